package cuda

import (
	"fmt"
	"runtime"

	"github.com/flash-decode/flash-decode/core"
	"gorgonia.org/cu"
)

// Prepared is a decode whose layout (shapes, strides, dtype, scale, causal,
// num_splits and device) was validated once by Prepare, so that each call
// of a serving loop, which decodes the same layout every step on new tensors,
// only checks the new device addresses and launches: the host-side half of
// the plan/run split. It is immutable and safe for concurrent use.
type Prepared struct {
	p      core.Problem // the layout; device addresses and Seqlen come with each Run
	device int
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
// WorkspaceBytes for the shape with a.Seqlen.
func (r *Prepared) Run(a *Args, stream uintptr) (core.Plan, error) {
	p := r.p
	p.Q.Ptr, p.K.Ptr, p.V.Ptr, p.Out.Ptr, p.LSE, p.CacheSeqlens = a.Q, a.K, a.V, a.Out, a.LSE, a.CacheSeqlens
	p.Seqlen = a.Seqlen
	if err := p.CheckPointers(); err != nil {
		return core.Plan{}, err
	}
	if p.Seqlen > p.SeqlenCache {
		return core.Plan{}, p.ValidateLayout() // the one layout check that depends on a per-call value
	}
	return run(&p, a.Workspace, a.WorkspaceBytes, r.device, stream)
}

// run plans (from the device's cache) and launches a problem whose layout
// and pointers are valid.
func run(p *core.Problem, workspace uintptr, workspaceBytes int, device int, stream uintptr) (core.Plan, error) {
	d, err := getDevice(device)
	if err != nil {
		return core.Plan{}, err
	}
	pd, err := d.plan(p.Shape)
	if err != nil {
		return core.Plan{}, err
	}
	pl := &pd.plan
	if workspaceBytes < pl.WorkspaceBytes || (pl.WorkspaceBytes > 0 && workspace == 0) {
		return core.Plan{}, &core.Error{Op: "decode", Arg: "workspace",
			Msg: fmt.Sprintf("needs %d bytes, got %d", pl.WorkspaceBytes, workspaceBytes), Err: core.ErrInvalid}
	}
	// The context is current per OS thread: keep this goroutine on one
	// thread from making it current to the launches. The calling thread may
	// have another context (or none) current.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cu.SetCurrentContext(d.ctx); err != nil {
		return core.Plan{}, fmt.Errorf("flashdecode: device %d: %w", device, err)
	}
	k := params(p, pl, workspace)
	if err := d.launch(&k, &pd, stream); err != nil {
		return core.Plan{}, fmt.Errorf("flashdecode: %w", err)
	}
	return *pl, nil
}
