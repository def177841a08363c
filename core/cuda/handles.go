package cuda

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/flash-decode/flash-decode/core"
)

// Handles is a table of prepared layouts by number, for the doors whose
// callers hold a number rather than a *Prepared (capi's fd_handle, the
// Python binding's int). The same layout and device get the same handle
// while it is held: each Prepare holds it once more, each Release once
// less, and the last Release frees its slot. Get, on every call, takes no
// lock. A handle is positive and never 0; a released handle is refused,
// not mistaken for a later layout in its slot. The zero value is ready.
type Handles struct {
	mu     sync.Mutex
	byKey  map[handleKey]int64
	held   map[int64]handleUse
	gens   []uint32 // generation of each slot used so far
	free   []int    // freed slots
	limit  int      // the most slots, if below maxHandles (tests)
	chunks [maxHandles / handleChunk]atomic.Pointer[[handleChunk]atomic.Pointer[handleSlot]]
}

type handleKey struct {
	l      core.Layout
	device int
}

type handleUse struct {
	key  handleKey
	refs int
}

type handleSlot struct {
	handle int64
	r      *Prepared
}

// maxHandles is the most layouts held at once; handleChunk slots are
// allocated together. A handle is generation<<handleBits | slot.
const (
	handleBits  = 16
	maxHandles  = 1 << handleBits
	handleChunk = 1024
)

// ErrLimit is wrapped by the error of a Prepare past maxHandles held
// layouts: a limit of the library, not a wrong argument.
var ErrLimit = errors.New("limit reached")

// Prepare returns the handle of layout l on device (see the package
// function Prepare), holding it once more.
func (t *Handles) Prepare(l *core.Layout, device int) (int64, error) {
	r, err := Prepare(l, device)
	if err != nil {
		return 0, err
	}
	// Layouts that differ only where it makes no difference (the stride of
	// a size-1 dimension, say) are one layout.
	key := handleKey{core.LayoutOf(&r.p), r.device}
	t.mu.Lock()
	defer t.mu.Unlock()
	if h, ok := t.byKey[key]; ok {
		u := t.held[h]
		u.refs++
		t.held[h] = u
		return h, nil
	}
	var slot int
	switch {
	case len(t.free) > 0:
		slot = t.free[len(t.free)-1]
		t.free = t.free[:len(t.free)-1]
	case len(t.gens) < maxHandles && (t.limit == 0 || len(t.gens) < t.limit):
		slot = len(t.gens)
		t.gens = append(t.gens, 0)
	default:
		return 0, &core.Error{Op: "prepare", Err: ErrLimit,
			Msg: fmt.Sprintf("%d layouts are held (one per distinct layout and device), the most one process holds; release some", len(t.gens))}
	}
	t.gens[slot]++
	h := int64(t.gens[slot])<<handleBits | int64(slot)
	chunk := t.chunks[slot/handleChunk].Load()
	if chunk == nil {
		chunk = new([handleChunk]atomic.Pointer[handleSlot])
		t.chunks[slot/handleChunk].Store(chunk)
	}
	chunk[slot%handleChunk].Store(&handleSlot{handle: h, r: r})
	if t.byKey == nil {
		t.byKey, t.held = map[handleKey]int64{}, map[int64]handleUse{}
	}
	t.byKey[key] = h
	t.held[h] = handleUse{key: key, refs: 1}
	return h, nil
}

// PrepareTensors checks a call's tensors (core.Tensors.Layout) and
// returns the handle of its layout on q's device, as Prepare does.
func (t *Handles) PrepareTensors(ts *core.Tensors) (int64, error) {
	l, device, err := ts.DeviceLayout()
	if err != nil {
		return 0, err
	}
	return t.Prepare(&l, device)
}

// Get returns the layout of a held handle.
func (t *Handles) Get(h int64) (*Prepared, error) {
	slot := h & (maxHandles - 1)
	if h > 0 {
		if chunk := t.chunks[slot/handleChunk].Load(); chunk != nil {
			if s := chunk[slot%handleChunk].Load(); s != nil && s.handle == h {
				return s.r, nil
			}
		}
	}
	return nil, &core.Error{Op: "decode", Arg: "handle", Err: core.ErrInvalid,
		Msg: fmt.Sprintf("%d is not held: not returned by prepare, or released", h)}
}

// Release holds h once less, freeing it after its last Prepare.
func (t *Handles) Release(h int64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	u, ok := t.held[h]
	if !ok {
		return &core.Error{Op: "release", Arg: "handle", Err: core.ErrInvalid,
			Msg: fmt.Sprintf("%d is not held: not returned by prepare, or released", h)}
	}
	if u.refs--; u.refs > 0 {
		t.held[h] = u
		return nil
	}
	delete(t.held, h)
	delete(t.byKey, u.key)
	slot := int(h & (maxHandles - 1))
	t.chunks[slot/handleChunk].Load()[slot%handleChunk].Store(nil)
	t.free = append(t.free, slot)
	return nil
}
