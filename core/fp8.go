package core

import (
	"fmt"
	"math"
)

// This file holds the fp8 caches' part of a Problem (Shape.KVDType and the
// descales KDescale, VDescale): their conversion from a Layout, their
// checks, and the rounding of a value to an fp8 format that the append
// does and the reference repeats.

// fp8Format is the layout of an fp8 format: its fraction bits, the
// exponent of its smallest normal value and its largest finite value.
type fp8Format struct {
	fracBits, minExp int
	max              float64
}

// fp8Formats are torch.float8_e4m3fn (no infinities: 448 is the largest
// value, its next code NaN) and torch.float8_e5m2 (IEEE-like: 57344, then
// infinity).
var fp8Formats = map[DType]fp8Format{
	Float8E4M3: {fracBits: 3, minExp: -6, max: 448},
	Float8E5M2: {fracBits: 2, minExp: -14, max: 57344},
}

// FP8Max returns the largest finite value of the fp8 format dt (448 for
// Float8E4M3, 57344 for Float8E5M2), or 0 for a dtype that is not fp8.
func FP8Max(dt DType) float32 { return float32(fp8Formats[dt].max) }

// RoundFP8 rounds x to the nearest value of the fp8 format dt, ties to
// even, saturating at ±FP8Max(dt) (infinities too); NaN stays NaN. It is
// torch's x.clamp(-max, max).to(dt), and the append's store of a new token
// into an fp8 cache (PTX cvt.rn.satfinite). x is returned for a dtype that
// is not fp8.
func RoundFP8(dt DType, x float32) float32 {
	f, ok := fp8Formats[dt]
	v := float64(x)
	if !ok || math.IsNaN(v) || v == 0 {
		return x
	}
	if math.Abs(v) >= f.max {
		return float32(math.Copysign(f.max, v))
	}
	// |v| in [2^(e-1), 2^e); below the smallest normal the step is the subnormals'.
	_, e := math.Frexp(math.Abs(v))
	step := math.Ldexp(1, max(e-1, f.minExp)-f.fracBits)
	return float32(min(max(math.RoundToEven(v/step)*step, -f.max), f.max))
}

// quantize is an appended value x as an fp8 cache of dtype dt with scale
// descale stores it: x / descale in float32, rounded by RoundFP8.
func quantize(dt DType, x, descale float32) float32 { return RoundFP8(dt, x/descale) }

// validateKVDType checks Shape.KVDType: 0 (DType's), DType itself, or an
// fp8 format.
func (s Shape) validateKVDType(op string) error {
	if s.KVDType != 0 && s.KVDType != s.DType && !s.KVDType.FP8() {
		return unsupported(op, "kv_dtype", fmt.Sprintf("%d with dtype %v; supported: 0 (dtype's), %d (%v), %d (%v)",
			int(s.KVDType), s.DType, int(Float8E4M3), Float8E4M3, int(Float8E5M2), Float8E5M2))
	}
	return nil
}

// layoutDescale converts the descale fields of l for one cache (name
// k_descale or v_descale): the strides of its array when l.Descale is set
// (those of a dimension of size 1 set to 0), else its value.
func layoutDescale(op, name string, l *Layout, strides [2]int64, value float64, batch, heads int) (Descale, error) {
	if l.Descale == 0 {
		if strides != [2]int64{} {
			return Descale{}, invalid(op, name, fmt.Sprintf("strides (%d, %d) without descale arrays (descale=0)", strides[0], strides[1]))
		}
		if value == 0 {
			return Descale{}, nil
		}
		// A positive float64 must neither round to 0 (read as 1) nor overflow.
		if f := float32(value); f >= minNormalFloat32 && f <= math.MaxFloat32 {
			return Descale{Value: f}, nil
		}
		return Descale{}, invalid(op, name, fmt.Sprintf("%v; must be a positive normal float32, %g to %g (0: 1)", value, minNormalFloat32, math.MaxFloat32))
	}
	if value != 0 {
		return Descale{}, invalid(op, name+"_value", fmt.Sprintf("%v given with descale arrays (descale=1): the array holds the scales", value))
	}
	d := Descale{BatchStride: strides[0], HeadStride: strides[1]}
	if batch <= 1 {
		d.BatchStride = 0
	}
	if heads <= 1 {
		d.HeadStride = 0
	}
	return d, nil
}

// convertFP8 sets p's cache dtype and descales from l (the layout's
// kv_dtype, descale, k_descale, v_descale and their values); Problem's
// checks (validateFP8) follow.
func (p *Problem) convertFP8(op string, l *Layout) error {
	if l.Descale != 0 && l.Descale != 1 {
		return invalid(op, "descale", fmt.Sprintf("%d; must be 0 or 1", l.Descale))
	}
	p.KVDType = DType(max(min(l.KVDType, math.MaxInt32), math.MinInt32))
	if p.KVDType == p.DType { // the same as 0: one plan for both
		p.KVDType = 0
	}
	p.DescaleArrays = l.Descale != 0
	var err error
	if p.KDescale, err = layoutDescale(op, "k_descale", l, l.KDescale, l.KDescaleValue, p.Batch, p.HeadsKV); err != nil {
		return err
	}
	p.VDescale, err = layoutDescale(op, "v_descale", l, l.VDescale, l.VDescaleValue, p.Batch, p.HeadsKV)
	return err
}

// layoutFP8 sets l's fp8 fields from p: the inverse of convertFP8.
func layoutFP8(l *Layout, p *Problem) {
	l.KVDType = int64(p.KVDType)
	l.Descale = layoutFlag(p.DescaleArrays)
	if p.DescaleArrays {
		l.KDescale = [2]int64{p.KDescale.BatchStride, p.KDescale.HeadStride}
		l.VDescale = [2]int64{p.VDescale.BatchStride, p.VDescale.HeadStride}
		return
	}
	l.KDescaleValue, l.VDescaleValue = float64(p.KDescale.Value), float64(p.VDescale.Value)
}

// validateFP8 is ValidateLayout's part for the descales: only with an fp8
// cache, arrays of non-negative strides whose offsets fit in 64 bits, or
// values that are 0 (1) or positive normal float32s.
func (p *Problem) validateFP8(op string) error {
	for _, x := range [...]struct {
		name string
		d    Descale
	}{{"k_descale", p.KDescale}, {"v_descale", p.VDescale}} {
		d := x.d
		set := p.DescaleArrays || d.Value != 0 || d.BatchStride != 0 || d.HeadStride != 0
		switch v := float64(d.Value); {
		case !set:
		case !p.CacheDType().FP8():
			return invalid(op, x.name, fmt.Sprintf("given with a %v cache; descales scale an fp8 cache (kv_dtype %d or %d)", p.CacheDType(), int(Float8E4M3), int(Float8E5M2)))
		case !p.DescaleArrays && (d.BatchStride != 0 || d.HeadStride != 0):
			return invalid(op, x.name, fmt.Sprintf("strides (%d, %d) without descale arrays", d.BatchStride, d.HeadStride))
		case p.DescaleArrays && v != 0:
			return invalid(op, x.name, fmt.Sprintf("value %v with descale arrays: the array holds the scales", d.Value))
		case v != 0 && !(v >= minNormalFloat32 && v <= math.MaxFloat32):
			return invalid(op, x.name, fmt.Sprintf("%v; must be a positive normal float32 (0: 1)", d.Value))
		case d.BatchStride < 0 || d.HeadStride < 0:
			return invalid(op, x.name, fmt.Sprintf("strides (%d, %d); must not be negative (0: the same scale along that dimension)", d.BatchStride, d.HeadStride))
		case d.descaleLast(p.Batch, p.HeadsKV) < 0:
			return invalid(op, x.name, "strides too large: offsets overflow 64 bits")
		}
	}
	return nil
}

// descaleLast is the offset of the last element of a (batch, heads)
// descale array of d's strides, or -1 past int64.
func (d Descale) descaleLast(batch, heads int) int64 {
	b, h := int64(max(batch-1, 0)), int64(max(heads-1, 0))
	if b > 0 && d.BatchStride > math.MaxInt64/b {
		return -1
	}
	last := b * d.BatchStride
	if h > 0 && d.HeadStride > (math.MaxInt64-last)/h {
		return -1
	}
	return last + h*d.HeadStride
}

// scales is the float32 elements a (batch, heads) descale array of d's
// strides spans, valid ones (validateFP8) fitting in 64 bits.
func (d Descale) scales(batch, heads int) uint64 {
	return uint64(max(batch-1, 0))*uint64(d.BatchStride) + uint64(max(heads-1, 0))*uint64(d.HeadStride) + 1
}

// checkDescalePointers is CheckPointers' part for the descales: both
// arrays given exactly when the layout has them, 4-byte aligned.
func (p *Problem) checkDescalePointers(op string) error {
	for _, x := range [...]struct {
		name string
		ptr  uintptr
	}{{"k_descale", p.KDescale.Ptr}, {"v_descale", p.VDescale.Ptr}} {
		switch {
		case !p.DescaleArrays && x.ptr != 0:
			return invalid(op, x.name, fmt.Sprintf("address %#x given, but the layout has no descale arrays (descale=0: one value)", x.ptr))
		case p.DescaleArrays && x.ptr == 0:
			return invalid(op, x.name, "null device pointer; the layout has descale arrays (descale=1)")
		case x.ptr%4 != 0:
			return invalid(op, x.name, fmt.Sprintf("address %#x is not 4-byte aligned", x.ptr))
		}
	}
	return nil
}
