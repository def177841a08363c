// params.h: the one plain-data struct every flash-decode kernel takes by value.
//
// The Go core (core/cuda) fills it through cgo from this very header, so the
// layout is shared by construction. Tensors are addressed by explicit strides
// counted in elements; only the last (head_dim) dimension must be contiguous,
// so a cache may be a slice of a larger buffer. Device addresses are
// integers (fd_devptr, as CUdeviceptr), never pointers: the Go side keeps the
// struct on its stack, where a pointer-typed field holding a device address
// would be taken for a Go pointer. Kernels convert them at use (fd_ptr).
#ifndef FLASHDECODE_PARAMS_H
#define FLASHDECODE_PARAMS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef unsigned long long fd_devptr;  // a device address; 0: none

typedef struct fd_params {
    // Inputs, in the variant's dtype (fp16 or bf16).
    fd_devptr q;            // const T: (batch, seqlen_q, heads_q, head_dim), or (total_q, heads_q, head_dim) with cu_seqlens_q
    fd_devptr k;            // const T: (batch, seqlen_cache, heads_kv, head_dim)
    fd_devptr v;            // const T: (batch, seqlen_cache, heads_kv, head_dim)
    fd_devptr cache_seqlens; // const int: (batch,) valid lengths, or 0: every batch uses `seqlen`

    // Outputs.
    fd_devptr out;          // T: q's shape and dtype
    fd_devptr lse;          // float: natural-log LSE by lse_batch_stride, lse_head_stride (below), or 0

    // Workspace for num_splits > 1 (0 when num_splits == 1: stage 1 then
    // writes out/lse itself and no combine runs). Rows are ordered
    // (batch, head_q, query), the same order as lse, from combine_row0 on.
    fd_devptr o_partial;    // float: [num_splits][batch * heads_q * seqlen_q - combine_row0][head_dim], normalized per split
    fd_devptr lse_partial;  // float: [num_splits][batch * heads_q * seqlen_q - combine_row0], -inf for a split that saw no key

    // Strides in elements.
    long long q_batch_stride, q_seq_stride, q_head_stride;
    long long k_batch_stride, k_seq_stride, k_head_stride;
    long long v_batch_stride, v_seq_stride, v_head_stride;
    long long out_batch_stride, out_seq_stride, out_head_stride;

    int batch;
    int seqlen_q;           // query tokens per sequence, 1..16
    int heads_q;
    int heads_kv;
    int group;              // heads_q / heads_kv: query heads sharing one K/V head
    int head_dim;           // actual head dim (<= the variant's compiled head dim, multiple of 8)
    int seqlen_cache;       // rows of K/V per sequence; lengths are clamped to [0, seqlen_cache]
    int seqlen;             // length used when cache_seqlens is 0
    int num_splits;         // splits of each sequence's length (grid.x of stage 1; see whole_items)
    int row_tiles;          // ceil(group * seqlen_q / variant rows): grid.y = heads_kv * row_tiles
    int causal;             // 1: query i sees keys j <= len - seqlen_q + i (bottom-right aligned)
    int early_dependents;   // 1: stage 1 lets the next kernel be scheduled as it starts, 0: once its loop is done
    int combine_early_dependents;  // 1: the combine lets the next kernel be scheduled once stage 1 is done, 0: as it ends
    int prefetch_tiles;     // plain stage 1: tiles of its split a block sends into L2 before the PDL wait (core.Plan.PrefetchTiles)
    // 0: the stage-1 grid is (num_splits, heads_kv * row_tiles, batch). > 0: a
    // 1-D grid whose first whole_items blocks each take one whole item (a
    // batch, K/V head, row tile, in that order) and whose later blocks take
    // the items after those in num_splits splits each; the combine then
    // merges only their rows, from row combine_row0 on, and the workspace
    // holds only theirs (a split's partial of row r at r - combine_row0).
    int whole_items;
    int combine_row0;       // first output row (batch, head, query order) the combine merges
    // > 0: balanced splits (balance.cuh, core.Plan.BalanceSplits): the split
    // count the plan would give equal lengths; the stage-1 grid is 1-D and
    // each sequence's own split count (at most num_splits) comes from all
    // the lengths, counted in tiles of balance_tile_keys keys (stage 1's).
    int balance_splits;
    int balance_tile_keys;
    float scale;            // softmax scale applied to q.k
    float scale_log2;       // scale * log2(e): kernels exponentiate with exp2f

    // Serving features: read by the fd_split_kv_serving_* and fd_append_kv_* kernels only.
    // With block_table, k and v are (num_pages, page_size, heads_kv, head_dim):
    // k/v_batch_stride is then the page stride, k/v_seq_stride the row stride in a page.
    fd_devptr block_table;         // const int: (batch, max_pages), or 0: contiguous cache
    long long block_table_stride;  // elements between sequences in block_table
    int page_size;                 // keys per page when block_table is set
    int num_pages;                 // pages in k/v (ids clamped to [0, num_pages - 1] on read)
    // key / page_size == (umulhi(key, page_div_m) + key) >> page_div_l for keys below 2^31
    // (the round-up method of Granlund and Montgomery; set by the core with page_size).
    unsigned int page_div_m;
    int page_div_l;
    fd_devptr cache_batch_idx;     // const int: (batch,), or 0: sequence b uses cache row b
    int cache_batch;               // k/v's batch dimension (cache rows) for clamping it
    fd_devptr cache_leftpad;       // const int: (batch,), or 0: keys start at 0
    int window_left, window_right; // -1: unbounded
    float softcap;                 // > 0: s = softcap * tanh(s / softcap)
    float softcap_log2;            // softcap * log2(e)
    fd_devptr alibi_slopes;        // const float: (heads_q,) or (batch, heads_q), or 0
    long long alibi_batch_stride;  // 0 for (heads_q,)
    fd_devptr k_new, v_new;        // const T: (batch, seqlen_new, heads_kv, head_dim), or 0
    long long k_new_batch_stride, k_new_seq_stride, k_new_head_stride;
    long long v_new_batch_stride, v_new_seq_stride, v_new_head_stride;
    int seqlen_new;                // 0: no append
    fd_devptr rotary_cos, rotary_sin; // const T: (rotary_rows, rotary_dim / 2), or 0
    long long rotary_stride;       // elements between rows of cos / sin
    int rotary_dim, rotary_rows, rotary_interleaved;
    fd_devptr q_rot;               // T: rotated q (batch, seqlen_q, heads_q, head_dim) contiguous, in the workspace; stage 1 reads it when rotary_cos != 0

    // fp8 caches (the variants whose cache type is fp8): an element x of k
    // (v) stands for x * descale, descale = k_descale[b * batch_stride +
    // kv_head * head_stride] where k_descale != 0, else k_descale_value.
    fd_devptr k_descale, v_descale;  // const float, or 0
    long long k_descale_batch_stride, k_descale_head_stride;
    long long v_descale_batch_stride, v_descale_head_stride;
    float k_descale_value, v_descale_value;

    // Attention sinks: const float (heads_q,), or 0: row r of head h has
    // exp(sinks[h]) more in its softmax denominator, with no value.
    fd_devptr sinks;

    // Batch-invariant splits (balance.cuh, core.Plan.InvariantTiles): > 0,
    // each sequence's split count comes from its own length alone, at
    // invariant_tiles key tiles (of balance_tile_keys keys) a split, the
    // split's tiles dealt round robin by that count; the grid's num_splits
    // is only the most any sequence takes, and its blocks past their
    // sequence's count exit. 0: off.
    int invariant_tiles;
    int invariant_max_splits;  // the most splits a sequence takes (core.MaxSplits): longer ones take more tiles a split
    int invariant_span_tiles;  // > 0 (a window): the most tiles counted for a sequence, ceil(window keys / tile) + 1
    // The fp8 variants' cache format: 1 float8_e5m2, 0 float8_e4m3fn.
    int kv_e5m2;

    // Ragged query lengths (FlashAttention 3's cu_seqlens_q): const int
    // (batch + 1,) row offsets, or 0: every sequence has seqlen_q rows.
    // With them, seqlen_q is the most a sequence has (what the plan is for),
    // q, out, k_new and v_new hold total_q rows (their batch strides 0), and
    // sequence b's query row i is row cu_seqlens_q[b] + i of each, for i
    // below its count cu_seqlens_q[b + 1] - cu_seqlens_q[b], both clamped
    // so that its rows lie in [0, total_q) and number at most seqlen_q
    // (fd_q_span, ragged.cuh). Its other planned rows are not read, and
    // nothing is written for them but the workspace's partials.
    fd_devptr cu_seqlens_q;
    int total_q;
    // Where lse's row (b, head, i) is: b * lse_batch_stride + head *
    // lse_head_stride + start + i, start being the sequence's first row
    // (0 without cu_seqlens_q): (batch, heads_q, seqlen_q) contiguous, or
    // (heads_q, total_q) with cu_seqlens_q.
    long long lse_batch_stride, lse_head_stride;
} fd_params;

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
// A device address as a pointer to T.
template <typename T>
__device__ __forceinline__ T *fd_ptr(fd_devptr a) {
    return reinterpret_cast<T *>(a);
}
#endif

#endif  // FLASHDECODE_PARAMS_H
