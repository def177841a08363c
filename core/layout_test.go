package core

import (
	"errors"
	"math"
	"strings"
	"testing"
	"unsafe"
)

// denseLayout is a valid contiguous layout: b=2, 32/8 heads, d128, 4096
// cached tokens.
func denseLayout() Layout {
	return Layout{DType: 1, Batch: 2, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 4096,
		Q: [4]int64{32 * 128, 32 * 128, 128, 1}, KCache: [4]int64{4096 * 8 * 128, 8 * 128, 128, 1},
		VCache: [4]int64{4096 * 8 * 128, 8 * 128, 128, 1}, Out: [4]int64{32 * 128, 32 * 128, 128, 1},
		WindowLeft: -1, WindowRight: -1}
}

// servingLayout is denseLayout with a paged cache, two appended tokens
// rotated, cache_leftpad, ALiBi, softcap and a window.
func servingLayout() Layout {
	l := denseLayout()
	l.PageSize, l.NumPages, l.MaxPages, l.BlockTable = 16, 600, 256, [2]int64{256, 1}
	l.KCache, l.VCache = [4]int64{16 * 8 * 128, 8 * 128, 128, 1}, [4]int64{16 * 8 * 128, 8 * 128, 128, 1}
	l.SeqlenNew, l.KNew, l.VNew = 2, [4]int64{2 * 8 * 128, 8 * 128, 128, 1}, [4]int64{2 * 8 * 128, 8 * 128, 128, 1}
	l.RotaryDim, l.RotaryRows, l.RotaryCos, l.RotarySin = 64, 4096, [2]int64{32, 1}, [2]int64{32, 1}
	l.Leftpad, l.Alibi, l.AlibiSlopes, l.Softcap = 1, 1, [2]int64{32, 1}, 30
	l.WindowLeft, l.WindowRight = 256, 0
	return l
}

// checkFields checks that fs, 8-byte fields one after another, make a
// record of size bytes.
func checkFields(t *testing.T, fs []LayoutField, size int) {
	t.Helper()
	if got := len(fs) * 8; got != size {
		t.Fatalf("%d fields make %d bytes; the record has %d", len(fs), got, size)
	}
	for i, f := range fs {
		if f.Offset != 8*i {
			t.Errorf("field %d %s at offset %d", i, f.Name, f.Offset)
		}
	}
}

func TestLayoutFieldsFollowTheStruct(t *testing.T) {
	checkFields(t, LayoutFields(), LayoutBytes)
	text := LayoutFieldsText()
	for _, want := range []string{"dtype:q,batch:q,", ",scale:d,q[0]:q,", ",softcap:d,", ",rotary_interleaved:q,", ",k_descale_value:d,v_descale_value:d,"} {
		if !strings.Contains(text, want) {
			t.Errorf("LayoutFieldsText() = %q lacks %q", text, want)
		}
	}
	if !strings.HasPrefix(text, "dtype:q,") || !strings.HasSuffix(text, ",sinks:q,batch_invariant:q,ragged:q,total_q:q") {
		t.Errorf("LayoutFieldsText() = %q", text)
	}
}

func TestLayoutProblem(t *testing.T) {
	l := servingLayout()
	p, err := l.Problem()
	if err != nil {
		t.Fatal(err)
	}
	if p.Seqlen != -1 || p.Q.Ptr != 0 || p.PageSize != 16 || p.New.Seqlen != 2 || p.Rotary.Stride != 32 ||
		!p.Window.Enabled || p.Window.Left != 256 || p.Softcap != 30 || !p.Alibi || p.AlibiBatchStride != 32 ||
		!p.Leftpad || p.BlockTableStride != 256 || p.Scale != 0 {
		t.Fatalf("Problem() = %+v", p)
	}
	want := l
	want.Q[1], want.Out[1] = 0, 0 // seqlen_q 1: normalized
	if back := LayoutOf(&p); back != want {
		t.Errorf("LayoutOf(Problem()) = %+v, want %+v", back, want)
	}
	d := denseLayout()
	if p, err := d.Problem(); err != nil || p.Window.Enabled || p.Serving() {
		t.Errorf("dense: %+v, %v", p, err)
	}
}

// A contiguous tensor whose size-1 dimensions have any stride (as torch
// gives them) is accepted: those strides are normalized.
func TestLayoutNormalizesSizeOneStrides(t *testing.T) {
	l := denseLayout()
	l.Batch, l.HeadsQ, l.HeadsKV, l.HeadDim = 1, 8, 8, 64
	// torch.randn(8, 64, 1).permute(2, 0, 1).unsqueeze(0): strides (1, 1, 64, 1).
	l.Q, l.Out = [4]int64{1, 1, 64, 1}, [4]int64{3, 5, 64, 1}
	l.KCache, l.VCache = [4]int64{7, 8 * 64, 64, 1}, [4]int64{7, 8 * 64, 64, 1}
	p, err := l.Problem()
	if err != nil {
		t.Fatal(err)
	}
	if p.Q != (Tensor{HeadStride: 64}) || p.Out != (Tensor{HeadStride: 64}) || p.K.BatchStride != 0 {
		t.Errorf("strides not normalized: q %+v out %+v k %+v", p.Q, p.Out, p.K)
	}
	s := servingLayout()
	s.MaxPages, s.SeqlenCache, s.BlockTable = 1, 16, [2]int64{3, 9} // one page: its last stride is unread
	s.Batch, s.Q, s.Out = 1, [4]int64{1, 1, 128, 1}, [4]int64{1, 1, 128, 1}
	s.AlibiSlopes = [2]int64{5, 1}
	s.SeqlenNew, s.KNew, s.VNew = 1, [4]int64{3, 3, 128, 1}, [4]int64{3, 3, 128, 1}
	p, err = s.Problem()
	if err != nil {
		t.Fatal(err)
	}
	if p.BlockTableStride != 0 || p.AlibiBatchStride != 0 || p.New.K != (Tensor{HeadStride: 128}) {
		t.Errorf("strides not normalized: %+v", p)
	}
}

func TestLayoutProblemErrors(t *testing.T) {
	for _, tt := range []struct {
		name string
		edit func(*Layout)
		arg  string
		want error
	}{
		{"q's last stride", func(l *Layout) { l.Q[3] = 2 }, "q", ErrInvalid},
		{"k_cache's last stride", func(l *Layout) { l.KCache[3] = 0 }, "k_cache", ErrInvalid},
		{"out's last stride", func(l *Layout) { l.Out[3] = 8 }, "out", ErrInvalid},
		{"k's last stride", func(l *Layout) { l.KNew[3] = 2 }, "k", ErrInvalid},
		{"v's last stride", func(l *Layout) { l.VNew[3] = 2 }, "v", ErrInvalid},
		{"block_table's last stride", func(l *Layout) { l.BlockTable[1] = 2 }, "block_table", ErrInvalid},
		{"alibi_slopes' last stride", func(l *Layout) { l.AlibiSlopes[1] = 2 }, "alibi_slopes", ErrInvalid},
		{"rotary_cos's last stride", func(l *Layout) { l.RotaryCos[1] = 2 }, "rotary_cos", ErrInvalid},
		{"rotary_sin's layout", func(l *Layout) { l.RotarySin[0] = 64 }, "rotary_sin", ErrInvalid},
		{"causal 2", func(l *Layout) { l.Causal = 2 }, "causal", ErrInvalid},
		{"device_lengths -1", func(l *Layout) { l.DeviceLengths = -1 }, "device_lengths", ErrInvalid},
		{"leftpad 3", func(l *Layout) { l.Leftpad = 3 }, "leftpad", ErrInvalid},
		{"alibi 2", func(l *Layout) { l.Alibi = 2 }, "alibi", ErrInvalid},
		{"rotary_interleaved 2", func(l *Layout) { l.RotaryInterleaved = 2 }, "rotary_interleaved", ErrInvalid},
		{"scale rounds to 0", func(l *Layout) { l.Scale = 1e-50 }, "softmax_scale", ErrInvalid},
		{"negative scale", func(l *Layout) { l.Scale = -1 }, "softmax_scale", ErrInvalid},
		{"scale past float32", func(l *Layout) { l.Scale = 1e39 }, "softmax_scale", ErrInvalid},
		{"softcap rounds to 0", func(l *Layout) { l.Softcap = 1e-50 }, "softcap", ErrInvalid},
		{"softcap past float32", func(l *Layout) { l.Softcap = 1e39 }, "softcap", ErrInvalid},
		{"NaN softcap", func(l *Layout) { l.Softcap = math.NaN() }, "softcap", ErrInvalid},
		{"the core's: heads", func(l *Layout) { l.HeadsQ = 12 }, "nheads_q", ErrInvalid},
		{"the core's: head dim", func(l *Layout) { l.HeadDim = 100 }, "headdim", ErrUnsupported},
		{"the core's: a huge batch", func(l *Layout) { l.Batch = 1 << 62 }, "batch", ErrUnsupported},
		{"the core's: stride", func(l *Layout) { l.Q[2] = 4 }, "q", ErrUnsupported},
		{"the core's: window", func(l *Layout) { l.WindowLeft = -2 }, "window_size", ErrInvalid},
		{"the core's: rotary dim", func(l *Layout) { l.RotaryDim = 24 }, "rotary_dim", ErrUnsupported},
		{"a bfloat16 cache for float16", func(l *Layout) { l.KVDType = int64(BFloat16) }, "kv_dtype", ErrUnsupported},
		{"a descale value with a float16 cache", func(l *Layout) { l.VDescaleValue = 2 }, "v_descale", ErrInvalid},
		{"batch_invariant 2", func(l *Layout) { l.BatchInvariant = 2 }, "batch_invariant", ErrInvalid},
		{"batch_invariant with num_splits", func(l *Layout) { l.BatchInvariant, l.NumSplits = 1, 4 }, "num_splits", ErrInvalid},
		{"sinks 2", func(l *Layout) { l.Sinks = 2 }, "sinks", ErrInvalid},
	} {
		l := servingLayout()
		tt.edit(&l)
		_, err := l.Problem()
		var e *Error
		if !errors.Is(err, tt.want) || !errors.As(err, &e) || e.Arg != tt.arg {
			t.Errorf("%s: err = %v, want %v naming %s", tt.name, err, tt.want, tt.arg)
		}
	}
}

func TestReadLayout(t *testing.T) {
	l := servingLayout()
	b := unsafe.Slice((*byte)(unsafe.Pointer(&l)), LayoutBytes)
	if got, err := ReadLayout(b); err != nil || got != l {
		t.Errorf("ReadLayout = %+v, %v", got, err)
	}
	// An older caller's shorter record: the fields it lacks are 0.
	if got, err := ReadLayout(b[:LayoutBytes-8]); err != nil || got.RotaryInterleaved != 0 || got.RotarySin != l.RotarySin {
		t.Errorf("short record: %+v, %v", got, err)
	}
	longer := append(append([]byte(nil), b...), make([]byte, 16)...)
	if got, err := ReadLayout(longer); err != nil || got != l {
		t.Errorf("longer record of zeros: %+v, %v", got, err)
	}
	longer[LayoutBytes+3] = 1
	for _, tt := range []struct {
		name string
		b    []byte
		want error
	}{
		{"empty", nil, ErrInvalid},
		{"part of a field", b[:13], ErrInvalid},
		{"a newer field set", longer, ErrUnsupported},
	} {
		_, err := ReadLayout(tt.b)
		var e *Error
		if !errors.Is(err, tt.want) || !errors.As(err, &e) || e.Arg != "layout_size" {
			t.Errorf("%s: err = %v, want %v naming layout_size", tt.name, err, tt.want)
		}
	}
}

func TestCallSeqlen(t *testing.T) {
	plain, err := func() (Problem, error) { l := denseLayout(); return l.Problem() }()
	if err != nil {
		t.Fatal(err)
	}
	appending, err := func() (Problem, error) { l := servingLayout(); return l.Problem() }()
	if err != nil {
		t.Fatal(err)
	}
	lengths := plain
	lengths.DeviceLengths = true
	withArray := appending
	withArray.CacheSeqlens = 0x1000
	lengthsNew := appending
	lengthsNew.DeviceLengths = true
	for _, tt := range []struct {
		name   string
		p      *Problem
		seqlen int
		want   int
		arg    string // the error's, or "" for none
	}{
		{"whole cache", &plain, -1, -1, ""},
		{"a length", &plain, 1000, 1000, ""},
		{"the capacity", &plain, 4096, 4096, ""},
		{"past the cache", &plain, 4097, 0, "cache_seqlens"},
		{"negative", &plain, -2, 0, "cache_seqlens"},
		{"append needs a length", &appending, -1, 0, "cache_seqlens"},
		{"append fits", &appending, 4094, 4094, ""},
		{"append past the cache", &appending, 4095, 0, "cache_seqlens"},
		{"append with an array: a hint", &withArray, -1, -1, ""},
		{"bound: whole cache", &lengths, -1, -1, ""},
		{"bound 0", &lengths, 0, 0, ""},
		{"bound 1", &lengths, 1, 1, ""},
		{"bound to its power of two", &lengths, 1000, 1024, ""},
		{"bound at a power of two", &lengths, 1024, 1024, ""},
		{"bound capped at the cache", &lengths, 5000, 4096, ""},
		{"bound less the new tokens", &lengthsNew, 1000, 1022, ""},
		{"bound below the new tokens", &lengthsNew, 1, 0, ""},
		{"negative bound", &lengths, -2, 0, "max_seqlen_k"},
		{"huge bound", &lengths, math.MaxInt, 4096, ""},
	} {
		got, err := tt.p.CallSeqlen(tt.seqlen)
		var e *Error
		switch {
		case tt.arg == "" && (err != nil || got != tt.want):
			t.Errorf("%s: CallSeqlen(%d) = %d, %v; want %d", tt.name, tt.seqlen, got, err, tt.want)
		case tt.arg != "" && (!errors.Is(err, ErrInvalid) || !errors.As(err, &e) || e.Arg != tt.arg):
			t.Errorf("%s: CallSeqlen(%d) err = %v, want one naming %s", tt.name, tt.seqlen, err, tt.arg)
		}
	}
}
