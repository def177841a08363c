// merge_states.cuh: the merge API's kernel, fd_merge_states_<dtype>: the
// combine stage on its own, for attention states a caller computed over
// disjoint key sets (cascade / shared-prefix attention, attention split across
// devices).
//
// What it does. For each row it reads the num_states LSEs lse_s (natural
// log, -inf for an empty state) and normalized outputs o_s, and computes
//     lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) * o_s
// through the shared softmax state (state.cuh), in base 2 as the combine
// does: each state is (lse_s * log2 e, 1). A state whose weight is 0 (empty,
// or negligible against the row's max) adds nothing, not even a NaN its
// output may hold; a row whose states are all empty gets out = 0 and
// lse = -inf. It accumulates in fp32 and writes out in the input dtype
// (fp16, bf16 or fp32), and lse when p.lse is not 0. Addressing is by
// strides (merge_params.h): states one pointer each or stacked, rows over up
// to three strided dimensions, head_dim contiguous.
//
// Launch shape. One block per row: grid.x = rows[0] * rows[1] * rows[2]. The
// block has WARPS = clamp(ceil(num_states / 8), 1, 16) warps
// (core.MergeProblem.Launch) and (WARPS - 1) * FD_MERGE_WARP_SHARED_BYTES of
// dynamic shared memory, where the warps after the first leave their sums.
// It may be launched with programmatic dependent launch (sm_90): its blocks
// then start while the kernel before drains, and wait in fd_pdl_wait.
//
// Why it is fast. A row is a few hundred bytes per state, so its time is
// round trips to memory, not bytes. As in combine.cuh, warp w takes states
// w, w + WARPS, ..., each lane keeping FD_MERGE_UNROLL states' LSEs and
// 4-column loads (coalesced rows) in flight at once, and folds them into its
// own online-softmax state without waiting for the other warps; the warps
// meet once in shared memory. So up to 8 * WARPS states (up to 128) cost one
// round trip, and the few states of a cascade merge run as 1-warp blocks
// without shared memory, as many rows at once per SM as it holds blocks.
#ifndef FLASHDECODE_MERGE_STATES_CUH
#define FLASHDECODE_MERGE_STATES_CUH

#include "merge_params.h"
#include "ptx.cuh"
#include "state.cuh"

#define FD_MERGE_UNROLL 8      // states one warp has in flight per step
#define FD_MERGE_SLICES 2      // 2 x 128 columns (4 a lane) cover head dims up to 256
#define FD_MERGE_MAX_WARPS 16  // 8 * 16 = 128 states in one round trip
// Dynamic shared memory per warp after the first: its sums (a float4 per
// lane and slice) and its fd_state.
#define FD_MERGE_WARP_SHARED_BYTES (FD_MERGE_SLICES * 32 * 16 + 8)

// Four elements of T (4-element aligned) as loaded, and stored from floats:
// one 8-byte access for fp16 / bf16, one 16-byte access for fp32. 16-bit
// loads stay packed until used: half the registers of floats, so that 32
// one-warp blocks fit an SM.
template <typename T>
struct fd_merge_io {
    typedef uint2 raw;
    static __device__ __forceinline__ void store(T *dst, float4 v) { fd_store4(dst, v); }
    static __device__ __forceinline__ raw zero() { return make_uint2(0u, 0u); }
    static __device__ __forceinline__ raw load(const T *src) { return *reinterpret_cast<const uint2 *>(src); }
    static __device__ __forceinline__ float4 unpack(raw u) {
        float4 f;
        fd_dtype<T>::unpack(u.x, f.x, f.y);
        fd_dtype<T>::unpack(u.y, f.z, f.w);
        return f;
    }
};

template <>
struct fd_merge_io<float> {
    typedef float4 raw;
    static __device__ __forceinline__ void store(float *dst, float4 v) { *reinterpret_cast<float4 *>(dst) = v; }
    static __device__ __forceinline__ raw zero() { return make_float4(0.f, 0.f, 0.f, 0.f); }
    static __device__ __forceinline__ raw load(const float *src) { return *reinterpret_cast<const float4 *>(src); }
    static __device__ __forceinline__ float4 unpack(raw f) { return f; }
};

// State s's row in `in` (merge_params.h), row the row's element offset.
template <typename E>
__device__ __forceinline__ const E *fd_merge_row(const fd_merge_input &in, int s, long long row) {
    const int i = min(s, in.num_ptrs - 1);
    return fd_ptr<const E>(in.ptrs[i]) + (s - i) * in.state_stride + row;
}

template <typename T>
__device__ __forceinline__ void fd_merge_states(const fd_merge_params &p) {
    extern __shared__ float4 fd_merge_shared[];
    const int warps = blockDim.x / 32;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x;
    const int i2 = row % p.rows[2];
    const int i1 = row / p.rows[2] % p.rows[1];
    const int i0 = row / p.rows[2] / p.rows[1];
    const long long out_row = i0 * p.outs.strides[0] + i1 * p.outs.strides[1] + i2 * p.outs.strides[2];
    const long long lse_row = i0 * p.lses.strides[0] + i1 * p.lses.strides[1] + i2 * p.lses.strides[2];
    fd_touch_params(out_row, lse_row, p.outs.ptrs[0], p.lses.ptrs[0], p.num_states);  // (ptx.cuh)
    fd_pdl_wait();  // with programmatic dependent launch: until the kernel before has finished

    // Warp w folds states w, w + warps, ... into its own state and columns
    // (fd_fold_states); a weightless state adds nothing, whatever its output
    // holds.
    fd_state st = fd_state_empty();
    float4 acc[FD_MERGE_SLICES];
#pragma unroll
    for (int i = 0; i < FD_MERGE_SLICES; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    typedef typename fd_merge_io<T>::raw raw;
    fd_fold_states<FD_MERGE_UNROLL, FD_MERGE_SLICES, true, raw>(
        st, acc, warp, p.num_states, warps,
        [&](int s, bool live, raw (&x)[FD_MERGE_SLICES]) {
            const float m = live ? *fd_merge_row<float>(p.lses, s, lse_row) * CUDART_L2E_F : -CUDART_INF_F;
            const T *src = fd_merge_row<T>(p.outs, s, out_row);
#pragma unroll
            for (int i = 0; i < FD_MERGE_SLICES; ++i) {
                const int d = lane * 4 + 128 * i;
                x[i] = live && d < p.head_dim ? fd_merge_io<T>::load(src + d) : fd_merge_io<T>::zero();
            }
            return m;
        },
        [](const raw &x) { return fd_merge_io<T>::unpack(x); });

    // Warps 1.. leave their sums and states in shared memory; warp 0 merges
    // them, normalizes and writes.
    if (warps > 1) {
        float4 *sum = fd_merge_shared;  // [warps - 1][FD_MERGE_SLICES * 32]
        fd_state *part = reinterpret_cast<fd_state *>(fd_merge_shared + (warps - 1) * FD_MERGE_SLICES * 32);
        if (warp > 0) {
#pragma unroll
            for (int i = 0; i < FD_MERGE_SLICES; ++i) sum[((warp - 1) * FD_MERGE_SLICES + i) * 32 + lane] = acc[i];
            if (lane == 0) part[warp - 1] = st;
        }
        __syncthreads();
        if (warp > 0) return;
        for (int w = 0; w < warps - 1; ++w) {
            float sa, sb;
            fd_state_merge(st, part[w], sa, sb);
#pragma unroll
            for (int i = 0; i < FD_MERGE_SLICES; ++i)
                acc[i] = fd_axpby4(acc[i], sa, sum[(w * FD_MERGE_SLICES + i) * 32 + lane], sb);
        }
    }
    const float inv = fd_state_norm(st);  // every state empty: output 0
    T *out = fd_ptr<T>(p.out) + i0 * p.out_strides[0] + i1 * p.out_strides[1] + i2 * p.out_strides[2];
#pragma unroll
    for (int i = 0; i < FD_MERGE_SLICES; ++i) {
        const int d = lane * 4 + 128 * i;
        if (d < p.head_dim) fd_merge_io<T>::store(out + d, fd_scale4(acc[i], inv));
    }
    if (lane == 0 && p.lse != 0)
        fd_ptr<float>(p.lse)[i0 * p.lse_strides[0] + i1 * p.lse_strides[1] + i2 * p.lse_strides[2]] = fd_state_lse2(st) * CUDART_LN2_F;
}

#endif  // FLASHDECODE_MERGE_STATES_CUH
