package core

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// balancedAssignment mirrors kernels/balance.cuh for a balanced plan p of s
// over the given lengths: each sequence's split count (BalancedSplitCounts),
// and for each block of the 1-D grid its (sequence, item, split), or
// sequence -1 past them.
func balancedAssignment(s Shape, p Plan, lengths []int) (counts []int, blocks [][3]int) {
	counts = p.BalancedSplitCounts(s, lengths)
	items := s.HeadsKV * p.RowTiles
	for b, c := range counts {
		for k := range c * items {
			blocks = append(blocks, [3]int{b, k / c, k % c})
		}
	}
	for len(blocks) < p.Grid[0] {
		blocks = append(blocks, [3]int{-1, 0, 0})
	}
	return counts, blocks
}

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
		{"appended tokens count, clamped to the cache", true, []int{-5, 40000}, []int{1, 16}},
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

// Every sequence's key tiles are covered once: each (sequence, item) gets
// splits 0..c-1 of its count c, the grid holds them all, equal lengths
// split as the plan for them does, and no split is far above the balanced
// share.
func TestBalancedAssignment(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	shapes := []Shape{
		{DType: Float16, Batch: 8, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 32768, Seqlen: -1, DeviceLengths: true},
		{DType: Float16, Batch: 3, SeqlenQ: 4, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 65536, Seqlen: -1, DeviceLengths: true},
		{DType: BFloat16, Batch: 5, SeqlenQ: 1, HeadsQ: 16, HeadsKV: 2, HeadDim: 64, SeqlenCache: 131072, Seqlen: -1, DeviceLengths: true},
		{DType: Float16, Batch: 2, SeqlenQ: 2, HeadsQ: 8, HeadsKV: 1, HeadDim: 256, SeqlenCache: 65536, Seqlen: 40000, DeviceLengths: true,
			Serving: true, Paged: true, SeqlenNew: 2},
		{DType: Float16, Batch: 32, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 8192, Seqlen: -1, DeviceLengths: true}, // 1 split
	}
	for _, s := range shapes {
		p, err := MakePlan(s, H200)
		if err != nil {
			t.Fatal(err)
		}
		if p.BalanceSplits == 0 {
			t.Fatalf("%+v: not balanced: %v", s, p)
		}
		for trial := range 200 {
			lengths := make([]int, s.Batch)
			for b := range lengths {
				switch trial % 4 {
				case 0:
					lengths[b] = s.SeqlenCache // equal
				case 1:
					lengths[b] = r.IntN(s.SeqlenCache + 1)
				case 2:
					lengths[b] = []int{0, 1, s.SeqlenCache}[r.IntN(3)]
				default:
					lengths[b] = r.IntN(64) - 8 // short, some negative (clamped)
				}
			}
			counts, blocks := balancedAssignment(s, p, lengths)
			if len(blocks) > p.Grid[0] {
				t.Fatalf("%v, lengths %v: %d blocks of splits, grid %d", p, lengths, len(blocks), p.Grid[0])
			}
			seen := map[[3]int]bool{}
			for _, blk := range blocks {
				if blk[0] < 0 {
					continue
				}
				if seen[blk] {
					t.Fatalf("lengths %v: block %v twice", lengths, blk)
				}
				seen[blk] = true
			}
			items := s.HeadsKV * p.RowTiles
			for b, c := range counts {
				if c < 1 || c > p.NumSplits {
					t.Fatalf("lengths %v: sequence %d takes %d splits (at most %d)", lengths, b, c, p.NumSplits)
				}
				for item := range items {
					for split := range c {
						if !seen[[3]int{b, item, split}] {
							t.Fatalf("lengths %v: sequence %d item %d split %d/%d has no block", lengths, b, item, split, c)
						}
					}
				}
			}
			if trial%4 == 0 {
				for b, c := range counts {
					if c != p.BalanceSplits {
						t.Errorf("equal lengths: sequence %d takes %d splits, the plan %d", b, c, p.BalanceSplits)
					}
				}
			}
		}
	}
}
