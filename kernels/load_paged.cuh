// load_paged.cuh: a paged cache's pages (fd_page_ring: the block_table
// entries of the split's next tiles, held in shared memory) and the tile
// loader of the paged forms (pages of a multiple of 8 keys; the paged
// appending form's new tokens read from k_new / v_new).
#ifndef FLASHDECODE_LOAD_PAGED_CUH
#define FLASHDECODE_LOAD_PAGED_CUH

#include "load_tile.cuh"
#include "params.h"
#include "ptx.cuh"

// key / page_size for 0 <= key < 2^31 as a multiply and a shift, with the
// magic numbers the core worked out (params.h: page_div_m, page_div_l).
struct fd_page_divider {
    uint32_t m;
    int l;
    __device__ __forceinline__ explicit fd_page_divider(const fd_params &p) : m(p.page_div_m), l(p.page_div_l) {}
    __device__ __forceinline__ int div(int n) const {
        return static_cast<int>((__umulhi(static_cast<uint32_t>(n), m) + static_cast<uint32_t>(n)) >> l);
    }
};

// The pages of a paged cache (block_table): the block keeps the pages of
// the keys of its split's next tiles in shared memory, those of its j-th
// tile in ring[j % (2 AHEAD)] (KEYS each). A loader's load of tile j reads
// them and starts the copy of tile j + AHEAD's; with AHEAD the pipeline's
// depth (kStages - 1) that copy joins tile j's cp.async group, so it has
// landed, and passed a __syncthreads, when tile j + AHEAD is loaded a few
// tiles of math later: no thread waits on the block_table, whose latency behind the cache
// stream is longer than a tile. Twice AHEAD slots: the prologue's loads
// have no barrier between them.
template <int KEYS, int AHEAD>
struct fd_page_ring {
    static constexpr bool kFetches = true;   // the loop fetches the prologue's pages (split_kv.cuh)
    static constexpr int kRing = 2 * AHEAD;  // slots, KEYS ints each
    int *ring;
    fd_page_divider page_size;

    __device__ __forceinline__ fd_page_ring(const fd_params &p, int *page_ring)
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
    // cache. A loader reads a lane's one id before its first copy: cp.async's
    // asm is a compiler barrier, so a read between copies would wait out the
    // shared-memory latency there.
    __device__ __forceinline__ int page_id(int j, int key) const { return ring[(j % kRing) * KEYS + key]; }

    // Adds the offset from k_base / v_base of key gkey of a paged cache (page
    // the key's page_id): its row in its page, the page clamped to the cache.
    // Each lane runs it once a tile (the serving loader shares the result by
    // shuffle, load_serving.cuh),
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

// The page ring of a stage-1 variant: its tiles' keys, the pipeline's depth ahead.
template <int D, int ROWS, typename KV>
using fd_page_ring_of = fd_page_ring<fd_split_kv_config<D, ROWS, sizeof(KV)>::kKeys,
                                     fd_split_kv_config<D, ROWS, sizeof(KV)>::kStages - 1>;

// A thread copies its chunk of kCopiesPerThread consecutive keys, which lie
// in one page (pages hold a multiple of them): one page lookup a thread, and
// each further key a stride on. APPENDS: keys from base on are new tokens
// (the paged appending form).
template <typename T, typename KV, int D, int ROWS, bool APPENDS>
struct fd_load_paged : fd_tile_copy<T, KV, D, ROWS, fd_page_ring_of<D, ROWS, KV>> {
    using C = fd_split_kv_config<D, ROWS, sizeof(KV)>;
    using pages_type = fd_page_ring_of<D, ROWS, KV>;
    using copy_base = fd_tile_copy<T, KV, D, ROWS, pages_type>;
    FD_TILE_COPY_MEMBERS(copy_base);

    __device__ __forceinline__ void operator()(int tile, int stage, int j) const {
        KV *k_s = smem + stage * 2 * C::kTileElems;
        KV *v_s = k_s + C::kTileElems;
        const int key0 = copy_key * C::kCopiesPerThread;
        const int gkey0 = tile * C::kKeys + key0;
        long long k_off = copy_chunk * C::kChunkElems, v_off = copy_chunk * C::kChunkElems;
        pages.offsets(p, pages.page_id(j, key0), gkey0, k_off, v_off);
        const KV *k_src = k_base + k_off, *v_src = v_base + v_off;
        if (!APPENDS || gkey0 + C::kCopiesPerThread <= base) {  // no new token among them
#pragma unroll
            for (int i = 0; i < C::kCopiesPerThread; ++i) {
                const int s_off = fd_kv_swizzle<D, KV>(key0 + i, copy_chunk);
                const bool valid = chunk_in_dim && gkey0 + i < len;
                copy(k_s + s_off, k_src + i * p.k_seq_stride, valid);
                copy(v_s + s_off, v_src + i * p.v_seq_stride, valid);
            }
        } else if constexpr (sizeof(KV) == 2) {
#pragma unroll
            for (int i = 0; i < C::kCopiesPerThread; ++i) {
                const int gkey = gkey0 + i;
                copy_new(k_s, v_s, fd_kv_swizzle<D, KV>(key0 + i, copy_chunk), gkey, chunk_in_dim && gkey < len,
                         k_src + i * p.k_seq_stride, v_src + i * p.v_seq_stride);
            }
        } else {
            // fp8: one copy at a time, each quantizing any new token, in
            // the few registers stage 1 has left at 32 rows a block.
#pragma unroll 1
            for (int i = 0; i < C::kCopiesPerThread; ++i) {
                const int gkey = gkey0 + i;
                copy_new(k_s, v_s, fd_kv_swizzle<D, KV>(key0 + i, copy_chunk), gkey, chunk_in_dim && gkey < len,
                         k_src + i * p.k_seq_stride, v_src + i * p.v_seq_stride);
            }
        }
        pages.fetch(p, b, tile + (C::kStages - 1) * num_splits, j + C::kStages - 1, 0, len);
    }
};

#endif  // FLASHDECODE_LOAD_PAGED_CUH
