// merge_params.h: fd_merge_params, the argument struct of the
// fd_merge_states_* kernels (merge_states.cuh), taken by value.
//
// The Go core (core/cuda/merge.go) fills it through cgo from this header, so
// the layout is shared by construction. Strides count elements. A row is
// indexed by up to three row dimensions (i0, i1, i2), i2 innermost; unused
// dimensions have size 1. Within a row the head_dim elements are contiguous.
#ifndef FLASHDECODE_MERGE_PARAMS_H
#define FLASHDECODE_MERGE_PARAMS_H

#include "params.h"  // fd_devptr, fd_ptr

#define FD_MERGE_MAX_POINTERS 8 // states passed one pointer each (a list of tensors)
#define FD_MERGE_ROW_DIMS 3

#ifdef __cplusplus
extern "C" {
#endif

// One input of every state (their outputs, or their LSEs). State s lives at
// ptrs[i] + (s - i) * state_stride with i = min(s, num_ptrs - 1): one pointer
// per state (num_ptrs == num_states, a list of tensors), or one pointer and a
// state stride (num_ptrs == 1, a stacked tensor). Its row (i0, i1, i2) is at
// + i0 * strides[0] + i1 * strides[1] + i2 * strides[2].
typedef struct fd_merge_input {
    fd_devptr ptrs[FD_MERGE_MAX_POINTERS];  // device addresses (params.h)
    long long state_stride;
    long long strides[FD_MERGE_ROW_DIMS];
    int num_ptrs;
} fd_merge_input;

typedef struct fd_merge_params {
    fd_merge_input outs;  // (num_states, rows..., head_dim) in the kernel's dtype, normalized
    fd_merge_input lses;  // (num_states, rows...) float32 natural-log LSE; -inf: an empty state
    fd_devptr out;        // (rows..., head_dim), the kernel's dtype
    fd_devptr lse;        // (rows...) float32 natural-log LSE, or 0
    long long out_strides[FD_MERGE_ROW_DIMS];
    long long lse_strides[FD_MERGE_ROW_DIMS];
    int rows[FD_MERGE_ROW_DIMS]; // sizes of the row dimensions; grid.x = their product
    int num_states;       // >= 1
    int head_dim;         // multiple of 4, at most 256
} fd_merge_params;

#ifdef __cplusplus
}
#endif

#endif  // FLASHDECODE_MERGE_PARAMS_H
