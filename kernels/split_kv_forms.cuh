// split_kv_forms.cuh: stage 1's five forms, each a policy type the main loop
// (split_kv.cuh) is written against, in the way of FlashInfer's
// AttentionVariant: a form gives the loop its tile loader, how its rows find
// their keys (q's layout, the cache row, each row's visible keys) and its
// score transform; the loop tests no form, only whether its pages type
// fetches page ids (kFetches: the page ring). Each form is a kernel of
// its own, so that no form's loop is the longer for another's features;
// core.Form names them in Go and the planner picks one.
//
//   fd_form_plain         a contiguous cache, no serving feature
//   fd_form_paged         pages of a multiple of 8 keys, with or without
//                         appended keys (written by fd_append_kv) and a
//                         rotated q, nothing else (no cache_batch_idx,
//                         leftpad, window, softcap or ALiBi)
//   fd_form_paged_append  the same, writing a few new tokens itself, without
//                         rotary (core.Plan.FusedAppend; fused_append.cuh)
//   fd_form_append        the appending form of a contiguous cache with no
//                         other feature
//   fd_form_serving       every serving feature, any page size (serving.cuh)
//
// A form F<T, KV, D, ROWS> (KV the cache's element type: T, or unsigned
// char for fp8) provides:
//   loader, pages      the tile loader (load_*.cuh) and the page ring it reads
//   q_layout           q's strides (the rotated copy's, with rotary)
//   rows               each query row's visible keys next to its key_limit
//   score              apply(): a tile's q.k to base-2 scores; in_max(): what
//                      the softmax's max pass does to each (scale and mask)
//   before_wait        the argument loads (and prefetch) before the PDL wait
//   kFromKeyZero       whether every split of a paged cache starts at key 0
//   attended_keys      the keys of a sequence of `base` cached ones and its new tokens
//   key_range          the visible keys [lo, ..) and the block's first tile
//   bases              q, k and v of the sequence once lengths may be read
//   append             the fused append, once the first tiles are on their way
#ifndef FLASHDECODE_SPLIT_KV_FORMS_CUH
#define FLASHDECODE_SPLIT_KV_FORMS_CUH

#include "balance.cuh"
#include "fused_append.cuh"
#include "load_contiguous.cuh"
#include "load_paged.cuh"
#include "load_serving.cuh"
#include "params.h"
#include "ptx.cuh"
#include "ragged.cuh"
#include "serving.cuh"
#include "split_kv_config.cuh"

// The plain form's q: its own strides.
struct fd_plain_q {
    __device__ __forceinline__ long long seq(const fd_params &p) const { return p.q_seq_stride; }
    __device__ __forceinline__ long long head(const fd_params &p) const { return p.q_head_stride; }
    // The sequence's first row of q (ragged.cuh).
    __device__ __forceinline__ long long first_row(const fd_q_span &span) const { return span.start; }
};

// Rows that see every key below their key_limit (the length, or the causal
// mask).
struct fd_plain_rows {
    __device__ __forceinline__ void set(const fd_params &, int, int, int, int, int, int &) {}
};

// Scores times scale * log2(e), -inf at or past the row's key_limit, done in
// the softmax's max pass.
struct fd_plain_score {
    __device__ __forceinline__ explicit fd_plain_score(const fd_params &) {}
    template <int MTILES, typename ROWS_T>
    __device__ __forceinline__ void apply(const fd_params &, float (&)[MTILES][2][4], int, const ROWS_T &,
                                          const int (&)[MTILES][2], int, int, int, int) const {}
    __device__ __forceinline__ void in_max(const fd_params &p, float &x, int key, int limit) const {
        x = key < limit ? x * p.scale_log2 : -CUDART_INF_F;
    }
};

template <typename T, typename KV, int D, int ROWS>
struct fd_form_plain {
    using C = fd_split_kv_config<D, ROWS, sizeof(KV)>;
    using loader = fd_load_contiguous<T, KV, D, ROWS, false>;
    using pages = fd_no_pages;
    using q_layout = fd_plain_q;
    using rows = fd_plain_rows;
    using score = fd_plain_score;

    // The argument loads behind q, k and v overlap the wait (fd_touch_params,
    // ptx.cuh), and the first tiles start into L2.
    __device__ __forceinline__ static void before_wait(const fd_params &p, int split, int num_splits,
                                                       const T *const &q_base, const KV *const &k_base,
                                                       const KV *const &v_base) {
        fd_touch_params(q_base, k_base, v_base, p.seqlen);
        fd_prefetch_tiles<D, ROWS>(p, split, num_splits, k_base, v_base);
    }
    static constexpr bool kFromKeyZero = false;  // (no pages)
    // No appended tokens.
    __device__ __forceinline__ static int attended_keys(const fd_params &p, int base, int) {
        return fd_attended_keys<false>(base, 0, p.seqlen_cache);
    }
    __device__ __forceinline__ static void key_range(const fd_params &, const int &, const int &, const int &,
                                                     const int &, const int &, int &, int &) {}
    __device__ __forceinline__ static void bases(const fd_params &, int, int, const T *&, const KV *&, const KV *&,
                                                 q_layout &) {}
    template <typename PAGES>
    __device__ __forceinline__ static void append(const fd_params &, const PAGES &, int, int, int, const fd_q_span &,
                                                  int, int, const fd_quant &, const fd_quant &) {}
};

// What every form but the plain one shares: appended keys, a cache row by
// cache_batch_idx or pages, a rotated q (serving.cuh).
template <typename T, typename KV, int D, int ROWS>
struct fd_form_cache : fd_form_plain<T, KV, D, ROWS> {
    using q_layout = fd_cache_q;

    // Also the serving fields' lines (cache_batch's and seqlen_new's), read
    // right after the wait.
    __device__ __forceinline__ static void before_wait(const fd_params &p, int, int, const T *const &q_base,
                                                       const KV *const &k_base, const KV *const &v_base) {
        fd_touch_params(q_base, k_base, v_base, p.seqlen, p.cache_batch, p.seqlen_new);
    }
    // The sequence's n_new appended tokens are keys too (balance.cuh).
    __device__ __forceinline__ static int attended_keys(const fd_params &p, int base, int n_new) {
        return fd_attended_keys<true>(base, n_new, p.seqlen_cache);
    }
    __device__ __forceinline__ static void bases(const fd_params &p, int b, int kv_head, const T *&q_base,
                                                 const KV *&k_base, const KV *&v_base, q_layout &q) {
        fd_cache_bases(p, b, kv_head, q_base, k_base, v_base, q);
    }
};

template <typename T, typename KV, int D, int ROWS>
struct fd_form_paged : fd_form_cache<T, KV, D, ROWS> {
    using loader = fd_load_paged<T, KV, D, ROWS, false>;
    using pages = typename loader::pages_type;
    static constexpr bool kFromKeyZero = true;  // every split starts at key 0 (no left padding, no window)
};

template <typename T, typename KV, int D, int ROWS>
struct fd_form_paged_append : fd_form_paged<T, KV, D, ROWS> {
    using C = fd_split_kv_config<D, ROWS, sizeof(KV)>;
    using loader = fd_load_paged<T, KV, D, ROWS, true>;
    // Block (split 0, row tile 0) of each K/V head writes the new tokens.
    template <typename PAGES>
    __device__ __forceinline__ static void append(const fd_params &p, const PAGES &pages, int b, int kv_head,
                                                  int base, const fd_q_span &span, int split, int row0,
                                                  const fd_quant &k_descale, const fd_quant &v_descale) {
        if (split == 0 && row0 == 0)
            fd_fused_append<T, KV, C::kThreads, true>(p, pages, b, kv_head, base, span, k_descale, v_descale);
    }
};

template <typename T, typename KV, int D, int ROWS>
struct fd_form_append : fd_form_cache<T, KV, D, ROWS> {
    using C = fd_split_kv_config<D, ROWS, sizeof(KV)>;
    using loader = fd_load_contiguous<T, KV, D, ROWS, true>;
    template <typename PAGES>
    __device__ __forceinline__ static void append(const fd_params &p, const PAGES &pages, int b, int kv_head,
                                                  int base, const fd_q_span &span, int split, int row0,
                                                  const fd_quant &k_descale, const fd_quant &v_descale) {
        if (split == 0 && row0 == 0)
            fd_fused_append<T, KV, C::kThreads, false>(p, pages, b, kv_head, base, span, k_descale, v_descale);
    }
};

template <typename T, typename KV, int D, int ROWS>
struct fd_form_serving : fd_form_cache<T, KV, D, ROWS> {
    using C = fd_split_kv_config<D, ROWS, sizeof(KV)>;
    using loader = fd_load_serving<T, KV, D, ROWS>;
    using pages = typename loader::pages_type;
    using rows = fd_serving_rows<C::kMTiles>;
    using score = fd_serving_score;

    static constexpr bool kFromKeyZero = false;  // only where there is no left padding and no window
    // Keys before lo (the left padding) are never visible, and the block
    // starts at the tile of the first key any of its rows sees.
    __device__ __forceinline__ static void key_range(const fd_params &p, const int &b, const int &len,
                                                     const int &pos0, const int &row0, const int &packed_rows,
                                                     int &lo, int &first_tile) {
        lo = p.cache_leftpad ? min(max(fd_ptr<const int>(p.cache_leftpad)[b], 0), len) : 0;
        first_tile = fd_serving_first_key(p, pos0, lo, row0, min(ROWS, packed_rows - row0)) / C::kKeys;
    }
};

#endif  // FLASHDECODE_SPLIT_KV_FORMS_CUH
