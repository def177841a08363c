// load_tile.cuh: what every stage-1 tile loader is given (fd_tile_copy): the
// pipeline, the thread's place in each tile's copy, and the block's sequence
// and visible keys. The loaders: load_contiguous.cuh (a contiguous cache),
// load_paged.cuh (pages of a multiple of 8 keys), load_serving.cuh (the
// serving form: either layout, any page size).
//
// A loader derives from fd_tile_copy, whose members refer to the block's own
// values, and its call (tile, stage, j) starts the cp.async copies of key
// tile `tile`, the split's j-th, into pipeline stage `stage`: K then V, keys
// row-major in XOR-swizzled 16-byte chunks (fd_swizzle), keys outside the
// visible ones zero-filled (masked, and never NaN in P V).
#ifndef FLASHDECODE_LOAD_TILE_CUH
#define FLASHDECODE_LOAD_TILE_CUH

#include "fp8.cuh"
#include "params.h"
#include "ptx.cuh"
#include "ragged.cuh"
#include "split_kv_config.cuh"

// A tile chunk's copy (valid: within the visible keys and head_dim); an fp8
// one copies its `bytes` within head_dim.
template <typename KV>
__device__ __forceinline__ void fd_copy_chunk(KV *dst, const KV *src, bool valid, int bytes) {
    if constexpr (sizeof(KV) == 2) fd_cp_async_16(dst, src, valid);
    else fd_cp_async_bytes(dst, src, valid ? bytes : 0);
}

// An appending form's copy of a key that may be a new token (gkey >= base):
// from k_new / v_new instead of its cache row (k_src, v_src). An fp8 cache's
// new token is quantized on the way as fd_fused_append stores it (the
// descales, read after the PDL wait), so the block attends to the value the
// cache will hold. Its members refer to the block's values.
template <typename T, typename KV>
struct fd_copy_new {
    const int &base;  // keys before this call's new ones
    const fd_params &p;
    int &b, &kv_head;
    const int &copy_chunk;
    const int &chunk_bytes;                   // fp8: the chunk's bytes within head_dim
    const fd_quant &k_descale, &v_descale;    // fp8: the sequence's K/V head's descales
    __device__ __forceinline__ void operator()(KV *k_s, KV *v_s, int s_off, int gkey, bool valid, const KV *k_src,
                                               const KV *v_src) const {
        constexpr int kElems = 16 / sizeof(KV);
        const bool fresh = gkey >= base;
        // The sequence's first row of k_new / v_new (ragged.cuh), read where
        // a new token is copied rather than held through the tile loop.
        const int q_start = fresh ? fd_q_span_of(p, b).start : 0;
        if constexpr (sizeof(KV) == 2) {
            const T *k_from = fresh ? fd_ptr<const T>(p.k_new) + b * p.k_new_batch_stride +
                                          (long long)(q_start + gkey - base) * p.k_new_seq_stride +
                                          kv_head * p.k_new_head_stride + copy_chunk * kElems
                                    : k_src;
            const T *v_from = fresh ? fd_ptr<const T>(p.v_new) + b * p.v_new_batch_stride +
                                          (long long)(q_start + gkey - base) * p.v_new_seq_stride +
                                          kv_head * p.v_new_head_stride + copy_chunk * kElems
                                    : v_src;
            fd_cp_async_16(k_s + s_off, k_from, valid);
            fd_cp_async_16(v_s + s_off, v_from, valid);
        } else if (!fresh) {
            fd_cp_async_bytes(k_s + s_off, k_src, valid ? chunk_bytes : 0);
            fd_cp_async_bytes(v_s + s_off, v_src, valid ? chunk_bytes : 0);
        } else {
            const long long t = q_start + gkey - base;
            const T *k_from = fd_ptr<const T>(p.k_new) + b * p.k_new_batch_stride + t * p.k_new_seq_stride +
                              kv_head * p.k_new_head_stride + copy_chunk * kElems;
            const T *v_from = fd_ptr<const T>(p.v_new) + b * p.v_new_batch_stride + t * p.v_new_seq_stride +
                              kv_head * p.v_new_head_stride + copy_chunk * kElems;
            // Eight elements at a time, each stored before the next are
            // loaded (the store is a compiler barrier): at 32 rows a block
            // stage 1 has no registers to spare.
            const int bytes = valid ? chunk_bytes : 0;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                fd_st_shared8(k_s + s_off + 8 * half, fd_quantize_half<T>(k_from + 8 * half, bytes > 8 * half, k_descale, p.kv_e5m2));
                fd_st_shared8(v_s + s_off + 8 * half, fd_quantize_half<T>(v_from + 8 * half, bytes > 8 * half, v_descale, p.kv_e5m2));
            }
        }
    }
};

// KV: the cache's element type (T, or unsigned char for fp8).
template <typename T, typename KV, int D, int ROWS, typename PAGES>
struct fd_tile_copy {
    using C = fd_split_kv_config<D, ROWS, sizeof(KV)>;
    const fd_params &p;
    KV *const &smem;           // the pipeline: stage s holds a K tile then a V tile
    const KV *const &k_base;   // the sequence's K/V head (a paged cache: the head in page 0)
    const KV *const &v_base;
    const int &b;
    const int &base;           // keys before this call's new ones (the appending forms read those from k_new / v_new)
    const int &lo, &len;       // the visible keys [lo, len)
    const int &num_splits;     // splits of the sequence (the page ring's stride between the split's tiles)
    const int &lane;
    const int &copy_chunk, &copy_key;  // the thread copies chunk copy_chunk of keys copy_key + i * kCopyKeyStep
    const bool &chunk_in_dim;          // that chunk lies within head_dim
    const int &chunk_bytes;            // fp8: its bytes within head_dim (16, or 8 for the last of a head_dim of 16n + 8)
    const long long &k_copy_stride, &v_copy_stride;  // kCopyKeyStep keys' rows
    PAGES &pages;              // a paged cache's page ring (load_paged.cuh)
    const fd_copy_new<T, KV> &copy_new;  // the appending forms' copy of a key that may be new

    // One chunk's copy (valid: within the visible keys and head_dim).
    __device__ __forceinline__ void copy(KV *dst, const KV *src, bool valid) const {
        fd_copy_chunk(dst, src, valid, chunk_bytes);
    }
};

// The members a loader reads, by their names.
#define FD_TILE_COPY_MEMBERS(B)                                                                                  \
    using B::p;                                                                                                  \
    using B::smem;                                                                                               \
    using B::k_base;                                                                                             \
    using B::v_base;                                                                                             \
    using B::b;                                                                                                  \
    using B::base;                                                                                               \
    using B::lo;                                                                                                 \
    using B::len;                                                                                                \
    using B::num_splits;                                                                                         \
    using B::lane;                                                                                               \
    using B::copy_chunk;                                                                                         \
    using B::copy_key;                                                                                           \
    using B::chunk_in_dim;                                                                                       \
    using B::copy;                                                                                               \
    using B::k_copy_stride;                                                                                      \
    using B::v_copy_stride;                                                                                      \
    using B::pages;                                                                                              \
    using B::copy_new

#endif  // FLASHDECODE_LOAD_TILE_CUH
