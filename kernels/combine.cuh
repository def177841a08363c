// combine.cuh: stage 2, the reduce kernel (reduce path 1): merges the splits
// of stage 1 by their log-sum-exp. (Reduce path 2, where the splits merge
// inside stage 1, is cluster_merge.cuh.)
//
// What it does. For each output row (b, query head, query token) it reads the
// num_splits partial LSEs (natural log, -inf for a split that saw no key) and
// normalized fp32 partial outputs o_s, and computes
//     lse = log(sum_s exp(lse_s)) = m + log(sum_s exp(lse_s - m)),  m = max_s lse_s
//     out = sum_s exp(lse_s - lse) * o_s
// through the shared softmax state (state.cuh): each split is the state
// (lse_s * log2 e, 1), empty when lse_s = -inf. A row whose splits are all
// empty gets out = 0 and lse = -inf. It writes out in q's dtype through the
// out strides, and lse when p.lse is not 0; with ragged query lengths only
// the rows of each sequence's own count (ragged.cuh).
//
// Launch shape. One block of 4 warps per output row: grid batch * heads_q *
// seqlen_q (core/variants.go CombineRows = 1), or only the rows from
// p.combine_row0 on, where stage 1 split only its last items
// (p.whole_items > 0); 3 KB of static shared memory. Plans of more than 32
// splits run the column-group form (fd_combine_cols: a block a row's 32
// columns), plans of at most 8 the narrow one (fd_combine_rows: a warp a
// row, 4 or 16 rows a block), both further down. Each has a balanced
// twin (BALANCED, fd_combine_*_bal in flashdecode.cu) for the plans that
// balance their splits by the lengths (balance.cuh): it merges the split
// count of the row's sequence, worked out from the lengths as stage 1 did,
// and leaves a row of one split, which stage 1 wrote itself. Each may be
// launched with programmatic dependent launch (sm_90): its blocks then start
// while stage 1 drains and wait in fd_pdl_wait for its results, which hides
// most of the second launch's latency. Where the plan says so
// (p.combine_early_dependents), once stage 1 is done it lets the next such
// kernel in (the next layer's stage 1, say), whose blocks then take the SMs
// it leaves idle and wait there instead of being scheduled after it.
//
// Why it is fast enough. It reads num_splits * head_dim * 4 bytes per row, a
// small fraction of the KV cache stage 1 read, so its time is L2 round trips,
// not bytes, and it runs after stage 1 on every split call: each round trip
// is time added to the call. So it takes one: warp w takes splits w,
// w + WARPS, ..., each lane keeping FD_COMBINE_UNROLL float4 loads (coalesced
// 512-byte rows) and their LSEs in flight, and merges them into its own
// online-softmax state without waiting for the other warps; the warps'
// states and rows meet once in shared memory at the end. So 8 * WARPS = 32
// splits are a single round trip, provided ptxas issues a step's loads
// before it uses any: it does so where the launch bounds give it the
// registers (flashdecode.cu; the narrow combines, kept small so that they
// share SMs with stage 1, take a few). One row per block also spreads a
// small batch over as many SMs as it has rows (b=1, 32 heads: 32).
#ifndef FLASHDECODE_COMBINE_CUH
#define FLASHDECODE_COMBINE_CUH

#include "balance.cuh"
#include "dev_hooks.h"
#include "params.h"
#include "partials.cuh"
#include "ptx.cuh"
#include "ragged.cuh"
#include "state.cuh"

#define FD_COMBINE_UNROLL 8  // splits one warp has in flight per step

// Folds splits first, first + step, ... (below count) of one output row into
// a warp's state st and its lane's columns acc (zeroed here; fd_fold_states),
// 8 at a time in one round trip to L2. lse_s and o_row are the row's split 0
// (split s at lse_s[s * partial_rows] and o_row + s * partial_rows * head_dim,
// partial_rows being the workspace's rows: those from combine_row0 on).
// An empty split (-inf) weighs 0; its o_s is 0.
template <int SLICES>
__device__ __forceinline__ void fd_combine_fold(fd_state &st, float4 (&acc)[SLICES], const fd_params &p,
                                                const float *lse_s, const float *o_row, int partial_rows,
                                                int first, int step, int count) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < SLICES; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    fd_fold_states<FD_COMBINE_UNROLL, SLICES, false, float4>(
        st, acc, first, count, step,
        [&](int s, bool live, float4 (&x)[SLICES]) {
            const float m = live ? lse_s[(long long)s * partial_rows] * CUDART_L2E_F : -CUDART_INF_F;
            const float *src = o_row + (long long)s * partial_rows * p.head_dim;
#pragma unroll
            for (int i = 0; i < SLICES; ++i) {
                const int d = lane * 4 + 128 * i;
                x[i] = live && d < p.head_dim ? *reinterpret_cast<const float4 *>(src + d)
                                              : make_float4(0.f, 0.f, 0.f, 0.f);
            }
            return m;
        },
        [](const float4 &x) { return x; });
}

// Output row `row` (batch, query head, query token order): where it goes
// in out as if its sequence's rows started at row 0 (known before the PDL
// wait), its sequence's rows (after it: a padding row of a ragged sequence
// is not written), and where its LSE goes (row itself without ragged
// lengths). Each is worked out from row where it is used, so that no more
// than out is held through the fold (a padding row is merged, then not
// written), and the divisions only where ragged.
template <typename T>
__device__ __forceinline__ T *fd_combine_out(const fd_params &p, int row) {
    return fd_ptr<T>(p.out) + fd_out_offset(p, row / (p.heads_q * p.seqlen_q), row / p.seqlen_q % p.heads_q,
                                            row % p.seqlen_q);
}
__device__ __forceinline__ fd_q_span fd_combine_span(const fd_params &p, int row) {
    if (p.cu_seqlens_q == 0) return {0, p.seqlen_q};
    return fd_q_span_of(p, row / (p.heads_q * p.seqlen_q));
}
__device__ __forceinline__ long long fd_combine_lse(const fd_params &p, int row, const fd_q_span &span) {
    if (p.cu_seqlens_q == 0) return row;
    return fd_lse_offset(p, row / (p.heads_q * p.seqlen_q), row / p.seqlen_q % p.heads_q,
                         span.start + row % p.seqlen_q);
}

template <typename T, int WARPS, bool BALANCED>
__device__ __forceinline__ void fd_combine(const fd_params &p) {
    constexpr int kSlices = 2;  // 2 x 128 columns (float4 per lane) cover head dims up to 256
    __shared__ float4 sum[WARPS - 1][kSlices * 32];
    __shared__ fd_state part[WARPS - 1];
    const int partial_rows = fd_partial_rows(p);  // the workspace's rows (partials.cuh)
    const int row = p.combine_row0 + blockIdx.x;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    T *out = fd_combine_out<T>(p, row);
    const float *lse_s = fd_ptr<float>(p.lse_partial) + fd_partial_row(p, row);  // split s at lse_s[s * partial_rows]
    const float *o_row = fd_ptr<float>(p.o_partial) + (long long)fd_partial_row(p, row) * p.head_dim;  // split s at + s * partial_rows * head_dim
    fd_touch_params(out, lse_s, o_row, p.num_splits);  // argument loads overlap the wait (ptx.cuh)
    const int count = BALANCED ? fd_row_splits(p, row) : p.num_splits;  // balanced: the row's own (balance.cuh)
    fd_pdl_wait();  // with programmatic dependent launch: until stage 1 has finished
    FD_TRACE(1);
    if (p.combine_early_dependents) fd_pdl_launch_dependents();
    if (BALANCED && count < 2) return;  // a row of one split: stage 1 wrote it

    // Warp w merges splits w, w + WARPS, ... into its own state and columns,
    // so 8 * WARPS splits cost a single round trip to L2.
    fd_state st = fd_state_empty();
    float4 acc[kSlices];
    fd_combine_fold(st, acc, p, lse_s, o_row, partial_rows, warp, WARPS, count);

    FD_TRACE(2);  // dev/trace/trace.cu: this warp's loads have landed and are merged

    // Warps 1.. hand their states and sums to warp 0, which merges them,
    // normalizes and writes.
    if (warp > 0) {
#pragma unroll
        for (int i = 0; i < kSlices; ++i) sum[warp - 1][i * 32 + lane] = acc[i];
        if (lane == 0) part[warp - 1] = st;
    }
    __syncthreads();
    FD_TRACE(3);
    if (warp > 0) return;
#pragma unroll
    for (int w = 0; w < WARPS - 1; ++w) {
        float sa, sb;
        fd_state_merge(st, part[w], sa, sb);
#pragma unroll
        for (int i = 0; i < kSlices; ++i) {
            const float4 o = sum[w][i * 32 + lane];
            acc[i] = fd_axpby4(acc[i], sa, o, sb);
        }
    }
    const float inv = fd_state_norm(st);  // every split empty: output 0
    const fd_q_span span = fd_combine_span(p, row);  // read once merged: nothing more held through the fold
    if (row % p.seqlen_q >= span.count) return;       // a ragged sequence's padding row
    out += (long long)span.start * p.out_seq_stride;
#pragma unroll
    for (int i = 0; i < kSlices; ++i) {
        const int d = lane * 4 + 128 * i;
        acc[i] = fd_scale4(acc[i], inv);
        if (d < p.head_dim) fd_store4(out + d, acc[i]);
    }
    if (lane == 0 && p.lse != 0) fd_ptr<float>(p.lse)[fd_combine_lse(p, row, span)] = fd_state_lse2(st) * CUDART_LN2_F;
}

// The narrow form, for plans of at most FD_COMBINE_UNROLL splits: one warp
// per output row, WARPS rows a block (grid ceil(rows / WARPS): 4, core
// Variant.CombineNarrowRows, or 16, CombineNarrowDenseRows, where only that
// grid is small enough). A warp loads all of its row's splits in one round
// trip and writes the row itself: no exchange between warps, no barrier,
// and a quarter (or a sixteenth) of the blocks, so that plans of more rows
// than stage-1 blocks can still let the next kernel in early
// (core.Plan.CombineEarlyDependents).
template <typename T, int WARPS, bool BALANCED>
__device__ __forceinline__ void fd_combine_rows(const fd_params &p) {
    constexpr int kSlices = 2;  // 2 x 128 columns (float4 per lane) cover head dims up to 256
    const int partial_rows = fd_partial_rows(p);  // the workspace's rows (partials.cuh)
    const int row = p.combine_row0 + blockIdx.x * WARPS + threadIdx.x / 32;  // a warp's row
    const bool live_row = fd_partial_row(p, row) < partial_rows;
    T *out = fd_combine_out<T>(p, row);
    const float *lse_s = fd_ptr<float>(p.lse_partial) + fd_partial_row(p, row);
    const float *o_row = fd_ptr<float>(p.o_partial) + (long long)fd_partial_row(p, row) * p.head_dim;
    fd_touch_params(out, lse_s, o_row, p.num_splits);
    const int count = BALANCED ? fd_row_splits(p, row) : p.num_splits;
    fd_pdl_wait();
    FD_TRACE(1);
    if (p.combine_early_dependents) fd_pdl_launch_dependents();
    if (!live_row) return;
    if (BALANCED && count < 2) return;

    fd_state st = fd_state_empty();
    float4 acc[kSlices];
    fd_combine_fold(st, acc, p, lse_s, o_row, partial_rows, 0, 1, count);
    FD_TRACE(2);  // dev/trace/trace.cu: the loads have landed and are merged
    FD_TRACE(3);  // (no warps to meet)
    const int lane = threadIdx.x % 32;
    const float inv = fd_state_norm(st);  // every split empty: output 0
    const fd_q_span span = fd_combine_span(p, row);  // read once merged: nothing more held through the fold
    if (row % p.seqlen_q >= span.count) return;       // a ragged sequence's padding row
    out += (long long)span.start * p.out_seq_stride;
#pragma unroll
    for (int i = 0; i < kSlices; ++i) {
        const int d = lane * 4 + 128 * i;
        if (d < p.head_dim) fd_store4(out + d, fd_scale4(acc[i], inv));
    }
    if (lane == 0 && p.lse != 0) fd_ptr<float>(p.lse)[fd_combine_lse(p, row, span)] = fd_state_lse2(st) * CUDART_LN2_F;
}

// The column-group form, for plans of more splits than fd_combine loads in
// one round trip (more than 32): a block of WARPS warps merges one group of
// FD_COMBINE_COLS columns of one output row, grid rows * ceil(head_dim /
// FD_COMBINE_COLS) (core Variant.CombineWide, CombineWideCols). A whole row
// of 128 splits is 64 KB of partials at head dim 128: a group is a quarter of
// that, so four times as many SMs pull it from L2 at once, and a lane holds
// one float4 a split (the whole-row form two, one idle at head dim 128 and
// below), so that all of a step's loads stay in flight.
//
// A warp's load covers 4 splits: lane (sub, c) holds columns c*4..c*4+3 of
// the group for split sub, so that lane folds splits warp*4 + sub, + 4*WARPS,
// ... (8 at a time, FD_COMBINE_UNROLL): 4 warps take 128 splits in one round
// trip to L2. The 4 subs of a column merge by shuffles, the warps through
// shared memory.
#define FD_COMBINE_COLS 32

template <typename T, int WARPS, bool BALANCED>
__device__ __forceinline__ void fd_combine_cols(const fd_params &p) {
    constexpr int kLanes = FD_COMBINE_COLS / 4;  // lanes a split's columns take: a float4 each
    constexpr int kSubs = 32 / kLanes;           // splits one warp-wide load brings
    __shared__ float4 sum[WARPS - 1][kLanes];
    __shared__ fd_state part[WARPS - 1];
    const int groups = (p.head_dim + FD_COMBINE_COLS - 1) / FD_COMBINE_COLS;
    const int partial_rows = fd_partial_rows(p);  // the workspace's rows (partials.cuh)
    const int row = p.combine_row0 + blockIdx.x / groups;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int d = blockIdx.x % groups * FD_COMBINE_COLS + lane % kLanes * 4;  // this lane's 4 columns
    const bool live_col = d < p.head_dim;
    T *out = fd_combine_out<T>(p, row);
    const float *lse_s = fd_ptr<float>(p.lse_partial) + fd_partial_row(p, row);
    const float *o_col = fd_ptr<float>(p.o_partial) + (long long)fd_partial_row(p, row) * p.head_dim + d;
    fd_touch_params(out, lse_s, o_col, p.num_splits);
    const int count = BALANCED ? fd_row_splits(p, row) : p.num_splits;
    fd_pdl_wait();
    FD_TRACE(1);
    if (p.combine_early_dependents) fd_pdl_launch_dependents();
    if (BALANCED && count < 2) return;

    fd_state st = fd_state_empty();
    float4 acc[1] = {make_float4(0.f, 0.f, 0.f, 0.f)};
    fd_fold_states<FD_COMBINE_UNROLL, 1, false, float4>(
        st, acc, warp * kSubs + lane / kLanes, count, WARPS * kSubs,
        [&](int s, bool live, float4 (&x)[1]) {
            const float m = live ? lse_s[(long long)s * partial_rows] * CUDART_L2E_F : -CUDART_INF_F;
            x[0] = live && live_col
                       ? *reinterpret_cast<const float4 *>(o_col + (long long)s * partial_rows * p.head_dim)
                       : make_float4(0.f, 0.f, 0.f, 0.f);
            return m;
        },
        [](const float4 &x) { return x; });
    FD_TRACE(2);  // dev/trace/trace.cu: this warp's loads have landed and are merged

    // The subs of a column (lanes c, c + kLanes, ...) merge; lanes 0..kLanes-1
    // then hold the warp's columns.
#pragma unroll
    for (int off = kLanes; off < 32; off *= 2) {
        const fd_state other{__shfl_xor_sync(0xffffffffu, st.m, off), __shfl_xor_sync(0xffffffffu, st.d, off)};
        const float4 o = make_float4(__shfl_xor_sync(0xffffffffu, acc[0].x, off),
                                     __shfl_xor_sync(0xffffffffu, acc[0].y, off),
                                     __shfl_xor_sync(0xffffffffu, acc[0].z, off),
                                     __shfl_xor_sync(0xffffffffu, acc[0].w, off));
        float sa, sb;
        fd_state_merge(st, other, sa, sb);
        acc[0] = fd_axpby4(acc[0], sa, o, sb);
    }
    if (warp > 0 && lane < kLanes) {
        sum[warp - 1][lane] = acc[0];
        if (lane == 0) part[warp - 1] = st;
    }
    __syncthreads();
    FD_TRACE(3);
    if (warp > 0 || lane >= kLanes) return;
#pragma unroll
    for (int w = 0; w < WARPS - 1; ++w) {
        float sa, sb;
        fd_state_merge(st, part[w], sa, sb);
        acc[0] = fd_axpby4(acc[0], sa, sum[w][lane], sb);
    }
    const fd_q_span span = fd_combine_span(p, row);  // read once merged: nothing more held through the fold
    if (row % p.seqlen_q >= span.count) return;       // a ragged sequence's padding row
    out += (long long)span.start * p.out_seq_stride;
    if (live_col) fd_store4(out + d, fd_scale4(acc[0], fd_state_norm(st)));  // every split empty: 0
    if (lane == 0 && d == 0 && p.lse != 0) fd_ptr<float>(p.lse)[fd_combine_lse(p, row, span)] = fd_state_lse2(st) * CUDART_LN2_F;
}

#endif  // FLASHDECODE_COMBINE_CUH
