// state.cuh: the online-softmax state and its merge, shared by both stages.
//
// A set of scores s_j (already multiplied by scale * log2(e), so base 2) is
// summarized by m = max s_j and d = sum 2^(s_j - m); the output that goes with
// it is sum 2^(s_j - m) v_j (unnormalized) or that divided by d (normalized).
// Two states over disjoint key sets merge exactly: take the larger m and
// rescale each side by 2^(m_side - m). Its log-sum-exp is m + log2(d).
//
// The empty set (no visible key: a masked row, an empty split, length 0) is
// m = -inf, d = 0, output 0. Exponentiating against -inf would give
// 2^(-inf - -inf) = NaN, so offsets go through fd_state_offset, which maps an
// empty max to 0: then 2^(-inf - 0) = 0 and empty sides simply drop out, and
// a merge of two empty states stays empty.
#ifndef FLASHDECODE_STATE_CUH
#define FLASHDECODE_STATE_CUH

#include <math_constants.h>

struct fd_state {
    float m;  // max score in base-2 units, -inf when empty
    float d;  // sum of 2^(s - m), 0 when empty
};

__device__ __forceinline__ fd_state fd_state_empty() { return {-CUDART_INF_F, 0.f}; }

// The offset to exponentiate against for a max m: m itself, or 0 when empty.
__device__ __forceinline__ float fd_state_offset(float m) { return m == -CUDART_INF_F ? 0.f : m; }

// Merges b into a. scale_a and scale_b are the factors that bring a's and
// b's outputs (and sums) to the merged max: out = scale_a*out_a + scale_b*out_b.
__device__ __forceinline__ void fd_state_merge(fd_state &a, fd_state b, float &scale_a,
                                               float &scale_b) {
    const float m = fmaxf(a.m, b.m);
    const float off = fd_state_offset(m);
    scale_a = exp2f(a.m - off);
    scale_b = exp2f(b.m - off);
    a.m = m;
    a.d = a.d * scale_a + b.d * scale_b;
}

// Base-2 log-sum-exp of the state's scores; -inf when empty.
__device__ __forceinline__ float fd_state_lse2(fd_state s) {
    return s.d > 0.f ? s.m + log2f(s.d) : -CUDART_INF_F;
}

#endif  // FLASHDECODE_STATE_CUH
