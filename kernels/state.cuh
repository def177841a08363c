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

// Raises s's max to m (m >= s.m) and returns the factor that brings its
// output to the new max: fd_state_merge's scale_a against a side of max m.
__device__ __forceinline__ float fd_state_rescale(fd_state &s, float m) {
    const float alpha = exp2f(s.m - fd_state_offset(m));
    s = fd_state{m, s.d * alpha};
    return alpha;
}

// Adds a key set of base-2 LSE lse2 (the state (lse2, 1), whose output is
// normalized) to s, whose max is already at least lse2; returns the weight
// 2^(lse2 - m) of that output: fd_state_merge's scale_b when scale_a is 1.
__device__ __forceinline__ float fd_state_add(fd_state &s, float lse2) {
    const float w = exp2f(lse2 - fd_state_offset(s.m));
    s = fd_state{s.m, s.d + w};
    return w;
}

// The factor that normalizes the state's output: 1 / d, or 0 when empty (no
// visible key: output 0). A NaN sum (a NaN or +inf score or LSE went in)
// stays NaN, so that it is never taken for an empty state downstream.
__device__ __forceinline__ float fd_state_norm(fd_state s) { return s.d == 0.f ? 0.f : 1.f / s.d; }

// Base-2 log-sum-exp of the state's scores; -inf when empty, NaN when a NaN
// or +inf went in.
__device__ __forceinline__ float fd_state_lse2(fd_state s) {
    return s.d == 0.f ? -CUDART_INF_F : s.m + log2f(s.d);
}

// The outputs that go with states, 4 columns (a float4) at a time.

// a * s.
__device__ __forceinline__ float4 fd_scale4(const float4 &a, float s) {
    return make_float4(a.x * s, a.y * s, a.z * s, a.w * s);
}

// a + w * x.
__device__ __forceinline__ float4 fd_fma4(const float4 &a, float w, const float4 &x) {
    return make_float4(a.x + w * x.x, a.y + w * x.y, a.z + w * x.z, a.w + w * x.w);
}

// a * sa + x * sb: two outputs merged with fd_state_merge's scales.
__device__ __forceinline__ float4 fd_axpby4(const float4 &a, float sa, const float4 &x, float sb) {
    return make_float4(a.x * sa + x.x * sb, a.y * sa + x.y * sb, a.z * sa + x.z * sb, a.w * sa + x.w * sb);
}

// Folds the states s = first, first + step, ... below n (normalized outputs
// of disjoint key sets, as a combine or merge_states reads them) into a
// warp's running state st and its lane's columns acc = sum 2^(lse_s - m) o_s,
// UNROLL states a step. load(s, live, x) returns state s's base-2 LSE (-inf
// where !live) and fills x with its lane's raw columns; unpack(x[i]) turns
// one into a float4. All of a step's loads come before any use, so up to
// UNROLL states per warp cost a single round trip to memory where the
// kernel's register budget lets ptxas keep them in that order, and
// nothing waits for the other warps. An empty state weighs 0; with
// SKIP_EMPTY its columns are not read at all (merge_states: a caller's empty
// state may hold anything), else they must be finite (stage 1 writes 0s).
template <int UNROLL, int SLICES, bool SKIP_EMPTY, typename Raw, typename Load, typename Unpack>
__device__ __forceinline__ void fd_fold_states(fd_state &st, float4 (&acc)[SLICES], int first, int n, int step,
                                               Load load, Unpack unpack) {
    for (int s0 = first; s0 < n; s0 += step * UNROLL) {
        Raw x[UNROLL][SLICES];
        float m[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int s = s0 + u * step;
            m[u] = load(s, s < n, x[u]);
        }
        float mx = st.m;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) mx = fmaxf(mx, m[u]);
        const float alpha = fd_state_rescale(st, mx);  // rescales what the warp has so far
#pragma unroll
        for (int i = 0; i < SLICES; ++i) acc[i] = fd_scale4(acc[i], alpha);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const float w = fd_state_add(st, m[u]);  // 0 for an empty state
            if (!SKIP_EMPTY || w != 0.f) {
#pragma unroll
                for (int i = 0; i < SLICES; ++i) acc[i] = fd_fma4(acc[i], w, unpack(x[u][i]));
            }
        }
    }
}

#endif  // FLASHDECODE_STATE_CUH
