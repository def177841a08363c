// ragged.cuh: ragged query lengths (p.cu_seqlens_q, params.h): which rows of
// q, out, lse, k_new and v_new are a sequence's, and where a row's output
// and LSE go. Without cu_seqlens_q every sequence has seqlen_q rows from
// row 0 of its batch entry, and these helpers compute what the kernels did
// before them; with it, the planned seqlen_q rows of a sequence past its
// own count are padding: computed (zero q) but never stored.
#ifndef FLASHDECODE_RAGGED_CUH
#define FLASHDECODE_RAGGED_CUH

#include "params.h"

// A sequence's query rows: rows [start, start + count) of the flattened
// tensors (start 0 of its own batch entry without cu_seqlens_q).
struct fd_q_span {
    int start, count;
};

// Sequence b's rows, read after the PDL wait (a kernel before may write
// cu_seqlens_q). Any values are memory-safe: start is clamped to
// [0, total_q], count to [0, min(seqlen_q, total_q - start)].
__device__ __forceinline__ fd_q_span fd_q_span_of(const fd_params &p, int b) {
    if (p.cu_seqlens_q == 0) return {0, p.seqlen_q};
    const int *cu = fd_ptr<const int>(p.cu_seqlens_q);
    const int start = min(max(cu[b], 0), p.total_q);
    return {start, min(max(cu[b + 1] - start, 0), min(p.seqlen_q, p.total_q - start))};
}

// The new tokens sequence b appends: its own query count with
// cu_seqlens_q (k_new and v_new are flattened as q is), else seqlen_new;
// cu_seqlens_q is read only where there are new tokens.
__device__ __forceinline__ int fd_new_tokens(const fd_params &p, int b) {
    if (p.seqlen_new == 0 || p.cu_seqlens_q == 0) return p.seqlen_new;
    return fd_q_span_of(p, b).count;
}

// The earliest query token of n_rows consecutive packed rows from row0
// (consecutive tokens of consecutive heads): row0's, unless they wrap past
// the last token (then token 0).
__device__ __forceinline__ int fd_first_token(const fd_params &p, int row0, int n_rows) {
    const int q0 = row0 % p.seqlen_q;
    return q0 + n_rows > p.seqlen_q ? 0 : q0;
}

// Element offsets of flattened row `row` (span.start + i) of sequence b's
// query head `head` in out, and of its LSE in lse.
__device__ __forceinline__ long long fd_out_offset(const fd_params &p, int b, int head, int row) {
    return b * p.out_batch_stride + (long long)row * p.out_seq_stride + head * p.out_head_stride;
}
__device__ __forceinline__ long long fd_lse_offset(const fd_params &p, int b, int head, int row) {
    return b * p.lse_batch_stride + head * p.lse_head_stride + row;
}

#endif  // FLASHDECODE_RAGGED_CUH
