package core

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// testVariant is a fixed stage-1 variant, so the planner is tested without
// the kernel author's table (variants.go).
var testVariant = Variant{
	Kernel: "fd_split_kv_f16_d128_r16", Combine: "fd_combine_f16", DType: Float16,
	HeadDim: 128, Rows: 16, Threads: 128, KeysPerTile: 64, SharedBytes: 32768,
	ClusterSharedBytes: 122880, CombineThreads: 128, CombineRows: 4,
	CombineWide: "fd_combine_f16_c32", CombineWideThreads: 128, CombineWideCols: 32,
}

// twoPerSM is a device of 132 SMs holding 2 blocks of any variant per SM,
// without clusters (the combine kernel merges every split), and clustered
// the same with clusters of up to 16 (an H200).
var (
	twoPerSM  = Device{SMs: 132, Occupancy: func(Variant) int { return 2 }}
	clustered = Device{SMs: 132, Occupancy: func(Variant) int { return 2 }, Clusters: clustersUpTo(16, 1000)}
)

// clustersUpTo is a ClusterOccupancy of n clusters of every size up to max.
func clustersUpTo(max, n int) ClusterOccupancy {
	return func(_ Variant, size int) int {
		if size > max {
			return 0
		}
		return n
	}
}

// fusedUpTo is autoSplits' merging for clusters (that all run at once) of
// up to mc splits, and the combine beyond.
func fusedUpTo(mc int) func(int) Merge {
	return func(n int) Merge {
		if n >= 2 && n <= mc {
			return MergeCluster
		}
		return MergeCombine
	}
}

func TestAutoSplits(t *testing.T) {
	tests := []struct {
		name                                   string
		blocks, slots, resident, tiles, mx, mc int
		want                                   int
	}{
		{"doc example: b=1, 8 kv heads, 32K keys", 8, 132, 264, 512, 128, 16, 16},
		{"doc example without clusters", 8, 132, 264, 512, 128, 1, 16},
		{"two blocks per SM: 32 even splits, not 31 of up to 17 tiles", 8, 264, 264, 512, 64, 16, 32},
		{"b=16: one wave of 256", 128, 264, 264, 512, 64, 1, 2},
		{"b=4", 32, 264, 264, 512, 64, 1, 8},
		{"b=5: 6 splits fill one wave", 40, 264, 264, 512, 64, 1, 6},
		{"24 blocks short of a wave", 240, 264, 264, 512, 64, 16, 1},
		{"just over 80% of a wave", 212, 264, 264, 512, 64, 16, 1},
		// Below 80% the cost model decides; from about hbmSlotsPct of the
		// slots up the grid is as fast as HBM unsplit, and more waves of
		// splits cannot beat it.
		{"just under 80% of a wave", 211, 264, 264, 512, 64, 1, 1},
		{"200 blocks", 200, 264, 264, 512, 64, 1, 1},
		{"100 blocks", 100, 264, 264, 512, 64, 1, 2},
		{"full wave", 264, 264, 264, 512, 64, 16, 1},
		// More blocks than slots (no clusters: that many never run at once).
		{"two full waves", 512, 264, 264, 512, 64, 1, 1},
		// More blocks than SMs, no more than resident: one wave, which HBM
		// bounds; the SMs given two blocks stream them faster than one.
		{"b=24, 4096 keys", 192, 132, 264, 64, 64, 1, 1},
		{"b=3, 48 heads, 4096 keys", 144, 132, 264, 64, 64, 1, 1},
		{"b=20, 2048 keys", 160, 132, 264, 32, 32, 1, 1},
		{"b=4, 48 heads, 2048 keys", 192, 132, 264, 32, 32, 1, 1},
		// More than resident: 24 blocks of 64 tiles would stream alone
		// after the first wave.
		{"b=6, 48 heads, 4096 keys", 288, 132, 264, 64, 64, 1, 3},
		{"b=32, 1024 keys: two nearly full waves", 256, 132, 264, 16, 16, 1, 1},
		{"b=8, 48 heads, 4096 keys: three", 384, 132, 264, 64, 64, 1, 1},
		{"1024 keys: at most 2", 8, 264, 264, 16, 2, 1, 2},
		{"1024 keys in clusters: one tile each", 8, 132, 264, 16, 16, 16, 16},
		{"4096 keys: limited by min chunk", 8, 264, 264, 64, 8, 1, 8},
		{"too short to split", 8, 264, 264, 5, 1, 16, 1},
		{"empty cache", 8, 264, 264, 0, 1, 16, 1},
		{"MQA 128K keys: cap, beyond a cluster", 1, 132, 264, 2048, 128, 16, 128},
		{"uneven tiles", 16, 132, 264, 100, 12, 1, 8},
		// Within the tolerance of 16 splits of 8 tiles, 15 would hold up to 9.
		{"b=1 8192 keys: 16 even splits, not 15", 8, 132, 264, 128, 128, 1, 16},
		// 256 keys: the combine does not pay for 3 saved tiles, a cluster
		// merge does.
		{"4 tiles, no clusters", 8, 132, 264, 4, 4, 1, 1},
		{"4 tiles in clusters", 8, 132, 264, 4, 4, 16, 4},
		// 48 MHA heads, 256 keys: not for 48 blocks in clusters of 2 (an
		// H200 runs 48 at once of 2, not of 4).
		{"4 tiles, 48 blocks in clusters of 2", 48, 132, 264, 4, 4, 2, 1},
		{"16 tiles in clusters of up to 8", 8, 132, 264, 16, 16, 8, 8},
	}
	for _, tt := range tests {
		got := autoSplits(tt.blocks, tt.slots, tt.resident, tt.tiles, tt.mx, narrowBlock, fusedUpTo(tt.mc))
		if got != tt.want {
			t.Errorf("%s: autoSplits(%d, %d, %d, %d, %d, %d) = %d, want %d", tt.name, tt.blocks, tt.slots, tt.resident, tt.tiles, tt.mx, tt.mc, got, tt.want)
		}
	}
}

// TestAutoSplitsProperties checks, over a grid of inputs, that the choice is
// in range and within the tolerance of the best modelled cost.
func TestAutoSplitsProperties(t *testing.T) {
	for _, blocks := range []int{1, 2, 3, 7, 8, 32, 100, 131, 263, 264, 1000} {
		for _, slots := range []int{108, 132, 264, 528} {
			for _, tiles := range []int{0, 1, 8, 9, 100, 512, 2048, 4096} {
				for _, mc := range []int{1, 8, 16} {
					mx := maxAutoSplits(tiles, 8)
					n := autoSplits(blocks, slots, 2*slots, tiles, mx, narrowBlock, fusedUpTo(mc))
					if n < 1 || n > mx || n > MaxSplits {
						t.Fatalf("autoSplits(%d,%d,%d,%d,%d) = %d out of [1,%d]", blocks, slots, tiles, mx, mc, n, mx)
					}
					oneWave := blocks*100 >= slots*busySlotsPct && blocks <= slots
					if oneWave && n != 1 {
						t.Fatalf("autoSplits(%d,%d,%d,%d,%d) = %d with a full wave", blocks, slots, tiles, mx, mc, n)
					}
					c := splitCost(blocks, slots, 2*slots, tiles, n, narrowBlock, fusedUpTo(mc)(n))
					optimize := !oneWave
					for m := 1; m <= mx && optimize; m++ {
						if best := splitCost(blocks, slots, 2*slots, tiles, m, narrowBlock, fusedUpTo(mc)(m)); c*100 > best*(100+splitTolerancePct) {
							t.Fatalf("autoSplits(%d,%d,%d,%d,%d) = %d costs %d; %d costs %d", blocks, slots, tiles, mx, mc, n, c, m, best)
						}
					}
				}
			}
		}
	}
}

// TestCombineRounds checks the cost model's round trips against the combine
// each compiled variant's plans launch (a warp loads combineUnroll splits of
// its row at once): the model assumes they all have the same three combines.
func TestCombineRounds(t *testing.T) {
	for _, v := range Variants() {
		for _, n := range []int{2, 8, 9, 16, 32, 33, 64, 128} {
			name, threads, rows := combineFor(v, n)
			cols := 0
			if name == v.CombineWide {
				cols = v.CombineWideCols
			}
			if want := ceilDiv(n, combineSplitsPerStep(threads/rows, cols)); combineRounds(n) != want {
				t.Errorf("%s, %d splits: combineRounds %d, its combine of %d threads and %d rows a block takes %d",
					v.Kernel, n, combineRounds(n), threads, rows, want)
			}
		}
	}
	for _, tt := range []struct{ n, want int }{{1, 1}, {32, 1}, {33, 1}, {128, 1}, {129, 2}} {
		if got := combineRounds(tt.n); got != tt.want {
			t.Errorf("combineRounds(%d) = %d, want %d", tt.n, got, tt.want)
		}
	}
}

func TestSplitHelpers(t *testing.T) {
	for _, tt := range []struct{ blocks, slots, resident, tiles, n, mc, want int }{
		// Up to one block per slot: 2 x tiles per split + 24, plus 3 for a
		// cluster merge, or 4 and 5 per round trip for the combine kernel
		// (one for up to 32 splits, else one per 128).
		{8, 264, 264, 512, 1, 16, 1048}, {8, 264, 264, 512, 16, 16, 91}, {8, 264, 264, 512, 16, 1, 97},
		{8, 264, 264, 512, 32, 16, 65}, {8, 264, 264, 512, 33, 16, 65},
		{1, 132, 264, 2048, 128, 16, 65}, {1, 132, 264, 2048, 129, 16, 70}, {1, 1, 1, 0, 1, 16, 24},
		// More than the resident blocks: each full wave streams its tiles at
		// HBM's rate (66% of the slots: 2*264*16*100/(264*66) -> 49), the
		// last partial one at least one block's 2t (272 blocks: 8 left, 32;
		// 512: 248 left, 23 > 16), and 24 once.
		{8, 264, 264, 512, 34, 16, 114}, {8, 264, 264, 512, 64, 16, 81},
		{200, 264, 264, 512, 9, 1, 1213},
		// Fused means every cluster runs at once: one wave whatever blocks.
		{200, 264, 264, 512, 9, 16, 141},
		// b=3, 48/48 heads, 4096 keys on an H200 (132 slots, 264 resident):
		// unsplit, 12 SMs hold two blocks of 64 tiles, streamed at 120% of
		// one's rate: 2*2*64*100/120 -> 214 (HBM 212), + 24. 2 splits: one
		// full wave at HBM's rate (194) and 24 blocks left (64); 3: 134 and
		// 168 left (85); 4: 2 x 97 and 48 left (32); + 24 and the combine's
		// 9.
		{144, 132, 264, 64, 1, 1, 238}, {144, 132, 264, 64, 2, 1, 291},
		{144, 132, 264, 64, 3, 1, 252}, {144, 132, 264, 64, 4, 1, 259},
	} {
		if got := splitCost(tt.blocks, tt.slots, tt.resident, tt.tiles, tt.n, narrowBlock, fusedUpTo(tt.mc)(tt.n)); got != tt.want {
			t.Errorf("splitCost(%d,%d,%d,%d,%d,%d) = %d, want %d", tt.blocks, tt.slots, tt.resident, tt.tiles, tt.n, tt.mc, got, tt.want)
		}
	}
	// A 32-row block (wideTileCost a tile, a merge of two 16-row tiles):
	// 16 splits of 4 tiles, in clusters 3*4 + 24 + 6, with the combine
	// 3*4 + 24 + 9; unsplit 3*64 + 24.
	wide := blockCostsOf(splitKV(Float16, 128, 32), Float16)
	if wide != (blockCosts{tile: wideTileCost, clusterMerge: 2 * clusterMergeCost, bytesPct: 100}) || blockCostsOf(splitKV(Float16, 128, 16), Float16) != narrowBlock {
		t.Errorf("blockCostsOf: %+v for 32 rows, %+v for 16", wide, blockCostsOf(splitKV(Float16, 128, 16), Float16))
	}
	for _, tt := range []struct{ n, mc, want int }{{16, 16, 42}, {16, 1, 45}, {1, 1, 216}} {
		if got := splitCost(8, 132, 264, 64, tt.n, wide, fusedUpTo(tt.mc)(tt.n)); got != tt.want {
			t.Errorf("splitCost(8,132,264,64,%d,wide,%d) = %d, want %d", tt.n, tt.mc, got, tt.want)
		}
	}
	for _, tt := range []struct{ n, tiles, want int }{
		{1, 512, 1}, {7, 512, 7}, {600, 512, 128}, {128, 512, 128}, {129, 1000, 128},
		{10, 3, 3}, {5, 0, 1}, {1, 0, 1},
	} {
		if got := clampSplits(tt.n, tt.tiles); got != tt.want {
			t.Errorf("clampSplits(%d, %d) = %d, want %d", tt.n, tt.tiles, got, tt.want)
		}
	}
	for _, tt := range []struct{ tiles, minTiles, want int }{
		{512, 8, 64}, {16, 8, 2}, {15, 8, 1}, {0, 8, 1}, {100000, 8, 128}, {5, 0, 5},
	} {
		if got := maxAutoSplits(tt.tiles, tt.minTiles); got != tt.want {
			t.Errorf("maxAutoSplits(%d, %d) = %d, want %d", tt.tiles, tt.minTiles, got, tt.want)
		}
	}
	for _, tt := range []struct{ tiles, minTiles, want int }{
		{512, 8, 64}, {8, 2, 8}, {8, 8, 8}, {15, 4, 8}, {16, 2, 8}, {7, 2, 3}, {4, 2, 2}, {0, 8, 1},
	} {
		if got := autoSplitCap(tt.tiles, tt.minTiles); got != tt.want {
			t.Errorf("autoSplitCap(%d, %d) = %d, want %d", tt.tiles, tt.minTiles, got, tt.want)
		}
	}
	for _, tt := range []struct{ rows, want, tail int }{{1, 64, 64}, {4, 64, 64}, {16, 64, 256}, {17, 68, 272}, {32, 128, 512}, {64, 256, 1024}} {
		if got := minKeysPerSplit(tt.rows, minSplitRowKeys); got != tt.want {
			t.Errorf("minKeysPerSplit(%d, minSplitRowKeys) = %d, want %d", tt.rows, got, tt.want)
		}
		if got := minKeysPerSplit(tt.rows, minTailSplitRowKeys); got != tt.tail {
			t.Errorf("minKeysPerSplit(%d, minTailSplitRowKeys) = %d, want %d", tt.rows, got, tt.tail)
		}
	}
}

func TestWorkspaceLayout(t *testing.T) {
	for _, tt := range []struct{ splits, rows, d, off, total int }{
		{1, 32, 128, 0, 0},
		{0, 32, 128, 0, 0},
		{32, 32, 128, 524288, 524288 + 4096},
		{2, 1, 8, 256, 256 + 8},     // 64 B of o_partial, lse at the next 256
		{3, 5, 72, 4352, 4352 + 60}, // 4320 B rounded up to 4352
		{2, 4, 64, 2048, 2048 + 32}, // already aligned
		{128, 4096, 256, 536870912, 536870912 + 2097152},
	} {
		off, _, total := workspaceLayout(tt.splits, tt.rows, tt.d, 0)
		if off != tt.off || total != tt.total {
			t.Errorf("workspaceLayout(%d, %d, %d) = %d, %d; want %d, %d", tt.splits, tt.rows, tt.d, off, total, tt.off, tt.total)
		}
		if off%256 != 0 || (tt.splits > 1 && off < tt.splits*tt.rows*tt.d*4) {
			t.Errorf("lse_partial offset %d overlaps o_partial or is unaligned", off)
		}
	}
}

func TestDefaultOccupancy(t *testing.T) {
	for _, tt := range []struct {
		threads, shared, want int
	}{
		{128, 0, 16},         // 64 warps / 4
		{128, 32768, 6},      // 228 KB / 33 KB
		{256, 0, 8},          // threads
		{32, 0, 32},          // block limit
		{100, 0, 16},         // 4 whole warps
		{128, 227 * 1024, 1}, // the most one block may have
		{128, 228 * 1024, 0}, // does not fit
		{1024, 48 * 1024, 2}, // threads
		{128, 16 * 1024, 13}, // 233472 / 17408
		{0, 0, 32},           // unknown threads
		{64, 100 * 1024, 2},  // shared
	} {
		v := testVariant
		v.Threads, v.SharedBytes = tt.threads, tt.shared
		if got := DefaultOccupancy(v); got != tt.want {
			t.Errorf("DefaultOccupancy(threads %d, shared %d) = %d, want %d", tt.threads, tt.shared, got, tt.want)
		}
	}
}

func TestPlanVariant(t *testing.T) {
	base := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 32768, Seqlen: -1}
	tests := []struct {
		name        string
		edit        func(*Shape)
		splits      int
		grid        [3]int
		combineGrid int
		lseOff, ws  int
	}{
		{"doc example", func(s *Shape) {}, 16, [3]int{16, 8, 1}, 8, 262144, 264192},
		{"seqlen overrides cache", func(s *Shape) { s.Seqlen = 1024 }, 16, [3]int{16, 8, 1}, 8, 262144, 262144 + 2048},
		{"seqlen 0", func(s *Shape) { s.Seqlen = 0 }, 1, [3]int{1, 8, 1}, 0, 0, 0},
		{"empty cache", func(s *Shape) { s.SeqlenCache = 0 }, 1, [3]int{1, 8, 1}, 0, 0, 0},
		{"batch 64: no split", func(s *Shape) { s.Batch = 64 }, 1, [3]int{1, 8, 64}, 0, 0, 0},
		{"requested 7", func(s *Shape) { s.NumSplits = 7 }, 7, [3]int{7, 8, 1}, 8, 7 * 32 * 128 * 4, 7*32*128*4 + 7*32*4},
		{"requested 1", func(s *Shape) { s.NumSplits = 1 }, 1, [3]int{1, 8, 1}, 0, 0, 0},
		// More than 32 splits: a combine block for each 32 columns of a row.
		{"requested 1000: cap", func(s *Shape) { s.NumSplits = 1000 }, 128, [3]int{128, 8, 1}, 32 * 4, 128 * 32 * 128 * 4, 128*32*128*4 + 128*32*4},
		{"requested 9 over 2 tiles", func(s *Shape) { s.NumSplits = 9; s.Seqlen = 100 }, 2, [3]int{2, 8, 1}, 8, 32768, 32768 + 256},
		{"requested 4 on empty", func(s *Shape) { s.NumSplits = 4; s.SeqlenCache = 0 }, 1, [3]int{1, 8, 1}, 0, 0, 0},
		{"head dim 72: actual head dim in workspace", func(s *Shape) { s.HeadDim = 72; s.NumSplits = 2 }, 2, [3]int{2, 8, 1}, 8, 2 * 32 * 72 * 4, 2*32*72*4 + 2*32*4},
		// group 4 x seqlen_q 8 = 32 rows: 2 row tiles of 16; 256 rows in all.
		{"row tiles", func(s *Shape) { s.SeqlenQ = 8; s.NumSplits = 3 }, 3, [3]int{3, 16, 1}, 64, 3 * 256 * 128 * 4, 3*256*128*4 + 3*256*4},
		// MHA 32/32, group 1: 32 blocks on 132 one-block slots, 512 tiles: 4 splits.
		{"mha", func(s *Shape) { s.HeadsKV = 32 }, 4, [3]int{4, 32, 1}, 8, 4 * 32 * 128 * 4, 4*32*128*4 + 4*32*4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := base
			tt.edit(&s)
			p, err := PlanVariant(s, testVariant, twoPerSM)
			if err != nil {
				t.Fatal(err)
			}
			if p.NumSplits != tt.splits || p.Grid != tt.grid || p.CombineGrid != tt.combineGrid ||
				p.LSEPartialOffset != tt.lseOff || p.WorkspaceBytes != tt.ws {
				t.Fatalf("got splits %d grid %v combine %d lse %d ws %d; want %d %v %d %d %d", p.NumSplits, p.Grid,
					p.CombineGrid, p.LSEPartialOffset, p.WorkspaceBytes, tt.splits, tt.grid, tt.combineGrid, tt.lseOff, tt.ws)
			}
			if p.Grid[1] != s.HeadsKV*p.RowTiles || p.Threads != testVariant.Threads || p.SharedBytes != testVariant.SharedBytes ||
				p.SMs != 132 || p.BlocksPerSM != 2 || p.Variant != testVariant {
				t.Fatalf("plan %+v does not carry the variant and device facts", p)
			}
			if (p.NumSplits == 1) != (p.CombineThreads == 0) || (p.NumSplits == 1) != (p.Combine == "") {
				t.Fatalf("combine %q of %d threads with %d splits", p.Combine, p.CombineThreads, p.NumSplits)
			}
		})
	}
}

// TestPlanCombineWidth: the 4-warp combine loads 32 splits per round trip to
// L2; more splits take the column-group one, when the variant has it, a
// block for each 32 columns of a row (the last group partly empty where the
// head dim is no multiple of 32).
func TestPlanCombineWidth(t *testing.T) {
	noWide := testVariant
	noWide.CombineWide, noWide.CombineWideThreads, noWide.CombineWideCols = "", 0, 0
	tests := []struct {
		splits, headDim int
		v               Variant
		combine         string
		threads, grid   int
	}{
		{1, 128, testVariant, "", 0, 0},
		{2, 128, testVariant, "fd_combine_f16", 128, 8},
		{32, 128, testVariant, "fd_combine_f16", 128, 8},
		{33, 128, testVariant, "fd_combine_f16_c32", 128, 32 * 4},
		{128, 128, testVariant, "fd_combine_f16_c32", 128, 32 * 4},
		{128, 40, testVariant, "fd_combine_f16_c32", 128, 32 * 2},
		{33, 128, noWide, "fd_combine_f16", 128, 8},
	}
	for _, tt := range tests {
		s := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: tt.headDim, SeqlenCache: 32768,
			Seqlen: -1, NumSplits: tt.splits}
		p, err := PlanVariant(s, tt.v, twoPerSM)
		if err != nil {
			t.Fatal(err)
		}
		if p.NumSplits != tt.splits || p.Combine != tt.combine || p.CombineThreads != tt.threads || p.CombineGrid != tt.grid {
			t.Errorf("%d splits, d%d (wide %q): %d splits, combine %q %d x %d; want %q %d x %d", tt.splits, tt.headDim,
				tt.v.CombineWide, p.NumSplits, p.Combine, p.CombineGrid, p.CombineThreads, tt.combine, tt.grid, tt.threads)
		}
	}
	// Rows whose column groups would pass the launch grid's x limit merge
	// whole, as many round trips as that takes.
	huge := Shape{DType: Float16, Batch: 65535, SeqlenQ: 2, HeadsQ: 8192, HeadsKV: 8192, HeadDim: 128, SeqlenCache: 4096,
		Seqlen: -1, NumSplits: 64}
	p, err := PlanVariant(huge, testVariant, twoPerSM)
	if err != nil {
		t.Fatal(err)
	}
	if rows := 65535 * 8192 * 2; p.Combine != "fd_combine_f16" || p.CombineGrid != rows/testVariant.CombineRows {
		t.Errorf("%d rows in 64 splits: combine %q x %d, want fd_combine_f16 x %d", rows, p.Combine, p.CombineGrid,
			rows/testVariant.CombineRows)
	}
}

// TestPlanClusters: on a device with clusters, 2 to 16 splits (chosen or
// requested) of at most 16 tiles merge inside stage 1, with no combine and
// no workspace, and so do longer splits when the split grid fills 80% of
// the SMs; more splits, longer ones on fewer SMs, or a device without
// clusters, use the combine kernel.
func TestPlanClusters(t *testing.T) {
	base := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 2048, Seqlen: -1}
	long := func(s *Shape) { s.SeqlenCache = 32768 } // 512 tiles
	b8 := func(s *Shape) { s.Batch, s.SeqlenCache = 8, 8192 }
	mha := func(s *Shape) { s.HeadsQ, s.HeadsKV, s.SeqlenCache = 48, 48, 8192 }
	tests := []struct {
		name            string
		dev             Device
		splits, request int
		cluster         int
		shape           func(*Shape)
	}{
		{"auto: 16", clustered, 16, 0, 16, nil},
		{"requested 2", clustered, 2, 2, 2, nil},
		{"requested 16", clustered, 16, 16, 16, nil},
		{"requested 17: combine", clustered, 17, 17, 1, nil},
		{"requested 1", clustered, 1, 1, 1, nil},
		{"clusters of 8", Device{SMs: 132, Clusters: clustersUpTo(8, 1000)}, 8, 8, 8, nil},
		{"clusters of 8, 9 splits", Device{SMs: 132, Clusters: clustersUpTo(8, 1000)}, 9, 9, 1, nil},
		{"clusters above the kernels' 16", Device{SMs: 132, Clusters: clustersUpTo(64, 1000)}, 32, 32, 1, nil},
		{"8 clusters fit at once", Device{SMs: 132, Clusters: clustersUpTo(16, 8)}, 16, 16, 16, nil},
		{"7 clusters fit at once: combine", Device{SMs: 132, Clusters: clustersUpTo(16, 7)}, 16, 16, 1, nil},
		{"no clusters", twoPerSM, 16, 0, 1, nil},
		{"long splits, 128 blocks of 132 SMs", clustered, 16, 16, 16, long},
		{"long splits, 96 blocks: combine", clustered, 12, 12, 1, long},
		{"long splits, 256 blocks on 132 SMs: combine", clustered, 16, 16, 1, func(s *Shape) { long(s); s.Batch = 2 }},
		{"splits of 65 tiles, 128 blocks: combine", clustered, 2, 2, 1, func(s *Shape) { b8(s); s.SeqlenCache = 8256 }},
		{"b=8, 65536 keys: combine", H200, 2, 0, 1, func(s *Shape) { b8(s); s.SeqlenCache = 65536 }},
		{"b=8: 2 long splits, 128 blocks", clustered, 2, 2, 2, b8},
		{"b=8 auto on an H200", H200, 2, 0, 2, b8},
		{"MHA: 2 long splits, 96 blocks: combine", clustered, 2, 2, 1, mha},
		{"MHA auto on an H200", H200, 2, 0, 1, mha},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := base
			s.NumSplits = tt.request
			if tt.shape != nil {
				tt.shape(&s)
			}
			p, err := PlanVariant(s, testVariant, tt.dev)
			if err != nil {
				t.Fatal(err)
			}
			if p.NumSplits != tt.splits || p.Cluster != tt.cluster {
				t.Fatalf("splits %d cluster %d, want %d %d", p.NumSplits, p.Cluster, tt.splits, tt.cluster)
			}
			fused := p.Cluster > 1
			if fused && (p.Cluster != p.Grid[0] || p.WorkspaceBytes != 0 || p.LSEPartialOffset != 0 || p.CombineGrid != 0 || p.CombineThreads != 0) {
				t.Fatalf("clustered plan %v has a combine or workspace, or a cluster that is not grid.x", p)
			}
			want := testVariant.SharedBytes
			if fused {
				want = testVariant.ClusterSharedBytes
			}
			if p.SharedBytes != want {
				t.Fatalf("shared bytes %d, want %d", p.SharedBytes, want)
			}
			if !fused && p.NumSplits > 1 && (p.WorkspaceBytes == 0 || p.CombineGrid == 0) {
				t.Fatalf("combined plan %v lacks the combine or workspace", p)
			}
		})
	}
}

// TestPlanPairs: two splits of a grid of more blocks than SMs merge in
// clusters at two blocks per SM (MergePairs) where the variant has a dense
// cluster size, else with the combine; other counts keep the combine.
func TestPlanPairs(t *testing.T) {
	mha := Shape{DType: Float16, Batch: 4, SeqlenQ: 1, HeadsQ: 48, HeadsKV: 48, HeadDim: 128, SeqlenCache: 2048, Seqlen: -1}
	v, err := SelectVariant(Float16, 128, 1, FormPlain)
	if err != nil {
		t.Fatal(err)
	}
	pull := v
	pull.ClusterDenseSharedBytes = 0 // as head dim 256 and 32 rows
	long := mha
	long.SeqlenCache = 16384 // 128 tiles a split: past clusterLongMaxTiles
	tests := []struct {
		name            string
		s               Shape
		v               Variant
		request         int
		cluster, shared int
	}{
		{"2 requested: pairs", mha, v, 2, 2, v.ClusterDenseSharedBytes},
		{"3 requested: combine", mha, v, 3, 1, v.SharedBytes},
		{"a pulling variant: combine", mha, pull, 2, 1, v.SharedBytes},
		{"splits of 128 tiles: combine", long, v, 2, 1, v.SharedBytes},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := tt.s
			s.NumSplits = tt.request
			p, err := PlanVariant(s, tt.v, H200)
			if err != nil {
				t.Fatal(err)
			}
			if p.NumSplits != 2 && tt.request == 0 || p.Cluster != tt.cluster || p.SharedBytes != tt.shared {
				t.Fatalf("%v: want cluster %d, %d B shared", p, tt.cluster, tt.shared)
			}
			if p.Cluster > 1 && (p.CombineGrid != 0 || p.WorkspaceBytes != 0) {
				t.Fatalf("%v: pairs with a combine", p)
			}
		})
	}
	if v.ClusterDenseSharedBytes <= v.SharedBytes || 2*(v.ClusterDenseSharedBytes+smSharedReserved) > smSharedBytes {
		t.Errorf("dense cluster shared bytes %d: must hold the inbox past %d and fit two blocks an SM", v.ClusterDenseSharedBytes, v.SharedBytes)
	}
}

// TestEarlyDependents: stage 1 lets the next kernel in at its start only
// when the combine follows or its grid has no more blocks than SMs.
func TestEarlyDependents(t *testing.T) {
	gqa := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 32768, Seqlen: -1}
	mha := Shape{DType: Float16, Batch: 3, SeqlenQ: 1, HeadsQ: 48, HeadsKV: 48, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1}
	with := func(s Shape, batch, keys, splits int) Shape {
		s.Batch, s.SeqlenCache, s.NumSplits = batch, keys, splits
		return s
	}
	tests := []struct {
		name  string
		s     Shape
		early bool
	}{
		{"16 splits and the combine", with(gqa, 1, 32768, 16), true},
		{"8 splits in clusters, 64 blocks", with(gqa, 1, 1024, 8), true},
		{"unsplit, 128 blocks", with(gqa, 16, 1024, 1), true},
		{"unsplit, 132 blocks: one an SM", Shape{DType: Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 66, HeadsKV: 66, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1, NumSplits: 1}, true},
		{"unsplit, 144 blocks", with(mha, 3, 4096, 1), false},
		{"3 splits and the combine, 432 blocks", with(mha, 3, 4096, 3), true},
		{"pairs, 384 blocks", with(mha, 4, 2048, 2), false},
		{"unsplit, 1024 blocks", with(gqa, 128, 1024, 1), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := MakePlan(tt.s, H200)
			if err != nil {
				t.Fatal(err)
			}
			if got := p.EarlyDependents(); got != tt.early {
				t.Errorf("%v: EarlyDependents() = %v, want %v", p, got, tt.early)
			}
		})
	}
}

// d128Shape is an fp16 shape at head dim 128 with the whole cache valid.
func d128Shape(batch, headsQ, headsKV, seqlenQ, keys, splits int) Shape {
	return Shape{DType: Float16, Batch: batch, SeqlenQ: seqlenQ, HeadsQ: headsQ, HeadsKV: headsKV, HeadDim: 128,
		SeqlenCache: keys, Seqlen: -1, NumSplits: splits}
}

// TestCombineEarlyDependents: the combine lets the next kernel in once stage
// 1 is done only when it has no more blocks than stage 1 and than SMs.
func TestCombineEarlyDependents(t *testing.T) {
	tests := []struct {
		name string
		s    Shape
		want bool
	}{
		{"32/8 b=1, 16 splits: 128 blocks, 32 rows", d128Shape(1, 32, 8, 1, 32768, 16), true},
		{"8/1 b=1, 128 splits: 128 blocks, 8 rows", d128Shape(1, 8, 1, 1, 131072, 128), true},
		{"32/8 b=1 with 4 tokens: 128 blocks, 128 rows", d128Shape(1, 32, 8, 4, 32768, 16), true},
		{"48/48 b=1 with 10 tokens: 96 blocks, 480 rows, 30 dense narrow blocks", d128Shape(1, 48, 48, 10, 8192, 2), true},
		{"8/1 b=32, 4 splits: 128 blocks, 256 rows, 64 narrow blocks", d128Shape(32, 8, 1, 1, 16384, 4), true},
		{"48/48 b=8, 3 splits: 1152 blocks, 384 rows, 96 narrow blocks", d128Shape(8, 48, 48, 1, 4096, 3), true},
		{"32/8 b=8 with 4 tokens, 16 splits: 1024 blocks, 1024 rows", d128Shape(8, 32, 8, 4, 32768, 16), false},
		{"clusters: no combine", d128Shape(1, 32, 8, 1, 1024, 8), false},
		{"unsplit: no combine", d128Shape(16, 32, 8, 1, 1024, 1), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := MakePlan(tt.s, H200)
			if err != nil {
				t.Fatal(err)
			}
			if got := p.CombineEarlyDependents(); got != tt.want {
				t.Errorf("%v: CombineEarlyDependents() = %v, want %v", p, got, tt.want)
			}
		})
	}
}

// TestNarrowCombineRows: plans of at most 8 splits merge a row a warp, 4
// rows a block, or 16 where only that grid has no more blocks than stage 1
// and the SMs (so that the combine lets the next kernel in early).
func TestNarrowCombineRows(t *testing.T) {
	tests := []struct {
		name       string
		s          Shape
		rows, grid int
	}{
		{"8/1 b=32, 4 splits: 256 rows behind 128 blocks", d128Shape(32, 8, 1, 1, 16384, 4), 4, 64},
		{"48/48 b=1, 2 splits: 48 rows", d128Shape(1, 48, 48, 1, 8192, 2), 4, 12},
		{"48/48 b=1 with 10 tokens: 480 rows behind 96 blocks", d128Shape(1, 48, 48, 10, 8192, 2), 16, 30},
		{"48/48 b=1 with 16 tokens: 768 rows, 48 dense blocks behind 96", d128Shape(1, 48, 48, 16, 8192, 2), 16, 48},
		{"32/8 b=8 with 4 tokens, 8 splits: 1024 rows, 64 dense blocks", d128Shape(8, 32, 8, 4, 32768, 8), 16, 64},
		{"32/8 b=32 with 4 tokens, 8 splits: 4096 rows, too many for either", d128Shape(32, 32, 8, 4, 32768, 8), 4, 1024},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := MakePlan(tt.s, H200)
			if err != nil {
				t.Fatal(err)
			}
			name := map[int]string{4: p.Variant.CombineNarrow, 16: p.Variant.CombineNarrowDense}[tt.rows]
			if p.Combine != name || p.CombineRows != tt.rows || p.CombineThreads != 32*tt.rows || p.CombineGrid != tt.grid {
				t.Errorf("%v: combine %s, %d rows a block of %d threads, grid %d; want %s, %d rows, grid %d",
					p, p.Combine, p.CombineRows, p.CombineThreads, p.CombineGrid, name, tt.rows, tt.grid)
			}
		})
	}
}

// TestPrefetchTiles: a plain stage 1 sends its split's tiles into L2 before
// the PDL wait only where its splits merge in clusters and are at most the
// pipeline's depth.
func TestPrefetchTiles(t *testing.T) {
	gqa := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 1024, Seqlen: -1}
	with := func(keys, splits int, serving bool) Shape {
		s := gqa
		s.SeqlenCache, s.NumSplits, s.Serving = keys, splits, serving
		return s
	}
	tests := []struct {
		name     string
		s        Shape
		d        Device
		cluster  int
		prefetch int
	}{
		{"1024 keys, 8 splits of 2 tiles in clusters", with(1024, 8, false), H200, 8, 2},
		{"512 keys, 8 splits of 1 tile in clusters", with(512, 8, false), H200, 8, 1},
		{"4096 keys, 8 splits of 8 tiles in clusters", with(4096, 8, false), H200, 8, 0},
		{"serving kernel, 1024 keys in clusters", with(1024, 8, true), H200, 8, 0},
		{"no clusters: the combine", with(1024, 8, false), Device{SMs: 132}, 1, 0},
		{"unsplit", with(1024, 1, false), H200, 1, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := MakePlan(tt.s, tt.d)
			if err != nil {
				t.Fatal(err)
			}
			if p.Cluster != tt.cluster || p.PrefetchTiles != tt.prefetch {
				t.Errorf("%v: cluster %d, PrefetchTiles %d; want %d, %d", p, p.Cluster, p.PrefetchTiles, tt.cluster, tt.prefetch)
			}
		})
	}
}

func TestTailSplit(t *testing.T) {
	for _, tt := range []struct{ blocks, resident, maxN, whole, m int }{
		{384, 264, 64, 264, 2},   // 48/48 b=8: 120 items left, in 2 splits
		{288, 264, 64, 264, 11},  // 48/48 b=6: 24 left, in 11
		{288, 264, 4, 264, 4},    // capped by the shortest split
		{270, 264, 128, 264, 44}, // 6 left
		{1024, 264, 64, 792, 1},  // 232 left: nearly a full wave, no split
		{528, 264, 64, 0, 0},     // two full waves
		{264, 264, 64, 0, 0},     // one
		{200, 264, 64, 0, 0},     // fewer items than slots
		{140, 132, 64, 132, 16},  // one block per SM
	} {
		whole, m := tailSplit(tt.blocks, tt.resident, tt.maxN)
		if m != tt.m || (m > 1 && whole != tt.whole) {
			t.Errorf("tailSplit(%d, %d, %d) = %d, %d; want %d, %d", tt.blocks, tt.resident, tt.maxN, whole, m, tt.whole, tt.m)
		}
	}
}

// TestPlanTailSplit: the num_splits=0 plan of a grid with a partial last
// wave keeps the full wave whole and splits the rest, merged by the combine
// from the first split item's first row; a requested count splits all.
func TestPlanTailSplit(t *testing.T) {
	mha := Shape{DType: Float16, Batch: 8, SeqlenQ: 10, HeadsQ: 48, HeadsKV: 48, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1}
	tiles := Shape{DType: Float16, Batch: 70, SeqlenQ: 2, HeadsQ: 64, HeadsKV: 2, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1}
	fiveTiles := Shape{DType: Float16, Batch: 33, SeqlenQ: 10, HeadsQ: 32, HeadsKV: 2, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1}
	tests := []struct {
		name                               string
		s                                  Shape
		whole, splits, grid, combine, row0 int
	}{
		// 384 items of 10 rows: 264 whole, 120 in 2 splits, their 1200 rows
		// merged by the narrow combine, 16 a block (4 a block would be 300
		// blocks, more than the SMs).
		{"48/48, b=8, seqlen_q 10", mha, 264, 2, 264 + 120*2, 75, 2640},
		// 280 items (70 x 2 K/V heads x 2 row tiles of 32 of the 64 rows):
		// 264 whole, 16 in 8 splits (4096 keys: a tail split holds at least
		// 512 keys, minTailSplitRowKeys), their 512 rows merged 4 a block.
		{"two row tiles a K/V head", tiles, 264, 8, 264 + 16*8, 16 * 32 / 4, 264 / 2 * 64},
		// 330 items (33 x 2 K/V heads x 5 row tiles of 32 of the 160 rows):
		// 264 whole, 52 K/V heads and 4 row tiles into the 53rd, so the split
		// rows start at 52*160 + 4*32; 66 in 4 splits, their 2112 rows merged
		// 16 a block.
		{"a tail starting inside a K/V head", fiveTiles, 264, 4, 264 + 66*4, 2112 / 16, 52*160 + 4*32},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := MakePlan(tt.s, H200)
			if err != nil {
				t.Fatal(err)
			}
			if p.WholeItems != tt.whole || p.NumSplits != tt.splits || p.Grid != [3]int{tt.grid, 1, 1} ||
				p.CombineGrid != tt.combine || p.CombineRow0 != tt.row0 || p.Cluster != 1 || !p.EarlyDependents() {
				t.Errorf("%v: want %d whole, %d splits, grid %d, combine %d from row %d", p, tt.whole, tt.splits, tt.grid, tt.combine, tt.row0)
			}
			// The partials of the split rows only, from tt.row0 on.
			rows := tt.s.Batch*tt.s.HeadsQ*tt.s.SeqlenQ - tt.row0
			if off, _, total := workspaceLayout(tt.splits, rows, tt.s.HeadDim, 0); p.LSEPartialOffset != off || p.WorkspaceBytes != total {
				t.Errorf("%v: workspace %d (lse at %d), want %d (%d)", p, p.WorkspaceBytes, p.LSEPartialOffset, total, off)
			}
			s := tt.s
			s.NumSplits = 2
			if p, _ := MakePlan(s, H200); p.WholeItems != 0 || p.Grid[0] != 2 {
				t.Errorf("2 splits requested: %v", p)
			}
		})
	}
}

// TestPlanIgnoresDeviceData: a Shape differing only in what the device holds
// (CacheSeqlens contents) cannot exist, but a Problem's pointers and options
// must not change the plan either.
func TestPlanIgnoresDeviceData(t *testing.T) {
	p1, p2 := validProblem(), validProblem()
	p2.CacheSeqlens, p2.LSE, p2.Causal, p2.Scale = 0x1000, 0x2000, true, 0.5
	a, err1 := PlanVariant(p1.Shape, testVariant, twoPerSM)
	b, err2 := PlanVariant(p2.Shape, testVariant, twoPerSM)
	if err1 != nil || err2 != nil || a != b {
		t.Fatalf("plans differ: %v %v / %v %v", a, err1, b, err2)
	}
}

func TestPlanVariantErrors(t *testing.T) {
	s := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1}
	bf := testVariant
	bf.DType = BFloat16
	small := testVariant
	small.HeadDim = 64
	zero := testVariant
	zero.KeysPerTile = 0
	bigHeads := s
	bigHeads.HeadsQ, bigHeads.HeadsKV, bigHeads.SeqlenQ = 70000*2, 70000, 16
	badShape := s
	badShape.HeadsKV = 5
	tests := []struct {
		name      string
		s         Shape
		v         Variant
		sms, bpsm int
		arg       string
		want      error
	}{
		{"sms 0", s, testVariant, 0, 2, "sms", ErrInvalid},
		{"blocks/SM 0", s, testVariant, 132, 0, "blocks_per_sm", ErrInvalid},
		{"dtype mismatch", s, bf, 132, 2, "variant", ErrInvalid},
		{"head dim too small", s, small, 132, 2, "variant", ErrInvalid},
		{"zero tile", s, zero, 132, 2, "variant", ErrInvalid},
		{"grid y", bigHeads, testVariant, 132, 2, "nheads_kv", ErrUnsupported},
		{"shape first", badShape, testVariant, 0, 0, "nheads_q", ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bpsm := tt.bpsm
			_, err := PlanVariant(tt.s, tt.v, Device{SMs: tt.sms, Occupancy: func(Variant) int { return bpsm }})
			checkErr(t, err, tt.arg, tt.want)
			if !strings.HasPrefix(err.Error(), "flashdecode: plan: ") {
				t.Errorf("error %q does not name the plan operation", err)
			}
		})
	}
}

func TestMakePlan(t *testing.T) {
	s := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 32768, Seqlen: -1}
	if _, err := MakePlan(s, Device{}); !errors.Is(err, ErrInvalid) {
		t.Errorf("sms 0: %v", err)
	}
	bad := s
	bad.HeadDim = 100
	if _, err := MakePlan(bad, H200); !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "headdim") {
		t.Errorf("headdim 100: %v", err)
	}
	v, err := SelectVariant(s.DType, s.HeadDim, 4, FormPlain)
	if err != nil {
		t.Fatal(err)
	}
	got, err := MakePlan(s, H200)
	if err != nil {
		t.Fatal(err)
	}
	want, err := PlanVariant(s, v, H200)
	if err != nil || got != want {
		t.Fatalf("MakePlan = %v, PlanVariant = %v (%v)", got, want, err)
	}
	if got.BlocksPerSM != DefaultOccupancy(v) || got.Cluster != 1 || got.NumSplits != 16 {
		t.Fatalf("MakePlan on an H200 = %v: want DefaultOccupancy and 16 splits without clusters (8 of 16 do not fit)", got)
	}
	for _, keys := range []int{1024, 4096} {
		s.SeqlenCache = keys
		if got, err = MakePlan(s, H200); err != nil || got.Cluster != 8 || got.NumSplits != 8 || got.SharedBytes != v.ClusterSharedBytes {
			t.Fatalf("MakePlan(%d keys) on an H200 = %v, %v: want 8 splits in clusters of 8", keys, got, err)
		}
	}
	if _, err := MakePlan(s, Device{SMs: 132, Occupancy: func(Variant) int { return 0 }}); !errors.Is(err, ErrUnsupported) {
		t.Errorf("occupancy 0: %v", err)
	}
}

// TestVariantTable checks that the variant table plans a spread of dtypes,
// head dims, query groups and seqlen_q, in rows that hold them.
func TestVariantTable(t *testing.T) {
	for _, dt := range []DType{Float16, BFloat16} {
		for _, d := range []int{8, 64, 72, 128, 136, 256} {
			for _, g := range []int{1, 4, 5, 7, 8, 12, 16} {
				for _, sq := range []int{1, 4, 16} {
					s := Shape{DType: dt, Batch: 2, SeqlenQ: sq, HeadsQ: 8 * g, HeadsKV: 8, HeadDim: d, SeqlenCache: 4096, Seqlen: -1}
					p, err := MakePlan(s, H200)
					if err != nil {
						t.Fatalf("%+v: %v", s, err)
					}
					if p.RowTiles*p.Variant.Rows < g*sq || p.Variant.HeadDim < d || p.Variant.DType != dt {
						t.Fatalf("%+v: plan %v cannot hold the rows", s, p)
					}
				}
			}
		}
	}
}

// TestClusterInbox checks the cluster launch of every variant whose
// cluster merge pushes (kernels/split_kv_config.cuh, kPushMerge: at most 4 (row,
// 4 columns) items a thread) against the inbox the kernel puts after its
// pipeline buffers (kInboxBytes, written out here), so that shrinking
// ClusterSharedBytes cannot leave the pushes writing past the launch's
// shared memory.
func TestClusterInbox(t *testing.T) {
	pushing := 0
	for _, v := range Variants() {
		items := v.Rows * v.HeadDim / 4
		if items > 4*v.Threads {
			continue // the pull form: no inbox
		}
		pushing++
		inbox := MaxCluster*v.Rows*4 + (items+MaxCluster)*16
		if v.ClusterSharedBytes < v.SharedBytes+inbox {
			t.Errorf("%s: cluster launch %d B < pipeline %d B + inbox %d B", v.Kernel, v.ClusterSharedBytes, v.SharedBytes, inbox)
		}
	}
	if pushing == 0 {
		t.Error("no variant pushes; kernels/split_kv_config.cuh says head dims 64 and 128 at 16 rows do")
	}
}

func TestPlanJSONAndString(t *testing.T) {
	s := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 32768, Seqlen: -1}
	p, err := PlanVariant(s, testVariant, twoPerSM)
	if err != nil {
		t.Fatal(err)
	}
	m := planFields(t, p)
	for _, k := range []string{"variant", "merge", "num_splits", "row_tiles", "grid", "threads", "shared_bytes", "cluster",
		"combine", "combine_grid", "combine_threads", "lse_partial_offset", "workspace_bytes", "sms", "blocks_per_sm"} {
		if _, ok := m[k]; !ok {
			t.Errorf("JSON %v lacks %q", m, k)
		}
	}
	if len(m) != 18 {
		t.Errorf("JSON %v has %d keys, want 18", m, len(m))
	}
	v, _ := m["variant"].(map[string]any)
	for _, k := range []string{"kernel", "combine", "dtype", "head_dim", "rows", "threads", "keys_per_tile",
		"shared_bytes", "cluster_shared_bytes", "combine_threads", "combine_rows", "combine_wide", "combine_wide_threads", "combine_wide_cols",
		"combine_narrow", "combine_narrow_rows", "combine_narrow_dense", "combine_narrow_dense_rows", "form"} {
		if _, ok := v[k]; !ok {
			t.Errorf("variant JSON %v lacks %q", v, k)
		}
	}
	if m["merge"] != "combine" || m["num_splits"] != 16.0 || m["workspace_bytes"] != 264192.0 || v["dtype"] != "float16" || v["form"] != "plain" {
		t.Errorf("JSON values wrong: %v", m)
	}
	str := p.String()
	for _, want := range []string{"fd_split_kv_f16_d128_r16", "(16,8,1)", "16 splits", "fd_combine_f16", "264192 B"} {
		if !strings.Contains(str, want) {
			t.Errorf("String() = %q lacks %q", str, want)
		}
	}
	s.SeqlenCache = 1024
	p, _ = PlanVariant(s, testVariant, clustered)
	if str := p.String(); !strings.Contains(str, "16 splits merged in clusters of 16, no combine, no workspace") {
		t.Errorf("String() = %q", str)
	}
	s.NumSplits = 1
	p, _ = PlanVariant(s, testVariant, twoPerSM)
	if str := p.String(); !strings.Contains(str, "1 split, no combine") || strings.Contains(str, "\n") {
		t.Errorf("String() = %q", str)
	}
}

func TestDefaultClusters(t *testing.T) {
	v := testVariant // 122880 B in a cluster launch: one block per SM
	for _, tt := range []struct{ size, want int }{
		{0, 0}, {1, 132}, {2, 66}, {3, 39}, {8, 15}, {16, 7}, {17, 0},
	} {
		if got := DefaultClusters(v, tt.size); got != tt.want {
			t.Errorf("DefaultClusters(size %d) = %d, want %d", tt.size, got, tt.want)
		}
	}
	v.ClusterSharedBytes = 98304 // two blocks per SM
	if got := DefaultClusters(v, 16); got != 14 {
		t.Errorf("two blocks per SM: DefaultClusters(16) = %d, want 14", got)
	}
	v.ClusterSharedBytes, v.Threads = 40000, 32 // five per SM: no measurement, an estimate
	if got := DefaultClusters(v, 4); got != 132*5/4 {
		t.Errorf("five blocks per SM: DefaultClusters(4) = %d, want %d", got, 132*5/4)
	}
}

func TestTargetBlocks(t *testing.T) {
	for _, tt := range []struct {
		threads, blocksPerSM, want int
	}{
		{256, 2, 1}, // 8 warps
		{128, 2, 1}, // d128: 4 warps
		{64, 2, 2},  // 2 warps: two blocks fill 4 warps
		{64, 1, 1},  // but never more than fit
		{32, 8, 4},
		{0, 3, 3}, // a degenerate variant still gets at least one warp's worth
	} {
		v := Variant{Threads: tt.threads}
		if got := targetBlocks(v, tt.blocksPerSM); got != tt.want {
			t.Errorf("targetBlocks(%d threads, %d/SM) = %d, want %d", tt.threads, tt.blocksPerSM, got, tt.want)
		}
	}
}

func TestPlanKey(t *testing.T) {
	for _, tc := range []struct{ seqlen, seqlenNew, cache, want int }{
		{-1, 0, 4096, -1},     // the whole cache
		{0, 0, 4096, 0},       // no key
		{1, 0, 4096, 32},      // up to a multiple of 32 keys
		{32, 0, 4096, 32},     // already one
		{33, 0, 4096, 64},     // the next
		{30, 3, 4096, 61},     // the appended tokens count: 33 keys -> 64
		{4090, 0, 4096, 4096}, // within the cache
		{4090, 3, 4096, 4093}, // within the cache, appended tokens and all
		{4095, 3, 4096, 4095}, // past what the cache holds: as it is
		{5000, 0, 4096, 5000}, // past the cache: as it is
		{70, 0, 100, 96},      // a cache that is not a multiple of 32
		{97, 0, 100, 100},
	} {
		s := Shape{Seqlen: tc.seqlen, SeqlenNew: tc.seqlenNew, SeqlenCache: tc.cache}
		if got := s.PlanKey().Seqlen; got != tc.want {
			t.Errorf("Seqlen %d, %d new, cache %d: PlanKey's Seqlen %d, want %d", tc.seqlen, tc.seqlenNew, tc.cache, got, tc.want)
		}
	}
}

// TestPlanRefusesGridsPastCUDA checks that a plan whose stage-1 or append
// grid passes CUDA's limits is refused by name, with or without an append
// kernel (which would run before stage 1 and write the cache).
func TestPlanRefusesGridsPastCUDA(t *testing.T) {
	wide := Shape{DType: Float16, Batch: 32774, SeqlenQ: 1, HeadsQ: 65524, HeadsKV: 65524, HeadDim: 128,
		SeqlenCache: 1024, Seqlen: -1}
	appending := wide
	appending.Serving, appending.SeqlenNew, appending.RotaryQ = true, 1, true
	rotating := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 262144, HeadsKV: 1, HeadDim: 256,
		SeqlenCache: 1024, Seqlen: -1, Serving: true, SeqlenNew: 1, RotaryQ: true}
	for _, tt := range []struct {
		name string
		s    Shape
		arg  string
	}{
		{"tail split past x", wide, "batch"},
		{"tail split past x, appending", appending, "batch"},
		{"append grid past z", rotating, "nheads_q"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, err := MakePlan(tt.s, H200)
			checkErr(t, err, tt.arg, ErrUnsupported)
			if p != (Plan{}) {
				t.Errorf("a refused plan is not empty: %v", p)
			}
		})
	}
}

// TestMergeNames: each merge mode has a name that JSON carries both ways,
// and an unknown mode or name is an error.
func TestMergeNames(t *testing.T) {
	for m := MergeNone; m <= MergeInvariant; m++ {
		b, err := json.Marshal(m)
		var back Merge
		if err != nil || json.Unmarshal(b, &back) != nil || back != m || string(b) != `"`+m.String()+`"` {
			t.Errorf("%v: JSON %s, %v, back %v", m, b, err, back)
		}
	}
	if _, err := json.Marshal(Merge(9)); err == nil || Merge(9).String() != "Merge(9)" {
		t.Errorf("Merge(9) marshals (%v) or prints %q", err, Merge(9))
	}
	var m Merge
	if err := json.Unmarshal([]byte(`"fused"`), &m); err == nil {
		t.Error(`"fused" unmarshals`)
	}
}
