package cuda

// #include <cuda.h>
import "C"

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/flash-decode/flash-decode/core"
	"gorgonia.org/cu"
)

// kernels are the driver handles of one variant: stage 1, its combines by
// name (Variant.Combine, CombineWide, CombineNarrow and CombineNarrowDense,
// whichever a plan names) and, for a serving variant, its append kernel.
type kernels struct {
	split, appendKV function
	combines        map[string]function
	blocksPerSM     int // stage-1 blocks of this variant resident per SM
	// clusters[n]: clusters of n stage-1 blocks (at the variant's
	// ClusterSharedBytes) that run at once; all 0 without clusters.
	clusters [core.MaxCluster + 1]int
}

// device is what flash-decode keeps per GPU: its primary context, the loaded
// module, the kernel handles and the plans made so far. It is built once, on
// the first call for that GPU, and never freed (like a loaded library).
type device struct {
	ordinal    int
	ctx        cu.CUContext // the primary context, retained
	raw        C.CUcontext  // its driver handle, for the launch path (context.go)
	sms        int
	pdl        bool                // programmatic dependent launch (sm_90 and newer)
	maxCluster int                 // largest stage-1 cluster a plan may use; 1: none
	fns        map[string]*kernels // by Variant.Kernel; read-only after init
	// Why the variants missing from fns cannot run on this GPU (more
	// shared memory than it gives a block): their plans are refused.
	unusable map[string]error
	merges   mergeKernels // the merge kernels, by dtype

	mu    sync.RWMutex
	plans map[core.Shape]planned
}

// planned is a cached plan with the kernels it launches.
type planned struct {
	plan     core.Plan
	appendKV function // the plan's append kernel (Plan.Append); unused without one
	split    function // stage 1
	combine  function // the plan's combine kernel (Plan.Combine); unused without one
	launches launches // the three above as launched, in order
}

const maxDevices = 64

var (
	devices [maxDevices]atomic.Pointer[device]
	initMu  sync.Mutex
)

// getDevice returns the state of GPU ordinal, initializing it on first use;
// op names the caller's operation in its errors.
func getDevice(op string, ordinal int) (*device, error) {
	if ordinal < 0 || ordinal >= maxDevices {
		return nil, &core.Error{Op: op, Arg: "device", Msg: fmt.Sprintf("no CUDA device %d", ordinal), Err: core.ErrInvalid}
	}
	if d := devices[ordinal].Load(); d != nil {
		return d, nil
	}
	initMu.Lock()
	defer initMu.Unlock()
	if d := devices[ordinal].Load(); d != nil {
		return d, nil
	}
	d, err := openDevice(op, ordinal)
	if err != nil {
		return nil, err
	}
	devices[ordinal].Store(d)
	return d, nil
}

// openDevice retains the primary context of GPU ordinal (never a new context:
// the caller's allocations live in the primary one), loads the fatbin and
// looks up every kernel variant. Where it fails it unloads the module and
// releases the context again, so that the next call starts afresh.
func openDevice(op string, ordinal int) (_ *device, err error) {
	n, err := cu.NumDevices()
	if err != nil {
		return nil, fmt.Errorf("flashdecode: counting CUDA devices: %w", err)
	}
	if ordinal >= n {
		return nil, &core.Error{Op: op, Arg: "device", Msg: fmt.Sprintf("no CUDA device %d (%d present)", ordinal, n), Err: core.ErrInvalid}
	}
	dev := cu.Device(ordinal)
	ctx, err := dev.RetainPrimaryCtx()
	if err != nil {
		return nil, fmt.Errorf("flashdecode: retaining the primary context of device %d: %w", ordinal, err)
	}
	defer func() {
		if err != nil {
			dev.ReleasePrimaryCtx()
		}
	}()
	raw, err := rawContext(ctx, ordinal)
	if err != nil {
		return nil, err
	}
	// The module loads into the current context: ours, on this thread only
	// until openDevice returns.
	s, err := current(raw, ordinal)
	if err != nil {
		return nil, err
	}
	defer s.undoInto(&err, ordinal)
	sms, err := dev.Attribute(cu.MultiprocessorCount)
	if err != nil {
		return nil, fmt.Errorf("flashdecode: device %d: %w", ordinal, err)
	}
	major, err := dev.Attribute(cu.ComputeCapabilityMajor)
	if err != nil {
		return nil, fmt.Errorf("flashdecode: device %d: %w", ordinal, err)
	}
	if major < 8 { // the fatbin's oldest code is sm_80: say so rather than fail in the loader
		minor, _ := dev.Attribute(cu.ComputeCapabilityMinor)
		return nil, &core.Error{Op: op, Arg: "device", Err: core.ErrUnsupported,
			Msg: fmt.Sprintf("CUDA device %d is sm_%d%d; the kernels need sm_80 or newer", ordinal, major, minor)}
	}
	image, err := kernelImage()
	if err != nil {
		return nil, &core.Error{Op: op, Msg: err.Error(), Err: core.ErrUnsupported}
	}
	mod, err := loadModule(image)
	if err != nil {
		return nil, fmt.Errorf("flashdecode: loading the kernels on device %d: %w", ordinal, err)
	}
	defer func() {
		if err != nil {
			unloadModule(mod) // while the context is current (s.undo runs after)
		}
	}()
	d := &device{ordinal: ordinal, ctx: ctx, raw: raw, sms: sms, pdl: major >= 9, maxCluster: 1,
		fns: map[string]*kernels{}, unusable: map[string]error{}, plans: map[core.Shape]planned{}}
	if major >= 9 {
		d.maxCluster = min(core.MaxCluster, clusterLimit())
	}
	for _, v := range core.Variants() {
		split, err := lookup(mod, v.Kernel)
		if err != nil {
			return nil, fmt.Errorf("flashdecode: kernel %s: %w", v.Kernel, err)
		}
		k := &kernels{split: split, combines: map[string]function{}}
		for _, plain := range []string{v.Combine, v.CombineWide, v.CombineNarrow, v.CombineNarrowDense} {
			if plain == "" {
				continue
			}
			for _, name := range []string{plain, core.BalancedCombine(plain)} {
				if k.combines[name], err = lookup(mod, name); err != nil {
					return nil, fmt.Errorf("flashdecode: kernel %s: %w", name, err)
				}
			}
		}
		if v.Append != "" {
			if k.appendKV, err = lookup(mod, v.Append); err != nil {
				return nil, fmt.Errorf("flashdecode: kernel %s: %w", v.Append, err)
			}
		}
		// A cluster launch asks for more shared memory than a plain one, and
		// only a GPU with clusters makes one. A GPU with clusters but too
		// little shared memory a block for them (sm_120: 99 KB) runs the
		// variant without.
		shared, clusters := v.SharedBytes, d.maxCluster > 1
		if clusters {
			shared = max(shared, v.ClusterSharedBytes, v.ClusterDenseSharedBytes)
		}
		if shared > 48<<10 {
			err := setMaxDynamicShared(k.split, shared)
			if err != nil && shared > v.SharedBytes {
				shared, clusters = v.SharedBytes, false
				err = setMaxDynamicShared(k.split, shared)
			}
			if err != nil {
				d.unusable[v.Kernel] = fmt.Errorf("%d B of dynamic shared memory a block: %w", shared, err)
				continue
			}
		}
		k.blocksPerSM, err = maxActiveBlocks(k.split, v.Threads, v.SharedBytes)
		if err != nil {
			return nil, fmt.Errorf("flashdecode: occupancy of %s: %w", v.Kernel, err)
		}
		if k.blocksPerSM < 1 {
			d.unusable[v.Kernel] = fmt.Errorf("no block of %d threads and %d B of shared memory fits an SM", v.Threads, v.SharedBytes)
			continue
		}
		if clusters {
			if err := k.measureClusters(v); err != nil {
				return nil, fmt.Errorf("flashdecode: clusters of %s: %w", v.Kernel, err)
			}
		}
		d.fns[v.Kernel] = k
	}
	// Looked up here, not on the first merge: that may come inside a graph capture.
	for _, dt := range mergeDTypes {
		name := core.MergeKernel(dt)
		if d.merges[dt], err = lookup(mod, name); err != nil {
			return nil, fmt.Errorf("flashdecode: kernel %s: %w", name, err)
		}
	}
	return d, nil
}

// clusterLimit is the FLASH_DECODE_MAX_CLUSTER environment variable, read
// when a device is first used: the largest cluster a plan may merge its
// splits in (1 turns the clusters off, so the combine kernel merges every
// split: for comparisons and tuning). Unset or invalid: no limit.
func clusterLimit() int {
	if n, err := strconv.Atoi(os.Getenv("FLASH_DECODE_MAX_CLUSTER")); err == nil && n >= 1 {
		return n
	}
	return core.MaxCluster
}

// measureClusters asks the driver how many clusters of 2 to MaxCluster
// stage-1 blocks of v run at once (sizes above 8 need the non-portable
// attribute; a size the GPU cannot run counts 0).
func (k *kernels) measureClusters(v core.Variant) error {
	large := allowLargeClusters(k.split) == nil
	for n := 2; n <= core.MaxCluster; n++ {
		if n > 8 && !large {
			break
		}
		c, err := maxActiveClusters(k.split, n, v.Threads, v.ClusterSharedBytes)
		if err != nil {
			return err
		}
		k.clusters[n] = c
	}
	return nil
}

// clusters is the device's core.ClusterOccupancy: the measured counts, for
// sizes up to maxCluster.
func (d *device) clusters(v core.Variant, size int) int {
	k := d.fns[v.Kernel]
	if k == nil || size < 2 || size > d.maxCluster {
		return 0
	}
	return k.clusters[size]
}

// occupancy reports the measured blocks per SM of a variant.
func (d *device) occupancy(v core.Variant) int {
	if k := d.fns[v.Kernel]; k != nil {
		return k.blocksPerSM
	}
	return 1
}

// plan returns the cached plan for s (a Problem's PlanShape), making it on
// first use.
func (d *device) plan(s core.Shape) (planned, error) {
	s = s.PlanKey() // one plan for the lengths of each key tile: an int length changes every step
	d.mu.RLock()
	p, ok := d.plans[s]
	d.mu.RUnlock()
	if ok {
		return p, nil
	}
	dev := core.Device{SMs: d.sms, Occupancy: d.occupancy}
	if d.maxCluster > 1 {
		dev.Clusters = d.clusters
	}
	pl, err := core.MakePlan(s, dev)
	if err != nil {
		return planned{}, err
	}
	k := d.fns[pl.Variant.Kernel]
	if k == nil {
		return planned{}, &core.Error{Op: "decode", Arg: "headdim", Err: core.ErrUnsupported,
			Msg: fmt.Sprintf("%d: its kernel %s cannot run on device %d: %v", s.HeadDim, pl.Variant.Kernel, d.ordinal, d.unusable[pl.Variant.Kernel])}
	}
	p = planned{plan: pl, appendKV: k.appendKV, split: k.split}
	if pl.Combine != "" {
		var ok bool
		if p.combine, ok = k.combines[pl.Combine]; !ok {
			return planned{}, fmt.Errorf("flashdecode: the plan's combine %s is not one of %s's", pl.Combine, pl.Variant.Kernel)
		}
	}
	p.launches = launchesOf(&p)
	d.mu.Lock()
	if len(d.plans) > 4096 { // many distinct shapes: start over rather than grow without bound
		d.plans = map[core.Shape]planned{}
	}
	d.plans[s] = p
	d.mu.Unlock()
	return p, nil
}
