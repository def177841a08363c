package cuda

// #include "params.h"
import "C"

import (
	"fmt"
	"sync/atomic"

	"github.com/flash-decode/flash-decode/core"
)

// Prepared is a decode layout validated once by Prepare, so that each call
// of a serving loop, which decodes the same layout every step on new
// tensors, only checks the new device addresses and launches: the native
// API both doors (capi, the Python binding) open onto. It is immutable but
// for its cache of ready plans, and safe for concurrent use.
type Prepared struct {
	p      core.Problem // the layout; device addresses and Seqlen come with each Run
	shape  core.Shape   // p.PlanShape(), the Seqlen of a call set on it
	device int          // a GPU ordinal, or -1: planned for core.H200, no Run
	// readies are the plans the last calls met, by the Seqlen of their plan
	// key (core.Shape.PlanKey: the whole cache, a sizing hint, or a block of
	// 32 int lengths), ready for the next call at one of them; a miss
	// replaces them in turn (next).
	readies [readySlots]atomic.Pointer[ready]
	next    atomic.Uint32
}

// readySlots is how many plan keys a Prepared keeps ready: a layout run at
// a few sizing hints in turn (max_seqlen_k buckets of interleaved batches,
// say) plans and allocates only the first time at each.
const readySlots = 4

// ready is a Prepared layout's plan at one plan key, ready to launch: its
// device (nil when planned without one), plan and kernels, and the
// kernels' parameters but the device addresses and the length, which are
// all that change between such calls.
type ready struct {
	seqlen int // the plan key's
	d      *device
	pd     planned
	layout C.fd_params
}

// Prepare validates layout l (core.Layout.Problem: everything but the
// device addresses and the length of a call) for GPU device and returns it
// ready for Run. It does not touch the GPU: the device is opened by the
// first Workspace, Plan or Run. A negative device prepares for the
// planner's default device (core.H200) without a GPU: Workspace and Plan
// work, Run is refused.
func Prepare(l *core.Layout, device int) (*Prepared, error) {
	if l == nil {
		return nil, &core.Error{Op: "prepare", Arg: "layout", Msg: "nil", Err: core.ErrInvalid}
	}
	if device >= maxDevices {
		return nil, &core.Error{Op: "prepare", Arg: "device", Msg: fmt.Sprintf("no CUDA device %d", device), Err: core.ErrInvalid}
	}
	p, err := l.Problem()
	if err != nil {
		return nil, err
	}
	return &Prepared{p: p, shape: p.PlanShape(), device: max(device, -1)}, nil
}

// Problem returns the prepared layout, with zero device addresses.
func (r *Prepared) Problem() core.Problem { return r.p }

// Device returns the GPU ordinal r runs on, or -1 when r plans without one.
func (r *Prepared) Device() int { return r.device }

// Args are the per-call device addresses of a Prepared decode (see
// core.Problem for each; LSE may be 0, CacheSeqlens is given exactly when
// the layout has device lengths, or, without them, in place of a length)
// and its workspace.
type Args struct {
	Q, K, V, Out, LSE, CacheSeqlens uintptr
	// The serving features' arrays, given exactly for the features the
	// prepared layout has: BlockTable (paged), CacheBatchIdx, CacheLeftpad,
	// AlibiSlopes, KNew and VNew (Problem.New's K and V), RotaryCos and
	// RotarySin (Problem.Rotary's tables).
	BlockTable, CacheBatchIdx, CacheLeftpad, AlibiSlopes uintptr
	KNew, VNew, RotaryCos, RotarySin                     uintptr
	// KDescale and VDescale (an fp8 layout with descale arrays) and Sinks
	// (a layout with sinks).
	KDescale, VDescale, Sinks uintptr
	// CuSeqlensQ, given exactly for a layout of ragged query lengths.
	CuSeqlensQ     uintptr
	Workspace      uintptr
	WorkspaceBytes int
}

// Workspace returns the bytes of workspace Run needs when called with this
// seqlen (see core.Problem.CallSeqlen). Like Plan, it opens the device on
// first use.
func (r *Prepared) Workspace(seqlen int) (int, error) {
	w, err := r.planAt(seqlen)
	if err != nil {
		return 0, err
	}
	return w.pd.plan.WorkspaceBytes, nil
}

// Plan returns the plan Run launches when called with this seqlen.
func (r *Prepared) Plan(seqlen int) (core.Plan, error) {
	w, err := r.planAt(seqlen)
	if err != nil {
		return core.Plan{}, err
	}
	return w.pd.plan, nil
}

// Run launches the prepared decode on a's tensors with this seqlen (see
// core.Problem.CallSeqlen) on stream (a CUstream handle) and returns the
// plan it ran. Like Decode, it never synchronizes, allocates no device
// memory, and the workspace needs Workspace(seqlen) bytes.
func (r *Prepared) Run(a *Args, seqlen int, stream uintptr) (core.Plan, error) {
	if r.device < 0 {
		return core.Plan{}, &core.Error{Op: "decode", Arg: "device", Err: core.ErrInvalid,
			Msg: "the layout was prepared without a GPU (device -1): it plans, but runs only when prepared for a device"}
	}
	p := r.p
	setArgs(&p, a)
	var err error
	if p.Seqlen, err = p.CallSeqlen(seqlen); err != nil {
		return core.Plan{}, err
	}
	if err := checkCall(&p, a.Workspace); err != nil {
		return core.Plan{}, err
	}
	w, err := r.at(p.Seqlen)
	if err != nil {
		return core.Plan{}, err
	}
	pl := &w.pd.plan
	if err := checkWorkspace(&p, pl, a.Workspace, a.WorkspaceBytes); err != nil {
		return core.Plan{}, err
	}
	k := w.layout
	setCall(&k, &p, pl, a.Workspace)
	if err := w.d.launch(&k, &w.pd, stream); err != nil {
		return core.Plan{}, err
	}
	return *pl, nil
}

// DecodeLayout is Prepare and Run in one call that keeps nothing (the
// plan comes from the device's cache): for one-shot callers of a layout.
func DecodeLayout(l *core.Layout, device int, a *Args, seqlen int, stream uintptr) (core.Plan, error) {
	if l == nil {
		return core.Plan{}, &core.Error{Op: "decode", Arg: "layout", Msg: "nil", Err: core.ErrInvalid}
	}
	p, err := l.Problem()
	if err != nil {
		return core.Plan{}, err
	}
	setArgs(&p, a)
	if p.Seqlen, err = p.CallSeqlen(seqlen); err != nil {
		return core.Plan{}, err
	}
	if err := checkCall(&p, a.Workspace); err != nil {
		return core.Plan{}, err
	}
	return run(&p, a.Workspace, a.WorkspaceBytes, device, stream)
}

// setArgs sets a call's device addresses on p.
func setArgs(p *core.Problem, a *Args) {
	p.Q.Ptr, p.K.Ptr, p.V.Ptr, p.Out.Ptr, p.LSE, p.CacheSeqlens = a.Q, a.K, a.V, a.Out, a.LSE, a.CacheSeqlens
	p.BlockTable, p.CacheBatchIdx, p.CacheLeftpad, p.AlibiSlopes = a.BlockTable, a.CacheBatchIdx, a.CacheLeftpad, a.AlibiSlopes
	p.New.K.Ptr, p.New.V.Ptr, p.Rotary.Cos, p.Rotary.Sin = a.KNew, a.VNew, a.RotaryCos, a.RotarySin
	p.KDescale.Ptr, p.VDescale.Ptr, p.Sinks = a.KDescale, a.VDescale, a.Sinks
	p.CuSeqlensQ = a.CuSeqlensQ
}

// checkCall checks the device addresses of a call of a valid layout p and
// its workspace's: a device lengths layout is called with its array, no
// address is below minAddress, and the core's checks
// (core.Problem.CheckPointers).
func checkCall(p *core.Problem, workspace uintptr) error {
	if p.DeviceLengths && p.CacheSeqlens == 0 {
		return &core.Error{Op: "decode", Arg: "cache_seqlens", Err: core.ErrInvalid,
			Msg: "null device pointer; the layout has device lengths (device_lengths=1)"}
	}
	if err := checkAddresses(p, workspace); err != nil {
		return err
	}
	return p.CheckPointers()
}

// planAt is at for a call with this seqlen whose arrays are not known.
func (r *Prepared) planAt(seqlen int) (*ready, error) {
	s, err := r.p.CallSeqlen(seqlen)
	if err != nil {
		return nil, err
	}
	return r.at(s)
}

// at returns r's ready plan for a call whose Shape.Seqlen is s, planning
// it on a miss.
func (r *Prepared) at(s int) (*ready, error) {
	key := r.shape
	key.Seqlen = s
	key = key.PlanKey()
	for i := range r.readies {
		if w := r.readies[i].Load(); w != nil && w.seqlen == key.Seqlen {
			return w, nil
		}
	}
	w, err := r.ready(key)
	if err != nil {
		return nil, err
	}
	r.readies[r.next.Add(1)%readySlots].Store(w)
	return w, nil
}

// ready plans r's layout at key, a plan key's shape, and fills the
// kernels' parameters but the addresses and the length.
func (r *Prepared) ready(key core.Shape) (*ready, error) {
	p := r.p
	p.Seqlen = key.Seqlen
	if r.device < 0 {
		pl, err := core.MakePlan(key, core.H200)
		if err != nil {
			return nil, err
		}
		return &ready{seqlen: key.Seqlen, pd: planned{plan: pl}}, nil
	}
	d, err := getDevice("decode", r.device)
	if err != nil {
		return nil, err
	}
	pd, err := d.plan(key)
	if err != nil {
		return nil, err
	}
	return &ready{seqlen: key.Seqlen, d: d, pd: pd, layout: layoutParams(&p, &pd.plan)}, nil
}
