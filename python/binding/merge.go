package binding

import (
	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// MergeStates merges attention states (see core.MergeProblem; strides count
// elements) on GPU device, on the CUstream handle stream, and returns the
// number of rows merged, or a negative error id. dtype is 1 (float16), 2 (bfloat16) or 3 (float32).
// Rows r0 x r1 x r2 are the row dimensions. The states' outputs are at
// o0..o7, one pointer per state (oPtrs == numStates, at most 8), or at o0 +
// s*oState elements (oPtrs == 1), and row (i0, i1, i2) of each at oS0*i0 +
// oS1*i1 + oS2*i2 further; their LSEs likewise (l..). out and lse (0: not
// wanted) receive the merged rows.
func MergeStates(dtype, numStates, r0, r1, r2, headDim int,
	o0, o1, o2, o3, o4, o5, o6, o7 uintptr, oPtrs int, oState, oS0, oS1, oS2 int64,
	l0, l1, l2, l3, l4, l5, l6, l7 uintptr, lPtrs int, lState, lS0, lS1, lS2 int64,
	out uintptr, outS0, outS1, outS2 int64, lse uintptr, lseS0, lseS1, lseS2 int64,
	device int, stream uintptr) (rows int) {
	defer recoverError(&rows)
	p := core.MergeProblem{
		DType: core.DType(dtype), NumStates: numStates, Rows: [3]int{r0, r1, r2}, HeadDim: headDim,
		Outs: core.MergeInput{Ptrs: [core.MergePointers]uintptr{o0, o1, o2, o3, o4, o5, o6, o7}, NumPtrs: oPtrs,
			StateStride: oState, Strides: [3]int64{oS0, oS1, oS2}},
		LSEs: core.MergeInput{Ptrs: [core.MergePointers]uintptr{l0, l1, l2, l3, l4, l5, l6, l7}, NumPtrs: lPtrs,
			StateStride: lState, Strides: [3]int64{lS0, lS1, lS2}},
		Out: core.MergeOutput{Ptr: out, Strides: [3]int64{outS0, outS1, outS2}},
		LSE: core.MergeOutput{Ptr: lse, Strides: [3]int64{lseS0, lseS1, lseS2}},
	}
	if err := cuda.MergeStates(&p, device, stream); err != nil {
		return fail(err)
	}
	return p.NumRows()
}
