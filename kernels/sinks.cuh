// sinks.cuh: attention sinks (p.sinks, params.h): query head h's softmax has
// one more term exp(sinks[h]) in its denominator, with no value, so
//     out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^sink),  lse = log(sum_j e^(s_j) + e^sink).
// The sink is one more state of the row, (sinks[h] * log2(e), 1) with output
// 0, merged once where the row's output is normalized and written: stage 1
// writing a row of one split itself (split_kv_epilogue.cuh), the combine
// (combine.cuh) and the cluster merge (cluster_merge.cuh) start their merge
// from it. The tile loop never sees it, and partials stay those of the keys
// alone. A row that sees no key gets out 0 and lse sinks[h]; without sinks
// (p.sinks == 0) the merges start from the empty state, as before.
#ifndef FLASHDECODE_SINKS_CUH
#define FLASHDECODE_SINKS_CUH

#include <math_constants.h>

#include "params.h"
#include "state.cuh"

// Query head `head`'s sink in base-2 units, sinks[head] * log2(e), where
// `sink` (p.sinks is set and the row is written here), else -inf: a max
// that weighs nothing.
__device__ __forceinline__ float fd_sink2(const fd_params &p, bool sink, int head) {
    return sink ? fd_ptr<const float>(p.sinks)[head] * CUDART_L2E_F : -CUDART_INF_F;
}

// The state a row's merge starts from: the sink (sink2, 1), whose output is
// 0, or the empty state where sink2 is -inf.
__device__ __forceinline__ fd_state fd_sink_state(float sink2) {
    return sink2 == -CUDART_INF_F ? fd_state_empty() : fd_state{sink2, 1.f};
}

#endif  // FLASHDECODE_SINKS_CUH
