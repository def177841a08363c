package cuda

import (
	"fmt"
	"runtime"

	"gorgonia.org/cu"
)

// current makes ctx current on the calling goroutine's OS thread and returns
// the function that undoes it: it puts back whatever context the thread had
// (PyTorch's, another device's, or none) and unlocks the thread. A context
// is current per OS thread, so the goroutine stays on one thread in
// between. When ctx is already current (the common case: the caller works
// on the same device's primary context) it costs one driver call.
//
//	restore, err := current(d.ctx, d.ordinal)
//	if err != nil { return err }
//	defer restore()
func current(ctx cu.CUContext, ordinal int) (restore func(), err error) {
	runtime.LockOSThread()
	prev, err := cu.CurrentContext()
	if err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("flashdecode: device %d: %w", ordinal, err)
	}
	if prev == ctx {
		return runtime.UnlockOSThread, nil
	}
	if err := cu.SetCurrentContext(ctx); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("flashdecode: device %d: %w", ordinal, err)
	}
	return func() {
		cu.SetCurrentContext(prev) // the caller's own context: it was current a moment ago
		runtime.UnlockOSThread()
	}, nil
}
