// sinks.cuh: attention sinks (p.sinks, params.h): query head h's softmax has
// one more term exp(sinks[h]) in its denominator, with no value, so
//     out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^sink),  lse = log(sum_j e^(s_j) + e^sink).
// The sink is the state (sinks[h] * log2(e), 1) with output 0, and split 0
// of each row starts its online softmax from it (stage 1, split_kv.cuh,
// before its tile loop). Every merge after that, of the key warps, of the
// splits by the combine or inside a cluster, then counts it once, as
// merge_states does for shards of which one carried the sink; the loop and
// the reduce paths are the same code with or without sinks, and a row that
// sees no key gets out 0 and lse sinks[h].
#ifndef FLASHDECODE_SINKS_CUH
#define FLASHDECODE_SINKS_CUH

#include <math_constants.h>

#include "params.h"

// Starts the online softmax of a lane's rows (packed row row_g + mt * 16 +
// 8h, below packed_rows) from their sinks: the max m is the sink in base 2
// and the sum l, which the 4 lanes of a row hold in shares, gets its 1 in
// lane t4 0. Called by one key warp of split 0 (its halves of the head dim
// alike), where p.sinks is set.
template <int MTILES>
__device__ __forceinline__ void fd_sink_start(const fd_params &p, int kv_head, int row_g, int packed_rows, int t4,
                                              float (&m)[MTILES][2], float (&l)[MTILES][2]) {
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row_g + mt * 16 + 8 * h;
            if (r < packed_rows) {
                m[mt][h] = fd_ptr<const float>(p.sinks)[kv_head * p.group + r / p.seqlen_q] * CUDART_L2E_F;
                l[mt][h] = t4 == 0 ? 1.f : 0.f;
            }
        }
}

#endif  // FLASHDECODE_SINKS_CUH
