/*
 * flashdecode.h: the C API of libflashdecode.so (flash decoding for NVIDIA GPUs).
 *
 * Attention of a few new query tokens over a KV cache in two stages: a split-KV
 * kernel spreads each sequence's keys over the GPU's SMs, then a combine kernel
 * merges the per-split partial outputs by their log-sum-exp. The library is the
 * Go core (github.com/flash-decode/flash-decode/core) built with
 * `go build -buildmode=c-shared -o libflashdecode.so ./capi`.
 *
 * Usage: describe the layout once (shapes, strides, options), then run it on each
 * step's device addresses:
 *     fd_layout l = {0};
 *     l.dtype = FD_FLOAT16; l.batch = 1; l.seqlen_q = 1; l.heads_q = 32; l.heads_kv = 8;
 *     l.head_dim = 128; l.seqlen_cache = 4096; l.window_left = l.window_right = -1;
 *     l.q[0] = 32*128; l.q[1] = 32*128; l.q[2] = 128; l.q[3] = 1;   ... k_cache, v_cache, out
 *     fd_handle h;
 *     if (fd_prepare(&l, sizeof l, 0, &h) != FD_OK) puts(fd_last_error());
 *     size_t ws_bytes;
 *     fd_workspace_size(h, -1, &ws_bytes);    ... cuMemAlloc a workspace of ws_bytes
 *     fd_ptrs p = {0};
 *     p.q = q_ptr; p.k_cache = k_ptr; p.v_cache = v_ptr; p.out = out_ptr;
 *     if (fd_run(h, &p, sizeof p, -1, ws, ws_bytes, stream) != FD_OK) puts(fd_last_error());
 *     fd_release(h);
 * fd_decode (fd_args) does the same in one call, validating everything each time.
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

/* Element type of q, k, v and out; the caches of a layout may be fp8 instead
 * (fd_layout.kv_dtype). */
typedef enum fd_dtype {
    FD_FLOAT16 = 1,       /* IEEE half precision */
    FD_BFLOAT16 = 2,      /* bfloat16 */
    FD_FLOAT8_E4M3 = 4,   /* fp8, 4 exponent bits, no infinities, largest 448 (torch.float8_e4m3fn) */
    FD_FLOAT8_E5M2 = 5,   /* fp8, 5 exponent bits, largest 57344 (torch.float8_e5m2) */
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
    FD_ERR_LIMIT = 6,       /* a limit of the library: 65536 layouts held at once (fd_prepare) */
    FD_ERR_FORKED = 7,      /* called in a child forked (without exec) from the process that
                               loaded the library: its Go runtime does not survive fork; start
                               workers with spawn, or exec */
    FD_ERR_TYPE = 8,        /* an argument of the wrong type: a tensor's dtype (fd_tensors) */
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

/* One flash-decoding call (mirrors core.Problem). Zero-initialize, then set. Ragged query
 * lengths (cu_seqlens_q) are the prepared API's: fd_layout.ragged, fd_ptrs.cu_seqlens_q. */
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

/* ---- The prepared API: fd_prepare once, fd_run each step ----------------------------
 *
 * A layout is every fact of a decode but its device addresses and lengths: the same in
 * Go (core.Layout), in C (fd_layout) and in Python, one 8-byte field after another, so
 * fd_layout_fields() lists them. fd_prepare validates it once and returns a handle;
 * fd_run checks only the new addresses and launches. Strides count elements, in
 * (batch, seq, head, head_dim) order for a 4-D tensor, (row, column) for a 2-D table;
 * the stride of a dimension of size 1 is never read (any value is taken), the last
 * one must be 1 otherwise. Flags are 0 or 1. Zero-initialize, then set (and set the
 * window to -1, -1: a zeroed window is (0, 0)). */
typedef struct fd_layout {
    int64_t dtype;          /* fd_dtype of q, k_cache, v_cache, out (and k_new, v_new, rotary) */
    int64_t batch;          /* sequences, >= 1 */
    int64_t seqlen_q;       /* new query tokens per sequence, 1..16 */
    int64_t heads_q;        /* query heads: a multiple of heads_kv */
    int64_t heads_kv;       /* key/value heads, >= 1 */
    int64_t head_dim;       /* a multiple of 8, at most 256 */
    int64_t seqlen_cache;   /* keys per sequence the cache holds (max_pages * page_size when paged) */
    int64_t num_splits;     /* 0: the planner chooses; n > 0: asks for n (clamped) */
    int64_t device_lengths; /* 1: each fd_run passes cache_seqlens, an int32 (batch,) array of
                               lengths, and its seqlen is a bound on them (max_seqlen_k) */
    int64_t causal;         /* 1: query i sees keys j <= len - seqlen_q + i (bottom-right) */
    double scale;           /* softmax scale: 0 for 1/sqrt(head_dim), else a positive normal float32 */
    int64_t q[4];           /* strides of q (batch, seqlen_q, heads_q, head_dim) */
    int64_t k_cache[4];     /* of the caches (batch, seqlen_cache, heads_kv, head_dim), or
                               (cache_batch, ...), or paged (num_pages, page_size, ...) */
    int64_t v_cache[4];
    int64_t out[4];         /* of out, like q; written */
    int64_t page_size;      /* keys per page of a paged cache (block_table); 0: contiguous */
    int64_t num_pages;      /* pages in k_cache and v_cache */
    int64_t max_pages;      /* pages per sequence: block_table is (batch, max_pages) int32 */
    int64_t block_table[2]; /* its strides */
    int64_t cache_batch;    /* > 0: k_cache has this many rows, cache_batch_idx picks each
                               sequence's (contiguous caches only); 0: row b is sequence b */
    int64_t leftpad;        /* 1: fd_run passes cache_leftpad, int32 (batch,) first valid keys */
    int64_t window_left;    /* keys before a query's position it sees; -1: unbounded */
    int64_t window_right;   /* keys after it (causal makes it 0); -1: unbounded */
    double softcap;         /* > 0: scores become softcap * tanh(score / softcap); 0: off */
    int64_t alibi;          /* 1: fd_run passes alibi_slopes, float32 (batch, heads_q) or (heads_q,) */
    int64_t alibi_slopes[2]; /* its strides; a batch stride of 0: one slope per head */
    int64_t seqlen_new;     /* tokens k_new and v_new append to each sequence before attention; 0: none */
    int64_t k_new[4];       /* strides of k_new (batch, seqlen_new, heads_kv, head_dim) */
    int64_t v_new[4];
    int64_t rotary_dim;     /* with an append: rotate the first rotary_dim channels of q and the new
                               keys (a multiple of 16); 0: none */
    int64_t rotary_rows;    /* positions in the tables (rotary_rows, rotary_dim / 2) */
    int64_t rotary_cos[2];  /* strides of the tables, which share one layout */
    int64_t rotary_sin[2];
    int64_t rotary_interleaved; /* 1: pairs (2m, 2m+1) (GPT-J); 0: (m, m + rotary_dim / 2) */
    int64_t kv_dtype;       /* fd_dtype of k_cache and v_cache: 0 (or dtype) for dtype's, or
                               FD_FLOAT8_E4M3 / FD_FLOAT8_E5M2 under a float16 or bfloat16
                               dtype; strides still count elements (bytes, for fp8) */
    int64_t descale;        /* fp8 only. 1: each fd_run passes k_descale and v_descale, both,
                               float32 (batch, heads_kv) arrays read on the device (no value
                               in them is checked) */
    int64_t k_descale[2];   /* their strides (batch, heads_kv); 0, 0: one value for all */
    int64_t v_descale[2];
    double k_descale_value; /* fp8, without the arrays: k_cache's scale, a positive normal
                               float32; 0: 1. A cached element x attends as x * scale; an
                               appended one is stored as x / scale, saturated to the format's
                               largest value and rounded to nearest even */
    double v_descale_value; /* v_cache's, likewise */
    int64_t sinks;          /* 1: fd_run passes sinks, float32 (heads_q,) contiguous logits: query
                               head h's softmax gets exp(sinks[h]) more in its denominator, with
                               no value, and the LSE includes it (a row with no key: out 0, LSE
                               sinks[h]); any layout takes it, and its plan is the same */
    int64_t batch_invariant; /* 1: a sequence's result never depends on the batch it is in */
    int64_t ragged;         /* 1: ragged query lengths (FlashAttention 3's cu_seqlens_q): each
                               fd_run passes cu_seqlens_q; q and out are (total_q, heads_q,
                               head_dim) and k_new, v_new (total_q, heads_kv, head_dim), their
                               strides in q[1..3] (q[0], k_new[0]... are not read); seqlen_q is
                               max_seqlen_q, the most rows a sequence has (1..16), and
                               seqlen_new, with an append, must equal it */
    int64_t total_q;        /* with ragged: the rows of q, >= 1; else 0 */
} fd_layout;

/* One call's device addresses (CUdeviceptr): q, k_cache, v_cache and out always (the
 * caches may be 0 with seqlen_cache 0), the others exactly where the layout has them
 * (lse is optional). What a call writes (out, lse, with an append the caches) must
 * share no byte with the other tensors or the workspace. Zero-initialize, then set. */
typedef struct fd_ptrs {
    uint64_t q, k_cache, v_cache, out;
    uint64_t lse;            /* float32 (batch, heads_q, seqlen_q), or with ragged (heads_q,
                                total_q), contiguous, receiving the natural-log LSE; 0: not
                                wanted */
    uint64_t cache_seqlens;  /* int32 (batch,) lengths: with device_lengths (or instead of a
                                seqlen); clamped to [0, seqlen_cache] on the device */
    uint64_t block_table, cache_batch_idx, cache_leftpad, alibi_slopes;
    uint64_t k_new, v_new, rotary_cos, rotary_sin;
    uint64_t k_descale, v_descale; /* float32 scales of an fp8 cache, with the layout's descale */
    uint64_t sinks;                /* float32 (heads_q,) sink logits, given exactly with the
                                      layout's sinks, 4-byte aligned; read at each fd_run */
    uint64_t cu_seqlens_q;         /* int32 (batch + 1,) row offsets, given exactly with the
                                      layout's ragged: sequence b's query rows (and new
                                      tokens) are rows cu_seqlens_q[b] to cu_seqlens_q[b + 1]
                                      of q, out (and k_new, v_new), causal and bottom-right
                                      aligned to their own count. Read on the device: the
                                      start is clamped to [0, total_q], the count to
                                      [0, min(seqlen_q, total_q - start)] */
} fd_ptrs;

/* A prepared layout: nonzero id, from fd_prepare, until its fd_release. */
typedef struct fd_handle {
    int64_t id;
} fd_handle;

/* Validates *layout (layout_size: sizeof(fd_layout) of the caller's header, so that the
 * struct can grow) for CUDA device `device` and sets *out to its handle. A negative
 * device plans for an H200 (132 SMs) without a GPU: fd_workspace_size and fd_plan work,
 * fd_run is refused. The same layout and device give the same handle; each fd_prepare
 * holds it once more, each fd_release once less. Touches no GPU. */
int fd_prepare(const fd_layout *layout, size_t layout_size, int device, fd_handle *out);

/* Sets *bytes to the workspace fd_run needs with this seqlen. seqlen: -1 for the whole
 * cache; without device_lengths, every sequence's length (0..seqlen_cache; with new
 * tokens the cached ones before them); with device_lengths, a bound on the lengths
 * (max_seqlen_k), which the library rounds up to a power of two for its plan. The first
 * call for a device opens it (retains its primary context, loads the kernels). */
int fd_workspace_size(fd_handle h, int64_t seqlen, size_t *bytes);

/* Launches the prepared decode on ptrs (ptrs_size: sizeof(fd_ptrs)) with this seqlen
 * (see fd_workspace_size) on stream (a CUstream; NULL is the legacy default stream).
 * workspace: at least fd_workspace_size bytes of device memory (NULL when 0), 16-byte
 * aligned; its contents need no initialization. Never synchronizes, never allocates:
 * outputs are ready when the stream reaches this point. */
int fd_run(fd_handle h, const fd_ptrs *ptrs, size_t ptrs_size, int64_t seqlen, void *workspace,
           size_t workspace_bytes, void *stream);

/* Fills *plan with the launch fd_run makes with this seqlen. */
int fd_plan(fd_handle h, int64_t seqlen, fd_plan_info *plan);

/* Writes that plan as a NUL-terminated JSON object (the fields of core.Plan, snake_case)
 * into buf. *needed (if not NULL) receives the bytes it takes, NUL included; returns
 * FD_ERR_BUFFER, writing nothing, when buf_size is smaller (buf NULL with buf_size 0 asks
 * for the size only). */
int fd_plan_json(fd_handle h, int64_t seqlen, char *buf, size_t buf_size, size_t *needed);

/* Holds h once less: after its last fd_release the handle is refused. */
int fd_release(fd_handle h);

/* fd_layout's fields in order, "name:q,name:d,..." (q int64_t, d double; an array's
 * elements are name[0], name[1], ...): for callers that build the record by name. */
const char *fd_layout_fields(void);

/* ---- A call's tensors: fd_tensors -----------------------------------------------------
 *
 * A call as flash_attn_with_kvcache takes it (PyTorch's names): each tensor argument as
 * a framework holds it, and the options, one 8-byte field after another (fd_tensors_fields()
 * lists them). fd_prepare_tensors checks that the tensors agree (ranks, dtypes, shapes
 * against q's and the caches', the pairs given together, index tensors contiguous, one
 * device) and prepares the layout they describe, which fd_run then runs on their
 * addresses; errors name the argument (q, k_cache, cache_seqlens, ...). An int length
 * (cache_seqlens as an int) is fd_run's seqlen. Zero-initialize, then set. */

/* fd_tensor_desc.dtype codes beyond fd_dtype's and FD_FLOAT32: the index tensors' int32,
 * and two types named in errors. 0: any other type. */
enum { FD_INT32 = 6, FD_INT64 = 7, FD_FLOAT64 = 8 };

/* One tensor argument. */
typedef struct fd_tensor_desc {
    int64_t given;      /* 1: the argument is a tensor; 0: not given */
    int64_t dtype;      /* fd_dtype, FD_FLOAT32, FD_INT32, ... (0: another type) */
    int64_t device;     /* its CUDA device ordinal; -1: not on a CUDA device */
    int64_t rank;       /* its dimensions (at most 8 are described) */
    int64_t shape[8];   /* its sizes */
    int64_t strides[8]; /* its strides, in elements */
} fd_tensor_desc;

typedef struct fd_tensors {
    fd_tensor_desc q;       /* (batch, seqlen_q, heads_q, head_dim); with cu_seqlens_q (total_q, heads_q, head_dim) */
    fd_tensor_desc k_cache; /* (batch, seqlen_cache, heads_kv, head_dim), paged (num_pages, page_size, ...) */
    fd_tensor_desc v_cache;
    fd_tensor_desc k, v;    /* new tokens (batch, seqlen_new, heads_kv, head_dim), both or neither */
    fd_tensor_desc rotary_cos, rotary_sin; /* (rotary_rows, rotary_dim / 2), with k and v */
    fd_tensor_desc cache_seqlens;          /* int32 (batch,): device lengths */
    fd_tensor_desc cache_batch_idx, cache_leftpad; /* int32 (batch,) */
    fd_tensor_desc block_table;            /* int32 (batch, max_pages): k_cache is paged */
    fd_tensor_desc alibi_slopes;           /* float32 (heads_q,) or (batch, heads_q) */
    fd_tensor_desc sinks;                  /* float32 (heads_q,) */
    fd_tensor_desc out;                    /* q's shape and dtype; not given: contiguous */
    fd_tensor_desc k_descale, v_descale;   /* float32, 1 element or (batch, heads_kv), both or neither */
    fd_tensor_desc cu_seqlens_q;           /* int32 (batch + 1,): ragged query lengths */
    double softmax_scale;       /* 0: 1/sqrt(head_dim) */
    int64_t causal;             /* 0 or 1 */
    int64_t window_left;        /* -1: unbounded */
    int64_t window_right;
    double softcap;             /* 0: off */
    int64_t rotary_interleaved; /* 0 or 1 */
    int64_t num_splits;         /* 0: the planner chooses */
    int64_t batch_invariant;    /* 0 or 1 */
    int64_t max_seqlen_q;       /* with cu_seqlens_q: the most rows a sequence has, 1..16; 0 otherwise */
    double k_descale_value;     /* fp8 without descale tensors: k_cache's scale; 0: 1 */
    double v_descale_value;
} fd_tensors;

/* Checks *tensors (tensors_size: sizeof(fd_tensors) of the caller's header) and sets *out
 * to the handle of the layout they describe on q's device, as fd_prepare does. */
int fd_prepare_tensors(const fd_tensors *tensors, size_t tensors_size, fd_handle *out);

/* Checks *tensors as fd_prepare_tensors does, but for q's device, and writes the layout
 * they describe into *layout (layout_size: sizeof(fd_layout)), for fd_prepare on any
 * device (-1: planning without a GPU). Prepares nothing. */
int fd_tensors_layout(const fd_tensors *tensors, size_t tensors_size, fd_layout *layout, size_t layout_size);

/* fd_tensors' fields in order, as fd_layout_fields() lists fd_layout's: a descriptor's
 * are q.given, q.dtype, q.device, q.rank, q.shape[0], ..., q.strides[3]. */
const char *fd_tensors_fields(void);

/* ---- One-shot calls: fd_args ----------------------------------------------------------
 *
 * fd_decode and its kin take the whole call in one struct and validate all of it each
 * time; they run the same code as fd_prepare and fd_run. */

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

/* Flash decoding for args on device args->device, launched on stream (a CUstream;
 * NULL is the legacy default stream). workspace: device memory of at least
 * fd_workspace_size bytes (may be NULL when that is 0), 16-byte aligned and sharing
 * no byte with the call's tensors; its contents need no initialization. Returns
 * FD_OK or an fd_status. Outputs are ready when the stream reaches this point. */
int fd_decode(const fd_args *args, void *workspace, size_t workspace_bytes, void *stream);

/* Sets *bytes to the workspace fd_decode needs for args' shapes (pointers are not
 * read, but whether cache_seqlens is 0 counts; args->device -1 plans without a GPU).
 * fd_workspace_size(args, bytes) calls it (see below). */
int fd_args_workspace_size(const fd_args *args, size_t *bytes);

/* Fills *plan with the launch fd_decode would run for args' shapes; fd_plan(args, plan)
 * calls it. */
int fd_args_plan(const fd_args *args, fd_plan_info *plan);

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

/* fd_plan_json for fd_decode; fd_plan_json(args, buf, buf_size, needed) calls it. */
int fd_args_plan_json(const fd_args *args, char *buf, size_t buf_size, size_t *needed);

/* fd_plan_json for fd_decode_serving: the whole plan of a serving call, its append
 * kernel and rotated q's offset (q_rot_offset) included. */
int fd_plan_json_serving(const fd_args *args, const fd_serving *serving, char *buf, size_t buf_size,
                         size_t *needed);

/* fd_workspace_size, fd_plan and fd_plan_json take an fd_handle; given an fd_args
 * pointer instead (as before the prepared API), they call the fd_args_ function. */
#ifdef __cplusplus
}
static inline int fd_workspace_size(const fd_args *args, size_t *bytes) { return fd_args_workspace_size(args, bytes); }
static inline int fd_plan(const fd_args *args, fd_plan_info *plan) { return fd_args_plan(args, plan); }
static inline int fd_plan_json(const fd_args *args, char *buf, size_t buf_size, size_t *needed) {
    return fd_args_plan_json(args, buf, buf_size, needed);
}
extern "C" {
#elif !defined(FD_NO_ARGS_OVERLOADS)
#define fd_workspace_size(x, ...) \
    _Generic((x), fd_handle: fd_workspace_size, default: fd_args_workspace_size)((x), __VA_ARGS__)
#define fd_plan(x, ...) _Generic((x), fd_handle: fd_plan, default: fd_args_plan)((x), __VA_ARGS__)
#define fd_plan_json(x, ...) _Generic((x), fd_handle: fd_plan_json, default: fd_args_plan_json)((x), __VA_ARGS__)
#endif

/* The flash-decode release, e.g. "0.1.0". */
const char *fd_version(void);

/* The longest fd_last_error message, NUL included (longer ones are cut). */
#define FD_LAST_ERROR_MAX 1024

/* The message of the last failed fd_* call on the calling thread, naming the field at
 * fault as fd_layout, fd_ptrs, fd_args, fd_serving or fd_merge_args call it (or the
 * function's argument: seqlen, workspace, handle, ...) (e.g. "flashdecode: plan:
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

/* Merges args' states on device args->device, launched on stream (a CUstream; NULL is
 * the legacy default stream): one kernel launch, no host synchronization, no allocation
 * once the device is open (see fd_decode); it can then be captured in a CUDA graph. Returns FD_OK or an fd_status; fd_last_error()
 * names the argument at fault. The outputs are ready when the stream reaches this point. */
int fd_merge_states(const fd_merge_args *args, void *stream);

/* One tensor of a merge as a framework holds it (mirrors core.MergeTensor). */
typedef struct fd_merge_tensor {
    fd_tensor_desc desc; /* outs float16, bfloat16 or float32; lses and lse float32 */
    uint64_t data;       /* CUdeviceptr of its first element */
} fd_merge_tensor;

/* fd_merge_tensors' flags. */
enum { FD_MERGE_OUTS_STACKED = 1, FD_MERGE_LSES_STACKED = 2, FD_MERGE_PAIR = 4 };

/* Merges states described as merge_states takes them: tensors holds num_outs outs, then
 * num_lses lses, then out and lse (tensors_size bytes: num_outs + num_lses + 2 records).
 * outs is one (*rows, head_dim) tensor per state (at most FD_MERGE_MAX_POINTERS, of one
 * layout), or with FD_MERGE_OUTS_STACKED one (num_states, *rows, head_dim); lses likewise
 * (*rows) float32 (FD_MERGE_LSES_STACKED); out (*rows, head_dim) in outs' dtype and lse
 * (*rows) float32 (desc.given 0: not wanted) receive the merge. The row dimensions are
 * joined into the kernel's three where every tensor steps through them as one; with
 * FD_MERGE_PAIR errors name merge_state's out_a, lse_a, out_b, lse_b. Then as
 * fd_merge_states; a merge of no row launches nothing. */
int fd_merge_tensors(const fd_merge_tensor *tensors, size_t tensors_size, int64_t num_outs, int64_t num_lses,
                     int64_t flags, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* FLASHDECODE_H */
