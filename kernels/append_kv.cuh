// append_kv.cuh: the append step of a serving call, fd_append_kv_<dtype>
// (fd_append_kv_<dtype>_fp8 into an fp8 cache: the new keys and values
// divided by the descales and quantized, after the rotation).
//
// What it does. With new tokens (p.k_new, p.v_new: seqlen_new per
// sequence; except where an appending form of stage 1 writes them itself,
// fused_append.cuh), it writes token t of sequence b into the cache at key
// index L + t, L = cache_seqlens[b] (p.seqlen without cache_seqlens): row L + t of
// cache row b (or cache_batch_idx[b], clamped), or of the page block_table
// names for it. Writes at key indices outside [0, seqlen_cache) or to page
// ids outside [0, num_pages) are skipped. With rotary tables (rotary_cos
// set) it rotates the new keys on the way, key t at position L + t, and
// writes q rotated into the workspace's q_rot (contiguous (batch, seqlen_q,
// heads_q, head_dim)), row i at position L + i with causal or a window,
// else every row at L; stage 1 then reads q_rot instead of q. Positions are
// absolute cache positions (a left padding does not shift them) clamped to
// [0, rotary_rows - 1]. The rotation, in fp32 and rounded to T: pairs
// (x0, x1) = (2m, 2m + 1) interleaved, (m, m + rotary_dim / 2) otherwise,
// become (x0 cos - x1 sin, x0 sin + x1 cos) with cos[m], sin[m] of the
// position's row; dims past rotary_dim are copied.
//
// With ragged query lengths (ragged.cuh) sequence b's new tokens and query
// rows are its own count of rows of k_new, v_new and q from its first; its
// rotated q still goes to q_rot's planned rows (b, i), which stage 1 reads.
//
// Launch shape. grid (max(seqlen_new, seqlen_q), batch, parts), 128
// threads: the parts blocks (t, b, *) take token t of sequence b, their
// threads striding over the token's (head, 16-byte chunk) items: heads_kv x
// head_dim / 8 of k and v (while t < seqlen_new), then heads_q x head_dim / 8
// of q (with rotary, while t < seqlen_q). The planner gives a token enough
// parts for one item a thread (core's Shape.appendParts). An interleaved
// pair lies within a chunk; a non-interleaved one reads its other half
// element by element.
//
// Why this way. The work is a few tokens' worth of copies, so what matters
// is not delaying stage 1: the kernel waits for the one before it
// (fd_pdl_wait: it may have written q, k_new, v_new or the lengths), then
// lets stage 1 be scheduled at once (fd_pdl_launch_dependents); stage 1's
// own fd_pdl_wait holds its loads until these writes are visible. One item
// a thread, because a thread's items run one after the other: each one's
// store may alias the next one's loads, so every item would wait out its
// own round trip to memory. And an item's new row is loaded before the
// length arrives, which only says where to store it: the store waits on
// one round trip, or two for a page id or a cos/sin row, not one more.
#ifndef FLASHDECODE_APPEND_KV_CUH
#define FLASHDECODE_APPEND_KV_CUH

#include "fp8.cuh"
#include "params.h"
#include "ptx.cuh"
#include "ragged.cuh"

// Threads of an fd_append_kv block (the launch's block size).
constexpr int kFdAppendThreads = 128;

__device__ __forceinline__ float fd_to_float(half x) { return __half2float(x); }
__device__ __forceinline__ float fd_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Eight elements of a new row (its dims d0..d0+7), as loaded before their
// position is known: the chunk itself and, for a non-interleaved rotation,
// the element each one pairs with (d0 + j +- rotary_dim / 2), which lies in
// another chunk.
struct fd_append_chunk {
    uint4 u;
    float other[8];
};

// Loads the chunk at src (dims d0..); `rotate`: it will be rotated.
template <typename T>
__device__ __forceinline__ fd_append_chunk fd_append_load(const fd_params &p, const T *src, int d0, bool rotate) {
    fd_append_chunk c = {};
    c.u = *reinterpret_cast<const uint4 *>(src);
    if (rotate && !p.rotary_interleaved && d0 < p.rotary_dim) {
        const int half_dim = p.rotary_dim / 2;
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // branch-free, so the eight loads go out together
            const int d = d0 + j;
            c.other[j] = fd_to_float(src[j + (d >= p.rotary_dim ? 0 : d < half_dim ? half_dim : -half_dim)]);
        }
    }
    return c;
}

// Stores chunk c (dims d0..d0+7) at dst, rotated with the cos/sin row at
// element offset cs (-1: as it is), in T; into an fp8 cache (KV unsigned
// char), the rotated T divided by descale and quantized (fd_quantize8).
template <typename T, typename KV = T>
__device__ __forceinline__ void fd_append_store(const fd_params &p, KV *dst, fd_append_chunk c, int d0, long long cs,
                                                const fd_quant &descale = fd_quant(1.f)) {
    if (cs >= 0 && d0 < p.rotary_dim) {
        const T *cos_row = fd_ptr<const T>(p.rotary_cos) + cs;
        const T *sin_row = fd_ptr<const T>(p.rotary_sin) + cs;
        uint32_t *w = reinterpret_cast<uint32_t *>(&c.u);
        float x[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) fd_dtype<T>::unpack(w[j], x[2 * j], x[2 * j + 1]);
        // Dim d0 + j is x0 or x1 of its pair and rotates with cos/sin column
        // m; past rotary_dim it stays as it is. Every cos/sin load first,
        // none behind a branch: the math then waits on one round trip, not
        // one per dim (a dim past rotary_dim loads a column it ignores).
        const bool inter = p.rotary_interleaved;
        const int half_dim = p.rotary_dim / 2;
        float cos_m[8], sin_m[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int d = min(d0 + j, p.rotary_dim - 1);
            const int m = inter ? d / 2 : d < half_dim ? d : d - half_dim;
            cos_m[j] = fd_to_float(cos_row[m]);
            sin_m[j] = fd_to_float(sin_row[m]);
        }
        float y[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int d = d0 + j;
            const bool first = inter ? j % 2 == 0 : d < half_dim;  // x0 of its pair
            const float x_other = inter ? x[j ^ 1] : c.other[j];
            const float rotated = first ? x[j] * cos_m[j] - x_other * sin_m[j] : x_other * sin_m[j] + x[j] * cos_m[j];
            y[j] = d < p.rotary_dim ? rotated : x[j];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = fd_dtype<T>::pack(y[2 * j], y[2 * j + 1]);
    }
    if constexpr (sizeof(KV) == 2) *reinterpret_cast<uint4 *>(dst) = c.u;
    else *reinterpret_cast<uint2 *>(dst) = fd_quantize8<T>(c.u, descale, p.kv_e5m2);
}

// The element offset of cos/sin row `pos`, clamped to the table.
__device__ __forceinline__ long long fd_rotary_row(const fd_params &p, int pos) {
    return min(max(pos, 0), p.rotary_rows - 1) * p.rotary_stride;
}

// KV: the cache's element type (T, or unsigned char for fp8).
template <typename T, typename KV>
__device__ __forceinline__ void fd_append_kv(const fd_params &p) {
    const int t = blockIdx.x;  // token: new key t and query row t
    const int b = blockIdx.y;
    fd_pdl_wait();
    fd_pdl_launch_dependents();

    const bool rotary = p.rotary_cos != 0;
    const int chunks = p.head_dim / 8;
    // The token's items, k/v's then q's, fixed by the launch (and the
    // sequence's ragged count): an item's new row is loaded in flight with
    // the length, which only its store needs.
    const fd_q_span span = fd_q_span_of(p, b);
    const int row = span.start + t;  // the token's row of k_new, v_new and q
    const int kv_items = t < fd_new_tokens(p, b) ? p.heads_kv * chunks : 0;
    const int q_items = rotary && t < span.count ? p.heads_q * chunks : 0;
    const int stride = kFdAppendThreads * gridDim.z;
    for (int idx = blockIdx.z * kFdAppendThreads + threadIdx.x; idx < kv_items + q_items; idx += stride) {
        const bool is_kv = idx < kv_items;
        const int h = (is_kv ? idx : idx - kv_items) / chunks;
        const int d0 = ((is_kv ? idx : idx - kv_items) % chunks) * 8;
        fd_append_chunk c0, c1;  // k and v, or q
        if (is_kv) {
            c0 = fd_append_load(p, fd_ptr<const T>(p.k_new) + b * p.k_new_batch_stride + (long long)row * p.k_new_seq_stride +
                                       h * p.k_new_head_stride + d0, d0, rotary);
            c1 = fd_append_load(p, fd_ptr<const T>(p.v_new) + b * p.v_new_batch_stride + (long long)row * p.v_new_seq_stride +
                                       h * p.v_new_head_stride + d0, d0, false);
        } else {
            c0 = fd_append_load(p, fd_ptr<const T>(p.q) + b * p.q_batch_stride + (long long)row * p.q_seq_stride +
                                       h * p.q_head_stride + d0, d0, true);
        }

        const int base = p.cache_seqlens ? fd_ptr<const int>(p.cache_seqlens)[b] : p.seqlen;  // L: new token t goes to key L + t
        if (!is_kv) {
            const bool by_row = p.causal || p.window_left >= 0 || p.window_right >= 0;
            T *q_dst = fd_ptr<T>(p.q_rot) + (((long long)b * p.seqlen_q + t) * p.heads_q + h) * p.head_dim + d0;
            fd_append_store<T>(p, q_dst, c0, d0, fd_rotary_row(p, by_row ? base + t : base));
            continue;
        }
        // Key L + t's row: a row of cache row b (or cache_batch_idx[b]), or
        // a row of the page block_table gives it; none outside the cache.
        const int key = base + t;
        if (key < 0 || key >= p.seqlen_cache) continue;
        long long k_row, v_row;  // element offsets of the key's row in k and v
        if (p.block_table != 0) {
            const int slot = key / p.page_size;
            const int page = fd_ptr<const int>(p.block_table)[b * p.block_table_stride + slot];
            if (page < 0 || page >= p.num_pages) continue;
            const long long row = key - slot * p.page_size;
            k_row = page * p.k_batch_stride + row * p.k_seq_stride;
            v_row = page * p.v_batch_stride + row * p.v_seq_stride;
        } else {
            const long long cb = p.cache_batch_idx ? min(max(fd_ptr<const int>(p.cache_batch_idx)[b], 0), p.cache_batch - 1) : b;
            k_row = cb * p.k_batch_stride + (long long)key * p.k_seq_stride;
            v_row = cb * p.v_batch_stride + (long long)key * p.v_seq_stride;
        }
        // The cache is const to stage 1, which only reads it.
        KV *k_dst = fd_ptr<KV>(p.k) + k_row + h * p.k_head_stride + d0;
        KV *v_dst = fd_ptr<KV>(p.v) + v_row + h * p.v_head_stride + d0;
        if constexpr (sizeof(KV) == 2) {
            fd_append_store<T>(p, k_dst, c0, d0, rotary ? fd_rotary_row(p, key) : -1LL);
            fd_append_store<T>(p, v_dst, c1, d0, -1LL);
        } else {
            fd_append_store<T, KV>(p, k_dst, c0, d0, rotary ? fd_rotary_row(p, key) : -1LL,
                                   fd_quant(fd_descale(p.k_descale, p.k_descale_batch_stride, p.k_descale_head_stride,
                                                       p.k_descale_value, b, h)));
            fd_append_store<T, KV>(p, v_dst, c1, d0, -1LL,
                                   fd_quant(fd_descale(p.v_descale, p.v_descale_batch_stride, p.v_descale_head_stride,
                                                       p.v_descale_value, b, h)));
        }
    }
}

#endif  // FLASHDECODE_APPEND_KV_CUH
