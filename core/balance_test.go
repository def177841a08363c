package core

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// groups is how many column groups of a row the plan's combine merges apart.
func groups(p Plan, s Shape) int {
	if (p.Combine == p.Variant.CombineWide || p.Combine == BalancedCombine(p.Variant.CombineWide)) && p.Variant.CombineWideCols > 0 {
		return ceilDiv(s.HeadDim, p.Variant.CombineWideCols)
	}
	return 1
}

func TestPlanBalancedSplits(t *testing.T) {
	base := Shape{DType: Float16, Batch: 8, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 32768, Seqlen: -1}
	with := func(f func(*Shape)) Shape {
		s := base
		s.DeviceLengths = true
		f(&s)
		return s
	}
	for _, tt := range []struct {
		name          string
		s             Shape
		balance, maxN int // 0: not balanced
		combine       string
	}{
		// 2 splits for equal lengths; a sequence may take the 132 planned
		// slots' worth over its 8 K/V heads: 17. The combine is the one equal
		// lengths take (a warp a row up to 8 splits), its balanced twin.
		{"b=8 32K", with(func(*Shape) {}), 2, 17, "fd_combine_f16_r4_bal"},
		{"b=2 32K", with(func(s *Shape) { s.Batch = 2 }), 8, 17, "fd_combine_f16_r4_bal"},
		// One K/V head: a sequence may take every slot's split, up to MaxSplits.
		{"MQA b=4 128K", with(func(s *Shape) { s.Batch, s.HeadsQ, s.HeadsKV, s.SeqlenCache = 4, 8, 1, 131072 }), 33, 128, "fd_combine_f16_c32_bal"},
		{"lengths on the host", base, 0, 0, ""},
		{"one sequence", with(func(s *Shape) { s.Batch = 1 }), 0, 0, ""},
		{"a window", with(func(s *Shape) { s.Serving, s.WindowKeys = true, 1024 }), 0, 0, ""},
		// 32 rows a block (GQA 8, 4 query tokens) in a serving form.
		{"32-row serving form", with(func(s *Shape) { s.Serving, s.HeadsQ, s.SeqlenQ = true, 64, 4 }), 0, 0, ""},
		{"splits requested", with(func(s *Shape) { s.NumSplits = 4 }), 0, 0, ""},
		{"clusters (b=8 8K)", with(func(s *Shape) { s.SeqlenCache = 8192 }), 0, 0, ""},
		// One split for equal lengths: balanced too, through the combine
		// for up to 8 splits, 16 rows a block (its grid fits the SMs).
		{"one split (b=32 32K)", with(func(s *Shape) { s.Batch = 32 }), 1, 17, "fd_combine_f16_r16_bal"},
		// A large batch: a split's partials take 4.2 MB (8192 rows of 128
		// outputs and an LSE), so a sequence takes at most 7 (32 MiB).
		{"b=256 4K", with(func(s *Shape) { s.Batch, s.SeqlenCache = 256, 4096 }), 1, 7, "fd_combine_f16_r4_bal"},
		// No sequence could take more splits than equal lengths give it:
		// one key tile planned (a bound of 64 keys), or partials capping
		// a sequence at its one split (b=1056: 32 full waves, no tail to
		// split, 17 MB of partials a split). Balancing would only cost.
		{"one tile planned", with(func(s *Shape) { s.Seqlen = 64 }), 0, 0, ""},
		{"b=1056 1K: partials cap it at one", with(func(s *Shape) { s.Batch, s.SeqlenCache = 1056, 1024 }), 0, 0, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, err := MakePlan(tt.s, H200)
			if err != nil {
				t.Fatal(err)
			}
			plain := tt.s
			plain.DeviceLengths = false
			q, err := MakePlan(plain, H200)
			if err != nil {
				t.Fatal(err)
			}
			if tt.balance == 0 {
				if p.BalanceSplits != 0 || p.NumSplits != q.NumSplits || p.Grid != q.Grid || p.WorkspaceBytes != q.WorkspaceBytes {
					t.Errorf("%v: want the plan without device lengths, %v", p, q)
				}
				return
			}
			items := tt.s.Batch * tt.s.HeadsKV * p.RowTiles
			rows := tt.s.Batch * tt.s.HeadsQ * tt.s.SeqlenQ
			if p.BalanceSplits != tt.balance || p.BalanceSplits != q.NumSplits || p.NumSplits != tt.maxN ||
				p.Grid != [3]int{items * (tt.balance + 1), 1, 1} || p.Cluster != 1 || p.WholeItems != 0 ||
				p.Combine != tt.combine || p.CombineGrid != ceilDiv(rows, p.CombineRows)*groups(p, tt.s) || !p.EarlyDependents() {
				t.Errorf("%v: want %d splits for equal lengths, at most %d, combine %s", p, tt.balance, tt.maxN, tt.combine)
			}
			if lse, _, total := workspaceLayout(p.NumSplits, rows, tt.s.HeadDim, 0); p.LSEPartialOffset != lse || p.WorkspaceBytes != total {
				t.Errorf("%v: workspace %d, lse at %d; want %d, %d", p, p.WorkspaceBytes, p.LSEPartialOffset, total, lse)
			}
		})
	}
}

// BalancedSplitCounts answers only for a balanced plan and a length per sequence.
func TestBalancedSplitCountsNeedABalancedPlan(t *testing.T) {
	s := Shape{DType: Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 32768, Seqlen: -1}
	for _, tt := range []struct {
		name    string
		device  bool
		lengths []int
		want    []int
	}{
		{"balanced", true, []int{32768, 0}, []int{16, 1}},
		{"clamped to the cache", true, []int{-5, 40000}, []int{1, 16}},
		{"a length missing", true, []int{32768}, nil},
		{"lengths on the host", false, []int{32768, 0}, nil},
	} {
		s.DeviceLengths = tt.device
		p, err := MakePlan(s, H200)
		if err != nil {
			t.Fatal(err)
		}
		if got := p.BalancedSplitCounts(s, tt.lengths); !slices.Equal(got, tt.want) {
			t.Errorf("%s: %v: counts %v, want %v", tt.name, p, got, tt.want)
		}
	}
}

// TestBalancedSplitCountsTable: counts worked by hand from kernels/balance.cuh's
// rule, c_b = clamp(ceil(n*batch*tiles_b / sum tiles), 1, NumSplits) with
// tiles_b = ceil(clamp(len_b + seqlen_new, 0, seqlen_cache) / 64).
func TestBalancedSplitCountsTable(t *testing.T) {
	mqa := Shape{DType: Float16, Batch: 4, SeqlenQ: 1, HeadsQ: 8, HeadsKV: 1, HeadDim: 128, SeqlenCache: 131072,
		Seqlen: -1, DeviceLengths: true}
	appending := mqa // 100 new tokens, rotated by the append kernel
	appending.Serving, appending.SeqlenNew, appending.RotaryQ = true, 100, true
	for _, tt := range []struct {
		name    string
		s       Shape
		n, most int // the plan's BalanceSplits and NumSplits the table assumes
		lengths []int
		want    []int
	}{
		// n*batch = 132 splits shared by tiles.
		{"equal", mqa, 33, 128, []int{131072, 131072, 131072, 131072}, []int{33, 33, 33, 33}},
		// 2048 tiles of 2048: 132 splits, capped at 128.
		{"one long, capped", mqa, 33, 128, []int{131072, 0, 0, 0}, []int{128, 1, 1, 1}},
		// Tiles 100, 50, 10, 1 of 161: 13200/161 = 81.99, 6600/161 = 40.99, 1320/161 = 8.2, 132/161 = 0.8.
		{"shares round up", mqa, 33, 128, []int{6400, 3200, 640, 1}, []int{82, 41, 9, 1}},
		// Tiles 2, 1, 1, 0 of 4 (65 keys take 2 tiles): 66, 33, 33, and 1 at least.
		{"tiles round up", mqa, 33, 128, []int{65, 64, 1, 0}, []int{66, 33, 33, 1}},
		{"no keys at all", mqa, 33, 128, []int{0, 0, 0, 0}, []int{1, 1, 1, 1}},
		{"clamped to the cache", mqa, 33, 128, []int{-5, 200000, 0, 0}, []int{1, 128, 1, 1}},
		// n*batch = 256. Keys 100, 128, 129, 0 (with the 100 new): tiles 2, 2, 3, 0 of 7:
		// 512/7 = 73.1, 73.1, 768/7 = 109.7, and 1 at least.
		{"appended tokens count", appending, 64, 128, []int{0, 28, 29, -100}, []int{74, 74, 110, 1}},
		// Keys 131072 (clamped: the new tokens overwrite the last), 100, 100, 100:
		// tiles 2048, 2, 2, 2 of 2054: 256*2048/2054 = 255.3, capped; 512/2054 = 0.25.
		{"appended past the cache", appending, 64, 128, []int{131072, 0, 0, 0}, []int{128, 1, 1, 1}},
		// Tiles 0 + 2 each with the new tokens alone: equal.
		{"only appended tokens", appending, 64, 128, []int{0, 0, 0, 0}, []int{64, 64, 64, 64}},
	} {
		p, err := MakePlan(tt.s, H200)
		if err != nil {
			t.Fatal(err)
		}
		if p.Merge != MergeBalanced || p.BalanceSplits != tt.n || p.NumSplits != tt.most || p.Variant.KeysPerTile != 64 {
			t.Fatalf("%s: %v: the table assumes a balanced plan of %d splits, at most %d, 64-key tiles", tt.name, p, tt.n, tt.most)
		}
		if got := p.BalancedSplitCounts(tt.s, tt.lengths); !slices.Equal(got, tt.want) {
			t.Errorf("%s: lengths %v: counts %v, want %v", tt.name, tt.lengths, got, tt.want)
		}
	}
}

// TestBalancedSplitCountsRule checks the counts of random lengths against
// kernels/balance.cuh's rule stated as bounds: c_b is the fewest splits in
// [1, NumSplits] that hold at most the batch's mean tiles a split (c_b *
// total >= n*batch*tiles_b), equal lengths take the plan's n, and the grid
// has a block for every split of every item.
func TestBalancedSplitCountsRule(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	shapes := []Shape{
		{DType: Float16, Batch: 8, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 32768, Seqlen: -1, DeviceLengths: true},
		{DType: Float16, Batch: 3, SeqlenQ: 4, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 65536, Seqlen: -1, DeviceLengths: true},
		{DType: BFloat16, Batch: 5, SeqlenQ: 1, HeadsQ: 16, HeadsKV: 2, HeadDim: 64, SeqlenCache: 131072, Seqlen: -1, DeviceLengths: true},
		{DType: Float16, Batch: 2, SeqlenQ: 2, HeadsQ: 8, HeadsKV: 1, HeadDim: 256, SeqlenCache: 65536, Seqlen: 40000, DeviceLengths: true,
			Serving: true, Paged: true, SeqlenNew: 2},
		{DType: Float16, Batch: 32, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 8192, Seqlen: -1, DeviceLengths: true}, // 1 split
		// n*batch = 256 past NumSplits = 7 (the partials' bound), and 132
		// past NumSplits = MaxSplits: one long sequence is capped.
		{DType: Float16, Batch: 256, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1, DeviceLengths: true},
		{DType: Float16, Batch: 4, SeqlenQ: 1, HeadsQ: 8, HeadsKV: 1, HeadDim: 128, SeqlenCache: 131072, Seqlen: -1, DeviceLengths: true},
		{DType: Float16, Batch: 4, SeqlenQ: 1, HeadsQ: 8, HeadsKV: 1, HeadDim: 128, SeqlenCache: 131072, Seqlen: -1, DeviceLengths: true,
			Serving: true, SeqlenNew: 100, RotaryQ: true},
	}
	for _, s := range shapes {
		p, err := MakePlan(s, H200)
		if err != nil {
			t.Fatal(err)
		}
		if p.BalanceSplits == 0 {
			t.Fatalf("%+v: not balanced: %v", s, p)
		}
		n, most, keysPerTile := p.BalanceSplits, p.NumSplits, p.Variant.KeysPerTile
		for trial := range 200 {
			lengths := make([]int, s.Batch)
			for b := range lengths {
				switch trial % 5 {
				case 0:
					lengths[b] = s.SeqlenCache // equal
				case 1:
					lengths[b] = r.IntN(s.SeqlenCache + 1)
				case 2:
					lengths[b] = []int{0, 1, s.SeqlenCache}[r.IntN(3)]
				case 3:
					lengths[b] = r.IntN(200) - 8 // short, some negative (clamped)
				default: // one long among empty ones: the cap binds
					if b == trial%s.Batch {
						lengths[b] = s.SeqlenCache
					}
				}
			}
			counts := p.BalancedSplitCounts(s, lengths)
			if len(counts) != s.Batch {
				t.Fatalf("%v, lengths %v: counts %v", p, lengths, counts)
			}
			tiles, total := make([]int, s.Batch), 0
			for b, l := range lengths {
				// balance.cuh's fd_attended_keys, then whole tiles.
				keys := min(max(min(l, s.SeqlenCache-s.SeqlenNew)+s.SeqlenNew, 0), s.SeqlenCache)
				tiles[b] = (keys + keysPerTile - 1) / keysPerTile
				total += tiles[b]
			}
			sum := 0
			for b, c := range counts {
				share := n * s.Batch * tiles[b] // c*total must reach it
				switch {
				case c < 1 || c > most:
					t.Fatalf("lengths %v: sequence %d takes %d splits, outside [1, %d]", lengths, b, c, most)
				case total == 0 && c != 1:
					t.Fatalf("lengths %v: no keys, yet sequence %d takes %d splits", lengths, b, c)
				case total > 0 && c < most && c*total < share:
					t.Fatalf("lengths %v: sequence %d's %d tiles of %d take %d splits, fewer than its share", lengths, b, tiles[b], total, c)
				case total > 0 && c > 1 && (c-1)*total >= share:
					t.Fatalf("lengths %v: sequence %d's %d tiles of %d take %d splits, more than its share", lengths, b, tiles[b], total, c)
				case trial%5 == 0 && c != n:
					t.Fatalf("equal lengths: sequence %d takes %d splits, the plan %d", b, c, n)
				}
				sum += c
			}
			if items := s.HeadsKV * p.RowTiles; sum*items > p.Grid[0] {
				t.Fatalf("%v, lengths %v: %d splits of %d items each, grid %d", p, lengths, sum, items, p.Grid[0])
			}
		}
	}
}
