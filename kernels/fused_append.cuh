// fused_append.cuh: the appending forms of stage 1 (fd_split_kv_append_*,
// fd_split_kv_paged_append_*), which take a few new tokens without an append
// kernel before them: their tile copies read a key at or past the cached
// length from k_new / v_new (fd_tile_copy::copy_new, load_tile.cuh), and one
// block a K/V head writes the new tokens into the cache (fd_fused_append).
#ifndef FLASHDECODE_FUSED_APPEND_CUH
#define FLASHDECODE_FUSED_APPEND_CUH

#include "fp8.cuh"
#include "params.h"
#include "ptx.cuh"
#include "ragged.cuh"

// The append: K/V head kv_head of sequence b writes its new tokens (rows
// span.start on of k_new / v_new, span.count of them with ragged query
// lengths, else seqlen_new: fd_new_tokens) into the cache, token t at key
// base + t: into its page (PAGED) or row b of a
// contiguous cache, skipping keys outside [0, seqlen_cache) and page ids
// outside [0, num_pages) as fd_append_kv does.
// No block of the grid reads those rows from the cache (they read the new
// tokens from k_new / v_new), so the stores need no ordering within the
// grid; the next kernel sees them after its PDL wait. One 16-byte chunk of
// k and v (8 elements) a thread and step; into an fp8 cache (KV unsigned
// char), divided by the descales and quantized (fd_quantize8).
template <typename T, typename KV, int THREADS, bool PAGED, typename PAGES>
__device__ __forceinline__ void fd_fused_append(const fd_params &p, const PAGES &pages, int b, int kv_head, int base,
                                                const fd_q_span &span, const fd_quant &k_descale,
                                                const fd_quant &v_descale) {
    // Token t's row offsets in k and v; false where it is skipped.
    auto row_of = [&](int t, long long &k_row, long long &v_row) {
        const int key = base + t;
        if (key < 0 || key >= p.seqlen_cache) return false;
        if constexpr (PAGED) {
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
    // The cache, which the rest of stage 1 only reads.
    KV *k_cache = fd_ptr<KV>(p.k) + kv_head * p.k_head_stride;
    KV *v_cache = fd_ptr<KV>(p.v) + kv_head * p.v_head_stride;
    const T *k_new = fd_ptr<const T>(p.k_new) + b * p.k_new_batch_stride + (long long)span.start * p.k_new_seq_stride +
                     kv_head * p.k_new_head_stride;
    const T *v_new = fd_ptr<const T>(p.v_new) + b * p.v_new_batch_stride + (long long)span.start * p.v_new_seq_stride +
                     kv_head * p.v_new_head_stride;
    const int chunks = p.head_dim / 8;
    const int n_new = fd_new_tokens(p, b);
    for (int idx = threadIdx.x; idx < n_new * chunks; idx += THREADS) {
        const int t = idx / chunks, d0 = (idx % chunks) * 8;
        const uint4 kx = *reinterpret_cast<const uint4 *>(k_new + t * p.k_new_seq_stride + d0);
        const uint4 vx = *reinterpret_cast<const uint4 *>(v_new + t * p.v_new_seq_stride + d0);
        long long k_row, v_row;
        if (!row_of(t, k_row, v_row)) continue;
        if constexpr (sizeof(KV) == 2) {
            *reinterpret_cast<uint4 *>(k_cache + k_row + d0) = kx;
            *reinterpret_cast<uint4 *>(v_cache + v_row + d0) = vx;
        } else {
            *reinterpret_cast<uint2 *>(k_cache + k_row + d0) = fd_quantize8<T>(kx, k_descale, p.kv_e5m2);
            *reinterpret_cast<uint2 *>(v_cache + v_row + d0) = fd_quantize8<T>(vx, v_descale, p.kv_e5m2);
        }
    }
}

#endif  // FLASHDECODE_FUSED_APPEND_CUH
