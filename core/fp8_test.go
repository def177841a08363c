package core

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// decodeFP8 is the value of fp8 code c of dt, read from its bits: sign,
// exponent, fraction; e4m3fn's all-ones code is NaN, e5m2's top exponent
// infinity or NaN.
func decodeFP8(dt DType, c uint8) float64 {
	frac, bias := 3, 7
	if dt == Float8E5M2 {
		frac, bias = 2, 15
	}
	sign := 1.0
	if c&0x80 != 0 {
		sign = -1
	}
	e, m := int(c&0x7f)>>frac, int(c)&(1<<frac-1)
	switch {
	case dt == Float8E4M3 && c&0x7f == 0x7f, dt == Float8E5M2 && e == 31 && m != 0:
		return math.NaN()
	case dt == Float8E5M2 && e == 31:
		return sign * math.Inf(1)
	case e == 0:
		return sign * math.Ldexp(float64(m), 1-bias-frac)
	}
	return sign * math.Ldexp(float64(m|1<<frac), e-bias-frac)
}

// TestFP8Encodings: the codes torch's float8 dtypes give known values.
func TestFP8Encodings(t *testing.T) {
	for _, tt := range []struct {
		dt   DType
		code uint8
		want float64
	}{
		{Float8E4M3, 0x7e, 448},
		{Float8E4M3, 0xfe, -448},
		{Float8E4M3, 0x38, 1},
		{Float8E4M3, 0x08, 0x1p-6}, // smallest normal
		{Float8E4M3, 0x07, 7 * 0x1p-9},
		{Float8E4M3, 0x01, 0x1p-9}, // smallest subnormal
		{Float8E4M3, 0x00, 0},
		{Float8E5M2, 0x7b, 57344},
		{Float8E5M2, 0x3c, 1},
		{Float8E5M2, 0x04, 0x1p-14},
		{Float8E5M2, 0x03, 3 * 0x1p-16},
		{Float8E5M2, 0x01, 0x1p-16},
		{Float8E5M2, 0x7c, math.Inf(1)},
	} {
		if got := decodeFP8(tt.dt, tt.code); got != tt.want {
			t.Errorf("%v code %#02x is %v, want %v", tt.dt, tt.code, got, tt.want)
		}
	}
	if !math.IsNaN(decodeFP8(Float8E4M3, 0x7f)) || !math.IsNaN(decodeFP8(Float8E5M2, 0x7d)) {
		t.Error("NaN codes")
	}
	if FP8Max(Float8E4M3) != 448 || FP8Max(Float8E5M2) != 57344 || FP8Max(Float16) != 0 {
		t.Error("FP8Max")
	}
}

// TestRoundFP8 rounds known values: ties to the even code, saturation at
// the largest finite value, subnormals.
func TestRoundFP8(t *testing.T) {
	for _, tt := range []struct {
		dt      DType
		x, want float32
	}{
		{Float8E4M3, 1.0625, 1},    // tie: 1.000 (even) and 1.001
		{Float8E4M3, 1.1875, 1.25}, // tie: 1.001 and 1.010 (even)
		{Float8E4M3, 1.07, 1.125},  // nearest
		{Float8E4M3, 15.5, 16},     // tie across a binade: 15 (odd) and 16
		{Float8E4M3, 449, 448},     // saturates
		{Float8E4M3, 464, 448},     // the tie with 480, which e4m3fn lacks
		{Float8E4M3, 1e6, 448},     // saturates
		{Float8E4M3, -1e6, -448},   // saturates
		{Float8E4M3, 0x1p-10, 0},   // tie: 0 (even) and the smallest subnormal
		{Float8E4M3, 3 * 0x1p-10, 0x1p-8},
		{Float8E4M3, 0x1p-11, 0},
		{Float8E4M3, 0.6 * 0x1p-9, 0x1p-9},
		{Float8E4M3, -0.3, -0.3125}, // 1.010 * 2^-2
		{Float8E5M2, 1.125, 1},      // tie: 1.00 (even) and 1.01
		{Float8E5M2, 1.375, 1.5},    // tie: 1.01 and 1.10 (even)
		{Float8E5M2, 61440, 57344},  // the tie with 65536 (infinity) saturates
		{Float8E5M2, 1e9, 57344},
		{Float8E5M2, 0x1p-17, 0},
		{Float8E5M2, 3 * 0x1p-17, 0x1p-15},
		{Float16, 1.0625, 1.0625}, // not fp8: unchanged
	} {
		if got := RoundFP8(tt.dt, tt.x); got != tt.want {
			t.Errorf("RoundFP8(%v, %v) = %v, want %v", tt.dt, tt.x, got, tt.want)
		}
	}
	inf := float32(math.Inf(1))
	for _, dt := range []DType{Float8E4M3, Float8E5M2} {
		if RoundFP8(dt, inf) != FP8Max(dt) || RoundFP8(dt, -inf) != -FP8Max(dt) {
			t.Errorf("%v: infinities do not saturate", dt)
		}
		if x := RoundFP8(dt, float32(math.NaN())); !math.IsNaN(float64(x)) {
			t.Errorf("%v: NaN rounds to %v", dt, x)
		}
		if x := RoundFP8(dt, float32(math.Copysign(0, -1))); x != 0 || !math.Signbit(float64(x)) {
			t.Errorf("%v: -0 rounds to %v", dt, x)
		}
	}
}

// TestRoundFP8EveryCode: every finite code rounds to itself, the midpoint
// of two neighbors to the even code, anything else between them to the
// nearer, for both signs.
func TestRoundFP8EveryCode(t *testing.T) {
	for _, dt := range []DType{Float8E4M3, Float8E5M2} {
		for c := 0; c < 0x7f; c++ {
			lo, hi := decodeFP8(dt, uint8(c)), decodeFP8(dt, uint8(c+1))
			if math.IsNaN(lo) || math.IsInf(lo, 0) {
				continue
			}
			checks := []struct{ x, want float64 }{{lo, lo}, {-lo, -lo}}
			if !math.IsNaN(hi) && !math.IsInf(hi, 0) {
				even := lo
				if c%2 == 1 {
					even = hi
				}
				mid := float32((lo + hi) / 2) // exact: one bit past the fraction
				checks = append(checks, []struct{ x, want float64 }{
					{float64(mid), even}, {float64(-mid), -even},
					{float64(math.Nextafter32(mid, float32(math.Inf(-1)))), lo},
					{float64(math.Nextafter32(mid, float32(math.Inf(1)))), hi},
				}...)
			}
			for _, ck := range checks {
				if got := RoundFP8(dt, float32(ck.x)); float64(got) != ck.want {
					t.Fatalf("%v: RoundFP8(%v) = %v, want %v (codes %#02x, %#02x)", dt, ck.x, got, ck.want, c, c+1)
				}
			}
		}
	}
}

// fp8Layout is denseLayout with an e4m3 cache.
func fp8Layout() Layout {
	l := denseLayout()
	l.KVDType = int64(Float8E4M3)
	return l
}

func TestLayoutFP8(t *testing.T) {
	for _, tt := range []struct {
		name string
		edit func(*Layout)
		want func(p *Problem) bool
	}{
		{"e4m3, no descale", func(l *Layout) {}, func(p *Problem) bool {
			return p.KVDType == Float8E4M3 && p.CacheDType() == Float8E4M3 && !p.DescaleArrays && p.KDescale == (Descale{})
		}},
		{"e5m2 under bfloat16", func(l *Layout) { l.DType, l.KVDType = 2, int64(Float8E5M2) }, func(p *Problem) bool {
			return p.DType == BFloat16 && p.KVDType == Float8E5M2
		}},
		{"values", func(l *Layout) { l.KDescaleValue, l.VDescaleValue = 0.5, 3 }, func(p *Problem) bool {
			return p.KDescale == Descale{Value: 0.5} && p.VDescale == Descale{Value: 3}
		}},
		{"arrays", func(l *Layout) { l.Descale, l.KDescale, l.VDescale = 1, [2]int64{8, 1}, [2]int64{1, 2} }, func(p *Problem) bool {
			return p.DescaleArrays && p.KDescale == Descale{BatchStride: 8, HeadStride: 1} &&
				p.VDescale == Descale{BatchStride: 1, HeadStride: 2}
		}},
		{"one value an array", func(l *Layout) { l.Descale = 1 }, func(p *Problem) bool {
			return p.DescaleArrays && p.KDescale == (Descale{})
		}},
	} {
		l := fp8Layout()
		tt.edit(&l)
		p, err := l.Problem()
		if err != nil || !tt.want(&p) {
			t.Errorf("%s: Problem() = %+v, %v", tt.name, p, err)
			continue
		}
		back := LayoutOf(&p)
		if again, err := back.Problem(); err != nil || again != p || back.KVDType != l.KVDType || back.Descale != l.Descale ||
			back.KDescale != l.KDescale || back.VDescale != l.VDescale || back.KDescaleValue != l.KDescaleValue ||
			back.VDescaleValue != l.VDescaleValue {
			t.Errorf("%s: LayoutOf(Problem()) = %+v (%v)", tt.name, back, err)
		}
		if _, err := l.Sizes(); err != nil {
			t.Errorf("%s: Sizes: %v", tt.name, err)
		}
	}
	// A size-1 dimension's descale stride is normalized; kv_dtype = dtype is 0.
	l := fp8Layout()
	l.Batch, l.Descale, l.KDescale, l.VDescale = 1, 1, [2]int64{9, 1}, [2]int64{9, 1}
	if p, err := l.Problem(); err != nil || p.KDescale != (Descale{HeadStride: 1}) {
		t.Errorf("batch 1: %+v, %v", p.KDescale, err)
	}
	l = denseLayout()
	l.KVDType = l.DType
	if p, err := l.Problem(); err != nil || p.KVDType != 0 {
		t.Errorf("kv_dtype = dtype: %v, %v", p.KVDType, err)
	}
}

func TestLayoutFP8Errors(t *testing.T) {
	for _, tt := range []struct {
		name string
		edit func(*Layout)
		arg  string
		want error
	}{
		{"kv_dtype bfloat16 under float16", func(l *Layout) { l.KVDType = 2 }, "kv_dtype", ErrUnsupported},
		{"kv_dtype float32", func(l *Layout) { l.KVDType = 3 }, "kv_dtype", ErrUnsupported},
		{"kv_dtype 6", func(l *Layout) { l.KVDType = 6 }, "kv_dtype", ErrUnsupported},
		{"kv_dtype -1", func(l *Layout) { l.KVDType = -1 }, "kv_dtype", ErrUnsupported},
		{"kv_dtype huge", func(l *Layout) { l.KVDType = 1 << 40 }, "kv_dtype", ErrUnsupported},
		{"an fp8 q", func(l *Layout) { l.DType = 4 }, "dtype", ErrUnsupported},
		{"descale 2", func(l *Layout) { l.Descale = 2 }, "descale", ErrInvalid},
		{"arrays with a float16 cache", func(l *Layout) { l.KVDType, l.Descale = 0, 1 }, "k_descale", ErrInvalid},
		{"k value with a float16 cache", func(l *Layout) { l.KVDType, l.KDescaleValue = 0, 2 }, "k_descale", ErrInvalid},
		{"v value with a float16 cache", func(l *Layout) { l.KVDType, l.VDescaleValue = 0, 2 }, "v_descale", ErrInvalid},
		{"negative value", func(l *Layout) { l.KDescaleValue = -1 }, "k_descale", ErrInvalid},
		{"NaN value", func(l *Layout) { l.VDescaleValue = math.NaN() }, "v_descale", ErrInvalid},
		{"infinite value", func(l *Layout) { l.VDescaleValue = math.Inf(1) }, "v_descale", ErrInvalid},
		{"value rounds to 0", func(l *Layout) { l.KDescaleValue = 1e-50 }, "k_descale", ErrInvalid},
		{"subnormal value", func(l *Layout) { l.KDescaleValue = 1e-40 }, "k_descale", ErrInvalid},
		{"value past float32", func(l *Layout) { l.KDescaleValue = 1e39 }, "k_descale", ErrInvalid},
		{"value with arrays", func(l *Layout) { l.Descale, l.KDescaleValue = 1, 2 }, "k_descale_value", ErrInvalid},
		{"strides without arrays", func(l *Layout) { l.VDescale = [2]int64{8, 1} }, "v_descale", ErrInvalid},
		{"negative stride", func(l *Layout) { l.Descale, l.KDescale = 1, [2]int64{-8, 1} }, "k_descale", ErrInvalid},
		{"strides overflow", func(l *Layout) { l.Descale, l.VDescale = 1, [2]int64{1 << 62, 1 << 62} }, "v_descale", ErrInvalid},
	} {
		l := fp8Layout()
		tt.edit(&l)
		_, err := l.Problem()
		var e *Error
		if !errors.Is(err, tt.want) || !errors.As(err, &e) || e.Arg != tt.arg {
			t.Errorf("%s: err = %v, want %v naming %s", tt.name, err, tt.want, tt.arg)
		}
	}
}

// fp8Problem is validProblem over an e4m3 cache with (batch, heads_kv)
// descale arrays far from its tensors. Its caches span 8 MiB each.
func fp8Problem() Problem {
	p := validProblem()
	p.KVDType, p.DescaleArrays = Float8E4M3, true
	p.KDescale = Descale{Ptr: 0x19000000, BatchStride: 8, HeadStride: 1}
	p.VDescale = Descale{Ptr: 0x19001000, BatchStride: 1, HeadStride: 2}
	return p
}

func TestFP8Validate(t *testing.T) {
	kEnd := uintptr(0x1000000 + 2*4096*8*128) // k_cache's last fp8 byte + 1
	tests := []problemCase{
		{"arrays", fp8Problem, func(p *Problem) {}, "", nil},
		{"values", fp8Problem, func(p *Problem) {
			p.DescaleArrays, p.KDescale, p.VDescale = false, Descale{Value: 2}, Descale{}
		}, "", nil},
		{"e5m2, one value an array", fp8Problem, func(p *Problem) {
			p.KVDType, p.KDescale.BatchStride, p.KDescale.HeadStride = Float8E5M2, 0, 0
		}, "", nil},
		{"out right after an fp8 k_cache", fp8Problem, func(p *Problem) { p.Out.Ptr = kEnd }, "", nil},
		{"out in a float16 k_cache there", fp8Problem, func(p *Problem) {
			p.KVDType, p.DescaleArrays, p.KDescale, p.VDescale, p.Out.Ptr = 0, false, Descale{}, Descale{}, kEnd
		}, "out", ErrInvalid},
		{"null k_descale", fp8Problem, func(p *Problem) { p.KDescale.Ptr = 0 }, "k_descale", ErrInvalid},
		{"null v_descale", fp8Problem, func(p *Problem) { p.VDescale.Ptr = 0 }, "v_descale", ErrInvalid},
		{"v_descale without arrays", fp8Problem, func(p *Problem) {
			p.DescaleArrays, p.KDescale, p.VDescale = false, Descale{}, Descale{Ptr: 0x19001000}
		}, "v_descale", ErrInvalid},
		{"misaligned k_descale", fp8Problem, func(p *Problem) { p.KDescale.Ptr += 2 }, "k_descale", ErrInvalid},
		{"out over k_descale", fp8Problem, func(p *Problem) { p.Out.Ptr = 0x19000000 - 0x1000 }, "out", ErrInvalid},
		{"lse after v_descale's last scale", fp8Problem, func(p *Problem) { p.LSE = 0x19001000 + 4*(1+1+7*2) }, "", nil},
		{"lse on v_descale's last scale", fp8Problem, func(p *Problem) { p.LSE = 0x19001000 + 4*(1+7*2) }, "lse", ErrInvalid},
		{"an append over k_descale", func() Problem {
			p := fp8Problem()
			a := appendProblem()
			p.New, p.Rotary, p.CacheSeqlens = a.New, a.Rotary, a.CacheSeqlens
			p.KDescale.Ptr = p.K.Ptr + 0x100
			return p
		}, func(p *Problem) {}, "k_descale", ErrInvalid},
		{"a value with arrays", fp8Problem, func(p *Problem) { p.KDescale.Value = 2 }, "k_descale", ErrInvalid},
		{"a negative value", fp8Problem, func(p *Problem) { p.DescaleArrays, p.KDescale = false, Descale{Value: -1} }, "k_descale", ErrInvalid},
		{"strides without arrays", fp8Problem, func(p *Problem) {
			p.DescaleArrays, p.KDescale, p.VDescale = false, Descale{}, Descale{HeadStride: 1}
		}, "v_descale", ErrInvalid},
		{"a negative stride", fp8Problem, func(p *Problem) { p.VDescale.HeadStride = -1 }, "v_descale", ErrInvalid},
		{"descales of a float16 cache", fp8Problem, func(p *Problem) { p.KVDType = 0 }, "k_descale", ErrInvalid},
		{"a float16 cache's value", validProblem, func(p *Problem) { p.VDescale.Value = 1 }, "v_descale", ErrInvalid},
		{"an e4m3 cache under bfloat16", fp8Problem, func(p *Problem) { p.DType = BFloat16 }, "", nil},
		// The kernels copy 16 bytes at a time: 16 fp8 elements, 8 of float16.
		{"an fp8 row stride of 8 bytes", fp8Problem, func(p *Problem) { p.V.SeqStride += 8 }, "v_cache", ErrUnsupported},
		{"a float16 row stride of 16 bytes", validProblem, func(p *Problem) { p.V.SeqStride += 8 }, "", nil},
		{"an fp8 row stride of 16 bytes", fp8Problem, func(p *Problem) { p.K.SeqStride += 16 }, "", nil},
		{"a bfloat16 cache under float16", validProblem, func(p *Problem) { p.KVDType = BFloat16 }, "kv_dtype", ErrUnsupported},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.base()
			tt.edit(&p)
			checkOpErr(t, p.Validate(), "decode", tt.arg, tt.want)
		})
	}
}

// TestFP8PlanShape: the cache dtype is part of the plan's Shape, and a
// planner's key.
func TestFP8PlanShape(t *testing.T) {
	p := fp8Problem()
	s := p.PlanShape()
	if s.KVDType != Float8E4M3 || s.PlanKey().KVDType != Float8E4M3 {
		t.Errorf("PlanShape().KVDType = %v", s.KVDType)
	}
	q := validProblem()
	if s == q.PlanShape() {
		t.Error("an fp8 plan shares the float16 one's Shape")
	}
	if _, err := MakePlan(s, H200); err != nil {
		t.Errorf("MakePlan: %v", err)
	}
}

// TestFP8SplitModel: the split model counts an fp8 tile's bytes at HBM's
// rate and keeps the bytes of a split's keys against its partials.
func TestFP8SplitModel(t *testing.T) {
	v := splitKV(Float16, 128, 16)
	if c := blockCostsOf(v, Float8E4M3); c.bytesPct != 50 || c.tile != narrowBlock.tile {
		t.Errorf("blockCostsOf(fp8 tiles of as many keys) = %+v", c)
	}
	twice := v
	twice.KeysPerTile *= 2
	if c := blockCostsOf(twice, Float8E5M2); c.bytesPct != 100 {
		t.Errorf("blockCostsOf(fp8 tiles of twice the keys) = %+v", c)
	}
	for _, dt := range []DType{Float16, BFloat16} {
		if c := blockCostsOf(v, dt); c != narrowBlock {
			t.Errorf("blockCostsOf(%v) = %+v", dt, c)
		}
	}
	if rowKeysFor(minSplitRowKeys, Float16) != minSplitRowKeys || rowKeysFor(minSplitRowKeys, Float8E4M3) != 2*minSplitRowKeys {
		t.Error("rowKeysFor")
	}
	// 8 items of 512 tiles on 132 slots at 66% HBM: a wave of 64 one-tile
	// splits would read at HBM's rate; fp8's half bytes take half its time.
	half := narrowBlock
	half.bytesPct = 50
	if full, fp8 := splitCost(2048, 132, 264, 512, 1, narrowBlock, MergeNone), splitCost(2048, 132, 264, 512, 1, half, MergeNone); fp8 >= full {
		t.Errorf("an HBM-bound grid costs %d with fp8 tiles, %d with float16", fp8, full)
	}
}

// fp8Host is servingHost over an fp8 cache of dtype kv: K and V hold fp8
// values, scaled by descales of the given form (0: none, 1: one value,
// 2: (batch, nheads_kv)).
func fp8Host(s Shape, lens []int32, causal bool, f serving, kv DType, form int, seed uint64) *HostProblem {
	s.KVDType = kv
	h := servingHost(s, lens, causal, f, seed)
	r := rand.New(rand.NewPCG(seed, 13))
	scales := func() []float32 {
		switch form {
		case 1:
			return []float32{0.5 + r.Float32()}
		case 2:
			x := make([]float32, s.Batch*s.HeadsKV)
			for i := range x {
				x[i] = 0.25 + r.Float32()
			}
			return x
		}
		return nil
	}
	h.KDescale, h.VDescale = scales(), scales()
	for _, c := range [][]float32{h.K, h.V} {
		for i := range c {
			c[i] = RoundFP8(kv, c[i]*4) // the cache's values, most of them normal
		}
	}
	return h
}

var fp8Cases = []struct {
	name                         string
	batch, sq, hq, hkv, d, cache int
	lens                         []int32
	causal                       bool
	f                            serving
}{
	{"contiguous", 2, 1, 4, 2, 16, 37, []int32{37, 20}, false, serving{}},
	{"paged, page 3, causal", 3, 2, 4, 2, 8, 30, []int32{0, 7, 30}, true, serving{pageSize: 3}},
	{"cache_batch_idx, leftpad", 3, 1, 4, 1, 8, 20, []int32{20, 3, 11}, false, serving{batchIdx: []int32{4, 0, 2}, cacheRows: 5, leftpad: []int32{2, 0, 5}}},
	{"window, softcap, alibi", 2, 4, 4, 2, 8, 50, []int32{50, 9}, true, serving{window: Window{true, 5, -1}, softcap: 0.7, scale: 2, alibi: 2}},
	{"append", 3, 1, 4, 2, 8, 30, []int32{5, 0, 20}, false, serving{seqlenNew: 3}},
	{"paged append, rotary neox, causal", 2, 4, 8, 2, 32, 48, []int32{9, 30}, true, serving{pageSize: 8, seqlenNew: 4, rotary: 16, neox: true}},
}

// TestReferenceFP8MatchesNaive: the two-stage reference over fp8 caches
// against naive attention, for each format and descale form.
func TestReferenceFP8MatchesNaive(t *testing.T) {
	for ci, tt := range fp8Cases {
		for _, kv := range []DType{Float8E4M3, Float8E5M2} {
			for form := range 3 {
				s := Shape{DType: BFloat16, Batch: tt.batch, SeqlenQ: tt.sq, HeadsQ: tt.hq, HeadsKV: tt.hkv, HeadDim: tt.d,
					SeqlenCache: tt.cache, Seqlen: -1}
				h := fp8Host(s, tt.lens, tt.causal, tt.f, kv, form, uint64(300+ci))
				nOut, nLSE, err := NaiveAttention(h)
				if err != nil {
					t.Fatalf("%s: %v", tt.name, err)
				}
				for _, n := range []int{1, 3} {
					t.Run(fmt.Sprintf("%s/%v/descale %d/splits=%d", tt.name, kv, form, n), func(t *testing.T) {
						out, lse, err := ReferenceDecode(h, n, 4)
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

// TestReferenceFP8IsDequantized: without an append, an fp8 cache attends
// exactly as a float32 cache holding its values times their descales.
func TestReferenceFP8IsDequantized(t *testing.T) {
	for ci, tt := range fp8Cases {
		if tt.f.seqlenNew > 0 {
			continue
		}
		s := Shape{DType: Float16, Batch: tt.batch, SeqlenQ: tt.sq, HeadsQ: tt.hq, HeadsKV: tt.hkv, HeadDim: tt.d,
			SeqlenCache: tt.cache, Seqlen: -1}
		h := fp8Host(s, tt.lens, tt.causal, tt.f, Float8E5M2, 2, uint64(400+ci))
		plain := *h
		plain.KVDType, plain.KDescale, plain.VDescale = 0, nil, nil
		plain.K, plain.V = append([]float32(nil), h.K...), append([]float32(nil), h.V...)
		// Each sequence reads its own slots here (no page or row is shared):
		// scale the slots it reads by its descales.
		seen := map[int]bool{}
		for b := range s.Batch {
			for j := range s.SeqlenCache {
				off := h.slot(b, j)
				if seen[off] {
					continue
				}
				seen[off] = true
				for kvh := range s.HeadsKV {
					for e := range s.HeadDim {
						plain.K[off+kvh*s.HeadDim+e] = h.K[off+kvh*s.HeadDim+e] * h.descale(h.KDescale, b, kvh)
						plain.V[off+kvh*s.HeadDim+e] = h.V[off+kvh*s.HeadDim+e] * h.descale(h.VDescale, b, kvh)
					}
				}
			}
		}
		out8, lse8, err := ReferenceDecode(h, 3, 4)
		if err != nil {
			t.Fatal(err)
		}
		out, lse, err := ReferenceDecode(&plain, 3, 4)
		if err != nil {
			t.Fatal(err)
		}
		for i := range out {
			if out[i] != out8[i] {
				t.Fatalf("%s: out[%d] = %v, dequantized %v", tt.name, i, out8[i], out[i])
			}
		}
		for i := range lse {
			if lse[i] != lse8[i] {
				t.Fatalf("%s: lse[%d] = %v, dequantized %v", tt.name, i, lse8[i], lse[i])
			}
		}
	}
}

// TestReferenceFP8Append: an appended token is stored as
// RoundFP8(x / descale) in float32, after rotary (rounded to q's dtype).
func TestReferenceFP8Append(t *testing.T) {
	s := Shape{DType: Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 4, HeadsKV: 2, HeadDim: 16, SeqlenCache: 20, Seqlen: -1}
	for _, rotary := range []int{0, 16} {
		h := fp8Host(s, []int32{3, 11}, false, serving{seqlenNew: 2, rotary: rotary}, Float8E4M3, 2, 7)
		for i := range h.KNew { // spread the new tokens over the format's range, past it too
			h.KNew[i] *= 600
			h.VNew[i] *= 0.01
		}
		k, v, _, err := ReferenceAppend(h)
		if err != nil {
			t.Fatal(err)
		}
		for b, at := range []int{3, 11} {
			for tok := range 2 {
				for kvh := range s.HeadsKV {
					key := append([]float32(nil), h.KNew[((b*2+tok)*s.HeadsKV+kvh)*s.HeadDim:][:s.HeadDim]...)
					if rotary > 0 {
						h.naiveRotate(key, at+tok)
					}
					kd, vd := h.KDescale[b*s.HeadsKV+kvh], h.VDescale[b*s.HeadsKV+kvh]
					off := h.slot(b, at+tok) + kvh*s.HeadDim
					for e := range s.HeadDim {
						x := h.VNew[((b*2+tok)*s.HeadsKV+kvh)*s.HeadDim+e]
						wantK := float32(math.Min(math.Max(float64(key[e]/kd), -448), 448))
						if k[off+e] != RoundFP8(Float8E4M3, wantK) || v[off+e] != RoundFP8(Float8E4M3, x/vd) {
							t.Fatalf("rotary %d: sequence %d token %d head %d [%d]: k %v v %v, from %v, %v", rotary, b, tok, kvh, e, k[off+e], v[off+e], key[e], x)
						}
					}
				}
			}
		}
	}
}

func TestReferenceFP8Errors(t *testing.T) {
	s := Shape{DType: Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 4, HeadsKV: 2, HeadDim: 8, SeqlenCache: 10, Seqlen: -1}
	for _, tt := range []struct {
		name string
		edit func(*HostProblem)
		arg  string
	}{
		{"descales of a float16 cache", func(h *HostProblem) { h.KVDType = 0 }, "k_descale"},
		{"three scales", func(h *HostProblem) { h.VDescale = []float32{1, 2, 3} }, "v_descale"},
		{"a zero scale", func(h *HostProblem) { h.KDescale[1] = 0 }, "k_descale"},
		{"an infinite scale", func(h *HostProblem) { h.VDescale[0] = float32(math.Inf(1)) }, "v_descale"},
		{"a NaN scale", func(h *HostProblem) { h.VDescale[0] = float32(math.NaN()) }, "v_descale"},
		{"an fp8 kv_dtype for q", func(h *HostProblem) { h.DType = Float8E4M3 }, "dtype"},
	} {
		h := fp8Host(s, nil, false, serving{}, Float8E4M3, 2, 9)
		tt.edit(h)
		_, _, err := ReferenceDecode(h, 1, 4)
		var e *Error
		if !errors.As(err, &e) || e.Arg != tt.arg {
			t.Errorf("%s: err = %v, want one naming %s", tt.name, err, tt.arg)
		}
	}
}
