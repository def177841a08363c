// load_serving.cuh: the tile loader of the serving form, for a contiguous
// cache (whose row may be cache_batch_idx[b]) or pages of any size, keys
// outside [lo, len) (the left padding) zero-filled.
#ifndef FLASHDECODE_LOAD_SERVING_CUH
#define FLASHDECODE_LOAD_SERVING_CUH

#include "load_paged.cuh"
#include "load_tile.cuh"
#include "params.h"
#include "ptx.cuh"

template <typename T, typename KV, int D, int ROWS>
struct fd_load_serving : fd_tile_copy<T, KV, D, ROWS, fd_page_ring_of<D, ROWS, KV>> {
    using C = fd_split_kv_config<D, ROWS, sizeof(KV)>;
    using pages_type = fd_page_ring_of<D, ROWS, KV>;
    using copy_base = fd_tile_copy<T, KV, D, ROWS, pages_type>;
    FD_TILE_COPY_MEMBERS(copy_base);

    __device__ __forceinline__ void operator()(int tile, int stage, int j) const {
        KV *k_s = smem + stage * 2 * C::kTileElems;
        KV *v_s = k_s + C::kTileElems;
        // A thread's copies from a paged cache (paged: fd_bool<true>) or a
        // contiguous one, each layout a straight run of cp.async: a layout
        // test per key would split the copies into blocks of their own,
        // which the compiler cannot interleave.
        // (The lambda takes the block's values by reference, not this loader.)
        const int &lane = this->lane, &copy_key = this->copy_key, &copy_chunk = this->copy_chunk;
        const int &lo = this->lo, &len = this->len;
        const bool &chunk_in_dim = this->chunk_in_dim;
        const int &chunk_bytes = this->chunk_bytes;
        const KV *const &k_base = this->k_base, *const &v_base = this->v_base;
        const fd_params &p = this->p;
        pages_type &pages = this->pages;
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
                const KV *k_src, *v_src;
                if constexpr (decltype(paged)::value) {
                    const int from = (lane & ~(C::kChunks - 1) & 31) | i;  // the lane of copy i of this key group
                    k_src = reinterpret_cast<const KV *>(__shfl_sync(0xffffffffu, k_mine, from)) + copy_chunk * C::kChunkElems;
                    v_src = reinterpret_cast<const KV *>(__shfl_sync(0xffffffffu, v_mine, from)) + copy_chunk * C::kChunkElems;
                } else {
                    k_src = k_base + (long long)gkey * p.k_seq_stride + copy_chunk * C::kChunkElems;
                    v_src = v_base + (long long)gkey * p.v_seq_stride + copy_chunk * C::kChunkElems;
                }
                const int s_off = fd_kv_swizzle<D, KV>(key, copy_chunk);
                fd_copy_chunk(k_s + s_off, k_src, valid, chunk_bytes);
                fd_copy_chunk(v_s + s_off, v_src, valid, chunk_bytes);
            }
        };
        if (p.block_table != 0) copies(fd_bool<true>{});
        else copies(fd_bool<false>{});
        pages.fetch(p, b, tile + (C::kStages - 1) * num_splits, j + C::kStages - 1, lo, len);
    }
};

#endif  // FLASHDECODE_LOAD_SERVING_CUH
