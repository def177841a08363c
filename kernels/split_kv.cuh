// split_kv.cuh: stage 1, the split-KV kernel.
//
// What it does. One block takes one (batch b, KV head, row tile) and one split
// of b's keys. Its query rows are the ROWS "packed" rows r of that KV head:
// query head kv_head*group + r/seqlen_q, query token r%seqlen_q, so every
// query head sharing the KV head (times every query token) rides on one read
// of K and V. With ragged query lengths (p.cu_seqlens_q, ragged.cuh) the
// tokens past a sequence's own count are padding: zero q, never stored. It
// computes softmax(q k^T * scale) v over its keys with an online softmax
// and writes either the final output (one split), or a
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
// they are released. With batch-invariant splits (p.invariant_tiles > 0,
// balance.cuh) the 3-D grid stays, and each block deals its sequence's
// tiles by that sequence's own split count, exiting past it.
// KEYS (keys per tile) = 8192 / D, so one tile of K plus one of V is always
// 32 KiB; a warp owns 16 keys of a tile (32 at D 64, two groups of 16: see
// kKeyGroups), and at D 256 two warps share each 16 keys, one per half of
// the output columns (see kDimSplit):
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
// fp8 caches. The same kernels with the caches' element type KV an fp8
// byte (fd_split_kv_<dtype>_fp8_*, either format): the tiles hold as many
// keys in half the bytes, copied as they are, so a deeper pipeline
// (fd_split_kv_config::kStages) keeps as many bytes in flight in the same
// shared memory; the warps turn the bytes into q's type as they read them
// (fp8.cuh), and the descales scale the scores and the output in fp32.
//
// The forms. The loop below is written once, against a form (a policy type,
// split_kv_forms.cuh) that gives it its tile loader (load_contiguous.cuh,
// load_paged.cuh, load_serving.cuh), how its rows find their keys and its
// score transform: the plain form, the paged forms (pages of a multiple of
// 8 keys, one page lookup per 8 keys), the appending forms, which write a
// few new tokens themselves (fused_append.cuh), and the serving form with
// every kv-cache feature (serving.cuh). Each is a kernel of its own with the
// same launch shapes, dynamic shared memory and reduce paths; the block's
// end (its warps' merge and its rows' writes, or the cluster merge) is
// split_kv_epilogue.cuh.
#ifndef FLASHDECODE_SPLIT_KV_CUH
#define FLASHDECODE_SPLIT_KV_CUH

#include "balance.cuh"
#include "cluster_merge.cuh"
#include "dev_hooks.h"
#include "fp8.cuh"
#include "load_tile.cuh"
#include "params.h"
#include "ptx.cuh"
#include "ragged.cuh"
#include "sinks.cuh"
#include "split_kv_config.cuh"
#include "split_kv_epilogue.cuh"
#include "split_kv_forms.cuh"
#include "state.cuh"

// Whether a stage-1 body balances its splits by the lengths (balance.cuh;
// fd_split_kv_body's BALANCE): never, always, or where p.balance_splits > 0.
// The plain kernel compiles its body twice, without and with, so that its
// plans without balanced splits run the code they would without the
// feature; the other forms test p.balance_splits in one body, since as two
// their balanced plans ran slower (docs/tuning.md), except at 32 rows a
// block, which already run at their register limit and never balance
// (fd_split_kv_config::kFormsBalance).
enum fd_balance { fd_balance_off, fd_balance_on, fd_balance_by_params };

// KV: the caches' element type, T or (fp8) unsigned char.
template <typename T, typename KV, int D, int ROWS, typename F, int BALANCE>
__device__ __forceinline__ void fd_split_kv_body(const fd_params &p, uint64_t &merge_bar, float *xchg,
                                                 int *page_ring) {
    using C = fd_split_kv_config<D, ROWS, sizeof(KV)>;
    using DT = fd_dtype<T>;
    constexpr bool kFp8 = sizeof(KV) == 1;

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
    // argument loads behind it overlap the wait (F::before_wait).
    const T *q_base = fd_ptr<const T>(p.q) + b * p.q_batch_stride;
    const KV *k_base = fd_ptr<const KV>(p.k) + b * p.k_batch_stride + kv_head * p.k_head_stride;
    const KV *v_base = fd_ptr<const KV>(p.v) + b * p.v_batch_stride + kv_head * p.v_head_stride;
    F::before_wait(p, split, num_splits, q_base, k_base, v_base);

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
        k_base = fd_ptr<const KV>(p.k) + b * p.k_batch_stride + kv_head * p.k_head_stride;
        v_base = fd_ptr<const KV>(p.v) + b * p.v_batch_stride + kv_head * p.v_head_stride;
    }

    // An fp8 cache: its descales (read after the wait), the conversion of
    // its bytes, and what the scores and the output are multiplied by in
    // fp32: the descales and the conversion's factor (fp8.cuh).
    float k_descale = 1.f, v_descale = 1.f, k_mul = 1.f, v_mul = 1.f;
    const fd_fp8_cvt<T> cvt(p.kv_e5m2 != 0);
    if constexpr (kFp8) {
        k_descale = fd_descale(p.k_descale, p.k_descale_batch_stride, p.k_descale_head_stride, p.k_descale_value, b,
                               kv_head);
        v_descale = fd_descale(p.v_descale, p.v_descale_batch_stride, p.v_descale_head_stride, p.v_descale_value, b,
                               kv_head);
        k_mul = k_descale * cvt.fold;
        v_mul = v_descale * cvt.fold;
    }

    if (p.invariant_tiles > 0) {  // batch-invariant: the sequence's own split count (balance.cuh)
        num_splits = fd_invariant_splits(p, b, p.cache_seqlens ? fd_ptr<const int>(p.cache_seqlens)[b] : p.seqlen);
        if (split >= num_splits) return;
    }

    // A paged cache: where the keys of a tile are (the form's page ring).
    // Where every split starts at key 0 (the paged forms; the serving form
    // with no left padding and no window), the page ids of the prologue's
    // tiles are fetched now, in flight with the length: the first keys then
    // wait on one read, not two.
    typename F::pages pages(p, page_ring);
    bool pages_early = false;
    if constexpr (F::pages::kFetches) {
        pages_early = F::kFromKeyZero || (p.block_table != 0 && p.window_left < 0 && p.cache_leftpad == 0);
        if (pages_early) {
#pragma unroll
            for (int s = 0; s < C::kStages - 1; ++s) pages.fetch(p, b, split + s * num_splits, s, 0, p.seqlen_cache);
        }
    }

    // This split's keys, from the actual length (never from the host): its
    // i-th tile is tile split + i * num_splits of the sequence's `tiles`,
    // counted from first_tile (the first any row of the block sees).
    // base: the keys before this call's new ones (the appending forms read
    // keys from base on from k_new / v_new).
    const int base = balanced ? balanced_len : p.cache_seqlens ? fd_ptr<const int>(p.cache_seqlens)[b] : p.seqlen;
    // The forms that append count the sequence's own new tokens, and the
    // serving form's window starts from its rows' positions, so they read
    // the sequence's query rows here (ragged.cuh); the plain form reads them
    // only once its first tiles are on their way (below).
    const int len = F::attended_keys(p, base, fd_new_tokens(p, b));
    int lo = 0, first_tile = 0;  // the visible keys start at lo
    typename F::q_layout q_strides;
    F::key_range(p, b, len, len - fd_q_span_of(p, b).count, row0, packed_rows, lo, first_tile);
    F::bases(p, b, kv_head, q_base, k_base, v_base, q_strides);
    const int tiles = (len + C::kKeys - 1) / C::kKeys - first_tile;
    int n_tiles = split < tiles ? (tiles - split + num_splits - 1) / num_splits : 0;

    // The pipeline: stage s holds a K tile then a V tile, keys row-major,
    // loaded by the form's loader: load_tile(tile, stage, j), j the split's j-th tile.
    KV *smem = reinterpret_cast<KV *>(fd_dynamic_smem);
    const int copy_chunk = threadIdx.x % C::kChunks;
    const int copy_key = threadIdx.x / C::kChunks;
    const bool chunk_in_dim = copy_chunk * C::kChunkElems < p.head_dim;
    const int chunk_bytes = kFp8 ? min(max(p.head_dim - copy_chunk * C::kChunkElems, 0), 16) : 16;
    const long long k_copy_stride = C::kCopyKeyStep * p.k_seq_stride, v_copy_stride = C::kCopyKeyStep * p.v_seq_stride;
    const fd_quant k_quant(k_descale), v_quant(v_descale);  // the appending forms' new tokens (fp8)
    const fd_copy_new<T, KV> copy_new{base, p, b, kv_head, copy_chunk, chunk_bytes, k_quant, v_quant};
    const typename F::loader load_tile{{p, smem, k_base, v_base, b, base, lo, len, num_splits, lane, copy_chunk, copy_key,
                                        chunk_in_dim, chunk_bytes, k_copy_stride, v_copy_stride, pages, copy_new}};

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
    // A paged cache: the prologue's pages, landed before its tiles load.
    if constexpr (F::pages::kFetches) {
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
    // of each 16-wide slice of the head dim (fp8: q's dims permuted as the
    // K fragments' are, below). Rows past the packed rows and
    // columns past head_dim are zero. Each row's last visible key + 1 goes in
    // key_limit (the length, or the bottom-right causal mask; serving: or the
    // window's right edge, and its first visible key in rows.start).
    // The sequence's query rows (ragged.cuh): q from its first (the rotated
    // q keeps the planned rows), query row i at position pos0 + i. A block
    // of padding rows only (its rows' tokens all at or past the count) reads
    // no more keys than the prologue's.
    const fd_q_span span = fd_q_span_of(p, b);
    const int pos0 = len - span.count;
    const T *const q_rows = q_base + q_strides.first_row(span) * q_strides.seq(p);
    if (p.cu_seqlens_q != 0 && fd_first_token(p, row0, min(ROWS, packed_rows - row0)) >= span.count) n_tiles = 0;
    uint32_t qf[C::kMTiles][C::kWarpDim / 16][4];
    int key_limit[C::kMTiles][2];
    typename F::rows rows;  // the serving form: each row's first visible key
#pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + mt * 16 + g + 8 * h;
            const int token = r % p.seqlen_q;
            const bool valid = r < packed_rows && token < span.count;  // ragged padding rows: zero q
            const int qi = valid ? token : 0;
            const int head = kv_head * p.group + (valid ? r / p.seqlen_q : 0);
            const uint32_t *q_row = reinterpret_cast<const uint32_t *>(
                q_rows + qi * q_strides.seq(p) + head * q_strides.head(p));
#pragma unroll
            for (int kk = 0; kk < C::kWarpDim / 16; ++kk) {
                if constexpr (kFp8) {
                    // An fp8 K register of key g holds its dims 4t4..4t4+3,
                    // read as (4t4, 4t4+2) for k 2t4, 2t4+1 and (4t4+1,
                    // 4t4+3) for k 2t4+8, 2t4+9 (fd_fp8_cvt even and odd):
                    // q's dims go the same way.
                    const int d0 = dim_part * C::kWarpDim + kk * 16 + 4 * t4;
                    const bool in = valid && d0 < p.head_dim;
                    const uint32_t w0 = in ? q_row[d0 / 2] : 0u, w1 = in ? q_row[d0 / 2 + 1] : 0u;
                    qf[mt][kk][h] = __byte_perm(w0, w1, 0x5410);
                    qf[mt][kk][2 + h] = __byte_perm(w0, w1, 0x7632);
                } else {
                    const int d0 = dim_part * C::kWarpDim + kk * 16 + 2 * t4;
                    qf[mt][kk][h] = valid && d0 < p.head_dim ? q_row[d0 / 2] : 0u;
                    qf[mt][kk][2 + h] = valid && d0 + 8 < p.head_dim ? q_row[d0 / 2 + 4] : 0u;
                }
            }
            key_limit[mt][h] = p.causal ? pos0 + qi + 1 : len;
            rows.set(p, mt, h, pos0 + qi, lo, len, key_limit[mt][h]);
        }
    }
    // Attention sinks: split 0's key warp 0 starts from the rows' sinks (sinks.cuh).
    if (p.sinks != 0 && split == 0 && key_warp == 0) fd_sink_start(p, kv_head, row0 + g, packed_rows, t4, m, l);

    F::append(p, pages, b, kv_head, base, span, split, row0, k_quant, v_quant);  // the appending forms, once the first tiles are on their way
    const typename F::score score(p);
    // The stage of tile `it`, counted along the loop: no division by kStages a tile.
    int stage = 0;
    for (int it = 0; it < n_tiles; ++it) {
        fd_cp_async_wait<C::kStages - 2>();
        __syncthreads();  // tile `it` landed for all; tile it-1's buffer is free
        if (it == 0) FD_TRACE(2);
        const int next = it + C::kStages - 1;
        const KV *k_s = smem + stage * 2 * C::kTileElems;
        const KV *v_s = k_s + C::kTileElems;
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
        if constexpr (kFp8) {
            // A 16-byte chunk of an fp8 row is a 16-dim slice: one ldmatrix
            // takes two slices of the group's 16 keys, each register 4 dims
            // of a key, read as b0 (even) and b1 (odd) of the slice's mma.
#pragma unroll
            for (int kk = 0; kk < C::kWarpDim / 16; kk += 2) {
#pragma unroll
                for (int kg = 0; kg < C::kKeyGroups; ++kg) {
                    uint32_t kf[4];  // keys 0-7 x slices kk, kk+1, then keys 8-15 x slices kk, kk+1
                    fd_ldmatrix_x4(kf, k_s + fd_kv_swizzle<D, KV>(warp_key + kg * 16 + (lane / 16) * 8 + lane % 8,
                                                                  (warp_col / 16) + kk + (lane / 8) % 2));
#pragma unroll
                    for (int s2 = 0; s2 < 2; ++s2) {
                        const uint32_t b00 = cvt.even(kf[s2]), b01 = cvt.odd(kf[s2]);
                        const uint32_t b10 = cvt.even(kf[2 + s2]), b11 = cvt.odd(kf[2 + s2]);
#pragma unroll
                        for (int mt = 0; mt < C::kMTiles; ++mt) {
                            float(&acc)[2][4] = C::kQkChains > 1 && s2 % 2 ? sc_odd : sc[kg][mt];
                            DT::mma(acc[0], qf[mt][kk + s2], b00, b01);
                            DT::mma(acc[1], qf[mt][kk + s2], b10, b11);
                        }
                    }
                }
            }
        } else {
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

        if constexpr (kFp8) {  // the K descale (and the conversion's factor)
#pragma unroll
            for (int kg = 0; kg < C::kKeyGroups; ++kg)
#pragma unroll
                for (int mt = 0; mt < C::kMTiles; ++mt)
#pragma unroll
                    for (int e = 0; e < 8; ++e) sc[kg][mt][e / 4][e % 4] *= k_mul;
        }
#pragma unroll
        for (int kg = 0; kg < C::kKeyGroups; ++kg)
            score.apply(p, sc[kg], key0 + kg * 16 + 2 * t4, rows, key_limit, b, kv_head, row0 + g, pos0);

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
                            score.in_max(p, x, key, key_limit[mt][h]);
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
        // keys and 16 columns per ldmatrix (fp8: 32 columns).
        if constexpr (kFp8) {
            // Transposed, a register of an fp8 slice holds keys 2t4, 2t4+1
            // of dims 2g, 2g+1: even() is the B column of dim 2g, odd() of
            // dim 2g+1. So o[2s] gathers the slice's even dims and o[2s+1]
            // its odd ones (lane t4: dims 16s + 4t4 .. +3), put back in
            // place once after the loop.
#pragma unroll
            for (int j = 0; j < C::kWarpDim / 16; j += 2) {
#pragma unroll
                for (int kg = 0; kg < C::kKeyGroups; ++kg) {
                    uint32_t vf[4];  // (keys 0-7 | 8-15 of the group) x slice j, then slice j+1
                    fd_ldmatrix_x4_trans(vf, v_s + fd_kv_swizzle<D, KV>(warp_key + kg * 16 + ((lane / 8) % 2) * 8 + lane % 8,
                                                                        (warp_col / 16) + j + lane / 16));
#pragma unroll
                    for (int s2 = 0; s2 < 2; ++s2) {
                        const uint32_t e0 = cvt.even(vf[2 * s2]), e1 = cvt.even(vf[2 * s2 + 1]);
                        const uint32_t d0 = cvt.odd(vf[2 * s2]), d1 = cvt.odd(vf[2 * s2 + 1]);
#pragma unroll
                        for (int mt = 0; mt < C::kMTiles; ++mt) {
                            DT::mma(o[mt][2 * (j + s2)], pf[kg][mt], e0, e1);
                            DT::mma(o[mt][2 * (j + s2) + 1], pf[kg][mt], d0, d1);
                        }
                    }
                }
            }
        } else {
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
        }
        stage = stage == C::kStages - 1 ? 0 : stage + 1;
    }
    fd_cp_async_wait<0>();
    __syncthreads();  // pipeline buffers are now the merge scratch
    if (!p.early_dependents) fd_pdl_launch_dependents();  // the next kernel's launch overlaps the merge and writes
    FD_TRACE(3);

    // The block's end (split_kv_epilogue.cuh): each warp parks its state
    // and unnormalized output in the merge scratch, then the key warps'
    // states merge row by row and the rows are written.
    float *so = reinterpret_cast<float *>(fd_dynamic_smem);  // [key warp][row][D + 8]
    float *sm = so + C::kKeyWarps * ROWS * C::kMergeStride;  // [key warp][row] max
    float *sl = sm + C::kKeyWarps * ROWS;                     // [key warp][row] sum
    float *sw = sl + C::kKeyWarps * ROWS;                     // by row: [row][key warp] weight in the row
    float *slse = sw + ROWS * C::kKeyWarps;                   // by row: [row] base-2 LSE
    if constexpr (kFp8) fd_fp8_o_in_place<C::kMTiles, C::kWarpDim / 8>(o, v_mul, t4);
    fd_split_kv_park<D, ROWS>(m, l, o, so, sm, sl, key_warp, dim_part, warp_col, g, t4);
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
    // The sequence's rows again, read anew rather than held through the loop.
    const fd_q_span out_span = fd_q_span_of(p, b);
    float *park_o = so + C::kMergeBytes / 4;  // [ROWS][D]
    float *park_lse = park_o + ROWS * D;      // [ROWS]
    const bool push = C::kPushMerge && clustered;
    const int rank = fd_cluster_rank();
    const int per_block = (C::kItems + cluster_n - 1) / cluster_n;  // items each cluster block owns
    const int block_rows = min(ROWS, packed_rows - row0);
    const fd_split_kv_write<T, D, ROWS> merge_rows{sm,   sl,       sw,       slse,   push,      merge_bar,
                                                   p,    cluster_n, rank,     per_block, block_rows, row0,
                                                   packed_rows, so, clustered, park_o, park_lse, kv_head,
                                                   b,    num_splits, split, partial_rows, out_span};
    if constexpr (C::kMergeByRow) merge_rows(fd_bool<true>{});
    else if (block_rows * (D / 4) > 2 * C::kThreads) merge_rows(fd_bool<true>{});
    else merge_rows(fd_bool<false>{});
    FD_TRACE(4);
    if (push) fd_cluster_push_merge<T, D, ROWS>(p, &merge_bar, cluster_n, rank, per_block, b, kv_head, row0, out_span);
    else if (clustered) fd_split_kv_cluster_merge<T, D, ROWS>(p, park_o, park_lse, b, kv_head, row0, out_span);
}

// The two kernels, each with its own static shared memory: the cluster
// merge's barrier, the kDimSplit score exchange and (the forms but the
// plain one) the page ring.
template <typename T, typename KV, int D, int ROWS>
__device__ __forceinline__ void fd_split_kv(const fd_params &p) {
    __shared__ uint64_t merge_bar;
    __shared__ float xchg[fd_split_kv_config<D, ROWS>::kXchg];
    using F = fd_form_plain<T, KV, D, ROWS>;
    if (p.balance_splits > 0) fd_split_kv_body<T, KV, D, ROWS, F, fd_balance_on>(p, merge_bar, xchg, nullptr);
    else fd_split_kv_body<T, KV, D, ROWS, F, fd_balance_off>(p, merge_bar, xchg, nullptr);
}

// The other forms (FORM: fd_form_paged, fd_form_paged_append,
// fd_form_append or fd_form_serving), with the page ring.
template <typename T, typename KV, int D, int ROWS, template <typename, typename, int, int> class FORM>
__device__ __forceinline__ void fd_split_kv_serving(const fd_params &p) {
    __shared__ uint64_t merge_bar;
    __shared__ float xchg[fd_split_kv_config<D, ROWS>::kXchg];
    using C = fd_split_kv_config<D, ROWS, sizeof(KV)>;
    __shared__ int page_ring[2 * (C::kStages - 1) * C::kKeys];  // fd_page_ring
    constexpr int kBalance = C::kFormsBalance ? fd_balance_by_params : fd_balance_off;
    fd_split_kv_body<T, KV, D, ROWS, FORM<T, KV, D, ROWS>, kBalance>(p, merge_bar, xchg, page_ring);
}

#endif  // FLASHDECODE_SPLIT_KV_CUH
