package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flash-decode/flash-decode/core"
)

// The GPU tests' tolerances, from the data rather than fixed: an output
// element may be off by outSteps rounding steps of the output dtype, taken
// at its own size plus its row's RMS (the size of the rounding noise of P
// in P V, which the kernels store in the input dtype), and the LSE, fp32
// throughout, by lseRel of its size (at least 1). A dropped key tile or
// split moves a long row by more than that (TestTolerancesSeeADroppedTile).
const (
	outSteps = 4
	lseRel   = 1e-4
)

// step is the spacing of dt's values in [1, 2).
func step(dt core.DType) float64 {
	if dt == core.BFloat16 {
		return 0x1p-7
	}
	return 0x1p-10
}

// compareAttention checks out (rows of headDim values) and lse against the
// float64 reference; it returns nil or what is off: the first element out
// of bounds and how many are. worst is the largest error in units of its
// bound.
func compareAttention(dt core.DType, headDim int, out []float32, want []float64, lse []float32, wantLSE []float64) (worst float64, err error) {
	bad, first := 0, ""
	note := func(what string, i int, got float32, w, bound float64) {
		ratio := math.Abs(float64(got)-w) / bound
		if math.IsNaN(ratio) || math.IsInf(float64(got), 0) != math.IsInf(w, 0) {
			ratio = math.Inf(1)
		}
		if !(ratio <= worst) {
			worst = ratio
		}
		if !(ratio <= 1) {
			if bad++; first == "" {
				first = fmt.Sprintf("%s[%d] = %v, want %v (bound %.3g)", what, i, got, w, bound)
			}
		}
	}
	for r := 0; r < len(want); r += headDim {
		row := want[r : r+headDim]
		var ss float64
		for _, w := range row {
			ss += w * w
		}
		rms := math.Sqrt(ss / float64(headDim))
		for e, w := range row {
			note("out", r+e, out[r+e], w, outSteps*step(dt)*(math.Abs(w)+rms)+0x1p-24)
		}
	}
	for i, w := range wantLSE {
		if math.IsInf(w, -1) && math.IsInf(float64(lse[i]), -1) {
			continue
		}
		note("lse", i, lse[i], w, lseRel*max(1, math.Abs(w)))
	}
	if bad > 0 {
		return worst, fmt.Errorf("%d values out of bounds, worst %.3g x its bound; first %s", bad, worst, first)
	}
	return worst, nil
}

// plantKeys makes key positions(n) of every sequence (n its length) the
// largest score of every row of its K/V head: the sequence's q rows of a
// K/V head get the signs of the first one, and the planted keys are those
// signs (+-1, exact in fp16 and bf16), so each scores sum |q| * scale
// (about 5.7 at head dim 128) against about 1.3 for the best random key.
// Dropping the tile or split that holds one then moves the long rows' out
// and lse far past their bounds.
func plantKeys(h *core.HostProblem, positions func(n int) []int) {
	s, d := h.Shape, h.HeadDim
	group := s.HeadsQ / s.HeadsKV
	for b := 0; b < s.Batch; b++ {
		for kvh := 0; kvh < s.HeadsKV; kvh++ {
			sign := make([]float32, d)
			for e := range sign {
				sign[e] = float32(math.Copysign(1, float64(h.Q[((b*s.SeqlenQ)*s.HeadsQ+kvh*group)*d+e])))
			}
			for i := 0; i < s.SeqlenQ; i++ {
				for hq := kvh * group; hq < (kvh+1)*group; hq++ {
					q := h.Q[((b*s.SeqlenQ+i)*s.HeadsQ+hq)*d:][:d]
					for e := range q {
						q[e] = float32(math.Abs(float64(q[e]))) * sign[e]
					}
				}
			}
			for _, j := range positions(hostLength(h, b)) {
				if j >= 0 && j < s.SeqlenCache {
					copy(h.K[((b*s.SeqlenCache+j)*s.HeadsKV+kvh)*d:][:d], sign)
				}
			}
		}
	}
}

// lastAndMiddle plants the last key a sequence's rows all see (the last
// tile: n - seqlenQ, and n - 1 for the last row) and its middle one (in
// another split where the sequence has several).
func lastAndMiddle(seqlenQ int) func(n int) []int {
	return func(n int) []int {
		if n == 0 {
			return nil
		}
		return []int{n - 1, n - seqlenQ, n / 2}
	}
}

// hostLength is sequence b's length in a contiguous HostProblem without new
// tokens.
func hostLength(h *core.HostProblem, b int) int {
	n := h.SeqlenCache
	if h.CacheSeqlens != nil {
		n = int(h.CacheSeqlens[b])
	} else if h.Seqlen >= 0 {
		n = h.Seqlen
	}
	return max(0, min(n, h.SeqlenCache))
}

// lowPrecisionDecode is what a kernel computes on a contiguous HostProblem
// without serving features, the keys keep(b, j) drops left out: an online
// softmax over tiles of keysPerTile keys, base-2 scores in float32, P
// rounded to the dtype for P V while the sum keeps it unrounded, out
// rounded to the dtype. With keep always true it stands for a correct
// kernel; the tests below drop a tile or a split.
func lowPrecisionDecode(h *core.HostProblem, keysPerTile int, keep func(b, j int) bool) (out []float32, lse []float32) {
	s, d := h.Shape, h.HeadDim
	group := s.HeadsQ / s.HeadsKV
	scaleLog2 := float32(math.Log2E / math.Sqrt(float64(d)))
	out = make([]float32, s.Batch*s.SeqlenQ*s.HeadsQ*d)
	lse = make([]float32, s.Batch*s.HeadsQ*s.SeqlenQ)
	x, o := make([]float32, keysPerTile), make([]float32, d)
	for b := 0; b < s.Batch; b++ {
		n := hostLength(h, b)
		for hq := 0; hq < s.HeadsQ; hq++ {
			kvh := hq / group
			for i := 0; i < s.SeqlenQ; i++ {
				q := h.Q[((b*s.SeqlenQ+i)*s.HeadsQ+hq)*d:][:d]
				last := n - 1
				if h.Causal {
					last = n - s.SeqlenQ + i
				}
				m, l := float32(math.Inf(-1)), float32(0)
				clear(o)
				for t0 := 0; t0 <= last; t0 += keysPerTile {
					tmax := float32(math.Inf(-1))
					for j := t0; j < t0+keysPerTile; j++ {
						x[j-t0] = float32(math.Inf(-1))
						if j > last || !keep(b, j) {
							continue
						}
						var dot float32
						for e, k := range h.K[((b*s.SeqlenCache+j)*s.HeadsKV+kvh)*d:][:d] {
							dot += q[e] * k
						}
						x[j-t0] = dot * scaleLog2
						tmax = max(tmax, x[j-t0])
					}
					if math.IsInf(float64(tmax), -1) {
						continue
					}
					mNew := max(m, tmax)
					alpha := float32(math.Exp2(float64(m - mNew)))
					l *= alpha
					for e := range o {
						o[e] *= alpha
					}
					for j := t0; j < t0+keysPerTile; j++ {
						p := float32(math.Exp2(float64(x[j-t0] - mNew)))
						if p == 0 {
							continue
						}
						l += p
						pr := roundToDType(s.DType, p)
						for e, v := range h.V[((b*s.SeqlenCache+j)*s.HeadsKV+kvh)*d:][:d] {
							o[e] += pr * v
						}
					}
					m = mNew
				}
				row := out[((b*s.SeqlenQ+i)*s.HeadsQ+hq)*d:][:d]
				lse[(b*s.HeadsQ+hq)*s.SeqlenQ+i] = float32(math.Inf(-1))
				if l > 0 {
					for e := range row {
						row[e] = roundToDType(s.DType, o[e]/l)
					}
					lse[(b*s.HeadsQ+hq)*s.SeqlenQ+i] = (m + float32(math.Log2(float64(l)))) * math.Ln2
				}
			}
		}
	}
	return out, lse
}

// roundToDType rounds x to the nearest fp16 or bf16 value (ties to even;
// the values here are finite and far from fp16's overflow).
func roundToDType(dt core.DType, x float32) float32 {
	if dt == core.BFloat16 {
		b := math.Float32bits(x)
		return math.Float32frombits((b + 0x7fff + (b>>16)&1) &^ 0xffff)
	}
	_, exp := math.Frexp(math.Abs(float64(x)))
	unit := math.Ldexp(1, max(exp-11, -24)) // fp16's spacing at x, subnormals included
	return float32(math.RoundToEven(float64(x)/unit) * unit)
}

// TestTolerancesSeeADroppedTile runs compareAttention, without a GPU, on
// what a correct kernel computes and on what a kernel that skips a
// sequence's last key tile, or one of its 100 splits, computes, on the
// inputs of TestDecodeMatchesNaiveAttention's "bf16 gqa8 many splits" (and
// fp16), with and without planted keys: the correct one must pass, the
// broken ones must not.
func TestTolerancesSeeADroppedTile(t *testing.T) {
	const keysPerTile, splits = 64, 100 // the d128 kernels' tile; the case's split count
	// The case with 16 query heads on 2 K/V heads, not 64 on 8: a quarter of the CPU time.
	s := core.Shape{DType: core.BFloat16, Batch: 1, SeqlenQ: 1, HeadsQ: 16, HeadsKV: 2, HeadDim: 128, SeqlenCache: 20000, Seqlen: -1, NumSplits: splits}
	for _, planted := range []bool{false, true} {
		r := rand.New(rand.NewPCG(1, 2))
		h := &core.HostProblem{Shape: s, CacheSeqlens: []int32{19999},
			Q: randomExact(r, s.Batch*s.SeqlenQ*s.HeadsQ*s.HeadDim),
			K: randomExact(r, s.Batch*s.SeqlenCache*s.HeadsKV*s.HeadDim),
			V: randomExact(r, s.Batch*s.SeqlenCache*s.HeadsKV*s.HeadDim)}
		if planted {
			plantKeys(h, lastAndMiddle(s.SeqlenQ))
		}
		want, wantLSE, err := core.NaiveAttention(h) // the inputs are exact in both dtypes
		if err != nil {
			t.Fatal(err)
		}
		n := hostLength(h, 0)
		lastTile, middle := (n-1)/keysPerTile, n/2/keysPerTile
		for _, dt := range []core.DType{core.BFloat16, core.Float16} {
			h.DType = dt
			for _, c := range []struct {
				name   string
				keep   func(b, j int) bool
				passes bool
			}{
				{"correct", func(b, j int) bool { return true }, true},
				{"last tile dropped", func(b, j int) bool { return j/keysPerTile != lastTile }, false},
				{"the last tile's split dropped", func(b, j int) bool { return j/keysPerTile%splits != lastTile%splits }, false},
				{"the middle key's split dropped", func(b, j int) bool { return j/keysPerTile%splits != middle%splits }, false},
			} {
				out, lse := lowPrecisionDecode(h, keysPerTile, c.keep)
				worst, err := compareAttention(dt, s.HeadDim, out, want, lse, wantLSE)
				t.Logf("%v planted %v, %s: worst error %.3g x its bound", dt, planted, c.name, worst)
				if (err == nil) != c.passes {
					t.Errorf("%v planted %v, %s: passes %v, want %v (%v)", dt, planted, c.name, err == nil, c.passes, err)
				}
			}
		}
	}
}
