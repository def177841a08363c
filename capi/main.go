// Command capi is the C ABI of flash-decode: built with
//
//	go build -buildmode=c-shared -o libflashdecode.so ./capi
//
// it exports the functions declared in capi/flashdecode.h (the public header;
// the libflashdecode.h Go writes beside the library is a build output). The
// public functions are C (entry.c): each refuses a call in a forked child
// before it enters Go, then calls its fdgo_ function here, which reads the C
// structs as core values and calls core/cuda, so C, Go and Python callers
// share one converter (core.Layout), one planner and one launcher. No
// function panics or exits: errors become an fd_status code plus a
// per-thread message (fd_last_error, in lasterror.c).
package main

/*
#cgo CFLAGS: -std=c11
#include <stdlib.h>
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

// Static strings, allocated once and never freed.
var (
	version       = C.CString(core.Version)
	layoutFields  = C.CString(core.LayoutFieldsText())
	tensorsFields = C.CString(core.TensorsFieldsText())
)

// handles are the layouts fd_prepare holds.
var handles cuda.Handles

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
	if errors.As(err, new(*bufferError)) {
		return C.FD_ERR_BUFFER
	}
	return C.int(cuda.KindOf(err))
}

type bufferError struct{ need, have int }

func (e *bufferError) Error() string {
	return fmt.Sprintf("flashdecode: plan_json: buf: needs %d bytes, got %d", e.need, e.have)
}

// guard turns a panic into an FD_ERR_INTERNAL result: nothing crosses into C.
func guard(ret *C.int) {
	if v := recover(); v != nil {
		*ret = finish(fmt.Errorf("flashdecode: %w: %v", cuda.ErrInternal, v))
	}
}

// sizeArg converts a size_t capacity for the Go core, which counts bytes
// in an int: a capacity past math.MaxInt (SIZE_MAX for "large enough")
// is more than any call needs, not a negative count.
func sizeArg(n C.size_t) int {
	return int(min(uint64(n), math.MaxInt))
}

func errNull(op, arg string) error {
	return &core.Error{Op: op, Arg: arg, Msg: "NULL", Err: core.ErrInvalid}
}

// renamed returns err naming its argument as names says (core's names are
// PyTorch's, see core.Error), and cache_seqlens as seqlen where the call
// passed no such array (its length is then the seqlen argument's).
func renamed(err error, names map[string]string, lengthsArray bool) error {
	e, ok := err.(*core.Error)
	if !ok {
		return err
	}
	name, ok := names[e.Arg]
	if e.Arg == "cache_seqlens" && !lengthsArray {
		name, ok = "seqlen", true
	}
	if !ok {
		return err
	}
	c := *e
	c.Arg = name
	return &c
}

// layoutNames are the fd_layout and fd_ptrs fields of core's argument names.
var layoutNames = map[string]string{
	"nheads_q": "heads_q", "nheads_kv": "heads_kv", "headdim": "head_dim", "softmax_scale": "scale",
	"k": "k_new", "v": "v_new", "window_size": "window_left", "max_seqlen_k": "seqlen", "max_seqlen_q": "seqlen_q",
}

//export fdgo_prepare
func fdgo_prepare(layout *C.fd_layout, layoutSize C.size_t, device C.int, out *C.fd_handle) (ret C.int) {
	defer guard(&ret)
	const op = "prepare"
	switch {
	case layout == nil:
		return finish(errNull(op, "layout"))
	case out == nil:
		return finish(errNull(op, "out"))
	case layoutSize > 1<<20:
		return finish(&core.Error{Op: op, Arg: "layout_size", Err: core.ErrInvalid, Msg: fmt.Sprintf("%d bytes", uint64(layoutSize))})
	}
	l, err := core.ReadLayout(unsafe.Slice((*byte)(unsafe.Pointer(layout)), int(layoutSize)))
	if err != nil {
		return finish(err)
	}
	h, err := handles.Prepare(&l, int(device))
	if err != nil {
		return finish(renamed(err, layoutNames, true))
	}
	out.id = C.int64_t(h)
	return finish(nil)
}

// readTensors reads the caller's fd_tensors of size bytes.
func readTensors(t *C.fd_tensors, size C.size_t) (core.Tensors, error) {
	switch {
	case t == nil:
		return core.Tensors{}, errNull("prepare", "tensors")
	case size > 1<<20:
		return core.Tensors{}, &core.Error{Op: "prepare", Arg: "tensors_size", Err: core.ErrInvalid, Msg: fmt.Sprintf("%d bytes", uint64(size))}
	}
	return core.ReadTensors(unsafe.Slice((*byte)(unsafe.Pointer(t)), int(size)))
}

//export fdgo_prepare_tensors
func fdgo_prepare_tensors(t *C.fd_tensors, size C.size_t, out *C.fd_handle) (ret C.int) {
	defer guard(&ret)
	if out == nil {
		return finish(errNull("prepare", "out"))
	}
	ts, err := readTensors(t, size)
	if err != nil {
		return finish(err)
	}
	h, err := handles.PrepareTensors(&ts)
	if err != nil {
		return finish(err)
	}
	out.id = C.int64_t(h)
	return finish(nil)
}

//export fdgo_tensors_layout
func fdgo_tensors_layout(t *C.fd_tensors, size C.size_t, layout *C.fd_layout, layoutSize C.size_t) (ret C.int) {
	defer guard(&ret)
	if layout == nil {
		return finish(errNull("prepare", "layout"))
	}
	if int(layoutSize) != core.LayoutBytes {
		return finish(&core.Error{Op: "prepare", Arg: "layout_size", Err: core.ErrInvalid,
			Msg: fmt.Sprintf("%d bytes; fd_layout is %d in this build", uint64(layoutSize), core.LayoutBytes)})
	}
	ts, err := readTensors(t, size)
	if err != nil {
		return finish(err)
	}
	l, err := ts.Layout()
	if err != nil {
		return finish(err)
	}
	*(*core.Layout)(unsafe.Pointer(layout)) = l
	return finish(nil)
}

//export fdgo_release
func fdgo_release(h C.int64_t) (ret C.int) {
	defer guard(&ret)
	return finish(handles.Release(int64(h)))
}

// prepared returns the layout of handle h.
func prepared(h C.int64_t) (*cuda.Prepared, error) { return handles.Get(int64(h)) }

//export fdgo_workspace_size
func fdgo_workspace_size(h C.int64_t, seqlen C.int64_t, bytes *C.size_t) (ret C.int) {
	defer guard(&ret)
	if bytes == nil {
		return finish(errNull("workspace_size", "bytes"))
	}
	r, err := prepared(h)
	if err != nil {
		return finish(err)
	}
	n, err := r.Workspace(int(seqlen))
	if err != nil {
		return finish(renamed(err, layoutNames, false))
	}
	*bytes = C.size_t(n)
	return finish(nil)
}

//export fdgo_run
func fdgo_run(h C.int64_t, ptrs *C.fd_ptrs, ptrsSize C.size_t, seqlen C.int64_t, workspace C.uintptr_t,
	workspaceBytes C.size_t, stream C.uintptr_t) (ret C.int) {
	defer guard(&ret)
	if ptrs == nil {
		return finish(errNull("decode", "ptrs"))
	}
	r, err := prepared(h)
	if err != nil {
		return finish(err)
	}
	var p C.fd_ptrs
	if err := readPtrs(&p, ptrs, ptrsSize); err != nil {
		return finish(err)
	}
	a := cuda.Args{Q: uintptr(p.q), K: uintptr(p.k_cache), V: uintptr(p.v_cache), Out: uintptr(p.out), LSE: uintptr(p.lse),
		CacheSeqlens: uintptr(p.cache_seqlens), BlockTable: uintptr(p.block_table), CacheBatchIdx: uintptr(p.cache_batch_idx),
		CacheLeftpad: uintptr(p.cache_leftpad), AlibiSlopes: uintptr(p.alibi_slopes), KNew: uintptr(p.k_new),
		VNew: uintptr(p.v_new), RotaryCos: uintptr(p.rotary_cos), RotarySin: uintptr(p.rotary_sin),
		KDescale: uintptr(p.k_descale), VDescale: uintptr(p.v_descale), Sinks: uintptr(p.sinks),
		CuSeqlensQ: uintptr(p.cu_seqlens_q), Workspace: uintptr(workspace), WorkspaceBytes: sizeArg(workspaceBytes)}
	if _, err := r.Run(&a, int(seqlen), uintptr(stream)); err != nil {
		// cache_seqlens is the seqlen argument's only where the layout takes no array.
		return finish(renamed(err, layoutNames, p.cache_seqlens != 0 || r.Problem().DeviceLengths))
	}
	return finish(nil)
}

// readPtrs copies the caller's fd_ptrs of size bytes into p: a shorter one
// (an older header's) leaves the fields it lacks 0; a longer one's extra
// fields must be 0.
func readPtrs(p *C.fd_ptrs, ptrs *C.fd_ptrs, size C.size_t) error {
	const have = C.size_t(unsafe.Sizeof(C.fd_ptrs{}))
	if size%8 != 0 || size > 1<<20 {
		return &core.Error{Op: "decode", Arg: "ptrs_size", Err: core.ErrInvalid,
			Msg: fmt.Sprintf("%d bytes; fd_ptrs is whole 8-byte fields, %d bytes in this build", uint64(size), uint64(have))}
	}
	src := unsafe.Slice((*byte)(unsafe.Pointer(ptrs)), int(size))
	if size > have {
		for i, b := range src[have:] {
			if b != 0 {
				return &core.Error{Op: "decode", Arg: "ptrs_size", Err: core.ErrUnsupported,
					Msg: fmt.Sprintf("%d bytes, with byte %d set; this build knows the first %d", uint64(size), int(have)+i, uint64(have))}
			}
		}
	}
	copy(unsafe.Slice((*byte)(unsafe.Pointer(p)), int(have)), src)
	return nil
}

// planOf returns the plan of handle h at seqlen, its error named for C.
func planOf(h, seqlen C.int64_t) (core.Plan, error) {
	r, err := prepared(h)
	if err != nil {
		return core.Plan{}, err
	}
	pl, err := r.Plan(int(seqlen))
	return pl, renamed(err, layoutNames, false)
}

//export fdgo_plan
func fdgo_plan(h, seqlen C.int64_t, out *C.fd_plan_info) (ret C.int) {
	defer guard(&ret)
	if out == nil {
		return finish(errNull("plan", "plan"))
	}
	pl, err := planOf(h, seqlen)
	if err != nil {
		return finish(err)
	}
	planInfo(&pl, out)
	return finish(nil)
}

//export fdgo_plan_json
func fdgo_plan_json(h, seqlen C.int64_t, buf *C.char, bufSize C.size_t, needed *C.size_t) (ret C.int) {
	defer guard(&ret)
	pl, err := planOf(h, seqlen)
	return writeJSON(pl, err, buf, bufSize, needed)
}

// planInfo fills out from pl.
func planInfo(pl *core.Plan, out *C.fd_plan_info) {
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
}

// copyName copies s into the fixed-size C array dst, NUL-terminated (truncated if long).
func copyName(dst []C.char, s string) {
	n := min(len(s), len(dst)-1)
	for i := 0; i < n; i++ {
		dst[i] = C.char(s[i])
	}
	dst[n] = 0
}

// writeJSON writes pl (unless err) as JSON into buf, as fd_plan_json says.
// A NULL buf with buf_size 0 asks for the size only.
func writeJSON(pl core.Plan, err error, buf *C.char, bufSize C.size_t, needed *C.size_t) C.int {
	if buf == nil && bufSize != 0 {
		return finish(&core.Error{Op: "plan_json", Arg: "buf", Msg: fmt.Sprintf("NULL with buf_size %d", uint64(bufSize)), Err: core.ErrInvalid})
	}
	if err != nil {
		return finish(err)
	}
	js, err := json.Marshal(pl)
	if err != nil {
		return finish(fmt.Errorf("flashdecode: %w: %v", cuda.ErrInternal, err))
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

//export fdgo_version
func fdgo_version() *C.char { return version }

//export fdgo_layout_fields
func fdgo_layout_fields() *C.char { return layoutFields }

//export fdgo_tensors_fields
func fdgo_tensors_fields() *C.char { return tensorsFields }

func main() {}
