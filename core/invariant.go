package core

import "fmt"

// This file is the batch-invariant planner (Shape.BatchInvariant): a plan
// in which a sequence's splits, the tiles each reads, their merge and the
// kernels that run depend on its own length and the layout only, so that
// its output bits are the same alone, in any batch and on any GPU
// (kernels/balance.cuh fd_invariant_splits works the counts out on the
// device). docs/tuning.md gives the constants' story.

// The tile budget of a split (invariantTiles).
const (
	invariantSplitBytes = 256 << 10 // fewest cache bytes (K and V) a split reads
	invariantRowKeys    = 64        // fewest keys a split reads per packed query row a block
)

// invariantTiles is the key tiles a split of a batch-invariant plan of s
// run by v reads: enough for invariantSplitBytes of K and V, and for
// invariantRowKeys keys per packed row of a block, so that its partials
// (written and read back) stay near 1/32 of its bytes. From the layout
// only. Head dim 128, fp16, 8 rows: max(256 KiB / 512 B, 64 * 8) = 512
// keys, 8 tiles of 64.
func invariantTiles(s Shape, v Variant) int {
	keyBytes := 2 * s.HeadDim * s.CacheDType().Size()
	rows := min(s.HeadsQ/s.HeadsKV*s.SeqlenQ, v.Rows)
	keys := max(ceilDiv(invariantSplitBytes, keyBytes), invariantRowKeys*rows)
	return max(1, ceilDiv(keys, v.KeysPerTile))
}

// invariantSpanTiles is the most key tiles a sequence's rows see under a
// window of s (Shape.WindowKeys, unaligned to tiles: one more), 0 without.
func invariantSpanTiles(s Shape, v Variant) int {
	if s.WindowKeys <= 0 {
		return 0
	}
	return ceilDiv(s.WindowKeys, v.KeysPerTile) + 1
}

// invariantSplits is the split count of a sequence of tiles key tiles at
// perSplit tiles a split: ceil(tiles / perSplit), at least 1; a sequence
// of more than MaxSplits*perSplit tiles takes more tiles a split instead
// of more splits. kernels/balance.cuh fd_invariant_splits is the same rule.
func invariantSplits(tiles, perSplit int) int {
	per := max(perSplit, ceilDiv(tiles, MaxSplits))
	return max(1, ceilDiv(tiles, per))
}

// planInvariant plans s batch-invariantly for v: the grid (most splits,
// K/V heads x row tiles, batch) with most = the split count of the
// longest length the plan is sized for, every sequence splitting by its
// own length on the device, the blocks past its count exiting; the
// combine's balanced twin merges a sequence's splits, always the 4-warp
// combine (its order of merging depends on the count only), and a
// sequence of one split is written by stage 1, in any plan.
func planInvariant(s Shape, v Variant, d Device) (Plan, error) {
	if s.NumSplits != 0 {
		return Plan{}, invalid(planOp, "num_splits", fmt.Sprintf("%d with batch_invariant; must be 0: the split count comes from each sequence's own length", s.NumSplits))
	}
	rowTiles, err := rowTilesOf(s, v)
	if err != nil {
		return Plan{}, err
	}
	per, span := invariantTiles(s, v), invariantSpanTiles(s, v)
	tiles := ceilDiv(s.plannedKeys(), v.KeysPerTile)
	if span > 0 { // plannedKeys counts the window's keys; the device counts its tiles
		tiles = min(tiles+1, span)
	}
	most := max(1, min(MaxSplits, ceilDiv(tiles, per)))
	p := newPlan(s, v, d, MergeNone, most, rowTiles)
	p.InvariantTiles, p.InvariantSpanTiles = per, span
	if most > 1 {
		p.Merge = MergeInvariant
		p.Combine, p.CombineThreads, p.CombineRows = BalancedCombine(v.Combine), v.CombineThreads, v.CombineRows
		p.CombineGrid = ceilDiv(s.Batch*s.HeadsQ*s.SeqlenQ, v.CombineRows)
	}
	if err := p.finish(s, v); err != nil {
		return Plan{}, err
	}
	return p, nil
}

// InvariantSplitCounts is the split count each sequence of s takes under
// the batch-invariant plan p for the given lengths (cache_seqlens, before
// the new tokens), as kernels/balance.cuh works it out: from each length
// alone, at most p.NumSplits. nil where p is not batch-invariant or
// len(lengths) != s.Batch.
func (p Plan) InvariantSplitCounts(s Shape, lengths []int) []int {
	if p.InvariantTiles == 0 || len(lengths) != s.Batch {
		return nil
	}
	counts := make([]int, len(lengths))
	for b, n := range lengths {
		n = min(max(min(n, s.SeqlenCache-s.SeqlenNew)+s.SeqlenNew, 0), s.SeqlenCache)
		tiles := ceilDiv(n, p.Variant.KeysPerTile)
		if p.InvariantSpanTiles > 0 {
			tiles = min(tiles, p.InvariantSpanTiles)
		}
		counts[b] = min(invariantSplits(tiles, p.InvariantTiles), p.NumSplits)
	}
	return counts
}
