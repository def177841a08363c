// Package binding is the flat-function surface that gopy wraps into the
// Python extension flash_decode._binding: a mirror of the native API
// (core/cuda's Prepare, Workspace, Run, Plan over a core.Layout, or a
// call's tensors, core.Tensors, checked into one) whose
// arguments are plain ints and addresses, so that a call from Python costs
// well under a microsecond. The core validates every value and names the
// argument at fault; the torch layer turns tensors into numbers and raises
// what the core says. Every function returns an int (or a string) and
// never raises: a failure is a negative error id, whose kind (capi's
// fd_status numbers, cuda.Kind) and text ErrorKind and ErrorMessage tell.
// Every function also turns a Go panic into such an error (recoverError):
// a panic that reached gopy's C wrapper would end the Python process.
package binding

import (
	"fmt"
	"runtime/debug"
	"sync"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// LayoutFields returns the layout's fields in order as "name:q,name:d,...",
// q an int64 and d a float64 (Python struct's codes); an array's elements
// are name[0], name[1], ... Python packs the record Prepare reads from it.
func LayoutFields() (fields string) {
	defer recoverText(&fields)
	return core.LayoutFieldsText()
}

// Version returns the flash-decode version.
func Version() (version string) {
	defer recoverText(&version)
	return core.Version
}

// ErrorKind returns the kind of error id (cuda.Kind: 1 invalid, 2
// unsupported, 8 a wrong type, others a runtime failure); an id no longer
// kept is KindInternal.
func ErrorKind(id int) (kind int) {
	defer recoverError(&kind)
	k, _ := recent.get(id)
	return int(k)
}

// ErrorMessage returns the text of error id.
func ErrorMessage(id int) (msg string) {
	defer recoverText(&msg)
	_, m := recent.get(id)
	return m
}

// errorRing is the most recent errors, by id: a bounded ring, so that a
// caller that never asks leaks nothing.
type errorRing struct {
	mu    sync.Mutex
	last  int // the last id handed out, as a positive count
	kinds [errorSlots]cuda.Kind
	msgs  [errorSlots]string
	ids   [errorSlots]int
}

// errorSlots is how many recent errors are kept: a caller asks about its
// error right after the call that failed.
const errorSlots = 1024

var recent errorRing

// put keeps err and returns its id, negative.
func (r *errorRing) put(err error) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.last++
	if r.last < 0 { // wrapped: start over
		r.last = 1
	}
	i := r.last % errorSlots
	r.ids[i], r.kinds[i], r.msgs[i] = r.last, cuda.KindOf(err), err.Error()
	return -r.last
}

// get returns the kind and text of error id.
func (r *errorRing) get(id int) (cuda.Kind, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if id < 0 {
		if i := -id % errorSlots; r.ids[i] == -id {
			return r.kinds[i], r.msgs[i]
		}
	}
	return cuda.KindInternal, fmt.Sprintf("flashdecode: error id %d is not one of the last %d errors", id, errorSlots)
}

// fail keeps err and returns its id.
func fail(err error) int { return recent.put(err) }

// recoverError, deferred by every exported function with an int result,
// turns a panic in it into an error id, with the stack for a bug report.
func recoverError(ret *int) {
	if r := recover(); r != nil {
		*ret = fail(fmt.Errorf("flashdecode: %w: panic: %v\n%s", cuda.ErrInternal, r, debug.Stack()))
	}
}

// recoverText is recoverError for a function with a string result, which
// a panic leaves "".
func recoverText(ret *string) {
	if r := recover(); r != nil {
		*ret = ""
	}
}
