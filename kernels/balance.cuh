// balance.cuh: balanced splits, worked out on the device from the lengths.
//
// What it is. With a cache_seqlens tensor the planner cannot see the
// lengths, so a plain plan gives every sequence the same split count n,
// each split by its own length: a batch of one long sequence among short
// ones then streams the long one on n blocks a K/V head while the others
// finish early. A balanced plan (p.balance_splits = n > 0, core
// Plan.BalanceSplits) sizes the splits from all the lengths instead, so
// that every split of the batch holds about the same number of key tiles:
//     tiles_b = ceil(len_b / tile keys)      len_b = cache_seqlens[b] + seqlen_new, clamped
// (with ragged query lengths seqlen_new is the most any sequence appends, so
// a sequence's count may be sized for a few more keys than it has)
//     c_b     = clamp(ceil(n * batch * tiles_b / sum_b tiles_b), 1, p.num_splits)
// (c_b = 1 where every length is 0). Sequence b's items (K/V head, row
// tile) are split c_b ways, the tiles dealt round robin as in any plan.
// For equal lengths c_b = n: the plan the planner makes for them. Stage 1
// runs a 1-D grid of batch * items * (n + 1) blocks (at least sum_b c_b *
// items): sequence b's blocks follow those of b - 1, item by item, c_b an
// item; the blocks past them exit.
// The combine's balanced twins (fd_combine_*_bal) work out c_b the same
// way (fd_row_splits) and merge c_b splits a row; a row with c_b = 1 is
// written by stage 1, and they skip it.
// Batch-invariant splits (fd_invariant_splits, below) are the same idea
// with c_b from the sequence's own length and a fixed tile budget instead
// of the batch's: stage 1 keeps its 3-D grid, and the balanced combine
// merges them.
#ifndef FLASHDECODE_BALANCE_CUH
#define FLASHDECODE_BALANCE_CUH

#include "params.h"
#include "ragged.cuh"

// What the rule reads of the kernels' arguments, passed by value to the
// out-of-line stage-1 helper below (a reference to the arguments themselves
// would copy them to local memory), so that the plans without balanced
// splits keep their registers.
struct fd_balance_args {
    const int *lens;  // cache_seqlens, or NULL: every sequence has seqlen keys
    int batch, seqlen, seqlen_new, seqlen_cache;
    int splits;     // p.balance_splits: n
    int max_splits; // p.num_splits: the most a sequence takes (the workspace's split dimension)
    int tile_keys;
};

__device__ __forceinline__ fd_balance_args fd_balance_args_of(const fd_params &p) {
    return {fd_ptr<const int>(p.cache_seqlens), p.batch, p.seqlen, p.seqlen_new, p.seqlen_cache, p.balance_splits, p.num_splits,
            p.balance_tile_keys};
}

// Sequence b's length as cache_seqlens gives it (seqlen without).
__device__ __forceinline__ int fd_balance_len(const fd_balance_args &a, int b) {
    return a.lens != nullptr ? a.lens[b] : a.seqlen;
}

// The keys a sequence attends when cache_seqlens gives it len: len plus
// the seqlen_new appended tokens, clamped to [0, seqlen_cache] (len first,
// so that a len near INT_MAX cannot wrap the sum). Stage 1 and the
// balancing rule both count keys this way; kernels that never append pass
// APPEND = false and skip the sum.
template <bool APPEND = true>
__device__ __forceinline__ int fd_attended_keys(int len, int seqlen_new, int seqlen_cache) {
    if constexpr (APPEND) len = min(len, seqlen_cache - seqlen_new) + seqlen_new;
    return min(max(len, 0), seqlen_cache);
}

// The key tiles of a sequence of len keys before the appended tokens.
__device__ __forceinline__ int fd_balance_tiles(const fd_balance_args &a, int len) {
    return (fd_attended_keys(len, a.seqlen_new, a.seqlen_cache) + a.tile_keys - 1) / a.tile_keys;
}

// A sequence's split count c_b for its tiles and the batch's total: its
// share of the n * batch splits equal lengths would take.
__device__ __forceinline__ int fd_balance_splits_of(const fd_balance_args &a, int tiles, long long total_tiles) {
    if (total_tiles <= 0) return 1;
    const long long c = ((long long)a.splits * a.batch * tiles + total_tiles - 1) / total_tiles;
    return (int)min(max(c, 1LL), (long long)a.max_splits);
}

// What fd_balance_block gives a block: its sequence b (< 0 for a block past
// the batch's splits), item (K/V head * row tiles + row tile), split, the
// sequence's split count, and cache_seqlens[b] as read (or seqlen).
struct fd_balance_pick {
    int b, item, split, count, len;
};

// Stage 1: which sequence, item and split this block takes. Every thread
// of the block must call it. The lengths are read once: a thread keeps the
// tiles of its first sequence for the scan (batches of up to THREADS
// sequences read nothing twice).
template <int THREADS>
__device__ __noinline__ fd_balance_pick fd_balance_block(fd_balance_args a, int items) {
    constexpr int kWarps = THREADS / 32;
    __shared__ long long warp_tiles[kWarps];
    __shared__ int warp_blocks[kWarps];
    __shared__ fd_balance_pick pick;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    // The batch's key tiles, summed over the block.
    int raw0 = a.seqlen, tiles0 = 0;  // this thread's first sequence: its length as read, its tiles
    if ((int)threadIdx.x < a.batch) {
        if (a.lens != nullptr) raw0 = a.lens[threadIdx.x];
        tiles0 = fd_balance_tiles(a, raw0);
    }
    long long t = tiles0;
    for (int i = threadIdx.x + THREADS; i < a.batch; i += THREADS) t += fd_balance_tiles(a, fd_balance_len(a, i));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) t += __shfl_xor_sync(0xffffffffu, t, off);
    if (lane == 0) warp_tiles[warp] = t;
    if (threadIdx.x == 0) pick = {-1, 0, 0, 0, 0};
    __syncthreads();
    long long total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += warp_tiles[w];

    // Each sequence's blocks (c_b an item), scanned THREADS sequences at a
    // time; the thread whose sequence holds this block's index names it.
    int base = 0;  // blocks of the sequences before this group
    for (int i0 = 0; i0 < a.batch; i0 += THREADS) {
        const int i = i0 + threadIdx.x;
        const int raw = i0 == 0 ? raw0 : (i < a.batch ? fd_balance_len(a, i) : 0);
        const int tiles = i0 == 0 ? tiles0 : fd_balance_tiles(a, raw);
        const int c = i < a.batch ? fd_balance_splits_of(a, tiles, total) : 0;
        const int n = c * items;
        int incl = n;  // inclusive scan within the warp
#pragma unroll
        for (int off = 1; off < 32; off *= 2) {
            const int x = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += x;
        }
        if (lane == 31) warp_blocks[warp] = incl;
        __syncthreads();
        int before = 0, group = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const int x = warp_blocks[w];
            before += w < warp ? x : 0;
            group += x;
        }
        const int lo = base + before + incl - n;
        if (n > 0 && (int)blockIdx.x >= lo && (int)blockIdx.x < lo + n) {
            const int k = blockIdx.x - lo;
            pick = {i, k / c, k % c, c, raw};
        }
        base += group;
        __syncthreads();  // pick is set; warp_blocks may be written again
    }
    return pick;
}

// Batch-invariant splits (p.invariant_tiles > 0, core Plan.InvariantTiles):
// sequence b's split count from its own length alone,
//     tiles_b = ceil(keys_b / tile keys), at most p.invariant_span_tiles where set (a window)
//     per_b   = max(p.invariant_tiles, ceil(tiles_b / p.invariant_max_splits))
//     c_b     = clamp(ceil(tiles_b / per_b), 1, p.num_splits)
// keys_b counted as stage 1 counts them (fd_attended_keys, with the
// sequence's own new tokens: fd_new_tokens). Stage 1 deals
// b's tiles round robin by c_b and the combine merges its c_b splits in
// order, so neither the batch, the other lengths, the grid nor the SMs
// reach its bits. The clamp to the grid's num_splits binds only for a
// length past the plan's bound (max_seqlen_k): the workspace stays safe.
__device__ __forceinline__ int fd_invariant_splits(const fd_params &p, int b, int len) {
    const int n_new = fd_new_tokens(p, b);
    int tiles = (fd_attended_keys(len, n_new, p.seqlen_cache) + p.balance_tile_keys - 1) / p.balance_tile_keys;
    if (p.invariant_span_tiles > 0) tiles = min(tiles, p.invariant_span_tiles);
    const int per = max(p.invariant_tiles, (tiles + p.invariant_max_splits - 1) / p.invariant_max_splits);
    return min(max((tiles + per - 1) / per, 1), p.num_splits);
}

// The split count c_b of output row `row`'s sequence (batch, head, query
// order), for the balanced combine (fd_combine_*_bal): each warp works it
// out from the lengths as stage 1 did, every lane calling (batch-invariant
// splits: from the sequence's own length). It runs before the combine's
// PDL wait: stage 1's blocks let the combine in only after their own wait,
// so the lengths are final by then, and the count is ready when the
// partials are.
__device__ __forceinline__ int fd_row_splits(const fd_params &p, int row) {
    const fd_balance_args a = fd_balance_args_of(p);
    const int b = min(row / (p.heads_q * p.seqlen_q), a.batch - 1);
    if (p.invariant_tiles > 0) return fd_invariant_splits(p, b, fd_balance_len(a, b));
    long long total = 0;
    for (int i = threadIdx.x % 32; i < a.batch; i += 32) total += fd_balance_tiles(a, fd_balance_len(a, i));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
    return fd_balance_splits_of(a, fd_balance_tiles(a, fd_balance_len(a, b)), total);
}

#endif  // FLASHDECODE_BALANCE_CUH
