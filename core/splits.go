package core

// MaxSplits is the most splits of one sequence's keys the planner makes or
// accepts: the combine reads every split of a row, and beyond 128 splits the
// partials cost more memory traffic than a split saves on any cache the
// heuristic would split that finely.
const MaxSplits = 128

// Split heuristic constants (see autoSplits).
const (
	// minSplitKeys is the fewest keys a split gets from the automatic
	// heuristic: one 64-key tile at head dim 128. A split of a block with r
	// packed rows writes r*d fp32 partial outputs and the combine reads them
	// back (8*r*d bytes) while it reads 4*keys*d bytes of fp16/bf16 K and V,
	// so minKeysPerSplit also asks for 16*r keys, which keeps that extra
	// traffic at or below 1/8. The combine's own cost grows with the splits
	// and is in the cost model (combineRoundCost) rather than in this floor.
	// Measured on the H200 (b=1, 32/8 heads, d128): 1024 keys run in 7.4 us
	// with 16 splits of 64 keys, 8.0 us with 4 of 256, 10.2 us with 2 of 512.
	minSplitKeys = 64
	// combineRoundCost is what one round of the combine costs in the
	// half-tile units of splitCost: one L2 round trip of a combine block
	// (combineRounds), about 2.5 tile loads of a slot. Fitted on the H200,
	// MQA 8/1, b=1, 16384 keys: 11.3, 10.5 and 12.3 us with 32, 64 and 128
	// splits, when the combine had 4 warps only.
	combineRoundCost = 5
	// combineLaunchCost is the fixed cost of the combine kernel: a second
	// launch (partly hidden by programmatic dependent launch) and one L2
	// round trip before its first load.
	combineLaunchCost = 4
	// clusterMergeCost is what merging the splits inside stage 1 costs (a
	// cluster launch, see Device.Clusters): one cluster barrier, each
	// block's pushes into its peers' shared memory, and every block of a
	// cluster held until the slowest is done. Fitted on the H200 (b=1, d128,
	// since the push sends only real rows; it was 6 with the pull merge):
	// 32/8 heads, 256 keys: 4.4 us in 4 splits merged in clusters, 5.0
	// unsplit; 1024 keys: 5.4 us in clusters of 8, 7.4 with 16 splits and
	// the combine; 4096 keys: 9.3 in clusters of 8, 10.2-10.3 with 13 or 16
	// splits and the combine; 48/48 heads, 256 keys: 5.6 unsplit, 5.9 in
	// clusters of 2 (a cost of 2 would pick the clusters there).
	clusterMergeCost = 3
	// pairMergeCost is what merging in pairs (mergePairs) costs: less than
	// the combine (combineLaunchCost + one round, 9), as measured, but more
	// than clusterMergeCost: besides the barrier, a block of a pair that
	// runs in a later wave than its partner holds the partner's SM. Every
	// value from 7 to 9 keeps each sweep of plan_sweep_test.go within 5% of
	// its best; 3 to 6 pick 2 splits over 3 where 3 run 10-14% faster (b=3,
	// 48/48 heads, 1024 keys; head dim 64, b=20, 4096 keys).
	pairMergeCost = 8
	// clusterMaxTiles: splits of more than this many tiles merge in
	// clusters only when, besides, the split grid is one block on 80-100%
	// of the SMs (busySlotsPct) and a split is at most clusterLongMaxTiles.
	// Long splits with SMs to spare streamed slower in clusters than the
	// combine costs, likely because a cluster's blocks sit on neighbouring
	// SMs (a cluster of two on the two SMs of one TPC, which share a path
	// to memory) where a plain launch of fewer blocks than SMs spreads them
	// out. H200, 2 splits of 64 tiles: 32/8 heads, b=8 (128 blocks) 62.9-
	// 63.5 us in clusters of 2, 64.8 with the combine; 48/48 heads, b=1
	// (96 blocks) 57.7 in clusters, 52.5 with the combine. At two blocks
	// per SM (head dim 256, b=16, 256 blocks of 32 tiles) clusters lost too:
	// 71.2-71.6 against 69.8 us.
	clusterMaxTiles = 16
	// clusterLongMaxTiles caps the splits that merge in clusters when the
	// grid fills the SMs: the combine's fixed cost, which a cluster saves,
	// matters little against a long stream, and at 512 tiles (b=8, 32/8,
	// 65536 keys) clusters took 469-471 us against 467 with the combine.
	clusterLongMaxTiles = 64
	// blockCost is what stage 1 costs besides its tiles, in the same units,
	// once per launch (splitCost: the blocks of a later wave ramp up while
	// others still stream): the pipelines' ramp-up and drain, loading Q,
	// the merge of the warps and the write of the rows, and the bandwidth
	// a wave of short blocks loses to its uneven end. It was fitted as the
	// cost of every wave, when the model had one wave per slot-full of
	// blocks: with 48 heads, 8192 keys, b=1 (48 blocks unsplit) 2 splits
	// run in 52 us and 4 to 8 in 55-65 us, which a model of tiles alone
	// ranks the other way round. Fitted, with clusterMergeCost and
	// clusterMaxTiles, to a sweep of num_splits over 15 shapes on the H200:
	// the choice is within 2% of the sweep's best on each.
	blockCost = 24
	// hbmSlotsPct caps a grid of more blocks than slots: HBM streams as
	// fast as this percentage of the slots each streaming one block alone.
	// Fitted on the H200: a lone 4-warp block (head dim 128) streams 1.66
	// tiles/us (b=1, 32/8 heads, 32768 keys unsplit: 512 tiles in 310.9
	// us), and the split sweeps of more blocks than SMs that HBM bounds
	// streamed 134-140 tiles/us besides blockCost and the combine (48/48
	// heads, 4 splits: b=4, 8192 keys, 185.9 us; b=6, 4096 keys, 147.0; 3
	// splits at b=3, 4096 keys, 76.0; 32/8 heads, b=20, 2048 keys, 3
	// splits: 47.5): about 82 lone blocks, 62% of 132. A lone 2-warp block
	// (head dim 256, two slots per SM) streams 0.74 tiles/us (b=1, 32/8,
	// 32768 keys: 1024 tiles in 1379.8 us), so HBM is about 184 of its 264
	// slots, 70% (that kernel has 4 warps now). 66 lies between. With
	// sharedSlotPct at 120 (the tenth session), every value from 58 to 75
	// keeps each of the 58 sweeps of plan_sweep_test.go within 5% of its
	// best, and 78 misses two (b=12, 32768 keys; 48/48, b=6, 1024 keys): a
	// loose fit, which the sweep test guards.
	hbmSlotsPct = 66
	// sharedSlotPct: an SM holding two blocks for one slot (a grid of more
	// blocks than slots, all started at once) streams the two at this
	// percentage of one lone block's rate in all, so it ends last, with
	// twice the tiles. Measured on the H200 (kernels/trace/trace.cu, 48/48
	// heads, b=3, 4096 keys unsplit: 144 blocks of 64 tiles): the 12-14
	// SMs holding two streamed their 128 tiles in 65 us, 1.97 tiles/us
	// against a lone block's 1.66, while the rest of the grid held HBM
	// busy. Every value from 100 up keeps each sweep of plan_sweep_test.go
	// within 5% of its best; 90 and below pick splits where the unsplit
	// grid wins by 6-19% (b=3, 48/48, 1024 keys: 21.2 us unsplit, 25.3 in
	// 3 splits). It was 75, fitted to grids whose blocks had been placed
	// two to an SM on half the SMs by the previous call's early
	// programmatic launch (Plan.EarlyDependents): 48/48, b=3, 4096 keys
	// then ran in 106.9 us unsplit.
	sharedSlotPct = 120
	// splitTolerancePct: among split counts whose modelled time is within
	// this many percent of the best, the smallest wins (fewer partials, a
	// cheaper combine).
	splitTolerancePct = 5
	// busySlotsPct: with at least this share of the block slots streaming
	// without splitting, in one wave (no more blocks than slots), HBM is
	// close to saturated (bandwidth is shared by the whole GPU, not owned
	// per slot), so the cost model's promised gain of under 1/4 would
	// mostly not materialize and would not pay for the partials and the
	// combine launch.
	busySlotsPct = 80
	// targetWarpsPerSM is how many resident stage-1 warps per SM the
	// heuristic fills, in whole blocks: one block of 4 or more warps (every
	// compiled kernel). A block's 3-stage cp.async pipeline keeps 64 KiB of
	// K/V in flight, enough on its own to cover HBM latency, while every
	// extra split costs partial traffic and combine work. Measured on the
	// H200 (b=1, 32/8 heads, 32768 keys, fp16): at d128 stage 1 streams 3.84
	// TB/s with 16 splits (one block per SM) and 3.79 TB/s with 33 (two),
	// and stage 1 + combine 3.24 against 2.89 TB/s; at d256, 68.1 us with 16
	// splits against 70.2-70.8 with 31-33. (When the d256 kernel had 2
	// warps, one block per SM left them stalled on fixed-latency
	// dependencies, and two blocks were better.)
	targetWarpsPerSM = 4
)

// minKeysPerSplit is the fewest keys the heuristic gives one split when a
// block holds rows packed query rows: max(minSplitKeys, 16*rows), which
// keeps partial traffic (8*rows*d bytes) within 1/8 of the K/V bytes
// (4*keys*d) the split reads.
func minKeysPerSplit(rows int) int { return max(minSplitKeys, 16*rows) }

// maxAutoSplits is the most splits the heuristic considers for a length of
// tiles key tiles when a split must hold at least minTiles of them:
// min(MaxSplits, tiles/minTiles), and at least 1.
func maxAutoSplits(tiles, minTiles int) int {
	return max(1, min(MaxSplits, tiles/max(minTiles, 1)))
}

// clampSplits is what a requested split count n > 0 becomes:
// n clamped to [1, min(MaxSplits, tiles)].
func clampSplits(n, tiles int) int {
	return max(1, min(n, MaxSplits, tiles))
}

// merge is how the splits of a plan are merged.
type merge int

const (
	// mergeCombine: by the combine kernel, a second launch that reads the
	// fp32 partials back (Plan.Combine).
	mergeCombine merge = iota
	// mergeCluster: inside stage 1, in clusters of n blocks that all run
	// at once, one block per SM (Plan.Cluster, Variant.ClusterSharedBytes).
	mergeCluster
	// mergePairs: inside stage 1, in clusters of 2 in a grid of more
	// blocks than SMs, launched at two blocks per SM like a plain grid
	// (Variant.ClusterDenseSharedBytes), so that their waves are the plain
	// grid's minus the combine. Measured on the H200 against 2 splits and
	// the combine, 13 shapes of 128-288 blocks unsplit, all faster by 1-10%
	// (µs, combine -> pairs): 32/8 heads, b=16, 1024 keys 22.1 -> 20.0,
	// b=32, 1024 keys 41.2 -> 37.9, b=20, 2048 keys 51.5 -> 49.1, b=24,
	// 4096 keys 102.5 -> 99.6, b=20, 8192 keys 179.2 -> 177.3; 48/48
	// heads, b=4, 2048 keys 54.2 -> 53.0, b=3, 4096 keys 90.5 -> 88.8,
	// b=8, 4096 keys, seqlen_q 10, 201.7 -> 189.9. Clusters of 3 and 4 in
	// such grids were as often slower as faster (b=20, 2048 keys, 3 splits
	// 47.4 -> 50.4; b=3, 48/48, 4096 keys 75.9 -> 73.5), so they keep the
	// combine.
	mergePairs
)

// splitCost models the time of a decode, in half key-tile loads of one
// block streaming alone, when blocks (batch x K/V heads x row tiles) are each
// split n ways: g = blocks*n blocks of t = ceil(tiles/n) tiles, on a GPU
// that streams slots blocks at one per slot (see targetBlocks) and holds
// resident blocks at once (its occupancy). Decode is memory-bound, so a
// block's time is the bytes it streams:
//
//   - g <= slots: each block streams alone in its slot, 2t + blockCost.
//     (HBM caps these too, from about hbmSlotsPct of the slots up, but the
//     cap comes gradually, and blockCost and the cluster constants were
//     fitted without it; a sharp cap would cost every count from 88 blocks
//     to 132 the same, and the tolerance would take the smallest, which no
//     sweep has timed: 11 splits at b=1, 32/8 heads, 32768 keys, where 8
//     (64 blocks) ran in 45.6 us and 16 (128) in 37.1.)
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
// at once (mergeCluster: one block per slot, plus clusterMergeCost), or in
// pairs among the grid's waves (mergePairs: the waves, plus
// pairMergeCost), else the combine kernel adds combineLaunchCost plus
// combineRoundCost per round trip (combineRounds).
func splitCost(blocks, slots, resident, tiles, n int, m merge) int {
	g, t := blocks*n, ceilDiv(tiles, n)
	// wave is the time of w blocks started at once, at most k per slot.
	wave := func(w, k int) int {
		busiest := 2 * t
		if k > 1 {
			busiest = ceilDiv(2*k*t*100, sharedSlotPct)
		}
		return max(busiest, ceilDiv(2*w*t*100, slots*hbmSlotsPct))
	}
	var cost int
	switch {
	case n > 1 && m == mergeCluster:
		return 2*t + blockCost + clusterMergeCost
	case g <= slots:
		cost = 2*t + blockCost
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
	case m == mergePairs:
		cost += pairMergeCost
	default:
		cost += combineLaunchCost + combineRoundCost*combineRounds(n)
	}
	return cost
}

// combineRounds is how many round trips to L2 the combine of n splits
// makes, as combineFor picks it for the compiled variants (all share
// combineThreads and combineWideThreads; TestCombineRounds checks): one
// for the 4-warp combine (up to 32 splits), else the 16-warp one's
// ceil(n / 128).
func combineRounds(n int) int {
	if n <= combineSplitsPerStep(combineThreads) {
		return 1
	}
	return ceilDiv(n, combineSplitsPerStep(combineWideThreads))
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
//   - else the n in [1, maxN] with the least splitCost, preferring the
//     smallest n within splitTolerancePct of it (fewer partials), which
//     favours whole waves and splits that divide the tiles evenly.
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
// end (85), + 24 + 9 = 252; 2 splits cost 291 (24 blocks of 32 tiles left
// alone at the end), 4 cost 259: unsplit (H200: 71.4 us unsplit, 87.7,
// 74.4 and 79.0 in 2, 3 and 4). With batch 6 (288 blocks, more than
// resident) autoSplits is not asked: planVariant keeps 264 items whole and
// splits the other 24 in 11 (tailSplit; 140.7-141.7 us against 165.5
// unsplit and 145.4 in 3 splits).
func autoSplits(blocks, slots, resident, tiles, maxN int, merging func(n int) merge) int {
	if maxN <= 1 || (blocks*100 >= slots*busySlotsPct && blocks <= slots) {
		return 1
	}
	costs := make([]int, maxN+1)
	best := splitCost(blocks, slots, resident, tiles, 1, mergeCombine)
	for n := 1; n <= maxN; n++ {
		costs[n] = splitCost(blocks, slots, resident, tiles, n, merging(n))
		best = min(best, costs[n])
	}
	for n := 1; n <= maxN; n++ {
		if costs[n]*100 <= best*(100+splitTolerancePct) {
			return n
		}
	}
	return 1 // unreachable: the best cost itself qualifies
}

// targetBlocks is how many resident blocks of v per SM the heuristic fills:
// enough for targetWarpsPerSM warps, at least one, at most blocksPerSM.
func targetBlocks(v Variant, blocksPerSM int) int {
	warps := max(1, ceilDiv(v.Threads, 32))
	return max(1, min(blocksPerSM, ceilDiv(targetWarpsPerSM, warps)))
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
// SMs streaming alone (kernels/trace/trace.cu, 48/48 heads, b=8, 4096 keys
// unsplit: 41 SMs held 4 of the 384 blocks and 53 held 2; the last 60 us
// of 191 ran on 79 SMs). Split, the last wave's smaller blocks fill the
// slots as they free. H200, auto plans before (uniform splits) and with
// the tail split, two runs each in one call, us: 48/48 b=6, 4096 keys
// 148.5-148.6 (3 splits) -> 140.7-141.7 (264 whole, 24 items in 11); b=8
// 189.2-189.9 (unsplit) -> 185.4-186.0 (120 items in 2); b=6, 1024 keys
// 44.2-44.3 (2 in pairs) -> 42.9-43.4; 32/8 b=40,
// 2048 keys 85.9-86.4 -> 83.4-84.0, 8192 keys 314.6-315.4 -> 304.3-305.9,
// head dim 256 174.4-174.5 -> 158.6-159.4, head dim 64 85.8-86.0 ->
// 82.9-83.5; 48/48 b=8, 4096 keys, seqlen_q 10 192.3-192.9 -> 191.0-191.1.
func tailSplit(blocks, resident, maxN int) (whole, m int) {
	tail := blocks % resident
	if blocks <= resident || tail == 0 {
		return 0, 0
	}
	return blocks - tail, min(maxN, resident/tail)
}
