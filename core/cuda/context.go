package cuda

/*
#include <cuda.h>

// The calling thread's current context, returned by value: a cgo call
// given a pointer into Go memory makes it escape to the heap, once per
// call on the launch path.
typedef struct { CUcontext ctx; CUresult r; } fd_ctx;
static fd_ctx fd_current_context(void) {
	fd_ctx c = {NULL, CUDA_SUCCESS};
	c.r = cuCtxGetCurrent(&c.ctx);
	return c;
}
*/
import "C"

import (
	"fmt"
	"runtime"

	"gorgonia.org/cu"
)

// scope is what current changed on the calling thread, for undo.
type scope struct {
	prev    C.CUcontext
	changed bool
}

// undo puts back the context the thread had (PyTorch's, another device's,
// or none) and unlocks the thread. It fails only where the driver refuses
// the caller's own context, current a moment ago.
func (s scope) undo(ordinal int) error {
	defer runtime.UnlockOSThread()
	if s.changed {
		if r := C.cuCtxSetCurrent(s.prev); r != C.CUDA_SUCCESS {
			return fmt.Errorf("flashdecode: device %d: putting the caller's context back: %w", ordinal, check("cuCtxSetCurrent", r))
		}
	}
	return nil
}

// undoInto is undo for a deferred call: its error becomes *err unless
// that holds one already.
func (s scope) undoInto(err *error, ordinal int) {
	if e := s.undo(ordinal); e != nil && *err == nil {
		*err = e
	}
}

// current makes ctx current on the calling goroutine's OS thread until the
// returned scope's undo. A context is current per OS thread, so the
// goroutine stays on one thread in between. When ctx is already current
// (the common case: the caller works on the same device's primary context)
// it costs one driver call, and it allocates nothing.
//
//	s, err := current(d.raw, d.ordinal)
//	if err != nil { return err }
//	defer s.undoInto(&err, d.ordinal)
func current(ctx C.CUcontext, ordinal int) (scope, error) {
	runtime.LockOSThread()
	c := C.fd_current_context()
	if c.r != C.CUDA_SUCCESS {
		runtime.UnlockOSThread()
		return scope{}, fmt.Errorf("flashdecode: device %d: %w", ordinal, check("cuCtxGetCurrent", c.r))
	}
	if c.ctx == ctx {
		return scope{}, nil
	}
	if r := C.cuCtxSetCurrent(ctx); r != C.CUDA_SUCCESS {
		runtime.UnlockOSThread()
		return scope{}, fmt.Errorf("flashdecode: device %d: %w", ordinal, check("cuCtxSetCurrent", r))
	}
	return scope{prev: c.ctx, changed: true}, nil
}

// rawContext is ctx's driver handle (gorgonia.org/cu keeps it unexported):
// it makes ctx current for a moment and reads the handle back.
func rawContext(ctx cu.CUContext, ordinal int) (C.CUcontext, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	prev := C.fd_current_context()
	if prev.r != C.CUDA_SUCCESS {
		return nil, fmt.Errorf("flashdecode: device %d: %w", ordinal, check("cuCtxGetCurrent", prev.r))
	}
	if err := cu.SetCurrentContext(ctx); err != nil {
		return nil, fmt.Errorf("flashdecode: device %d: %w", ordinal, err)
	}
	c := C.fd_current_context()
	if r := C.cuCtxSetCurrent(prev.ctx); r != C.CUDA_SUCCESS {
		return nil, fmt.Errorf("flashdecode: device %d: putting the caller's context back: %w", ordinal, check("cuCtxSetCurrent", r))
	}
	if c.r != C.CUDA_SUCCESS {
		return nil, fmt.Errorf("flashdecode: device %d: %w", ordinal, check("cuCtxGetCurrent", c.r))
	}
	return c.ctx, nil
}
