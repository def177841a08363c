// serving.cuh: the serving form's policies (fd_split_kv_serving_*,
// FlashAttention's kv-cache features): which keys a block and each of its
// rows see (cache_leftpad, the window), and its score transform (softcap,
// ALiBi, the rows' key ranges); and what every form but the plain one does
// to find its rows: the cache row cache_batch_idx[b], and the rotated q.
//
// Keys are absolute cache indices: b's keys are [lo, len), len =
// cache_seqlens[b] + seqlen_new (clamped), lo = cache_leftpad[b]; query row
// i sits at pos_i = pos0 + i, pos0 = len - n (n: the sequence's query rows,
// seqlen_q or its ragged count), and sees [max(lo, pos_i - left),
// min(len, pos_i + right + 1)) (causal: right 0). A block's tiles start at
// the tile of its rows' first visible key, so a window reads only its keys.
#ifndef FLASHDECODE_SERVING_CUH
#define FLASHDECODE_SERVING_CUH

#include "params.h"
#include "ptx.cuh"
#include "ragged.cuh"

// The first key any of a block's rows sees: lo, or with a left window the
// window start of its earliest query token (at position pos0 + token).
__device__ __forceinline__ int fd_serving_first_key(const fd_params &p, int pos0, int lo, int row0, int n_rows) {
    if (p.window_left < 0) return lo;
    return (int)max((long long)lo, (long long)pos0 + fd_first_token(p, row0, n_rows) - p.window_left);
}

// Where the block reads, once the lengths and indices may be read: the cache
// row cache_batch_idx[b] (clamped) instead of b, no row at all for a paged
// cache (the page ring adds the page), and the rotated q, which
// fd_append_kv wrote contiguous, when rotary is on.
struct fd_cache_q {  // q's strides, or the rotated copy's
    long long seq_stride = 0, head_stride = 0;
    bool rotated = false;
    __device__ __forceinline__ long long seq(const fd_params &p) const { return rotated ? seq_stride : p.q_seq_stride; }
    __device__ __forceinline__ long long head(const fd_params &p) const {
        return rotated ? head_stride : p.q_head_stride;
    }
    // The sequence's first row: its first of q (ragged.cuh), or of the
    // rotated copy, which keeps the planned rows from its own.
    __device__ __forceinline__ long long first_row(const fd_q_span &span) const { return rotated ? 0 : span.start; }
};

template <typename T, typename KV>
__device__ __forceinline__ void fd_cache_bases(const fd_params &p, int b, int kv_head, const T *&q_base,
                                               const KV *&k_base, const KV *&v_base, fd_cache_q &q) {
    long long row = 0;
    if (p.block_table == 0) row = p.cache_batch_idx ? min(max(fd_ptr<const int>(p.cache_batch_idx)[b], 0), p.cache_batch - 1) : b;
    k_base = fd_ptr<const KV>(p.k) + row * p.k_batch_stride + kv_head * p.k_head_stride;
    v_base = fd_ptr<const KV>(p.v) + row * p.v_batch_stride + kv_head * p.v_head_stride;
    if (p.rotary_cos != 0) {
        q.rotated = true;
        q.head_stride = p.head_dim;
        q.seq_stride = (long long)p.heads_q * p.head_dim;
        q_base = fd_ptr<const T>(p.q_rot) + b * p.seqlen_q * q.seq_stride;
    }
}

// A lane's query rows' first visible key (leftpad, left window), next to
// key_limit, which set() narrows to the window's right edge.
template <int MTILES>
struct fd_serving_rows {
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
// rather than held in registers.
struct fd_serving_score {
    float cap_in;  // scale / softcap
    __device__ __forceinline__ explicit fd_serving_score(const fd_params &p)
        : cap_in(p.softcap > 0.f ? p.scale / p.softcap : 0.f) {}

    // The softmax's pass over the scores: apply did it all.
    __device__ __forceinline__ void in_max(const fd_params &, float &, int, int) const {}

    // sc[mt][nt][2h + e]: packed row lane_row + mt * 16 + 8h of (b, kv_head),
    // key key_lane + nt * 8 + e; query token i at position pos0 + i.
    template <int MTILES>
    __device__ __forceinline__ void apply(const fd_params &p, float (&sc)[MTILES][2][4], int key_lane,
                                          const fd_serving_rows<MTILES> &rows, const int (&limit)[MTILES][2],
                                          int b, int kv_head, int lane_row, int pos0) const {
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
                    const int pos = pos0 + (valid ? r % p.seqlen_q : 0);
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


#endif  // FLASHDECODE_SERVING_CUH
