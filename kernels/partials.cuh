// partials.cuh: where a split's partial output and LSE lie in the workspace.
//
// A plan that merges through the combine (combine.cuh) has stage 1
// (split_kv.cuh) write each split's normalized fp32 output row and its LSE
// into the workspace, split by split, for the output rows (batch, query
// head, query token order) from p.combine_row0 on (params.h):
//     lse_partial[s * rows + (row - combine_row0)]
//     o_partial[(s * rows + (row - combine_row0)) * head_dim + d]
// with rows = fd_partial_rows(p). Both stages address them through these
// helpers, so that they agree by construction.
#ifndef FLASHDECODE_PARTIALS_CUH
#define FLASHDECODE_PARTIALS_CUH

#include "params.h"

// The rows the workspace holds for each split: those the combine merges.
__device__ __forceinline__ int fd_partial_rows(const fd_params &p) {
    return p.batch * p.heads_q * p.seqlen_q - p.combine_row0;
}

// The index of output row `row`'s partial in split 0: its LSE is at
// lse_partial[index], its output at o_partial + index * head_dim, and
// split s's lie s * fd_partial_rows(p) rows further.
__device__ __forceinline__ int fd_partial_row(const fd_params &p, int row) { return row - p.combine_row0; }

#endif  // FLASHDECODE_PARTIALS_CUH
