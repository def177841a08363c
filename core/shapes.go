package core

import (
	"fmt"
	"reflect"
	"unsafe"
)

// Shapes is a call described by its sizes, as plan() takes them: Describe
// fills a Tensors with the descriptors of contiguous tensors of these
// shapes (device -1), the call whose plan is asked for.
type Shapes struct {
	Batch       int64 `layout:"batch"`
	SeqlenQ     int64 `layout:"seqlen_q"` // with cu_seqlens_q given: max_seqlen_q
	HeadsQ      int64 `layout:"nheads_q"`
	HeadsKV     int64 `layout:"nheads_kv"`
	HeadDim     int64 `layout:"headdim"`
	SeqlenCache int64 `layout:"seqlen_cache"`
	DType       int64 `layout:"dtype"`      // q's: Float16 or BFloat16
	KVDType     int64 `layout:"kv_dtype"`   // the caches': 0 (DType's), DType or an fp8 one
	SeqlenNew   int64 `layout:"seqlen_new"` // new tokens appended: k and v given
	PageSize    int64 `layout:"page_size"`  // > 0: a paged cache (a block table)
	Rotary      int64 `layout:"rotary"`     // 1: rotary tables, for a rotary_dim of the largest multiple of 16 up to HeadDim
	Lengths     int64 `layout:"lengths"`    // 1: a cache_seqlens tensor
	Serving     int64 `layout:"serving"`    // 1: the serving kernels (a cache_batch_idx where nothing else asks for them)
}

// ShapesBytes is the size of a Shapes record in bytes.
const ShapesBytes = int(unsafe.Sizeof(Shapes{}))

var shapesFields = recordFields(reflect.TypeOf(Shapes{}), "", 0)

// ShapesFieldsText names a Shapes record's fields as LayoutFieldsText does.
func ShapesFieldsText() string { return fieldsText(shapesFields) }

// ReadShapes reads a Shapes record as ReadLayout reads a Layout.
func ReadShapes(b []byte) (Shapes, error) {
	var s Shapes
	err := readRecord("shapes", unsafe.Slice((*byte)(unsafe.Pointer(&s)), ShapesBytes), b)
	return s, err
}

// Describe sets t's descriptors to those of contiguous tensors of s's
// shapes; t's options and its cu_seqlens_q and descale tensors stay (a
// ragged call's q is (batch * seqlen_q, nheads_q, headdim)). Errors name
// plan()'s arguments; the sizes are checked as the call's.
func (s *Shapes) Describe(t *Tensors) error {
	const op = "plan"
	kv := s.KVDType
	if kv == 0 {
		kv = s.DType
	}
	switch {
	case s.DType != int64(Float16) && s.DType != int64(BFloat16):
		return wrongType(op, "dtype", "must be torch.float16 or torch.bfloat16, got "+dtypeText(s.DType))
	case kv != s.DType && !DType(kv).FP8():
		return wrongType(op, "kv_dtype", fmt.Sprintf("must be None (dtype's), %s, torch.float8_e4m3fn or torch.float8_e5m2, got %s", dtypeText(s.DType), dtypeText(kv)))
	case s.PageSize < 0:
		return invalid(op, "page_size", fmt.Sprintf("%d; must not be negative (0: not paged)", s.PageSize))
	case s.SeqlenNew < 0:
		return invalid(op, "seqlen_new", fmt.Sprintf("%d; must not be negative", s.SeqlenNew))
	}
	pages, rows := int64(0), []int64{s.Batch, s.SeqlenQ}
	if s.PageSize > 0 {
		pages = ceilDiv64(s.SeqlenCache, s.PageSize)
	}
	if t.CuSeqlensQ.Given != 0 {
		rows = []int64{s.Batch * s.SeqlenQ}
	}
	set := func(d *TensorDesc, dtype int64, shape ...int64) {
		*d = TensorDesc{Given: 1, DType: dtype, Device: -1, Rank: int64(len(shape)), Strides: contiguous(shape...)}
		copy(d.Shape[:], shape)
	}
	cache := []int64{s.Batch, s.SeqlenCache, s.HeadsKV, s.HeadDim}
	if pages > 0 {
		cache[0], cache[1] = s.Batch*pages, s.PageSize
		set(&t.BlockTable, int64(Int32), s.Batch, pages)
	}
	set(&t.Q, s.DType, append(rows, s.HeadsQ, s.HeadDim)...)
	set(&t.KCache, kv, cache...)
	set(&t.VCache, kv, cache...)
	if s.Lengths != 0 {
		set(&t.CacheSeqlens, int64(Int32), s.Batch)
	}
	if s.SeqlenNew > 0 {
		newRows := []int64{s.Batch, s.SeqlenNew}
		if len(rows) == 1 {
			newRows = rows
		}
		set(&t.K, s.DType, append(newRows, s.HeadsKV, s.HeadDim)...)
		t.V = t.K
	}
	if s.Rotary != 0 {
		set(&t.RotaryCos, s.DType, s.SeqlenCache+s.SeqlenNew, max(16, s.HeadDim/16*16)/2)
		t.RotarySin = t.RotaryCos
	}
	if s.Serving != 0 && s.SeqlenNew == 0 && pages == 0 && s.Rotary == 0 && t.WindowLeft == -1 && t.WindowRight == -1 {
		set(&t.CacheBatchIdx, int64(Int32), s.Batch) // a serving argument that leaves the plan alone
	}
	return nil
}

func ceilDiv64(a, b int64) int64 { return (a + b - 1) / b }
