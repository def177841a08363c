package cuda

// #include "params.h"
import "C"

import (
	"fmt"
	"sync/atomic"

	"github.com/flash-decode/flash-decode/core"
)

// Prepared is a decode whose layout (shapes, strides, dtype, scale, causal,
// num_splits, the serving features and device) was validated once by Prepare, so that each call
// of a serving loop, which decodes the same layout every step on new tensors,
// only checks the new device addresses and launches: the host-side half of
// the plan/run split. It is immutable and safe for concurrent use.
type Prepared struct {
	p      core.Problem // the layout; device addresses and Seqlen come with each Run
	device int
	// readies are the plans the last Runs launched, by the Seqlen of their
	// plan key (core.Shape.PlanKey: the whole cache, a sizing hint, or a
	// block of 32 int lengths), ready for the next Run at one of them; a
	// miss replaces them in turn (next).
	readies [readySlots]atomic.Pointer[ready]
	next    atomic.Uint32
}

// readySlots is how many plan keys a Prepared keeps ready: a layout run at
// a few sizing hints in turn (max_seqlen_k buckets of interleaved batches,
// say) plans and allocates only the first time at each.
const readySlots = 4

// ready is a Prepared layout's plan at one plan key, ready to launch: its
// device, plan and kernels, and the kernels' parameters but the device
// addresses and the length, which are all that change between such calls.
type ready struct {
	seqlen int // the plan key's
	d      *device
	pd     planned
	layout C.fd_params
}

// Prepare validates the layout of p (everything but its device addresses,
// see core.Problem.ValidateLayout) for GPU device and returns it ready for
// Run. It does not touch the GPU: the device is opened by the first Run.
func Prepare(p *core.Problem, device int) (*Prepared, error) {
	if err := p.ValidateLayout(); err != nil {
		return nil, err
	}
	if device < 0 || device >= maxDevices {
		return nil, &core.Error{Op: "decode", Arg: "device", Msg: fmt.Sprintf("no CUDA device %d", device), Err: core.ErrInvalid}
	}
	r := &Prepared{p: *p, device: device}
	r.p.Q.Ptr, r.p.K.Ptr, r.p.V.Ptr, r.p.Out.Ptr, r.p.LSE, r.p.CacheSeqlens = 0, 0, 0, 0, 0, 0
	r.p.BlockTable, r.p.CacheBatchIdx, r.p.CacheLeftpad, r.p.AlibiSlopes = 0, 0, 0, 0
	r.p.New.K.Ptr, r.p.New.V.Ptr, r.p.Rotary.Cos, r.p.Rotary.Sin = 0, 0, 0, 0
	return r, nil
}

// Problem returns the prepared layout, with zero device addresses.
func (r *Prepared) Problem() core.Problem { return r.p }

// Device returns the GPU ordinal r runs on.
func (r *Prepared) Device() int { return r.device }

// Args are the per-call device addresses of a Prepared decode (see
// core.Problem for each; LSE and CacheSeqlens may be 0) and its workspace.
type Args struct {
	Q, K, V, Out, LSE, CacheSeqlens uintptr
	// The serving features' arrays, given exactly for the features the
	// prepared layout has: BlockTable (paged), CacheBatchIdx, CacheLeftpad,
	// AlibiSlopes, KNew and VNew (Problem.New's K and V), RotaryCos and
	// RotarySin (Problem.Rotary's tables).
	BlockTable, CacheBatchIdx, CacheLeftpad, AlibiSlopes uintptr
	KNew, VNew, RotaryCos, RotarySin                     uintptr
	// Seqlen is the valid length of every sequence when CacheSeqlens is 0,
	// and the planner's sizing hint otherwise; negative means the whole cache
	// (see core.Shape.Seqlen).
	Seqlen         int
	Workspace      uintptr
	WorkspaceBytes int
}

// Run launches the prepared decode on a's tensors on stream (a CUstream
// handle) and returns the plan it ran. Like Decode, it never synchronizes,
// allocates no device memory, and the workspace needs PlanFor's
// WorkspaceBytes for the layout's PlanShape with a.Seqlen.
func (r *Prepared) Run(a *Args, stream uintptr) (core.Plan, error) {
	p := r.p
	p.Q.Ptr, p.K.Ptr, p.V.Ptr, p.Out.Ptr, p.LSE, p.CacheSeqlens = a.Q, a.K, a.V, a.Out, a.LSE, a.CacheSeqlens
	p.BlockTable, p.CacheBatchIdx, p.CacheLeftpad, p.AlibiSlopes = a.BlockTable, a.CacheBatchIdx, a.CacheLeftpad, a.AlibiSlopes
	p.New.K.Ptr, p.New.V.Ptr, p.Rotary.Cos, p.Rotary.Sin = a.KNew, a.VNew, a.RotaryCos, a.RotarySin
	p.Seqlen = a.Seqlen
	if err := p.CheckPointers(); err != nil {
		return core.Plan{}, err
	}
	if p.Seqlen > p.SeqlenCache {
		return core.Plan{}, p.ValidateLayout() // the one layout check that depends on a per-call value
	}
	key := p.Shape // PlanKey reads Seqlen, the appended tokens and the capacity
	key.SeqlenNew = p.New.Seqlen
	seqlen := key.PlanKey().Seqlen
	w := r.readyAt(seqlen)
	if w == nil {
		var err error
		if w, err = r.ready(seqlen); err != nil {
			return core.Plan{}, err
		}
		r.readies[r.next.Add(1)%readySlots].Store(w)
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

// readyAt returns the kept plan at seqlen, or nil.
func (r *Prepared) readyAt(seqlen int) *ready {
	for i := range r.readies {
		if w := r.readies[i].Load(); w != nil && w.seqlen == seqlen {
			return w
		}
	}
	return nil
}

// ready plans r's layout at seqlen, a plan key's, as run would (a Seqlen
// plans as its key does) and fills the kernels' parameters but the
// addresses and the length.
func (r *Prepared) ready(seqlen int) (*ready, error) {
	d, err := getDevice("decode", r.device)
	if err != nil {
		return nil, err
	}
	p := r.p
	p.Seqlen = seqlen
	pd, err := d.plan(p.PlanShape())
	if err != nil {
		return nil, err
	}
	return &ready{seqlen: seqlen, d: d, pd: pd, layout: layoutParams(&p, &pd.plan)}, nil
}
