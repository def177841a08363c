package cuda

import (
	"errors"
	"reflect"
	"runtime"
	"testing"

	"github.com/flash-decode/flash-decode/core"
	"gorgonia.org/cu"
)

// A valid layout: b=2, 32/8 heads, d128, 4096 cached tokens, contiguous.
func preparedLayout() core.Problem {
	s := core.Shape{DType: core.Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1}
	q := core.Tensor{BatchStride: 32 * 128, HeadStride: 128}
	kv := core.Tensor{BatchStride: 4096 * 8 * 128, SeqStride: 8 * 128, HeadStride: 128}
	return core.Problem{Shape: s, Q: q, K: kv, V: kv, Out: q}
}

// checkErr fails t unless err wraps want and names arg.
func checkErr(t *testing.T, what string, err error, arg string, want error) {
	t.Helper()
	var e *core.Error
	if !errors.Is(err, want) || !errors.As(err, &e) || e.Arg != arg {
		t.Errorf("%s: err = %v, want %v naming %s", what, err, want, arg)
	}
}

// Prepare and the checks Run makes before touching a GPU need none, so
// they run in CI.
func TestPrepareWithoutGPU(t *testing.T) {
	p := preparedLayout()
	l := core.LayoutOf(&p)
	r, err := Prepare(&l, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Problem(); got.Q.Ptr != 0 || got.Shape != p.Shape || r.Device() != 0 {
		t.Fatalf("Problem() = %+v on device %d", got, r.Device())
	}

	bad := l
	bad.KCache[1] = 8*128 + 4 // not a multiple of 8 elements
	_, err = Prepare(&bad, 0)
	checkErr(t, "bad stride", err, "k_cache", core.ErrUnsupported)
	_, err = Prepare(&l, maxDevices)
	checkErr(t, "device past the last", err, "device", core.ErrInvalid)
	_, err = Prepare(nil, 0)
	checkErr(t, "nil layout", err, "layout", core.ErrInvalid)

	ok := Args{Q: 0x10000, K: 0x1000000, V: 0x3000000, Out: 0x20000}
	for _, tt := range []struct {
		name   string
		edit   func(*Args)
		seqlen int
		arg    string
		want   error
	}{
		{"null q", func(a *Args) { a.Q = 0 }, -1, "q", core.ErrInvalid},
		{"misaligned v", func(a *Args) { a.V += 8 }, -1, "v_cache", core.ErrUnsupported},
		{"null out", func(a *Args) { a.Out = 0 }, -1, "out", core.ErrInvalid},
		{"misaligned lse", func(a *Args) { a.LSE = 0x50002 }, -1, "lse", core.ErrInvalid},
		{"seqlen past the cache", func(a *Args) {}, 4097, "cache_seqlens", core.ErrInvalid},
		{"negative seqlen", func(a *Args) {}, -2, "cache_seqlens", core.ErrInvalid},
		// Small values would sit in pointer-typed words of the kernels' parameters.
		{"q at 16", func(a *Args) { a.Q = 16 }, -1, "q", core.ErrInvalid},
		{"lse at 4", func(a *Args) { a.LSE = 4 }, -1, "lse", core.ErrInvalid},
		{"cache_seqlens at 4092", func(a *Args) { a.CacheSeqlens = 4092 }, -1, "cache_seqlens", core.ErrInvalid},
		{"workspace at 16", func(a *Args) { a.Workspace = 16 }, -1, "workspace", core.ErrInvalid},
	} {
		a := ok
		tt.edit(&a)
		_, err := r.Run(&a, tt.seqlen, 0)
		checkErr(t, tt.name, err, tt.arg, tt.want)
		_, err = DecodeLayout(&l, 0, &a, tt.seqlen, 0)
		checkErr(t, tt.name+" (DecodeLayout)", err, tt.arg, tt.want)
	}
	dl := l
	dl.DeviceLengths = 1
	r, err = Prepare(&dl, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = r.Run(&ok, -1, 0)
	checkErr(t, "device lengths without cache_seqlens", err, "cache_seqlens", core.ErrInvalid)
	_, err = r.Run(&ok, -2, 0)
	checkErr(t, "a negative bound", err, "max_seqlen_k", core.ErrInvalid)
}

// A layout prepared without a GPU (device -1) plans for core.H200, as
// PlanFor does, at each call's seqlen, and refuses to run.
func TestPrepareForNoDevice(t *testing.T) {
	p := preparedLayout()
	p.DeviceLengths = true
	l := core.LayoutOf(&p)
	r, err := Prepare(&l, -1)
	if err != nil {
		t.Fatal(err)
	}
	if r.Device() != -1 {
		t.Errorf("Device() = %d", r.Device())
	}
	for _, tt := range []struct{ seqlen, planned int }{{-1, -1}, {0, 0}, {300, 512}, {512, 512}, {3000, 4096}, {9999, 4096}} {
		pl, err := r.Plan(tt.seqlen)
		s := p.PlanShape()
		s.Seqlen = tt.planned
		want, werr := PlanFor(s, -1)
		if err != nil || werr != nil || !reflect.DeepEqual(pl, want) {
			t.Errorf("Plan(%d) = %v, %v; want PlanFor at %d: %v, %v", tt.seqlen, pl, err, tt.planned, want, werr)
		}
		if ws, err := r.Workspace(tt.seqlen); err != nil || ws != want.WorkspaceBytes {
			t.Errorf("Workspace(%d) = %d, %v; want %d", tt.seqlen, ws, err, want.WorkspaceBytes)
		}
	}
	_, err = r.Run(&Args{Q: 0x10000, K: 0x1000000, V: 0x3000000, Out: 0x20000, CacheSeqlens: 0x50000}, -1, 0)
	checkErr(t, "Run without a device", err, "device", core.ErrInvalid)
	_, err = r.Plan(-2)
	checkErr(t, "Plan at a negative bound", err, "max_seqlen_k", core.ErrInvalid)
}

// TestPrepareServingWithoutGPU: a prepared serving layout keeps its
// features but none of their arrays, and Run checks each call's arrays.
func TestPrepareServingWithoutGPU(t *testing.T) {
	p := preparedLayout()
	p.PageSize, p.NumPages, p.MaxPages, p.BlockTableStride = 16, 600, 256, 256
	p.K.BatchStride, p.V.BatchStride = 16*8*128, 16*8*128
	fresh := core.Tensor{BatchStride: 2 * 8 * 128, SeqStride: 8 * 128, HeadStride: 128}
	p.New = core.Append{K: fresh, V: fresh, Seqlen: 2}
	p.Rotary = core.Rotary{Dim: 64, Rows: 4096, Stride: 32}
	p.Leftpad = true
	l := core.LayoutOf(&p)
	r, err := Prepare(&l, 0)
	if err != nil {
		t.Fatal(err)
	}
	got := r.Problem()
	if got.PageSize != 16 || got.New.Seqlen != 2 || got.Rotary.Dim != 64 || !got.Serving() {
		t.Fatalf("Problem() = %+v", got)
	}
	// Tensors far apart: out shares no byte with another.
	ok := Args{Q: 0x10000, K: 0x1000000, V: 0x3000000, Out: 0x20000, CacheSeqlens: 0x50000,
		BlockTable: 0x10000000, CacheLeftpad: 0x11000000, KNew: 0x12000000, VNew: 0x13000000, RotaryCos: 0x14000000, RotarySin: 0x15000000}
	for _, tt := range []struct {
		name   string
		edit   func(*Args)
		seqlen int
		arg    string
		want   error
	}{
		{"null block_table", func(a *Args) { a.BlockTable = 0 }, -1, "block_table", core.ErrInvalid},
		{"null cache_leftpad", func(a *Args) { a.CacheLeftpad = 0 }, -1, "cache_leftpad", core.ErrInvalid},
		{"cache_batch_idx not in the layout", func(a *Args) { a.CacheBatchIdx = 0x16000000 }, -1, "cache_batch_idx", core.ErrInvalid},
		{"alibi_slopes not in the layout", func(a *Args) { a.AlibiSlopes = 0x16000000 }, -1, "alibi_slopes", core.ErrInvalid},
		{"null k", func(a *Args) { a.KNew = 0 }, -1, "k", core.ErrInvalid},
		{"misaligned v", func(a *Args) { a.VNew += 2 }, -1, "v", core.ErrUnsupported},
		{"null rotary_sin", func(a *Args) { a.RotarySin = 0 }, -1, "rotary_sin", core.ErrInvalid},
		{"rotary_sin at 32", func(a *Args) { a.RotarySin = 32 }, -1, "rotary_sin", core.ErrInvalid},
		{"append without cache_seqlens", func(a *Args) { a.CacheSeqlens = 0 }, -1, "cache_seqlens", core.ErrInvalid},
		{"append past the int seqlen", func(a *Args) { a.CacheSeqlens = 0 }, 4095, "cache_seqlens", core.ErrInvalid},
	} {
		a := ok
		tt.edit(&a)
		_, err := r.Run(&a, tt.seqlen, 0)
		checkErr(t, tt.name, err, tt.arg, tt.want)
	}

	bad := l
	bad.RotaryDim = 24
	_, err = Prepare(&bad, 0)
	checkErr(t, "rotary_dim 24", err, "rotary_dim", core.ErrUnsupported)
}

// TestHandles: the same layout and device get the same handle while held;
// the last Release frees it, and a released handle is refused.
func TestHandles(t *testing.T) {
	var hs Handles
	p := preparedLayout()
	l := core.LayoutOf(&p)
	h, err := hs.Prepare(&l, -1)
	if err != nil || h <= 0 {
		t.Fatalf("Prepare = %d, %v", h, err)
	}
	if h2, err := hs.Prepare(&l, -1); h2 != h || err != nil {
		t.Errorf("the same layout again: %d, %v; want %d", h2, err, h)
	}
	if h3, err := hs.Prepare(&l, 0); h3 == h || err != nil {
		t.Errorf("another device: %d, %v", h3, err)
	}
	causal := l
	causal.Causal = 1
	hc, err := hs.Prepare(&causal, -1)
	if hc == h || err != nil {
		t.Errorf("another layout: %d, %v", hc, err)
	}
	if r, err := hs.Get(h); err != nil || r.Problem().Causal || r.Device() != -1 {
		t.Errorf("Get(%d) = %v, %v", h, r, err)
	}
	for i := 0; i < 2; i++ { // held twice
		if err := hs.Release(h); err != nil {
			t.Fatal(err)
		}
	}
	_, err = hs.Get(h)
	checkErr(t, "Get after the last Release", err, "handle", core.ErrInvalid)
	checkErr(t, "Release again", hs.Release(h), "handle", core.ErrInvalid)
	for _, bad := range []int64{0, -1, 5, 1 << 40} {
		_, err = hs.Get(bad)
		checkErr(t, "Get of a made-up handle", err, "handle", core.ErrInvalid)
	}
	// The freed slot serves a new layout under a new handle.
	if h4, err := hs.Prepare(&l, -1); err != nil || h4 == h || h4&(maxHandles-1) != h&(maxHandles-1) {
		t.Errorf("Prepare after Release = %#x, %v; the old handle was %#x", h4, err, h)
	}
	// Full: a new layout is refused as a limit of the library; held ones still answer.
	full := Handles{limit: 2}
	a, errA := full.Prepare(&l, -1)
	_, errB := full.Prepare(&causal, -1)
	other := l
	other.SeqlenCache, other.KCache[0], other.VCache[0] = 2048, 2048*8*128, 2048*8*128
	_, err = full.Prepare(&other, -1)
	if errA != nil || errB != nil || !errors.Is(err, ErrLimit) || KindOf(err) != KindLimit {
		t.Errorf("a third layout in a table of 2: %v (%v, %v)", err, errA, errB)
	}
	if again, err := full.Prepare(&l, -1); again != a || err != nil {
		t.Errorf("a held layout in a full table: %d, %v", again, err)
	}
	_, err = hs.Prepare(&core.Layout{}, -1)
	checkErr(t, "an empty layout", err, "dtype", core.ErrUnsupported)
	_, err = hs.Prepare(nil, -1)
	checkErr(t, "nil", err, "layout", core.ErrInvalid)
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
			l := core.LayoutOf(&p)
			r, err := Prepare(&l, 0)
			if err != nil {
				b.Fatal(err)
			}
			a := Args{Q: p.Q.Ptr, K: p.K.Ptr, V: p.V.Ptr, Out: p.Out.Ptr, Workspace: ws, WorkspaceBytes: pl.WorkspaceBytes}
			b.ResetTimer()
			for i := range b.N {
				if _, err := r.Run(&a, -1, 0); err != nil {
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
