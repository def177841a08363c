package cuda

import (
	"fmt"

	"github.com/flash-decode/flash-decode/core"
)

// Decode computes flash-decoding attention for p on GPU device, launching on
// stream (a CUstream handle; 0 is the legacy default stream) and returning the
// plan it ran. workspace must hold at least Plan.WorkspaceBytes bytes of
// device memory (PlanFor(p.PlanShape()) tells how many; 0 bytes unless the
// plan runs the combine kernel or rotates q), 16-byte aligned and apart
// from p's tensors (core.Problem.CheckWorkspace); its contents need no
// initialization. With new tokens (p.New) it first writes them into the
// cache. Decode never synchronizes with the host and allocates no device
// memory: out and the optional LSE are ready when the stream reaches this
// point. The first call that names a device (PlanFor's too) opens it:
// retains its primary context and loads the kernels, which allocates, so
// make one before capturing a CUDA graph.
func Decode(p *core.Problem, workspace uintptr, workspaceBytes int, device int, stream uintptr) (core.Plan, error) {
	if err := p.Validate(); err != nil {
		return core.Plan{}, err
	}
	if err := checkAddresses(p, workspace); err != nil {
		return core.Plan{}, err
	}
	return run(p, workspace, workspaceBytes, device, stream)
}

// minAddress is the lowest device address a call takes: no allocation
// lies below it, so a value there is the caller's mistake (and one in a
// pointer-typed word on a goroutine stack makes the Go runtime throw).
const minAddress = 4096

// checkAddresses refuses, by name, a nonzero device address of p or
// workspace below minAddress. Every call runs it: one test of all the
// addresses first, the names only on a refusal.
func checkAddresses(p *core.Problem, workspace uintptr) error {
	low := func(ptr uintptr) bool { return ptr-1 < minAddress-1 } // 0 wraps around: not low
	if !(low(p.Q.Ptr) || low(p.K.Ptr) || low(p.V.Ptr) || low(p.Out.Ptr) || low(p.LSE) || low(p.CacheSeqlens) ||
		low(p.BlockTable) || low(p.CacheBatchIdx) || low(p.CacheLeftpad) || low(p.AlibiSlopes) ||
		low(p.New.K.Ptr) || low(p.New.V.Ptr) || low(p.Rotary.Cos) || low(p.Rotary.Sin) || low(p.KDescale.Ptr) ||
		low(p.VDescale.Ptr) || low(p.Sinks) || low(p.CuSeqlensQ) || low(workspace)) {
		return nil
	}
	for _, x := range [...]struct {
		name string
		ptr  uintptr
	}{
		{"q", p.Q.Ptr}, {"k_cache", p.K.Ptr}, {"v_cache", p.V.Ptr}, {"out", p.Out.Ptr}, {"lse", p.LSE},
		{"cache_seqlens", p.CacheSeqlens}, {"block_table", p.BlockTable}, {"cache_batch_idx", p.CacheBatchIdx},
		{"cache_leftpad", p.CacheLeftpad}, {"alibi_slopes", p.AlibiSlopes}, {"k", p.New.K.Ptr}, {"v", p.New.V.Ptr},
		{"rotary_cos", p.Rotary.Cos}, {"rotary_sin", p.Rotary.Sin}, {"k_descale", p.KDescale.Ptr},
		{"v_descale", p.VDescale.Ptr}, {"sinks", p.Sinks}, {"cu_seqlens_q", p.CuSeqlensQ}, {"workspace", workspace},
	} {
		if err := checkAddress("decode", x.name, x.ptr); err != nil {
			return err
		}
	}
	return nil
}

// checkAddress refuses a nonzero address below minAddress.
func checkAddress(op, name string, ptr uintptr) error {
	if ptr != 0 && ptr < minAddress {
		return &core.Error{Op: op, Arg: name, Err: core.ErrInvalid,
			Msg: fmt.Sprintf("address %#x is not a device address (below %#x)", ptr, minAddress)}
	}
	return nil
}

// run plans (from the device's cache) and launches a problem whose layout
// and pointers are valid: the launch path Decode and Prepared.Run share.
func run(p *core.Problem, workspace uintptr, workspaceBytes int, device int, stream uintptr) (core.Plan, error) {
	d, err := getDevice("decode", device)
	if err != nil {
		return core.Plan{}, err
	}
	pd, err := d.plan(p.PlanShape())
	if err != nil {
		return core.Plan{}, err
	}
	pl := &pd.plan
	if err := checkWorkspace(p, pl, workspace, workspaceBytes); err != nil {
		return core.Plan{}, err
	}
	k := params(p, pl, workspace)
	if err := d.launch(&k, &pd, stream); err != nil {
		return core.Plan{}, err
	}
	return *pl, nil
}

// checkWorkspace checks the workspace of a call of p that runs pl: large
// enough, given when pl needs one, aligned and apart from p's tensors.
func checkWorkspace(p *core.Problem, pl *core.Plan, workspace uintptr, workspaceBytes int) error {
	switch {
	case workspaceBytes < pl.WorkspaceBytes:
		return &core.Error{Op: "decode", Arg: "workspace",
			Msg: fmt.Sprintf("needs %d bytes, got %d", pl.WorkspaceBytes, workspaceBytes), Err: core.ErrInvalid}
	case pl.WorkspaceBytes > 0 && workspace == 0:
		return &core.Error{Op: "decode", Arg: "workspace",
			Msg: fmt.Sprintf("null device pointer; the plan needs %d bytes", pl.WorkspaceBytes), Err: core.ErrInvalid}
	}
	return p.CheckWorkspace(workspace, pl.WorkspaceBytes)
}

// PlanFor returns the plan Decode would run for shape s on GPU device: the
// kernel variant, the split count num_splits=0 picks, the grid, the cluster
// size and the workspace size. For a Problem p, s is p.PlanShape() (which
// carries the serving features the plan depends on). With device < 0 it
// plans for core.H200 (132 SMs, clusters of 16, occupancy estimated from
// each variant's threads and shared memory) without touching a GPU.
func PlanFor(s core.Shape, device int) (core.Plan, error) {
	if device < 0 {
		return core.MakePlan(s, core.H200)
	}
	if err := s.Validate(); err != nil { // name the argument before a device opens
		return core.Plan{}, err
	}
	d, err := getDevice("plan", device)
	if err != nil {
		return core.Plan{}, err
	}
	pd, err := d.plan(s)
	return pd.plan, err
}

// PlanLayout returns the plan of a call of layout l with this seqlen (see
// core.Problem.CallSeqlen) on GPU device (< 0: core.H200, as PlanFor),
// holding nothing and reading none of the tensors' strides
// (core.Layout.Sizes): for one-shot callers that plan before they have
// the tensors.
func PlanLayout(l *core.Layout, device, seqlen int) (core.Plan, error) {
	if l == nil {
		return core.Plan{}, &core.Error{Op: "plan", Arg: "layout", Msg: "nil", Err: core.ErrInvalid}
	}
	p, err := l.Sizes()
	if err != nil {
		return core.Plan{}, err
	}
	if p.Seqlen, err = p.CallSeqlen(seqlen); err != nil {
		return core.Plan{}, err
	}
	return PlanFor(p.PlanShape(), device)
}
