// combine.cuh: stage 2, merging the splits of stage 1 by their log-sum-exp.
//
// What it does. For each output row (b, query head, query token) it reads the
// num_splits partial LSEs (natural log, -inf for a split that saw no key) and
// normalized fp32 partial outputs o_s, and computes
//     lse = log(sum_s exp(lse_s)) = m + log(sum_s exp(lse_s - m)),  m = max_s lse_s
//     out = sum_s exp(lse_s - lse) * o_s
// through the shared softmax state (state.cuh): each split is the state
// (lse_s * log2 e, 1), empty when lse_s = -inf. A row whose splits are all
// empty gets out = 0 and lse = -inf. It writes out in q's dtype through the
// out strides, and lse when p.lse is non-NULL.
//
// Launch shape. One block of FD_COMBINE_THREADS (4 warps) per output row:
// grid batch * heads_q * seqlen_q (core/variants.go CombineRows = 1,
// CombineThreads); 3 KB of static shared memory. It may be launched with
// programmatic dependent launch (sm_90): its blocks then start while stage 1
// drains and wait in fd_pdl_wait for its results, which hides most of the
// second launch's latency.
//
// Why it is fast enough. It reads num_splits * head_dim * 4 bytes per row, a
// small fraction of the KV cache stage 1 read, so its time is L2 round trips,
// not bytes. Every warp first merges all splits' LSEs (lanes take every 32nd
// split: one round trip), then the 4 warps share the splits, each keeping
// FD_COMBINE_UNROLL float4 loads per lane in flight (coalesced 512-byte
// rows), so 32 splits cost one more round trip; a shared-memory sum of the 4
// warps' rows finishes. One row per block also spreads a small batch (b=1:
// 32 rows) over 32 SMs instead of 8.
#ifndef FLASHDECODE_COMBINE_CUH
#define FLASHDECODE_COMBINE_CUH

#include "params.h"
#include "ptx.cuh"
#include "state.cuh"

#define FD_COMBINE_THREADS 128
#define FD_COMBINE_WARPS (FD_COMBINE_THREADS / 32)
#define FD_COMBINE_UNROLL 8

template <typename T>
__device__ __forceinline__ void fd_combine(const fd_params &p) {
    constexpr int kSlices = 2;  // 2 x 128 columns (float4 per lane) cover head dims up to 256
    __shared__ float4 sum[FD_COMBINE_WARPS - 1][kSlices * 32];
    const int rows_total = p.batch * p.heads_q * p.seqlen_q;
    const int row = blockIdx.x;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    fd_pdl_wait();  // with programmatic dependent launch: until stage 1 has finished
    const float *lse_s = p.lse_partial + row;  // split s at lse_s[s * rows_total]

    // The merged state of all splits, in every warp: lanes take every 32nd
    // split, then the warp merges its 32 states.
    fd_state st = fd_state_empty();
    for (int s = lane; s < p.num_splits; s += 32) {
        const float m = lse_s[(long long)s * rows_total] * CUDART_L2E_F;
        float sa, sb;
        fd_state_merge(st, fd_state{m, m == -CUDART_INF_F ? 0.f : 1.f}, sa, sb);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
        const fd_state other{__shfl_xor_sync(0xffffffffu, st.m, off),
                             __shfl_xor_sync(0xffffffffu, st.d, off)};
        float sa, sb;
        fd_state_merge(st, other, sa, sb);
    }
    const float lse2 = fd_state_lse2(st);

    // out = sum_s 2^(lse2_s - lse2) o_s: warp w takes splits w, w + 4, ...,
    // FD_COMBINE_UNROLL of them per step with all their loads (the split's
    // LSE, broadcast, and its float4 columns) issued before any is used. An
    // empty split (-inf) weighs 0, and its o_s is 0 too.
    float4 acc[kSlices];
#pragma unroll
    for (int i = 0; i < kSlices; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = warp; s0 < p.num_splits; s0 += FD_COMBINE_WARPS * FD_COMBINE_UNROLL) {
        float4 x[FD_COMBINE_UNROLL][kSlices];
        float m[FD_COMBINE_UNROLL];
#pragma unroll
        for (int u = 0; u < FD_COMBINE_UNROLL; ++u) {
            const int s = s0 + u * FD_COMBINE_WARPS;
            const bool live = s < p.num_splits;
            m[u] = live ? lse_s[(long long)s * rows_total] * CUDART_L2E_F : -CUDART_INF_F;
            const float *src = p.o_partial + ((long long)s * rows_total + row) * p.head_dim;
#pragma unroll
            for (int i = 0; i < kSlices; ++i) {
                const int d = lane * 4 + 128 * i;
                x[u][i] = live && d < p.head_dim ? *reinterpret_cast<const float4 *>(src + d)
                                                 : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
#pragma unroll
        for (int u = 0; u < FD_COMBINE_UNROLL; ++u) {
            const float w = m[u] == -CUDART_INF_F ? 0.f : exp2f(m[u] - lse2);
#pragma unroll
            for (int i = 0; i < kSlices; ++i) {
                acc[i].x += w * x[u][i].x;
                acc[i].y += w * x[u][i].y;
                acc[i].z += w * x[u][i].z;
                acc[i].w += w * x[u][i].w;
            }
        }
    }

    // Warps 1..3 hand their sums to warp 0, which adds them and writes.
    if (warp > 0) {
#pragma unroll
        for (int i = 0; i < kSlices; ++i) sum[warp - 1][i * 32 + lane] = acc[i];
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int w = 0; w < FD_COMBINE_WARPS - 1; ++w)
#pragma unroll
        for (int i = 0; i < kSlices; ++i) {
            const float4 o = sum[w][i * 32 + lane];
            acc[i].x += o.x;
            acc[i].y += o.y;
            acc[i].z += o.z;
            acc[i].w += o.w;
        }
    const int b = row / (p.heads_q * p.seqlen_q);
    const int head = row / p.seqlen_q % p.heads_q;
    const int qi = row % p.seqlen_q;
    T *out = static_cast<T *>(p.out) + b * p.out_batch_stride + qi * p.out_seq_stride +
             head * p.out_head_stride;
#pragma unroll
    for (int i = 0; i < kSlices; ++i) {
        const int d = lane * 4 + 128 * i;
        if (d < p.head_dim) fd_store4(out + d, acc[i]);
    }
    if (lane == 0 && p.lse != nullptr) p.lse[row] = lse2 * CUDART_LN2_F;
}

#endif  // FLASHDECODE_COMBINE_CUH
