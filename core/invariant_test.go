package core

import (
	"errors"
	"math/rand/v2"
	"testing"
)

// a100 is a device of 108 SMs without clusters, beside H200's 132 with them.
var a100 = Device{SMs: 108}

// invariantPath is what decides a sequence's bits in a batch-invariant
// plan: the stage-1 kernel, the tile budget, the window's cap, its split
// count and the kernel that merges them ("" for one split, which stage 1
// writes itself).
type invariantPath struct {
	kernel         string
	tiles, span, n int
	combine        string
}

func pathOf(t *testing.T, s Shape, d Device, b, length int) invariantPath {
	t.Helper()
	p, err := MakePlan(s, d)
	if err != nil {
		t.Fatalf("%+v on %d SMs: %v", s, d.SMs, err)
	}
	lengths := make([]int, s.Batch)
	lengths[b] = length
	n := p.InvariantSplitCounts(s, lengths)[b]
	path := invariantPath{kernel: p.Variant.Kernel, tiles: p.InvariantTiles, span: p.InvariantSpanTiles, n: n}
	if n > 1 {
		if p.Merge != MergeInvariant {
			t.Fatalf("%+v: %d splits merged by %v", s, n, p.Merge)
		}
		path.combine = p.Combine
	}
	if n > p.Grid[0] || p.Grid[1] != s.HeadsKV*p.RowTiles || p.Grid[2] != s.Batch {
		t.Fatalf("%+v: %d splits in grid %v", s, n, p.Grid)
	}
	return path
}

// TestInvariantPlanAcrossBatches plans one sequence's layout alone and in
// batches of 1-256 with other bounds (the cache, max_seqlen_k) and on
// 132 and 108 SMs: its kernels, tile budget, split count and merge are
// always the same.
func TestInvariantPlanAcrossBatches(t *testing.T) {
	r := rand.New(rand.NewPCG(6, 5))
	layouts := []struct {
		name string
		s    Shape
	}{
		{"GQA 4 d128 f16", Shape{DType: Float16, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128}},
		{"MQA d64 bf16, 4 tokens", Shape{DType: BFloat16, SeqlenQ: 4, HeadsQ: 16, HeadsKV: 1, HeadDim: 64}},
		{"GQA 8 d256, 4 tokens (2 row tiles)", Shape{DType: Float16, SeqlenQ: 4, HeadsQ: 64, HeadsKV: 8, HeadDim: 256}},
		{"paged", Shape{DType: Float16, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, Serving: true, Paged: true}},
		{"paged, appending 2", Shape{DType: BFloat16, SeqlenQ: 2, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, Serving: true, Paged: true, SeqlenNew: 2}},
		{"serving, 32-row, window", Shape{DType: Float16, SeqlenQ: 4, HeadsQ: 64, HeadsKV: 8, HeadDim: 128, Serving: true, WindowKeys: 1029}},
		{"serving, rotary append", Shape{DType: Float16, SeqlenQ: 1, HeadsQ: 8, HeadsKV: 8, HeadDim: 96, Serving: true, SeqlenNew: 1, RotaryQ: true}},
	}
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			for _, length := range []int{0, 1, 63, 511, 512, 513, 4096, 40000, 131072 - 8, 1 << 20} {
				alone := l.s
				alone.Batch, alone.SeqlenCache, alone.Seqlen, alone.BatchInvariant = 1, length+l.s.SeqlenNew, -1, true
				want := pathOf(t, alone, H200, 0, length)
				for range 12 {
					s := alone
					s.Batch = 1 + r.IntN(256)
					s.SeqlenCache += r.IntN(2) * r.IntN(1<<18)
					s.DeviceLengths = r.IntN(2) == 0
					if s.DeviceLengths && r.IntN(2) == 0 { // a max_seqlen_k bound at or above the length
						s.Seqlen = length + r.IntN(s.SeqlenCache-length-l.s.SeqlenNew+1)
					}
					d := H200
					if r.IntN(2) == 0 {
						d = a100
					}
					if got := pathOf(t, s, d, r.IntN(s.Batch), length); got != want {
						t.Fatalf("length %d in %+v on %d SMs: %+v; alone %+v", length, s, d.SMs, got, want)
					}
				}
			}
		})
	}
}

// TestInvariantTiles works the tile budget's examples (docs/tuning.md).
func TestInvariantTiles(t *testing.T) {
	for _, tt := range []struct {
		name        string
		s           Shape
		tiles, keys int
	}{
		// 256 KiB of 512-byte keys (K and V rows at head dim 128): 512 keys.
		{"d128 GQA 4", Shape{DType: Float16, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128}, 8, 512},
		{"d64 MQA", Shape{DType: Float16, SeqlenQ: 1, HeadsQ: 16, HeadsKV: 1, HeadDim: 64}, 8, 1024},
		// 16 rows a block: 64 keys a row, 1024 keys.
		{"d128 GQA 8, 2 tokens", Shape{DType: Float16, SeqlenQ: 2, HeadsQ: 64, HeadsKV: 8, HeadDim: 128}, 16, 1024},
		{"d256 GQA 8", Shape{DType: BFloat16, SeqlenQ: 1, HeadsQ: 64, HeadsKV: 8, HeadDim: 256}, 16, 512},
		// 32 rows a block: 2048 keys.
		{"d128 GQA 8, 4 tokens", Shape{DType: Float16, SeqlenQ: 4, HeadsQ: 64, HeadsKV: 8, HeadDim: 128}, 32, 2048},
	} {
		tt.s.Batch, tt.s.SeqlenCache, tt.s.Seqlen, tt.s.BatchInvariant = 3, 1<<20, -1, true
		p, err := MakePlan(tt.s, H200)
		if err != nil {
			t.Fatal(err)
		}
		if p.InvariantTiles != tt.tiles || p.InvariantTiles*p.Variant.KeysPerTile != tt.keys {
			t.Errorf("%s: %d tiles of %d keys, want %d tiles, %d keys", tt.name, p.InvariantTiles, p.Variant.KeysPerTile, tt.tiles, tt.keys)
		}
		// 1M keys: past MaxSplits of the budget, the longest takes MaxSplits.
		if p.NumSplits != MaxSplits || p.Merge != MergeInvariant || p.Combine != BalancedCombine(p.Variant.Combine) {
			t.Errorf("%s: %v", tt.name, p)
		}
	}
}

// TestInvariantSplits checks the count rule: one split up to the budget,
// a split a budget after, never past MaxSplits nor the bound's count, and
// no split longer than the budget but where MaxSplits would not do.
func TestInvariantSplits(t *testing.T) {
	for _, per := range []int{1, 8, 32} {
		for tiles := 0; tiles <= 3*MaxSplits*per; tiles++ {
			n := invariantSplits(tiles, per)
			bound := max(1, min(MaxSplits, ceilDiv(tiles, per)))
			switch {
			case n < 1 || n > bound:
				t.Fatalf("%d tiles at %d a split: %d splits, outside [1, %d]", tiles, per, n, bound)
			case tiles <= MaxSplits*per && n != max(1, ceilDiv(tiles, per)):
				t.Fatalf("%d tiles at %d a split: %d splits", tiles, per, n)
			case ceilDiv(tiles, n) > max(per, ceilDiv(tiles, MaxSplits)):
				t.Fatalf("%d tiles at %d a split: %d splits, a split past the budget", tiles, per, n)
			}
		}
	}
}

// TestInvariantPlan checks a plan's shape: one split writes out itself,
// more merge through the 4-warp combine's balanced twin, whatever the
// split count; a window caps the count; num_splits is refused.
func TestInvariantPlan(t *testing.T) {
	s := Shape{DType: Float16, Batch: 4, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 512, Seqlen: -1,
		BatchInvariant: true, DeviceLengths: true}
	p, err := MakePlan(s, H200)
	if err != nil || p.Merge != MergeNone || p.NumSplits != 1 || p.WorkspaceBytes != 0 || p.CombineGrid != 0 || p.InvariantTiles != 8 {
		t.Fatalf("512 keys: %v, %v", p, err)
	}
	for _, keys := range []int{513, 4096, 32768, 1 << 20} {
		s.SeqlenCache = keys
		p, err := MakePlan(s, H200)
		if err != nil || p.Merge != MergeInvariant || p.Combine != "fd_combine_f16_bal" || p.CombineGrid != 4*32 ||
			p.NumSplits != min(MaxSplits, ceilDiv(keys, 512)) || p.Grid != [3]int{p.NumSplits, 8, 4} {
			t.Fatalf("%d keys: %v, %v", keys, p, err)
		}
	}
	s.SeqlenCache, s.Serving, s.WindowKeys = 1<<20, true, 4097 // 65 tiles of 64 keys, one more unaligned
	if p, err := MakePlan(s, H200); err != nil || p.InvariantSpanTiles != 66 || p.NumSplits != 9 {
		t.Fatalf("a window: %v, %v", p, err)
	}
	s.NumSplits = 4
	var e *Error
	if _, err := MakePlan(s, H200); !errors.Is(err, ErrInvalid) || !errors.As(err, &e) || e.Arg != "num_splits" {
		t.Fatalf("num_splits with batch_invariant: %v", err)
	}
}

// TestInvariantSplitCounts follows the kernels' clamps: a length past the
// cache counts the cache, the new tokens count, and the plan's NumSplits
// caps a length past its bound.
func TestInvariantSplitCounts(t *testing.T) {
	s := Shape{DType: Float16, Batch: 5, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 8192, Seqlen: 1024,
		Serving: true, SeqlenNew: 1, BatchInvariant: true, DeviceLengths: true}
	p, err := MakePlan(s, H200)
	if err != nil {
		t.Fatal(err)
	}
	got := p.InvariantSplitCounts(s, []int{0, 511, 512, 1023, 9000})
	if want := []int{1, 1, 2, 2, 3}; len(got) != len(want) || got[0] != want[0] || got[1] != want[1] || got[2] != want[2] ||
		got[3] != want[3] || got[4] != want[4] {
		t.Errorf("counts %v, want %v (a bound of 1025 keys: 3 splits at most)", got, want)
	}
	if p.InvariantSplitCounts(s, []int{1}) != nil {
		t.Error("counts for the wrong batch")
	}
}

func TestLayoutBatchInvariant(t *testing.T) {
	l := denseLayout()
	l.BatchInvariant = 1
	p, err := l.Problem()
	if err != nil || !p.BatchInvariant || !p.PlanShape().BatchInvariant {
		t.Fatalf("Problem() = %+v, %v", p, err)
	}
	if back := LayoutOf(&p); back.BatchInvariant != 1 {
		t.Errorf("LayoutOf lost batch_invariant: %+v", back)
	}
}
