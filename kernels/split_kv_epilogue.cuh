// split_kv_epilogue.cuh: the end of a stage-1 block, after its tile loop:
// its warps' states parked in shared memory (fd_split_kv_park), merged row
// by row (fd_split_kv_write), and the writes of its rows: the output and
// LSE (one split), the fp32 partials and their LSE for the combine (reduce
// path 1, combine.cuh; partials.cuh), or, in a cluster launch, the rows
// parked or pushed for the merge inside the cluster (reduce path 2,
// cluster_merge.cuh), which the block runs next.
#ifndef FLASHDECODE_SPLIT_KV_EPILOGUE_CUH
#define FLASHDECODE_SPLIT_KV_EPILOGUE_CUH

#include "cluster_merge.cuh"
#include "params.h"
#include "partials.cuh"
#include "ptx.cuh"
#include "ragged.cuh"
#include "split_kv_config.cuh"
#include "state.cuh"

// Each warp parks its state (m, l) and unnormalized output o in shared
// memory, in so (output), sm (max) and sl (sum); the halves of D share a key
// warp's row, their states being the same.
template <int D, int ROWS>
__device__ __forceinline__ void fd_split_kv_park(
    float (&m)[fd_split_kv_config<D, ROWS>::kMTiles][2], float (&l)[fd_split_kv_config<D, ROWS>::kMTiles][2],
    float (&o)[fd_split_kv_config<D, ROWS>::kMTiles][fd_split_kv_config<D, ROWS>::kWarpDim / 8][4],
    float *const &so, float *const &sm, float *const &sl, const int &key_warp, const int &dim_part,
    const int &warp_col, const int &g, const int &t4) {
    using C = fd_split_kv_config<D, ROWS>;
#pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = l[mt][h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int row = key_warp * ROWS + mt * 16 + g + 8 * h;
#pragma unroll
            for (int n = 0; n < C::kWarpDim / 8; ++n)
                *reinterpret_cast<float2 *>(so + row * C::kMergeStride + warp_col + n * 8 + 2 * t4) =
                    make_float2(o[mt][n][2 * h], o[mt][n][2 * h + 1]);
            if (t4 == 0 && dim_part == 0) {
                sm[row] = m[mt][h];
                sl[row] = sum;
            }
        }
    }
}

// Its members refer to the block's values; the call (fd_bool<kByRow>) merges
// and writes every (row, 4 columns) item of the block's rows.
template <typename T, int D, int ROWS>
struct fd_split_kv_write {
    using C = fd_split_kv_config<D, ROWS>;
    float *const &sm, *const &sl;              // the key warps' maxes and sums (split_kv.cuh)
    float *const &sw, *const &slse;            // by row: the key warps' weights in a row, its base-2 LSE
    const bool &push;                          // a cluster's push merge
    uint64_t &merge_bar;                       // the barrier its pushes count on
    const fd_params &p;
    const int &cluster_n, &rank, &per_block;   // the cluster, this block's rank, the items each block owns
    const int &block_rows;                     // the block's real rows
    int &row0;                                 // the block's first packed row
    const int &packed_rows;
    float *const &so;                          // the key warps' unnormalized outputs
    const bool &clustered;
    float *const &park_o, *const &park_lse;    // a cluster's pull merge: the block's normalized rows and LSEs
    int &kv_head, &b, &num_splits, &split;     // the block's item and split
    const int &partial_rows;                   // the workspace's rows per split (partials.cuh)
    const fd_q_span &span;                     // the sequence's query rows (ragged.cuh)

    template <typename BY_ROW>
    __device__ __forceinline__ void operator()(BY_ROW by_row) const {
        constexpr bool kByRow = decltype(by_row)::value;
        if constexpr (kByRow) {
            if (threadIdx.x < ROWS) {
                const int row = threadIdx.x;
                fd_state st = fd_state_empty();
#pragma unroll
                for (int w = 0; w < C::kKeyWarps; ++w) st.m = fmaxf(st.m, sm[w * ROWS + row]);
                const float off = fd_state_offset(st.m);
                float wt[C::kKeyWarps];
#pragma unroll
                for (int w = 0; w < C::kKeyWarps; ++w) {
                    wt[w] = exp2f(sm[w * ROWS + row] - off);
                    st.d += sl[w * ROWS + row] * wt[w];
                }
                const float inv = fd_state_norm(st);  // no visible key: output 0
#pragma unroll
                for (int w = 0; w < C::kKeyWarps; ++w) sw[row * C::kKeyWarps + w] = wt[w] * inv;
                slse[row] = fd_state_lse2(st);
            }
            __syncthreads();
        }

        // Write 4 columns of one row per thread and step: the output itself
        // (one split), the partials for the combine kernel, or, in a cluster
        // launch, the block's parked rows for the cluster merge.
        if (push) {
            fd_cluster_wait();  // every block's barrier is initialized (arrived at the start)
            if (threadIdx.x == 0)
                fd_mbar_expect_bytes(&merge_bar, fd_cluster_inbox_bytes<D, ROWS>(cluster_n, rank, per_block,
                                                                                 block_rows, (p.head_dim + 3) / 4));
        }
        for (int idx = threadIdx.x; idx < ROWS * (D / 4); idx += C::kThreads) {
            const int row = idx / (D / 4);
            const int d = (idx % (D / 4)) * 4;
            const int r = row0 + row;
            if (r >= packed_rows || d >= p.head_dim) continue;
            fd_state st = fd_state_empty();
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
            if constexpr (kByRow) {
#pragma unroll
                for (int w = 0; w < C::kKeyWarps; ++w)
                    acc = fd_fma4(acc, sw[row * C::kKeyWarps + w],
                                  *reinterpret_cast<const float4 *>(so + (w * ROWS + row) * C::kMergeStride + d));
                st = fd_state{slse[row], 1.f};  // a state of that LSE (fd_state_lse2), acc already normalized
            } else {
#pragma unroll
                for (int w = 0; w < C::kKeyWarps; ++w) {
                    const int wr = w * ROWS + row;
                    float sa, sb;
                    fd_state_merge(st, fd_state{sm[wr], sl[wr]}, sa, sb);
                    acc = fd_axpby4(acc, sa, *reinterpret_cast<const float4 *>(so + wr * C::kMergeStride + d), sb);
                }
                acc = fd_scale4(acc, fd_state_norm(st));  // no visible key: output 0
            }
            if (push) {
                fd_cluster_push<D, ROWS>(&merge_bar, cluster_n, rank, per_block, idx, row, acc, fd_state_lse2(st));
                continue;
            }
            if (clustered) {
                *reinterpret_cast<float4 *>(park_o + row * D + d) = acc;
                if (d == 0) park_lse[row] = fd_state_lse2(st);
                continue;
            }
            const float lse = fd_state_lse2(st) * CUDART_LN2_F;  // natural log; -inf stays -inf
            const int head = kv_head * p.group + r / p.seqlen_q;
            const int qi = r % p.seqlen_q;
            const int out_row = (b * p.heads_q + head) * p.seqlen_q + qi;  // the partials' row order
            if (p.o_partial == 0 || num_splits == 1) {
                if (qi >= span.count) continue;  // a ragged sequence's padding row
                fd_store4(fd_ptr<T>(p.out) + fd_out_offset(p, b, head, span.start + qi) + d, acc);
                if (d == 0 && p.lse != 0) fd_ptr<float>(p.lse)[fd_lse_offset(p, b, head, span.start + qi)] = lse;
            } else {
                const long long prow = (long long)split * partial_rows + fd_partial_row(p, out_row);
                *reinterpret_cast<float4 *>(fd_ptr<float>(p.o_partial) + prow * p.head_dim + d) = acc;
                if (d == 0) fd_ptr<float>(p.lse_partial)[prow] = lse;
            }
        }
    }
};

#endif  // FLASHDECODE_SPLIT_KV_EPILOGUE_CUH
