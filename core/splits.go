package core

// This file is the num_splits=0 heuristic: a cost model of one decode
// (splitCost) and the rules that pick a split count with it (autoSplits,
// tailSplit). docs/tuning.md gives each constant's measurement and range.

// MaxSplits is the most splits of one sequence the planner makes or accepts:
// beyond it the partials cost more traffic than a split saves.
const MaxSplits = 128

// The cost model's constants, in half key-tile loads of one block streaming
// alone (splitCost's unit) or in percent.
const (
	minSplitKeys         = 64       // fewest keys of a split: a 64-key tile at head dim 128
	minSplitRowKeys      = 4        // fewest keys of a split per packed query row
	minTailSplitRowKeys  = 16       // the same in a tail split, whose grid is already full
	floorlessSplits      = 8        // splits a sequence of that many tiles may always take
	combineRoundCost     = 5        // one L2 round trip of the combine
	combineLaunchCost    = 4        // the combine's launch and first round trip
	clusterMergeCost     = 3        // a cluster merge per 16 packed rows: barrier and pushes
	wideTileCost         = 3        // a tile of a block of more than 16 rows (16 rows: 2)
	pairMergeCost        = 8        // merging in pairs: a block may wait for its partner's wave
	clusterMaxTiles      = 16       // longest split that merges in clusters anywhere
	clusterLongMaxTiles  = 64       // longest split that merges in clusters where the grid fills the SMs
	blockCost            = 24       // stage 1 besides its tiles, once a launch
	hbmSlotsPct          = 66       // HBM streams a full grid as fast as this share of lone blocks
	sharedSlotPct        = 120      // two blocks sharing a slot stream this share of one's rate
	splitTolerancePct    = 5        // counts this close to the best cost: the smallest wins
	busySlotsPct         = 80       // an unsplit one-wave grid filling this share of slots stays unsplit
	balancedPartialBytes = 32 << 20 // the most partials a balanced plan adds to the workspace
)

// blockCosts is what one block of a variant costs in the model: a key tile
// of its stream, its share of a cluster merge, and the bytes of its key
// tile in percent of kvTileBytes (the share of HBM's time a tile takes).
type blockCosts struct{ tile, clusterMerge, bytesPct int }

// narrowBlock is the costs of a block of up to 16 packed rows of a 16-bit
// cache.
var narrowBlock = blockCosts{tile: 2, clusterMerge: clusterMergeCost, bytesPct: 100}

// kvTileBytes is the bytes of a key tile of K and V of a 16-bit cache
// (8192 elements each, see splitKVSharedBytes): the tile the costs are
// fitted to.
const kvTileBytes = 2 * 8192 * 2

// blockCostsOf gives v's block costs over a cache of dtype kv: a block of
// more than 16 rows runs at its register limit, so its tiles and its
// cluster merge cost more; a tile of fewer bytes (fp8) takes HBM's time in
// proportion, while a lone block's time a tile, its work and copies, stays.
func blockCostsOf(v Variant, kv DType) blockCosts {
	c := narrowBlock
	if v.Rows > 16 {
		c = blockCosts{tile: wideTileCost, clusterMerge: clusterMergeCost * ceilDiv(v.Rows, 16)}
	}
	c.bytesPct = 100 * v.KeysPerTile * v.HeadDim * 2 * kv.Size() / kvTileBytes
	return c
}

// autoSplits picks the split count of every item: 1 where the unsplit grid
// already fills busySlotsPct of one wave, else the n in [1, maxN] of least
// splitCost, preferring the smallest within splitTolerancePct unless that
// only lengthens a one-wave grid's splits (longerSplits). docs/tuning.md
// works an example. merging(n) is how n splits merge.
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

// longerSplits reports whether n splits only trade bestN's one-wave grid
// for fewer, longer splits merged the same way: the call lasts as long as
// its longest split.
func longerSplits(blocks, slots, tiles, n, bestN int, merges []Merge) bool {
	return n > 1 && blocks*bestN <= slots && merges[n] == merges[bestN] && ceilDiv(tiles, n) > ceilDiv(tiles, bestN)
}

// splitCost models a decode of blocks items split n ways (g = blocks*n
// blocks of t = ceil(tiles/n) tiles) on slots that each stream one block
// alone and resident blocks at once: a one-wave grid costs its busiest
// SM's stream (sharedSlotPct for two a slot) or its bytes at HBM's rate
// (hbmSlotsPct of the slots, for tiles of c.bytesPct), whichever is longer; more blocks than resident cost a
// wave each, the last alone or at HBM's rate. blockCost counts once, and
// the merge adds its cost (m: cluster, pairs or the combine's rounds).
func splitCost(blocks, slots, resident, tiles, n int, c blockCosts, m Merge) int {
	g, t := blocks*n, ceilDiv(tiles, n)
	// wave is the time of w blocks started at once, at most k per slot.
	wave := func(w, k int) int {
		busiest := c.tile * t
		if k > 1 {
			busiest = ceilDiv(c.tile*k*t*100, sharedSlotPct)
		}
		return max(busiest, ceilDiv(c.tile*w*t*c.bytesPct, slots*hbmSlotsPct))
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

// combineRounds is the L2 round trips of the combine of n splits that
// combineFor picks for the compiled variants (TestCombineRounds checks).
func combineRounds(n int) int {
	if n <= combineSplitsPerStep(combineThreads, 0) {
		return 1
	}
	return ceilDiv(n, combineSplitsPerStep(combineWideThreads, combineWideCols))
}

// tailSplit plans a grid of more items than the GPU holds at once: the full
// waves' items stay whole and each item of the partial last wave splits m
// ways (at most maxN) to fill the slots as they free; whole items there
// would land two to an SM on the SMs that free first. m < 2: no tail split.
func tailSplit(blocks, resident, maxN int) (whole, m int) {
	tail := blocks % resident
	if blocks <= resident || tail == 0 {
		return 0, 0
	}
	return blocks - tail, min(maxN, resident/tail)
}

// targetBlocks is the resident blocks of v an SM needs for targetWarpsPerSM
// warps, in [1, blocksPerSM].
func targetBlocks(v Variant, blocksPerSM int) int {
	warps := max(1, ceilDiv(v.Threads, 32))
	return max(1, min(blocksPerSM, ceilDiv(targetWarpsPerSM, warps)))
}

// minKeysPerSplit is the fewest keys of a split of a block of rows packed
// rows at rowKeys keys a row: its partials then stay a small share of its
// bytes.
func minKeysPerSplit(rows, rowKeys int) int { return max(minSplitKeys, rowKeys*rows) }

// rowKeysFor is a floor of keys a packed row (minSplitRowKeys,
// minTailSplitRowKeys), fitted to 16-bit caches, for a cache of dtype kv:
// as many bytes of K and V against a row's partials, so twice the keys of
// an fp8 cache.
func rowKeysFor(rowKeys int, kv DType) int { return rowKeys * 2 / kv.Size() }

// maxAutoSplits is the most splits the heuristic considers for a length of
// tiles key tiles when a split must hold at least minTiles of them:
// min(MaxSplits, tiles/minTiles), and at least 1.
func maxAutoSplits(tiles, minTiles int) int {
	return max(1, min(MaxSplits, tiles/max(minTiles, 1)))
}

// autoSplitCap is the most splits autoSplits considers: maxAutoSplits, but
// at least floorlessSplits for a sequence of that many tiles or more.
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

// BalancedSplitCounts is the split count each sequence of s takes under the
// balanced plan p for the given lengths, as kernels/balance.cuh works it
// out: its share of Batch*BalanceSplits by key tiles, in [1, NumSplits].
// nil where p does not balance or len(lengths) != s.Batch.
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
// splits balances them by the lengths on the device, or 0 where it does not
// (host lengths, one sequence, a window, or no more than n to gain): enough
// to fill the slots alone, within the key tiles, MaxSplits and
// balancedPartialBytes of partials. A long sequence among short ones then
// streams on more blocks than equal lengths would give it.
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
