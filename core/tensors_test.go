package core

import (
	"errors"
	"strings"
	"testing"
)

// desc describes a contiguous tensor of dtype on CUDA device 0.
func desc(dtype DType, shape ...int64) TensorDesc {
	d := TensorDesc{Given: 1, DType: int64(dtype), Rank: int64(len(shape))}
	copy(d.Shape[:], shape)
	d.Strides = contiguous(shape...)
	return d
}

// denseTensors is denseLayout's call: q (2, 1, 32, 128), caches (2, 4096, 8, 128).
func denseTensors() Tensors {
	return Tensors{Q: desc(Float16, 2, 1, 32, 128), KCache: desc(Float16, 2, 4096, 8, 128),
		VCache: desc(Float16, 2, 4096, 8, 128), WindowLeft: -1, WindowRight: -1}
}

// servingTensors is servingLayout's call: pages of 16 keys, two new tokens
// rotated, cache_leftpad, per-batch ALiBi, softcap and a window.
func servingTensors() Tensors {
	t := denseTensors()
	t.KCache, t.VCache = desc(Float16, 600, 16, 8, 128), desc(Float16, 600, 16, 8, 128)
	t.BlockTable, t.CacheLeftpad = desc(Int32, 2, 256), desc(Int32, 2)
	t.K, t.V = desc(Float16, 2, 2, 8, 128), desc(Float16, 2, 2, 8, 128)
	t.RotaryCos, t.RotarySin = desc(Float16, 4096, 32), desc(Float16, 4096, 32)
	t.AlibiSlopes, t.Softcap = desc(Float32, 2, 32), 30
	t.WindowLeft, t.WindowRight = 256, 0
	return t
}

func TestTensorsFieldsFollowTheStruct(t *testing.T) {
	checkFields(t, TensorsFields(), TensorsBytes)
	text := TensorsFieldsText()
	for _, want := range []string{"q.given:q,q.dtype:q,q.device:q,q.rank:q,q.shape[0]:q,", ",q.strides[7]:q,k_cache.given:q,",
		",cu_seqlens_q.strides[7]:q,softmax_scale:d,causal:q,", ",softcap:d,", ",k_descale_value:d,v_descale_value:d"} {
		if !strings.Contains(text, want) {
			t.Errorf("TensorsFieldsText() = %q lacks %q", text, want)
		}
	}
}

func TestTensorsLayout(t *testing.T) {
	for _, tt := range []struct {
		name  string
		t     func() Tensors
		want  Layout
		valid bool // the layout passes Layout.Problem
	}{
		{"dense", denseTensors, denseLayout(), true},
		{"serving", servingTensors, servingLayout(), true},
		{"out and scale", func() Tensors {
			t := denseTensors()
			t.Out, t.Scale, t.Causal = desc(Float16, 2, 1, 32, 128), 0.5, 1
			return t
		}, func() Layout { l := denseLayout(); l.Scale, l.Causal = 0.5, 1; return l }(), true},
		{"ragged", func() Tensors {
			t := denseTensors()
			t.Q, t.CuSeqlensQ, t.MaxSeqlenQ = desc(Float16, 5, 32, 128), desc(Int32, 3), 4
			t.CacheSeqlens = desc(Int32, 2)
			return t
		}, func() Layout {
			l := denseLayout()
			l.SeqlenQ, l.Ragged, l.TotalQ, l.DeviceLengths = 4, 1, 5, 1
			l.Q, l.Out = [4]int64{0, 32 * 128, 128, 1}, [4]int64{0, 32 * 128, 128, 1}
			return l
		}(), true},
		{"fp8 with descale tensors", func() Tensors {
			t := denseTensors()
			t.KCache.DType, t.VCache.DType = int64(Float8E4M3), int64(Float8E4M3)
			t.KDescale, t.VDescale = desc(Float32, 2, 8), desc(Float32, 1)
			return t
		}, func() Layout {
			l := denseLayout()
			l.KVDType, l.Descale, l.KDescale = int64(Float8E4M3), 1, [2]int64{8, 1}
			return l
		}(), true},
		{"sinks and batch invariance", func() Tensors {
			t := denseTensors()
			t.Sinks, t.BatchInvariant = desc(Float32, 32), 1
			return t
		}, func() Layout { l := denseLayout(); l.Sinks, l.BatchInvariant = 1, 1; return l }(), true},
	} {
		ts := tt.t()
		l, err := ts.Layout()
		if err != nil {
			t.Errorf("%s: %v", tt.name, err)
			continue
		}
		if l != tt.want {
			t.Errorf("%s: layout\n%+v, want\n%+v", tt.name, l, tt.want)
		}
		if _, err := l.Problem(); tt.valid && err != nil {
			t.Errorf("%s: Problem: %v", tt.name, err)
		}
	}
}

// Contiguous tensors whose size-1 dimensions have odd strides (as torch
// gives them) are taken: the layout normalizes those strides.
func TestTensorsSizeOneStrides(t *testing.T) {
	ts := denseTensors()
	ts.Q = desc(Float16, 1, 1, 64, 128)
	ts.Q.Strides = [TensorDims]int64{1, 1, 128, 1}
	ts.KCache, ts.VCache = desc(Float16, 1, 4096, 8, 128), desc(Float16, 1, 4096, 8, 128)
	l, err := ts.Layout()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.Problem(); err != nil {
		t.Fatal(err)
	}
}

func TestTensorsErrors(t *testing.T) {
	for _, tt := range []struct {
		name   string
		change func(*Tensors)
		arg    string
		kind   error
		msg    string
	}{
		{"q not given", func(t *Tensors) { t.Q = TensorDesc{} }, "q", ErrType, "must be a tensor, got none"},
		{"q given 2", func(t *Tensors) { t.Q.Given = 2 }, "q", ErrInvalid, "given=2"},
		{"q rank 3", func(t *Tensors) { t.Q = desc(Float16, 2, 32, 128) }, "q", ErrInvalid, "must have 4 dimensions (batch, seqlen_q, nheads_q, headdim), got shape (2, 32, 128)"},
		{"q float32", func(t *Tensors) { t.Q.DType = int64(Float32) }, "q", ErrType, "must be torch.float16 or torch.bfloat16, got torch.float32"},
		{"k_cache rank 9", func(t *Tensors) { t.KCache.Rank = 9 }, "k_cache", ErrInvalid, "got shape (2, 4096, 8, 128, 0, 0, 0, 0, ...)"},
		{"k_cache bf16", func(t *Tensors) { t.KCache.DType = int64(BFloat16) }, "k_cache", ErrType, "must have q's dtype torch.float16 or be torch.float8_e4m3fn or torch.float8_e5m2, got torch.bfloat16"},
		{"v_cache other fp8", func(t *Tensors) {
			t.KCache.DType, t.VCache.DType = int64(Float8E4M3), int64(Float8E5M2)
		}, "v_cache", ErrType, "must have k_cache's dtype torch.float8_e4m3fn"},
		{"k_cache batch", func(t *Tensors) { t.KCache.Shape[0] = 3 }, "k_cache", ErrInvalid, "must have shape (batch=2, seqlen_cache, nheads_kv, headdim=128)"},
		{"v_cache seqlen", func(t *Tensors) { t.VCache.Shape[1] = 4095 }, "v_cache", ErrInvalid, "must have k_cache's shape (2, 4096, 8, 128), got (2, 4095, 8, 128)"},
		{"cache_seqlens int64", func(t *Tensors) { t.CacheSeqlens = desc(Int64, 2) }, "cache_seqlens", ErrType, "must be a torch.int32 tensor, got torch.int64"},
		{"cache_seqlens length", func(t *Tensors) { t.CacheSeqlens = desc(Int32, 4) }, "cache_seqlens", ErrInvalid, "must have shape (batch,) = (2,), got (4,)"},
		{"cache_seqlens strided", func(t *Tensors) {
			t.CacheSeqlens = desc(Int32, 2)
			t.CacheSeqlens.Strides[0] = 2
		}, "cache_seqlens", ErrInvalid, "must be contiguous, got stride (2,)"},
		{"out dtype", func(t *Tensors) { t.Out = desc(BFloat16, 2, 1, 32, 128) }, "out", ErrType, "must have q's dtype torch.float16, got torch.bfloat16"},
		{"out shape", func(t *Tensors) { t.Out = desc(Float16, 2, 1, 32, 136) }, "out", ErrInvalid, "must have q's shape (2, 1, 32, 128)"},
		{"block_table rank", func(t *Tensors) { t.BlockTable = desc(Int32, 2) }, "block_table", ErrInvalid, "must have 2 dimensions (batch=2, max_blocks)"},
		{"cache_batch_idx batch", func(t *Tensors) { t.CacheBatchIdx = desc(Int32, 3) }, "cache_batch_idx", ErrInvalid, "must have shape (batch,) = (2,)"},
		{"cache_leftpad float", func(t *Tensors) { t.CacheLeftpad = desc(Float32, 2) }, "cache_leftpad", ErrType, "must be a torch.int32 tensor"},
		{"alibi_slopes shape", func(t *Tensors) { t.AlibiSlopes = desc(Float32, 31) }, "alibi_slopes", ErrInvalid, "must have shape (nheads_q,) = (32,) or (batch, nheads_q) = (2, 32), got (31,)"},
		{"alibi_slopes fp16", func(t *Tensors) { t.AlibiSlopes = desc(Float16, 32) }, "alibi_slopes", ErrType, "must be a torch.float32 tensor, got torch.float16"},
		{"sinks shape", func(t *Tensors) { t.Sinks = desc(Float32, 8) }, "sinks", ErrInvalid, "must have shape (nheads_q,) = (32,)"},
		{"sinks strided", func(t *Tensors) {
			t.Sinks = desc(Float32, 32)
			t.Sinks.Strides[0] = 2
		}, "sinks", ErrInvalid, "must be contiguous"},
		{"k without v", func(t *Tensors) { t.K = desc(Float16, 2, 1, 8, 128) }, "v", ErrInvalid, "is None but k is not"},
		{"rotary_sin without cos", func(t *Tensors) { t.RotarySin = desc(Float16, 8, 32) }, "rotary_cos", ErrInvalid, "is None but rotary_sin is not"},
		{"k heads", func(t *Tensors) { t.K, t.V = desc(Float16, 2, 1, 4, 128), desc(Float16, 2, 1, 4, 128) }, "k", ErrInvalid, "must have shape (batch=2, seqlen_new, nheads_kv=8, headdim=128) with seqlen_new >= 1"},
		{"v shape", func(t *Tensors) { t.K, t.V = desc(Float16, 2, 1, 8, 128), desc(Float16, 2, 2, 8, 128) }, "v", ErrInvalid, "must have k's shape"},
		{"rotary_cos rank", func(t *Tensors) {
			t.K, t.V = desc(Float16, 2, 1, 8, 128), desc(Float16, 2, 1, 8, 128)
			t.RotaryCos, t.RotarySin = desc(Float16, 64), desc(Float16, 64)
		}, "rotary_cos", ErrInvalid, "must have 2 dimensions (seqlen_ro, rotary_dim / 2)"},
		{"k_descale alone", func(t *Tensors) { t.KDescale = desc(Float32, 1) }, "v_descale", ErrInvalid, "must be a tensor too: k_descale is one"},
		{"v_descale shape", func(t *Tensors) { t.KDescale, t.VDescale = desc(Float32, 1), desc(Float32, 8, 2) }, "v_descale", ErrInvalid, "must have 1 element or shape (batch, nheads_kv) = (2, 8), got (8, 2)"},
		{"cu_seqlens_q int64", func(t *Tensors) {
			t.Q, t.CuSeqlensQ, t.MaxSeqlenQ = desc(Float16, 5, 32, 128), desc(Int64, 3), 4
		}, "cu_seqlens_q", ErrType, "must be a torch.int32 tensor"},
		{"max_seqlen_q missing", func(t *Tensors) { t.Q, t.CuSeqlensQ = desc(Float16, 5, 32, 128), desc(Int32, 3) }, "max_seqlen_q", ErrInvalid, "must be given with cu_seqlens_q"},
		{"max_seqlen_q without cu", func(t *Tensors) { t.Q, t.MaxSeqlenQ = desc(Float16, 5, 32, 128), 4 }, "max_seqlen_q", ErrInvalid, "is given without cu_seqlens_q"},
		{"cu_seqlens_q short", func(t *Tensors) {
			t.Q, t.CuSeqlensQ, t.MaxSeqlenQ = desc(Float16, 5, 32, 128), desc(Int32, 1), 4
		}, "cu_seqlens_q", ErrInvalid, "must have batch + 1 >= 2 elements, got shape (1,)"},
		{"cu_seqlens_q of another batch", func(t *Tensors) {
			t.Q, t.CuSeqlensQ, t.MaxSeqlenQ = desc(Float16, 5, 32, 128), desc(Int32, 4), 4
		}, "cu_seqlens_q", ErrInvalid, "must have batch + 1 = 3 elements (k_cache has batch 2), got 4"},
		{"q rank 4 with cu_seqlens_q", func(t *Tensors) { t.CuSeqlensQ, t.MaxSeqlenQ = desc(Int32, 3), 1 }, "q", ErrInvalid, "must have 3 dimensions (total_q, nheads_q, headdim) with cu_seqlens_q"},
		{"k_cache on another device", func(t *Tensors) { t.KCache.Device = 1 }, "k_cache", ErrInvalid, "must be on q's device cuda:0, got cuda:1"},
		{"out off CUDA", func(t *Tensors) {
			t.Out = desc(Float16, 2, 1, 32, 128)
			t.Out.Device = -1
		}, "out", ErrInvalid, "must be on q's device cuda:0, got a device that is not CUDA"},
	} {
		ts := denseTensors()
		tt.change(&ts)
		_, err := ts.Layout()
		var e *Error
		if !errors.As(err, &e) || e.Arg != tt.arg || !errors.Is(err, tt.kind) || !strings.Contains(e.Msg, tt.msg) {
			t.Errorf("%s: %v; want %s: %v: ...%s...", tt.name, err, tt.arg, tt.kind, tt.msg)
		}
	}
}

func TestTensorsDeviceLayout(t *testing.T) {
	ts := denseTensors()
	if _, d, err := ts.DeviceLayout(); d != 0 || err != nil {
		t.Errorf("DeviceLayout() = %d, %v", d, err)
	}
	// q off CUDA is named before the others are found on another device than q's.
	ts.Q.Device = -1
	if _, err := ts.Layout(); err == nil || !strings.Contains(err.Error(), ": k_cache: ") {
		t.Errorf("Layout of q off CUDA: %v", err)
	}
	if _, _, err := ts.DeviceLayout(); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), ": q: invalid argument: must be a CUDA tensor") {
		t.Errorf("DeviceLayout of q off CUDA: %v", err)
	}
}

func TestReadTensors(t *testing.T) {
	b := make([]byte, TensorsBytes+8)
	got, err := ReadTensors(b[:TensorsBytes])
	if err != nil || got != (Tensors{}) {
		t.Errorf("zeros: %+v, %v", got, err)
	}
	if _, err := ReadTensors(b[:12]); !errors.Is(err, ErrInvalid) {
		t.Errorf("12 bytes: %v", err)
	}
	b[TensorsBytes] = 1
	if _, err := ReadTensors(b); !errors.Is(err, ErrUnsupported) {
		t.Errorf("a newer field set: %v", err)
	}
}
