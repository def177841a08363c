package core

import (
	"fmt"
	"math"
)

// HostProblem is an attention problem on the host, in contiguous float32
// layouts, for the CPU reference: the same shapes and options as a Problem
// with slices in place of device tensors.
type HostProblem struct {
	Shape // NumSplits is not read: ReferenceDecode takes the split count

	Q    []float32 // (Batch, SeqlenQ, HeadsQ, HeadDim)
	K, V []float32 // (Batch, SeqlenCache, HeadsKV, HeadDim)
	// CacheSeqlens holds each sequence's valid length, clamped to
	// [0, SeqlenCache] as the kernels do; nil means Seqlen for every
	// sequence (SeqlenCache when Seqlen < 0).
	CacheSeqlens []int32

	Scale  float32 // softmax scale; 0 means 1/sqrt(HeadDim)
	Causal bool    // query i sees keys j <= length - SeqlenQ + i
}

// ReferenceDecode runs the two-stage algorithm of the kernels on the CPU in
// float32 and returns out (Batch, SeqlenQ, HeadsQ, HeadDim) and the
// natural-log lse (Batch, HeadsQ, SeqlenQ).
//
// Stage 1 splits each sequence's length len exactly as the kernels do:
// tiles = ceil(len/keysPerTile), and split s takes key tiles s, s+numSplits,
// s+2*numSplits, ... below tiles (dealt round robin), so splits past tiles
// are empty.
// Each split runs an online softmax tile by tile (base-2 exponentials of
// scale*log2(e)*q.k, as the kernels compute) and yields a partial output
// normalized by its own sum and its lse; a split that sees no key yields
// o = 0 and lse = -inf. Stage 2 merges the splits of a row with the max-LSE
// trick; a row that sees no key gets out = 0 and lse = -inf. numSplits == 1
// is the kernels' single-stage path: the one split is the answer.
func ReferenceDecode(h *HostProblem, numSplits, keysPerTile int) (out, lse []float32, err error) {
	const op = "reference"
	if err := h.check(op); err != nil {
		return nil, nil, err
	}
	if numSplits < 1 {
		return nil, nil, invalid(op, "num_splits", fmt.Sprintf("%d; must be at least 1", numSplits))
	}
	if keysPerTile < 1 {
		return nil, nil, invalid(op, "keys_per_tile", fmt.Sprintf("%d; must be at least 1", keysPerTile))
	}
	s, d := h.Shape, h.HeadDim
	group := s.HeadsQ / s.HeadsKV
	scaleLog2 := h.scale() * math.Log2E
	out = make([]float32, s.Batch*s.SeqlenQ*s.HeadsQ*d)
	lse = make([]float32, s.Batch*s.HeadsQ*s.SeqlenQ)
	oPart := make([][]float32, numSplits) // per split: the row's partial output
	lsePart := make([]float32, numSplits)
	for i := range oPart {
		oPart[i] = make([]float32, d)
	}
	for b := 0; b < s.Batch; b++ {
		n := h.length(b)
		for kvh := 0; kvh < s.HeadsKV; kvh++ {
			// Packed rows of this (batch, K/V head), as the kernels order them.
			for r := 0; r < group*s.SeqlenQ; r++ {
				hq, i := kvh*group+r/s.SeqlenQ, r%s.SeqlenQ
				q := h.Q[((b*s.SeqlenQ+i)*s.HeadsQ+hq)*d:][:d]
				visible := h.visible(n, i)
				for sp := 0; sp < numSplits; sp++ {
					lsePart[sp] = h.splitPartial(oPart[sp], q, b, kvh, sp, numSplits, visible, keysPerTile, float32(scaleLog2))
				}
				row := (b*s.HeadsQ+hq)*s.SeqlenQ + i
				o := out[((b*s.SeqlenQ+i)*s.HeadsQ+hq)*d:][:d]
				if numSplits == 1 {
					copy(o, oPart[0])
					lse[row] = lsePart[0]
				} else {
					lse[row] = mergePartials(o, oPart, lsePart)
				}
			}
		}
	}
	return out, lse, nil
}

// splitPartial is stage 1 for one row and one split: an online softmax over
// the key tiles first, first+step, ... (tiles of keysPerTile keys, cut at the
// visible keys). It writes the partial output, normalized by its own sum, to
// o and returns its natural-log lse: -inf, with o = 0, when it saw no key.
func (h *HostProblem) splitPartial(o, q []float32, b, kvh, first, step, visible, keysPerTile int, scaleLog2 float32) float32 {
	d := h.HeadDim
	clear(o)
	m := float32(math.Inf(-1)) // running max of scaleLog2*q.k
	var l float32              // running sum of exp2(x - m)
	x := make([]float32, keysPerTile)
	for t := first * keysPerTile; t < visible; t += step * keysPerTile {
		te := min(t+keysPerTile, visible)
		tmax := float32(math.Inf(-1))
		for j := t; j < te; j++ {
			var dot float32
			k := h.kv(h.K, b, j, kvh)
			for e := range d {
				dot += q[e] * k[e]
			}
			x[j-t] = dot * scaleLog2
			tmax = max(tmax, x[j-t])
		}
		mNew := max(m, tmax)
		alpha := exp2(m - mNew) // 0 while nothing was seen (m = -inf)
		l *= alpha
		for e := range o {
			o[e] *= alpha
		}
		for j := t; j < te; j++ {
			p := exp2(x[j-t] - mNew)
			l += p
			v := h.kv(h.V, b, j, kvh)
			for e := range d {
				o[e] += p * v[e]
			}
		}
		m = mNew
	}
	if l == 0 {
		return float32(math.Inf(-1))
	}
	for e := range o {
		o[e] /= l
	}
	return (m + float32(math.Log2(float64(l)))) * math.Ln2
}

// mergePartials is stage 2 for one row: it merges partial outputs o[s],
// each normalized by its own sum, by their natural-log LSEs into out and
// returns the row's lse. With M the largest LSE, split s weighs
// w_s = exp(lse_s - M) (0 for a split that saw no key), out = sum w_s o_s /
// sum w_s and lse = M + log(sum w_s). If no split saw a key, out = 0 and
// lse = -inf.
func mergePartials(out []float32, o [][]float32, lse []float32) float32 {
	clear(out)
	mx := float32(math.Inf(-1))
	for _, x := range lse {
		mx = max(mx, x)
	}
	if math.IsInf(float64(mx), -1) {
		return mx
	}
	var sum float32
	for s, x := range lse {
		w := float32(math.Exp(float64(x - mx))) // exp(-inf) = 0
		sum += w
		for e := range out {
			out[e] += w * o[s][e]
		}
	}
	for e := range out {
		out[e] /= sum
	}
	return mx + float32(math.Log(float64(sum)))
}

// NaiveAttention computes the same attention as ReferenceDecode in float64
// with a plain softmax over all visible keys at once: out (Batch, SeqlenQ,
// HeadsQ, HeadDim) and natural-log lse (Batch, HeadsQ, SeqlenQ); a row that
// sees no key gets out = 0 and lse = -inf. It is the yardstick the two-stage
// reference is tested against.
func NaiveAttention(h *HostProblem) (out, lse []float64, err error) {
	if err := h.check("naive"); err != nil {
		return nil, nil, err
	}
	s, d := h.Shape, h.HeadDim
	scale := h.scale()
	out = make([]float64, s.Batch*s.SeqlenQ*s.HeadsQ*d)
	lse = make([]float64, s.Batch*s.HeadsQ*s.SeqlenQ)
	for b := 0; b < s.Batch; b++ {
		n := h.length(b)
		for hq := 0; hq < s.HeadsQ; hq++ {
			kvh := hq / (s.HeadsQ / s.HeadsKV)
			for i := 0; i < s.SeqlenQ; i++ {
				q := h.Q[((b*s.SeqlenQ+i)*s.HeadsQ+hq)*d:][:d]
				o := out[((b*s.SeqlenQ+i)*s.HeadsQ+hq)*d:][:d]
				row := (b*s.HeadsQ+hq)*s.SeqlenQ + i
				visible := h.visible(n, i)
				if visible <= 0 {
					lse[row] = math.Inf(-1)
					continue
				}
				scores := make([]float64, visible)
				mx := math.Inf(-1)
				for j := range scores {
					k := h.kv(h.K, b, j, kvh)
					var dot float64
					for e := range d {
						dot += float64(q[e]) * float64(k[e])
					}
					scores[j] = dot * scale
					mx = max(mx, scores[j])
				}
				var sum float64
				for j, x := range scores {
					p := math.Exp(x - mx)
					sum += p
					v := h.kv(h.V, b, j, kvh)
					for e := range d {
						o[e] += p * float64(v[e])
					}
				}
				for e := range o {
					o[e] /= sum
				}
				lse[row] = mx + math.Log(sum)
			}
		}
	}
	return out, lse, nil
}

// check validates the shape and the slice lengths.
func (h *HostProblem) check(op string) error {
	if h == nil {
		return invalid(op, "", "nil HostProblem")
	}
	if err := h.Shape.validate(op); err != nil {
		return err
	}
	s := h.Shape
	want := []struct {
		name     string
		got, len int
	}{
		{"q", len(h.Q), s.Batch * s.SeqlenQ * s.HeadsQ * s.HeadDim},
		{"k_cache", len(h.K), s.Batch * s.SeqlenCache * s.HeadsKV * s.HeadDim},
		{"v_cache", len(h.V), s.Batch * s.SeqlenCache * s.HeadsKV * s.HeadDim},
	}
	for _, w := range want {
		if w.got != w.len {
			return invalid(op, w.name, fmt.Sprintf("%d elements, want %d", w.got, w.len))
		}
	}
	if h.CacheSeqlens != nil && len(h.CacheSeqlens) != s.Batch {
		return invalid(op, "cache_seqlens", fmt.Sprintf("%d lengths for batch %d", len(h.CacheSeqlens), s.Batch))
	}
	if sc := float64(h.Scale); math.IsNaN(sc) || math.IsInf(sc, 0) || sc < 0 {
		return invalid(op, "softmax_scale", fmt.Sprintf("%v; must be finite and not negative", h.Scale))
	}
	return nil
}

// length is sequence b's valid length, clamped to [0, SeqlenCache].
func (h *HostProblem) length(b int) int {
	n := h.SeqlenCache
	switch {
	case h.CacheSeqlens != nil:
		n = int(h.CacheSeqlens[b])
	case h.Seqlen >= 0:
		n = h.Seqlen
	}
	return max(0, min(n, h.SeqlenCache))
}

// visible is how many leading keys of a length-n sequence query i sees:
// all n, or with the bottom-right causal mask n - SeqlenQ + i + 1 (which may
// be 0 or negative: the row sees nothing).
func (h *HostProblem) visible(n, i int) int {
	if h.Causal {
		return min(n, n-h.SeqlenQ+i+1)
	}
	return n
}

// kv returns the head_dim vector of key/value j of (batch b, K/V head kvh).
func (h *HostProblem) kv(t []float32, b, j, kvh int) []float32 {
	return t[((b*h.SeqlenCache+j)*h.HeadsKV+kvh)*h.HeadDim:][:h.HeadDim]
}

// scale is the softmax scale, 1/sqrt(HeadDim) when Scale is 0.
func (h *HostProblem) scale() float64 {
	if h.Scale == 0 {
		return 1 / math.Sqrt(float64(h.HeadDim))
	}
	return float64(h.Scale)
}

func exp2(x float32) float32 { return float32(math.Exp2(float64(x))) }
