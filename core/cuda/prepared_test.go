package cuda

import (
	"errors"
	"runtime"
	"testing"

	"github.com/flash-decode/flash-decode/core"
	"gorgonia.org/cu"
)

// A valid layout: b=2, 32/8 heads, d128, 4096 cached tokens, contiguous.
func preparedLayout() core.Problem {
	s := core.Shape{DType: core.Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1}
	q := core.Tensor{BatchStride: 32 * 128, SeqStride: 32 * 128, HeadStride: 128}
	kv := core.Tensor{BatchStride: 4096 * 8 * 128, SeqStride: 8 * 128, HeadStride: 128}
	return core.Problem{Shape: s, Q: q, K: kv, V: kv, Out: q}
}

// Prepare and the checks Run makes before touching a GPU need none, so
// they run in CI.
func TestPrepareWithoutGPU(t *testing.T) {
	p := preparedLayout()
	p.Q.Ptr, p.LSE = 0x1000, 0x2000 // addresses are not part of a layout
	r, err := Prepare(&p, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Problem(); got.Q.Ptr != 0 || got.LSE != 0 || got.Shape != p.Shape || r.Device() != 0 {
		t.Fatalf("Problem() = %+v on device %d", got, r.Device())
	}

	bad := preparedLayout()
	bad.K.SeqStride = 8*128 + 4 // not a multiple of 8 elements
	if _, err := Prepare(&bad, 0); !errors.Is(err, core.ErrUnsupported) {
		t.Errorf("bad stride: %v", err)
	}
	if _, err := Prepare(&p, -1); !errors.Is(err, core.ErrInvalid) {
		t.Errorf("device -1: %v", err)
	}

	ok := Args{Q: 0x10000, K: 0x1000000, V: 0x3000000, Out: 0x20000, Seqlen: -1}
	for _, tt := range []struct {
		name string
		edit func(*Args)
		arg  string
		want error
	}{
		{"null q", func(a *Args) { a.Q = 0 }, "q", core.ErrInvalid},
		{"misaligned v", func(a *Args) { a.V += 8 }, "v_cache", core.ErrUnsupported},
		{"null out", func(a *Args) { a.Out = 0 }, "out", core.ErrInvalid},
		{"misaligned lse", func(a *Args) { a.LSE = 0x50002 }, "lse", core.ErrInvalid},
		{"seqlen past the cache", func(a *Args) { a.Seqlen = 4097 }, "cache_seqlens", core.ErrInvalid},
	} {
		a := ok
		tt.edit(&a)
		_, err := r.Run(&a, 0)
		var e *core.Error
		if !errors.Is(err, tt.want) || !errors.As(err, &e) || e.Arg != tt.arg {
			t.Errorf("%s: err = %v, want %v naming %s", tt.name, err, tt.want, tt.arg)
		}
	}
}

// TestPrepareServingWithoutGPU: a prepared serving layout keeps its
// features but none of their arrays, and Run checks each call's arrays.
func TestPrepareServingWithoutGPU(t *testing.T) {
	p := preparedLayout()
	p.PageSize, p.NumPages, p.MaxPages, p.BlockTableStride = 16, 600, 256, 256
	p.K.BatchStride, p.V.BatchStride = 16*8*128, 16*8*128
	fresh := core.Tensor{BatchStride: 2 * 8 * 128, SeqStride: 8 * 128, HeadStride: 128}
	p.New = core.Append{K: fresh, V: fresh, Seqlen: 2}
	p.Rotary = core.Rotary{Dim: 64, Rows: 4096, Stride: 32, Cos: 0x10000000, Sin: 0x11000000}
	p.Leftpad, p.CacheLeftpad = true, 0x12000000
	p.BlockTable = 0x13000000
	r, err := Prepare(&p, 0)
	if err != nil {
		t.Fatal(err)
	}
	got := r.Problem()
	if got.BlockTable != 0 || got.CacheLeftpad != 0 || got.Rotary.Cos != 0 || got.New.K.Ptr != 0 ||
		got.PageSize != 16 || got.New.Seqlen != 2 || got.Rotary.Dim != 64 || !got.Serving() {
		t.Fatalf("Problem() = %+v", got)
	}
	// Tensors far apart: out shares no byte with another.
	ok := Args{Q: 0x10000, K: 0x1000000, V: 0x3000000, Out: 0x20000, CacheSeqlens: 0x50000, Seqlen: -1,
		BlockTable: 0x10000000, CacheLeftpad: 0x11000000, KNew: 0x12000000, VNew: 0x13000000, RotaryCos: 0x14000000, RotarySin: 0x15000000}
	for _, tt := range []struct {
		name string
		edit func(*Args)
		arg  string
		want error
	}{
		{"null block_table", func(a *Args) { a.BlockTable = 0 }, "block_table", core.ErrInvalid},
		{"null cache_leftpad", func(a *Args) { a.CacheLeftpad = 0 }, "cache_leftpad", core.ErrInvalid},
		{"cache_batch_idx not in the layout", func(a *Args) { a.CacheBatchIdx = 0x16000000 }, "cache_batch_idx", core.ErrInvalid},
		{"alibi_slopes not in the layout", func(a *Args) { a.AlibiSlopes = 0x16000000 }, "alibi_slopes", core.ErrInvalid},
		{"null k", func(a *Args) { a.KNew = 0 }, "k", core.ErrInvalid},
		{"misaligned v", func(a *Args) { a.VNew += 2 }, "v", core.ErrUnsupported},
		{"null rotary_sin", func(a *Args) { a.RotarySin = 0 }, "rotary_sin", core.ErrInvalid},
		{"append without cache_seqlens", func(a *Args) { a.CacheSeqlens = 0 }, "cache_seqlens", core.ErrInvalid},
		{"append past the int seqlen", func(a *Args) { a.CacheSeqlens, a.Seqlen = 0, 4095 }, "cache_seqlens", core.ErrInvalid},
	} {
		a := ok
		tt.edit(&a)
		_, err := r.Run(&a, 0)
		var e *core.Error
		if !errors.Is(err, tt.want) || !errors.As(err, &e) || e.Arg != tt.arg {
			t.Errorf("%s: err = %v, want %v naming %s", tt.name, err, tt.want, tt.arg)
		}
	}

	bad := p
	bad.Rotary.Dim = 24
	if _, err := Prepare(&bad, 0); !errors.Is(err, core.ErrUnsupported) {
		t.Errorf("rotary_dim 24: %v", err)
	}
}

// TestPlanForServing: PlanFor plans a Problem's PlanShape without a GPU,
// with the serving kernels, the append and the rotated q's workspace.
func TestPlanForServing(t *testing.T) {
	p := preparedLayout()
	p.New = core.Append{Seqlen: 1, K: p.Q, V: p.Q}
	p.New.K.HeadStride, p.New.K.SeqStride, p.New.K.BatchStride = 128, 8*128, 8*128
	p.Rotary = core.Rotary{Dim: 128, Rows: 4096, Stride: 64}
	p.NumSplits = 1
	pl, err := PlanFor(p.PlanShape(), -1)
	if err != nil {
		t.Fatal(err)
	}
	if pl.Variant.Kernel != "fd_split_kv_serving_f16_d128_r16" || pl.Append != "fd_append_kv_f16" ||
		pl.AppendGrid != [3]int{1, 2, 5} || pl.WorkspaceBytes != 2*32*128*2 || pl.QRotOffset != 0 {
		t.Fatalf("PlanFor = %v", pl)
	}
	// Without rotary, the contiguous cache's appending form: no append kernel, no workspace.
	p.Rotary = core.Rotary{}
	if pl, err = PlanFor(p.PlanShape(), -1); err != nil || pl.Variant.Kernel != "fd_split_kv_append_f16_d128_r16" ||
		pl.Append != "" || !pl.FusedAppend() || pl.WorkspaceBytes != 0 {
		t.Fatalf("PlanFor without rotary = %v, %v", pl, err)
	}
	if plain, err := PlanFor(p.Shape, -1); err != nil || plain.Variant.Form != core.FormPlain || plain.WorkspaceBytes != 0 {
		t.Fatalf("PlanFor(p.Shape) = %v, %v: want the plain plan", plain, err)
	}
}

// BenchmarkPreparedRun measures the host time of one Run (address checks,
// cached plan, context, launches) for b=1, 32/8 heads, d128, with the GPU's
// work excluded: the stream is drained outside the timer every 128 calls.
func BenchmarkPreparedRun(b *testing.B) {
	if n, err := cu.NumDevices(); err != nil || n == 0 {
		b.Skip("no CUDA device")
	}
	for _, bc := range []struct {
		name          string
		cache, splits int
	}{{"256 tokens, 1 split", 256, 1}, {"256 tokens, cluster of 4", 256, 4}, {"4096 tokens, 32 splits + combine", 4096, 32}} {
		b.Run(bc.name, func(b *testing.B) {
			// A sub-benchmark runs on its own goroutine: lock it, make the context current.
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			d, err := getDevice("decode", 0)
			if err != nil {
				b.Fatal(err)
			}
			if err := cu.SetCurrentContext(d.ctx); err != nil {
				b.Fatal(err)
			}
			s := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: bc.cache, Seqlen: -1, NumSplits: bc.splits}
			mem := func(bytes int64) uintptr {
				p, err := cu.MemAlloc(bytes)
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { cu.MemFree(p) })
				return uintptr(p)
			}
			q, kv := mem(32*128*2), mem(int64(bc.cache)*8*128*2)
			p := core.Problem{Shape: s, Q: contiguous(cu.DevicePtr(q), 1, 32, 128), K: contiguous(cu.DevicePtr(kv), bc.cache, 8, 128),
				V: contiguous(cu.DevicePtr(kv), bc.cache, 8, 128), Out: contiguous(cu.DevicePtr(mem(32*128*2)), 1, 32, 128)}
			pl, err := PlanFor(s, 0)
			if err != nil {
				b.Fatal(err)
			}
			ws := uintptr(0)
			if pl.WorkspaceBytes > 0 {
				ws = mem(int64(pl.WorkspaceBytes))
			}
			r, err := Prepare(&p, 0)
			if err != nil {
				b.Fatal(err)
			}
			a := Args{Q: p.Q.Ptr, K: p.K.Ptr, V: p.V.Ptr, Out: p.Out.Ptr, Seqlen: -1, Workspace: ws, WorkspaceBytes: pl.WorkspaceBytes}
			b.ResetTimer()
			for i := range b.N {
				if _, err := r.Run(&a, 0); err != nil {
					b.Fatal(err)
				}
				if i%128 == 127 {
					b.StopTimer()
					if err := cu.Synchronize(); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
			}
			b.ReportMetric(float64(pl.Cluster), "cluster")
		})
	}
}
