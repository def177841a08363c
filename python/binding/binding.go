// Package binding is the flat-function surface that gopy wraps into the
// Python extension flash_decode._binding. Arguments are plain ints, floats
// and device addresses (uintptr) so a call from Python costs well under a
// microsecond. The core validates every value and names the argument at
// fault (core.Error); the torch layer in python/flash_decode checks only
// what never reaches Go (Python types, ranks, that the tensors agree in
// shape, devices). Every function returns (T, error): gopy leaks a C string
// per call for functions that return only an error. Every function also
// turns a Go panic into its error (recoverError): a panic that reached
// gopy's C wrapper would end the Python process.
package binding

import (
	"encoding/json"
	"fmt"
	"runtime/debug"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// Plan returns, as JSON, the plan Run would launch for these shapes on GPU
// device (device < 0: an H200, without touching a GPU): kernel variant,
// num_splits, grids and workspace bytes. dtype is 1 for float16 and 2 for
// bfloat16; seqlen < 0 plans for the whole cache. deviceLengths: the calls
// pass a cache_seqlens tensor (core.Shape.DeviceLengths).
func Plan(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, seqlen, numSplits, device int, deviceLengths bool) (plan string, err error) {
	defer recoverError(&err)
	s := shape(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, seqlen, numSplits)
	s.DeviceLengths = deviceLengths
	return planJSON(s, device)
}

// PlanServing is Plan for a call that runs the serving kernels
// (fd_split_kv_serving_*, which any of a paged cache, cache_batch_idx,
// cache_leftpad, a window, softcap, ALiBi or an append selects): with
// seqlenNew tokens appended, the window (windowLeft, windowRight; -1 is an
// unbounded side, both -1 no window), with rotary (q and the new keys
// rotated), and pageSize > 0 a paged cache of pages of that many keys,
// which runs the paged form (fd_split_kv_paged_*) when a multiple of 8 and
// no window is given (core.Problem.PagedForm; the call must then have no
// cache_batch_idx, cache_leftpad, softcap or ALiBi either). A few new tokens
// run an appending form (paged, or, without pages or a window, the
// contiguous cache's: core.Problem.ContiguousForm), which plans as if those
// other features were off too; otherwise they do not change the plan.
func PlanServing(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, seqlen, numSplits, seqlenNew,
	windowLeft, windowRight int, rotary bool, pageSize, device int, deviceLengths bool) (plan string, err error) {
	defer recoverError(&err)
	p := core.Problem{Shape: shape(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, seqlen, numSplits),
		New: core.Append{Seqlen: seqlenNew}, Window: window(windowLeft, windowRight), PageSize: pageSize}
	p.DeviceLengths = deviceLengths
	s := p.PlanShape()
	s.Serving, s.RotaryQ = true, rotary
	return planJSON(s, device)
}

// planJSON is the plan of s on device, as JSON.
func planJSON(s core.Shape, device int) (string, error) {
	pl, err := cuda.PlanFor(s, device)
	if err != nil {
		return "", err
	}
	b, err := json.Marshal(pl)
	return string(b), err
}

// window is window_size (left, right) as a core.Window: disabled (the zero
// value) for (-1, -1).
func window(left, right int) core.Window {
	if left == -1 && right == -1 {
		return core.Window{}
	}
	return core.Window{Enabled: true, Left: left, Right: right}
}

// PlanKeyQuantum returns core.PlanKeyQuantum: int lengths whose keys, the
// appended ones included, round up to one multiple of it plan alike, so
// the torch layer sizes their workspace once.
func PlanKeyQuantum() (keys int, err error) {
	defer recoverError(&err)
	return core.PlanKeyQuantum, nil
}

// Version returns the flash-decode version.
func Version() (version string, err error) {
	defer recoverError(&err)
	return core.Version, nil
}

func shape(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, seqlen, numSplits int) core.Shape {
	return core.Shape{DType: core.DType(dtype), Batch: batch, SeqlenQ: seqlenQ, HeadsQ: headsQ,
		HeadsKV: headsKV, HeadDim: headDim, SeqlenCache: seqlenCache, Seqlen: seqlen, NumSplits: numSplits}
}

// recoverError, deferred by every exported function, turns a panic in it
// into its error result, with the stack for a bug report.
func recoverError(err *error) {
	if r := recover(); r != nil {
		*err = fmt.Errorf("flashdecode: internal error (please report): panic: %v\n%s", r, debug.Stack())
	}
}
