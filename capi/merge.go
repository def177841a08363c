package main

/*
#include "flashdecode.h"
*/
import "C"

import (
	"unsafe"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// mergeProblem converts an fd_merge_args.
func mergeProblem(a *C.fd_merge_args) core.MergeProblem {
	p := core.MergeProblem{
		DType:     core.DType(a.dtype),
		NumStates: int(a.num_states),
		HeadDim:   int(a.head_dim),
		Outs:      mergeInput(&a.outs),
		LSEs:      mergeInput(&a.lses),
		Out:       core.MergeOutput{Ptr: uintptr(a.out)},
		LSE:       core.MergeOutput{Ptr: uintptr(a.lse)},
	}
	for i := range core.MergeRowDims {
		p.Rows[i] = int(a.rows[i])
		p.Out.Strides[i] = int64(a.out_strides[i])
		p.LSE.Strides[i] = int64(a.lse_strides[i])
	}
	return p
}

func mergeInput(in *C.fd_merge_input) core.MergeInput {
	m := core.MergeInput{NumPtrs: int(in.num_ptrs), StateStride: int64(in.state_stride)}
	for i := range m.Ptrs {
		m.Ptrs[i] = uintptr(in.ptrs[i])
	}
	for i := range m.Strides {
		m.Strides[i] = int64(in.row_strides[i])
	}
	return m
}

//export fdgo_merge_states
func fdgo_merge_states(args *C.fd_merge_args, stream C.uintptr_t) (ret C.int) {
	defer guard(&ret)
	if args == nil {
		return finish(errNull("merge_states", "args"))
	}
	p := mergeProblem(args)
	return finish(cuda.MergeStates(&p, int(args.device), uintptr(stream)))
}

//export fdgo_merge_tensors
func fdgo_merge_tensors(t *C.fd_merge_tensor, size C.size_t, numOuts, numLSEs, flags C.int64_t, stream C.uintptr_t) (ret C.int) {
	defer guard(&ret)
	if t == nil || size == 0 {
		return finish(errNull("merge_states", "tensors"))
	}
	m, err := core.ReadMergeTensors(unsafe.Slice((*byte)(unsafe.Pointer(t)), int(size)), int64(numOuts), int64(numLSEs), int64(flags))
	if err == nil {
		_, err = cuda.MergeTensors(&m, uintptr(stream))
	}
	return finish(err)
}
