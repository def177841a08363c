package cuda

// The driver calls flash-decode makes itself, in a few lines of C: loading
// the module and looking up its kernels (gorgonia.org/cu keeps the handles it
// gets unexported, and every call below needs them), asking how many blocks
// and clusters of a kernel fit, raising its dynamic shared memory limit above
// 48 KB, and launching a kernel whose one argument is the fd_params struct by
// value (cu.Function.Launch passes every argument as 8 bytes and mallocs per
// call) with programmatic dependent launch and thread-block clusters.
// gorgonia.org/cu keeps the rest: devices, their attributes and contexts.

/*
#cgo CFLAGS: -I${SRCDIR}/../../kernels
#cgo noescape fd_run
#cgo nocallback fd_run
#include <stdint.h>
#include <stdlib.h>
#include <cuda.h>
#include "launch.h"
#include "params.h"

// One kernel of a plan: the append kernel, stage 1 or the combine.
typedef struct { CUfunction f; unsigned gx, gy, gz, threads, smem, cluster; } fd_launch_spec;

// What fd_run did: r is CUDA_SUCCESS, or the failure of step 0 (cuCtxGetCurrent),
// 1 (cuCtxSetCurrent), 2 + i (launch i) or -1 (putting the caller's context back).
typedef struct { CUresult r; int step; } fd_run_result;

// Makes ctx current on the calling thread (unless it is), launches the n kernels of l in
// order with the one argument p, and puts the thread's context back: a decode's whole
// driver work in one cgo call, which runs on one OS thread from start to end. The stream
// comes as an integer: a CUstream on the Go side would be a pointer-typed word holding
// small handles such as CU_STREAM_PER_THREAD (2).
static fd_run_result fd_run(CUcontext ctx, const fd_launch_spec *l, int n, uintptr_t stream_handle, int pdl,
                            fd_params *p) {
	CUstream stream = (CUstream)stream_handle;
	fd_run_result res = {CUDA_SUCCESS, 0};
	CUcontext prev = NULL;
	if ((res.r = cuCtxGetCurrent(&prev)) != CUDA_SUCCESS) return res;
	const int changed = prev != ctx;
	if (changed && (res.r = cuCtxSetCurrent(ctx)) != CUDA_SUCCESS) {
		res.step = 1;
		return res;
	}
	for (int i = 0; i < n; i++) {
		res.r = fd_launch_kernel(l[i].f, l[i].gx, l[i].gy, l[i].gz, l[i].threads, l[i].smem, stream, pdl,
		                         l[i].cluster, p);
		if (res.r != CUDA_SUCCESS) {
			res.step = 2 + i;
			break;
		}
	}
	if (changed) {
		CUresult r = cuCtxSetCurrent(prev);
		if (r != CUDA_SUCCESS && res.r == CUDA_SUCCESS) {
			res.r = r;
			res.step = -1;
		}
	}
	return res;
}

static CUresult fd_set_max_dynamic_smem(CUfunction f, int bytes) {
	return cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes);
}

// Lets f run in clusters of more than 8 blocks (sm_90: up to 16).
static CUresult fd_allow_large_clusters(CUfunction f) {
	return cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1);
}

// How many clusters of `cluster` blocks of f (threads, smem each) the GPU
// runs at once; 0 when such a cluster cannot be scheduled at all.
static CUresult fd_max_active_clusters(CUfunction f, unsigned cluster, unsigned threads,
                                       unsigned smem, int *n) {
	CUlaunchAttribute attr;
	fd_cluster_attr(&attr, cluster);
	CUlaunchConfig cfg = fd_launch_config(cluster, 1, 1, threads, smem, NULL, &attr, 1);
	return cuOccupancyMaxActiveClusters(n, f, &cfg);
}

static const char *fd_error_string(CUresult r) {
	const char *s = NULL;
	if (cuGetErrorString(r, &s) != CUDA_SUCCESS || s == NULL) return "unknown CUDA error";
	return s;
}
*/
import "C"

import (
	"fmt"
	"math"
	"math/bits"
	"unsafe"

	"github.com/flash-decode/flash-decode/core"
)

// module is a loaded module's driver handle.
type module C.CUmodule

// function is a loaded kernel's driver handle.
type function C.CUfunction

// loadModule loads a fatbin (or cubin or PTX) image into the current
// context, from a C copy of it as gorgonia.org/cu's LoadData does.
func loadModule(image string) (module, error) {
	c := C.CString(image)
	defer C.free(unsafe.Pointer(c))
	var m C.CUmodule
	err := check("cuModuleLoadData", C.cuModuleLoadData(&m, unsafe.Pointer(c)))
	return module(m), err
}

// unloadModule unloads a module loaded by loadModule, from the current
// context (a failed device open leaves nothing behind).
func unloadModule(m module) { C.cuModuleUnload(C.CUmodule(m)) }

// lookup returns the kernel called name in m.
func lookup(m module, name string) (function, error) {
	c := C.CString(name)
	defer C.free(unsafe.Pointer(c))
	var f C.CUfunction
	err := check("cuModuleGetFunction", C.cuModuleGetFunction(&f, C.CUmodule(m), c))
	return function(f), err
}

// maxActiveBlocks is how many blocks of f, each of threads threads and smem
// bytes of dynamic shared memory, one SM runs at once.
func maxActiveBlocks(f function, threads, smem int) (int, error) {
	var n C.int
	err := check("cuOccupancyMaxActiveBlocksPerMultiprocessor",
		C.cuOccupancyMaxActiveBlocksPerMultiprocessor(&n, C.CUfunction(f), C.int(threads), C.size_t(smem)))
	return int(n), err
}

// setMaxDynamicShared lets f use bytes of dynamic shared memory.
func setMaxDynamicShared(f function, bytes int) error {
	return check("cuFuncSetAttribute", C.fd_set_max_dynamic_smem(C.CUfunction(f), C.int(bytes)))
}

// allowLargeClusters lets f run in clusters of more than 8 blocks.
func allowLargeClusters(f function) error {
	return check("cuFuncSetAttribute", C.fd_allow_large_clusters(C.CUfunction(f)))
}

// maxActiveClusters is how many clusters of `cluster` blocks of f, each of
// threads threads and smem bytes of dynamic shared memory, run at once.
func maxActiveClusters(f function, cluster, threads, smem int) (int, error) {
	var n C.int
	err := check("cuOccupancyMaxActiveClusters",
		C.fd_max_active_clusters(C.CUfunction(f), C.uint(cluster), C.uint(threads), C.uint(smem), &n))
	return int(n), err
}

// check turns a CUresult into an error naming the driver call.
func check(call string, r C.CUresult) error {
	if r == C.CUDA_SUCCESS {
		return nil
	}
	return fmt.Errorf("%s: %s (CUDA error %d)", call, C.GoString(C.fd_error_string(r)), int(r))
}

// params fills the kernels' argument struct from a validated problem and its plan:
// the layout's fields, then the call's.
func params(p *core.Problem, pl *core.Plan, workspace uintptr) C.fd_params {
	k := layoutParams(p, pl)
	setCall(&k, p, pl, workspace)
	return k
}

// layoutParams fills every field but the device addresses and the length:
// what a Prepared layout run at the lengths of one plan keeps from call to
// call (see Prepared.Run).
func layoutParams(p *core.Problem, pl *core.Plan) C.fd_params {
	k := plainParams(p, pl)
	if pl.Variant.Form.Serving() {
		servingParams(&k, p)
	}
	return k
}

// setCall sets what layoutParams leaves at 0: the device addresses (those
// in the workspace too) from p and workspace, and the length (p.Seqlen,
// the whole cache when negative).
func setCall(k *C.fd_params, p *core.Problem, pl *core.Plan, workspace uintptr) {
	k.seqlen = C.int(p.SeqlenCache)
	if p.Seqlen >= 0 {
		k.seqlen = C.int(p.Seqlen)
	}
	k.q = C.fd_devptr(p.Q.Ptr)
	k.k = C.fd_devptr(p.K.Ptr)
	k.v = C.fd_devptr(p.V.Ptr)
	k.cache_seqlens = C.fd_devptr(p.CacheSeqlens)
	k.out = C.fd_devptr(p.Out.Ptr)
	k.lse = C.fd_devptr(p.LSE)
	k.sinks = C.fd_devptr(p.Sinks)
	k.cu_seqlens_q = C.fd_devptr(p.CuSeqlensQ)
	if pl.CombineGrid > 0 {
		k.o_partial = C.fd_devptr(workspace)
		k.lse_partial = C.fd_devptr(workspace + uintptr(pl.LSEPartialOffset))
	}
	if pl.Variant.FP8Cache {
		k.k_descale = C.fd_devptr(p.KDescale.Ptr)
		k.v_descale = C.fd_devptr(p.VDescale.Ptr)
	}
	if !pl.Variant.Form.Serving() {
		return
	}
	k.block_table = C.fd_devptr(p.BlockTable)
	k.cache_batch_idx = C.fd_devptr(p.CacheBatchIdx)
	k.cache_leftpad = C.fd_devptr(p.CacheLeftpad)
	k.alibi_slopes = C.fd_devptr(p.AlibiSlopes)
	if p.New.Seqlen > 0 {
		k.k_new = C.fd_devptr(p.New.K.Ptr)
		k.v_new = C.fd_devptr(p.New.V.Ptr)
	}
	if p.Rotary.Dim > 0 {
		k.rotary_cos = C.fd_devptr(p.Rotary.Cos)
		k.rotary_sin = C.fd_devptr(p.Rotary.Sin)
		k.q_rot = C.fd_devptr(workspace + uintptr(pl.QRotOffset))
	}
}

// plainParams fills the layout fields every kernel reads.
func plainParams(p *core.Problem, pl *core.Plan) C.fd_params {
	var k C.fd_params
	k.q_batch_stride, k.q_seq_stride, k.q_head_stride = strides(p.Q)
	k.k_batch_stride, k.k_seq_stride, k.k_head_stride = strides(p.K)
	k.v_batch_stride, k.v_seq_stride, k.v_head_stride = strides(p.V)
	k.out_batch_stride, k.out_seq_stride, k.out_head_stride = strides(p.Out)
	k.batch = C.int(p.Batch)
	k.seqlen_q = C.int(p.SeqlenQ)
	k.heads_q = C.int(p.HeadsQ)
	k.heads_kv = C.int(p.HeadsKV)
	k.group = C.int(p.HeadsQ / p.HeadsKV)
	k.head_dim = C.int(p.HeadDim)
	k.seqlen_cache = C.int(p.SeqlenCache)
	k.num_splits = C.int(pl.NumSplits)
	k.row_tiles = C.int(pl.RowTiles)
	if p.Causal {
		k.causal = 1
	}
	if pl.EarlyDependents() {
		k.early_dependents = 1
	}
	if pl.CombineEarlyDependents() {
		k.combine_early_dependents = 1
	}
	k.prefetch_tiles = C.int(pl.PrefetchTiles)
	// lse: (batch, heads_q, seqlen_q), or with ragged lengths (heads_q, total_q)
	// (kernels/ragged.cuh; q's and out's batch strides are then 0).
	k.lse_batch_stride, k.lse_head_stride = C.longlong(p.HeadsQ*p.SeqlenQ), C.longlong(p.SeqlenQ)
	if p.Ragged {
		k.total_q, k.lse_batch_stride, k.lse_head_stride = C.int(p.TotalQ), 0, C.longlong(p.TotalQ)
	}
	k.whole_items = C.int(pl.WholeItems)
	k.combine_row0 = C.int(pl.CombineRow0)
	if pl.BalanceSplits > 0 {
		k.balance_splits = C.int(pl.BalanceSplits)
		k.balance_tile_keys = C.int(pl.Variant.KeysPerTile)
	}
	if pl.InvariantTiles > 0 { // batch-invariant splits (kernels/balance.cuh)
		k.invariant_tiles, k.invariant_span_tiles = C.int(pl.InvariantTiles), C.int(pl.InvariantSpanTiles)
		k.invariant_max_splits, k.balance_tile_keys = C.int(core.MaxSplits), C.int(pl.Variant.KeysPerTile)
	}
	scale := p.EffectiveScale()
	k.scale = C.float(scale)
	k.scale_log2 = C.float(float64(scale) * math.Log2E)
	if pl.Variant.FP8Cache {
		fp8Params(&k, p)
	}
	return k
}

// fp8Params fills the layout fields of an fp8 cache: its format and its
// descales' strides or values (the kernels take a Value of 0 as 1).
func fp8Params(k *C.fd_params, p *core.Problem) {
	if p.CacheDType() == core.Float8E5M2 {
		k.kv_e5m2 = 1
	}
	k.k_descale_batch_stride = C.longlong(p.KDescale.BatchStride)
	k.k_descale_head_stride = C.longlong(p.KDescale.HeadStride)
	k.v_descale_batch_stride = C.longlong(p.VDescale.BatchStride)
	k.v_descale_head_stride = C.longlong(p.VDescale.HeadStride)
	k.k_descale_value = C.float(p.KDescale.Value)
	k.v_descale_value = C.float(p.VDescale.Value)
}

// pageDivider returns the magic numbers that divide a key n (0 <= n < 2^31)
// by d >= 1 on the device as (umulhi(n, m) + n) >> l, without a division
// there (Granlund and Montgomery's round-up method): l = ceil(log2 d),
// m = floor(2^(32+l) / d) - 2^32 + 1.
func pageDivider(d int) (m uint32, l int) {
	l = bits.Len32(uint32(d - 1))
	return uint32((uint64(1)<<(32+l))/uint64(d) - (1 << 32) + 1), l
}

// servingParams fills the layout fields the serving and append kernels read.
// The window is (-1, -1) without one, and causal makes its right side 0.
func servingParams(k *C.fd_params, p *core.Problem) {
	k.block_table_stride = C.longlong(p.BlockTableStride)
	k.page_size = C.int(p.PageSize)
	k.num_pages = C.int(p.NumPages)
	if p.PageSize > 0 {
		m, l := pageDivider(p.PageSize)
		k.page_div_m, k.page_div_l = C.uint(m), C.int(l)
	}
	k.cache_batch = C.int(p.Batch)
	if p.CacheBatch > 0 {
		k.cache_batch = C.int(p.CacheBatch)
	}
	k.window_left, k.window_right = -1, -1
	if p.Window.Enabled {
		k.window_left, k.window_right = C.int(p.Window.Left), C.int(p.Window.Right)
	}
	if p.Causal {
		k.window_right = 0
	}
	k.softcap = C.float(p.Softcap)
	k.softcap_log2 = C.float(float64(p.Softcap) * math.Log2E)
	k.alibi_batch_stride = C.longlong(p.AlibiBatchStride)
	if p.New.Seqlen > 0 {
		k.k_new_batch_stride, k.k_new_seq_stride, k.k_new_head_stride = strides(p.New.K)
		k.v_new_batch_stride, k.v_new_seq_stride, k.v_new_head_stride = strides(p.New.V)
		k.seqlen_new = C.int(p.New.Seqlen)
	}
	if r := p.Rotary; r.Dim > 0 {
		k.rotary_stride = C.longlong(r.Stride)
		k.rotary_dim, k.rotary_rows = C.int(r.Dim), C.int(r.Rows)
		if r.Interleaved {
			k.rotary_interleaved = 1
		}
	}
}

func strides(t core.Tensor) (C.longlong, C.longlong, C.longlong) {
	return C.longlong(t.BatchStride), C.longlong(t.SeqStride), C.longlong(t.HeadStride)
}

// launches is a plan's kernels in launch order, as fd_run takes them: the
// append kernel when the plan has one, stage 1 (in clusters of pl.Cluster
// blocks when its splits merge themselves), then the combine when the plan
// has one. Each waits in the kernel for the one before it (programmatic
// dependent launch).
type launches struct {
	spec  [3]C.fd_launch_spec
	names [3]string // the kernels' names, for errors
	n     int
}

// launchesOf lists pd's kernels (see launches).
func launchesOf(pd *planned) launches {
	pl := &pd.plan
	var l launches
	add := func(f function, name string, grid [3]int, threads, smem, cluster int) {
		l.spec[l.n] = C.fd_launch_spec{f: C.CUfunction(f), gx: C.uint(grid[0]), gy: C.uint(grid[1]),
			gz: C.uint(grid[2]), threads: C.uint(threads), smem: C.uint(smem), cluster: C.uint(cluster)}
		l.names[l.n] = name
		l.n++
	}
	if pl.Append != "" {
		add(pd.appendKV, pl.Append, pl.AppendGrid, pl.AppendThreads, 0, 1)
	}
	add(pd.split, pl.Variant.Kernel, pl.Grid, pl.Threads, pl.SharedBytes, pl.Cluster)
	if pl.CombineGrid > 0 {
		add(pd.combine, pl.Combine, [3]int{pl.CombineGrid, 1, 1}, pl.CombineThreads, 0, 1)
	}
	return l
}

// launch runs pd's kernels with k on stream, with d's context current for
// the launches only: the caller's (torch's current device, say) is current
// again when it returns. The error's text is built only on failure: this
// runs every call.
func (d *device) launch(k *C.fd_params, pd *planned, stream uintptr) error {
	l := &pd.launches
	pdl := C.int(0)
	if d.pdl {
		pdl = 1
	}
	res := C.fd_run(d.raw, &l.spec[0], C.int(l.n), C.uintptr_t(stream), pdl, k)
	switch step := int(res.step); {
	case res.r == C.CUDA_SUCCESS:
		return nil
	case step == -1:
		return fmt.Errorf("flashdecode: device %d: the kernels launched, but putting the caller's context back failed: %w", d.ordinal, check("cuCtxSetCurrent", res.r))
	case step == 0:
		return fmt.Errorf("flashdecode: device %d: %w", d.ordinal, check("cuCtxGetCurrent", res.r))
	case step == 1:
		return fmt.Errorf("flashdecode: device %d: %w", d.ordinal, check("cuCtxSetCurrent", res.r))
	default:
		return fmt.Errorf("flashdecode: %w", check("launch "+l.names[step-2], res.r))
	}
}
