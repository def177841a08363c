package core

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"testing/quick"
)

// randomHost fills a HostProblem of shape s with uniform values in [-1, 1).
func randomHost(s Shape, lens []int32, causal bool, seed uint64) *HostProblem {
	r := rand.New(rand.NewPCG(seed, 7))
	fill := func(n int) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = 2*r.Float32() - 1
		}
		return x
	}
	kv := s.Batch * s.SeqlenCache * s.HeadsKV * s.HeadDim
	return &HostProblem{Shape: s, Q: fill(s.Batch * s.SeqlenQ * s.HeadsQ * s.HeadDim), K: fill(kv), V: fill(kv),
		CacheSeqlens: lens, Causal: causal}
}

// compare fails unless the float32 reference matches the float64 naive
// attention: -inf LSEs exactly, the rest within tolerance.
func compare(t *testing.T, out, lse []float32, nOut, nLSE []float64) {
	t.Helper()
	for i := range nLSE {
		if math.IsInf(nLSE[i], -1) || math.IsInf(float64(lse[i]), -1) {
			if !math.IsInf(nLSE[i], -1) || !math.IsInf(float64(lse[i]), -1) {
				t.Fatalf("lse[%d] = %v, naive %v", i, lse[i], nLSE[i])
			}
			continue
		}
		if d := math.Abs(float64(lse[i]) - nLSE[i]); d > 1e-4+1e-5*math.Abs(nLSE[i]) {
			t.Fatalf("lse[%d] = %v, naive %v", i, lse[i], nLSE[i])
		}
	}
	for i := range nOut {
		if d := math.Abs(float64(out[i]) - nOut[i]); d > 2e-5+1e-4*math.Abs(nOut[i]) || math.IsNaN(float64(out[i])) {
			t.Fatalf("out[%d] = %v, naive %v", i, out[i], nOut[i])
		}
	}
}

func TestReferenceMatchesNaive(t *testing.T) {
	tests := []struct {
		name                         string
		batch, sq, hq, hkv, d, cache int
		seqlen                       int // used when lens is nil
		lens                         []int32
		causal                       bool
	}{
		{"mha", 2, 1, 4, 4, 16, 37, -1, nil, false},
		{"gqa 4", 2, 1, 8, 2, 32, 64, -1, nil, false},
		{"gqa 5 ragged", 3, 2, 10, 2, 8, 50, -1, []int32{0, 1, 50}, false},
		{"gqa 8 causal", 2, 4, 8, 1, 16, 40, -1, []int32{40, 17}, true},
		{"gqa 5 causal seqlen_q 16", 2, 16, 5, 1, 8, 33, -1, []int32{33, 9}, true},
		{"causal rows see nothing", 3, 8, 4, 4, 8, 20, -1, []int32{3, 0, 8}, true},
		{"length 1", 1, 1, 8, 8, 24, 10, 1, nil, false},
		{"length 1 causal", 1, 3, 4, 1, 8, 10, 1, nil, true},
		{"seqlen 0", 2, 1, 4, 2, 8, 10, 0, nil, false},
		{"empty cache", 2, 2, 4, 2, 8, 0, -1, nil, true},
		{"lens clamped", 3, 1, 4, 1, 8, 12, -1, []int32{-5, 12, 99}, false},
		{"seqlen below cache", 1, 2, 12, 4, 16, 64, 30, nil, true},
		{"head dim 128", 1, 1, 4, 1, 128, 300, -1, nil, false},
	}
	splits := []int{1, 2, 3, 7, 64}
	tiles := []int{1, 4, 16, 64}
	for ci, tt := range tests {
		s := Shape{DType: Float16, Batch: tt.batch, SeqlenQ: tt.sq, HeadsQ: tt.hq, HeadsKV: tt.hkv, HeadDim: tt.d,
			SeqlenCache: tt.cache, Seqlen: tt.seqlen}
		h := randomHost(s, tt.lens, tt.causal, uint64(ci))
		nOut, nLSE, err := NaiveAttention(h)
		if err != nil {
			t.Fatalf("%s: %v", tt.name, err)
		}
		for _, n := range splits {
			for _, kpt := range tiles {
				t.Run(fmt.Sprintf("%s/splits=%d/tile=%d", tt.name, n, kpt), func(t *testing.T) {
					out, lse, err := ReferenceDecode(h, n, kpt)
					if err != nil {
						t.Fatal(err)
					}
					compare(t, out, lse, nOut, nLSE)
				})
			}
		}
	}
}

// TestReferenceNoKey: rows that see no key give out = 0 and lse = -inf
// exactly, whatever the split.
func TestReferenceNoKey(t *testing.T) {
	s := Shape{DType: BFloat16, Batch: 2, SeqlenQ: 4, HeadsQ: 2, HeadsKV: 1, HeadDim: 8, SeqlenCache: 6, Seqlen: -1}
	h := randomHost(s, []int32{0, 2}, true, 1)
	for _, n := range []int{1, 4} {
		out, lse, err := ReferenceDecode(h, n, 2)
		if err != nil {
			t.Fatal(err)
		}
		for hq := 0; hq < 2; hq++ {
			for i := 0; i < 4; i++ {
				// Batch 0 sees nothing; batch 1 (length 2) lets query i see
				// keys j <= i - 2, so queries 0 and 1 see nothing.
				for b, empty := range []bool{true, i < 2} {
					row := (b*2+hq)*4 + i
					if empty != math.IsInf(float64(lse[row]), -1) {
						t.Fatalf("splits %d: lse[b=%d,h=%d,i=%d] = %v", n, b, hq, i, lse[row])
					}
					o := out[((b*4+i)*2+hq)*8:][:8]
					for _, x := range o {
						if empty && x != 0 {
							t.Fatalf("splits %d: out[b=%d,i=%d,h=%d] = %v, want 0", n, b, i, hq, o)
						}
					}
				}
			}
		}
	}
}

func TestReferenceScale(t *testing.T) {
	s := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 2, HeadsKV: 1, HeadDim: 16, SeqlenCache: 20, Seqlen: -1}
	h := randomHost(s, nil, false, 3)
	outDefault, lseDefault, _ := ReferenceDecode(h, 3, 4)
	h.Scale = 0.25 // = 1/sqrt(16)
	out, lse, err := ReferenceDecode(h, 3, 4)
	if err != nil {
		t.Fatal(err)
	}
	for i := range out {
		if out[i] != outDefault[i] {
			t.Fatalf("explicit 1/sqrt(d) differs from the default at %d", i)
		}
	}
	for i := range lse {
		if lse[i] != lseDefault[i] {
			t.Fatalf("explicit 1/sqrt(d) lse differs at %d", i)
		}
	}
	h.Scale = 2
	nOut, nLSE, _ := NaiveAttention(h)
	out, lse, _ = ReferenceDecode(h, 3, 4)
	compare(t, out, lse, nOut, nLSE)
}

func TestReferenceErrors(t *testing.T) {
	s := Shape{DType: Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 4, HeadsKV: 2, HeadDim: 8, SeqlenCache: 5, Seqlen: -1}
	tests := []struct {
		name      string
		edit      func(*HostProblem)
		splits, k int
		arg       string
	}{
		{"q short", func(h *HostProblem) { h.Q = h.Q[1:] }, 1, 1, "q"},
		{"k short", func(h *HostProblem) { h.K = nil }, 1, 1, "k_cache"},
		{"v long", func(h *HostProblem) { h.V = append(h.V, 0) }, 1, 1, "v_cache"},
		{"lens", func(h *HostProblem) { h.CacheSeqlens = []int32{1} }, 1, 1, "cache_seqlens"},
		{"shape", func(h *HostProblem) { h.HeadsKV = 3 }, 1, 1, "nheads_q"},
		{"scale", func(h *HostProblem) { h.Scale = float32(math.NaN()) }, 1, 1, "softmax_scale"},
		{"splits", func(h *HostProblem) {}, 0, 1, "num_splits"},
		{"tile", func(h *HostProblem) {}, 1, 0, "keys_per_tile"},
	}
	for _, tt := range tests {
		h := randomHost(s, nil, false, 0)
		tt.edit(h)
		_, _, err := ReferenceDecode(h, tt.splits, tt.k)
		var e *Error
		if !errors.As(err, &e) || e.Arg != tt.arg || !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: error %v, want one naming %q", tt.name, err, tt.arg)
		}
		if tt.splits > 0 && tt.k > 0 {
			if _, _, err := NaiveAttention(h); !errors.Is(err, ErrInvalid) {
				t.Errorf("%s: NaiveAttention error %v", tt.name, err)
			}
		}
	}
	if _, _, err := ReferenceDecode(nil, 1, 1); !errors.Is(err, ErrInvalid) {
		t.Errorf("nil: %v", err)
	}
}

// TestMergePartialsQuick: cutting a row's keys into any chunks (empty ones
// included), normalizing each by its own sum and merging by LSE gives the
// softmax over all of them.
func TestMergePartialsQuick(t *testing.T) {
	const d = 3
	f := func(seed uint64, nKeys, nCuts uint8, spread float32) bool {
		r := rand.New(rand.NewPCG(seed, 1))
		n := int(nKeys)%40 + 1
		sc := float64(math.Abs(float64(spread)))
		if math.IsNaN(sc) || sc > 30 {
			sc = 30
		}
		x := make([]float64, n)
		v := make([][d]float64, n)
		for j := range x {
			x[j] = (2*r.Float64() - 1) * sc
			for e := range v[j] {
				v[j][e] = 2*r.Float64() - 1
			}
		}
		cuts := []int{0, n}
		for range int(nCuts) % 8 {
			cuts = append(cuts, r.IntN(n+1))
		}
		slices.Sort(cuts)
		var (
			oParts [][]float32
			lParts []float32
		)
		for c := 0; c+1 < len(cuts); c++ {
			o, l := softmaxChunk(x[cuts[c]:cuts[c+1]], v[cuts[c]:cuts[c+1]])
			oParts, lParts = append(oParts, o), append(lParts, l)
		}
		out := make([]float32, d)
		lse := mergePartials(out, oParts, lParts)
		wantO, wantL := softmaxChunk(x, v)
		if math.Abs(float64(lse-wantL)) > 1e-4*(1+math.Abs(float64(wantL))) {
			return false
		}
		for e := range out {
			if math.Abs(float64(out[e]-wantO[e])) > 1e-5 {
				return false
			}
		}
		return true
	}
	if err := quick.Check(f, &quick.Config{MaxCount: 2000}); err != nil {
		t.Error(err)
	}
	// No split saw a key.
	out := []float32{9, 9}
	if lse := mergePartials(out, [][]float32{{0, 0}, {0, 0}}, []float32{float32(math.Inf(-1)), float32(math.Inf(-1))}); !math.IsInf(float64(lse), -1) || out[0] != 0 || out[1] != 0 {
		t.Errorf("all empty: lse %v out %v", lse, out)
	}
}

// softmaxChunk is one split's partial in float64: the softmax-weighted mean of
// v over scores x, and log(sum(exp(x))); 0 and -inf for no key.
func softmaxChunk(x []float64, v [][3]float64) ([]float32, float32) {
	o := make([]float32, 3)
	if len(x) == 0 {
		return o, float32(math.Inf(-1))
	}
	mx := math.Inf(-1)
	for _, s := range x {
		mx = max(mx, s)
	}
	var sum float64
	acc := [3]float64{}
	for j, s := range x {
		p := math.Exp(s - mx)
		sum += p
		for e := range acc {
			acc[e] += p * v[j][e]
		}
	}
	for e := range o {
		o[e] = float32(acc[e] / sum)
	}
	return o, float32(mx + math.Log(sum))
}

// FuzzReferenceDecode compares the two-stage reference with naive attention
// on fuzzed small shapes, lengths, splits and tiles; `go test` runs the seeds.
func FuzzReferenceDecode(f *testing.F) {
	f.Add(uint8(1), uint8(1), uint8(1), uint8(1), uint8(10), uint8(3), uint8(1), uint8(4), false, uint64(0))
	f.Add(uint8(3), uint8(4), uint8(5), uint8(2), uint8(33), uint8(9), uint8(64), uint8(2), true, uint64(1))
	f.Add(uint8(2), uint8(16), uint8(8), uint8(1), uint8(0), uint8(0), uint8(7), uint8(1), true, uint64(2))
	f.Fuzz(func(t *testing.T, batch, sq, group, hkv, cache, lenSeed, splits, kpt uint8, causal bool, seed uint64) {
		s := Shape{DType: Float16, Batch: int(batch)%3 + 1, SeqlenQ: int(sq)%MaxSeqlenQ + 1,
			HeadsKV: int(hkv)%3 + 1, HeadDim: 8, SeqlenCache: int(cache) % 70, Seqlen: -1}
		s.HeadsQ = s.HeadsKV * (int(group)%8 + 1)
		lens := make([]int32, s.Batch)
		for b := range lens {
			lens[b] = int32((int(lenSeed) + 37*b) % (s.SeqlenCache + 1))
		}
		h := randomHost(s, lens, causal, seed)
		nOut, nLSE, err := NaiveAttention(h)
		if err != nil {
			t.Fatal(err)
		}
		out, lse, err := ReferenceDecode(h, int(splits)%MaxSplits+1, int(kpt)%64+1)
		if err != nil {
			t.Fatal(err)
		}
		compare(t, out, lse, nOut, nLSE)
	})
}
