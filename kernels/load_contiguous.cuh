// load_contiguous.cuh: the tile loader of a contiguous cache (the plain form,
// and the appending form, whose tiles holding new tokens read those from
// k_new / v_new), and the plain form's prefetch of its first tiles into L2
// before the PDL wait.
#ifndef FLASHDECODE_LOAD_CONTIGUOUS_CUH
#define FLASHDECODE_LOAD_CONTIGUOUS_CUH

#include "load_tile.cuh"
#include "params.h"
#include "ptx.cuh"

// The pages of a contiguous cache: none.
struct fd_no_pages {
    static constexpr bool kFetches = false;
    __device__ __forceinline__ fd_no_pages(const fd_params &, int *) {}
};

// Where a plan's splits are a tile or two (core.Plan.PrefetchTiles), the
// block's keys start on their way into L2 before the PDL wait, while the
// kernel before it still runs: the lengths are not known yet, so it sends
// the tiles of the planned length.
template <int D, int ROWS, typename KV>
__device__ __forceinline__ void fd_prefetch_tiles(const fd_params &p, int split, int num_splits, const KV *k_base,
                                                  const KV *v_base) {
    using C = fd_split_kv_config<D, ROWS, sizeof(KV)>;
    if (p.prefetch_tiles > 0) {
        const int planned = p.cache_seqlens ? p.seqlen_cache : min(p.seqlen, p.seqlen_cache);
        const int chunk = threadIdx.x % C::kChunks;
        for (int s = 0; s < p.prefetch_tiles && s < C::kStages - 1; ++s) {
#pragma unroll
            for (int i = 0; i < C::kCopiesPerThread; ++i) {
                const int key = (split + s * num_splits) * C::kKeys + threadIdx.x / C::kChunks +
                                i * C::kCopyKeyStep;
                if (key < planned && chunk * C::kChunkElems < p.head_dim) {
                    fd_prefetch_l2(k_base + (long long)key * p.k_seq_stride + chunk * C::kChunkElems);
                    fd_prefetch_l2(v_base + (long long)key * p.v_seq_stride + chunk * C::kChunkElems);
                }
            }
        }
    }
}

// APPENDS: keys from base on are new tokens (the appending form), so a
// tile holding any is copied apart.
template <typename T, typename KV, int D, int ROWS, bool APPENDS>
struct fd_load_contiguous : fd_tile_copy<T, KV, D, ROWS, fd_no_pages> {
    using C = fd_split_kv_config<D, ROWS, sizeof(KV)>;
    using pages_type = fd_no_pages;
    using copy_base = fd_tile_copy<T, KV, D, ROWS, fd_no_pages>;
    FD_TILE_COPY_MEMBERS(copy_base);

    __device__ __forceinline__ void operator()(int tile, int stage, int) const {
        KV *k_s = smem + stage * 2 * C::kTileElems;
        KV *v_s = k_s + C::kTileElems;
        const bool fresh_tile = APPENDS && (tile + 1) * C::kKeys > base;
        if (!fresh_tile && chunk_in_dim && (tile + 1) * C::kKeys <= len) {
            // A whole tile of cached keys (every tile but a sequence's
            // last and, appending, those holding new tokens): one row
            // address a thread, each further copy a stride on, and no
            // test a copy. These copies sit on every tile's path to its mmas.
            const long long key = tile * C::kKeys + copy_key;
            const KV *k_src = k_base + key * p.k_seq_stride + copy_chunk * C::kChunkElems;
            const KV *v_src = v_base + key * p.v_seq_stride + copy_chunk * C::kChunkElems;
#pragma unroll
            for (int i = 0; i < C::kCopiesPerThread; ++i) {
                const int s_off = fd_kv_swizzle<D, KV>(copy_key + i * C::kCopyKeyStep, copy_chunk);
                copy(k_s + s_off, k_src, true);
                copy(v_s + s_off, v_src, true);
                k_src += k_copy_stride;
                v_src += v_copy_stride;
            }
            return;
        }
        if constexpr (APPENDS && sizeof(KV) == 1) {
            if (fresh_tile) {
                // fp8: one copy at a time, each quantizing any new token, in
                // the few registers stage 1 has left at 32 rows a block.
#pragma unroll 1
                for (int i = 0; i < C::kCopiesPerThread; ++i) copy_one(tile, i, true, k_s, v_s);
                return;
            }
        }
#pragma unroll
        for (int i = 0; i < C::kCopiesPerThread; ++i) copy_one(tile, i, fresh_tile, k_s, v_s);
    }

    // The thread's i-th copy of a tile that is not whole (a sequence's last,
    // or one holding new tokens: fresh_tile).
    __device__ __forceinline__ void copy_one(int tile, int i, bool fresh_tile, KV *k_s, KV *v_s) const {
        const int key = copy_key + i * C::kCopyKeyStep;
        const int gkey = tile * C::kKeys + key;
        const bool valid = chunk_in_dim && gkey < len;
        const long long k_off = (long long)(valid ? gkey : 0) * p.k_seq_stride + copy_chunk * C::kChunkElems;
        const long long v_off = (long long)(valid ? gkey : 0) * p.v_seq_stride + copy_chunk * C::kChunkElems;
        const int s_off = fd_kv_swizzle<D, KV>(key, copy_chunk);
        if (fresh_tile) {
            copy_new(k_s, v_s, s_off, gkey, valid, k_base + k_off, v_base + v_off);
        } else {
            copy(k_s + s_off, k_base + k_off, valid);
            copy(v_s + s_off, v_base + v_off, valid);
        }
    }
};

#endif  // FLASHDECODE_LOAD_CONTIGUOUS_CUH
