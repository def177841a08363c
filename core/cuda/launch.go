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
#cgo noescape fd_launch
#cgo nocallback fd_launch
#include <stdlib.h>
#include <cuda.h>
#include "launch.h"
#include "params.h"

// Stage 1, the combine or the append kernel, whose one argument is p.
static CUresult fd_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                          unsigned smem, CUstream stream, int pdl, unsigned cluster, fd_params *p) {
	return fd_launch_kernel(f, gx, gy, gz, threads, smem, stream, pdl, cluster, p);
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

// params fills the kernels' argument struct from a validated problem and its plan.
func params(p *core.Problem, pl *core.Plan, workspace uintptr) C.fd_params {
	k := plainParams(p, pl, workspace)
	if pl.Variant.Form.Serving() {
		servingParams(&k, p, pl, workspace)
	}
	return k
}

// plainParams fills the fields every kernel reads.
func plainParams(p *core.Problem, pl *core.Plan, workspace uintptr) C.fd_params {
	var k C.fd_params
	setPtr(unsafe.Pointer(&k.q), p.Q.Ptr)
	setPtr(unsafe.Pointer(&k.k), p.K.Ptr)
	setPtr(unsafe.Pointer(&k.v), p.V.Ptr)
	setPtr(unsafe.Pointer(&k.cache_seqlens), p.CacheSeqlens)
	setPtr(unsafe.Pointer(&k.out), p.Out.Ptr)
	setPtr(unsafe.Pointer(&k.lse), p.LSE)
	if pl.CombineGrid > 0 {
		setPtr(unsafe.Pointer(&k.o_partial), workspace)
		setPtr(unsafe.Pointer(&k.lse_partial), workspace+uintptr(pl.LSEPartialOffset))
	}
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
	k.seqlen = C.int(p.SeqlenCache)
	if p.Seqlen >= 0 {
		k.seqlen = C.int(p.Seqlen)
	}
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
	k.whole_items = C.int(pl.WholeItems)
	k.combine_row0 = C.int(pl.CombineRow0)
	if pl.BalanceSplits > 0 {
		k.balance_splits = C.int(pl.BalanceSplits)
		k.balance_tile_keys = C.int(pl.Variant.KeysPerTile)
	}
	scale := p.EffectiveScale()
	k.scale = C.float(scale)
	k.scale_log2 = C.float(float64(scale) * math.Log2E)
	return k
}

// pageDivider returns the magic numbers that divide a key n (0 <= n < 2^31)
// by d >= 1 on the device as (umulhi(n, m) + n) >> l, without a division
// there (Granlund and Montgomery's round-up method): l = ceil(log2 d),
// m = floor(2^(32+l) / d) - 2^32 + 1.
func pageDivider(d int) (m uint32, l int) {
	l = bits.Len32(uint32(d - 1))
	return uint32((uint64(1)<<(32+l))/uint64(d) - (1 << 32) + 1), l
}

// servingParams fills the fields the serving and append kernels read. The
// window is (-1, -1) without one, and causal makes its right side 0.
func servingParams(k *C.fd_params, p *core.Problem, pl *core.Plan, workspace uintptr) {
	setPtr(unsafe.Pointer(&k.block_table), p.BlockTable)
	k.block_table_stride = C.longlong(p.BlockTableStride)
	k.page_size = C.int(p.PageSize)
	k.num_pages = C.int(p.NumPages)
	if p.PageSize > 0 {
		m, l := pageDivider(p.PageSize)
		k.page_div_m, k.page_div_l = C.uint(m), C.int(l)
	}
	setPtr(unsafe.Pointer(&k.cache_batch_idx), p.CacheBatchIdx)
	k.cache_batch = C.int(p.Batch)
	if p.CacheBatch > 0 {
		k.cache_batch = C.int(p.CacheBatch)
	}
	setPtr(unsafe.Pointer(&k.cache_leftpad), p.CacheLeftpad)
	k.window_left, k.window_right = -1, -1
	if p.Window.Enabled {
		k.window_left, k.window_right = C.int(p.Window.Left), C.int(p.Window.Right)
	}
	if p.Causal {
		k.window_right = 0
	}
	k.softcap = C.float(p.Softcap)
	k.softcap_log2 = C.float(float64(p.Softcap) * math.Log2E)
	setPtr(unsafe.Pointer(&k.alibi_slopes), p.AlibiSlopes)
	k.alibi_batch_stride = C.longlong(p.AlibiBatchStride)
	if p.New.Seqlen > 0 {
		setPtr(unsafe.Pointer(&k.k_new), p.New.K.Ptr)
		setPtr(unsafe.Pointer(&k.v_new), p.New.V.Ptr)
		k.k_new_batch_stride, k.k_new_seq_stride, k.k_new_head_stride = strides(p.New.K)
		k.v_new_batch_stride, k.v_new_seq_stride, k.v_new_head_stride = strides(p.New.V)
		k.seqlen_new = C.int(p.New.Seqlen)
	}
	if r := p.Rotary; r.Dim > 0 {
		setPtr(unsafe.Pointer(&k.rotary_cos), r.Cos)
		setPtr(unsafe.Pointer(&k.rotary_sin), r.Sin)
		k.rotary_stride = C.longlong(r.Stride)
		k.rotary_dim, k.rotary_rows = C.int(r.Dim), C.int(r.Rows)
		if r.Interleaved {
			k.rotary_interleaved = 1
		}
		setPtr(unsafe.Pointer(&k.q_rot), workspace+uintptr(pl.QRotOffset))
	}
}

// setPtr stores a device address in a pointer field of a C struct.
func setPtr(field unsafe.Pointer, addr uintptr) { *(*uintptr)(field) = addr }

func strides(t core.Tensor) (C.longlong, C.longlong, C.longlong) {
	return C.longlong(t.BatchStride), C.longlong(t.SeqStride), C.longlong(t.HeadStride)
}

// launch runs the plan's kernels on stream: the append kernel when the
// plan has one, stage 1 (in clusters of pl.Cluster blocks when its splits
// merge themselves), then the combine when the plan has one. Each waits in
// the kernel for the one before it (programmatic dependent launch).
func (d *device) launch(k *C.fd_params, pd *planned, stream uintptr) error {
	pl := &pd.plan
	s := *(*C.CUstream)(unsafe.Pointer(&stream))
	pdl := C.int(0)
	if d.pdl {
		pdl = 1
	}
	// The error's text is built only on failure: this runs every call.
	if pl.Append != "" {
		r := C.fd_launch(C.CUfunction(pd.appendKV), C.uint(pl.AppendGrid[0]), C.uint(pl.AppendGrid[1]), C.uint(pl.AppendGrid[2]),
			C.uint(pl.AppendThreads), 0, s, pdl, 1, k)
		if r != C.CUDA_SUCCESS {
			return check("launch "+pl.Append, r)
		}
	}
	r := C.fd_launch(C.CUfunction(pd.split), C.uint(pl.Grid[0]), C.uint(pl.Grid[1]), C.uint(pl.Grid[2]),
		C.uint(pl.Threads), C.uint(pl.SharedBytes), s, pdl, C.uint(pl.Cluster), k)
	if r != C.CUDA_SUCCESS {
		return check("launch "+pl.Variant.Kernel, r)
	}
	if pl.CombineGrid == 0 {
		return nil
	}
	r = C.fd_launch(C.CUfunction(pd.combine), C.uint(pl.CombineGrid), 1, 1,
		C.uint(pl.CombineThreads), 0, s, pdl, 1, k)
	if r != C.CUDA_SUCCESS {
		return check("launch "+pl.Combine, r)
	}
	return nil
}
