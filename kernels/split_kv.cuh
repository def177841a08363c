// split_kv.cuh: stage 1, the split-KV kernel.
//
// What it does. One block takes one (batch b, KV head, row tile) and one split
// of b's keys. Its query rows are the ROWS "packed" rows r of that KV head:
// query head kv_head*group + r/seqlen_q, query token r%seqlen_q, so every
// query head sharing the KV head (times every query token) rides on one read
// of K and V. It computes softmax(q k^T * scale) v over its keys with an
// online softmax and writes either the final output (one split), or a
// normalized fp32 partial output and its natural-log LSE for the combine,
// or, launched in clusters of num_splits blocks (sm_90), merges the splits
// with the other blocks of its cluster and writes the final output (see
// cluster_merge.cuh).
//
// Launch shape. grid (num_splits, heads_kv * row_tiles, batch);
// blockIdx.y = kv_head * row_tiles + row_tile. Or, for a grid of more
// items (batch, K/V head, row tile) than the GPU holds at once, a 1-D grid
// (p.whole_items > 0, core.Plan.WholeItems): blocks 0..whole_items-1 each
// take one whole item and write the output, and the items after those
// follow in num_splits consecutive blocks each, writing partials for the
// combine, so that the last wave's smaller blocks fill the slots the first
// wave frees instead of landing two to an SM on a few SMs. Or, with
// balanced splits (p.balance_splits > 0, balance.cuh), a 1-D grid whose
// blocks work out their sequence, item and split from all the lengths once
// they are released. KEYS (keys per tile) =
// 8192 / D, so one tile of K plus one of V is always 32 KiB; a warp owns 16
// keys of a tile (32 at D 64, two groups of 16: see kKeyGroups), and at D
// 256 two warps share each 16 keys, one per half of the output columns (see
// kDimSplit):
//     D  64: 128 keys, 4 warps (32 keys each), 128 threads
//     D 128:  64 keys, 4 warps, 128 threads
//     D 256:  32 keys, 4 warps (2 x 2 halves of D), 128 threads
// Dynamic shared memory = STAGES * 2 * KEYS * D * sizeof(T) = 3 * 32 KiB
// = 98304 bytes for every variant (core/variants.go SharedBytes): two blocks
// fit on an H100/H200 SM (228 KB) and one on sm_86/sm_89 (99 KB a block).
// The split of the keys happens here at run time from the actual length, so
// a captured CUDA graph stays right when cache_seqlens changes: the length's
// key tiles are dealt round robin, split s taking tiles s, s + num_splits,
// s + 2 num_splits, ... (why: at the tile loop, below). A
// cluster launch (cluster dims (num_splits, 1, 1)) asks for 120 KB of
// dynamic shared memory (core/variants.go ClusterSharedBytes) so that the
// blocks of a cluster land on separate SMs; the kernel still uses 96 KB.
//
// Why it is fast. Decode attention reads each K/V byte once and does little
// math with it, so the kernel is a streaming read: a 3-stage cp.async
// pipeline keeps two 32 KiB tiles in flight per block (four per SM on sm_90)
// while the warps compute on the third, with 16-byte copies straight into
// XOR-swizzled shared memory (no bank conflicts for ldmatrix). The math runs
// on tensor cores (mma.sync m16n8k16, fp32 accumulation): ROWS packed rows
// are 16 or 32 rows of the mma's M, each warp owns 16 keys of every tile (32
// at D 64) with its own online-softmax state, and the warps merge their states once at the
// end, so a tile needs a single __syncthreads. Softmax is fp32 with exp2
// (fd_exp2_ftz) on scores pre-multiplied by scale*log2(e). Launched with
// programmatic dependent launch (optional, sm_90), the combine grid is
// scheduled while this one drains instead of after it (see fd_pdl_wait in
// ptx.cuh).
//
// The serving variants (fd_split_kv_serving_*, kServing) are this kernel
// with FlashAttention's kv-cache features, same launch shapes, dynamic
// shared memory and reduce paths; the plain variants compile without any of
// it. Keys are absolute cache indices: b's keys are [lo, len), len =
// cache_seqlens[b] + seqlen_new (clamped), lo = cache_leftpad[b]; query row
// i sits at pos_i = len - seqlen_q + i and sees [max(lo, pos_i - left),
// min(len, pos_i + right + 1)) (causal: right 0). The block's tiles start at
// the tile of its rows' first visible key, so a window reads only its keys.
// K/V rows come from cache row cache_batch_idx[b], or key by key from the
// pages of block_table, whose entries a small static shared-memory ring
// holds two tiles ahead (fd_serving_pages). Scores are softcapped, then get
// ALiBi's -slope |pos_i - j|. q is read from q_rot (rotated by
// fd_append_kv, append_kv.cuh, which also wrote the new keys) when rotary
// is on. The paged variants (fd_split_kv_paged_*, kPaged) are the serving
// kernel for its most common call: a paged cache whose pages hold a
// multiple of 8 keys, appended keys and a rotated q, nothing else. A
// thread there copies its chunk of 8 (4 at D 64) consecutive keys, which
// lie in one page, so it looks up one page id a tile instead of sharing
// one lookup a key by shuffle, and its tiles skip the other features'
// per-tile work: a paged call then runs about as fast as a contiguous one.
// The appending forms (kFused: a few new tokens, no rotary;
// fd_split_kv_paged_append_* for such a paged cache, fd_split_kv_append_*
// for a contiguous cache with no other feature) also read the new keys from
// k_new / v_new and write them into the cache themselves (fd_fused_append),
// so no append kernel runs before them. Each is a form of its own, so that
// no other form's loop is the longer for it.
#ifndef FLASHDECODE_SPLIT_KV_CUH
#define FLASHDECODE_SPLIT_KV_CUH

#include "balance.cuh"
#include "cluster_merge.cuh"
#include "params.h"
#include "partials.cuh"
#include "ptx.cuh"
#include "split_kv_config.cuh"
#include "state.cuh"

// FD_TRACE(i): a timestamp hook for dev/trace/trace.cu, which defines it
// to record %globaltimer per block at six points (1: released from the PDL
// wait, 7: the first tiles' copies begin, 8: they are issued, 2: first tile
// landed, 3: loop done, 4: rows written). Empty in the library build.
#ifndef FD_TRACE
#define FD_TRACE(i)
#endif

// The serving features (kServing, the fd_split_kv_serving_* variants; their
// fields are the last ones of fd_params) are steps of the kernel done by the
// helpers below it, declared here; the plain variants' helpers are empty.
__device__ __forceinline__ int fd_serving_first_key(const fd_params &p, int len, int lo, int row0, int n_rows);
template <bool kServing>
struct fd_serving_q;
template <typename T>
__device__ __forceinline__ void fd_serving_bases(const fd_params &p, int b, int kv_head, const T *&q_base,
                                                 const T *&k_base, const T *&v_base, fd_serving_q<true> &q);
template <bool kServing, int KEYS, int AHEAD>
struct fd_serving_pages;
template <typename T, int THREADS, bool kPaged, typename PAGES>
__device__ __forceinline__ void fd_fused_append(const fd_params &p, const PAGES &pages, int b, int kv_head, int base);
template <bool kServing, int MTILES>
struct fd_serving_rows;
template <bool kServing>
struct fd_serving_score;
// A compile-time flag passed as an argument, for a generic lambda to branch on.
template <bool B>
struct fd_bool {
    static constexpr bool value = B;
};

// Stage 1's forms (fd_split_kv_body's FORM): the plain kernel; the paged
// kernel, for a paged cache whose pages hold a multiple of 8 keys, with or
// without appended keys and a rotated q, and nothing else (no
// cache_batch_idx, leftpad, window, softcap or ALiBi); the same appending
// a few new tokens itself, without rotary (core.Plan.FusedAppend); the
// appending form of a contiguous cache with no other feature; and the
// serving kernel, with every feature. core.Form names them in Go.
enum fd_form { fd_form_plain, fd_form_paged, fd_form_paged_append, fd_form_append, fd_form_serving };

// Whether a stage-1 body balances its splits by the lengths (balance.cuh;
// fd_split_kv_body's BALANCE): never, always, or where p.balance_splits > 0.
// The plain kernel compiles its body twice, without and with, so that its
// plans without balanced splits run the code they would without the
// feature; the other forms test p.balance_splits in one body, since as two
// their balanced plans ran slower (docs/tuning.md), except at 32 rows a
// block, which already run at their register limit and never balance
// (core.Variant.Balances).
enum fd_balance { fd_balance_off, fd_balance_on, fd_balance_by_params };

template <typename T, int D, int ROWS, int FORM, int BALANCE>
__device__ __forceinline__ void fd_split_kv_body(const fd_params &p, uint64_t &merge_bar, float *xchg,
                                                 int *page_ring) {
    using C = fd_split_kv_config<D, ROWS>;
    using DT = fd_dtype<T>;
    constexpr bool kServing = FORM == fd_form_serving;                          // every serving feature
    constexpr bool kFused = FORM == fd_form_paged_append || FORM == fd_form_append;  // appends itself
    constexpr bool kPaged = FORM == fd_form_paged || FORM == fd_form_paged_append;   // pages of a multiple of 8 keys
    constexpr bool kPages = kServing || kPaged;  // reads block_table (when set) through the page ring
    constexpr bool kCache = kPages || kFused;    // the fields all but the plain form read: appended keys, q_rot

    // This block's item (sequence b, K/V head, row tile) and split of it.
    int split = blockIdx.x, item_y = blockIdx.y, b = blockIdx.z, num_splits = p.num_splits;
    if (p.whole_items > 0) {  // 1-D grid: whole items first, then the rest split (params.h)
        int item = blockIdx.x;
        split = 0;
        num_splits = 1;
        if (item >= p.whole_items) {
            const int t = item - p.whole_items;
            item = p.whole_items + t / p.num_splits;
            split = t % p.num_splits;
            num_splits = p.num_splits;
        }
        item_y = item % (p.heads_kv * p.row_tiles);
        b = item / (p.heads_kv * p.row_tiles);
    }
    int kv_head = item_y / p.row_tiles;
    int row0 = (item_y % p.row_tiles) * ROWS;  // first packed row of this block (balanced: set after the wait)
    const int warp = threadIdx.x / 32;
    // Which keys of a tile, and which kWarpDim of the head dim (both known
    // at compile time to be the whole head dim where kDimSplit is 1).
    const int key_warp = C::kDimSplit > 1 ? warp % C::kKeyWarps : warp;
    const int dim_part = C::kDimSplit > 1 ? warp / C::kKeyWarps : 0;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;  // mma "group": the row (and key column pair) a lane holds
    const int t4 = lane % 4;
    const int packed_rows = p.group * p.seqlen_q;

    // In a cluster launch of a push-merge variant, the barrier the other
    // blocks' pushes to this block's inbox count on, set up before anything
    // else so that it is long visible to them when they push
    // (fd_cluster_push_merge, cluster_merge.cuh).
    const int cluster_n = fd_cluster_size();  // 1 outside a cluster launch
    const bool clustered = cluster_n > 1;
    if (C::kPushMerge && clustered) {
        if (threadIdx.x == 0) fd_mbar_init(&merge_bar);
        fd_cluster_arrive_relaxed();
    }

    // Where this block reads, computed before the PDL wait so that the
    // argument loads behind it overlap the wait (fd_touch_params, ptx.cuh).
    // The serving variants also read the serving fields (cache_batch's line
    // and seqlen_new's) right after the wait.
    const T *q_base = fd_ptr<const T>(p.q) + b * p.q_batch_stride;
    const T *k_base = fd_ptr<const T>(p.k) + b * p.k_batch_stride + kv_head * p.k_head_stride;
    const T *v_base = fd_ptr<const T>(p.v) + b * p.v_batch_stride + kv_head * p.v_head_stride;
    if constexpr (kCache) fd_touch_params(q_base, k_base, v_base, p.seqlen, p.cache_batch, p.seqlen_new);
    else fd_touch_params(q_base, k_base, v_base, p.seqlen);

    // Where a plan's splits are a tile or two (core.Plan.PrefetchTiles), the
    // block's keys start on their way into L2 now, while the kernel before
    // it still runs, instead of after the wait: the lengths are not known
    // yet, so it sends the tiles of the planned length.
    if constexpr (!kCache) {
        if (p.prefetch_tiles > 0) {
            const int planned = p.cache_seqlens ? p.seqlen_cache : min(p.seqlen, p.seqlen_cache);
            const int chunk = threadIdx.x % C::kChunks;
            for (int s = 0; s < p.prefetch_tiles && s < C::kStages - 1; ++s) {
#pragma unroll
                for (int i = 0; i < C::kCopiesPerThread; ++i) {
                    const int key = (split + s * num_splits) * C::kKeys + threadIdx.x / C::kChunks +
                                    i * C::kCopyKeyStep;
                    if (key < planned && chunk * 8 < p.head_dim) {
                        fd_prefetch_l2(k_base + (long long)key * p.k_seq_stride + chunk * 8);
                        fd_prefetch_l2(v_base + (long long)key * p.v_seq_stride + chunk * 8);
                    }
                }
            }
        }
    }

    // With programmatic dependent launch: wait for the kernel that wrote q
    // (or the lengths), then, if the plan says so (core.Plan.EarlyDependents:
    // a combine follows, or this grid has no more blocks than SMs), let the
    // next kernel be scheduled behind this grid now, its blocks waiting in
    // their own fd_pdl_wait on the slots this grid leaves free. Otherwise it
    // is let in once this block's loop is done (below): the next kernel is
    // often this one again (the next layer), and scheduled from here, its
    // blocks would take every free slot while this grid streams and then
    // find themselves two to an SM on some SMs and none on others.
    fd_pdl_wait();
    if (p.early_dependents) fd_pdl_launch_dependents();
    FD_TRACE(1);

    // Balanced splits (balance.cuh): which sequence, item and split this
    // block takes comes from the lengths, known only now.
    const bool balanced = BALANCE == fd_balance_on || (BALANCE == fd_balance_by_params && p.balance_splits > 0);
    int balanced_len = 0;  // cache_seqlens[b], as the balancing read it
    if (balanced) {
        const fd_balance_pick at = fd_balance_block<C::kThreads>(fd_balance_args_of(p), p.heads_kv * p.row_tiles);
        if (at.b < 0) return;
        b = at.b, item_y = at.item, split = at.split, num_splits = at.count, balanced_len = at.len;
        kv_head = item_y / p.row_tiles;
        row0 = (item_y % p.row_tiles) * ROWS;
        q_base = fd_ptr<const T>(p.q) + b * p.q_batch_stride;
        k_base = fd_ptr<const T>(p.k) + b * p.k_batch_stride + kv_head * p.k_head_stride;
        v_base = fd_ptr<const T>(p.v) + b * p.v_batch_stride + kv_head * p.v_head_stride;
    }

    // Serving: where the keys of a tile are (fd_serving_pages). A paged
    // cache with no left padding and no window (always, in the paged form)
    // starts every split at key 0, so the page ids of the prologue's tiles
    // are fetched now, in flight with the length: the first keys then wait
    // on one read, not two.
    fd_serving_pages<kPages, C::kKeys, C::kStages - 1> pages(p, page_ring);
    bool pages_early = false;
    if constexpr (kPages) {
        pages_early = kPaged || (p.block_table != 0 && p.window_left < 0 && p.cache_leftpad == 0);
        if (pages_early) {
#pragma unroll
            for (int s = 0; s < C::kStages - 1; ++s) pages.fetch(p, b, split + s * num_splits, s, 0, p.seqlen_cache);
        }
    }

    // This split's keys, from the actual length (never from the host): its
    // i-th tile is tile split + i * num_splits of the sequence's `tiles`
    // (serving: counted from first_tile).
    // base: the keys before this call's new ones. In the appending forms
    // (kFused) keys from base on are the new tokens, read from k_new / v_new
    // (token key - base), while block (split 0, row tile 0) writes them into
    // the cache.
    const int base = balanced ? balanced_len : p.cache_seqlens ? fd_ptr<const int>(p.cache_seqlens)[b] : p.seqlen;
    // The appended tokens are keys too (balance.cuh); the plain forms append none.
    const int len = fd_attended_keys<kCache>(base, p.seqlen_new, p.seqlen_cache);
    // Serving: keys before lo (the left padding) are never visible, and the
    // block starts at the tile of the first key any of its rows sees.
    int lo = 0, first_tile = 0;
    fd_serving_q<kCache> q_strides;
    if constexpr (kServing) {
        lo = p.cache_leftpad ? min(max(fd_ptr<const int>(p.cache_leftpad)[b], 0), len) : 0;
        first_tile = fd_serving_first_key(p, len, lo, row0, min(ROWS, packed_rows - row0)) / C::kKeys;
    }
    if constexpr (kCache) fd_serving_bases(p, b, kv_head, q_base, k_base, v_base, q_strides);
    const int tiles = (len + C::kKeys - 1) / C::kKeys - first_tile;
    const int n_tiles = split < tiles ? (tiles - split + num_splits - 1) / num_splits : 0;

    // The pipeline: stage s holds a K tile then a V tile, keys row-major.
    T *smem = reinterpret_cast<T *>(fd_dynamic_smem);
    const int copy_chunk = threadIdx.x % C::kChunks;
    const int copy_key = threadIdx.x / C::kChunks;
    const bool chunk_in_dim = copy_chunk * 8 < p.head_dim;
    const long long k_copy_stride = C::kCopyKeyStep * p.k_seq_stride, v_copy_stride = C::kCopyKeyStep * p.v_seq_stride;
    // The appending forms' copy of a key that may be a new token (gkey >=
    // base): from k_new / v_new instead of its cache row (k_src, v_src).
    auto copy_new = [&](T *k_s, T *v_s, int s_off, int gkey, bool valid, const T *k_src, const T *v_src) {
        const bool fresh = gkey >= base;
        const T *k_from = fresh ? fd_ptr<const T>(p.k_new) + b * p.k_new_batch_stride +
                                      (long long)(gkey - base) * p.k_new_seq_stride + kv_head * p.k_new_head_stride +
                                      copy_chunk * 8
                                : k_src;
        const T *v_from = fresh ? fd_ptr<const T>(p.v_new) + b * p.v_new_batch_stride +
                                      (long long)(gkey - base) * p.v_new_seq_stride + kv_head * p.v_new_head_stride +
                                      copy_chunk * 8
                                : v_src;
        fd_cp_async_16(k_s + s_off, k_from, valid);
        fd_cp_async_16(v_s + s_off, v_from, valid);
    };
    // Serving: keys outside [lo, len) are zero-filled (masked, and never NaN
    // in P V), and the pages come from the ring (fd_serving_pages).
    auto load_tile = [&](int tile, int stage, int j) {  // j: the split's j-th tile
        T *k_s = smem + stage * 2 * C::kTileElems;
        T *v_s = k_s + C::kTileElems;
        if constexpr (kServing) {
            // A thread's copies from a paged cache (paged: fd_bool<true>) or a
            // contiguous one, each layout a straight run of cp.async: a layout
            // test per key would split the copies into blocks of their own,
            // which the compiler cannot interleave.
            auto copies = [&](auto paged) {
                // A paged key's row is the same for the kChunks threads that
                // copy its chunks: lane l works out the row of its copy
                // l % kCopiesPerThread, and the others take it by shuffle.
                unsigned long long k_mine = 0, v_mine = 0;  // the row's address
                if constexpr (decltype(paged)::value) {
                    const int key = copy_key + lane % C::kCopiesPerThread * C::kCopyKeyStep;
                    long long k_off = 0, v_off = 0;  // branch-free: cp.async skips an invalid key
                    pages.offsets(p, pages.page_id(j, key), tile * C::kKeys + key, k_off, v_off);
                    k_mine = reinterpret_cast<unsigned long long>(k_base + k_off);
                    v_mine = reinterpret_cast<unsigned long long>(v_base + v_off);
                }
#pragma unroll
                for (int i = 0; i < C::kCopiesPerThread; ++i) {
                    const int key = copy_key + i * C::kCopyKeyStep;
                    const int gkey = tile * C::kKeys + key;
                    const bool valid = chunk_in_dim && gkey >= lo && gkey < len;
                    const T *k_src, *v_src;
                    if constexpr (decltype(paged)::value) {
                        const int from = (lane & ~(C::kChunks - 1) & 31) | i;  // the lane of copy i of this key group
                        k_src = reinterpret_cast<const T *>(__shfl_sync(0xffffffffu, k_mine, from)) + copy_chunk * 8;
                        v_src = reinterpret_cast<const T *>(__shfl_sync(0xffffffffu, v_mine, from)) + copy_chunk * 8;
                    } else {
                        k_src = k_base + (long long)gkey * p.k_seq_stride + copy_chunk * 8;
                        v_src = v_base + (long long)gkey * p.v_seq_stride + copy_chunk * 8;
                    }
                    const int s_off = fd_swizzle<D>(key, copy_chunk);
                    fd_cp_async_16(k_s + s_off, k_src, valid);
                    fd_cp_async_16(v_s + s_off, v_src, valid);
                }
            };
            if (p.block_table != 0) copies(fd_bool<true>{});
            else copies(fd_bool<false>{});
            pages.fetch(p, b, tile + (C::kStages - 1) * num_splits, j + C::kStages - 1, lo, len);
        } else if constexpr (kPaged) {
            // A thread copies its chunk of kCopiesPerThread consecutive keys,
            // which lie in one page (pages hold a multiple of them): one page
            // lookup a thread, and each further key a stride on.
            const int key0 = copy_key * C::kCopiesPerThread;
            const int gkey0 = tile * C::kKeys + key0;
            long long k_off = copy_chunk * 8, v_off = copy_chunk * 8;
            pages.offsets(p, pages.page_id(j, key0), gkey0, k_off, v_off);
            const T *k_src = k_base + k_off, *v_src = v_base + v_off;
            if (!kFused || gkey0 + C::kCopiesPerThread <= base) {  // no new token among them
#pragma unroll
                for (int i = 0; i < C::kCopiesPerThread; ++i) {
                    const int s_off = fd_swizzle<D>(key0 + i, copy_chunk);
                    const bool valid = chunk_in_dim && gkey0 + i < len;
                    fd_cp_async_16(k_s + s_off, k_src + i * p.k_seq_stride, valid);
                    fd_cp_async_16(v_s + s_off, v_src + i * p.v_seq_stride, valid);
                }
            } else {
#pragma unroll
                for (int i = 0; i < C::kCopiesPerThread; ++i) {
                    const int gkey = gkey0 + i;
                    copy_new(k_s, v_s, fd_swizzle<D>(key0 + i, copy_chunk), gkey, chunk_in_dim && gkey < len,
                             k_src + i * p.k_seq_stride, v_src + i * p.v_seq_stride);
                }
            }
            pages.fetch(p, b, tile + (C::kStages - 1) * num_splits, j + C::kStages - 1, 0, len);
        } else {  // a contiguous cache (the appending forms: a tile holding new tokens apart)
            const bool fresh_tile = kFused && (tile + 1) * C::kKeys > base;
            if (!fresh_tile && chunk_in_dim && (tile + 1) * C::kKeys <= len) {
                // A whole tile of cached keys (every tile but a sequence's
                // last and, appending, those holding new tokens): one row
                // address a thread, each further copy a stride on, and no
                // test a copy. These copies sit on every tile's path to its mmas.
                const long long key = tile * C::kKeys + copy_key;
                const T *k_src = k_base + key * p.k_seq_stride + copy_chunk * 8;
                const T *v_src = v_base + key * p.v_seq_stride + copy_chunk * 8;
#pragma unroll
                for (int i = 0; i < C::kCopiesPerThread; ++i) {
                    const int s_off = fd_swizzle<D>(copy_key + i * C::kCopyKeyStep, copy_chunk);
                    fd_cp_async_16(k_s + s_off, k_src, true);
                    fd_cp_async_16(v_s + s_off, v_src, true);
                    k_src += k_copy_stride;
                    v_src += v_copy_stride;
                }
                return;
            }
#pragma unroll
            for (int i = 0; i < C::kCopiesPerThread; ++i) {
                const int key = copy_key + i * C::kCopyKeyStep;
                const int gkey = tile * C::kKeys + key;
                const bool valid = chunk_in_dim && gkey < len;
                const long long k_off = (long long)(valid ? gkey : 0) * p.k_seq_stride + copy_chunk * 8;
                const long long v_off = (long long)(valid ? gkey : 0) * p.v_seq_stride + copy_chunk * 8;
                const int s_off = fd_swizzle<D>(key, copy_chunk);
                if (fresh_tile) {
                    copy_new(k_s, v_s, s_off, gkey, valid, k_base + k_off, v_base + v_off);
                } else {
                    fd_cp_async_16(k_s + s_off, k_base + k_off, valid);
                    fd_cp_async_16(v_s + s_off, v_base + v_off, valid);
                }
            }
        }
    };

    // Per-warp online softmax over the warp's keys of every tile. For each
    // of its rows a lane keeps the max m (the same in the 4 lanes of a row)
    // and its own share of the sum l; o holds the mma C fragments of the
    // unnormalized output: row g (+8), columns n*8 + 2*t4 (+1).
    float m[C::kMTiles][2], l[C::kMTiles][2];
    float o[C::kMTiles][C::kWarpDim / 8][4];
#pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt) {
        m[mt][0] = m[mt][1] = -CUDART_INF_F;
        l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
        for (int n = 0; n < C::kWarpDim / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    }
    const int warp_key = key_warp * 16 * C::kKeyGroups;  // the warp's first key within a tile
    const int warp_col = dim_part * C::kWarpDim;  // the warp's first output column (and Q K^T dim)
    static_assert(C::kDimSplit == 1 || (C::kDimSplit == 2 && C::kKeyWarps <= 2), "fd_bar_sync<1 + key_warp, 64> pairs the warps of 16 keys");
    static_assert(C::kDimSplit == 1 || C::kKeyGroups == 1, "the score exchange of kDimSplit moves one group of 16 keys (sc[0])");
    // xchg: [warp][score][lane], the Q K^T halves of kDimSplit.

    // The tiles of the splits are dealt round robin rather than in runs of
    // ceil(tiles / num_splits): at any moment the blocks of a sequence read
    // neighbouring tiles instead of addresses a whole split apart (often a
    // power of two), and the blocks end closer together.
    const auto tile_of = [&](int i) { return first_tile + split + i * num_splits; };
    if constexpr (kPages) {  // the pages of the prologue's tiles, before it loads them
        if (!pages_early) {
#pragma unroll
            for (int s = 0; s < C::kStages - 1; ++s) pages.fetch(p, b, tile_of(s), s, lo, len);
        }
        fd_cp_async_commit();
        fd_cp_async_wait<0>();
        __syncthreads();
    }
    FD_TRACE(7);
#pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s) {
        if (s < n_tiles) load_tile(tile_of(s), s, s);
        fd_cp_async_commit();
    }
    FD_TRACE(8);
    // Q as mma A fragments, straight from global memory into registers,
    // loaded once the first tiles' copies are on their way (the first mma
    // waits on those copies, and work ahead of them delays the start of
    // every call; docs/tuning.md), and before the appending forms' append.
    // Lane holds rows g and g+8 of each 16-row tile, columns 2*t4 (+1, +8, +9)
    // of each 16-wide slice of the head dim. Rows past the packed rows and
    // columns past head_dim are zero. Each row's last visible key + 1 goes in
    // key_limit (the length, or the bottom-right causal mask; serving: or the
    // window's right edge, and its first visible key in rows.start).
    uint32_t qf[C::kMTiles][C::kWarpDim / 16][4];
    int key_limit[C::kMTiles][2];
    fd_serving_rows<kServing, C::kMTiles> rows;  // serving: each row's first visible key
#pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + mt * 16 + g + 8 * h;
            const bool valid = r < packed_rows;
            const int qi = valid ? r % p.seqlen_q : 0;
            const int head = kv_head * p.group + (valid ? r / p.seqlen_q : 0);
            const uint32_t *q_row = reinterpret_cast<const uint32_t *>(
                q_base + qi * q_strides.seq(p) + head * q_strides.head(p));
#pragma unroll
            for (int kk = 0; kk < C::kWarpDim / 16; ++kk) {
                const int d0 = dim_part * C::kWarpDim + kk * 16 + 2 * t4;
                qf[mt][kk][h] = valid && d0 < p.head_dim ? q_row[d0 / 2] : 0u;
                qf[mt][kk][2 + h] = valid && d0 + 8 < p.head_dim ? q_row[d0 / 2 + 4] : 0u;
            }
            key_limit[mt][h] = p.causal ? len - p.seqlen_q + qi + 1 : len;
            if constexpr (kServing) rows.set(p, mt, h, len - p.seqlen_q + qi, lo, len, key_limit[mt][h]);
        }
    }

    if constexpr (kFused) {  // the append, once the first tiles are on their way
        if (split == 0 && row0 == 0) fd_fused_append<T, C::kThreads, kPaged>(p, pages, b, kv_head, base);
    }
    const fd_serving_score<kServing> score(p);  // serving: softcap, ALiBi, the rows' key ranges
    // The stage of tile `it`, counted along the loop: no division by kStages a tile.
    int stage = 0;
    for (int it = 0; it < n_tiles; ++it) {
        fd_cp_async_wait<C::kStages - 2>();
        __syncthreads();  // tile `it` landed for all; tile it-1's buffer is free
        if (it == 0) FD_TRACE(2);
        const int next = it + C::kStages - 1;
        const T *k_s = smem + stage * 2 * C::kTileElems;
        const T *v_s = k_s + C::kTileElems;
        if (next < n_tiles) load_tile(tile_of(next), stage == 0 ? C::kStages - 1 : stage - 1, next);
        fd_cp_async_commit();

        const int key0 = tile_of(it) * C::kKeys + warp_key;

        // S = Q K^T for each of the warp's groups of 16 keys: two 8-key mma
        // column tiles, over the warp's kWarpDim dims of the head. Each mma
        // waits on the one before it into the same accumulator, so with one
        // row tile and one group the even and odd 16-dim slices sum apart
        // (kQkChains) and meet at the end: half as long a chain of dependent
        // mmas on every tile.
        float sc[C::kKeyGroups][C::kMTiles][2][4], sc_odd[2][4];  // sc_odd: the odd slices (kQkChains > 1)
#pragma unroll
        for (int kg = 0; kg < C::kKeyGroups; ++kg)
#pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt)
#pragma unroll
                for (int e = 0; e < 8; ++e) sc[kg][mt][e / 4][e % 4] = 0.f;
        if constexpr (C::kQkChains > 1) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sc_odd[e / 4][e % 4] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < C::kWarpDim / 16; ++kk) {
#pragma unroll
            for (int kg = 0; kg < C::kKeyGroups; ++kg) {
                uint32_t kf[4];  // keys 0-7 | 8-15 of the group x dims 16kk..+7 | +8..+15
                fd_ldmatrix_x4(kf, k_s + fd_swizzle<D>(warp_key + kg * 16 + (lane / 16) * 8 + lane % 8,
                                                        (warp_col / 8) + 2 * kk + (lane / 8) % 2));
#pragma unroll
                for (int mt = 0; mt < C::kMTiles; ++mt) {
                    float(&acc)[2][4] = C::kQkChains > 1 && kk % 2 ? sc_odd : sc[kg][mt];
                    DT::mma(acc[0], qf[mt][kk], kf[0], kf[1]);
                    DT::mma(acc[1], qf[mt][kk], kf[2], kf[3]);
                }
            }
        }
        if constexpr (C::kQkChains > 1) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sc[0][0][e / 4][e % 4] += sc_odd[e / 4][e % 4];
        }
        if (C::kDimSplit > 1) {
            // Add the other half's scores (a + b == b + a in fp32, so both
            // warps hold the same scores and softmax state). The buffer is
            // free again after the next tile's __syncthreads.
#pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt)
#pragma unroll
                for (int e = 0; e < 8; ++e) xchg[(warp * C::kMTiles * 8 + mt * 8 + e) * 32 + lane] = sc[0][mt][e / 4][e % 4];
            if (key_warp == 0) fd_bar_sync<1, 64>();
            else fd_bar_sync<2, 64>();
            const int other = (C::kDimSplit - 1 - dim_part) * C::kKeyWarps + key_warp;
#pragma unroll
            for (int mt = 0; mt < C::kMTiles; ++mt)
#pragma unroll
                for (int e = 0; e < 8; ++e) sc[0][mt][e / 4][e % 4] += xchg[(other * C::kMTiles * 8 + mt * 8 + e) * 32 + lane];
        }

        if constexpr (kServing) {
#pragma unroll
            for (int kg = 0; kg < C::kKeyGroups; ++kg)
                score.apply(p, sc[kg], key0 + kg * 16 + 2 * t4, rows, key_limit, b, kv_head, row0 + g, len);
        }

        // Online softmax, one step for all of the warp's keys of the tile;
        // the probabilities become the A fragments of P V.
        uint32_t pf[C::kKeyGroups][C::kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < C::kMTiles; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = -CUDART_INF_F;
#pragma unroll
                for (int kg = 0; kg < C::kKeyGroups; ++kg)
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int key = key0 + kg * 16 + nt * 8 + 2 * t4 + e;
                            float &x = sc[kg][mt][nt][2 * h + e];
                            if constexpr (!kServing)  // (serving: done by score.apply)
                                x = key < key_limit[mt][h] ? x * p.scale_log2 : -CUDART_INF_F;
                            mx = fmaxf(mx, x);
                        }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m[mt][h], mx);
                const float off = fd_state_offset(m_new);
                const float alpha = fd_exp2_ftz(m[mt][h] - off);
                m[mt][h] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int kg = 0; kg < C::kKeyGroups; ++kg)
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float &x = sc[kg][mt][nt][2 * h + e];
                            x = fd_exp2_ftz(x - off);
                            sum += x;
                        }
                l[mt][h] = l[mt][h] * alpha + sum;
#pragma unroll
                for (int n = 0; n < C::kWarpDim / 8; ++n) {
                    o[mt][n][2 * h] *= alpha;
                    o[mt][n][2 * h + 1] *= alpha;
                }
            }
#pragma unroll
            for (int kg = 0; kg < C::kKeyGroups; ++kg) {
                pf[kg][mt][0] = DT::pack(sc[kg][mt][0][0], sc[kg][mt][0][1]);  // row g,   keys 2t4, +1
                pf[kg][mt][1] = DT::pack(sc[kg][mt][0][2], sc[kg][mt][0][3]);  // row g+8, keys 2t4, +1
                pf[kg][mt][2] = DT::pack(sc[kg][mt][1][0], sc[kg][mt][1][1]);  // row g,   keys 8+2t4, +1
                pf[kg][mt][3] = DT::pack(sc[kg][mt][1][2], sc[kg][mt][1][3]);  // row g+8, keys 8+2t4, +1
            }
        }

        // O += P V over the warp's keys and kWarpDim output columns, 16
        // keys and 16 columns per ldmatrix.
#pragma unroll
        for (int j = 0; j < C::kWarpDim / 16; ++j) {
#pragma unroll
            for (int kg = 0; kg < C::kKeyGroups; ++kg) {
                uint32_t vf[4];  // (keys 0-7 | 8-15 of the group) x dims 16j..+7, then dims 16j+8..+15
                fd_ldmatrix_x4_trans(vf, v_s + fd_swizzle<D>(warp_key + kg * 16 + ((lane / 8) % 2) * 8 + lane % 8,
                                                             (warp_col / 8) + 2 * j + lane / 16));
#pragma unroll
                for (int mt = 0; mt < C::kMTiles; ++mt) {
                    DT::mma(o[mt][2 * j], pf[kg][mt], vf[0], vf[1]);
                    DT::mma(o[mt][2 * j + 1], pf[kg][mt], vf[2], vf[3]);
                }
            }
        }
        stage = stage == C::kStages - 1 ? 0 : stage + 1;
    }
    fd_cp_async_wait<0>();
    __syncthreads();  // pipeline buffers are now the merge scratch
    if (!p.early_dependents) fd_pdl_launch_dependents();  // the next kernel's launch overlaps the merge and writes
    FD_TRACE(3);

    // Each warp parks its state and unnormalized output in shared memory
    // (the halves of D share a key warp's row; their states are the same).
    float *so = reinterpret_cast<float *>(fd_dynamic_smem);  // [key warp][row][D + 8]
    float *sm = so + C::kKeyWarps * ROWS * C::kMergeStride;  // [key warp][row] max
    float *sl = sm + C::kKeyWarps * ROWS;                     // [key warp][row] sum
    float *sw = sl + C::kKeyWarps * ROWS;                     // by row: [row][key warp] weight in the row
    float *slse = sw + ROWS * C::kKeyWarps;                   // by row: [row] base-2 LSE
#pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = l[mt][h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int row = key_warp * ROWS + mt * 16 + g + 8 * h;
#pragma unroll
            for (int n = 0; n < C::kWarpDim / 8; ++n)
                *reinterpret_cast<float2 *>(so + row * C::kMergeStride + warp_col + n * 8 + 2 * t4) =
                    make_float2(o[mt][n][2 * h], o[mt][n][2 * h + 1]);
            if (t4 == 0 && dim_part == 0) {
                sm[row] = m[mt][h];
                sl[row] = sum;
            }
        }
    }
    __syncthreads();

    // Each (row, 4 columns) item below merges the key warps' states of its
    // row, a chain of dependent steps. Where a thread has more than two
    // items (always at 32 rows: 8 at head dim 128; at 16 rows, with 10 or
    // more of them used at head dim 128, 5 at 256), a thread a row merges
    // them once instead, behind one more barrier: each warp's weight in the
    // normalized row (2^(m_w - m) / d; 0 for an empty row) and the row's
    // LSE, so that the items are loads and multiply-adds. The two ways are
    // two copies of the loop (kByRow), so that the test is not made in
    // every item.
    // The workspace holds the rows the combine merges, split by split (partials.cuh).
    const int partial_rows = fd_partial_rows(p);
    float *park_o = so + C::kMergeBytes / 4;  // [ROWS][D]
    float *park_lse = park_o + ROWS * D;      // [ROWS]
    const bool push = C::kPushMerge && clustered;
    const int rank = fd_cluster_rank();
    const int per_block = (C::kItems + cluster_n - 1) / cluster_n;  // items each cluster block owns
    const int block_rows = min(ROWS, packed_rows - row0);
    auto merge_rows = [&](auto by_row) {
        constexpr bool kByRow = decltype(by_row)::value;
        if constexpr (kByRow) {
            if (threadIdx.x < ROWS) {
                const int row = threadIdx.x;
                fd_state st = fd_state_empty();
#pragma unroll
                for (int w = 0; w < C::kKeyWarps; ++w) st.m = fmaxf(st.m, sm[w * ROWS + row]);
                const float off = fd_state_offset(st.m);
                float wt[C::kKeyWarps];
#pragma unroll
                for (int w = 0; w < C::kKeyWarps; ++w) {
                    wt[w] = exp2f(sm[w * ROWS + row] - off);
                    st.d += sl[w * ROWS + row] * wt[w];
                }
                const float inv = fd_state_norm(st);  // no visible key: output 0
#pragma unroll
                for (int w = 0; w < C::kKeyWarps; ++w) sw[row * C::kKeyWarps + w] = wt[w] * inv;
                slse[row] = fd_state_lse2(st);
            }
            __syncthreads();
        }

        // Write 4 columns of one row per thread and step: the output itself
        // (one split), the partials for the combine kernel, or, in a cluster
        // launch, the block's parked rows for the cluster merge.
        if (push) {
            fd_cluster_wait();  // every block's barrier is initialized (arrived at the start)
            if (threadIdx.x == 0)
                fd_mbar_expect_bytes(&merge_bar, fd_cluster_inbox_bytes<D, ROWS>(cluster_n, rank, per_block,
                                                                                 block_rows, (p.head_dim + 3) / 4));
        }
        for (int idx = threadIdx.x; idx < ROWS * (D / 4); idx += C::kThreads) {
            const int row = idx / (D / 4);
            const int d = (idx % (D / 4)) * 4;
            const int r = row0 + row;
            if (r >= packed_rows || d >= p.head_dim) continue;
            fd_state st = fd_state_empty();
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
            if constexpr (kByRow) {
#pragma unroll
                for (int w = 0; w < C::kKeyWarps; ++w)
                    acc = fd_fma4(acc, sw[row * C::kKeyWarps + w],
                                  *reinterpret_cast<const float4 *>(so + (w * ROWS + row) * C::kMergeStride + d));
                st = fd_state{slse[row], 1.f};  // a state of that LSE (fd_state_lse2), acc already normalized
            } else {
#pragma unroll
                for (int w = 0; w < C::kKeyWarps; ++w) {
                    const int wr = w * ROWS + row;
                    float sa, sb;
                    fd_state_merge(st, fd_state{sm[wr], sl[wr]}, sa, sb);
                    acc = fd_axpby4(acc, sa, *reinterpret_cast<const float4 *>(so + wr * C::kMergeStride + d), sb);
                }
                acc = fd_scale4(acc, fd_state_norm(st));  // no visible key: output 0
            }
            if (push) {
                fd_cluster_push<D, ROWS>(&merge_bar, cluster_n, rank, per_block, idx, row, acc, fd_state_lse2(st));
                continue;
            }
            if (clustered) {
                *reinterpret_cast<float4 *>(park_o + row * D + d) = acc;
                if (d == 0) park_lse[row] = fd_state_lse2(st);
                continue;
            }
            const float lse = fd_state_lse2(st) * CUDART_LN2_F;  // natural log; -inf stays -inf
            const int head = kv_head * p.group + r / p.seqlen_q;
            const int qi = r % p.seqlen_q;
            const int out_row = (b * p.heads_q + head) * p.seqlen_q + qi;  // lse / partial row order
            if (p.o_partial == 0 || num_splits == 1) {
                T *out = fd_ptr<T>(p.out) + b * p.out_batch_stride + qi * p.out_seq_stride +
                         head * p.out_head_stride + d;
                fd_store4(out, acc);
                if (d == 0 && p.lse != 0) fd_ptr<float>(p.lse)[out_row] = lse;
            } else {
                const long long prow = (long long)split * partial_rows + fd_partial_row(p, out_row);
                *reinterpret_cast<float4 *>(fd_ptr<float>(p.o_partial) + prow * p.head_dim + d) = acc;
                if (d == 0) fd_ptr<float>(p.lse_partial)[prow] = lse;
            }
        }
    };
    if constexpr (C::kMergeByRow) merge_rows(fd_bool<true>{});
    else if (block_rows * (D / 4) > 2 * C::kThreads) merge_rows(fd_bool<true>{});
    else merge_rows(fd_bool<false>{});
    FD_TRACE(4);
    if (push) fd_cluster_push_merge<T, D, ROWS>(p, &merge_bar, cluster_n, rank, per_block, b, kv_head, row0);
    else if (clustered) fd_split_kv_cluster_merge<T, D, ROWS>(p, park_o, park_lse, b, kv_head, row0);
}

// The two kernels, each with its own static shared memory: the cluster
// merge's barrier, the kDimSplit score exchange and (serving) the page ring.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void fd_split_kv(const fd_params &p) {
    __shared__ uint64_t merge_bar;
    __shared__ float xchg[fd_split_kv_config<D, ROWS>::kXchg];
    if (p.balance_splits > 0) fd_split_kv_body<T, D, ROWS, fd_form_plain, fd_balance_on>(p, merge_bar, xchg, nullptr);
    else fd_split_kv_body<T, D, ROWS, fd_form_plain, fd_balance_off>(p, merge_bar, xchg, nullptr);
}

// The paged and the serving forms (FORM), with the page ring.
template <typename T, int D, int ROWS, int FORM>
__device__ __forceinline__ void fd_split_kv_serving(const fd_params &p) {
    __shared__ uint64_t merge_bar;
    __shared__ float xchg[fd_split_kv_config<D, ROWS>::kXchg];
    using C = fd_split_kv_config<D, ROWS>;
    __shared__ int page_ring[2 * (C::kStages - 1) * C::kKeys];  // fd_serving_pages
    constexpr int kBalance = ROWS == 32 ? fd_balance_off : fd_balance_by_params;
    fd_split_kv_body<T, D, ROWS, FORM, kBalance>(p, merge_bar, xchg, page_ring);
}

// The serving helpers (declared above the kernel), in the order the kernel
// calls them.

// The first key any of a block's rows sees: lo, or with a left window the
// window start of its earliest query token. The rows are consecutive tokens
// of consecutive heads, so the earliest is row0's unless they wrap past the
// last token (and then token 0).
__device__ __forceinline__ int fd_serving_first_key(const fd_params &p, int len, int lo, int row0, int n_rows) {
    if (p.window_left < 0) return lo;
    const int q0 = row0 % p.seqlen_q;
    const int q_min = q0 + n_rows > p.seqlen_q ? 0 : q0;
    return (int)max((long long)lo, (long long)len - p.seqlen_q + q_min - p.window_left);
}

// Where the block reads, once the lengths and indices may be read: the cache
// row cache_batch_idx[b] (clamped) instead of b, no row at all for a paged
// cache (fd_serving_pages adds the page), and the rotated q, which
// fd_append_kv wrote contiguous, when rotary is on.
template <bool kServing>
struct fd_serving_q {  // the plain variants read q with its own strides
    __device__ __forceinline__ long long seq(const fd_params &p) const { return p.q_seq_stride; }
    __device__ __forceinline__ long long head(const fd_params &p) const { return p.q_head_stride; }
};

template <>
struct fd_serving_q<true> {  // q's strides, or the rotated copy's
    long long seq_stride = 0, head_stride = 0;
    bool rotated = false;
    __device__ __forceinline__ long long seq(const fd_params &p) const { return rotated ? seq_stride : p.q_seq_stride; }
    __device__ __forceinline__ long long head(const fd_params &p) const {
        return rotated ? head_stride : p.q_head_stride;
    }
};

template <typename T>
__device__ __forceinline__ void fd_serving_bases(const fd_params &p, int b, int kv_head, const T *&q_base,
                                                 const T *&k_base, const T *&v_base, fd_serving_q<true> &q) {
    long long row = 0;
    if (p.block_table == 0) row = p.cache_batch_idx ? min(max(fd_ptr<const int>(p.cache_batch_idx)[b], 0), p.cache_batch - 1) : b;
    k_base = fd_ptr<const T>(p.k) + row * p.k_batch_stride + kv_head * p.k_head_stride;
    v_base = fd_ptr<const T>(p.v) + row * p.v_batch_stride + kv_head * p.v_head_stride;
    if (p.rotary_cos != 0) {
        q.rotated = true;
        q.head_stride = p.head_dim;
        q.seq_stride = (long long)p.heads_q * p.head_dim;
        q_base = fd_ptr<const T>(p.q_rot) + b * p.seqlen_q * q.seq_stride;
    }
}

// key / page_size for 0 <= key < 2^31 as a multiply and a shift, with the
// magic numbers the core worked out (params.h: page_div_m, page_div_l).
struct fd_serving_divider {
    uint32_t m;
    int l;
    __device__ __forceinline__ explicit fd_serving_divider(const fd_params &p) : m(p.page_div_m), l(p.page_div_l) {}
    __device__ __forceinline__ int div(int n) const {
        return static_cast<int>((__umulhi(static_cast<uint32_t>(n), m) + static_cast<uint32_t>(n)) >> l);
    }
};

// Where the keys of a tile are: contiguous rows, or the pages of
// block_table. For a paged cache the block keeps the pages of the keys of
// its split's next tiles in shared memory, those of its j-th tile in
// ring[j % (2 AHEAD)] (KEYS each). load_tile(j) reads them and starts the
// copy of tile j + AHEAD's; with AHEAD the pipeline's depth (kStages - 1)
// that copy joins load_tile(j)'s cp.async group, so it has landed, and
// passed a __syncthreads, when load_tile(j + AHEAD) runs a few tiles of math
// later: no thread waits on the block_table, whose latency behind the cache
// stream is longer than a tile. Twice AHEAD slots: the prologue's loads
// have no barrier between them. Empty for the plain variants.
template <bool kServing, int KEYS, int AHEAD>
struct fd_serving_pages {
    __device__ __forceinline__ fd_serving_pages(const fd_params &, int *) {}
};

template <int KEYS, int AHEAD>
struct fd_serving_pages<true, KEYS, AHEAD> {
    static constexpr int kRing = 2 * AHEAD;  // slots, KEYS ints each
    int *ring;
    fd_serving_divider page_size;

    __device__ __forceinline__ fd_serving_pages(const fd_params &p, int *page_ring)
        : ring(page_ring), page_size(p) {}

    // Starts copying the pages of the keys of `tile`, the split's j-th, into
    // its slot: thread t < KEYS copies key t's (0 for a key outside [lo, len),
    // whose page is never read).
    __device__ __forceinline__ void fetch(const fd_params &p, int b, int tile, int j, int lo, int len) {
        if (p.block_table == 0 || threadIdx.x >= KEYS) return;
        const int gkey = tile * KEYS + threadIdx.x;
        const bool valid = gkey >= lo && gkey < len;
        const int *src = fd_ptr<const int>(p.block_table) + b * p.block_table_stride + (valid ? page_size.div(gkey) : 0);
        fd_cp_async_4(ring + (j % kRing) * KEYS + threadIdx.x, src, valid);
    }

    // Key `key`'s page id from the ring, for the split's j-th tile of a paged
    // cache. load_tile reads a lane's one id before its first copy: cp.async's
    // asm is a compiler barrier, so a read between copies would wait out the
    // shared-memory latency there.
    __device__ __forceinline__ int page_id(int j, int key) const { return ring[(j % kRing) * KEYS + key]; }

    // Adds the offset from k_base / v_base of key gkey of a paged cache (page
    // the key's page_id): its row in its page, the page clamped to the cache.
    // Each lane runs it once a tile (load_tile shares the result by shuffle),
    // so a page's offset is one 32 x 32 -> 64-bit multiply and a row's a
    // 32-bit one: the layout check (core, validateServing) keeps page strides
    // below 2^32 elements and a page's rows below 2^31. Keys outside
    // [lo, len) get an offset too (their ring entry is 0, or the table's
    // entry where the prologue's ids were fetched early), which is never read.
    __device__ __forceinline__ void offsets(const fd_params &p, int page, int gkey, long long &k_off,
                                            long long &v_off) const {
        const uint32_t pg = static_cast<uint32_t>(min(max(page, 0), p.num_pages - 1));
        const uint32_t row = static_cast<uint32_t>(gkey - page_size.div(gkey) * p.page_size);
        k_off += static_cast<long long>(static_cast<unsigned long long>(pg) * static_cast<uint32_t>(p.k_batch_stride) +
                                        row * static_cast<uint32_t>(p.k_seq_stride));
        v_off += static_cast<long long>(static_cast<unsigned long long>(pg) * static_cast<uint32_t>(p.v_batch_stride) +
                                        row * static_cast<uint32_t>(p.v_seq_stride));
    }
};

// The appending forms' append (kFused): K/V head kv_head of sequence b
// writes its new tokens into the cache, token t at key base + t: into its
// page (kPaged) or row b of a contiguous cache, skipping keys outside [0,
// seqlen_cache) and page ids outside [0, num_pages) as fd_append_kv does.
// No block of the grid reads those rows from the cache (they read the new
// tokens from k_new / v_new), so the stores need no ordering within the
// grid; the next kernel sees them after its PDL wait. One 16-byte chunk of
// k and v a thread and step.
template <typename T, int THREADS, bool kPaged, typename PAGES>
__device__ __forceinline__ void fd_fused_append(const fd_params &p, const PAGES &pages, int b, int kv_head, int base) {
    // Token t's row offsets in k and v; false where it is skipped.
    auto row_of = [&](int t, long long &k_row, long long &v_row) {
        const int key = base + t;
        if (key < 0 || key >= p.seqlen_cache) return false;
        if constexpr (kPaged) {
            const int slot = pages.page_size.div(key);
            const int page = fd_ptr<const int>(p.block_table)[b * p.block_table_stride + slot];
            if (page < 0 || page >= p.num_pages) return false;
            const long long row = key - slot * p.page_size;
            k_row = page * p.k_batch_stride + row * p.k_seq_stride;
            v_row = page * p.v_batch_stride + row * p.v_seq_stride;
        } else {
            k_row = b * p.k_batch_stride + (long long)key * p.k_seq_stride;
            v_row = b * p.v_batch_stride + (long long)key * p.v_seq_stride;
        }
        return true;
    };
    // The cache is const to the reads of stage 1.
    T *k_cache = fd_ptr<T>(p.k) + kv_head * p.k_head_stride;
    T *v_cache = fd_ptr<T>(p.v) + kv_head * p.v_head_stride;
    const T *k_new = fd_ptr<const T>(p.k_new) + b * p.k_new_batch_stride + kv_head * p.k_new_head_stride;
    const T *v_new = fd_ptr<const T>(p.v_new) + b * p.v_new_batch_stride + kv_head * p.v_new_head_stride;
    const int chunks = p.head_dim / 8;
    for (int idx = threadIdx.x; idx < p.seqlen_new * chunks; idx += THREADS) {
        const int t = idx / chunks, d0 = (idx % chunks) * 8;
        const uint4 kx = *reinterpret_cast<const uint4 *>(k_new + t * p.k_new_seq_stride + d0);
        const uint4 vx = *reinterpret_cast<const uint4 *>(v_new + t * p.v_new_seq_stride + d0);
        long long k_row, v_row;
        if (!row_of(t, k_row, v_row)) continue;
        *reinterpret_cast<uint4 *>(k_cache + k_row + d0) = kx;
        *reinterpret_cast<uint4 *>(v_cache + v_row + d0) = vx;
    }
}

// A lane's query rows' first visible key (leftpad, left window), next to
// key_limit. Empty for the plain variants.
template <bool kServing, int MTILES>
struct fd_serving_rows {};

template <int MTILES>
struct fd_serving_rows<true, MTILES> {
    int start[MTILES][2];

    // Row (mt, h), at position pos_i, sees keys [start, limit): lo <= j < len,
    // j >= pos_i - left, j <= pos_i + right (causal: right 0).
    __device__ __forceinline__ void set(const fd_params &p, int mt, int h, int pos_i, int lo, int len, int &limit) {
        const int right = p.causal ? 0 : p.window_right;
        start[mt][h] = p.window_left >= 0 ? (int)max((long long)lo, (long long)pos_i - p.window_left) : lo;
        limit = right >= 0 ? (int)min((long long)len, (long long)pos_i + right + 1) : len;
    }
};

// A tile's q.k to the base-2 scores the online softmax takes: times
// scale * log2(e), or softcapped, softcap * log2(e) * tanh(q.k * scale /
// softcap); then ALiBi's -slope * log2(e) * |pos_i - j|; then -inf outside
// the row's [start, limit). The features' tests are uniform and outside the
// per-score loops, and ALiBi's slopes and positions are found per tile
// rather than held in registers. Empty for the plain variants.
template <bool kServing>
struct fd_serving_score {
    __device__ __forceinline__ explicit fd_serving_score(const fd_params &) {}
};

template <>
struct fd_serving_score<true> {
    float cap_in;  // scale / softcap
    __device__ __forceinline__ explicit fd_serving_score(const fd_params &p)
        : cap_in(p.softcap > 0.f ? p.scale / p.softcap : 0.f) {}

    // sc[mt][nt][2h + e]: packed row lane_row + mt * 16 + 8h of (b, kv_head),
    // key key_lane + nt * 8 + e.
    template <int MTILES>
    __device__ __forceinline__ void apply(const fd_params &p, float (&sc)[MTILES][2][4], int key_lane,
                                          const fd_serving_rows<true, MTILES> &rows, const int (&limit)[MTILES][2],
                                          int b, int kv_head, int lane_row, int len) const {
        if (p.softcap > 0.f) {
#pragma unroll
            for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    sc[mt][e / 4][e % 4] = p.softcap_log2 * tanhf(sc[mt][e / 4][e % 4] * cap_in);
        } else {
#pragma unroll
            for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
                for (int e = 0; e < 8; ++e) sc[mt][e / 4][e % 4] *= p.scale_log2;
        }
        if (p.alibi_slopes != 0) {
#pragma unroll
            for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = lane_row + mt * 16 + 8 * h;
                    const bool valid = r < p.group * p.seqlen_q;
                    const int pos = len - p.seqlen_q + (valid ? r % p.seqlen_q : 0);
                    const int head = kv_head * p.group + (valid ? r / p.seqlen_q : 0);
                    const float slope = fd_ptr<const float>(p.alibi_slopes)[b * p.alibi_batch_stride + head] * CUDART_L2E_F;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key_lane + (e / 2) * 8 + e % 2;
                        sc[mt][e / 2][2 * h + e % 2] -= slope * (float)abs(pos - key);
                    }
                }
        }
#pragma unroll
        for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int h = (e % 4) / 2;
                const int key = key_lane + (e / 4) * 8 + e % 2;
                float &x = sc[mt][e / 4][e % 4];
                x = key >= rows.start[mt][h] && key < limit[mt][h] ? x : -CUDART_INF_F;
            }
    }
};

#endif  // FLASHDECODE_SPLIT_KV_CUH
