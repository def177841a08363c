package cuda

// The merge API's launch: the fd_merge_states_<dtype> kernels of
// kernels/merge_states.cuh, which take an fd_merge_params (merge_params.h)
// by value. openDevice looks their handles up with the decode kernels'.

/*
#cgo CFLAGS: -I${SRCDIR}/../../kernels
#cgo noescape fd_merge_launch
#cgo nocallback fd_merge_launch
#include <stdint.h>
#include <cuda.h>
#include "launch.h"
#include "merge_params.h"

// Launches a merge kernel (one block per row) on fd_merge_params p; the stream comes
// as an integer, as fd_run's.
static CUresult fd_merge_launch(CUfunction f, unsigned grid, unsigned threads, unsigned smem,
                                uintptr_t stream, int pdl, fd_merge_params *p) {
	return fd_launch_kernel(f, grid, 1, 1, threads, smem, (CUstream)stream, pdl, 1, p);
}
*/
import "C"

import (
	"fmt"

	"github.com/flash-decode/flash-decode/core"
)

// mergeDTypes are the dtypes with a merge kernel; mergeKernels holds one
// handle per dtype, by core.DType.
var mergeDTypes = [...]core.DType{core.Float16, core.BFloat16, core.Float32}

type mergeKernels [core.Float32 + 1]function

// MergeStates merges the attention states of p (see core.MergeProblem) on
// GPU device, launching on stream (a CUstream handle; 0 is the legacy
// default stream). Like Decode it never synchronizes with the host and
// allocates no device memory, and its launch depends on p's sizes only (it
// can be captured in a CUDA graph): out and lse are ready when the stream
// reaches this point.
func MergeStates(p *core.MergeProblem, device int, stream uintptr) (err error) {
	if err := p.Validate(); err != nil {
		return err
	}
	if err := checkMergeAddresses(p); err != nil {
		return err
	}
	d, err := getDevice("merge_states", device)
	if err != nil {
		return err
	}
	sc, err := current(d.raw, device) // as in run
	if err != nil {
		return err
	}
	defer sc.undoInto(&err, device)
	l := p.Launch()
	params := mergeParams(p)
	pdl := C.int(0)
	if d.pdl {
		pdl = 1
	}
	r := C.fd_merge_launch(C.CUfunction(d.merges[p.DType]), C.uint(l.Grid), C.uint(l.Threads), C.uint(l.SharedBytes),
		C.uintptr_t(stream), pdl, &params)
	if r != C.CUDA_SUCCESS {
		return fmt.Errorf("flashdecode: %w", check("launch "+l.Kernel, r))
	}
	return nil
}

// MergeTensors merges the states m describes (see core.MergeTensors) on
// their device, launching on stream as MergeStates does, and returns the
// number of rows merged; a merge of no row launches nothing.
func MergeTensors(m *core.MergeTensors, stream uintptr) (int, error) {
	p, device, err := m.Problem()
	if err != nil || p.NumRows() == 0 {
		return 0, err
	}
	return p.NumRows(), MergeStates(&p, device, stream)
}

// checkMergeAddresses refuses a merge's nonzero addresses below minAddress
// (see checkAddresses).
func checkMergeAddresses(p *core.MergeProblem) error {
	for _, in := range [...]struct {
		name string
		in   *core.MergeInput
	}{{"outs", &p.Outs}, {"lses", &p.LSEs}} {
		for _, ptr := range in.in.Ptrs[:in.in.NumPtrs] {
			if err := checkAddress("merge_states", in.name, ptr); err != nil {
				return err
			}
		}
	}
	if err := checkAddress("merge_states", "out", p.Out.Ptr); err != nil {
		return err
	}
	return checkAddress("merge_states", "lse", p.LSE.Ptr)
}

// mergeParams fills the merge kernels' argument struct from a valid problem.
func mergeParams(p *core.MergeProblem) C.fd_merge_params {
	var k C.fd_merge_params
	mergeInput(&k.outs, &p.Outs)
	mergeInput(&k.lses, &p.LSEs)
	k.out = C.fd_devptr(p.Out.Ptr)
	k.lse = C.fd_devptr(p.LSE.Ptr)
	for i := range core.MergeRowDims {
		k.out_strides[i] = C.longlong(p.Out.Strides[i])
		k.lse_strides[i] = C.longlong(p.LSE.Strides[i])
		k.rows[i] = C.int(p.Rows[i])
	}
	k.num_states = C.int(p.NumStates)
	k.head_dim = C.int(p.HeadDim)
	return k
}

func mergeInput(k *C.fd_merge_input, in *core.MergeInput) {
	for i, ptr := range in.Ptrs[:in.NumPtrs] {
		k.ptrs[i] = C.fd_devptr(ptr)
	}
	k.num_ptrs = C.int(in.NumPtrs)
	if in.NumPtrs == 1 { // stacked; with a pointer per state the stride stays 0
		k.state_stride = C.longlong(in.StateStride)
	}
	for i, st := range in.Strides {
		k.strides[i] = C.longlong(st)
	}
}
