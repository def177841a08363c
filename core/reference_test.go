package core

import (
	"errors"
	"fmt"
	"math"
	mathrand "math/rand"
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
		matchesNaive(t, tt.name, randomHost(s, tt.lens, tt.causal, uint64(ci)), splits, tiles)
	}
}

// matchesNaive runs ReferenceDecode on h at each split count and tile size,
// a subtest each, against NaiveAttention (compare).
func matchesNaive(t *testing.T, name string, h *HostProblem, splits, tiles []int) {
	nOut, nLSE, err := NaiveAttention(h)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	for _, n := range splits {
		for _, kpt := range tiles {
			t.Run(fmt.Sprintf("%s/splits=%d/tile=%d", name, n, kpt), func(t *testing.T) {
				out, lse, err := ReferenceDecode(h, n, kpt)
				if err != nil {
					t.Fatal(err)
				}
				compare(t, out, lse, nOut, nLSE)
			})
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
	// A fixed seed, so that a failure repeats.
	if err := quick.Check(f, &quick.Config{MaxCount: 2000, Rand: mathrand.New(mathrand.NewSource(1))}); err != nil {
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

// serving describes the serving features of a reference test case; its
// zero value turns them all off.
type serving struct {
	seqlenNew int
	pageSize  int     // > 0: page the cache (shuffled page ids, 3 pages no sequence owns)
	batchIdx  []int32 // cache row of each sequence, in a cache of cacheRows rows
	cacheRows int
	leftpad   []int32
	window    Window
	softcap   float32
	scale     float32
	alibi     int // 1: slopes (nheads_q,); 2: (batch, nheads_q)
	rotary    int // rotary_dim
	neox      bool
	rotRows   int // rows of the rotary tables; 0: seqlen_cache + 16
}

// servingHost is randomHost with the serving features of f.
func servingHost(s Shape, lens []int32, causal bool, f serving, seed uint64) *HostProblem {
	r := rand.New(rand.NewPCG(seed, 11))
	fill := func(n int) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = 2*r.Float32() - 1
		}
		return x
	}
	s.SeqlenNew = f.seqlenNew
	h := randomHost(s, lens, causal, seed)
	h.Scale, h.Window, h.Softcap, h.CacheLeftpad = f.scale, f.window, f.softcap, f.leftpad
	row := s.HeadsKV * s.HeadDim
	if f.batchIdx != nil {
		h.CacheBatchIdx = f.batchIdx
		h.K, h.V = fill(f.cacheRows*s.SeqlenCache*row), fill(f.cacheRows*s.SeqlenCache*row)
	}
	if f.pageSize > 0 {
		pagesPer := s.SeqlenCache / f.pageSize
		h.PageSize, h.BlockTable = f.pageSize, make([]int32, s.Batch*pagesPer)
		for i, p := range r.Perm(s.Batch*pagesPer + 3)[:len(h.BlockTable)] {
			h.BlockTable[i] = int32(p)
		}
		h.K, h.V = fill((s.Batch*pagesPer+3)*f.pageSize*row), fill((s.Batch*pagesPer+3)*f.pageSize*row)
	}
	switch f.alibi {
	case 1:
		h.AlibiSlopes = fill(s.HeadsQ)
	case 2:
		h.AlibiSlopes = fill(s.Batch * s.HeadsQ)
	}
	for i := range h.AlibiSlopes {
		h.AlibiSlopes[i] = (h.AlibiSlopes[i] + 1) / 4 // slopes in [0, 0.5)
	}
	if f.seqlenNew > 0 {
		h.KNew, h.VNew = fill(s.Batch*f.seqlenNew*row), fill(s.Batch*f.seqlenNew*row)
	}
	if f.rotary > 0 {
		rows := f.rotRows
		if rows == 0 {
			rows = s.SeqlenCache + 16
		}
		h.RotaryDim, h.RotaryInterleaved = f.rotary, !f.neox
		h.RotaryCos, h.RotarySin = make([]float32, rows*f.rotary/2), make([]float32, rows*f.rotary/2)
		for p := range rows {
			for m := range f.rotary / 2 {
				a := float64(p) * math.Pow(100, -2*float64(m)/float64(f.rotary))
				h.RotaryCos[p*f.rotary/2+m] = roundTo(s.DType, float32(math.Cos(a)))
				h.RotarySin[p*f.rotary/2+m] = roundTo(s.DType, float32(math.Sin(a)))
			}
		}
	}
	return h
}

// TestReferenceServingMatchesNaive: each serving feature, and a few
// together, in the two-stage reference against naive attention.
func TestReferenceServingMatchesNaive(t *testing.T) {
	tests := []struct {
		name                         string
		batch, sq, hq, hkv, d, cache int
		lens                         []int32
		causal                       bool
		f                            serving
	}{
		{"paged, page 1", 2, 1, 4, 2, 8, 13, []int32{13, 6}, false, serving{pageSize: 1}},
		{"paged, page 3, ragged", 3, 2, 4, 2, 8, 30, []int32{0, 7, 30}, false, serving{pageSize: 3}},
		{"paged, page 16, causal", 2, 4, 8, 2, 16, 64, []int32{64, 33}, true, serving{pageSize: 16}},
		{"cache_batch_idx", 3, 1, 4, 1, 8, 20, []int32{20, 3, 11}, false, serving{batchIdx: []int32{4, 0, 2}, cacheRows: 5}},
		{"cache_batch_idx clamped", 2, 2, 2, 2, 8, 20, nil, true, serving{batchIdx: []int32{-3, 9}, cacheRows: 3}},
		{"leftpad", 3, 1, 4, 2, 8, 40, []int32{40, 12, 40}, false, serving{leftpad: []int32{0, 5, 39}}},
		{"leftpad clamped", 2, 3, 4, 4, 8, 40, []int32{30, 10}, true, serving{leftpad: []int32{-2, 100}}},
		{"window left 5", 2, 4, 4, 1, 8, 50, []int32{50, 3}, false, serving{window: Window{true, 5, -1}}},
		{"window right 2", 2, 4, 4, 1, 8, 50, []int32{50, 9}, false, serving{window: Window{true, -1, 2}}},
		{"window (3, 1)", 1, 6, 2, 1, 8, 50, []int32{47}, false, serving{window: Window{true, 3, 1}}},
		{"window left 7, causal", 2, 5, 4, 2, 8, 60, []int32{60, 20}, true, serving{window: Window{true, 7, 4}}},
		{"window (0, 0)", 1, 3, 2, 1, 8, 20, nil, false, serving{window: Window{true, 0, 0}}},
		{"window wider than the cache", 1, 2, 2, 2, 8, 20, nil, false, serving{window: Window{true, 100, 100}}},
		{"window (-1, -1)", 1, 2, 2, 2, 8, 20, nil, true, serving{window: Window{true, -1, -1}}},
		{"softcap", 2, 2, 4, 2, 16, 37, []int32{37, 19}, false, serving{softcap: 0.7, scale: 3}},
		{"alibi (nheads_q,)", 2, 3, 6, 2, 8, 33, []int32{33, 10}, false, serving{alibi: 1}},
		{"alibi (batch, nheads_q), causal", 2, 3, 6, 2, 8, 33, []int32{20, 33}, true, serving{alibi: 2}},
		{"softcap and alibi", 1, 2, 4, 1, 8, 33, nil, true, serving{softcap: 0.5, scale: 2, alibi: 1}},
		{"append", 3, 1, 4, 2, 8, 30, []int32{5, 0, 20}, false, serving{seqlenNew: 3}},
		{"append past the cache", 2, 2, 4, 2, 8, 30, []int32{28, -1}, true, serving{seqlenNew: 5}},
		{"append, rotary", 2, 1, 4, 2, 32, 40, []int32{9, 30}, false, serving{seqlenNew: 2, rotary: 16}},
		{"append, rotary neox, causal", 2, 4, 8, 2, 32, 40, []int32{9, 30}, true, serving{seqlenNew: 4, rotary: 32, neox: true}},
		{"append, rotary, window", 1, 3, 4, 1, 32, 40, []int32{20}, false, serving{seqlenNew: 3, rotary: 16, window: Window{true, 6, -1}}},
		{"rotary positions clamped", 2, 2, 2, 1, 16, 40, []int32{20, 35}, true, serving{seqlenNew: 2, rotary: 16, rotRows: 25}},
		{"paged, append, rotary, leftpad, window, softcap, alibi", 3, 4, 8, 2, 32, 48, []int32{10, 0, 40}, true,
			serving{pageSize: 6, seqlenNew: 4, rotary: 16, leftpad: []int32{3, 0, 20}, window: Window{true, 9, -1}, softcap: 0.8, scale: 2, alibi: 2}},
		{"cache_batch_idx, append, rotary neox, causal", 2, 2, 4, 2, 16, 24, []int32{7, 15}, true,
			serving{batchIdx: []int32{2, 0}, cacheRows: 3, seqlenNew: 2, rotary: 16, neox: true}},
	}
	for ci, tt := range tests {
		for _, dt := range []DType{Float16, BFloat16} {
			s := Shape{DType: dt, Batch: tt.batch, SeqlenQ: tt.sq, HeadsQ: tt.hq, HeadsKV: tt.hkv, HeadDim: tt.d,
				SeqlenCache: tt.cache, Seqlen: -1}
			h := servingHost(s, tt.lens, tt.causal, tt.f, uint64(100+ci))
			nOut, nLSE, err := NaiveAttention(h)
			if err != nil {
				t.Fatalf("%s: %v", tt.name, err)
			}
			for _, n := range []int{1, 2, 3, 7} {
				for _, kpt := range []int{1, 4, 16} {
					t.Run(fmt.Sprintf("%s/%v/splits=%d/tile=%d", tt.name, dt, n, kpt), func(t *testing.T) {
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
}

// TestReferencePagedMatchesContiguous: the same keys through a shuffled
// block table give exactly the contiguous cache's result, whatever the page
// size, and so does a cache_batch_idx permutation of the cache rows.
func TestReferencePagedMatchesContiguous(t *testing.T) {
	s := Shape{DType: Float16, Batch: 3, SeqlenQ: 2, HeadsQ: 8, HeadsKV: 2, HeadDim: 16, SeqlenCache: 36, Seqlen: -1, SeqlenNew: 2}
	lens := []int32{30, 3, 34}
	f := serving{seqlenNew: 2, rotary: 16, window: Window{true, 11, -1}}
	base := servingHost(s, lens, true, f, 5)
	row := s.HeadsKV * s.HeadDim
	wantOut, wantLSE, err := ReferenceDecode(base, 3, 4)
	if err != nil {
		t.Fatal(err)
	}
	wantK, wantV, _, err := ReferenceAppend(base)
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(9, 9))
	for _, ps := range []int{1, 2, 3, 4, 6, 9, 12, 36} {
		pagesPer := s.SeqlenCache / ps
		p := *base
		p.PageSize, p.BlockTable = ps, make([]int32, s.Batch*pagesPer)
		pages := s.Batch*pagesPer + 2
		p.K, p.V = make([]float32, pages*ps*row), make([]float32, pages*ps*row)
		for i, pg := range r.Perm(pages)[:len(p.BlockTable)] {
			p.BlockTable[i] = int32(pg)
			b, first := i/pagesPer, i%pagesPer*ps // the page's sequence and first key
			copy(p.K[pg*ps*row:][:ps*row], base.K[(b*s.SeqlenCache+first)*row:][:ps*row])
			copy(p.V[pg*ps*row:][:ps*row], base.V[(b*s.SeqlenCache+first)*row:][:ps*row])
		}
		out, lse, err := ReferenceDecode(&p, 3, 4)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(out, wantOut) || !slices.Equal(lse, wantLSE) {
			t.Errorf("page size %d: paged result differs from the contiguous one", ps)
		}
		k, v, _, err := ReferenceAppend(&p)
		if err != nil {
			t.Fatal(err)
		}
		for i, pg := range p.BlockTable {
			b, first := i/pagesPer, i%pagesPer*ps
			if !slices.Equal(k[int(pg)*ps*row:][:ps*row], wantK[(b*s.SeqlenCache+first)*row:][:ps*row]) ||
				!slices.Equal(v[int(pg)*ps*row:][:ps*row], wantV[(b*s.SeqlenCache+first)*row:][:ps*row]) {
				t.Fatalf("page size %d: page %d after the append differs from keys %d.. of sequence %d", ps, pg, first, b)
			}
		}
	}
	// cache_batch_idx: sequence b in row perm[b] of a larger cache.
	p := *base
	perm := []int32{3, 0, 1}
	p.CacheBatchIdx = perm
	p.K, p.V = make([]float32, 4*s.SeqlenCache*row), make([]float32, 4*s.SeqlenCache*row)
	for b, c := range perm {
		copy(p.K[int(c)*s.SeqlenCache*row:][:s.SeqlenCache*row], base.K[b*s.SeqlenCache*row:][:s.SeqlenCache*row])
		copy(p.V[int(c)*s.SeqlenCache*row:][:s.SeqlenCache*row], base.V[b*s.SeqlenCache*row:][:s.SeqlenCache*row])
	}
	out, lse, err := ReferenceDecode(&p, 3, 4)
	if err != nil || !slices.Equal(out, wantOut) || !slices.Equal(lse, wantLSE) {
		t.Errorf("cache_batch_idx: result differs from the contiguous one (%v)", err)
	}
}

// TestReferencePagesClamped: page ids out of range read the nearest page
// and are never written; a block table of such ids is the same as one of
// the clamped ids for reading.
func TestReferencePagesClamped(t *testing.T) {
	s := Shape{DType: Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 2, HeadsKV: 1, HeadDim: 8, SeqlenCache: 8, Seqlen: -1}
	h := servingHost(s, []int32{8, 6}, false, serving{pageSize: 2}, 3) // 2*4 + 3 = 11 pages
	clamped := *h
	h.BlockTable = []int32{-5, 3, 40, 1, 2, 11, 0, -1}
	clamped.BlockTable = []int32{0, 3, 10, 1, 2, 10, 0, 0}
	out, lse, err := ReferenceDecode(h, 2, 2)
	if err != nil {
		t.Fatal(err)
	}
	wantOut, wantLSE, _ := ReferenceDecode(&clamped, 2, 2)
	if !slices.Equal(out, wantOut) || !slices.Equal(lse, wantLSE) {
		t.Error("out-of-range page ids are not read as the clamped ones")
	}
	// Appending one token to each: sequence 0 writes key 6 into page 0
	// (entry 3: page 1); sequence 1 at key 6 hits entry 7 (-1): skipped.
	s.SeqlenNew = 1
	a := servingHost(s, []int32{6, 6}, false, serving{pageSize: 2, seqlenNew: 1}, 4)
	a.BlockTable = []int32{4, 5, 6, 1, 7, 8, 9, -1}
	k, v, _, err := ReferenceAppend(a)
	if err != nil {
		t.Fatal(err)
	}
	for i := range k {
		page, slot := i/16, i/8%2
		written := page == 1 && slot == 0
		if got, want := k[i], a.K[i]; written {
			want = a.KNew[i%8]
			if got != want || v[i] != a.VNew[i%8] {
				t.Fatalf("k[%d] = %v, want the new token's %v", i, got, want)
			}
		} else if got != want || v[i] != a.V[i] {
			t.Fatalf("k[%d] = %v changed (was %v): a skipped write landed", i, got, want)
		}
	}
}

// TestReferenceAppendRotary checks the append's writes and the rotary
// embedding against hand-made cases: cos 0, sin 1 turns (x0, x1) into
// (-x1, x0), in pairs (2m, 2m+1) interleaved and (m, m+8) for GPT-NeoX at
// rotary_dim 16, leaving the channels past it alone.
func TestReferenceAppendRotary(t *testing.T) {
	s := Shape{DType: Float16, Batch: 1, SeqlenQ: 2, HeadsQ: 1, HeadsKV: 1, HeadDim: 32, SeqlenCache: 8, Seqlen: -1, SeqlenNew: 2}
	for _, interleaved := range []bool{true, false} {
		h := &HostProblem{Shape: s, Q: make([]float32, 2*32), K: make([]float32, 8*32), V: make([]float32, 8*32),
			KNew: make([]float32, 2*32), VNew: make([]float32, 2*32), CacheSeqlens: []int32{3},
			RotaryDim: 16, RotaryInterleaved: interleaved, Causal: true,
			RotaryCos: make([]float32, 6*8), RotarySin: make([]float32, 6*8)}
		for m := range 8 {
			h.RotaryCos[4*8+m], h.RotarySin[4*8+m] = 0, 1 // position 4: a quarter turn
			h.RotaryCos[3*8+m] = 1                        // position 3: none
		}
		for e := range 32 {
			h.Q[e], h.Q[32+e] = float32(e+1), float32(e+1)
			h.KNew[e], h.KNew[32+e] = float32(e+1), float32(e+1)
			h.VNew[e], h.VNew[32+e] = float32(-e), float32(e)
		}
		k, v, q, err := ReferenceAppend(h)
		if err != nil {
			t.Fatal(err)
		}
		turned := make([]float32, 32) // x rotated a quarter turn
		for e := range 32 {
			turned[e] = float32(e + 1)
		}
		for m := range 8 {
			i0, i1 := m, m+8
			if interleaved {
				i0, i1 = 2*m, 2*m+1
			}
			turned[i0], turned[i1] = -float32(i1+1), float32(i0+1)
		}
		same := func(x []float32) bool {
			for e := range x {
				if x[e] != float32(e+1) {
					return false
				}
			}
			return true
		}
		// Causal: query rows at positions 3 and 4; new keys at 3 and 4
		// (rotated there: unchanged, then a quarter turn), the rest untouched.
		if !same(q[:32]) || !slices.Equal(q[32:], turned) {
			t.Errorf("interleaved %v: rotated q = %v", interleaved, q)
		}
		if !same(k[3*32:4*32]) || !slices.Equal(k[4*32:5*32], turned) || !slices.Equal(v[3*32:5*32], h.VNew) {
			t.Errorf("interleaved %v: appended keys %v, values %v", interleaved, k[3*32:5*32], v[3*32:5*32])
		}
		for j := range 8 {
			if j != 3 && j != 4 && (slices.ContainsFunc(k[j*32:(j+1)*32], func(x float32) bool { return x != 0 }) ||
				slices.ContainsFunc(v[j*32:(j+1)*32], func(x float32) bool { return x != 0 })) {
				t.Errorf("interleaved %v: key %d written", interleaved, j)
			}
		}
		// Without causal or a window every query row rotates at position 3.
		h.Causal = false
		if _, _, q, _ := ReferenceAppend(h); !same(q[:32]) || !same(q[32:]) {
			t.Errorf("interleaved %v, not causal: rotated q = %v", interleaved, q)
		}
	}
}

func TestRoundTo(t *testing.T) {
	for _, tt := range []struct {
		dt   DType
		x    float32
		want float32
	}{
		{Float16, 1 + 1.0/2048, 1},                // a tie: to even
		{Float16, 1 + 3.0/2048, 1 + 4.0/2048},     // a tie: to even
		{Float16, 1 + 1.5/2048, 1 + 2.0/2048},     // nearest
		{Float16, -(1 + 1.5/2048), -1 - 2.0/2048}, // sign kept
		{Float16, 65519, 65504},
		{Float16, 65520, float32(math.Inf(1))},
		{Float16, 0x1p-25, 0}, // half the smallest subnormal: to even
		{Float16, 0x3p-25, 0x1p-23},
		{Float16, 0x1.8p-20, 0x1.8p-20}, // a subnormal
		{Float16, 0.1, 0.0999755859375},
		{BFloat16, 1 + 1.0/256, 1},
		{BFloat16, 1 + 3.0/256, 1 + 4.0/256},
		{BFloat16, 0.1, 0.10009765625},
		{BFloat16, 3.4e38, float32(math.Inf(1))},
		{BFloat16, 0, 0},
	} {
		if got := roundTo(tt.dt, tt.x); got != tt.want {
			t.Errorf("roundTo(%v, %v) = %v, want %v", tt.dt, tt.x, got, tt.want)
		}
	}
}

func TestReferenceServingErrors(t *testing.T) {
	s := Shape{DType: Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 4, HeadsKV: 2, HeadDim: 16, SeqlenCache: 8, Seqlen: -1}
	tests := []struct {
		name string
		f    serving
		edit func(*HostProblem)
		arg  string
	}{
		{"page size without table", serving{}, func(h *HostProblem) { h.PageSize = 2 }, "page_size"},
		{"table without page size", serving{pageSize: 2}, func(h *HostProblem) { h.PageSize = 0 }, "page_size"},
		{"table too short", serving{pageSize: 2}, func(h *HostProblem) { h.BlockTable = h.BlockTable[1:] }, "block_table"},
		{"pages cut", serving{pageSize: 2}, func(h *HostProblem) { h.K = h.K[1:] }, "k_cache"},
		{"paged v short", serving{pageSize: 2}, func(h *HostProblem) { h.V = h.V[32:] }, "v_cache"},
		{"batch idx with pages", serving{pageSize: 2}, func(h *HostProblem) { h.CacheBatchIdx = []int32{0, 1} }, "cache_batch_idx"},
		{"batch idx short", serving{batchIdx: []int32{0, 1}, cacheRows: 3}, func(h *HostProblem) { h.CacheBatchIdx = h.CacheBatchIdx[1:] }, "cache_batch_idx"},
		{"cache rows cut", serving{batchIdx: []int32{0, 1}, cacheRows: 3}, func(h *HostProblem) { h.K = h.K[1:] }, "k_cache"},
		{"leftpad short", serving{leftpad: []int32{1}}, nil, "cache_leftpad"},
		{"window -2", serving{window: Window{true, -2, 0}}, nil, "window_size"},
		{"softcap", serving{softcap: -1}, nil, "softcap"},
		{"alibi", serving{alibi: 1}, func(h *HostProblem) { h.AlibiSlopes = h.AlibiSlopes[1:] }, "alibi_slopes"},
		{"k short", serving{seqlenNew: 2}, func(h *HostProblem) { h.KNew = h.KNew[1:] }, "k"},
		{"v missing", serving{seqlenNew: 2}, func(h *HostProblem) { h.VNew = nil }, "v"},
		{"seqlen_new past the cache", serving{seqlenNew: 2}, func(h *HostProblem) { h.SeqlenNew = 9 }, "k"},
		{"rotary without append", serving{}, func(h *HostProblem) {
			h.RotaryDim = 16
			h.RotaryCos, h.RotarySin = make([]float32, 8), make([]float32, 8)
		}, "rotary_cos"},
		{"rotary odd", serving{seqlenNew: 1, rotary: 16}, func(h *HostProblem) { h.RotaryDim = 7 }, "rotary_dim"},
		{"rotary past headdim", serving{seqlenNew: 1, rotary: 16}, func(h *HostProblem) { h.RotaryDim = 18 }, "rotary_dim"},
		{"rotary tables differ", serving{seqlenNew: 1, rotary: 16}, func(h *HostProblem) { h.RotarySin = h.RotarySin[8:] }, "rotary_cos"},
		{"tables without rotary_dim", serving{seqlenNew: 1, rotary: 16}, func(h *HostProblem) { h.RotaryDim = 0 }, "rotary_cos"},
	}
	for _, tt := range tests {
		h := servingHost(s, nil, false, tt.f, 0)
		if tt.edit != nil {
			tt.edit(h)
		}
		for _, run := range []func() error{
			func() error { _, _, err := ReferenceDecode(h, 1, 1); return err },
			func() error { _, _, err := NaiveAttention(h); return err },
			func() error { _, _, _, err := ReferenceAppend(h); return err },
		} {
			var e *Error
			if err := run(); !errors.As(err, &e) || e.Arg != tt.arg || !errors.Is(err, ErrInvalid) {
				t.Errorf("%s: error %v, want one naming %q", tt.name, err, tt.arg)
			}
		}
	}
}
