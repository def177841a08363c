package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flash-decode/flash-decode/core"
	"gorgonia.org/cu"
)

// fp8Format is an fp8 cache format's encoding: mantissa bits, exponent
// bias and its largest finite code.
type fp8Format struct {
	mbits, bias int
	maxCode     uint8
}

func formatOf(dt core.DType) fp8Format {
	if dt == core.Float8E5M2 {
		return fp8Format{mbits: 2, bias: 15, maxCode: 0x7b}
	}
	return fp8Format{mbits: 3, bias: 7, maxCode: 0x7e}
}

// toFP8 is x as an fp8 cache holds it (the append's rule): saturated to
// the largest finite value, then rounded to nearest even, as torch's
// .to(float8_*) rounds the saturated value; -0 keeps its sign.
func toFP8(dt core.DType, x float32) uint8 {
	f := formatOf(dt)
	var sign uint8
	if math.Signbit(float64(x)) {
		sign = 0x80
	}
	a := math.Min(math.Abs(float64(x)), float64(fromFP8(dt, f.maxCode)))
	if a == 0 {
		return sign
	}
	// The spacing of values at a: that of the subnormals below the
	// smallest normal, else 2^(exponent - mbits). Codes grow with values,
	// a carry out of the mantissa landing on the next exponent.
	e := max(math.Ilogb(a), 1-f.bias)
	q := math.RoundToEven(math.Ldexp(a, f.mbits-e)) // a / spacing, in [0, 2^(mbits+1)]
	code := int(q)
	if e > 1-f.bias || code >= 1<<f.mbits {
		code = (e+f.bias)<<f.mbits + code - 1<<f.mbits
	}
	return sign | min(uint8(code), f.maxCode)
}

// fromFP8 is the value of an fp8 code (finite codes only).
func fromFP8(dt core.DType, b uint8) float32 {
	f := formatOf(dt)
	e, m := int(b&0x7f)>>f.mbits, float64(int(b)&(1<<f.mbits-1))
	v := math.Ldexp(m, 1-f.bias-f.mbits) // subnormal
	if e > 0 {
		v = math.Ldexp(m+float64(int(1)<<f.mbits), e-f.bias-f.mbits)
	}
	if b&0x80 != 0 {
		v = -v
	}
	return float32(v)
}

// TestFP8Encoding: the host encoder against values worked out by hand
// (rounding ties to even, subnormals, saturation), and every finite code
// back to itself.
func TestFP8Encoding(t *testing.T) {
	e4, e5 := core.Float8E4M3, core.Float8E5M2
	cases := []struct {
		dt   core.DType
		x    float32
		code uint8
	}{
		{e4, 1, 0x38}, {e4, -2, 0xc0}, {e4, 0.0625, 0x18}, {e4, 448, 0x7e}, {e4, 464, 0x7e}, {e4, 500, 0x7e},
		{e4, float32(math.Inf(-1)), 0xfe}, {e4, 0x1p-9, 0x01}, {e4, 0x1p-10, 0x00}, {e4, 0x1.8p-10, 0x01},
		{e4, 0x1.8p-9, 0x02}, {e4, 0x7p-9, 0x07}, {e4, 0x7.8p-9, 0x08}, {e4, 1.0625, 0x38}, {e4, 1.1875, 0x3a},
		{e4, 1.0626, 0x39}, {e4, float32(math.Copysign(0, -1)), 0x80}, {e4, 240, 0x77}, {e4, 3.1, 0x44},
		{e5, 1, 0x3c}, {e5, -3, 0xc2}, {e5, 57344, 0x7b}, {e5, 1e6, 0x7b}, {e5, 0x1p-16, 0x01}, {e5, 0x1p-17, 0x00},
		{e5, 0x1.8p-16, 0x02}, {e5, 1.125, 0x3c}, {e5, 1.375, 0x3e}, {e5, 0x3.8p-16, 0x04}, {e5, -0x1p-14, 0x84},
	}
	for _, c := range cases {
		if got := toFP8(c.dt, c.x); got != c.code {
			t.Errorf("%v %g: code %#02x, want %#02x", c.dt, c.x, got, c.code)
		}
	}
	for _, dt := range []core.DType{e4, e5} {
		f := formatOf(dt)
		for b := 0; b < 256; b++ {
			if code := uint8(b); code&0x7f <= f.maxCode {
				if got := toFP8(dt, fromFP8(dt, code)); got != code {
					t.Errorf("%v code %#02x (%g) encodes as %#02x", dt, code, fromFP8(dt, code), got)
				}
			}
		}
	}
}

// randomFP8 returns n fp8 codes of magnitudes up to 7.5 (e4m3) or 7 (e5m2),
// subnormals included, and their values.
func randomFP8(r *rand.Rand, dt core.DType, n int) ([]uint8, []float32) {
	f := formatOf(dt)
	top := 2 + f.bias // largest exponent field: values below 8
	codes, vals := make([]uint8, n), make([]float32, n)
	for i := range codes {
		codes[i] = uint8(r.IntN(2)<<7 | r.IntN(top+1)<<f.mbits | r.IntN(1<<f.mbits))
		vals[i] = fromFP8(dt, codes[i])
	}
	return codes, vals
}

// fp8Case is a GPU test of an fp8 cache: the plain, paged or serving form.
type fp8Case struct {
	name     string
	kv       core.DType
	shape    core.Shape
	lens     []int32
	causal   bool
	pageSize int          // > 0: a paged cache, pages shuffled
	perHead  bool         // (batch, heads_kv) descale arrays, else one value each
	window   core.Window  // the serving form
	softcap  float32      // the serving form
	newKV    int          // tokens appended (an appending form, or the append kernel with rotary)
	rotary   int          // rotary_dim
	wantForm core.Form    // the form the plan must run
	descales [2][]float32 // set by problem: per (b, h) K and V descales
}

// descaleOf is sequence b's K/V head h's descale of table d (one value if len 1).
func descaleOf(d []float32, b, h, heads int) float32 {
	if len(d) == 1 {
		return d[0]
	}
	return d[b*heads+h]
}

// TestFP8CacheMatchesNaiveAttention runs stage 1 (and its merge) over fp8
// caches against naive attention in float64 over the dequantized caches
// (codes times descales), and checks that the appended tokens are the host
// encoder's codes of the new values divided by the descales, bit for bit.
func TestFP8CacheMatchesNaiveAttention(t *testing.T) {
	gpu(t) // skips without a GPU
	f16, bf16, e4, e5 := core.Float16, core.BFloat16, core.Float8E4M3, core.Float8E5M2
	shape := func(dt core.DType, batch, sq, hq, hkv, d, cache, splits int) core.Shape {
		return core.Shape{DType: dt, Batch: batch, SeqlenQ: sq, HeadsQ: hq, HeadsKV: hkv, HeadDim: d, SeqlenCache: cache,
			Seqlen: -1, NumSplits: splits}
	}
	tests := []fp8Case{
		{name: "f16 e4m3 d128 gqa4 plain", kv: e4, shape: shape(f16, 2, 1, 32, 8, 128, 3000, 0), lens: []int32{2999, 1}, wantForm: core.FormPlain},
		{name: "bf16 e4m3 d64 causal sq4 ragged, per head", kv: e4, shape: shape(bf16, 3, 4, 20, 4, 64, 777, 7), lens: []int32{0, 5, 777},
			causal: true, perHead: true, wantForm: core.FormPlain},
		{name: "f16 e5m2 d256 mqa sq16 causal", kv: e5, shape: shape(f16, 1, 16, 8, 1, 256, 4096, 0), lens: []int32{4000}, causal: true, wantForm: core.FormPlain},
		{name: "bf16 e5m2 d128 r32 causal sq4, per head", kv: e5, shape: shape(bf16, 2, 4, 64, 8, 128, 1500, 5), causal: true, perHead: true, wantForm: core.FormPlain},
		{name: "f16 e4m3 d80 (padded) mha", kv: e4, shape: shape(f16, 2, 2, 4, 4, 80, 300, 1), wantForm: core.FormPlain},
		{name: "bf16 e4m3 d128 paged 16 causal, per head", kv: e4, shape: shape(bf16, 3, 4, 32, 8, 128, 2048, 0), lens: []int32{2048, 700, 1},
			causal: true, pageSize: 16, perHead: true, wantForm: core.FormPaged},
		{name: "f16 e5m2 d64 paged 8, 100 splits", kv: e5, shape: shape(f16, 1, 1, 64, 8, 64, 20000, 100), lens: []int32{19999}, pageSize: 8, wantForm: core.FormPaged},
		{name: "f16 e4m3 d128 serving: window, softcap, paged 5", kv: e4, shape: shape(f16, 2, 3, 32, 8, 128, 2000, 0), lens: []int32{2000, 900},
			causal: true, pageSize: 5, window: core.Window{Enabled: true, Left: 300, Right: -1}, softcap: 20, perHead: true, wantForm: core.FormServing},
		{name: "bf16 e4m3 d128 append 3 (fused)", kv: e4, shape: shape(bf16, 2, 1, 16, 4, 128, 1024, 0), lens: []int32{500, 0}, newKV: 3,
			perHead: true, wantForm: core.FormAppend},
		{name: "f16 e5m2 d64 paged 16, append 2 (fused)", kv: e5, shape: shape(f16, 2, 2, 8, 2, 64, 512, 0), lens: []int32{200, 509}, newKV: 2,
			pageSize: 16, wantForm: core.FormPagedAppend},
		{name: "f16 e4m3 d128 append 4, rotary (append kernel)", kv: e4, shape: shape(f16, 2, 4, 16, 4, 128, 1024, 0), lens: []int32{600, 3},
			causal: true, newKV: 4, rotary: 64, perHead: true, wantForm: core.FormServing},
	}
	r := rand.New(rand.NewPCG(5, 6))
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			gpu(t)
			runFP8Case(t, r, tc)
		})
	}
}

func runFP8Case(t *testing.T, r *rand.Rand, tc fp8Case) {
	s := tc.shape
	s.SeqlenNew = tc.newKV
	row := s.HeadsKV * s.HeadDim
	sc := servingCase{shape: s, lens: tc.lens, causal: tc.causal, pageSize: tc.pageSize, window: tc.window,
		softcap: tc.softcap, rotary: tc.rotary}
	h := sc.host(r) // q, the new tokens, pages and rotary tables; the caches are replaced below
	// The descales: powers of two and not, one value or one per (b, h).
	pick := func() []float32 {
		n := 1
		if tc.perHead {
			n = s.Batch * s.HeadsKV
		}
		d := make([]float32, n)
		for i := range d {
			d[i] = []float32{0.5, 1, 0.75, 1.5, 0.3}[r.IntN(5)]
		}
		return d
	}
	kd, vd := pick(), pick()
	kCodes, kVals := randomFP8(r, tc.kv, len(h.K))
	vCodes, vVals := randomFP8(r, tc.kv, len(h.V))
	// The sequence whose descale a cache row takes: its own (contiguous),
	// or its page's owner (pages no sequence owns are never read).
	var pageOwner []int
	if tc.pageSize > 0 {
		pageOwner = make([]int, len(h.K)/(tc.pageSize*row))
		for j, p := range h.BlockTable {
			pageOwner[p] = j / (s.SeqlenCache / tc.pageSize)
		}
	}
	owner := func(i int) int {
		if tc.pageSize == 0 {
			return i / (s.SeqlenCache * row)
		}
		return pageOwner[i/(tc.pageSize*row)]
	}
	for i := range h.K {
		b, head := owner(i), i%row/s.HeadDim
		h.K[i] = kVals[i] * descaleOf(kd, b, head, s.HeadsKV)
		h.V[i] = vVals[i] * descaleOf(vd, b, head, s.HeadsKV)
	}
	// The reference: naive attention over the dequantized caches with the
	// new tokens written in (rotated, in q's dtype) as the cache will hold
	// them, quantized, and q rotated (ReferenceAppend), with nothing left
	// to append or rotate.
	k, v, q, err := core.ReferenceAppend(h)
	if err != nil {
		t.Fatal(err)
	}
	ref := *h
	ref.K, ref.V, ref.Q = k, v, q
	var wantNewK, wantNewV []uint8 // the appended tokens' codes, (batch, new, heads_kv, head_dim)
	if tc.newKV > 0 {
		wantNewK, wantNewV = make([]uint8, len(h.KNew)), make([]uint8, len(h.VNew))
		ref.CacheSeqlens = make([]int32, s.Batch)
		for b := range s.Batch {
			ref.CacheSeqlens[b] = int32(min(int(tc.lens[b])+tc.newKV, s.SeqlenCache))
		}
		newSlots(h, tc, func(b, tok, at int) {
			for j := range row {
				kdj, vdj := descaleOf(kd, b, j/s.HeadDim, s.HeadsKV), descaleOf(vd, b, j/s.HeadDim, s.HeadsKV)
				i := (b*tc.newKV+tok)*row + j
				wantNewK[i], wantNewV[i] = toFP8(tc.kv, k[at+j]/kdj), toFP8(tc.kv, v[at+j]/vdj)
				ref.K[at+j], ref.V[at+j] = fromFP8(tc.kv, wantNewK[i])*kdj, fromFP8(tc.kv, wantNewV[i])*vdj
			}
		})
		ref.Shape.SeqlenNew, ref.KNew, ref.VNew = 0, nil, nil
		ref.RotaryCos, ref.RotarySin, ref.RotaryDim = nil, nil, 0
	}
	want, wantLSE, err := core.NaiveAttention(&ref)
	if err != nil {
		t.Fatal(err)
	}

	p := sc.problem(t, h)
	p.Shape.KVDType = tc.kv
	p.K.Ptr, p.V.Ptr = uintptr(upload(t, kCodes)), uintptr(upload(t, vCodes))
	for i, d := range [][]float32{kd, vd} {
		ds := core.Descale{Value: d[0]}
		if tc.perHead {
			ds = core.Descale{Ptr: uintptr(upload(t, d)), BatchStride: int64(s.HeadsKV), HeadStride: 1}
		}
		if i == 0 {
			p.KDescale = ds
		} else {
			p.VDescale = ds
		}
	}
	pl, err := PlanFor(p.PlanShape(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if pl.Variant.Form != tc.wantForm || !pl.Variant.FP8Cache {
		t.Fatalf("planned %s (%v), want the %v form of an fp8 cache", pl.Variant.Kernel, pl.Variant.Form, tc.wantForm)
	}
	ws := upload(t, make([]byte, pl.WorkspaceBytes))
	if _, err := Decode(&p, uintptr(ws), pl.WorkspaceBytes, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := cu.Synchronize(); err != nil {
		t.Fatal(err)
	}
	checkOutputs(t, &p, pl, want, wantLSE)
	if tc.newKV == 0 {
		return
	}
	// The appended tokens, bit for bit.
	for _, c := range []struct {
		name string
		ptr  uintptr
		want []uint8
	}{{"k_cache", p.K.Ptr, wantNewK}, {"v_cache", p.V.Ptr, wantNewV}} {
		got := make([]uint8, len(kCodes))
		download(t, cu.DevicePtr(c.ptr), got)
		newSlots(h, tc, func(b, tok, at int) {
			for j := range row {
				if w := c.want[(b*tc.newKV+tok)*row+j]; got[at+j] != w {
					t.Fatalf("%s: sequence %d new token %d element %d = %#02x, want %#02x", c.name, b, tok, j, got[at+j], w)
				}
			}
		})
	}
}

// newSlots calls f with each appended token's sequence, its index and its
// element offset in the cache, skipping tokens past the cache as the
// append does.
func newSlots(h *core.HostProblem, tc fp8Case, f func(b, tok, at int)) {
	row := tc.shape.HeadsKV * tc.shape.HeadDim
	for b := range tc.shape.Batch {
		for tok := range tc.newKV {
			if key := int(tc.lens[b]) + tok; key < tc.shape.SeqlenCache {
				f(b, tok, cacheRow(h, tc, b, key)*row)
			}
		}
	}
}

// cacheRow is the cache row (in rows of heads_kv x head_dim) of key `key`
// of sequence b.
func cacheRow(h *core.HostProblem, tc fp8Case, b, key int) int {
	if tc.pageSize == 0 {
		return b*tc.shape.SeqlenCache + key
	}
	per := tc.shape.SeqlenCache / tc.pageSize
	return int(h.BlockTable[b*per+key/tc.pageSize])*tc.pageSize + key%tc.pageSize
}
