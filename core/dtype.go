package core

// DType is the element type of q, k, v and out.
type DType int

// The supported element types.
const (
	Float16  DType = 1 // IEEE half precision (torch.float16)
	BFloat16 DType = 2 // bfloat16 (torch.bfloat16)
)

// String returns the torch-style name of the dtype.
func (d DType) String() string {
	switch d {
	case Float16:
		return "float16"
	case BFloat16:
		return "bfloat16"
	}
	return "invalid dtype"
}

// Valid reports whether d is one of the supported element types.
func (d DType) Valid() bool { return d == Float16 || d == BFloat16 }

// Size returns the size of one element in bytes.
func (d DType) Size() int { return 2 }
