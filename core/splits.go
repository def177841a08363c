package core

// This file is the num_splits=0 heuristic: a cost model of one decode
// (splitCost), fitted to split sweeps on an H200, and the rules that pick
// a split count with it (autoSplits, tailSplit). docs/tuning.md says what
// fixes each constant and how far it may move; core/testdata holds the
// sweeps, which TestPlanAgainstH200Sweeps checks the picks against.

// MaxSplits is the most splits of one sequence's keys the planner makes or
// accepts: the combine reads every split of a row, and beyond 128 splits the
// partials cost more memory traffic than a split saves on any cache the
// heuristic would split that finely.
const MaxSplits = 128

// The cost model's constants. Costs are in half key-tile loads of one block
// streaming alone (see splitCost).
const (
	// minSplitKeys is the fewest keys the heuristic gives a split: one
	// 64-key tile at head dim 128 (minKeysPerSplit adds a floor per row).
	minSplitKeys = 64
	// minSplitRowKeys is the fewest keys a split holds per packed query
	// row, and minTailSplitRowKeys the same in a tail split (tailSplit),
	// whose grid already holds more blocks than the GPU runs at once, so
	// that short splits there only add partials and the combine
	// (minKeysPerSplit).
	minSplitRowKeys     = 4
	minTailSplitRowKeys = 16
	// floorlessSplits is how many splits a sequence of at least that many
	// key tiles may always take, a tile or more each, whatever the per-row
	// floor (autoSplitCap): eight one-tile splits merged in a portable
	// cluster beat four of two tiles wherever the floor stopped at four.
	floorlessSplits = 8
	// combineRoundCost is one L2 round trip of the combine (combineRounds),
	// about 2.5 tile loads.
	combineRoundCost = 5
	// combineLaunchCost is the combine's fixed cost: a second launch, partly
	// hidden by programmatic dependent launch, and one L2 round trip before
	// its first load.
	combineLaunchCost = 4
	// clusterMergeCost is merging the splits inside stage 1 in clusters
	// (MergeCluster): a cluster barrier, each block's pushes into its peers'
	// shared memory, and every block held until its cluster's slowest ends;
	// per 16 packed rows a block merges (blockCostsOf).
	clusterMergeCost = 3
	// wideTileCost is a key tile of a block of more than 16 packed rows
	// (the 32-row variants, which run at their register limit), where a
	// 16-row block's tile costs 2: such a block streams a tile about 1.5
	// times as long (blockCostsOf).
	wideTileCost = 3
	// pairMergeCost is merging in pairs (MergePairs): more than
	// clusterMergeCost, since a block whose partner runs in a later wave
	// holds its SM until then, and less than the combine (9).
	pairMergeCost = 8
	// clusterMaxTiles is the longest split (in tiles) that merges in
	// clusters anywhere; longer ones do only where the split grid fills the
	// SMs (busySlotsPct), up to clusterLongMaxTiles. With SMs to spare a
	// plain launch spreads its blocks out, where a cluster's blocks share
	// neighbouring SMs' path to memory and long splits stream slower.
	clusterMaxTiles = 16
	// clusterLongMaxTiles caps the splits that merge in clusters when the
	// grid fills the SMs: against a long stream the combine's fixed cost,
	// which a cluster saves, no longer pays for the cluster's slower stream.
	clusterLongMaxTiles = 64
	// blockCost is what stage 1 costs besides its tiles, once per launch:
	// pipeline ramp-up and drain, loading Q, merging the warps, writing the
	// rows, and the bandwidth a wave of short blocks loses to its uneven end.
	blockCost = 24
	// hbmSlotsPct is how fast HBM streams a grid of more blocks than slots:
	// as fast as this percentage of the slots each streaming one block alone.
	hbmSlotsPct = 66
	// sharedSlotPct is how fast an SM streams two blocks held for one slot:
	// at this percentage of one lone block's rate for the two together.
	sharedSlotPct = 120
	// splitTolerancePct: among split counts whose modelled time is within
	// this many percent of the best, the smallest wins (fewer partials, a
	// cheaper combine), unless it only makes a one-wave grid's splits
	// longer (longerSplits).
	splitTolerancePct = 5
	// busySlotsPct: an unsplit grid of one wave that fills at least this
	// share of the block slots stays unsplit. HBM is then close to saturated
	// (bandwidth is shared by the whole GPU, not owned per slot), so the gain
	// the model promises, under 1/4, would not pay for partials and a combine.
	busySlotsPct = 80
	// balancedPartialBytes bounds the partials a balanced plan's most
	// splits a sequence (Plan.NumSplits) may add to the workspace, which
	// holds that many for every row: a large batch keeps a few MiB a split.
	balancedPartialBytes = 32 << 20
)

// blockCosts is what one block of a variant costs in the model: a key tile
// of its stream, and its share of a cluster merge.
type blockCosts struct{ tile, clusterMerge int }

// narrowBlock is the costs of a block of up to 16 packed rows, the unit the
// model's other constants are fitted in.
var narrowBlock = blockCosts{tile: 2, clusterMerge: clusterMergeCost}

// blockCostsOf gives v's block costs: narrowBlock up to 16 rows; beyond,
// wideTileCost a tile and clusterMergeCost per 16 rows merged.
func blockCostsOf(v Variant) blockCosts {
	if v.Rows <= 16 {
		return narrowBlock
	}
	return blockCosts{tile: wideTileCost, clusterMerge: clusterMergeCost * ceilDiv(v.Rows, 16)}
}

// autoSplits is the num_splits=0 heuristic. Decode streams the whole K/V
// cache once and is memory-bound; its unsplit grid has only blocks =
// batch x K/V heads x row tiles blocks, often far fewer than the slots =
// SMs x blocks-per-SM the GPU can keep streaming. Splitting each sequence's
// keys n ways gives every slot a part of the cache, at the cost of writing
// fp32 partials and a combine launch. So:
//
//   - blocks in 80-100% of slots (one nearly full wave already;
//     busySlotsPct) or maxN <= 1: 1 split;
//   - else the n in [1, maxN] with the least splitCost (with block costs
//     c), preferring the smallest n within splitTolerancePct of it (fewer
//     partials), which favours whole waves and splits that divide the
//     tiles evenly, but never one that only makes a one-wave grid's splits
//     longer (longerSplits).
//
// (planVariant passes slots = SMs x targetBlocks: one block per SM for the
// kernels of 4 or more warps, and resident = SMs x blocks per SM.)
//
// Worked example, on an H200: batch 1, 32 query and 8 K/V heads (one row
// tile of 4 rows), 32768 keys in tiles of 64 (512 tiles), 132 SMs x 1 block
// = 132 slots. blocks = 8; a split holds >= 64 keys = 1 tile, so maxN =
// 128. No split of at most 16 tiles fits a cluster of at most 16, so the
// combine kernel merges: 16 splits make 128 blocks, one per slot, 2*32 +
// 24 + 4 + 5 = 97; 32 make 256 blocks, two on most SMs, which HBM holds
// to 2*256*16*100/(132*66) = 95 (the busiest SM alone: 2*2*16*100/120 =
// 54), + 24 + 9 = 128; 128 take three waves of the 264 resident and a
// partial fourth (130); 1 split costs 1048. The least cost is 16: grid
// (16, 8, 1), 128 of 132 SMs busy, 2048 keys each, then the combine. With
// batch 16 (128 blocks, 80-100% of 132) it is 1. With 1024 keys (16
// tiles), 8 splits in clusters of 8 cost 4 + 24 + 3 = 31, 16 with the
// combine 2 + 24 + 9 = 35, 1 split 32 + 24 = 56: 8 splits, merged inside
// stage 1; with 4096 keys (64 tiles) 16 splits and the combine cost 41, 8
// in clusters 16 + 24 + 3 = 43, within 5%: 8 in clusters.
//
// More blocks than slots all start at once, and HBM bounds them: batch 3
// with 48 query and K/V heads and 4096 keys (144 blocks of 64 tiles on the
// 132 slots, 264 resident) leaves 12 SMs two blocks, which stream at 120%
// of one's rate, 2*2*64*100/120 = 214, against HBM's 2*144*64*100/(132*66)
// = 212, + 24 = 238. Split 3 ways, 432 blocks run one full wave at HBM's
// rate (2*264*22*100/(132*66) = 134) and 168 more that start as the first
// end (85), + 24 + 9 = 252; 2 splits, merged in pairs, cost 290 (24 blocks
// of 32 tiles left alone at the end), 4 cost 259: unsplit. With batch 6
// (288 blocks, more than resident) autoSplits is not asked: planVariant
// keeps 264 items whole and splits the other 24 in 11 (tailSplit).
func autoSplits(blocks, slots, resident, tiles, maxN int, c blockCosts, merging func(n int) Merge) int {
	if maxN <= 1 || (blocks*100 >= slots*busySlotsPct && blocks <= slots) {
		return 1
	}
	costs, merges := make([]int, maxN+1), make([]Merge, maxN+1)
	bestN := 1
	for n := 1; n <= maxN; n++ {
		merges[n] = merging(n)
		costs[n] = splitCost(blocks, slots, resident, tiles, n, c, merges[n])
		if costs[n] < costs[bestN] {
			bestN = n
		}
	}
	best := costs[bestN]
	for n := 1; n <= maxN; n++ {
		if costs[n]*100 <= best*(100+splitTolerancePct) && !longerSplits(blocks, slots, tiles, n, bestN, merges) {
			return n
		}
	}
	return bestN
}

// longerSplits reports whether n splits would only trade bestN's for fewer,
// longer ones: both merge the same way, bestN's blocks each have a slot
// (one wave), and n's splits hold more tiles. Such a call lasts as long as
// its longest split, and n's fewer partials do not make up for a whole tile
// more (docs/tuning.md, splitTolerancePct, has the sweeps). merges[n] is
// how n splits merge.
func longerSplits(blocks, slots, tiles, n, bestN int, merges []Merge) bool {
	return n > 1 && blocks*bestN <= slots && merges[n] == merges[bestN] && ceilDiv(tiles, n) > ceilDiv(tiles, bestN)
}

// splitCost models the time of a decode, in half key-tile loads of one
// block streaming alone, when blocks (batch x K/V heads x row tiles) are each
// split n ways: g = blocks*n blocks of t = ceil(tiles/n) tiles, on a GPU
// that streams slots blocks at one per slot (see targetBlocks) and holds
// resident blocks at once (its occupancy). Decode is memory-bound, so a
// block's time is the bytes it streams, c.tile per tile (2 for a block of
// up to 16 rows; the formulas below write that case):
//
//   - g <= slots: each block streams alone in its slot, 2t + blockCost.
//     (HBM caps these too from about hbmSlotsPct of the slots up, but
//     gradually: a sharp cap would cost every count from 88 blocks to 132
//     the same, and the tolerance would then take the smallest, which
//     streams slower.)
//   - slots < g <= resident: one wave, every block started at once. The
//     busiest SM holds k = ceil(g/slots) blocks for a slot and streams them
//     at sharedSlotPct of one block's rate, and all g*t tiles stream no
//     faster than HBM (hbmSlotsPct of the slots): the larger of
//     2kt*100/sharedSlotPct and 2gt*100/(slots*hbmSlotsPct), + blockCost.
//   - g > resident: waves of resident blocks, each costed the same way,
//     except the last, partial one, which takes the larger of one block
//     alone (2t) and its tiles at HBM's rate: its blocks start as earlier
//     ones end. (Optimistic: whole blocks of a last wave land two to an SM
//     on the SMs that free first, which is why a grid of more items than
//     resident takes tailSplit instead, when its last wave is partial.)
//     blockCost is counted once: the blocks of a later wave ramp up while
//     others still stream.
//
// With n > 1 the splits merge (m) inside stage 1 in clusters that all run
// at once (MergeCluster: one block per slot, plus c.clusterMerge), or in
// pairs among the grid's waves (MergePairs: the waves, plus
// pairMergeCost), else the combine kernel adds combineLaunchCost plus
// combineRoundCost per round trip (combineRounds).
func splitCost(blocks, slots, resident, tiles, n int, c blockCosts, m Merge) int {
	g, t := blocks*n, ceilDiv(tiles, n)
	// wave is the time of w blocks started at once, at most k per slot.
	wave := func(w, k int) int {
		busiest := c.tile * t
		if k > 1 {
			busiest = ceilDiv(c.tile*k*t*100, sharedSlotPct)
		}
		return max(busiest, ceilDiv(c.tile*w*t*100, slots*hbmSlotsPct))
	}
	var cost int
	switch {
	case n > 1 && m == MergeCluster:
		return c.tile*t + blockCost + c.clusterMerge
	case g <= slots:
		cost = c.tile*t + blockCost
	case g <= resident:
		cost = wave(g, ceilDiv(g, slots)) + blockCost
	default:
		cost = g/resident*wave(resident, ceilDiv(resident, slots)) + blockCost
		if last := g % resident; last > 0 {
			cost += wave(last, 1)
		}
	}
	switch {
	case n == 1:
	case m == MergePairs:
		cost += pairMergeCost
	default:
		cost += combineLaunchCost + combineRoundCost*combineRounds(n)
	}
	return cost
}

// combineRounds is how many round trips to L2 the combine of n splits
// makes, as combineFor picks it for the compiled variants (all share
// combineThreads, combineWideThreads and combineWideCols; TestCombineRounds
// checks): one for the narrow and the 4-warp combines (up to 8 and 32
// splits), else the column-group one's ceil(n / 128).
func combineRounds(n int) int {
	if n <= combineSplitsPerStep(combineThreads, 0) {
		return 1
	}
	return ceilDiv(n, combineSplitsPerStep(combineWideThreads, combineWideCols))
}

// tailSplit is the num_splits=0 plan of a grid of more items (blocks
// unsplit) than the GPU holds at once (resident): the items of the full
// waves stay whole, and each item of the last, partial wave splits m ways,
// m = resident / (its items), at most maxN, so that its blocks fill one
// wave's slots. It returns the whole items and m, or m < 2 where there is
// no partial wave or it is nearly full.
//
// Why: the block scheduler gives each slot that frees the next block, so
// whole items of a partial wave land two to an SM on the SMs whose first
// blocks ended first and none on the rest, and the call ends with a few
// SMs streaming alone. Split, the last wave's smaller blocks fill the
// slots as they free.
func tailSplit(blocks, resident, maxN int) (whole, m int) {
	tail := blocks % resident
	if blocks <= resident || tail == 0 {
		return 0, 0
	}
	return blocks - tail, min(maxN, resident/tail)
}

// targetBlocks is how many resident blocks of v per SM the heuristic fills:
// enough for targetWarpsPerSM warps, at least one, at most blocksPerSM.
// (planVariant gives a serving variant that only for a plan that merges in
// clusters, else every slot: see there.)
func targetBlocks(v Variant, blocksPerSM int) int {
	warps := max(1, ceilDiv(v.Threads, 32))
	return max(1, min(blocksPerSM, ceilDiv(targetWarpsPerSM, warps)))
}

// minKeysPerSplit is the fewest keys the heuristic gives one split when a
// block holds rows packed query rows and a split rowKeys keys a row
// (minSplitRowKeys, minTailSplitRowKeys): max(minSplitKeys, rowKeys*rows).
// A split writes rows*d fp32 partials that the combine reads back (8*rows*d
// bytes) while it reads 4*keys*d bytes of K and V: at 4 keys a row the
// partials are at most half as many bytes, and they go through L2, not HBM
// (docs/tuning.md, minSplitRowKeys, has the sweeps).
func minKeysPerSplit(rows, rowKeys int) int { return max(minSplitKeys, rowKeys*rows) }

// maxAutoSplits is the most splits the heuristic considers for a length of
// tiles key tiles when a split must hold at least minTiles of them:
// min(MaxSplits, tiles/minTiles), and at least 1.
func maxAutoSplits(tiles, minTiles int) int {
	return max(1, min(MaxSplits, tiles/max(minTiles, 1)))
}

// autoSplitCap is the most splits autoSplits considers: maxAutoSplits, but
// at least floorlessSplits for a sequence of that many tiles or more. (A
// shorter one keeps the floor: at 32 packed rows, four one-tile splits and
// their merge ran slower than one block of four tiles.)
func autoSplitCap(tiles, minTiles int) int {
	n := maxAutoSplits(tiles, minTiles)
	if tiles >= floorlessSplits {
		n = max(n, floorlessSplits)
	}
	return n
}

// clampSplits is what a requested split count n > 0 becomes:
// n clamped to [1, min(MaxSplits, tiles)].
func clampSplits(n, tiles int) int {
	return max(1, min(n, MaxSplits, tiles))
}

// BalancedSplitCounts is the split count each sequence of s takes under a
// balanced plan p (Plan.BalanceSplits > 0) when cache_seqlens holds the
// given lengths, one a sequence: what kernels/balance.cuh works out on the
// device, shown on the host. A sequence's key tiles count its appended
// tokens, clamped to the cache; its count is its share of the
// BalanceSplits * Batch splits equal lengths take, rounded up, at least 1
// and at most NumSplits. It is nil for a plan that does not balance, whose
// sequences all take NumSplits, and for len(lengths) != s.Batch.
func (p Plan) BalancedSplitCounts(s Shape, lengths []int) []int {
	if p.BalanceSplits == 0 || len(lengths) != s.Batch {
		return nil
	}
	tiles := make([]int, len(lengths))
	total := 0
	for b, n := range lengths {
		n = min(max(n+s.SeqlenNew, 0), s.SeqlenCache)
		tiles[b] = ceilDiv(n, p.Variant.KeysPerTile)
		total += tiles[b]
	}
	counts := make([]int, len(lengths))
	for b, t := range tiles {
		counts[b] = 1
		if total > 0 {
			counts[b] = min(max(ceilDiv(p.BalanceSplits*s.Batch*t, total), 1), p.NumSplits)
		}
	}
	return counts
}

// balancedSplits is the most splits one sequence may take when a plan of n
// splits for equal lengths (1 included) balances them by the lengths on
// the device (Plan.BalanceSplits), or 0 where it does not: the lengths
// come as a device array (Shape.DeviceLengths), there are two sequences or
// more, and no window bounds a row's keys. A sequence may take enough
// splits to fill the planned slots alone (items of it a split each), and
// no more than the plan's key tiles, MaxSplits, or what keeps the
// partials of its rows (rowBytes a split) within balancedPartialBytes.
// Where that is no more than n, no sequence could take more splits than
// equal lengths give it, so balancing could only cost (a grid of n + 1
// blocks an item, a combine where n is 1): 0.
//
// Why: the planner never reads the lengths, so a plain plan gives every
// sequence n splits, and a batch of one long sequence among short ones
// streams the long one on n blocks of each of its items while the others
// end early (BENCHMARKS.md, "Ragged batches"). The kernels instead size
// each sequence's splits from the total of the lengths (balance.cuh).
func balancedSplits(s Shape, n, items, slots, tiles, rowBytes int) int {
	if !s.DeviceLengths || s.Batch < 2 || s.WindowKeys > 0 {
		return 0
	}
	most := min(MaxSplits, tiles, ceilDiv(slots, max(items, 1)), balancedPartialBytes/max(rowBytes, 1))
	if most <= n {
		return 0
	}
	return most
}
