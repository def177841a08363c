package core

// DType is the element type of q, k, v and out (and of merge_states' inputs).
type DType int

// The element types. Decoding takes Float16 and BFloat16 (Valid); the merge
// kernels take Float32 too.
const (
	Float16  DType = 1 // IEEE half precision (torch.float16)
	BFloat16 DType = 2 // bfloat16 (torch.bfloat16)
	Float32  DType = 3 // IEEE single precision (torch.float32)
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
	}
	return "invalid dtype"
}

// Valid reports whether d is an element type decoding supports.
func (d DType) Valid() bool { return d == Float16 || d == BFloat16 }

// Size returns the size of one element in bytes.
func (d DType) Size() int { return elemSize(d) }

// elemSize is the size in bytes of one element of d.
func elemSize(d DType) int {
	if d == Float32 {
		return 4
	}
	return 2
}
