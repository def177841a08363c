package binding

import (
	"errors"
	"strings"
	"testing"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// layout is the arguments of Prepare for b=1, 32/8 heads, d128, a cache of
// n tokens, contiguous, the default scale.
type layout struct {
	dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache int
	strides                                                      [16]int64 // q, k_cache, v_cache, out: (batch, seq, head, head_dim)
	scale                                                        float64
	defaultScale, causal                                         bool
	numSplits, device                                            int
}

func dense(n int) layout {
	const q, kv = 32 * 128, 8 * 128
	return layout{dtype: 1, batch: 1, seqlenQ: 1, headsQ: 32, headsKV: 8, headDim: 128, seqlenCache: n,
		strides:      [16]int64{q, q, 128, 1, int64(n * kv), kv, 128, 1, int64(n * kv), kv, 128, 1, q, q, 128, 1},
		defaultScale: true}
}

func (l layout) prepare() (int, error) {
	s := l.strides
	return Prepare(l.dtype, l.batch, l.seqlenQ, l.headsQ, l.headsKV, l.headDim, l.seqlenCache,
		s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11], s[12], s[13], s[14], s[15],
		l.scale, l.defaultScale, l.causal, l.numSplits, l.device, false)
}

func prepare(n int, causal bool) (int, error) {
	l := dense(n)
	l.causal = causal
	return l.prepare()
}

// checkErr fails unless err is an *core.Error naming arg that wraps want.
func checkErr(t *testing.T, what string, err error, arg string, want error) {
	t.Helper()
	var e *core.Error
	if !errors.As(err, &e) || e.Arg != arg || !errors.Is(err, want) {
		t.Errorf("%s: error %v, want one naming %q wrapping %q", what, err, arg, want)
	}
}

func TestPrepareHandles(t *testing.T) {
	a, err := prepare(4096, false)
	if err != nil {
		t.Fatal(err)
	}
	again, _ := prepare(4096, false)
	other, _ := prepare(4096, true)
	if a < 0 || again != a || other == a {
		t.Fatalf("handles %d, %d (same layout), %d (causal)", a, again, other)
	}
	for _, h := range []int{-1, 1 << 30} {
		_, err := Run(h, -1, 16, 16, 16, 16, 0, 0, 0, 0, 0)
		checkErr(t, "Run with a bad handle", err, "handle", core.ErrInvalid)
		_, err = Workspace(h, -1)
		checkErr(t, "Workspace with a bad handle", err, "handle", core.ErrInvalid)
	}
	_, err = Run(a, -1, 0, 16, 16, 16, 0, 0, 0, 0, 0)
	checkErr(t, "Run with a null q", err, "q", core.ErrInvalid)
}

// Prepare refuses what the core refuses, naming the argument as Python
// knows it, and what only the binding sees: the last strides and an
// explicit scale that would read as the default.
func TestPrepareChecks(t *testing.T) {
	for _, tt := range []struct {
		name string
		edit func(*layout)
		arg  string // "": valid
		want error
	}{
		{"valid", func(l *layout) {}, "", nil},
		{"explicit scale", func(l *layout) { l.scale, l.defaultScale = 0.125, false }, "", nil},
		{"default ignores scale", func(l *layout) { l.scale = 1e-50 }, "", nil},
		{"empty cache", func(l *layout) { l.seqlenCache = 0 }, "", nil},
		{"scale rounds to 0", func(l *layout) { l.scale, l.defaultScale = 1e-50, false }, "softmax_scale", core.ErrInvalid},
		{"scale float32 subnormal", func(l *layout) { l.scale, l.defaultScale = 1e-40, false }, "softmax_scale", core.ErrInvalid},
		{"scale 0", func(l *layout) { l.scale, l.defaultScale = 0, false }, "softmax_scale", core.ErrInvalid},
		{"scale negative", func(l *layout) { l.scale, l.defaultScale = -1, false }, "softmax_scale", core.ErrInvalid},
		{"scale past float32", func(l *layout) { l.scale, l.defaultScale = 1e39, false }, "softmax_scale", core.ErrInvalid},
		{"q last stride", func(l *layout) { l.strides[3] = 2 }, "q", core.ErrInvalid},
		{"k_cache last stride", func(l *layout) { l.strides[7] = 0 }, "k_cache", core.ErrInvalid},
		{"v_cache last stride", func(l *layout) { l.strides[11] = -1 }, "v_cache", core.ErrInvalid},
		{"out last stride", func(l *layout) { l.strides[15] = 8 }, "out", core.ErrInvalid},
		{"k_cache seq stride", func(l *layout) { l.strides[5] = 1028 }, "k_cache", core.ErrUnsupported},
		{"heads not a multiple", func(l *layout) { l.headsQ, l.headsKV = 12, 5 }, "nheads_q", core.ErrInvalid},
		{"headdim 100", func(l *layout) { l.headDim = 100 }, "headdim", core.ErrUnsupported},
		{"seqlen_q 17", func(l *layout) { l.seqlenQ = 17 }, "seqlen_q", core.ErrUnsupported},
		{"batch 0", func(l *layout) { l.batch = 0 }, "batch", core.ErrInvalid},
		{"num_splits -1", func(l *layout) { l.numSplits = -1 }, "num_splits", core.ErrInvalid},
		{"cache too long", func(l *layout) { l.seqlenCache = core.MaxSeqlenCache + 1 }, "seqlen_cache", core.ErrUnsupported},
		{"dtype 3", func(l *layout) { l.dtype = 3 }, "dtype", core.ErrUnsupported},
		{"device -1", func(l *layout) { l.device = -1 }, "device", core.ErrInvalid},
	} {
		l := dense(512)
		tt.edit(&l)
		_, err := l.prepare()
		if tt.want == nil {
			if err != nil {
				t.Errorf("%s: %v", tt.name, err)
			}
			continue
		}
		checkErr(t, tt.name, err, tt.arg, tt.want)
	}

	// The default and an explicit 1/sqrt(128) are the same decode, but an
	// explicit scale is never stored as 0, the default's mark.
	def, _ := dense(512).prepare()
	l := dense(512)
	l.scale, l.defaultScale = 0.125, false
	explicit, _ := l.prepare()
	if def == explicit {
		t.Errorf("the default scale and 0.125 share handle %d", def)
	}
}

// Layouts registered from several goroutines while others look handles up:
// every handle stays valid and distinct (run with -race to check the table).
func TestPrepareConcurrent(t *testing.T) {
	const n = 64
	handles := make([]int, n)
	done := make(chan struct{})
	go func() { // a reader: Run on every handle seen so far (a null q: an error before any GPU work)
		defer close(done)
		for range 200 {
			for h := 0; h < n; h++ {
				if _, err := Run(h, -1, 0, 16, 16, 16, 0, 0, 0, 0, 0); err == nil {
					t.Error("Run with a null q succeeded")
					return
				}
			}
		}
	}()
	errs := make(chan error, n)
	for i := range n {
		go func() {
			h, err := prepare(1024+64*i, false)
			handles[i] = h
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	<-done
	seen := map[int]bool{}
	for i, h := range handles {
		if again, _ := prepare(1024+64*i, false); again != h || seen[h] {
			t.Fatalf("layout %d: handle %d, again %d (seen before: %v)", i, h, again, seen[h])
		}
		seen[h] = true
	}
}

// A full table refuses new layouts with an error that is neither
// ErrInvalid nor ErrUnsupported (Python: RuntimeError), and keeps serving
// the layouts it has.
func TestLayoutsFull(t *testing.T) {
	l := layouts{limit: 2}
	problem := func(n int) *core.Problem {
		const q, kv = 32 * 128, 8 * 128
		return &core.Problem{
			Shape: core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: n, Seqlen: -1},
			Q:     core.Tensor{BatchStride: q, SeqStride: q, HeadStride: 128},
			K:     core.Tensor{BatchStride: int64(n * kv), SeqStride: kv, HeadStride: 128},
			V:     core.Tensor{BatchStride: int64(n * kv), SeqStride: kv, HeadStride: 128},
			Out:   core.Tensor{BatchStride: q, SeqStride: q, HeadStride: 128},
		}
	}
	a, errA := l.add(problem(256), 0)
	b, errB := l.add(problem(512), 0)
	if errA != nil || errB != nil || a != 0 || b != 1 {
		t.Fatalf("handles %d, %d: %v, %v", a, b, errA, errB)
	}
	_, err := l.add(problem(1024), 0)
	if !errors.Is(err, errTooManyLayouts) || errors.Is(err, core.ErrInvalid) || errors.Is(err, core.ErrUnsupported) {
		t.Fatalf("a third layout: %v", err)
	}
	if !strings.Contains(err.Error(), "2 are prepared") {
		t.Errorf("message %q does not say the limit", err)
	}
	if again, err := l.add(problem(512), 0); again != b || err != nil {
		t.Errorf("a known layout in a full table: %d, %v", again, err)
	}
	if r, err := l.get(a); err != nil || r.Problem().SeqlenCache != 256 {
		t.Errorf("get(%d): %v", a, err)
	}
	bad := problem(256)
	bad.HeadsKV = 5
	_, err = l.add(bad, 0)
	checkErr(t, "an invalid layout in a full table", err, "nheads_q", core.ErrInvalid)
}

// Workspace answers what PlanFor does for the layout's shape with that
// seqlen: a number on a GPU machine, the same error without one.
func TestWorkspace(t *testing.T) {
	h, err := prepare(4096, false)
	if err != nil {
		t.Fatal(err)
	}
	_, err = Workspace(h, 4097)
	checkErr(t, "seqlen past the cache", err, "cache_seqlens", core.ErrInvalid)
	for _, seqlen := range []int{-1, 0, 100, 4096} {
		shape := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 4096, Seqlen: seqlen}
		pl, planErr := cuda.PlanFor(shape, 0)
		got, err := Workspace(h, seqlen)
		if (err == nil) != (planErr == nil) || (err != nil && err.Error() != planErr.Error()) || (err == nil && got != pl.WorkspaceBytes) {
			t.Errorf("seqlen %d: Workspace %d, %v; PlanFor %d, %v", seqlen, got, err, pl.WorkspaceBytes, planErr)
		}
	}
}

// A panic inside an exported function comes back as its error.
func TestPanicIsAnError(t *testing.T) {
	saved := prepared.table.Load()
	defer prepared.table.Store(saved)
	prepared.table.Store(&[]*cuda.Prepared{nil}) // handle 0: a nil layout, which panics when used
	_, runErr := Run(0, -1, 16, 16, 16, 16, 0, 0, 0, 0, 0)
	_, wsErr := Workspace(0, -1)
	for name, err := range map[string]error{"Run": runErr, "Workspace": wsErr} {
		if err == nil || !strings.Contains(err.Error(), "internal error") || !strings.Contains(err.Error(), "panic") ||
			errors.Is(err, core.ErrInvalid) || errors.Is(err, core.ErrUnsupported) {
			t.Errorf("%s on a nil layout: %v", name, err)
		}
	}
}
