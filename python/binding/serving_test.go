package binding

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// servingDense is dense(n) as PrepareServing's layout: no serving feature.
func servingDense(n int) servingLayout {
	d := dense(n)
	s := d.strides
	return servingLayout{DType: d.dtype, Batch: d.batch, SeqlenQ: d.seqlenQ, HeadsQ: d.headsQ, HeadsKV: d.headsKV,
		HeadDim: d.headDim, SeqlenCache: d.seqlenCache, NumSplits: d.numSplits,
		Q: [4]int64(s[0:4]), KCache: [4]int64(s[4:8]), VCache: [4]int64(s[8:12]), Out: [4]int64(s[12:16]),
		DefaultScale: true, Window: [2]int{-1, -1}}
}

func (l servingLayout) text(t *testing.T) string {
	t.Helper()
	b, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func (l servingLayout) prepare(t *testing.T) (int, error) {
	t.Helper()
	return PrepareServing(l.text(t), 0)
}

// Edits of servingDense(512) that turn one serving feature on, as the torch
// layer sends them (k_cache / v_cache rows of 8 heads x 128).
const kv = 8 * 128

func paged(l *servingLayout) {
	l.PageSize, l.NumPages, l.MaxPages, l.SeqlenCache = 16, 64, 8, 128
	l.KCache = [4]int64{16 * kv, kv, 128, 1}
	l.VCache = l.KCache
	l.BlockTable = [2]int64{8, 1}
}

func appended(l *servingLayout) {
	l.SeqlenNew = 2
	l.K = [4]int64{2 * kv, kv, 128, 1}
	l.V = l.K
}

func rotary(l *servingLayout) {
	appended(l)
	l.RotaryDim, l.RotaryRows, l.RotaryInterleaved = 64, 4096, true
	l.RotaryCos = [2]int64{32, 1}
	l.RotarySin = l.RotaryCos
}

// PrepareServing turns each JSON field into its core.Problem field.
func TestPrepareServingProblem(t *testing.T) {
	l0 := servingDense(512)
	base, err := l0.problem()
	if err != nil {
		t.Fatal(err)
	}
	newTensor := core.Tensor{BatchStride: 2 * kv, SeqStride: kv, HeadStride: 128}
	for _, tt := range []struct {
		name string
		edit func(*servingLayout)
		want func(*core.Problem)
	}{
		{"plain", func(*servingLayout) {}, func(*core.Problem) {}},
		{"paged", paged, func(p *core.Problem) {
			p.PageSize, p.NumPages, p.MaxPages, p.SeqlenCache, p.BlockTableStride = 16, 64, 8, 128, 8
			p.K = core.Tensor{BatchStride: 16 * kv, SeqStride: kv, HeadStride: 128}
			p.V = p.K
		}},
		{"cache_batch_idx", func(l *servingLayout) { l.CacheBatch = 4 }, func(p *core.Problem) { p.CacheBatch = 4 }},
		{"cache_leftpad", func(l *servingLayout) { l.Leftpad = true }, func(p *core.Problem) { p.Leftpad = true }},
		{"window", func(l *servingLayout) { l.Window = [2]int{64, 0} },
			func(p *core.Problem) { p.Window = core.Window{Enabled: true, Left: 64, Right: 0} }},
		{"window right only", func(l *servingLayout) { l.Window = [2]int{-1, 16} },
			func(p *core.Problem) { p.Window = core.Window{Enabled: true, Left: -1, Right: 16} }},
		{"window (-1, -1) is off", func(l *servingLayout) { l.Window = [2]int{-1, -1} }, func(*core.Problem) {}},
		{"softcap", func(l *servingLayout) { l.Softcap = 30 }, func(p *core.Problem) { p.Softcap = 30 }},
		{"alibi per head", func(l *servingLayout) { l.Alibi, l.AlibiSlopes = true, [2]int64{0, 1} },
			func(p *core.Problem) { p.Alibi = true }},
		{"alibi per sequence", func(l *servingLayout) { l.Alibi, l.AlibiSlopes = true, [2]int64{32, 1} },
			func(p *core.Problem) { p.Alibi, p.AlibiBatchStride = true, 32 }},
		{"append", appended, func(p *core.Problem) { p.New = core.Append{K: newTensor, V: newTensor, Seqlen: 2} }},
		{"rotary", rotary, func(p *core.Problem) {
			p.New = core.Append{K: newTensor, V: newTensor, Seqlen: 2}
			p.Rotary = core.Rotary{Stride: 32, Dim: 64, Rows: 4096, Interleaved: true}
		}},
		{"rotary not interleaved", func(l *servingLayout) { rotary(l); l.RotaryInterleaved = false }, func(p *core.Problem) {
			p.New = core.Append{K: newTensor, V: newTensor, Seqlen: 2}
			p.Rotary = core.Rotary{Stride: 32, Dim: 64, Rows: 4096}
		}},
		{"explicit scale, causal", func(l *servingLayout) { l.Scale, l.DefaultScale, l.Causal = 0.125, false, true },
			func(p *core.Problem) { p.Scale, p.Causal = 0.125, true }},
		{"paged append", func(l *servingLayout) { paged(l); appended(l) }, func(p *core.Problem) {
			p.PageSize, p.NumPages, p.MaxPages, p.SeqlenCache, p.BlockTableStride = 16, 64, 8, 128, 8
			p.K = core.Tensor{BatchStride: 16 * kv, SeqStride: kv, HeadStride: 128}
			p.V = p.K
			p.New = core.Append{K: newTensor, V: newTensor, Seqlen: 2}
		}},
	} {
		l := servingDense(512)
		tt.edit(&l)
		h, err := l.prepare(t)
		if err != nil {
			t.Errorf("%s: %v", tt.name, err)
			continue
		}
		want := base
		tt.want(&want)
		r, err := prepared.get(h)
		if err != nil {
			t.Fatal(err)
		}
		if got := r.Problem(); got != want {
			t.Errorf("%s: prepared\n%+v\nwant\n%+v", tt.name, got, want)
		}
		if again, _ := l.prepare(t); again != h {
			t.Errorf("%s: handles %d, then %d for the same layout", tt.name, h, again)
		}
	}
}

// A layout with no serving feature is Prepare's: the same problem, so the
// same handle; each feature makes a layout of its own.
func TestPrepareServingHandles(t *testing.T) {
	plain, err := dense(512).prepare()
	if err != nil {
		t.Fatal(err)
	}
	if h, err := servingDense(512).prepare(t); h != plain || err != nil {
		t.Errorf("the plain layout: handle %d, %v; Prepare's is %d", h, err, plain)
	}
	// Fields left out of the JSON keep the plain decode's values.
	l := servingDense(512)
	text := strings.NewReplacer(`,"default_scale":true`, "", `,"window_size":[-1,-1]`, "").Replace(l.text(t))
	if h, err := PrepareServing(text, 0); h != plain || err != nil {
		t.Errorf("without default_scale and window_size: handle %d, %v; Prepare's is %d (JSON %s)", h, err, plain, text)
	}
	seen := map[int]string{plain: "plain"}
	for name, edit := range map[string]func(*servingLayout){
		"paged": paged, "append": appended, "rotary": rotary,
		"cache_batch_idx": func(l *servingLayout) { l.CacheBatch = 4 },
		"cache_leftpad":   func(l *servingLayout) { l.Leftpad = true },
		"window":          func(l *servingLayout) { l.Window = [2]int{64, 0} },
		"softcap":         func(l *servingLayout) { l.Softcap = 30 },
		"alibi":           func(l *servingLayout) { l.Alibi, l.AlibiSlopes = true, [2]int64{0, 1} },
	} {
		l := servingDense(512)
		edit(&l)
		h, err := l.prepare(t)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if other, ok := seen[h]; ok {
			t.Errorf("%s and %s share handle %d", name, other, h)
		}
		seen[h] = name
	}
}

// PrepareServing refuses what only the binding sees, naming the argument as
// Python knows it: malformed JSON, a last stride that is not 1 (of a tensor
// the layout uses), rotary tables of two layouts, and float options that do
// not survive the conversion to float32.
func TestPrepareServingChecks(t *testing.T) {
	for _, tt := range []struct {
		name string
		edit func(*servingLayout)
		arg  string // "": valid
		want error
	}{
		{"q last stride", func(l *servingLayout) { l.Q[3] = 2 }, "q", core.ErrInvalid},
		{"k_cache last stride", func(l *servingLayout) { l.KCache[3] = 0 }, "k_cache", core.ErrInvalid},
		{"v_cache last stride", func(l *servingLayout) { l.VCache[3] = -1 }, "v_cache", core.ErrInvalid},
		{"out last stride", func(l *servingLayout) { l.Out[3] = 8 }, "out", core.ErrInvalid},
		{"k last stride", func(l *servingLayout) { appended(l); l.K[3] = 2 }, "k", core.ErrInvalid},
		{"v last stride", func(l *servingLayout) { appended(l); l.V[3] = 2 }, "v", core.ErrInvalid},
		{"block_table last stride", func(l *servingLayout) { paged(l); l.BlockTable[1] = 2 }, "block_table", core.ErrInvalid},
		{"alibi_slopes last stride", func(l *servingLayout) { l.Alibi, l.AlibiSlopes = true, [2]int64{0, 2} }, "alibi_slopes", core.ErrInvalid},
		{"rotary_cos last stride", func(l *servingLayout) { rotary(l); l.RotaryCos[1] = 2 }, "rotary_cos", core.ErrInvalid},
		{"rotary_sin last stride", func(l *servingLayout) { rotary(l); l.RotarySin = [2]int64{64, 2} }, "rotary_sin", core.ErrInvalid},
		{"rotary_sin row stride", func(l *servingLayout) { rotary(l); l.RotarySin[0] = 64 }, "rotary_sin", core.ErrInvalid},
		{"unused last strides are not read", func(l *servingLayout) {
			l.K[3], l.V[3], l.BlockTable[1], l.AlibiSlopes[1], l.RotaryCos[1], l.RotarySin[1] = 0, 0, 0, 2, 3, 3
		}, "", nil},
		{"scale rounds to 0", func(l *servingLayout) { l.Scale, l.DefaultScale = 1e-50, false }, "softmax_scale", core.ErrInvalid},
		{"softcap rounds to 0", func(l *servingLayout) { l.Softcap = 1e-50 }, "softcap", core.ErrInvalid},
		{"softcap past float32", func(l *servingLayout) { l.Softcap = 1e39 }, "softcap", core.ErrInvalid},
		{"heads not a multiple", func(l *servingLayout) { paged(l); l.HeadsQ, l.HeadsKV = 12, 5 }, "nheads_q", core.ErrInvalid},
		{"seqlen_q 17", func(l *servingLayout) { appended(l); l.SeqlenQ = 17 }, "seqlen_q", core.ErrUnsupported},
	} {
		l := servingDense(512)
		tt.edit(&l)
		_, err := l.prepare(t)
		if tt.want == nil {
			if err != nil {
				t.Errorf("%s: %v", tt.name, err)
			}
			continue
		}
		checkErr(t, tt.name, err, tt.arg, tt.want)
	}
	for name, text := range map[string]string{
		"not JSON":         `{"batch": 1,`,
		"unknown field":    `{"batch": 1, "block_tables": [8, 1]}`,
		"wrong type":       `{"batch": "1"}`,
		"int out of range": `{"window_size": [1e30, 0]}`,
	} {
		_, err := PrepareServing(text, 0)
		checkErr(t, name, err, "layout", core.ErrInvalid)
	}
}

// WorkspaceServing and RunServing take only handles that a Prepare gave,
// and RunServing checks the addresses before any GPU work.
func TestRunServingChecks(t *testing.T) {
	l := servingDense(4096)
	appended(&l)
	h, err := l.prepare(t)
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range []int{-1, 1 << 30} {
		_, err := RunServing(bad, -1, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 16, 16, 0, 0, 0, 0, 0)
		checkErr(t, "RunServing with a bad handle", err, "handle", core.ErrInvalid)
		_, err = WorkspaceServing(bad, -1)
		checkErr(t, "WorkspaceServing with a bad handle", err, "handle", core.ErrInvalid)
	}
	_, err = RunServing(h, -1, 0, 1<<20, 1<<24, 1<<26, 0, 0, 0, 0, 0, 0, 1<<28, 1<<29, 0, 0, 0, 0, 0)
	checkErr(t, "RunServing with a null q", err, "q", core.ErrInvalid)
	_, err = WorkspaceServing(h, 4097)
	checkErr(t, "WorkspaceServing past the cache", err, "cache_seqlens", core.ErrInvalid)
}

// A panic inside the serving functions comes back as their error.
func TestServingPanicIsAnError(t *testing.T) {
	saved := prepared.table.Load()
	defer prepared.table.Store(saved)
	prepared.table.Store(&[]*cuda.Prepared{nil}) // handle 0: a nil layout, which panics when used
	_, runErr := RunServing(0, -1, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
	_, wsErr := WorkspaceServing(0, -1)
	for name, err := range map[string]error{"RunServing": runErr, "WorkspaceServing": wsErr} {
		if err == nil || !strings.Contains(err.Error(), "internal error") || errors.Is(err, core.ErrInvalid) {
			t.Errorf("%s on a nil layout: %v", name, err)
		}
	}
}

// TestPlanServing checks PlanServing against the core's plans of the same
// serving shapes (on an H200 without a GPU), pages of a multiple of 8 keys
// without a window in the paged form, and that it refuses what the planner
// refuses.
func TestPlanServing(t *testing.T) {
	base := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128,
		SeqlenCache: 32768, Seqlen: -1, Serving: true}
	tests := []struct {
		name                   string
		seqlenNew, left, right int
		rotary                 bool
		pageSize               int
		kernel                 string // the stage-1 kernel's name starts with it
		want                   func(s core.Shape) core.Shape
	}{
		{"serving kernels alone", 0, -1, -1, false, 0, "fd_split_kv_serving_", func(s core.Shape) core.Shape { return s }},
		{"append", 1, -1, -1, false, 0, "fd_split_kv_append_", func(s core.Shape) core.Shape { s.SeqlenNew, s.Contiguous = 1, true; return s }},
		{"append with rotary", 4, -1, -1, true, 0, "fd_split_kv_serving_", func(s core.Shape) core.Shape {
			s.SeqlenNew, s.RotaryQ, s.Contiguous = 4, true, true
			return s
		}},
		{"append with rotary and a window", 4, 1000, 0, true, 0, "fd_split_kv_serving_", func(s core.Shape) core.Shape {
			s.SeqlenNew, s.RotaryQ, s.WindowKeys = 4, true, 1000+1+1
			return s
		}},
		{"left window", 0, 1000, 0, false, 0, "fd_split_kv_serving_", func(s core.Shape) core.Shape { s.WindowKeys = 1000 + 1 + 1; return s }},
		{"right window only", 0, -1, 5, false, 0, "fd_split_kv_serving_", func(s core.Shape) core.Shape { return s }},
		{"pages of 16", 0, -1, -1, false, 16, "fd_split_kv_paged_", func(s core.Shape) core.Shape { s.Paged = true; return s }},
		{"pages of 16, append with rotary", 1, -1, -1, true, 16, "fd_split_kv_paged_f16", func(s core.Shape) core.Shape { s.SeqlenNew, s.RotaryQ, s.Paged = 1, true, true; return s }},
		{"pages of 1", 0, -1, -1, false, 1, "fd_split_kv_serving_", func(s core.Shape) core.Shape { return s }},
		{"pages of 16 with a window", 0, 1000, 0, false, 16, "fd_split_kv_serving_", func(s core.Shape) core.Shape { s.WindowKeys = 1000 + 1 + 1; return s }},
	}
	for _, tt := range tests {
		got, err := PlanServing(1, 1, 1, 32, 8, 128, 32768, -1, 0, tt.seqlenNew, tt.left, tt.right, tt.rotary, tt.pageSize, -1, false)
		if err != nil {
			t.Fatalf("%s: %v", tt.name, err)
		}
		want, err := cuda.PlanFor(tt.want(base), -1)
		if err != nil {
			t.Fatal(err)
		}
		wantJSON, _ := json.Marshal(want)
		if got != string(wantJSON) || !strings.Contains(got, `"kernel":"`+tt.kernel) {
			t.Errorf("%s: PlanServing = %s\nwant %s", tt.name, got, wantJSON)
		}
	}
	if _, err := PlanServing(1, 1, 1, 32, 8, 128, 32768, -1, 0, 0, -1, -1, true, 0, -1, false); !errors.Is(err, core.ErrInvalid) {
		t.Errorf("rotary without an append: %v, want ErrInvalid", err)
	}
	if _, err := PlanServing(1, 1, 1, 32, 8, 128, 1024, -1, 0, 2000, -1, -1, false, 0, -1, false); !errors.Is(err, core.ErrInvalid) {
		t.Errorf("more new tokens than the cache holds: %v, want ErrInvalid", err)
	}
}
