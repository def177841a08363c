// flashdecode.cu: the one translation unit nvcc compiles into the fatbin; it
// instantiates every kernel the Go core can launch, by name: the list of
// core's kernel table (core.Kernels), which `go generate ./core/cuda` writes
// as _instances.inc (core/cuda/internal/instances) and nvcc finds on its
// include path. The list invokes the macros below, a kernel a line, and
// static_asserts that what the kernels decide at compile time (threads, tile
// keys, shared memory, balancing) is what the table says.
//
// The files (each header says what it does; stage 1's give its launch shape
// and why it is fast):
//   split_kv.cuh         stage 1's main loop, written once for every form:
//                        fd_split_kv_<dtype>[_fp8]_d<D>_r<ROWS> (_fp8: an fp8
//                        cache beside q's dtype), one block per
//                        (split, KV head x row tile, batch)
//   split_kv_forms.cuh   stage 1's forms as policy types: plain (fd_split_kv_*),
//                        paged (fd_split_kv_paged_*: pages of a multiple of 8
//                        keys), paged_append and append (fd_split_kv_paged_append_*,
//                        fd_split_kv_append_*: writing a few new tokens themselves),
//                        serving (fd_split_kv_serving_*: every kv-cache feature)
//   load_tile.cuh        what a tile loader is given
//   load_contiguous.cuh  the plain and append forms' loader (a contiguous cache)
//   load_paged.cuh       the page ring and the paged forms' loader
//   load_serving.cuh     the serving form's loader (either layout)
//   serving.cuh          the serving policies: key ranges (leftpad, window),
//                        softcap, ALiBi, cache_batch_idx, the rotated q
//   fused_append.cuh     the appending forms' write of the new tokens
//   fp8.cuh              fp8 caches: their bytes as mma operands, new
//                        tokens quantized into them, their descales
//   split_kv_epilogue.cuh stage 1's end: its warps' merge and its rows' writes
//                        (out/lse, or partials for the combine, or the cluster merge)
//   split_kv_config.cuh  a stage-1 variant's compile-time shape (threads,
//                        tiles, shared memory) and its dynamic shared memory
//   append_kv.cuh        fd_append_kv_<dtype>: before a serving stage 1, writes
//                        the new keys and values into the cache (rotated keys,
//                        and the rotated q into the workspace, with rotary)
//   combine.cuh          reduce path 1, the reduce kernel: fd_combine_<dtype>
//                        (4 warps a row), _c32 (a block a row's 32 columns,
//                        for more than 32 splits), _r4 and _r16 (a warp a
//                        row, 4 or 16 rows a block, for at most 8 splits)
//                        merge the partials by LSE
//   cluster_merge.cuh    reduce path 2, the in-cluster reduce (sm_90): the
//                        blocks of one cluster merge their splits through
//                        distributed shared memory, inside stage 1
//   merge_states.cuh     fd_merge_states_<dtype>: the combine on its own, for
//                        caller-computed states (merge_states in Python;
//                        its own argument struct, merge_params.h)
//   partials.cuh         where a split's partials lie in the workspace (the
//                        rows stage 1 writes and the combine reads)
//   ragged.cuh           ragged query lengths (cu_seqlens_q): a sequence's rows
//                        of q, out, lse and the new tokens, clamped
//   balance.cuh          a sequence's attended keys, and balanced splits
//                        worked out on the device from the lengths
//   state.cuh            the online-softmax state and merge all of them share
//   sinks.cuh            attention sinks: split 0 of a row starts its online
//                        softmax from the row's sink, which every merge then counts once
//   ptx.cuh              cp.async / ldmatrix / mma / cluster wrappers and the
//                        dtype pieces
//   params.h             fd_params, the argument struct (shared with core/cuda)
//   dev_hooks.h          FD_TRACE, no-op points a developer tool may time
//
// Every kernel takes `const fd_params p` (params.h) by value. Stage 1 uses
// 98304 bytes of dynamic shared memory for every variant:
//     SharedBytes = 3 stages * (K tile + V tile) * KeysPerTile * D * 2 bytes,
//     KeysPerTile = 8192 / D, so 3 * 2 * 8192 * 2 = 98304
// (fd_split_kv_config::kSharedBytes); the combine and the append use none.
#include "append_kv.cuh"
#include "combine.cuh"
#include "merge_states.cuh"
#include "split_kv.cuh"

// Stage 1 and the append take q's type T and the caches' KV: T, or
// unsigned char for an fp8 cache (either format: fd_params.kv_e5m2).
#define FD_SPLIT_KV(name, T, KV, D, ROWS)                                                 \
    extern "C" __global__ void __launch_bounds__(fd_split_kv_config<D, ROWS>::kThreads, 2) \
        name(const fd_params p) {                                                         \
        fd_split_kv<T, KV, D, ROWS>(p);                                                   \
    }

#define FD_SPLIT_KV_SERVING(name, T, KV, D, ROWS)                                         \
    extern "C" __global__ void __launch_bounds__(fd_split_kv_config<D, ROWS>::kThreads, 2) \
        name(const fd_params p) {                                                         \
        fd_split_kv_serving<T, KV, D, ROWS, fd_form_serving>(p);                          \
    }

#define FD_SPLIT_KV_FORM(name, T, KV, D, ROWS, FORM)                                      \
    extern "C" __global__ void __launch_bounds__(fd_split_kv_config<D, ROWS>::kThreads, 2) \
        name(const fd_params p) {                                                         \
        fd_split_kv_serving<T, KV, D, ROWS, FORM>(p);                                     \
    }

#define FD_APPEND_KV(name, T, KV)                                                          \
    extern "C" __global__ void __launch_bounds__(kFdAppendThreads) name(const fd_params p) { \
        fd_append_kv<T, KV>(p);                                                            \
    }

// The combines' launch bounds (BOUNDS: core's Kernel.Threads and
// MinBlocks). (128, 1) lets ptxas keep all of a fold
// step's loads in flight (combine.cuh), one round trip to L2; with the
// default it interleaves them with their uses to save registers (96 of
// them instead of 154), and a step takes four or five round trips. The
// narrow combines keep the default: with all their loads in flight (107-113
// registers) they slowed the plans whose stage-1 blocks they share SMs
// with (docs/tuning.md).
// Each combine form FORM (fd_combine, fd_combine_rows, fd_combine_cols) is
// compiled as name and as its balanced twin, name_bal (balance.cuh), for the
// plans that balance their splits by the lengths: the twin merges each
// row's own split count, so the plain combines keep their code.
#define FD_COMBINE_FORM(name, FORM, T, WARPS, BOUNDS)                     \
    extern "C" __global__ void __launch_bounds__ BOUNDS name(const fd_params p) { \
        FORM<T, WARPS, false>(p);                                         \
    }                                                                     \
    extern "C" __global__ void __launch_bounds__ BOUNDS name##_bal(const fd_params p) { \
        FORM<T, WARPS, true>(p);                                          \
    }
#define FD_COMBINE(name, T, WARPS, BOUNDS) FD_COMBINE_FORM(name, fd_combine, T, WARPS, BOUNDS)

// The narrow combine: a warp a row, WARPS rows a block (at most
// FD_COMBINE_UNROLL splits).
#define FD_COMBINE_ROWS(name, T, WARPS, BOUNDS) FD_COMBINE_FORM(name, fd_combine_rows, T, WARPS, BOUNDS)

// The column-group combine: a block a group of FD_COMBINE_COLS columns of a
// row, for plans of more splits than the 4-warp combine loads at once; its
// lane holds one float4 a split, so all of its loads stay in flight at 90
// registers.
#define FD_COMBINE_GROUPS(name, T, WARPS, BOUNDS) FD_COMBINE_FORM(name, fd_combine_cols, T, WARPS, BOUNDS)

// The merge API (merge_states.cuh, merge_params.h): fd_merge_states_<dtype>
// merges caller-computed attention states by their LSE, in and out in one
// dtype; 32 to 512 threads (core.MergeProblem.Launch), dynamic shared memory.
#define FD_MERGE_STATES(name, T)                                                         \
    extern "C" __global__ void __launch_bounds__(32 * FD_MERGE_MAX_WARPS) name(         \
        const fd_merge_params p) {                                                       \
        fd_merge_states<T>(p);                                                           \
    }

#include "_instances.inc"
