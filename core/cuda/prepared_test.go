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
			d, err := getDevice(0)
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
