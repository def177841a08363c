/*
 * flashdecode.h: the C API of libflashdecode.so (flash decoding for NVIDIA GPUs).
 *
 * Attention of a few new query tokens over a KV cache in two stages: a split-KV
 * kernel spreads each sequence's keys over the GPU's SMs, then a combine kernel
 * merges the per-split partial outputs by their log-sum-exp. The library is the
 * Go core (github.com/flash-decode/flash-decode/core) built with
 * `go build -buildmode=c-shared -o libflashdecode.so ./capi`.
 *
 * Usage:
 *     fd_args a = {0};
 *     a.dtype = FD_FLOAT16; a.batch = 1; a.seqlen_q = 1; a.heads_q = 32; a.heads_kv = 8;
 *     a.head_dim = 128; a.seqlen_cache = 4096; a.seqlen = -1; a.device = 0;
 *     a.q = (fd_tensor){q_ptr, 1*32*128, 32*128, 128};   ... k, v, out likewise
 *     size_t ws_bytes;
 *     if (fd_workspace_size(&a, &ws_bytes) != FD_OK) puts(fd_last_error());
 *     ... cuMemAlloc a workspace of ws_bytes (none when 0) ...
 *     if (fd_decode(&a, ws, ws_bytes, stream) != FD_OK) puts(fd_last_error());
 *
 * Device memory and streams are the CUDA driver API's (CUdeviceptr, CUstream); the
 * library uses the primary context of args->device, the one the CUDA runtime and
 * PyTorch use too. fd_decode never synchronizes with the host and never allocates,
 * once a device is open: the first call that names a device (fd_plan and
 * fd_workspace_size with device >= 0 too) retains its primary context and loads the
 * kernels, which allocates. Make one such call before capturing a CUDA graph.
 *
 * Loading: the library needs libcuda.so.1 (the NVIDIA driver). Its CUDA binding
 * (gorgonia.org/cu) calls cuInit when the library loads and exits the process if
 * that fails, so load it only where a driver is installed. It carries a Go runtime:
 * a process must not load a second Go shared library (such as flash_decode's Python
 * extension) beside it.
 */
#ifndef FLASHDECODE_H
#define FLASHDECODE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element type of q, k, v and out. */
typedef enum fd_dtype {
    FD_FLOAT16 = 1,  /* IEEE half precision */
    FD_BFLOAT16 = 2, /* bfloat16 */
} fd_dtype;

/* What every function returns. fd_last_error() tells more. */
typedef enum fd_status {
    FD_OK = 0,
    FD_ERR_INVALID = 1,     /* an argument can never be right (negative size, NULL pointer,
                               a device ordinal with no GPU, ...) */
    FD_ERR_UNSUPPORTED = 2, /* well-formed, but no kernel for it (a dtype or head_dim, a GPU
                               older than sm_80, a build without kernels) */
    FD_ERR_CUDA = 3,        /* the driver failed: a launch error, out of resources, ... */
    FD_ERR_BUFFER = 4,      /* a caller buffer is too small (fd_plan_json) */
    FD_ERR_INTERNAL = 5,    /* a bug in flash-decode; please report fd_last_error() */
} fd_status;

/* A 4-D (batch, seq, heads, head_dim) tensor in device memory. Strides count
 * elements, not bytes; the head_dim dimension is contiguous (stride 1). The kernels
 * load 8 elements at a time: ptr must be 16-byte aligned and the strides multiples
 * of 8. What a call writes (out, lse, and with an append the caches) must share no
 * byte with its other tensors or with the workspace. */
typedef struct fd_tensor {
    uint64_t ptr;          /* CUdeviceptr of element [0,0,0,0] */
    int64_t batch_stride;  /* elements between consecutive batch entries */
    int64_t seq_stride;    /* elements between consecutive tokens */
    int64_t head_stride;   /* elements between consecutive heads */
} fd_tensor;

/* One flash-decoding call (mirrors core.Problem). Zero-initialize, then set. */
typedef struct fd_args {
    int32_t dtype;        /* fd_dtype of q, k, v and out */
    int32_t batch;        /* sequences, >= 1 */
    int32_t seqlen_q;     /* new query tokens per sequence, 1..16 */
    int32_t heads_q;      /* query heads: a multiple of heads_kv (MHA, GQA, MQA) */
    int32_t heads_kv;     /* key/value heads, >= 1 */
    int32_t head_dim;     /* a multiple of 8, at most 256 */
    int32_t seqlen_cache; /* K/V rows per sequence (the cache's capacity), >= 0 */
    int32_t seqlen;       /* valid length of every sequence when cache_seqlens is 0;
                             < 0 means seqlen_cache. With cache_seqlens set, a value >= 0
                             only sizes the split (launch shapes never read device data). */
    int32_t num_splits;   /* 0: the planner chooses; n > 0: asks for n, clamped to
                             [1, min(128, key tiles of the planned length)] */
    int32_t causal;       /* nonzero: query i sees keys j <= len - seqlen_q + i (bottom-right) */
    float scale;          /* softmax scale; 0 means 1/sqrt(head_dim) */
    int32_t device;       /* CUDA device ordinal; fd_plan and fd_workspace_size accept -1:
                             plan for an H200 (132 SMs) without touching a GPU */
    fd_tensor q;          /* (batch, seqlen_q, heads_q, head_dim), dtype */
    fd_tensor k;          /* (batch, seqlen_cache, heads_kv, head_dim), dtype */
    fd_tensor v;          /* (batch, seqlen_cache, heads_kv, head_dim), dtype */
    fd_tensor out;        /* (batch, seqlen_q, heads_q, head_dim), dtype; written */
    uint64_t lse;         /* CUdeviceptr of float32 (batch, heads_q, seqlen_q), contiguous,
                             receiving the natural-log log-sum-exp (-inf for a row that sees
                             no key; out is 0 there); 0: not wanted */
    uint64_t cache_seqlens; /* CUdeviceptr of int32 (batch,) valid lengths, clamped to
                               [0, seqlen_cache] on the device; 0: use seqlen. Whether it is
                               0 is part of the shape: a batch with lengths balances its
                               splits by them, so pass the same args to fd_workspace_size */
} fd_args;

/* The launch fd_decode would run (mirrors core.Plan). */
typedef struct fd_plan_info {
    char kernel[64];            /* stage-1 (split-KV) kernel name */
    char combine[64];           /* stage-2 (combine) kernel that runs; "" when combine_grid == 0 */
    int32_t num_splits;         /* splits of each sequence's keys: grid[0] (of the items after
                                   the whole ones when grid[1] == grid[2] == 1, see grid); with
                                   balance_splits (fd_plan_json) > 0, the most one sequence
                                   takes, each taking its share by the lengths */
    int32_t row_tiles;          /* tiles of packed query rows per K/V head */
    int32_t grid[3];            /* stage-1 grid (num_splits, heads_kv * row_tiles, batch), or
                                   (whole_items + other items * num_splits, 1, 1) for a grid of
                                   more items than the GPU holds at once, whose first
                                   whole_items (fd_plan_json) run unsplit, or (items *
                                   (balance_splits + 1), 1, 1) for splits balanced by the
                                   lengths */
    int32_t threads;            /* stage-1 threads per block */
    int32_t shared_bytes;       /* stage-1 dynamic shared memory per block */
    int32_t cluster;            /* stage-1 cluster size along x: num_splits when the splits
                                   merge inside stage 1 (sm_90), else 1 */
    int32_t combine_grid;       /* combine blocks (0 when num_splits == 1 or cluster > 1) */
    int32_t combine_threads;    /* combine threads per block (0 when combine_grid == 0) */
    int32_t sms;                /* SM count planned for */
    int32_t blocks_per_sm;      /* resident stage-1 blocks per SM planned for */
    int64_t lse_partial_offset; /* byte offset of the partial LSEs in the workspace */
    int64_t workspace_bytes;    /* workspace fd_decode needs (0 when combine_grid == 0
                                   and no rotary embedding rotates q into it) */
} fd_plan_info; /* (its layout is fixed: newer plan fields, such as whole_items,
                   combine_row0, balance_splits and the append kernel, are in
                   fd_plan_json and fd_plan_json_serving only) */

/* The serving features of one call, flash_attn_with_kvcache's arguments beyond
 * fd_args (mirrors core.Problem's serving fields). Zero-initialize, then set: a
 * zeroed fd_serving (or NULL) turns every feature off. Positions are key indices
 * of a sequence's cache: sequence b attends to len = cache_seqlens[b] (or
 * fd_args.seqlen) + seqlen_new keys, clamped to [0, seqlen_cache], from
 * cache_leftpad[b] on; its query row i sits at position len - seqlen_q + i. */
typedef struct fd_serving {
    /* Paged cache (page_size > 0): fd_args.k and v are (num_pages, page_size, heads_kv,
       head_dim), their batch_stride the page stride, and fd_args.seqlen_cache is
       max_pages * page_size. Key j of sequence b is row j % page_size of page
       block_table[b, j / page_size]; ids out of [0, num_pages) are clamped on read
       and skipped on write. */
    uint64_t block_table;        /* CUdeviceptr of int32 (batch, max_pages) page ids */
    int64_t block_table_stride;  /* elements between sequences in block_table */
    int32_t page_size;           /* keys per page (k_cache.shape[1]), >= 1; 0: contiguous cache */
    int32_t num_pages;           /* pages in k and v (k_cache.shape[0]) */
    int32_t max_pages;           /* pages per sequence (block_table.shape[1]) */
    int32_t cache_batch;         /* cache_batch_idx: rows of k and v (k_cache.shape[0]), > 0 */
    uint64_t cache_batch_idx;    /* CUdeviceptr of int32 (batch,) cache rows (contiguous cache
                                    only; clamped to [0, cache_batch - 1]); required when
                                    cache_batch > 0, else 0 (sequence b reads row b) */
    uint64_t cache_leftpad;      /* CUdeviceptr of int32 (batch,) first valid key of each
                                    sequence; 0: keys start at 0 */
    int32_t window;              /* nonzero: window_left and window_right apply (window_size) */
    int32_t window_left;         /* keys before the query's position it sees, -1: unbounded */
    int32_t window_right;        /* keys after it (causal makes it 0), -1: unbounded */
    float softcap;               /* > 0: scores become softcap * tanh(score / softcap) */
    uint64_t alibi_slopes;       /* CUdeviceptr of float32 (heads_q,) or (batch, heads_q)
                                    slopes: scores -= slope * |position - key|; 0: none */
    int64_t alibi_batch_stride;  /* 0 for (heads_q,) slopes, else elements between sequences */
    fd_tensor k_new;             /* (batch, seqlen_new, heads_kv, head_dim), dtype: token t of
                                    sequence b is written to key cache_seqlens[b] + t before
                                    attention (skipped past the cache). Needs fd_args's
                                    cache_seqlens, or seqlen >= 0 (every sequence at that
                                    length) with seqlen + seqlen_new <= seqlen_cache */
    fd_tensor v_new;             /* likewise for v */
    int32_t seqlen_new;          /* new tokens per sequence, 1..seqlen_cache; 0: no append */
    int32_t rotary_dim;          /* with an append: rotate the first rotary_dim channels (a
                                    multiple of 16, <= head_dim) of q and the new keys; 0: none */
    uint64_t rotary_cos;         /* CUdeviceptr of (rotary_rows, rotary_dim / 2) cosines, dtype */
    uint64_t rotary_sin;         /* likewise the sines */
    int64_t rotary_stride;       /* elements between rows of the tables (a multiple of 8) */
    int32_t rotary_rows;         /* positions in the tables (seqlen_ro); positions are clamped */
    int32_t rotary_interleaved;  /* nonzero: pairs (2m, 2m+1) (GPT-J); 0: (m, m + rotary_dim/2) */
} fd_serving;

#ifndef FD_CGO_EXPORTS /* capi's Go code declares these itself (cgo has no const) */

/* Flash decoding for args on device args->device, launched on stream (a CUstream;
 * NULL is the legacy default stream). workspace: device memory of at least
 * fd_workspace_size bytes (may be NULL when that is 0), 16-byte aligned and sharing
 * no byte with the call's tensors; its contents need no initialization. Returns
 * FD_OK or an fd_status. Outputs are ready when the stream reaches this point. */
int fd_decode(const fd_args *args, void *workspace, size_t workspace_bytes, void *stream);

/* Sets *bytes to the workspace fd_decode needs for args' shapes (pointers are not
 * read, but whether cache_seqlens is 0 counts; args->device -1 plans without a GPU). */
int fd_workspace_size(const fd_args *args, size_t *bytes);

/* Fills *plan with the launch fd_decode would run for args' shapes. */
int fd_plan(const fd_args *args, fd_plan_info *plan);

/* fd_decode with the serving features of serving (NULL: none): a paged or
 * batch-indexed cache, leftpad, a window, softcap, ALiBi, and new tokens appended
 * to the cache (rotated with rotary_dim) before attention. Every argument is
 * checked before anything runs; workspace needs fd_workspace_size_serving bytes. */
int fd_decode_serving(const fd_args *args, const fd_serving *serving, void *workspace,
                      size_t workspace_bytes, void *stream);

/* fd_workspace_size for fd_decode_serving: reads the sizes and which of serving's
 * arrays are set (not what they hold); pass the same fd_serving as to the decode. It
 * refuses the sizes and options fd_decode_serving would (page counts, window, softcap,
 * new tokens, rotary layout), whatever the tensors. */
int fd_workspace_size_serving(const fd_args *args, const fd_serving *serving, size_t *bytes);

/* fd_plan for fd_decode_serving (the serving kernels when a feature is on). */
int fd_plan_serving(const fd_args *args, const fd_serving *serving, fd_plan_info *plan);

/* Writes the plan as a NUL-terminated JSON object (the fields of core.Plan, snake_case)
 * into buf. *needed (if not NULL) receives the bytes it takes, NUL included; returns
 * FD_ERR_BUFFER, writing nothing, when buf_size is smaller (buf NULL with buf_size 0
 * asks for the size only). */
int fd_plan_json(const fd_args *args, char *buf, size_t buf_size, size_t *needed);

/* fd_plan_json for fd_decode_serving: the whole plan of a serving call, its append
 * kernel and rotated q's offset (q_rot_offset) included. */
int fd_plan_json_serving(const fd_args *args, const fd_serving *serving, char *buf, size_t buf_size,
                         size_t *needed);

/* The flash-decode release, e.g. "0.1.0". */
const char *fd_version(void);

#endif /* FD_CGO_EXPORTS */

/* The longest fd_last_error message, NUL included (longer ones are cut). */
#define FD_LAST_ERROR_MAX 1024

/* The message of the last failed fd_* call on the calling thread, naming the field at
 * fault as fd_args, fd_serving or fd_merge_args call it (e.g. "flashdecode: plan:
 * heads_q: invalid argument: 12 is not a multiple of nheads_kv=5"; the details after
 * the field may use PyTorch's names: nheads_kv is heads_kv, k_cache.shape[0] is
 * num_pages); "" after a successful call. Valid until the thread's next fd_* call; it
 * takes no memory beyond a fixed per-thread buffer. */
const char *fd_last_error(void);

/* ---- Merging attention states: fd_merge_states --------------------------------------
 *
 * The combine stage on its own, for attention a caller computed in parts: cascade or
 * shared-prefix attention (a prefix shared by many sequences, then each one's own keys),
 * or attention over keys split across devices. It merges num_states results over
 * disjoint key sets, each a normalized output and its natural-log LSE per row, into the
 * attention over all their keys:
 *     lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) * out_s
 * An LSE of -inf is an empty state: it weighs nothing, whatever its output holds; a row
 * whose states are all empty gets out = 0 and lse = -inf. It accumulates in float32.
 *
 * A row is indexed by up to three row dimensions (i0, i1, i2), each with a stride (an
 * unused dimension has size 1; the strides of size-1 dimensions are not read), e.g.
 * (batch, seqlen_q, heads_q) for fd_decode's out, whose lse (batch, heads_q, seqlen_q)
 * is then read with row strides (heads_q * seqlen_q, 1, seqlen_q). The head_dim elements
 * of a row are contiguous. Strides count elements and must not be negative. */

/* fd_merge_states also takes float32 states (fd_decode does not). */
enum { FD_FLOAT32 = 3 };

#define FD_MERGE_MAX_POINTERS 8 /* most states passed one pointer each */

/* One input of every state: their outputs (outs) or their LSEs (lses). */
typedef struct fd_merge_input {
    uint64_t ptrs[FD_MERGE_MAX_POINTERS]; /* CUdeviceptr of each state (num_ptrs == num_states),
                                             or of state 0 of a stacked tensor (num_ptrs == 1) */
    int64_t state_stride;   /* num_ptrs == 1: elements between states (0: all the same) */
    int64_t row_strides[3]; /* elements between rows along row dimensions 0, 1, 2 */
    int32_t num_ptrs;       /* 1, or num_states when that is at most FD_MERGE_MAX_POINTERS */
} fd_merge_input;

/* One merge (mirrors core.MergeProblem). Zero-initialize, then set. */
typedef struct fd_merge_args {
    int32_t dtype;        /* FD_FLOAT16, FD_BFLOAT16 or FD_FLOAT32: of outs and out */
    int32_t num_states;   /* >= 1 */
    int32_t rows[3];      /* sizes of the row dimensions, each >= 1; at most 2^31 - 1 rows */
    int32_t head_dim;     /* a multiple of 4, at most 256 */
    int32_t device;       /* CUDA device ordinal */
    fd_merge_input outs;  /* (num_states, rows..., head_dim) in dtype: 4-element aligned
                             pointers, strides multiples of 4 */
    fd_merge_input lses;  /* (num_states, rows...) float32 natural-log LSEs, 4-byte aligned */
    uint64_t out;         /* CUdeviceptr of (rows..., head_dim) in dtype, written; 4-element
                             aligned, strides multiples of 4; must not overlap the inputs or
                             lse (byte ranges, first to last element, are compared: an out
                             interleaved with the states in one buffer is refused) */
    int64_t out_strides[3];
    uint64_t lse;         /* CUdeviceptr of (rows...) float32 receiving the merged LSE, 4-byte
                             aligned; must not overlap the inputs or out (as out);
                             0: not wanted */
    int64_t lse_strides[3];
} fd_merge_args;

#ifndef FD_CGO_EXPORTS

/* Merges args' states on device args->device, launched on stream (a CUstream; NULL is
 * the legacy default stream): one kernel launch, no host synchronization, no allocation
 * once the device is open (see fd_decode); it can then be captured in a CUDA graph. Returns FD_OK or an fd_status; fd_last_error()
 * names the argument at fault. The outputs are ready when the stream reaches this point. */
int fd_merge_states(const fd_merge_args *args, void *stream);

#endif /* FD_CGO_EXPORTS */

#ifdef __cplusplus
}
#endif

#endif /* FLASHDECODE_H */
