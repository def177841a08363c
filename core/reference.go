package core

import (
	"fmt"
	"math"
)

// HostProblem is an attention problem on the host, in contiguous float32
// layouts, for the CPU reference: the same shapes and options as a Problem
// with slices in place of device tensors.
type HostProblem struct {
	// NumSplits is not read (ReferenceDecode takes the split count), nor
	// are Serving, WindowKeys and RotaryQ; SeqlenNew is the number of new
	// tokens in KNew and VNew.
	Shape

	Q []float32 // (Batch, SeqlenQ, HeadsQ, HeadDim)
	// K and V are the cache: (Batch, SeqlenCache, HeadsKV, HeadDim); with
	// CacheBatchIdx (rows, SeqlenCache, HeadsKV, HeadDim) for any number of
	// rows; with BlockTable (pages, PageSize, HeadsKV, HeadDim). An fp8
	// cache (KVDType) holds its fp8 values, not scaled.
	K, V []float32
	// KDescale and VDescale scale an fp8 cache: key j of sequence b, K/V
	// head h, is attended as K * KDescale[b*HeadsKV + h] (V likewise); one
	// value scales all, nil is 1.
	KDescale, VDescale []float32
	// CacheSeqlens holds each sequence's cached length; nil means Seqlen
	// for every sequence (SeqlenCache when Seqlen < 0). Sequence b attends
	// to its first len = length + SeqlenNew keys, clamped to
	// [0, SeqlenCache], as the kernels do.
	CacheSeqlens []int32

	Scale  float32 // softmax scale; 0 means 1/sqrt(HeadDim)
	Causal bool    // query i sees keys j <= len - SeqlenQ + i

	// The serving features, as in Problem; nil or zero turns each off.

	// BlockTable, (Batch, SeqlenCache/PageSize), pages K and V: key j of
	// sequence b is row j%PageSize of page BlockTable[b, j/PageSize], the
	// page clamped to the cache's pages on read (a write to a page out of
	// range is skipped).
	BlockTable []int32
	PageSize   int
	// CacheBatchIdx, (Batch,), is the cache row of each sequence, clamped
	// to K's rows.
	CacheBatchIdx []int32
	// CacheLeftpad, (Batch,), is each sequence's first valid key, clamped
	// to [0, len].
	CacheLeftpad []int32
	Window       Window
	Softcap      float32
	AlibiSlopes  []float32 // (HeadsQ,) or (Batch, HeadsQ)
	// KNew and VNew, (Batch, SeqlenNew, HeadsKV, HeadDim), are appended:
	// token t of sequence b goes to key length + t (skipped past the cache),
	// into an fp8 cache as quantize(x, descale) stores it.
	KNew, VNew []float32
	// RotaryCos and RotarySin, (rows, RotaryDim/2), rotate the first
	// RotaryDim channels of q and the new keys (see Rotary). The rotated
	// values are rounded to DType, as the kernels store them.
	RotaryCos, RotarySin []float32
	RotaryDim            int
	RotaryInterleaved    bool
	// Sinks, (HeadsQ,), are the sink logits (core/sinks.go); nil: none.
	Sinks []float32
}

// ReferenceDecode runs the kernels' algorithm on the CPU in float32 and
// returns out (Batch, SeqlenQ, HeadsQ, HeadDim) and the natural-log lse
// (Batch, HeadsQ, SeqlenQ).
//
// With new tokens it first appends them to copies of the caches and rotates
// q, as the append kernel does before stage 1 (ReferenceAppend). Stage 1
// then splits each sequence's keys as the kernels do: from the first tile
// of its key range [lo, len) (lo the leftpad, raised with a left window
// bound to the first key row 0 sees) to the last, tiles of keysPerTile
// keys dealt round robin: split s takes tiles first+s, first+s+numSplits,
// ..., so splits past the tiles are empty. Each split runs an online
// softmax tile by tile over the keys a row sees (base-2 exponentials of
// the score times log2(e), as the kernels compute; a tile with no visible
// key is skipped) and yields a partial output normalized by its own sum
// and its lse; a split that sees no key yields o = 0 and lse = -inf. Stage
// 2 merges the splits of a row with the max-LSE trick; a row that sees no
// key gets out = 0 and lse = -inf. numSplits == 1 is the kernels'
// single-stage path: the one split is the answer. With Sinks, split 0
// starts from the row's sink, the state (sink * log2(e), 1) with output 0,
// as the kernels' does: a row that sees no key gets lse = its sink.
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
	k, v, qs := h.K, h.V, h.Q
	if h.SeqlenNew > 0 {
		k, v, qs = h.appendNew()
	}
	s, d := h.Shape, h.HeadDim
	group := s.HeadsQ / s.HeadsKV
	out = make([]float32, s.Batch*s.SeqlenQ*s.HeadsQ*d)
	lse = make([]float32, s.Batch*s.HeadsQ*s.SeqlenQ)
	oPart := make([][]float32, numSplits) // per split: the row's partial output
	lsePart := make([]float32, numSplits)
	for i := range oPart {
		oPart[i] = make([]float32, d)
	}
	left, _ := h.window()
	for b := 0; b < s.Batch; b++ {
		n := h.length(b)
		lo := h.leftpad(b, n)
		first := lo // the first key of the block's range
		if left >= 0 {
			first = max(lo, n-s.SeqlenQ-left)
		}
		tiles := tileRange{first: first / keysPerTile, end: ceilDiv(n, keysPerTile), keys: keysPerTile}
		for kvh := 0; kvh < s.HeadsKV; kvh++ {
			// Packed rows of this (batch, K/V head), as the kernels order them.
			for r := 0; r < group*s.SeqlenQ; r++ {
				hq, i := kvh*group+r/s.SeqlenQ, r%s.SeqlenQ
				q := qs[((b*s.SeqlenQ+i)*s.HeadsQ+hq)*d:][:d]
				for sp := 0; sp < numSplits; sp++ {
					lsePart[sp] = h.splitPartial(oPart[sp], q, k, v, b, kvh, hq, i, n, lo, tiles, sp, numSplits)
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

// tileRange is a sequence's key tiles first..end-1 of keys keys each.
type tileRange struct{ first, end, keys int }

// splitPartial is stage 1 for one row (query head hq, query i of sequence
// b, whose length is n and first valid key lo) and one split: an online
// softmax over the tiles split, split+step, ... of tiles (cut at n), over
// the keys the row sees. It writes the partial output, normalized by its
// own sum, to o and returns its natural-log lse: -inf, with o = 0, when it
// saw no key.
func (h *HostProblem) splitPartial(o, q, kc, vc []float32, b, kvh, hq, i, n, lo int, tiles tileRange, split, step int) float32 {
	d := h.HeadDim
	clear(o)
	scale := float32(h.scale())
	scaleLog2 := float32(h.scale() * math.Log2E)
	capLog2 := float32(float64(h.Softcap) * math.Log2E)
	slopeLog2 := float32(float64(h.slope(b, hq)) * math.Log2E)
	pos := n - h.SeqlenQ + i
	m := float32(math.Inf(-1)) // running max of the base-2 scores
	var l float32              // running sum of exp2(x - m)
	if h.Sinks != nil && split == 0 {
		m, l = h.Sinks[hq]*math.Log2E, 1 // the sink: a term with no value
	}
	x := make([]float32, tiles.keys)
	kBuf, vBuf := h.descaleBuffers()
	for t := tiles.first + split; t < tiles.end; t += step {
		t0, te := t*tiles.keys, min((t+1)*tiles.keys, n)
		tmax := float32(math.Inf(-1))
		for j := t0; j < te; j++ {
			x[j-t0] = float32(math.Inf(-1))
			if !h.sees(pos, j, n, lo) {
				continue
			}
			var dot float32
			k := h.scaledKV(kBuf, h.KDescale, kc, b, j, kvh)
			for e := range d {
				dot += q[e] * k[e]
			}
			if h.Softcap > 0 {
				x[j-t0] = capLog2 * float32(math.Tanh(float64(dot*scale/h.Softcap)))
			} else {
				x[j-t0] = dot * scaleLog2
			}
			if h.AlibiSlopes != nil {
				x[j-t0] -= slopeLog2 * float32(abs(pos-j))
			}
			tmax = max(tmax, x[j-t0])
		}
		if math.IsInf(float64(tmax), -1) {
			continue // the row sees no key of this tile
		}
		mNew := max(m, tmax)
		alpha := exp2(m - mNew) // 0 while nothing was seen (m = -inf)
		l *= alpha
		for e := range o {
			o[e] *= alpha
		}
		for j := t0; j < te; j++ {
			p := exp2(x[j-t0] - mNew) // 0 for the keys the row does not see
			if p == 0 {
				continue
			}
			l += p
			v := h.scaledKV(vBuf, h.VDescale, vc, b, j, kvh)
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

// ReferenceAppend returns what the append kernel leaves before stage 1:
// copies of K and V with the new tokens written in (the new keys rotated
// when RotaryDim > 0) and q rotated (a copy of Q without rotary). Without
// new tokens it returns copies of K, V and Q. A GPU test compares the
// caches after a decode with k and v.
func ReferenceAppend(h *HostProblem) (k, v, q []float32, err error) {
	if err := h.check("reference"); err != nil {
		return nil, nil, nil, err
	}
	if h.SeqlenNew == 0 {
		return append([]float32(nil), h.K...), append([]float32(nil), h.V...), append([]float32(nil), h.Q...), nil
	}
	k, v, q = h.appendNew()
	return k, v, q, nil
}

// appendNew is ReferenceAppend for a checked problem with new tokens: token
// t of sequence b goes to key cachedLength(b) + t when that is in
// [0, SeqlenCache) and, paged, on a page in range. Where two sequences'
// tokens share a slot the kernels leave either one; the reference writes
// in order, so the later one's stays (tests give sequences their own slots).
func (h *HostProblem) appendNew() (k, v, q []float32) {
	s, d := h.Shape, h.HeadDim
	k, v = append([]float32(nil), h.K...), append([]float32(nil), h.V...)
	q = append([]float32(nil), h.Q...)
	perRow := h.rotaryPerRow()
	for b := 0; b < s.Batch; b++ {
		at := h.cachedLength(b)
		if h.RotaryDim > 0 {
			for i := 0; i < s.SeqlenQ; i++ {
				p := at
				if perRow {
					p += i
				}
				for hq := 0; hq < s.HeadsQ; hq++ {
					h.rotate(q[((b*s.SeqlenQ+i)*s.HeadsQ+hq)*d:][:d], p)
				}
			}
		}
		for t := 0; t < s.SeqlenNew; t++ {
			off, ok := h.writeSlot(b, at+t)
			if !ok {
				continue
			}
			for kvh := 0; kvh < s.HeadsKV; kvh++ {
				src := ((b*s.SeqlenNew+t)*s.HeadsKV + kvh) * d
				dst := off + kvh*d
				copy(k[dst:dst+d], h.KNew[src:src+d])
				copy(v[dst:dst+d], h.VNew[src:src+d])
				if h.RotaryDim > 0 {
					h.rotate(k[dst:dst+d], at+t)
				}
				h.quantizeRow(k[dst:dst+d], h.KDescale, b, kvh)
				h.quantizeRow(v[dst:dst+d], h.VDescale, b, kvh)
			}
		}
	}
	return k, v, q
}

// rotate applies the rotary embedding at position p (clamped to the
// tables) to the first RotaryDim channels of x, in place.
func (h *HostProblem) rotate(x []float32, p int) {
	half := h.RotaryDim / 2
	r := max(0, min(p, len(h.RotaryCos)/half-1))
	cos, sin := h.RotaryCos[r*half:][:half], h.RotarySin[r*half:][:half]
	for m := range half {
		i0, i1 := m, m+half
		if h.RotaryInterleaved {
			i0, i1 = 2*m, 2*m+1
		}
		x[i0], x[i1] = rotatePair(h.DType, x[i0], x[i1], cos[m], sin[m])
	}
}

// rotatePair rotates (x0, x1) by the angle of (cos, sin) in float32 and
// rounds the results to dt, as the kernels do.
func rotatePair(dt DType, x0, x1, cos, sin float32) (float32, float32) {
	return roundTo(dt, float32(x0*cos)-float32(x1*sin)), roundTo(dt, float32(x0*sin)+float32(x1*cos))
}

// NaiveAttention computes the same attention as ReferenceDecode in float64
// with a plain softmax over all visible keys at once: out (Batch, SeqlenQ,
// HeadsQ, HeadDim) and natural-log lse (Batch, HeadsQ, SeqlenQ), the sink's
// exp(Sinks[head]) in the sum where given; a row that sees no key gets
// out = 0 and lse = -inf (its sink with Sinks). It reads a sequence's new
// tokens straight from KNew and VNew (rotated at their positions), the
// other keys from the cache, so it assumes that no two sequences' new
// tokens share a cache slot and that their pages are in range. It is the
// yardstick the two-stage reference is tested against.
func NaiveAttention(h *HostProblem) (out, lse []float64, err error) {
	if err := h.check("naive"); err != nil {
		return nil, nil, err
	}
	s, d := h.Shape, h.HeadDim
	scale := h.scale()
	left, right := h.window()
	out = make([]float64, s.Batch*s.SeqlenQ*s.HeadsQ*d)
	lse = make([]float64, s.Batch*s.HeadsQ*s.SeqlenQ)
	perRow := h.rotaryPerRow()
	q := make([]float32, d)
	for b := 0; b < s.Batch; b++ {
		at := h.cachedLength(b)
		n := max(0, min(at+s.SeqlenNew, s.SeqlenCache))
		lo := 0
		if h.CacheLeftpad != nil {
			lo = max(0, min(int(h.CacheLeftpad[b]), n))
		}
		for hq := 0; hq < s.HeadsQ; hq++ {
			kvh := hq / (s.HeadsQ / s.HeadsKV)
			for i := 0; i < s.SeqlenQ; i++ {
				copy(q, h.Q[((b*s.SeqlenQ+i)*s.HeadsQ+hq)*d:][:d])
				if h.RotaryDim > 0 {
					p := at
					if perRow {
						p = at + i
					}
					h.naiveRotate(q, p)
				}
				o := out[((b*s.SeqlenQ+i)*s.HeadsQ+hq)*d:][:d]
				row := (b*s.HeadsQ+hq)*s.SeqlenQ + i
				pos := n - s.SeqlenQ + i
				var keys []int
				for j := lo; j < n; j++ {
					if (left < 0 || j >= pos-left) && (right < 0 || j <= pos+right) {
						keys = append(keys, j)
					}
				}
				sink := math.Inf(-1) // no sink: exp(sink) = 0
				if h.Sinks != nil {
					sink = float64(h.Sinks[hq])
				}
				if len(keys) == 0 {
					lse[row] = sink
					continue
				}
				scores := make([]float64, len(keys))
				mx := math.Inf(-1)
				for c, j := range keys {
					k := h.naiveKV(h.K, h.KNew, b, j, kvh, at, true)
					var dot float64
					for e := range d {
						dot += float64(q[e]) * float64(k[e])
					}
					x := dot * scale
					if h.Softcap > 0 {
						x = float64(h.Softcap) * math.Tanh(x/float64(h.Softcap))
					}
					x -= float64(h.slope(b, hq)) * math.Abs(float64(pos-j))
					scores[c] = x
					mx = max(mx, x)
				}
				mx = max(mx, sink)
				sum := math.Exp(sink - mx)
				for c, x := range scores {
					p := math.Exp(x - mx)
					sum += p
					v := h.naiveKV(h.V, h.VNew, b, keys[c], kvh, at, false)
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

// naiveKV is key or value j of (sequence b, K/V head kvh) as
// NaiveAttention sees it: the new token j - at when the sequence appended
// it (a key rotated at position j; quantized into an fp8 cache), else the
// cached one, scaled by its descale.
func (h *HostProblem) naiveKV(cache, fresh []float32, b, j, kvh, at int, key bool) []float32 {
	d := h.HeadDim
	scales := h.VDescale
	if key {
		scales = h.KDescale
	}
	var x []float32
	if t := j - at; t >= 0 && t < h.SeqlenNew {
		x = append(x, fresh[((b*h.SeqlenNew+t)*h.HeadsKV+kvh)*d:][:d]...)
		if key && h.RotaryDim > 0 {
			h.naiveRotate(x, j)
		}
		h.quantizeRow(x, scales, b, kvh)
	} else if x = h.kv(cache, b, j, kvh); h.KVDType.FP8() {
		x = append([]float32(nil), x...)
	}
	if h.KVDType.FP8() {
		ds := h.descale(scales, b, kvh)
		for e := range x {
			x[e] *= ds
		}
	}
	return x
}

// naiveRotate is NaiveAttention's rotary embedding at position p of x: the
// pairs (2m, 2m+1) or (m, m + RotaryDim/2) at table row p (clamped).
func (h *HostProblem) naiveRotate(x []float32, p int) {
	half := h.RotaryDim / 2
	rows := len(h.RotaryCos) / half
	p = max(0, min(p, rows-1))
	for m := 0; m < half; m++ {
		a, c := m, half+m
		if h.RotaryInterleaved {
			a, c = 2*m, 2*m+1
		}
		x[a], x[c] = rotatePair(h.DType, x[a], x[c], h.RotaryCos[p*half+m], h.RotarySin[p*half+m])
	}
}

// check validates the shape, the options and the slice lengths.
func (h *HostProblem) check(op string) error {
	if h == nil {
		return invalid(op, "", "nil HostProblem")
	}
	if err := h.Shape.validateSizes(op); err != nil {
		return err
	}
	s := h.Shape
	if s.SeqlenNew < 0 || s.SeqlenNew > s.SeqlenCache {
		return invalid(op, "k", fmt.Sprintf("%d new tokens; must be in [0, seqlen_cache=%d]", s.SeqlenNew, s.SeqlenCache))
	}
	row := s.HeadsKV * s.HeadDim // elements of one key
	cacheLen := s.Batch * s.SeqlenCache * row
	switch {
	case h.PageSize < 0 || (h.PageSize == 0) != (h.BlockTable == nil):
		return invalid(op, "page_size", fmt.Sprintf("%d with a block table of %d entries: both or neither", h.PageSize, len(h.BlockTable)))
	case h.PageSize > 0 && h.CacheBatchIdx != nil:
		return invalid(op, "cache_batch_idx", "cannot be used with block_table")
	case h.PageSize > 0 && (len(h.BlockTable)%s.Batch != 0 || len(h.BlockTable)/s.Batch*h.PageSize != s.SeqlenCache):
		return invalid(op, "block_table", fmt.Sprintf("%d entries for batch %d: want %d pages of %d keys a sequence", len(h.BlockTable), s.Batch, s.SeqlenCache/h.PageSize, h.PageSize))
	case h.PageSize > 0:
		cacheLen = -1 // any whole number of pages, at least one
		if n := len(h.K); n == 0 || n%(h.PageSize*row) != 0 {
			return invalid(op, "k_cache", fmt.Sprintf("%d elements: not a positive number of pages of %d", n, h.PageSize*row))
		}
	case h.CacheBatchIdx != nil:
		cacheLen = -1 // any number of rows
		if n, per := len(h.K), s.SeqlenCache*row; (per == 0 && n != 0) || (per > 0 && n%per != 0) {
			return invalid(op, "k_cache", fmt.Sprintf("%d elements: not a whole number of rows of %d", n, per))
		}
		if len(h.CacheBatchIdx) != s.Batch {
			return invalid(op, "cache_batch_idx", fmt.Sprintf("%d rows for batch %d", len(h.CacheBatchIdx), s.Batch))
		}
	}
	want := []struct {
		name     string
		got, len int
	}{
		{"q", len(h.Q), s.Batch * s.SeqlenQ * s.HeadsQ * s.HeadDim},
		{"k_cache", len(h.K), cacheLen},
		{"v_cache", len(h.V), len(h.K)},
		{"k", len(h.KNew), s.Batch * s.SeqlenNew * row},
		{"v", len(h.VNew), s.Batch * s.SeqlenNew * row},
	}
	for _, w := range want {
		if w.len >= 0 && w.got != w.len {
			return invalid(op, w.name, fmt.Sprintf("%d elements, want %d", w.got, w.len))
		}
	}
	if err := h.checkDescales(op); err != nil {
		return err
	}
	if h.CacheSeqlens != nil && len(h.CacheSeqlens) != s.Batch {
		return invalid(op, "cache_seqlens", fmt.Sprintf("%d lengths for batch %d", len(h.CacheSeqlens), s.Batch))
	}
	if h.CacheLeftpad != nil && len(h.CacheLeftpad) != s.Batch {
		return invalid(op, "cache_leftpad", fmt.Sprintf("%d values for batch %d", len(h.CacheLeftpad), s.Batch))
	}
	if sc := float64(h.Scale); math.IsNaN(sc) || math.IsInf(sc, 0) || sc < 0 {
		return invalid(op, "softmax_scale", fmt.Sprintf("%v; must be finite and not negative", h.Scale))
	}
	if w := h.Window; w.Enabled && (w.Left < -1 || w.Right < -1) {
		return invalid(op, "window_size", fmt.Sprintf("(%d, %d); each side must be -1 or at least 0", w.Left, w.Right))
	}
	if c := float64(h.Softcap); math.IsNaN(c) || math.IsInf(c, 0) || c < 0 {
		return invalid(op, "softcap", fmt.Sprintf("%v; must be finite and not negative", h.Softcap))
	}
	if n := len(h.AlibiSlopes); h.AlibiSlopes != nil && n != s.HeadsQ && n != s.Batch*s.HeadsQ {
		return invalid(op, "alibi_slopes", fmt.Sprintf("%d slopes; want nheads_q=%d or batch*nheads_q=%d", n, s.HeadsQ, s.Batch*s.HeadsQ))
	}
	if h.Sinks != nil && len(h.Sinks) != s.HeadsQ {
		return invalid(op, "sinks", fmt.Sprintf("%d logits; want nheads_q=%d", len(h.Sinks), s.HeadsQ))
	}
	switch r := h.RotaryDim; {
	case r == 0 && (h.RotaryCos != nil || h.RotarySin != nil):
		return invalid(op, "rotary_cos", "given without rotary_dim")
	case r == 0:
	case r < 0 || r%2 != 0 || r > s.HeadDim:
		return invalid(op, "rotary_dim", fmt.Sprintf("%d; must be even and at most headdim=%d", r, s.HeadDim))
	case s.SeqlenNew == 0:
		return invalid(op, "rotary_cos", "needs k and v")
	case len(h.RotaryCos) == 0 || len(h.RotaryCos)%(r/2) != 0 || len(h.RotarySin) != len(h.RotaryCos):
		return invalid(op, "rotary_cos", fmt.Sprintf("%d and %d elements: want the same positive number of rows of %d", len(h.RotaryCos), len(h.RotarySin), r/2))
	}
	return nil
}

// cachedLength is sequence b's cached length as given (cache_seqlens, or
// Seqlen, or SeqlenCache), not clamped: where its new tokens go.
func (h *HostProblem) cachedLength(b int) int {
	switch {
	case h.CacheSeqlens != nil:
		return int(h.CacheSeqlens[b])
	case h.Seqlen >= 0:
		return h.Seqlen
	}
	return h.SeqlenCache
}

// length is the keys sequence b attends to: its cached length plus the new
// tokens, clamped to [0, SeqlenCache].
func (h *HostProblem) length(b int) int {
	return max(0, min(h.cachedLength(b)+h.SeqlenNew, h.SeqlenCache))
}

// leftpad is sequence b's first valid key, clamped to [0, n].
func (h *HostProblem) leftpad(b, n int) int {
	if h.CacheLeftpad == nil {
		return 0
	}
	return max(0, min(int(h.CacheLeftpad[b]), n))
}

// window is the key window around a query's position: (left, right) keys
// before and after it, -1 unbounded; causal makes right 0.
func (h *HostProblem) window() (left, right int) {
	left, right = -1, -1
	if h.Window.Enabled {
		left, right = h.Window.Left, h.Window.Right
	}
	if h.Causal {
		right = 0
	}
	return left, right
}

// sees reports whether the query at position pos of a sequence of length n
// whose keys start at lo sees key j.
func (h *HostProblem) sees(pos, j, n, lo int) bool {
	left, right := h.window()
	return j >= lo && j < n && (left < 0 || j >= pos-left) && (right < 0 || j <= pos+right)
}

// rotaryPerRow reports whether query row i is rotated at the cached length
// plus i (causal or a window bound) rather than every row at the cached
// length.
func (h *HostProblem) rotaryPerRow() bool {
	left, right := h.window()
	return left >= 0 || right >= 0
}

// slope is the ALiBi slope of query head hq of sequence b, 0 without ALiBi.
func (h *HostProblem) slope(b, hq int) float32 {
	switch len(h.AlibiSlopes) {
	case 0:
		return 0
	case h.HeadsQ:
		return h.AlibiSlopes[hq]
	}
	return h.AlibiSlopes[b*h.HeadsQ+hq]
}

// slot is the offset in K or V of key j of sequence b, K/V head 0: the
// clamped cache row, or the clamped page, as the kernels read.
func (h *HostProblem) slot(b, j int) int {
	row := h.HeadsKV * h.HeadDim
	if h.PageSize > 0 {
		pages := len(h.K) / (h.PageSize * row)
		page := max(0, min(int(h.BlockTable[b*(h.SeqlenCache/h.PageSize)+j/h.PageSize]), pages-1))
		return (page*h.PageSize + j%h.PageSize) * row
	}
	if h.CacheBatchIdx != nil {
		rows := len(h.K) / max(1, h.SeqlenCache*row)
		b = max(0, min(int(h.CacheBatchIdx[b]), rows-1))
	}
	return (b*h.SeqlenCache + j) * row
}

// writeSlot is slot for a write of key j of sequence b, and whether the
// write happens: j in [0, SeqlenCache) and, paged, a page in range.
func (h *HostProblem) writeSlot(b, j int) (int, bool) {
	if j < 0 || j >= h.SeqlenCache {
		return 0, false
	}
	if h.PageSize > 0 {
		pages := len(h.K) / (h.PageSize * h.HeadsKV * h.HeadDim)
		if page := int(h.BlockTable[b*(h.SeqlenCache/h.PageSize)+j/h.PageSize]); page < 0 || page >= pages {
			return 0, false
		}
	}
	return h.slot(b, j), true
}

// kv returns the head_dim vector of key/value j of (batch b, K/V head kvh)
// in the cache t (K or V, or a copy of either).
func (h *HostProblem) kv(t []float32, b, j, kvh int) []float32 {
	return t[h.slot(b, j)+kvh*h.HeadDim:][:h.HeadDim]
}

// scale is the softmax scale, 1/sqrt(HeadDim) when Scale is 0.
func (h *HostProblem) scale() float64 {
	if h.Scale == 0 {
		return 1 / math.Sqrt(float64(h.HeadDim))
	}
	return float64(h.Scale)
}

func exp2(x float32) float32 { return float32(math.Exp2(float64(x))) }

func abs(x int) int { return max(x, -x) }

// roundTo rounds x to the nearest value of dt (ties to even), as a kernel
// storing it in dt does: float16 overflows to infinity past 65504.
func roundTo(dt DType, x float32) float32 {
	f := float64(x)
	if math.IsNaN(f) || math.IsInf(f, 0) || f == 0 {
		return x
	}
	if dt == BFloat16 {
		b := math.Float32bits(x)
		b += 0x7fff + (b>>16)&1
		return math.Float32frombits(b &^ 0xffff)
	}
	// float16: 10 fraction bits, exponents -14..15, subnormals in steps of 2^-24.
	_, exp := math.Frexp(math.Abs(f)) // |f| in [2^(exp-1), 2^exp)
	step := math.Ldexp(1, max(exp-11, -24))
	r := math.RoundToEven(f/step) * step
	if math.Abs(r) > 65504 {
		return float32(math.Copysign(math.Inf(1), f))
	}
	return float32(r)
}

// checkDescales checks KDescale and VDescale: only with an fp8 cache, of
// one value or (Batch, HeadsKV), each positive and finite.
func (h *HostProblem) checkDescales(op string) error {
	for _, x := range [...]struct {
		name string
		d    []float32
	}{{"k_descale", h.KDescale}, {"v_descale", h.VDescale}} {
		switch n := len(x.d); {
		case x.d == nil:
			continue
		case !h.KVDType.FP8():
			return invalid(op, x.name, fmt.Sprintf("given with a %v cache; descales scale an fp8 cache", h.CacheDType()))
		case n != 1 && n != h.Batch*h.HeadsKV:
			return invalid(op, x.name, fmt.Sprintf("%d values; want 1 or batch*nheads_kv=%d", n, h.Batch*h.HeadsKV))
		}
		for _, v := range x.d {
			if !(v > 0) || math.IsInf(float64(v), 0) {
				return invalid(op, x.name, fmt.Sprintf("%v; must be positive and finite", v))
			}
		}
	}
	return nil
}

// descale is the scale of (sequence b, K/V head kvh) in scales (KDescale
// or VDescale): 1 without them.
func (h *HostProblem) descale(scales []float32, b, kvh int) float32 {
	switch len(scales) {
	case 0:
		return 1
	case 1:
		return scales[0]
	}
	return scales[b*h.HeadsKV+kvh]
}

// descaleBuffers are a key's and a value's room for their scaled copies
// (scaledKV), nil without an fp8 cache.
func (h *HostProblem) descaleBuffers() (k, v []float32) {
	if !h.KVDType.FP8() {
		return nil, nil
	}
	return make([]float32, h.HeadDim), make([]float32, h.HeadDim)
}

// scaledKV is kv's vector as attended: with an fp8 cache, scaled by its
// descale into buf (descaleBuffers) in float32.
func (h *HostProblem) scaledKV(buf, scales, t []float32, b, j, kvh int) []float32 {
	x := h.kv(t, b, j, kvh)
	if buf == nil {
		return x
	}
	ds := h.descale(scales, b, kvh)
	for e := range x {
		buf[e] = x[e] * ds
	}
	return buf
}

// quantizeRow stores x, a new key or value of (sequence b, K/V head kvh),
// as an fp8 cache holds it (quantize), in place; nothing without one.
func (h *HostProblem) quantizeRow(x, scales []float32, b, kvh int) {
	if !h.KVDType.FP8() {
		return
	}
	ds := h.descale(scales, b, kvh)
	for e := range x {
		x[e] = quantize(h.KVDType, x[e], ds)
	}
}
