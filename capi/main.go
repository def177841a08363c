// Command capi is the C ABI of flash-decode: built with
//
//	go build -buildmode=c-shared -o libflashdecode.so ./capi
//
// it exports the functions declared in capi/flashdecode.h (the public header;
// the libflashdecode.h Go writes beside the library is a build output). Each
// function converts the C structs into core values and calls core/cuda, so C,
// Go and Python callers share one planner and one launcher. No function
// panics or exits: errors become an fd_status code plus a per-thread message
// (fd_last_error, in lasterror.c).
package main

/*
#cgo CFLAGS: -std=c11
#include <stdlib.h>
#define FD_CGO_EXPORTS
#include "flashdecode.h"

void fd_set_last_error(const char *msg);
*/
import "C"

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"unsafe"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// version is fd_version's string, allocated once and never freed.
var version = C.CString(core.Version)

// shape converts the planner's part of a. C callers pass the same fd_args
// to the workspace query as to the decode, so whether cache_seqlens is
// given decides Shape.DeviceLengths for both.
func shape(a *C.fd_args) core.Shape {
	return core.Shape{
		DType:         core.DType(a.dtype),
		Batch:         int(a.batch),
		SeqlenQ:       int(a.seqlen_q),
		HeadsQ:        int(a.heads_q),
		HeadsKV:       int(a.heads_kv),
		HeadDim:       int(a.head_dim),
		SeqlenCache:   int(a.seqlen_cache),
		Seqlen:        int(a.seqlen),
		NumSplits:     int(a.num_splits),
		DeviceLengths: a.cache_seqlens != 0,
	}
}

func tensor(t C.fd_tensor) core.Tensor {
	return core.Tensor{Ptr: uintptr(t.ptr), BatchStride: int64(t.batch_stride),
		SeqStride: int64(t.seq_stride), HeadStride: int64(t.head_stride)}
}

// problem converts a whole fd_args and, when not NULL, an fd_serving.
func problem(a *C.fd_args, sv *C.fd_serving) core.Problem {
	p := core.Problem{
		Shape:        shape(a),
		Q:            tensor(a.q),
		K:            tensor(a.k),
		V:            tensor(a.v),
		Out:          tensor(a.out),
		LSE:          uintptr(a.lse),
		CacheSeqlens: uintptr(a.cache_seqlens),
		Scale:        float32(a.scale),
		Causal:       a.causal != 0,
	}
	if sv != nil {
		serving(&p, sv)
	}
	return p
}

// serving sets p's serving features from sv: a feature of Go's with a flag
// (leftpad, ALiBi) is on in C when its array is given.
func serving(p *core.Problem, sv *C.fd_serving) {
	p.BlockTable, p.BlockTableStride = uintptr(sv.block_table), int64(sv.block_table_stride)
	p.PageSize, p.NumPages, p.MaxPages = int(sv.page_size), int(sv.num_pages), int(sv.max_pages)
	p.CacheBatch, p.CacheBatchIdx = int(sv.cache_batch), uintptr(sv.cache_batch_idx)
	p.Leftpad, p.CacheLeftpad = sv.cache_leftpad != 0, uintptr(sv.cache_leftpad)
	p.Window = core.Window{Enabled: sv.window != 0, Left: int(sv.window_left), Right: int(sv.window_right)}
	p.Softcap = float32(sv.softcap)
	p.Alibi, p.AlibiSlopes, p.AlibiBatchStride = sv.alibi_slopes != 0, uintptr(sv.alibi_slopes), int64(sv.alibi_batch_stride)
	p.New = core.Append{K: tensor(sv.k_new), V: tensor(sv.v_new), Seqlen: int(sv.seqlen_new)}
	p.Rotary = core.Rotary{Cos: uintptr(sv.rotary_cos), Sin: uintptr(sv.rotary_sin), Stride: int64(sv.rotary_stride),
		Dim: int(sv.rotary_dim), Rows: int(sv.rotary_rows), Interleaved: sv.rotary_interleaved != 0}
}

// cArgs maps the argument names core's errors use (PyTorch's, see
// core.Error) to the fd_args and fd_serving fields a C caller sets: the
// caches are fd_args.k and v, the new tokens fd_serving.k_new and v_new.
var cArgs = map[string]string{
	"k_cache": "k", "v_cache": "v", "k": "k_new", "v": "v_new",
	"nheads_q": "heads_q", "nheads_kv": "heads_kv", "headdim": "head_dim",
	"softmax_scale": "scale", "window_size": "window",
}

// forC renames the argument of a decode or plan error for a C caller of
// args (see cArgs); without a cache_seqlens array the lengths are
// fd_args.seqlen.
func forC(err error, args *C.fd_args) error {
	e, ok := err.(*core.Error)
	if !ok {
		return err
	}
	name, ok := cArgs[e.Arg]
	if e.Arg == "cache_seqlens" && args.cache_seqlens == 0 {
		name, ok = "seqlen", true
	}
	if !ok {
		return err
	}
	c := *e
	c.Arg = name
	return &c
}

// errNilArgs reports a NULL fd_args pointer.
func errNilArgs(op string) error {
	return &core.Error{Op: op, Arg: "args", Msg: "NULL", Err: core.ErrInvalid}
}

// finish records err as the thread's last error and returns its fd_status.
func finish(err error) C.int {
	if err == nil {
		C.fd_set_last_error(nil)
		return C.FD_OK
	}
	msg := C.CString(err.Error())
	C.fd_set_last_error(msg)
	C.free(unsafe.Pointer(msg))
	return status(err)
}

// status maps an error to its fd_status.
func status(err error) C.int {
	var buf *bufferError
	switch {
	case errors.Is(err, core.ErrInvalid):
		return C.FD_ERR_INVALID
	case errors.Is(err, core.ErrUnsupported):
		return C.FD_ERR_UNSUPPORTED
	case errors.As(err, &buf):
		return C.FD_ERR_BUFFER
	case errors.As(err, new(*internalError)):
		return C.FD_ERR_INTERNAL
	}
	return C.FD_ERR_CUDA
}

type bufferError struct{ need, have int }

func (e *bufferError) Error() string {
	return fmt.Sprintf("flashdecode: plan_json: buf: needs %d bytes, got %d", e.need, e.have)
}

type internalError struct{ v any }

func (e *internalError) Error() string {
	return fmt.Sprintf("flashdecode: internal error (please report): %v", e.v)
}

// sizeArg converts a size_t capacity for the Go core, which counts bytes
// in an int: a capacity past math.MaxInt (SIZE_MAX for "large enough")
// is more than any call needs, not a negative count.
func sizeArg(n C.size_t) int {
	return int(min(uint64(n), math.MaxInt))
}

// guard turns a panic into an FD_ERR_INTERNAL result: nothing crosses into C.
func guard(ret *C.int) {
	if v := recover(); v != nil {
		*ret = finish(&internalError{v})
	}
}

//export fd_decode
func fd_decode(args *C.fd_args, workspace unsafe.Pointer, workspaceBytes C.size_t, stream unsafe.Pointer) (ret C.int) {
	defer guard(&ret)
	return decode(args, nil, workspace, workspaceBytes, stream)
}

//export fd_decode_serving
func fd_decode_serving(args *C.fd_args, sv *C.fd_serving, workspace unsafe.Pointer, workspaceBytes C.size_t, stream unsafe.Pointer) (ret C.int) {
	defer guard(&ret)
	return decode(args, sv, workspace, workspaceBytes, stream)
}

// decode is fd_decode and fd_decode_serving.
func decode(args *C.fd_args, sv *C.fd_serving, workspace unsafe.Pointer, workspaceBytes C.size_t, stream unsafe.Pointer) C.int {
	if args == nil {
		return finish(errNilArgs("decode"))
	}
	p := problem(args, sv)
	_, err := cuda.Decode(&p, uintptr(workspace), sizeArg(workspaceBytes), int(args.device), uintptr(stream))
	return finish(forC(err, args))
}

// plan returns the plan for args' shapes (and sv's serving features, when
// not NULL) on args.device; an error names fields as C knows them.
func plan(op string, args *C.fd_args, sv *C.fd_serving) (core.Plan, error) {
	if args == nil {
		return core.Plan{}, errNilArgs(op)
	}
	pl, err := planFor(args, sv)
	return pl, forC(err, args)
}

// planFor is plan's work.
func planFor(args *C.fd_args, sv *C.fd_serving) (core.Plan, error) {
	s := shape(args)
	if sv != nil {
		// What fd_decode_serving would refuse whatever the tensors: the
		// serving features' sizes and options, and an append's start.
		p := problem(args, sv)
		if err := p.ValidateSizes(); err != nil {
			return core.Plan{}, err
		}
		s = p.PlanShape()
	}
	return cuda.PlanFor(s, int(args.device))
}

//export fd_workspace_size
func fd_workspace_size(args *C.fd_args, bytes *C.size_t) (ret C.int) {
	defer guard(&ret)
	return workspaceSize(args, nil, bytes)
}

//export fd_workspace_size_serving
func fd_workspace_size_serving(args *C.fd_args, sv *C.fd_serving, bytes *C.size_t) (ret C.int) {
	defer guard(&ret)
	return workspaceSize(args, sv, bytes)
}

// workspaceSize is fd_workspace_size and fd_workspace_size_serving.
func workspaceSize(args *C.fd_args, sv *C.fd_serving, bytes *C.size_t) C.int {
	if bytes == nil {
		return finish(&core.Error{Op: "workspace_size", Arg: "bytes", Msg: "NULL", Err: core.ErrInvalid})
	}
	pl, err := plan("workspace_size", args, sv)
	if err == nil {
		*bytes = C.size_t(pl.WorkspaceBytes)
	}
	return finish(err)
}

//export fd_plan
func fd_plan(args *C.fd_args, out *C.fd_plan_info) (ret C.int) {
	defer guard(&ret)
	return planInfo(args, nil, out)
}

//export fd_plan_serving
func fd_plan_serving(args *C.fd_args, sv *C.fd_serving, out *C.fd_plan_info) (ret C.int) {
	defer guard(&ret)
	return planInfo(args, sv, out)
}

// planInfo is fd_plan and fd_plan_serving.
func planInfo(args *C.fd_args, sv *C.fd_serving, out *C.fd_plan_info) C.int {
	if out == nil {
		return finish(&core.Error{Op: "plan", Arg: "plan", Msg: "NULL", Err: core.ErrInvalid})
	}
	pl, err := plan("plan", args, sv)
	if err != nil {
		return finish(err)
	}
	*out = C.fd_plan_info{}
	copyName(out.kernel[:], pl.Variant.Kernel)
	copyName(out.combine[:], pl.Combine)
	out.num_splits = C.int32_t(pl.NumSplits)
	out.row_tiles = C.int32_t(pl.RowTiles)
	for i, g := range pl.Grid {
		out.grid[i] = C.int32_t(g)
	}
	out.threads = C.int32_t(pl.Threads)
	out.shared_bytes = C.int32_t(pl.SharedBytes)
	out.cluster = C.int32_t(pl.Cluster)
	out.combine_grid = C.int32_t(pl.CombineGrid)
	out.combine_threads = C.int32_t(pl.CombineThreads)
	out.sms = C.int32_t(pl.SMs)
	out.blocks_per_sm = C.int32_t(pl.BlocksPerSM)
	out.lse_partial_offset = C.int64_t(pl.LSEPartialOffset)
	out.workspace_bytes = C.int64_t(pl.WorkspaceBytes)
	return finish(nil)
}

// copyName copies s into the fixed-size C array dst, NUL-terminated (truncated if long).
func copyName(dst []C.char, s string) {
	n := min(len(s), len(dst)-1)
	for i := 0; i < n; i++ {
		dst[i] = C.char(s[i])
	}
	dst[n] = 0
}

//export fd_plan_json
func fd_plan_json(args *C.fd_args, buf *C.char, bufSize C.size_t, needed *C.size_t) (ret C.int) {
	defer guard(&ret)
	return planJSON(args, nil, buf, bufSize, needed)
}

//export fd_plan_json_serving
func fd_plan_json_serving(args *C.fd_args, sv *C.fd_serving, buf *C.char, bufSize C.size_t, needed *C.size_t) (ret C.int) {
	defer guard(&ret)
	return planJSON(args, sv, buf, bufSize, needed)
}

// planJSON is fd_plan_json and fd_plan_json_serving. A NULL buf with
// buf_size 0 asks for the size only.
func planJSON(args *C.fd_args, sv *C.fd_serving, buf *C.char, bufSize C.size_t, needed *C.size_t) C.int {
	if buf == nil && bufSize != 0 {
		return finish(&core.Error{Op: "plan_json", Arg: "buf", Msg: fmt.Sprintf("NULL with buf_size %d", uint64(bufSize)), Err: core.ErrInvalid})
	}
	pl, err := plan("plan_json", args, sv)
	if err != nil {
		return finish(err)
	}
	js, err := json.Marshal(pl)
	if err != nil {
		return finish(&internalError{err})
	}
	if needed != nil {
		*needed = C.size_t(len(js) + 1)
	}
	if sizeArg(bufSize) < len(js)+1 {
		return finish(&bufferError{need: len(js) + 1, have: sizeArg(bufSize)})
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), len(js)+1)
	copy(dst, js)
	dst[len(js)] = 0
	return finish(nil)
}

//export fd_version
func fd_version() *C.char { return version }

func main() {}
