// sinks.cuh: attention sinks (p.sinks, params.h): query head h's softmax has
// one more term exp(sinks[h]) in its denominator, with no value, so
//     out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^sink),  lse = log(sum_j e^(s_j) + e^sink).
// The sink joins a row once, in its final state, where the row's output is
// normalized and written: stage 1 writing a row of one split itself
// (split_kv_epilogue.cuh), the combine (combine.cuh) and the cluster merge
// (cluster_merge.cuh). The tile loop never sees it, and partials stay those
// of the keys alone, so without sinks (p.sinks == 0) a row costs one
// uniform test.
#ifndef FLASHDECODE_SINKS_CUH
#define FLASHDECODE_SINKS_CUH

#include <math_constants.h>

#include "params.h"
#include "state.cuh"

// The factor that normalizes a row's final state st (fd_state_norm), with
// query head `head`'s sink merged into st first where `sink` (p.sinks is
// set and the row is written here): the sink is the state (sinks[head] *
// log2(e), 1) with output 0, and the factor brings st's output to the
// merged max too. A row that saw no key then has output 0 and LSE
// sinks[head] (fd_state_lse2(st) in base 2).
__device__ __forceinline__ float fd_sink_norm(const fd_params &p, bool sink, int head, fd_state &st) {
    float sa = 1.f, sb;
    if (sink) fd_state_merge(st, fd_state{fd_ptr<const float>(p.sinks)[head] * CUDART_L2E_F, 1.f}, sa, sb);
    return sa * fd_state_norm(st);
}

#endif  // FLASHDECODE_SINKS_CUH
