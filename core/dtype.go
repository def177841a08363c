package core

// DType is the element type of q, k, v and out (and of merge_states' inputs).
type DType int

// The element types. Decoding takes Float16 and BFloat16 (Valid) for q,
// out and the new tokens, and for the caches those or an fp8 format
// (Shape.KVDType); the merge kernels take Float32 too.
const (
	Float16    DType = 1 // IEEE half precision (torch.float16)
	BFloat16   DType = 2 // bfloat16 (torch.bfloat16)
	Float32    DType = 3 // IEEE single precision (torch.float32)
	Float8E4M3 DType = 4 // fp8 with 4 exponent bits, no infinities (torch.float8_e4m3fn)
	Float8E5M2 DType = 5 // fp8 with 5 exponent bits (torch.float8_e5m2)
	// The index tensors' type, and two a caller passes by mistake (a
	// Tensors record names them in its errors).
	Int32   DType = 6
	Int64   DType = 7
	Float64 DType = 8
)

// String returns the torch-style name of the dtype.
func (d DType) String() string {
	switch d {
	case Float16:
		return "float16"
	case BFloat16:
		return "bfloat16"
	case Float32:
		return "float32"
	case Float8E4M3:
		return "float8_e4m3fn"
	case Float8E5M2:
		return "float8_e5m2"
	case Int32:
		return "int32"
	case Int64:
		return "int64"
	case Float64:
		return "float64"
	}
	return "invalid dtype"
}

// Valid reports whether d is an element type decoding supports.
func (d DType) Valid() bool { return d == Float16 || d == BFloat16 }

// FP8 reports whether d is one of the fp8 cache formats.
func (d DType) FP8() bool { return d == Float8E4M3 || d == Float8E5M2 }

// Size returns the size of one element in bytes.
func (d DType) Size() int { return elemSize(d) }

// elemSize is the size in bytes of one element of d.
func elemSize(d DType) int {
	switch {
	case d == Float32:
		return 4
	case d.FP8():
		return 1
	}
	return 2
}
