// Package binding is the flat-function surface that gopy wraps into the
// Python extension flash_decode._binding. Arguments are plain ints, floats
// and device addresses (uintptr) so a call from Python costs well under a
// microsecond; the torch layer in python/flash_decode does the argument
// checks users see. Every function returns (T, error): gopy leaks a C string
// per call for functions that return only an error.
package binding

import (
	"encoding/json"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// Decode runs flash decoding (see core.Problem for the meaning of each
// argument; strides count elements) on GPU device, on the CUstream handle
// stream, and returns the number of splits it used. dtype is 1 for float16
// and 2 for bfloat16; seqlen < 0 means the whole cache (or the per-sequence
// lengths at seqlens when that is not 0).
func Decode(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, seqlen int,
	q uintptr, qB, qS, qH int64, k uintptr, kB, kS, kH int64, v uintptr, vB, vS, vH int64,
	out uintptr, oB, oS, oH int64, lse, seqlens, workspace uintptr, workspaceBytes int,
	scale float64, causal bool, numSplits, device int, stream uintptr) (int, error) {
	p := core.Problem{
		Shape:        shape(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, seqlen, numSplits),
		Q:            core.Tensor{Ptr: q, BatchStride: qB, SeqStride: qS, HeadStride: qH},
		K:            core.Tensor{Ptr: k, BatchStride: kB, SeqStride: kS, HeadStride: kH},
		V:            core.Tensor{Ptr: v, BatchStride: vB, SeqStride: vS, HeadStride: vH},
		Out:          core.Tensor{Ptr: out, BatchStride: oB, SeqStride: oS, HeadStride: oH},
		LSE:          lse,
		CacheSeqlens: seqlens,
		Scale:        float32(scale),
		Causal:       causal,
	}
	pl, err := cuda.Decode(&p, workspace, workspaceBytes, device, stream)
	if err != nil {
		return 0, err
	}
	return pl.NumSplits, nil
}

// Plan returns, as JSON, the plan Decode would run for these shapes on GPU
// device (device < 0: an H200, without touching a GPU): kernel variant,
// num_splits, grids and workspace bytes.
func Plan(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, seqlen, numSplits, device int) (string, error) {
	pl, err := cuda.PlanFor(shape(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, seqlen, numSplits), device)
	if err != nil {
		return "", err
	}
	b, err := json.Marshal(pl)
	return string(b), err
}

// Version returns the flash-decode version.
func Version() (string, error) { return core.Version, nil }

func shape(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, seqlen, numSplits int) core.Shape {
	return core.Shape{DType: core.DType(dtype), Batch: batch, SeqlenQ: seqlenQ, HeadsQ: headsQ,
		HeadsKV: headsKV, HeadDim: headDim, SeqlenCache: seqlenCache, Seqlen: seqlen, NumSplits: numSplits}
}
