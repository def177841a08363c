package core

import (
	"errors"
	"strings"
	"testing"
)

// Describe gives the call of contiguous tensors of the shapes, which the
// Tensors check takes.
func TestShapesDescribe(t *testing.T) {
	s := Shapes{Batch: 2, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 4096, DType: int64(Float16)}
	var ts Tensors
	ts.WindowLeft, ts.WindowRight = -1, -1
	if err := s.Describe(&ts); err != nil {
		t.Fatal(err)
	}
	if ts.Q.Shape != [TensorDims]int64{2, 1, 32, 128} || ts.KCache.Strides != [TensorDims]int64{4096 * 8 * 128, 8 * 128, 128, 1} ||
		ts.Q.Device != -1 || ts.CacheBatchIdx.Given != 0 || ts.BlockTable.Given != 0 {
		t.Errorf("plain: %+v", ts)
	}
	if _, err := ts.Layout(); err != nil {
		t.Fatal(err)
	}

	// Paged, ragged (4 rows a sequence), appending, rotary, fp8, device lengths.
	s = Shapes{Batch: 3, SeqlenQ: 4, HeadsQ: 8, HeadsKV: 2, HeadDim: 64, SeqlenCache: 1000, DType: int64(BFloat16),
		KVDType: int64(Float8E4M3), SeqlenNew: 4, PageSize: 256, Rotary: 1, Lengths: 1, Serving: 1}
	ts = Tensors{WindowLeft: -1, WindowRight: -1, MaxSeqlenQ: 4, CuSeqlensQ: desc(Int32, 4)}
	ts.CuSeqlensQ.Device = -1
	if err := s.Describe(&ts); err != nil {
		t.Fatal(err)
	}
	if ts.Q.Shape != [TensorDims]int64{12, 8, 64} || ts.KCache.Shape != [TensorDims]int64{12, 256, 2, 64} ||
		ts.BlockTable.Shape != [TensorDims]int64{3, 4} || ts.K.Shape != [TensorDims]int64{12, 2, 64} ||
		ts.RotarySin.Shape != [TensorDims]int64{1004, 32} || ts.CacheBatchIdx.Given != 0 || ts.KCache.DType != int64(Float8E4M3) {
		t.Errorf("paged ragged: %+v", ts)
	}
	if _, err := ts.Layout(); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		mutate func(*Shapes)
		arg    string
		kind   error
	}{
		{func(s *Shapes) { s.DType = int64(Float32) }, "dtype", ErrType},
		{func(s *Shapes) { s.KVDType = int64(Float16) }, "kv_dtype", ErrType},
		{func(s *Shapes) { s.PageSize = -1 }, "page_size", ErrInvalid},
		{func(s *Shapes) { s.SeqlenNew = -1 }, "seqlen_new", ErrInvalid},
	} {
		s := s
		tc.mutate(&s)
		err := s.Describe(&ts)
		if !errors.Is(err, tc.kind) || !strings.Contains(err.Error(), "plan: "+tc.arg+": ") {
			t.Errorf("%s: %v", tc.arg, err)
		}
	}
	if text := ShapesFieldsText(); !strings.HasPrefix(text, "batch:q,seqlen_q:q,nheads_q:q,") {
		t.Errorf("ShapesFieldsText() = %q", text)
	}
}
