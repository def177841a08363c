package core

import "fmt"

// Ragged query lengths (FlashAttention 3's cu_seqlens_q, vLLM's
// query_start_loc): with Problem.Ragged, q and out are (TotalQ, HeadsQ,
// HeadDim), the new tokens' k and v (TotalQ, HeadsKV, HeadDim), and
// sequence b's rows are rows cu_seqlens_q[b] to cu_seqlens_q[b+1] of each,
// an int32 (Batch+1,) device array (Problem.CuSeqlensQ) read only by the
// kernels. Shape.SeqlenQ is then max_seqlen_q, the most rows a sequence
// has: the call is planned, balanced and sized as the uniform call of that
// many rows a sequence, whose padding rows the kernels neither read nor
// write. A sequence's rows are causal and bottom-right aligned to its own
// count, and with new tokens it appends its own rows of k and v. The LSE
// is (HeadsQ, TotalQ), FlashAttention 3's layout. The kernels clamp the
// offsets (kernels/ragged.cuh): a sequence's rows start within [0, TotalQ]
// and number at most min(SeqlenQ, TotalQ - start), so any values are
// memory-safe.

// qDims returns the (batch, rows) dimensions of q and out, and of the new
// tokens' k and v of rows seqNew a sequence: one batch of TotalQ flattened
// rows with ragged lengths.
func (p *Problem) qDims(seq int) (batch, rows int) {
	if p.Ragged {
		return 1, p.TotalQ
	}
	return p.Batch, seq
}

// lseElems is the LSE's element count: Batch*HeadsQ*SeqlenQ, or
// HeadsQ*TotalQ with ragged lengths.
func (p *Problem) lseElems() uint64 {
	if p.Ragged {
		return uint64(max(p.HeadsQ, 0)) * uint64(max(p.TotalQ, 0))
	}
	return uint64(max(p.Batch, 0)) * uint64(max(p.HeadsQ, 0)) * uint64(max(p.SeqlenQ, 0))
}

// validateRagged checks the ragged fields of a layout: max_seqlen_q 1 to
// MaxSeqlenQ (named as such, before the sizes' seqlen_q check), TotalQ
// given exactly with ragged lengths, and new tokens flattened as q is.
func (p *Problem) validateRagged(op string) error {
	if !p.Ragged {
		if p.TotalQ != 0 {
			return invalid(op, "total_q", fmt.Sprintf("%d without ragged query lengths (cu_seqlens_q); must be 0", p.TotalQ))
		}
		return nil
	}
	switch {
	case p.SeqlenQ < 1:
		return invalid(op, "max_seqlen_q", fmt.Sprintf("%d; must be at least 1 with cu_seqlens_q: the most query rows a sequence has", p.SeqlenQ))
	case p.SeqlenQ > MaxSeqlenQ:
		return unsupported(op, "max_seqlen_q", fmt.Sprintf("%d; supported: 1 to %d", p.SeqlenQ, MaxSeqlenQ))
	case p.TotalQ < 1:
		return invalid(op, "total_q", fmt.Sprintf("%d rows of q (q.shape[0]); must be at least 1", p.TotalQ))
	case int64(p.TotalQ)*int64(max(p.HeadsQ, 1)) > MaxRows:
		return unsupported(op, "total_q", fmt.Sprintf("%d rows of %d heads; at most %d (the kernels index rows in 32 bits)", p.TotalQ, p.HeadsQ, MaxRows))
	case p.New.Seqlen != 0 && p.New.Seqlen != p.SeqlenQ:
		return invalid(op, "k", fmt.Sprintf("seqlen_new %d with cu_seqlens_q; k and v are flattened as q is, each sequence appending its own rows: seqlen_new must be max_seqlen_q=%d", p.New.Seqlen, p.SeqlenQ))
	}
	return nil
}

// checkCuSeqlensQ is CheckPointers' part for cu_seqlens_q: given exactly
// with ragged lengths, and 4-byte aligned.
func (p *Problem) checkCuSeqlensQ(op string) error {
	return checkLayoutArray(op, "cu_seqlens_q", p.Ragged, p.CuSeqlensQ, "; the layout has ragged query lengths (ragged=1)",
		"with a layout of one query length for all (ragged=0)")
}

// RaggedRows returns sequence b's rows [start, start+count) of a ragged
// call's TotalQ as the kernels take them from cu (Batch+1 offsets):
// start clamped to [0, totalQ], count to [0, min(maxSeqlenQ, totalQ -
// start)].
func RaggedRows(cu []int32, b, maxSeqlenQ, totalQ int) (start, count int) {
	start = min(max(int(cu[b]), 0), totalQ)
	return start, min(max(int(cu[b+1])-start, 0), min(maxSeqlenQ, totalQ-start))
}

// ReferenceRagged is ReferenceDecode with ragged query lengths: h's Q is
// (TotalQ, HeadsQ, HeadDim), its KNew and VNew (TotalQ, HeadsKV, HeadDim)
// when SeqlenNew > 0 (which must then be SeqlenQ), Shape.SeqlenQ is
// max_seqlen_q, and cu holds the Batch+1 row offsets. Sequence b is the
// uniform problem of its own rows (RaggedRows, none: skipped), alone in a
// batch of one with the rest of h its own (its cache row, block table
// row, lengths, slopes and descales), which is how the kernels treat it.
// It returns out (TotalQ, HeadsQ, HeadDim) and the natural-log lse
// (HeadsQ, TotalQ); rows no sequence has are 0.
func ReferenceRagged(h *HostProblem, cu []int32, numSplits, keysPerTile int) (out, lse []float32, err error) {
	const op = "reference"
	if h == nil {
		return nil, nil, invalid(op, "", "nil HostProblem")
	}
	s := h.Shape
	if err := s.validateSizes(op); err != nil {
		return nil, nil, err
	}
	rowElems := s.HeadsQ * s.HeadDim
	switch {
	case len(cu) != s.Batch+1:
		return nil, nil, invalid(op, "cu_seqlens_q", fmt.Sprintf("%d offsets for batch %d; want batch + 1", len(cu), s.Batch))
	case len(h.Q)%rowElems != 0:
		return nil, nil, invalid(op, "q", fmt.Sprintf("%d elements: not whole rows of %d", len(h.Q), rowElems))
	case s.SeqlenNew != 0 && s.SeqlenNew != s.SeqlenQ:
		return nil, nil, invalid(op, "k", fmt.Sprintf("seqlen_new %d; must be max_seqlen_q=%d", s.SeqlenNew, s.SeqlenQ))
	}
	totalQ := len(h.Q) / rowElems
	kvRow := s.HeadsKV * s.HeadDim
	if s.SeqlenNew > 0 && (len(h.KNew) != totalQ*kvRow || len(h.VNew) != totalQ*kvRow) {
		return nil, nil, invalid(op, "k", fmt.Sprintf("%d and %d elements; want total_q=%d rows of %d", len(h.KNew), len(h.VNew), totalQ, kvRow))
	}
	out = make([]float32, len(h.Q))
	lse = make([]float32, s.HeadsQ*totalQ)
	for b := 0; b < s.Batch; b++ {
		start, n := RaggedRows(cu, b, s.SeqlenQ, totalQ)
		if n == 0 {
			continue
		}
		one := h.sequence(b, start, n)
		o, l, err := ReferenceDecode(&one, numSplits, keysPerTile)
		if err != nil {
			return nil, nil, err
		}
		copy(out[start*rowElems:(start+n)*rowElems], o)
		for hq := 0; hq < s.HeadsQ; hq++ {
			copy(lse[hq*totalQ+start:][:n], l[hq*n:][:n])
		}
	}
	return out, lse, nil
}

// sequence is sequence b of a ragged h, rows [start, start+n) of its
// flattened q (and new tokens), as a problem of batch 1.
func (h *HostProblem) sequence(b, start, n int) HostProblem {
	s := h.Shape
	one := *h
	one.Batch, one.SeqlenQ = 1, n
	rowQ, rowKV := s.HeadsQ*s.HeadDim, s.HeadsKV*s.HeadDim
	one.Q = h.Q[start*rowQ : (start+n)*rowQ]
	if s.SeqlenNew > 0 {
		one.SeqlenNew = n
		one.KNew, one.VNew = h.KNew[start*rowKV:(start+n)*rowKV], h.VNew[start*rowKV:(start+n)*rowKV]
	}
	if h.BlockTable == nil && h.CacheBatchIdx == nil { // the cache's row b
		per := s.SeqlenCache * rowKV
		one.K, one.V = h.K[b*per:(b+1)*per], h.V[b*per:(b+1)*per]
	}
	pick := func(x []int32, per int) []int32 {
		if x == nil {
			return nil
		}
		return x[b*per : (b+1)*per]
	}
	one.CacheSeqlens, one.CacheBatchIdx, one.CacheLeftpad = pick(h.CacheSeqlens, 1), pick(h.CacheBatchIdx, 1), pick(h.CacheLeftpad, 1)
	if h.BlockTable != nil {
		one.BlockTable = pick(h.BlockTable, len(h.BlockTable)/s.Batch)
	}
	if len(h.AlibiSlopes) == s.Batch*s.HeadsQ && s.Batch > 1 {
		one.AlibiSlopes = h.AlibiSlopes[b*s.HeadsQ : (b+1)*s.HeadsQ]
	}
	if len(h.KDescale) == s.Batch*s.HeadsKV && s.Batch > 1 {
		one.KDescale = h.KDescale[b*s.HeadsKV : (b+1)*s.HeadsKV]
	}
	if len(h.VDescale) == s.Batch*s.HeadsKV && s.Batch > 1 {
		one.VDescale = h.VDescale[b*s.HeadsKV : (b+1)*s.HeadsKV]
	}
	return one
}
