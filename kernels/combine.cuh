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
// Launch shape. One warp per row, FD_COMBINE_ROWS rows per block:
// grid ceil(batch * heads_q * seqlen_q / FD_COMBINE_ROWS), FD_COMBINE_THREADS
// threads (core/variants.go CombineRows, CombineThreads); no shared memory.
// It may be launched with programmatic dependent launch (sm_90): its blocks
// then start while stage 1 drains and wait in fd_pdl_wait for its results,
// which hides most of the second launch's latency.
//
// Why it is fast enough. It reads num_splits * head_dim * 4 bytes per row, a
// small fraction of the KV cache stage 1 read; lanes load float4 columns
// (coalesced 512-byte rows), each lane computes one split's weight once, and
// the warp keeps 8 splits' loads in flight, so a row costs a few L2 round
// trips rather than one per split.
#ifndef FLASHDECODE_COMBINE_CUH
#define FLASHDECODE_COMBINE_CUH

#include "params.h"
#include "ptx.cuh"
#include "state.cuh"

#define FD_COMBINE_THREADS 128
#define FD_COMBINE_ROWS (FD_COMBINE_THREADS / 32)

template <typename T>
__device__ __forceinline__ void fd_combine(const fd_params &p) {
    const int rows_total = p.batch * p.heads_q * p.seqlen_q;
    const int row = blockIdx.x * FD_COMBINE_ROWS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    fd_pdl_wait();  // with programmatic dependent launch: until stage 1 has finished
    if (row >= rows_total) return;
    const float *lse_s = p.lse_partial + row;  // split s at lse_s[s * rows_total]

    // The merged state of all splits: lanes take every 32nd split, then the
    // warp merges its 32 states.
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

    // out = sum_s 2^(lse2_s - lse2) o_s, 32 splits at a time: lane j holds the
    // weight of split s0 + j (0 for an empty split or one past the end) and
    // the warp walks them 8 at a time, 8 independent float4 loads in flight
    // per lane (a serial walk would wait one L2 round trip per split).
    const int b = row / (p.heads_q * p.seqlen_q);
    const int head = row / p.seqlen_q % p.heads_q;
    const int qi = row % p.seqlen_q;
    constexpr int kUnroll = 8;
    constexpr int kSlices = 2;  // 2 x 128 columns cover head dims up to 256
    float4 acc[kSlices];
#pragma unroll
    for (int i = 0; i < kSlices; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < p.num_splits; s0 += 32) {
        const int n = min(32, p.num_splits - s0);
        const float m = lane < n ? lse_s[(long long)(s0 + lane) * rows_total] * CUDART_L2E_F
                                 : -CUDART_INF_F;
        const float w = m == -CUDART_INF_F ? 0.f : exp2f(m - lse2);
        for (int j0 = 0; j0 < n; j0 += kUnroll) {
            float4 x[kUnroll][kSlices];
            float wj[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int j = j0 + u;
                wj[u] = __shfl_sync(0xffffffffu, w, j % 32);
                const float *src = p.o_partial + ((long long)(s0 + j) * rows_total + row) * p.head_dim;
#pragma unroll
                for (int i = 0; i < kSlices; ++i) {
                    const int d = lane * 4 + 128 * i;
                    x[u][i] = j < n && d < p.head_dim ? *reinterpret_cast<const float4 *>(src + d)
                                                      : make_float4(0.f, 0.f, 0.f, 0.f);
                }
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                for (int i = 0; i < kSlices; ++i) {
                    acc[i].x += wj[u] * x[u][i].x;
                    acc[i].y += wj[u] * x[u][i].y;
                    acc[i].z += wj[u] * x[u][i].z;
                    acc[i].w += wj[u] * x[u][i].w;
                }
        }
    }
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
