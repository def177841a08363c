// cluster_merge.cuh: the second reduce path, the splits merged inside stage 1
// (sm_90) instead of by the combine kernel.
//
// What it does. In a cluster launch of stage 1, cluster dims (num_splits, 1, 1),
// the num_splits blocks of one (batch, KV head, row tile) form one cluster.
// Each block merges its warps (split_kv.cuh), then block `rank` owns a
// contiguous 1/num_splits of the tile's (row, 4 columns) items, merges them
// over every block by LSE with the combine's formula and writes out (and
// lse). The pull form (fd_split_kv_cluster_merge) reads the rows the blocks
// parked in their own shared memory; the push form (fd_cluster_push_merge,
// variants with kPushMerge) has every block send each item to its owner.
//
// Why it is fast. No workspace, no second launch, no partials through HBM:
// the splits meet in distributed shared memory within the one kernel, which
// is what a small cache gains most from splitting.
#ifndef FLASHDECODE_CLUSTER_MERGE_CUH
#define FLASHDECODE_CLUSTER_MERGE_CUH

#include "params.h"
#include "ptx.cuh"
#include "ragged.cuh"
#include "split_kv_config.cuh"
#include "state.cuh"

// Merges item (packed row r, columns d..d+3) over the n blocks of a cluster
// (n <= KMAX) with the combine's formula
//     m = max_s lse_s,  w_s = 2^(lse_s - m),  out = sum_s w_s o_s / sum_s w_s:
// lse2_of(s) gives block s's base-2 LSE of the row, o_of(s) its normalized
// output there; writes out (and lse) at the sequence's rows (span). Both
// forms below use it, for the rows below span.count.
template <typename T, int KMAX, typename LseOf, typename OOf>
__device__ __forceinline__ void fd_cluster_merge_item(const fd_params &p, int n, int b, int kv_head,
                                                      const fd_q_span &span, int r, int d,
                                                      LseOf lse2_of, OOf o_of) {
    float lse2[KMAX];
    float m = -CUDART_INF_F;
#pragma unroll
    for (int s = 0; s < KMAX; ++s) {
        lse2[s] = s < n ? lse2_of(s) : -CUDART_INF_F;
        m = fmaxf(m, lse2[s]);
    }
    const float off = fd_state_offset(m);
    fd_state st{m, 0.f};
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < KMAX; ++s) {
        if (s < n) {
            const float w = exp2f(lse2[s] - off);  // 0 for a split that saw no key
            const float4 x = o_of(s);
            st.d += w;
            acc = fd_fma4(acc, w, x);
        }
    }
    acc = fd_scale4(acc, fd_state_norm(st));  // no visible key: output 0
    const int head = kv_head * p.group + r / p.seqlen_q;
    const int row = span.start + r % p.seqlen_q;
    fd_store4(fd_ptr<T>(p.out) + fd_out_offset(p, b, head, row) + d, acc);
    if (d == 0 && p.lse != 0)
        fd_ptr<float>(p.lse)[fd_lse_offset(p, b, head, row)] =
            st.d == 0.f ? -CUDART_INF_F : (off + log2f(st.d)) * CUDART_LN2_F;  // NaN stays NaN (state.cuh)
}

// The pull form, for variants without kPushMerge: each block has parked its
// normalized rows `park_o` and their base-2 LSEs `park_lse` in its own
// shared memory. After a cluster barrier, block `rank` merges the items it
// owns, reading every block's through distributed shared memory, and writes
// out (and lse). A second barrier keeps every block's shared memory alive
// until the others have read it.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void fd_split_kv_cluster_merge(const fd_params &p, const float *park_o,
                                                          const float *park_lse, int b,
                                                          int kv_head, int row0, const fd_q_span &span) {
    using C = fd_split_kv_config<D, ROWS>;
    const int n = fd_cluster_size();
    const int rank = fd_cluster_rank();
    const int packed_rows = p.group * p.seqlen_q;
    const int per_block = (C::kItems + n - 1) / n;
    const int end = min((rank + 1) * per_block, C::kItems);
    fd_cluster_sync();  // every block's rows are parked
    for (int idx = rank * per_block + threadIdx.x; idx < end; idx += C::kThreads) {
        const int row = idx / (D / 4);
        const int d = (idx % (D / 4)) * 4;
        const int r = row0 + row;
        if (r >= packed_rows || d >= p.head_dim || r % p.seqlen_q >= span.count) continue;
        fd_cluster_merge_item<T, C::kMaxCluster>(
            p, n, b, kv_head, span, r, d, [&](int s) { return fd_cluster_ld(fd_cluster_addr(park_lse + row, s)); },
            [&](int s) { return fd_cluster_ld4(fd_cluster_addr(park_o + row * D + d, s)); });
    }
    fd_cluster_sync();  // the others have read this block's rows: it may exit
}

// The push form, for variants with kPushMerge (at most 4 items a thread):
// every block sends each merged item to its owner, and all its rows' base-2
// LSEs to every block, with st.async into the owner's inbox (kInboxBytes
// after the pipeline buffers), each store counted on the owner's mbarrier;
// the owner waits on its own barrier for exactly the bytes it expects, then
// merges its items from its own shared memory. One cluster barrier (whose
// arrive is at the kernel's start) instead of two, and no round trip between
// blocks. But each st.async travels on its own, so the sending grows with
// the items a thread sends: at head dim 256 (16 items a thread) parking the
// rows is faster, hence only where kPushMerge.

// The inbox of a cluster block, at kSharedBytes in its dynamic shared memory.
template <int D, int ROWS>
struct fd_cluster_inbox {
    using C = fd_split_kv_config<D, ROWS>;
    float *lse;  // [kMaxCluster][ROWS]: block s's base-2 LSE of row r at lse[s * ROWS + r]
    float4 *o;   // [n][per_block]: block s's output for owned item i at o[s * per_block + i]
    __device__ __forceinline__ fd_cluster_inbox() {
        lse = reinterpret_cast<float *>(fd_dynamic_smem + C::kSharedBytes);
        o = reinterpret_cast<float4 *>(lse + C::kMaxCluster * ROWS);
    }
};

// Block `rank` of `n` sends its merged item `idx` (output `o`, row `row`, a
// real row and column) to the item's owner, and, from the row's first item,
// the row's base-2 LSE to every block. `bar` is the mbarrier at the same
// place in each block.
template <int D, int ROWS>
__device__ __forceinline__ void fd_cluster_push(uint64_t *bar, int n, int rank, int per_block, int idx,
                                                int row, float4 o, float lse2) {
    const fd_cluster_inbox<D, ROWS> in;
    const int owner = idx / per_block;
    fd_st_async4(fd_cluster_addr(in.o + rank * per_block + (idx - owner * per_block), owner), o,
                 fd_cluster_addr(bar, owner));
    if (idx % (D / 4) == 0)
        for (int s = 0; s < n; ++s)
            fd_st_async1(fd_cluster_addr(in.lse + rank * ROWS + row, s), lse2, fd_cluster_addr(bar, s));
}

// The bytes block `rank` receives: from every block, the LSEs of the real
// rows (rows < rows, of the packed rows this block's tile holds) and its
// outputs for the items `rank` owns in real rows and columns (columns
// < cols 4-column chunks). Only real items travel: at one query row per
// tile (MHA) the padding would be 15 rows of 16.
template <int D, int ROWS>
__device__ __forceinline__ uint32_t fd_cluster_inbox_bytes(int n, int rank, int per_block, int rows,
                                                           int cols) {
    constexpr int kItems = fd_split_kv_config<D, ROWS>::kItems;
    constexpr int kPerRow = D / 4;
    const int first = rank * per_block;
    const int end = min(first + per_block, kItems);
    int items = 0;
    for (int row = first / kPerRow; row < rows && row * kPerRow < end; ++row)
        items += max(0, min(end, row * kPerRow + cols) - max(first, row * kPerRow));
    return n * (rows * 4 + items * 16);
}

// Block `rank` merges the items it owns from its inbox once all have landed,
// and writes out (and lse).
template <typename T, int D, int ROWS>
__device__ __forceinline__ void fd_cluster_push_merge(const fd_params &p, uint64_t *bar, int n, int rank,
                                                      int per_block, int b, int kv_head, int row0,
                                                      const fd_q_span &span) {
    using C = fd_split_kv_config<D, ROWS>;
    const fd_cluster_inbox<D, ROWS> in;
    const int packed_rows = p.group * p.seqlen_q;
    const int first = rank * per_block;
    const int owned = min(per_block, C::kItems - first);
    fd_mbar_wait_phase0(bar);
    for (int i = threadIdx.x; i < owned; i += C::kThreads) {
        const int idx = first + i;
        const int row = idx / (D / 4);
        const int d = (idx % (D / 4)) * 4;
        const int r = row0 + row;
        if (r >= packed_rows || d >= p.head_dim || r % p.seqlen_q >= span.count) continue;
        fd_cluster_merge_item<T, C::kMaxCluster>(
            p, n, b, kv_head, span, r, d, [&](int s) { return in.lse[s * ROWS + row]; },
            [&](int s) { return in.o[s * per_block + i]; });
    }
}

#endif  // FLASHDECODE_CLUSTER_MERGE_CUH
