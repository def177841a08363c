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

#include "params.h"
#include "ptx.cuh"
#include "split_kv_config.cuh"

// An appending form's copy of a key that may be a new token (gkey >= base):
// from k_new / v_new instead of its cache row (k_src, v_src). Its members
// refer to the block's values.
template <typename T>
struct fd_copy_new {
    const int &base;  // keys before this call's new ones
    const fd_params &p;
    int &b, &kv_head;
    const int &copy_chunk;
    __device__ __forceinline__ void operator()(T *k_s, T *v_s, int s_off, int gkey, bool valid, const T *k_src,
                                               const T *v_src) const {
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
    }
};

template <typename T, int D, int ROWS, typename PAGES>
struct fd_tile_copy {
    using C = fd_split_kv_config<D, ROWS>;
    const fd_params &p;
    T *const &smem;            // the pipeline: stage s holds a K tile then a V tile
    const T *const &k_base;    // the sequence's K/V head (a paged cache: the head in page 0)
    const T *const &v_base;
    const int &b;
    const int &base;           // keys before this call's new ones (the appending forms read those from k_new / v_new)
    const int &lo, &len;       // the visible keys [lo, len)
    const int &num_splits;     // splits of the sequence (the page ring's stride between the split's tiles)
    const int &lane;
    const int &copy_chunk, &copy_key;  // the thread copies chunk copy_chunk of keys copy_key + i * kCopyKeyStep
    const bool &chunk_in_dim;          // that chunk lies within head_dim
    const long long &k_copy_stride, &v_copy_stride;  // kCopyKeyStep keys' rows
    PAGES &pages;              // a paged cache's page ring (load_paged.cuh)
    const fd_copy_new<T> &copy_new;  // the appending forms' copy of a key that may be new
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
    using B::k_copy_stride;                                                                                      \
    using B::v_copy_stride;                                                                                      \
    using B::pages;                                                                                              \
    using B::copy_new

#endif  // FLASHDECODE_LOAD_TILE_CUH
