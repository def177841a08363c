package core

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// raggedLayout is denseLayout with ragged query lengths: batch 2, at most
// 4 rows a sequence, 5 rows in all.
func raggedLayout() Layout {
	l := denseLayout()
	l.SeqlenQ, l.Ragged, l.TotalQ = 4, 1, 5
	l.Q = [4]int64{0, 32 * 128, 128, 1}
	l.Out = l.Q
	return l
}

func TestRaggedLayoutRefusals(t *testing.T) {
	tests := []struct {
		name string
		edit func(*Layout)
		arg  string
		want error
	}{
		{"max_seqlen_q 0", func(l *Layout) { l.SeqlenQ = 0 }, "max_seqlen_q", ErrInvalid},
		{"max_seqlen_q 17", func(l *Layout) { l.SeqlenQ = 17 }, "max_seqlen_q", ErrUnsupported},
		{"no rows", func(l *Layout) { l.TotalQ = 0 }, "total_q", ErrInvalid},
		{"too many rows", func(l *Layout) { l.TotalQ = math.MaxInt32 }, "total_q", ErrUnsupported},
		{"total_q without ragged", func(l *Layout) { l.Ragged = 0 }, "total_q", ErrInvalid},
		{"ragged flag 2", func(l *Layout) { l.Ragged = 2 }, "ragged", ErrInvalid},
		{"new tokens not flattened as q", func(l *Layout) {
			l.SeqlenNew, l.KNew, l.VNew = 2, [4]int64{0, 8 * 128, 128, 1}, [4]int64{0, 8 * 128, 128, 1}
		}, "k", ErrInvalid},
		{"out rows overlap", func(l *Layout) { l.Out = [4]int64{0, 128, 128, 1} }, "out", ErrInvalid},
	}
	for _, tt := range tests {
		l := raggedLayout()
		tt.edit(&l)
		_, err := l.Problem()
		var e *Error
		if !errors.Is(err, tt.want) || !errors.As(err, &e) || e.Arg != tt.arg {
			t.Errorf("%s: %v; want %v naming %s", tt.name, err, tt.want, tt.arg)
		}
		if tt.arg == "max_seqlen_q" || tt.arg == "total_q" {
			if _, err := l.Sizes(); !errors.As(err, &e) || e.Arg != tt.arg {
				t.Errorf("%s: Sizes: %v; want one naming %s", tt.name, err, tt.arg)
			}
		}
	}
}

// TestRaggedLayout: the batch strides of the flattened tensors are not
// read, the layout round-trips, and the plan is the uniform one of
// max_seqlen_q rows a sequence.
func TestRaggedLayout(t *testing.T) {
	l := raggedLayout()
	l.Q[0], l.Out[0] = 12345, 999 // ignored
	p, err := l.Problem()
	if err != nil {
		t.Fatal(err)
	}
	if !p.Ragged || p.TotalQ != 5 || p.Q.BatchStride != 0 || p.Out.BatchStride != 0 || p.Q.SeqStride != 32*128 {
		t.Fatalf("Problem = %+v", p)
	}
	if back := LayoutOf(&p); back.Ragged != 1 || back.TotalQ != 5 || back.Q != raggedLayout().Q || back.Out != raggedLayout().Out {
		t.Errorf("LayoutOf = %+v", back)
	}
	u := denseLayout()
	u.SeqlenQ = 4
	u.Q, u.Out = [4]int64{4 * 32 * 128, 32 * 128, 128, 1}, [4]int64{4 * 32 * 128, 32 * 128, 128, 1}
	up, err := u.Problem()
	if err != nil {
		t.Fatal(err)
	}
	if p.PlanShape() != up.PlanShape() {
		t.Errorf("ragged plan shape %+v, uniform %+v", p.PlanShape(), up.PlanShape())
	}
	rp, err1 := MakePlan(p.PlanShape(), H200)
	uq, err2 := MakePlan(up.PlanShape(), H200)
	if err1 != nil || err2 != nil || rp.String() != uq.String() || rp.WorkspaceBytes != uq.WorkspaceBytes {
		t.Errorf("ragged plan %v (%v), uniform %v (%v)", rp, err1, uq, err2)
	}
}

func TestRaggedPointers(t *testing.T) {
	l := raggedLayout()
	p, err := l.Problem()
	if err != nil {
		t.Fatal(err)
	}
	const mb = 1 << 20
	p.Q.Ptr, p.K.Ptr, p.V.Ptr, p.Out.Ptr = 1*mb, 16*mb, 48*mb, 80*mb
	p.LSE = 90 * mb
	for _, tt := range []struct {
		name   string
		ragged bool
		cu     uintptr
		arg    string
	}{
		{"missing", true, 0, "cu_seqlens_q"},
		{"misaligned", true, 100*mb + 2, "cu_seqlens_q"},
		{"without ragged", false, 100 * mb, "cu_seqlens_q"},
		{"overlapping lse", true, 90*mb + 4*32*5 - 4, "lse"},
		{"overlapping out", true, 80*mb + 8, "out"},
		{"fine", true, 100 * mb, ""},
	} {
		c := p
		c.Ragged, c.CuSeqlensQ = tt.ragged, tt.cu
		if !tt.ragged {
			c.TotalQ = 0
		}
		err := c.CheckPointers()
		if tt.arg == "" {
			if err != nil {
				t.Errorf("%s: %v", tt.name, err)
			}
			continue
		}
		var e *Error
		if !errors.As(err, &e) || e.Arg != tt.arg {
			t.Errorf("%s: %v; want an error naming %s", tt.name, err, tt.arg)
		}
	}
}

// raggedHost is a HostProblem of ragged rows (cu) over randomHost's
// caches, with q flattened.
func raggedHost(s Shape, lens, cu []int32, causal bool, seed uint64) *HostProblem {
	h := randomHost(s, lens, causal, seed)
	h.Q = h.Q[:int(cu[len(cu)-1])*s.HeadsQ*s.HeadDim]
	return h
}

// TestReferenceRaggedEqualLengths: rows of equal counts are the uniform
// call's, bit for bit, the LSE transposed to (heads, rows).
func TestReferenceRaggedEqualLengths(t *testing.T) {
	s := Shape{DType: Float16, Batch: 3, SeqlenQ: 3, HeadsQ: 8, HeadsKV: 2, HeadDim: 16, SeqlenCache: 40, Seqlen: -1}
	h := randomHost(s, []int32{40, 7, 19}, true, 3)
	h.Window, h.Softcap, h.AlibiSlopes = Window{Enabled: true, Left: 9, Right: 0}, 20, make([]float32, s.HeadsQ)
	for i := range h.AlibiSlopes {
		h.AlibiSlopes[i] = 0.1 * float32(i)
	}
	cu := []int32{0, 3, 6, 9}
	for _, splits := range []int{1, 3} {
		out, lse, err := ReferenceDecode(h, splits, 8)
		if err != nil {
			t.Fatal(err)
		}
		rOut, rLSE, err := ReferenceRagged(h, cu, splits, 8)
		if err != nil {
			t.Fatal(err)
		}
		for i := range out {
			if math.Float32bits(out[i]) != math.Float32bits(rOut[i]) {
				t.Fatalf("splits %d: out[%d] = %v, uniform %v", splits, i, rOut[i], out[i])
			}
		}
		for b := 0; b < s.Batch; b++ {
			for hq := 0; hq < s.HeadsQ; hq++ {
				for i := 0; i < s.SeqlenQ; i++ {
					u, r := lse[(b*s.HeadsQ+hq)*s.SeqlenQ+i], rLSE[hq*9+b*3+i]
					if math.Float32bits(u) != math.Float32bits(r) {
						t.Fatalf("splits %d: lse (b %d, head %d, row %d) = %v, uniform %v", splits, b, hq, i, r, u)
					}
				}
			}
		}
	}
}

// TestReferenceRaggedMixed: each sequence's rows are its own uniform
// call's, a sequence of 0 rows has none, and a bottom-right causal mask
// aligned to its own count (against NaiveAttention of it alone).
func TestReferenceRaggedMixed(t *testing.T) {
	s := Shape{DType: Float16, Batch: 4, SeqlenQ: 5, HeadsQ: 4, HeadsKV: 2, HeadDim: 8, SeqlenCache: 30, Seqlen: -1}
	cu := []int32{0, 2, 2, 7, 8}
	h := raggedHost(s, []int32{30, 4, 11, 0}, cu, true, 9)
	out, lse, err := ReferenceRagged(h, cu, 2, 4)
	if err != nil {
		t.Fatal(err)
	}
	for b := 0; b < s.Batch; b++ {
		start, n := RaggedRows(cu, b, s.SeqlenQ, 8)
		if n == 0 {
			continue
		}
		one := h.sequence(b, start, n)
		nOut, nLSE, err := NaiveAttention(&one)
		if err != nil {
			t.Fatal(err)
		}
		rows := make([]float32, 0, s.HeadsQ*n)
		for hq := 0; hq < s.HeadsQ; hq++ {
			rows = append(rows, lse[hq*8+start:][:n]...)
		}
		compare(t, out[start*s.HeadsQ*s.HeadDim:(start+n)*s.HeadsQ*s.HeadDim], rows, nOut, nLSE)
	}
	if _, _, err := ReferenceRagged(h, cu[:3], 1, 4); err == nil || !strings.Contains(err.Error(), "cu_seqlens_q") {
		t.Errorf("short cu: %v", err)
	}
}

// TestRaggedRowsClamp: any offsets give rows within [0, totalQ), at most
// maxSeqlenQ of them.
func TestRaggedRowsClamp(t *testing.T) {
	for _, tt := range []struct {
		cu           []int32
		start, count int
	}{
		{[]int32{0, 3}, 0, 3},
		{[]int32{2, 1}, 2, 0},
		{[]int32{-7, 2}, 0, 2},
		{[]int32{0, 40}, 0, 4},
		{[]int32{9, 12}, 9, 1},
		{[]int32{math.MaxInt32, math.MinInt32}, 10, 0},
		{[]int32{math.MinInt32, math.MaxInt32}, 0, 4},
	} {
		start, count := RaggedRows(tt.cu, 0, 4, 10)
		if start != tt.start || count != tt.count {
			t.Errorf("RaggedRows(%v) = %d, %d; want %d, %d", tt.cu, start, count, tt.start, tt.count)
		}
	}
}
