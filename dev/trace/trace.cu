// trace.cu: where one call's time goes, block by block (a developer tool,
// not part of the library).
//
// It compiles the library's own stage-1 and combine code with the FD_TRACE
// hooks of kernels/dev_hooks.h defined, launches them exactly as the Go core does
// (programmatic dependent launch, the same grids, clusters or balanced splits
// where asked) in a CUDA graph of 20 calls over rotating layers, as the
// benchmark does, and records %globaltimer per block: entering, released from
// the PDL wait (the kernel's own: its work before the wait, the L2 prefetch
// included, runs before it as in the library), its first tiles' copies begun
// and issued, first tile landed, loop done, rows written, exit. It prints,
// per scenario, the event time per call and the medians over calls of those
// moments, counted from the end of the previous call, and (from %smid) how
// many SMs held one, two or more stage-1 blocks with those blocks' loop time
// and end, and how far apart the blocks end (the spread of their ends, and of
// its means by SM and by block, whose bytes are the same every call), and the
// slot time (the shares of all stage-1 slots over the call that blocks spent
// before their first tile, in their loop and after it), next to a plain
// streaming read of the same bytes. fp16, head dim 128, (batch, heads, seq,
// dim) layout, zero data. BENCHMARKS.md ("What bounds each regime") shows
// what it found.
//
//     nvcc -O3 -std=c++17 -arch=sm_90a -o trace dev/trace/trace.cu && ./trace [name part | =name]
//
// TRACE_DUMP=file appends every block's stamps to file, for analysis
// beyond the medians printed (dev/trace/dump.py reads it).
//
// The globaltimer ticks in 0.256 us steps on the H200.
#include <climits>
#include <cstdint>

#include "../common.cuh"

// One timestamp per block and hook (by thread 0), into the per-call buffer
// the wrapper kernels below set; and for hook 8 (stage 1's first tiles'
// copies issued) one per warp too, by its lane 0, in slots 10 to 13: a
// block's warps may issue their copies far apart.
__shared__ unsigned long long *fd_trace_ts;
#define FD_TRACE(i)                                                                              \
    do {                                                                                         \
        const int fd_trace_at_ = 16 * (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)); \
        if (threadIdx.x == 0) fd_trace_ts[fd_trace_at_ + (i)] = gtime();                         \
        if ((i) == 8 && threadIdx.x % 32 == 0 && threadIdx.x < 128)                              \
            fd_trace_ts[fd_trace_at_ + 10 + threadIdx.x / 32] = gtime();                         \
    } while (0)
#include "../../kernels/combine.cuh"
#include "../../kernels/split_kv.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

typedef unsigned long long u64;
__device__ __forceinline__ int flat_block() {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}
// 16 stamps per block: 0 enter, 1 after griddepcontrol.wait, 2 first tile
// landed, 3 loop done, 4 rows written (parked, in a cluster), 5 exit, 6 smid,
// 7 the first tiles' copies begin, 8 they are issued (thread 0), 10-13 they
// are issued (warps 0-3); for a combine block: 2 warp 0's loads merged, 3 the
// warps met. t1 < 0: stamp 1 is the kernel's own.
#define NS 16
__device__ __forceinline__ void stamp(u64 *ts, u64 t0, long long t1) {
    if (threadIdx.x == 0) {
        u64 *s = ts + NS * flat_block();
        s[0] = t0;
        if (t1 >= 0) s[1] = t1;
        s[5] = gtime();
        s[6] = smid();
    }
}

// Stage 1, plain or (kServing: a cache_batch_idx, or pages) the serving variant.
// Blocks at or past exit_from exit before the library's code runs (a
// balanced grid's blocks that would find no split, on equal lengths).
template <bool kServing>
__global__ void __launch_bounds__(128, 2) tr_split(const fd_params p, u64 *ts, int exit_from) {
    const u64 t0 = gtime();
    if (threadIdx.x == 0) fd_trace_ts = ts;
    __syncthreads();
    if (flat_block() >= exit_from) {
        stamp(ts, t0, (long long)t0);
        return;
    }
    // The kernel's own work before its PDL wait (argument loads, the L2
    // prefetch) runs before it, as in the library; it stamps its release (1).
    if constexpr (kServing) fd_split_kv_serving<half, 128, 16, fd_form_serving>(p);
    else fd_split_kv<half, 128, 16>(p);
    __syncthreads();
    stamp(ts, t0, -1);
}

// A balanced grid's spare blocks as a launch of their own after stage 1
// (on equal lengths they find no split): as many blocks, of stage 1's size,
// that let the combine in and wait for stage 1, so that the combine after
// them still waits for all of stage 1.
__global__ void __launch_bounds__(128, 2) tr_spare() {
    fd_pdl_launch_dependents();
    fd_pdl_wait();
}

// The combine: WARPS warps a row (fd_combine), or with ROWS a warp a row
// and WARPS rows a block (fd_combine_rows), or with COLS a block a row's
// group of 32 columns (fd_combine_cols), with the library's launch bounds
// (kernels/flashdecode.cu: one block an SM for the 4-warp ones, so that
// their loads stay in flight; 0 is no minimum); with BAL the balanced twin
// (fd_combine_*_bal: each row's split count from the lengths).
template <int WARPS, bool ROWS = false, bool COLS = false, bool BAL = false>
__global__ void __launch_bounds__(32 * WARPS, WARPS == 4 && !ROWS ? 1 : 0) tr_combine(const fd_params p, u64 *ts) {
    const u64 t0 = gtime();
    if (threadIdx.x == 0) fd_trace_ts = ts;
    __syncthreads();
    // The combine's own work before its PDL wait (the balanced twin's split
    // counts) runs before it, as in the library; it stamps its release (1).
    if constexpr (ROWS)
        fd_combine_rows<half, WARPS, BAL>(p);
    else if constexpr (COLS)
        fd_combine_cols<half, WARPS, BAL>(p);
    else
        fd_combine<half, WARPS, BAL>(p);
    __syncthreads();
    stamp(ts, t0, -1);
}

// A plain streaming read: block i sums `per_block` bytes from x + i * per_block
// with 16-byte loads, UNROLL in flight per thread; or, with interleave, the
// same bytes in 32 KB chunks dealt round robin (chunk c to block c % blocks).
template <int UNROLL>
__global__ void __launch_bounds__(256) tr_read(const int4 *x, long long per_block16, float *outp,
                                               u64 *ts, int pdl, int interleave) {
    const u64 t0 = gtime();
    if (pdl) {
        fd_pdl_wait();
        fd_pdl_launch_dependents();
    }
    const u64 t1 = gtime();
    const int4 *src = x + blockIdx.x * per_block16;
    float acc = 0.f;
    if (interleave) {  // 2048-int4 (32 KB) chunks blockIdx.x, +gridDim.x, ...: 8 loads a thread each
        const long long chunks = per_block16 * gridDim.x / 2048;
        for (long long ch = blockIdx.x; ch < chunks; ch += gridDim.x) {
            const int4 *c = x + ch * 2048;
            int4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = __ldcs(c + threadIdx.x + u * 256);
#pragma unroll
            for (int u = 0; u < 8; ++u) acc += __int_as_float(v[u].x ^ v[u].y ^ v[u].z ^ v[u].w);
        }
    } else {
        for (long long i = threadIdx.x; i < per_block16; i += 256 * UNROLL) {
            int4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                v[u] = i + u * 256 < per_block16 ? __ldcs(src + i + u * 256) : make_int4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) acc += __int_as_float(v[u].x ^ v[u].y ^ v[u].z ^ v[u].w);
        }
    }
    if (acc == 1.2345f) outp[blockIdx.x] = acc;  // keeps the loads
    __syncthreads();
    stamp(ts, t0, t1);
}

template <typename K, typename... A>
static void launch(K fn, dim3 grid, int threads, int smem, cudaStream_t s, bool pdl, int cluster,
                   A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr[2];
    int n = 0;
    if (pdl) {
        attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n].val.programmaticStreamSerializationAllowed = 1;
        n++;
    }
    if (cluster > 1) {
        attr[n].id = cudaLaunchAttributeClusterDimension;
        attr[n].val.clusterDim.x = cluster;
        attr[n].val.clusterDim.y = 1;
        attr[n].val.clusterDim.z = 1;
        n++;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    CK(cudaLaunchKernelEx(&cfg, fn, args...));
}

struct Stats {
    std::vector<double> v;
    void add(double x) { v.push_back(x); }
    double med() {
        if (v.empty()) return 0;
        std::vector<double> w = v;
        std::sort(w.begin(), w.end());
        return w[w.size() / 2];
    }
    double mean() const {
        double m = 0;
        for (double x : v) m += x;
        return v.empty() ? 0 : m / v.size();
    }
};

static const int kCalls = 20;

// One scenario: a graph of kCalls calls; returns after printing.
struct Scenario {
    std::string name;
    // attention
    int batch = 1, L = 1024, splits = 1, cluster = 1, hq = 32, hkv = 8;
    int sq = 1;  // query tokens per sequence: group * sq rows a block, at most 16
    // Whether the combine lets the next call in once stage 1 is done: -1 as
    // core.Plan.CombineEarlyDependents, 0 never, 1 always.
    int combine_early = -1;
    // Whether stage 1 lets the combine in at its start (else after its
    // loop): -1 as core.Plan.EarlyDependents, 0 never, 1 always.
    int stage1_early = -1;
    // Items (sequence, KV head) taken whole by the first blocks of a 1-D
    // grid, the rest split (core.Plan.WholeItems); 0: the 3-D grid.
    int whole = 0;
    // Rows a combine block merges: 1 (fd_combine, the splits spread over
    // its warps) or 4 or 16 (fd_combine_rows, a warp a row; at most 8 splits).
    int combine_rows = 1;
    // Balanced splits (core.Plan.BalanceSplits, kernels/balance.cuh): > 0 is
    // the count equal lengths take, splits then the most a sequence takes
    // (the plan's NumSplits); a 1-D grid of items * (balance + 1) blocks,
    // and the combine's balanced twin. Its blocks past the batch's splits
    // exit at once, and the statistics below leave them out.
    int balance = 0;
    // Which combine follows: -1 as the plan (the balanced twin where
    // balance > 0), 0 the plain one (count: the split count equal lengths
    // take), 1 the balanced twin (balanced at that count). Equal lengths
    // give both the same splits, so that a stage 1 can be timed with either.
    int twin = -1;
    // Balanced: a grid of items * balance blocks, without the blocks past
    // the splits equal lengths take (right for equal lengths only).
    bool exact_grid = false;
    // Balanced: the blocks past the splits equal lengths take exit before
    // the library's code (without its scan of the lengths).
    bool idle_exit = false;
    // Balanced, with exact_grid: the spare blocks (items of them) as a
    // launch of their own between stage 1 and the combine (tr_spare).
    bool spare_kernel = false;
    // Whether cache_seqlens is a device tensor (L each) rather than the
    // int seqlen: always with balance, as the library plans only then.
    bool lens_tensor = false;
    // Where the layers sit: 0 one cudaMalloc each; 1 back to back in one
    // allocation (as torch's caching allocator carves them from a cached
    // segment); 2 one cudaMalloc each, after 6.4 GB were allocated and
    // freed; 3 back to back at the start of one 2.2 GB allocation.
    int placement = 0;
    // Bytes a cudaMemsetAsync zeroes before each stage-1 launch (0: none):
    // what a memset node costs inside the graph, e.g. for per-call counters.
    int memset_bytes = 0;
    // Layers the calls rotate over (0: enough to rotate past the L2; 1: the
    // same cache every call, L2-resident).
    int layers = 0;
    // read kernel
    bool read = false;
    long long read_bytes = 0;
    int read_blocks = 0, read_unroll = 4;
    bool pdl = true;
    bool interleave = false;  // read in 32 KB chunks dealt round robin to the blocks, not one run each
    // 0 the plain kernel; the serving kernel on the same cache, 1 through
    // cache_batch_idx = arange, 2 as pages of 16 keys in order (b=1 only).
    int serving = 0;
};

static void run(const Scenario &sc) {
    const int hq = sc.hq, hkv = sc.hkv, d = 128;
    const long long cache_bytes =
        sc.read ? sc.read_bytes : 2LL * sc.batch * sc.L * hkv * d * 2;
    const int layers = sc.layers > 0 ? sc.layers : std::max(3, (int)((240e6 + cache_bytes - 1) / cache_bytes));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<void *> bufs(layers);
    void *arena = nullptr;
    if (sc.placement == 1 || sc.placement == 3) {
        const size_t total = std::max<size_t>((size_t)layers * cache_bytes, sc.placement == 3 ? 2200000000ull : 0);
        CK(cudaMalloc(&arena, total));
        CK(cudaMemset(arena, 0, total));  // zeros: finite scores
        for (int i = 0; i < layers; ++i) bufs[i] = (char *)arena + (size_t)i * cache_bytes;
    } else {
        if (sc.placement == 2) {
            void *big;
            CK(cudaMalloc(&big, 6400000000ull));
            CK(cudaFree(big));
        }
        for (auto &b : bufs) {
            CK(cudaMalloc(&b, cache_bytes));
            CK(cudaMemset(b, 0, cache_bytes));  // zeros: finite scores
        }
    }
    void *counters;
    CK(cudaMalloc(&counters, 1 << 16));
    const int rows = sc.batch * hq * sc.sq;
    void *q, *out, *ws = nullptr;
    CK(cudaMalloc(&q, (size_t)rows * d * 2));
    CK(cudaMemset(q, 0, (size_t)rows * d * 2));
    CK(cudaMalloc(&out, (size_t)rows * d * 2));
    const bool combine = !sc.read && sc.splits > 1 && sc.cluster == 1;
    int *lens = nullptr;  // cache_seqlens: L for every sequence
    if (sc.lens_tensor || sc.balance > 0) {
        CK(cudaMalloc(&lens, sc.batch * 4));
        std::vector<int> h(sc.batch, sc.L);
        CK(cudaMemcpy(lens, h.data(), sc.batch * 4, cudaMemcpyHostToDevice));
    }
    if (combine) CK(cudaMalloc(&ws, (size_t)sc.splits * rows * (d + 1) * 4));
    float *partial;
    CK(cudaMalloc(&partial, 1 << 20));

    const int items = hkv * sc.batch;
    const int g1 = sc.read ? sc.read_blocks
                 : sc.balance > 0 ? items * (sc.balance + (sc.exact_grid ? 0 : 1))
                 : sc.whole > 0 ? sc.whole + (items - sc.whole) * sc.splits
                                : sc.splits * items;
    const int row0 = sc.whole * (hq / hkv) * sc.sq;  // the combine's first row
    // Above 32 splits, as the planner: a block a row's group of 32 columns
    // (balanced: the combine equal lengths take, core.Plan.setCombine).
    const int combine_splits = sc.balance > 0 ? sc.balance : sc.splits;
    const int groups =
        sc.combine_rows == 1 && combine_splits > 32 ? (d + FD_COMBINE_COLS - 1) / FD_COMBINE_COLS : 1;
    const int g2 = combine ? (rows - row0 + sc.combine_rows - 1) / sc.combine_rows * groups : 0;
    u64 *ts;
    const size_t per_call = (size_t)(g1 + g2) * NS;
    CK(cudaMalloc(&ts, per_call * kCalls * 8));
    CK(cudaMemset(ts, 0, per_call * kCalls * 8));

    const int smem = sc.cluster > 1 ? 122880 : 98304;
    for (auto fn : {tr_split<false>, tr_split<true>}) {
        CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, 122880));
        CK(cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    }
    CK(cudaFuncSetAttribute(tr_spare, cudaFuncAttributeMaxDynamicSharedMemorySize, 122880));
    // The serving kernel's indices: cache rows 0..batch-1, or pages 0..L/16-1.
    int *idx;
    const int n_idx = std::max(sc.batch, sc.L / 16);
    CK(cudaMalloc(&idx, n_idx * 4));
    {
        std::vector<int> h(n_idx);
        for (int i = 0; i < n_idx; ++i) h[i] = i;
        CK(cudaMemcpy(idx, h.data(), n_idx * 4, cudaMemcpyHostToDevice));
    }

    // As core.Plan.EarlyDependents: the next kernel is let in at stage 1's
    // start when the combine follows or the grid has no more blocks than SMs.
    int num_sms = 0;
    CK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
    const bool early_dependents = sc.stage1_early < 0 ? combine || g1 <= num_sms : sc.stage1_early == 1;
    // As core.Plan.CombineEarlyDependents: the combine lets the next kernel
    // in once stage 1 is done when it has no more blocks than stage 1 and SMs.
    const bool combine_early_dependents =
        combine && (sc.combine_early < 0 ? g2 <= std::min(g1, num_sms) : sc.combine_early == 1);
    // As core.Plan.PrefetchTiles: the plain kernel's splits of at most two
    // tiles that merge in clusters go into L2 before the PDL wait.
    const int split_tiles = (sc.L / 64 + sc.splits - 1) / sc.splits;
    const int prefetch_tiles = sc.cluster > 1 && sc.serving == 0 && split_tiles <= 2 ? split_tiles : 0;

    auto call = [&](int i) {
        u64 *t = ts + per_call * i;
        void *kv = bufs[i % layers];
        if (sc.read) {
            const long long per16 = cache_bytes / 16 / sc.read_blocks;
            if (sc.read_unroll == 8)
                launch(tr_read<8>, dim3(sc.read_blocks), 256, 0, s, sc.pdl, 1, (const int4 *)kv, per16, partial, t, (int)sc.pdl, (int)sc.interleave);
            else
                launch(tr_read<4>, dim3(sc.read_blocks), 256, 0, s, sc.pdl, 1, (const int4 *)kv, per16, partial, t, (int)sc.pdl, (int)sc.interleave);
            return;
        }
        fd_params p = {};
        p.q = (fd_devptr)q;
        p.k = (fd_devptr)kv;
        p.v = (fd_devptr)((char *)kv + cache_bytes / 2);
        p.out = (fd_devptr)out;
        if (combine) {
            p.o_partial = (fd_devptr)ws;
            p.lse_partial = (fd_devptr)((float *)ws + (size_t)sc.splits * rows * d);
        }
        p.q_batch_stride = (long long)sc.sq * hq * d;  // (b, s, h, d)
        p.q_seq_stride = hq * d;
        p.q_head_stride = d;
        p.k_batch_stride = p.v_batch_stride = (long long)hkv * sc.L * d;  // (b, h, s, d)
        p.k_seq_stride = p.v_seq_stride = d;
        p.k_head_stride = p.v_head_stride = (long long)sc.L * d;
        p.out_batch_stride = (long long)sc.sq * hq * d;
        p.out_seq_stride = hq * d;
        p.out_head_stride = d;
        p.batch = sc.batch;
        p.seqlen_q = sc.sq;
        p.heads_q = hq;
        p.heads_kv = hkv;
        p.group = hq / hkv;
        p.head_dim = d;
        p.seqlen_cache = sc.L;
        p.seqlen = sc.L;
        p.num_splits = sc.splits;
        p.row_tiles = 1;
        p.whole_items = sc.whole;
        p.combine_row0 = row0;
        p.early_dependents = early_dependents;
        p.combine_early_dependents = combine_early_dependents;
        p.prefetch_tiles = prefetch_tiles;
        if (lens) p.cache_seqlens = (fd_devptr)lens;
        if (sc.balance > 0) {
            p.balance_splits = sc.balance;
            p.balance_tile_keys = 64;
        }
        p.scale = 0.088f;
        p.scale_log2 = 0.088f * 1.4427f;
        p.window_left = p.window_right = -1;
        p.cache_batch = sc.batch;
        if (sc.serving == 1) p.cache_batch_idx = (fd_devptr)idx;
        if (sc.serving == 2) {  // (b, h, s, d) seen as pages of 16 keys of every head
            p.block_table = (fd_devptr)idx;
            p.page_size = 16;
            p.num_pages = sc.L / 16;
            p.page_div_m = 1;  // n / 16 = (umulhi(n, 1) + n) >> 4
            p.page_div_l = 4;
            p.k_batch_stride = p.v_batch_stride = 16 * d;
        }
        if (sc.memset_bytes > 0) CK(cudaMemsetAsync(counters, 0, sc.memset_bytes, s));
        launch(sc.serving ? tr_split<true> : tr_split<false>,
               sc.whole > 0 || sc.balance > 0 ? dim3(g1) : dim3(sc.splits, hkv, sc.batch), 128, smem, s, sc.pdl,
               sc.cluster, p, t, sc.idle_exit ? items * sc.balance : INT_MAX);
        if (sc.spare_kernel) launch(tr_spare, dim3(items), 128, smem, s, sc.pdl, 1);
        if (combine) {
            // The library's combine for the plan, or its balanced twin.
            const bool bal = sc.twin < 0 ? sc.balance > 0 : sc.twin == 1;
            fd_params pc = p;  // the combine's arguments (twin: as a balanced plan's)
            if (sc.twin == 0) pc.num_splits = combine_splits;
            if (sc.twin == 1 && sc.balance == 0) {
                pc.balance_splits = sc.splits;
                pc.balance_tile_keys = 64;
            }
            void (*fn)(const fd_params, u64 *) = bal ? tr_combine<4, false, false, true> : tr_combine<4>;
            int threads = 128;
            if (sc.combine_rows == 16) {
                fn = bal ? tr_combine<16, true, false, true> : tr_combine<16, true>;
                threads = 512;
            } else if (sc.combine_rows == 4)
                fn = bal ? tr_combine<4, true, false, true> : tr_combine<4, true>;
            else if (groups > 1)
                fn = bal ? tr_combine<4, false, true, true> : tr_combine<4, false, true>;
            launch(fn, dim3(g2), threads, 0, s, sc.pdl, 1, pc, t + NS * g1);
        }
    };
    for (int i = 0; i < 3; ++i) call(i);
    CK(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kCalls; ++i) call(i);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaGraphLaunch(exec, s));
    Stats per;
    for (float ms : time_graph(exec, s, 9)) per.add(ms * 1e3 / kCalls);
    std::vector<u64> h(per_call * kCalls);
    CK(cudaMemcpy(h.data(), ts, h.size() * 8, cudaMemcpyDeviceToHost));
    // TRACE_DUMP=file appends every block's stamps (ns from its call's
    // first stage-1 release; 0 where not stamped) and SM, a tab-separated row each:
    // scenario, call, s1 or comb, block, enter, go, copies begin, issued, tile0, loop done, written, exit, SM,
    // and the first tiles' copies issued by warps 0-3.
    if (const char *path = getenv("TRACE_DUMP")) {
        FILE *f = fopen(path, "a");
        for (int i = 0; i < kCalls && f; ++i) {
            const u64 *c = h.data() + per_call * i;
            u64 go = ~0ull;
            for (int b = 0; b < g1; ++b)
                if (c[NS * b + 1]) go = std::min(go, c[NS * b + 1]);
            for (int b = 0; b < g1 + g2; ++b) {
                const u64 *x = c + NS * b;
                fprintf(f, "%s\t%d\t%s\t%d", sc.name.c_str(), i, b < g1 ? "s1" : "comb", b < g1 ? b : b - g1);
                for (int k : {0, 1, 7, 8, 2, 3, 4, 5})
                    fprintf(f, "\t%lld", x[k] ? (long long)(x[k] - go) : 0LL);
                fprintf(f, "\t%llu", x[6]);
                for (int k = 10; k < 14; ++k) fprintf(f, "\t%lld", x[k] ? (long long)(x[k] - go) : 0LL);
                fprintf(f, "\n");
            }
        }
        if (f) fclose(f);
    }

    // Per call (skip the first 2): all times relative to the previous call's end.
    Stats gap_enter, first_go, s1_lastgo, s1_end_p10, s1_end_p50, s1_end_max, c_go, c_end, period,
        enter_spread, c_first_enter, ph_copies0, ph_copies, ph_warp_first, ph_warp_last, ph_tile, ph_loop, ph_write, ph_tail, cph_load, cph_sync,
        cph_tail;
    // By the number of stage-1 blocks an SM held in a call: how many SMs
    // held that many, and their blocks' loop time and end (from the
    // previous call's end). Whether two blocks on one SM stream slower
    // each, and where the blocks of a grid of more blocks than SMs land.
    std::map<int, Stats> sm_count, sm_loop, sm_end;
    // Why blocks end apart: each block's end (from its call's first go) by
    // SM and by block index (its bytes), over calls: the spread of the group
    // means against the whole spread says whether an SM or an address range is slow.
    std::map<unsigned, Stats> by_sm;
    std::map<int, Stats> by_block, by_block_t0;
    Stats all_ends;
    // The ends of blocks on an SM that also held a block past the balanced
    // splits (which exits without streaming), or one of the combine's
    // (resident, waiting, through stage 1), against the others'.
    Stats end_beside_idle, end_alone, end_beside_combine, end_no_combine;
    // Slot time: over each call's period (previous call's end to its end),
    // the share of the stage-1 slots (SMs x blocks per SM) its blocks spent
    // from entering to their first tile, streaming (the loop), and from the
    // loop's end to exit; the rest is idle (or another kernel's).
    Stats slot_start, slot_loop, slot_finish;
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tr_split<false>, 128, smem));
    const double slots = (double)num_sms * std::max(per_sm, 1);
    u64 prev_end = 0;
    // A stage-1 block that streamed: its first tile landed (stamp 2). A
    // balanced grid's blocks past the batch's splits exit without one.
    auto streamed = [&](const u64 *x) { return sc.read || x[2] != 0; };
    for (int i = 0; i < kCalls; ++i) {
        const u64 *c = h.data() + per_call * i;
        u64 e_min = ~0ull, go_min = ~0ull, go_max = 0, end_max = 0, enter_max = 0;
        std::vector<double> ends;
        for (int b = 0; b < g1; ++b) {
            e_min = std::min(e_min, c[NS * b]);
            enter_max = std::max(enter_max, c[NS * b]);
            go_min = std::min(go_min, c[NS * b + 1]);
            go_max = std::max(go_max, c[NS * b + 1]);
            end_max = std::max(end_max, c[NS * b + 5]);
            if (streamed(c + NS * b)) ends.push_back((double)c[NS * b + 5]);
        }
        std::sort(ends.begin(), ends.end());
        if (i >= 2)
            for (int b = 0; b < g1; ++b) {
                if (!streamed(c + NS * b)) continue;
                const double e = ((double)c[NS * b + 5] - (double)go_min) / 1e3;
                by_sm[(unsigned)c[NS * b + 6]].add(e);
                by_block[b].add(e);
                by_block_t0[b].add(((double)c[NS * b + 2] - (double)go_min) / 1e3);
                all_ends.add(e);
            }
        if (!sc.read && i >= 2) {
            // Stage-1 blocks of this call per SM that streamed, and that did not; the combine's.
            std::map<unsigned, int> on_sm, idle_on, combine_on;
            for (int b = 0; b < g1; ++b) (streamed(c + NS * b) ? on_sm : idle_on)[(unsigned)c[NS * b + 6]]++;
            for (int b = 0; b < g2; ++b) combine_on[(unsigned)c[NS * (g1 + b) + 6]]++;
            std::map<int, int> sms;  // SMs by how many blocks they held
            for (auto &e : on_sm) sms[e.second]++;
            for (auto &e : sms) sm_count[e.first].add(e.second);
            for (int b = 0; b < g1; ++b) {
                const u64 *x = c + NS * b;
                if (!streamed(x)) continue;
                const unsigned sm = (unsigned)x[6];
                const double e = ((double)x[5] - (double)go_min) / 1e3;
                (idle_on.count(sm) ? end_beside_idle : end_alone).add(e);
                (combine_on.count(sm) ? end_beside_combine : end_no_combine).add(e);
                ph_copies0.add((double)x[7] - x[1]);
                ph_copies.add((double)x[8] - x[1]);
                u64 w_first = ~0ull, w_last = 0;
                for (int w = 10; w < 14; ++w)
                    if (x[w]) w_first = std::min(w_first, x[w]), w_last = std::max(w_last, x[w]);
                if (w_last) ph_warp_first.add((double)w_first - x[1]), ph_warp_last.add((double)w_last - x[1]);
                ph_tile.add((double)x[2] - x[1]);
                ph_loop.add((double)x[3] - x[2]);
                ph_write.add((double)x[4] - x[3]);
                ph_tail.add((double)x[5] - x[4]);
                const int k = on_sm[(unsigned)x[6]];
                sm_loop[k].add((double)x[3] - x[2]);
                sm_end[k].add((double)x[5] - (double)prev_end);
            }
        }
        u64 call_end = end_max;
        u64 cgo_min = ~0ull, cend_max = 0, center_min = ~0ull;
        for (int b = 0; b < g2; ++b) {
            const u64 *x = c + NS * (g1 + b);
            center_min = std::min(center_min, x[0]);
            cgo_min = std::min(cgo_min, x[1]);
            cend_max = std::max(cend_max, x[5]);
            if (i >= 2 && x[2] != 0) {  // a balanced twin's block of one-split rows merges nothing
                cph_load.add((double)x[2] - x[1]);
                cph_sync.add((double)x[3] - x[2]);
                cph_tail.add((double)x[5] - x[3]);
            }
        }
        if (g2) call_end = std::max(call_end, cend_max);
        if (i >= 2) {
            const double base = (double)prev_end;
            gap_enter.add((double)e_min - base);
            first_go.add((double)go_min - base);
            s1_lastgo.add((double)go_max - base);
            enter_spread.add((double)enter_max - (double)e_min);
            s1_end_p10.add(ends[ends.size() / 10] - base);
            s1_end_p50.add(ends[ends.size() / 2] - base);
            s1_end_max.add((double)end_max - base);
            if (g2) {
                c_first_enter.add((double)center_min - base);
                c_go.add((double)cgo_min - base);
                c_end.add((double)cend_max - base);
            }
            period.add((double)call_end - base);
            if (!sc.read) {
                double st = 0, lp = 0, fi = 0;
                for (int b = 0; b < g1; ++b) {
                    const u64 *x = c + NS * b;
                    if (!streamed(x)) continue;
                    st += (double)x[2] - x[0];
                    lp += (double)x[3] - x[2];
                    fi += (double)x[5] - x[3];
                }
                const double total = slots * ((double)call_end - base);
                slot_start.add(st / total), slot_loop.add(lp / total), slot_finish.add(fi / total);
            }
        }
        prev_end = call_end;
    }
    const double ideal = cache_bytes / 4.57e12 * 1e9;  // ns at 4.57 TB/s
    printf("%-34s layers %2d | event %7.2f us/call | period %7.2f | at-ceiling %7.2f | "
           "s1 enter %6.2f (spread %5.2f) go %6.2f..%6.2f end p10 %7.2f p50 %7.2f max %7.2f",
           sc.name.c_str(), layers, per.med(), period.med() / 1e3, ideal / 1e3, gap_enter.med() / 1e3,
           enter_spread.med() / 1e3, first_go.med() / 1e3, s1_lastgo.med() / 1e3,
           s1_end_p10.med() / 1e3, s1_end_p50.med() / 1e3, s1_end_max.med() / 1e3);
    if (g2)
        printf(" | comb enter %6.2f go %6.2f end %6.2f", c_first_enter.med() / 1e3, c_go.med() / 1e3,
               c_end.med() / 1e3);
    if (!sc.read) {
        printf("\n    per block (median), from go: copies begin %5.2f, issued %5.2f (its warps %5.2f..%5.2f), "
               "tile0 %5.2f; loop %6.2f, rows written %5.2f, ->exit %5.2f",
               ph_copies0.med() / 1e3, ph_copies.med() / 1e3, ph_warp_first.med() / 1e3, ph_warp_last.med() / 1e3,
               ph_tile.med() / 1e3, ph_loop.med() / 1e3, ph_write.med() / 1e3, ph_tail.med() / 1e3);
        printf("\n    slot time (%g slots): enter->tile0 %4.1f%%, loop %4.1f%%, loop end->exit %4.1f%%, idle %4.1f%%",
               slots, 100 * slot_start.med(), 100 * slot_loop.med(), 100 * slot_finish.med(),
               100 * (1 - slot_start.med() - slot_loop.med() - slot_finish.med()));
        printf("\n    per SM (medians over calls):");
        for (auto &e : sm_count)
            printf(" %g SMs held %d (loop %6.2f, end %7.2f);", e.second.med(), e.first,
                   sm_loop[e.first].med() / 1e3, sm_end[e.first].med() / 1e3);
    }
    {
        auto sd_means = [](auto &groups) {
            double n = 0, m = 0, m2 = 0;
            for (auto &e : groups) {
                const double mu = e.second.mean();
                n += 1, m += mu, m2 += mu * mu;
            }
            m /= n;
            return std::sqrt(std::max(0.0, m2 / n - m * m));
        };
        double mu = 0, mu2 = 0;
        for (double x : all_ends.v) mu += x, mu2 += x * x;
        mu /= all_ends.v.size();
        printf("\n    block ends from first go: mean %7.2f sd %5.2f; sd of means by SM %5.2f (%zu SMs), by block %5.2f",
               mu, std::sqrt(std::max(0.0, mu2 / all_ends.v.size() - mu * mu)), sd_means(by_sm), by_sm.size(),
               sd_means(by_block));
    }
    if (!sc.read) {
        // By block index, in 16 groups of the blocks that streamed: mean
        // first tile and end from the first go (which blocks start and end late).
        if (sc.lens_tensor && !by_block.empty()) {
            std::vector<int> idx;
            for (auto &e : by_block) idx.push_back(e.first);
            const int groups = std::min<int>(16, idx.size());
            printf("\n    by block index (first..last, mean tile0/end):");
            for (int g = 0; g < groups; ++g) {
                const size_t lo = idx.size() * g / groups, hi = idx.size() * (g + 1) / groups;
                double t0 = 0, e = 0;
                for (size_t k = lo; k < hi; ++k) t0 += by_block_t0[idx[k]].mean(), e += by_block[idx[k]].mean();
                printf(" %d..%d %.2f/%.2f;", idx[lo], idx[hi - 1], t0 / (hi - lo), e / (hi - lo));
            }
            // The blocks' mean ends against their mean first tiles: ends by quartile of first tile.
            std::vector<std::pair<double, double>> te;
            for (int b : idx) te.push_back({by_block_t0[b].mean(), by_block[b].mean()});
            std::sort(te.begin(), te.end());
            printf("\n    by quartile of first tile (mean tile0/end):");
            for (int qt = 0; qt < 4; ++qt) {
                const size_t lo = te.size() * qt / 4, hi = te.size() * (qt + 1) / 4;
                double a = 0, z = 0;
                for (size_t k = lo; k < hi; ++k) a += te[k].first, z += te[k].second;
                if (hi > lo) printf(" %.2f/%.2f;", a / (hi - lo), z / (hi - lo));
            }
        }
        if (!end_beside_combine.v.empty()) {
            std::map<int, int> spread;  // SMs by the combine blocks they held, last call
            const u64 *c = h.data() + per_call * (kCalls - 1);
            std::map<unsigned, int> on;
            for (int b = 0; b < g2; ++b) on[(unsigned)c[NS * (g1 + b) + 6]]++;
            for (auto &e : on) spread[e.second]++;
            printf("\n    ends beside a combine block: mean %.2f (%zu) against %.2f (%zu); last call's combine blocks per SM:",
                   end_beside_combine.mean(), end_beside_combine.v.size(), end_no_combine.mean(),
                   end_no_combine.v.size());
            for (auto &e : spread) printf(" %d SMs held %d;", e.second, e.first);
        }
        if (!end_beside_idle.v.empty())
            printf("\n    ends beside a block past the splits: mean %.2f (%zu) against %.2f (%zu) elsewhere",
                   end_beside_idle.mean(), end_beside_idle.v.size(), end_alone.mean(), end_alone.v.size());
    }
    if (g2)
        printf("\n    combine per block (median): go->loads merged %5.2f, ->warps met %5.2f, ->exit %5.2f",
               cph_load.med() / 1e3, cph_sync.med() / 1e3, cph_tail.med() / 1e3);
    printf("\n");
    fflush(stdout);

    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    if (arena) CK(cudaFree(arena));
    else
        for (auto b : bufs) CK(cudaFree(b));
    CK(cudaFree(counters));
    CK(cudaFree(q));
    CK(cudaFree(out));
    if (ws) CK(cudaFree(ws));
    CK(cudaFree(partial));
    CK(cudaFree(idx));
    if (lens) CK(cudaFree(lens));
    CK(cudaFree(ts));
    CK(cudaStreamDestroy(s));
}

// With an argument, runs only the scenarios whose name contains it (or, after
// a leading '=', is it).
int main(int argc, char **argv) {
    std::vector<Scenario> v;
    auto att = [&](const char *n, int b, int L, int splits, int cluster, bool pdl = true, int hq = 32, int hkv = 8) {
        Scenario s;
        s.hq = hq;
        s.hkv = hkv;
        s.name = n;
        s.batch = b;
        s.L = L;
        s.splits = splits;
        s.cluster = cluster;
        s.pdl = pdl;
        v.push_back(s);
    };
    auto rd = [&](const char *n, long long bytes, int blocks, int unroll, bool pdl = true) {
        Scenario s;
        s.name = n;
        s.read = true;
        s.read_bytes = bytes;
        s.read_blocks = blocks;
        s.read_unroll = unroll;
        s.pdl = pdl;
        v.push_back(s);
    };
    const long long MB134 = 2LL * 32768 * 8 * 128 * 2;  // b=1, 8 KV heads, 32K tokens
    // The plain kernel, then the serving kernel on the same caches: through
    // cache_batch_idx, and paged.
    for (int L : {1024, 4096})
        for (int sv : {0, 1, 2}) {
            att("", 1, L, 8, 8);
            v.back().name = "b=1 " + std::to_string(L / 1024) + "K, 8 splits in clusters of 8" +
                            (sv == 1 ? ", serving" : sv == 2 ? ", paged 16" : "");
            v.back().serving = sv;
        }
    att("b=1 1K, 8 splits in clusters of 8, one layer (in L2)", 1, 1024, 8, 8);
    v.back().layers = 1;
    att("b=1 1K, 16 splits + combine", 1, 1024, 16, 1);
    att("b=8 1K, 2 splits in clusters of 2", 8, 1024, 2, 2);
    att("b=8 1K, 2 splits + combine", 8, 1024, 2, 1);
    att("b=1 4K, 13 splits + combine", 1, 4096, 13, 1);
    att("b=1 32K, 16 splits + combine", 1, 32768, 16, 1);
    att("b=1 32K, 16 splits, no PDL", 1, 32768, 16, 1, false);
    att("b=1 128K, 16 splits + combine", 1, 131072, 16, 1);
    att("b=8 8K, 2 splits + combine", 8, 8192, 2, 1);
    att("b=32 1K, 1 split", 32, 1024, 1, 1);
    att("MQA b=1 128K, 128 splits + combine", 1, 131072, 128, 1, true, 8, 1);
    // The same 128 blocks of 64 tiles as b=8 8K above, with 8 query rows a
    // block (MQA b=32, 4 splits; 64/8 heads b=8, 2 splits) instead of 4.
    att("MQA b=32 16K, 4 splits + combine", 32, 16384, 4, 1, true, 8, 1);
    att("64/8 b=8 8K, 2 splits + combine", 8, 8192, 2, 1, true, 64, 8);
    // b=1 32K's 128 blocks with 4 query rows a block, 8 (64/8 heads) and 16
    // (4 query tokens), whose calls take 1.1 and 1.6 us longer; the combine
    // let in at stage 1's start (as the planner) or after its loop.
    for (int s1e : {-1, 0})
        for (int k = 0; k < 3; ++k) {
            att("", 1, 32768, 16, 1, true, k == 1 ? 64 : 32, 8);
            v.back().sq = k == 2 ? 4 : 1;
            v.back().stage1_early = s1e;
            v.back().name = std::string("rows a block ") + (k == 0 ? "4" : k == 1 ? "8 (64/8)" : "16 (sq4)") +
                            ": b=1 32K, 16 splits + combine" + (s1e < 0 ? "" : ", let in late");
        }
    // 96 blocks and a combine of 480 one-row blocks, whose letting the next
    // call in early slowed it (docs/tuning.md, "The combine lets the next
    // kernel in"), 8 query tokens (384 rows), which did not, and one (48).
    for (int sq : {1, 8, 10})
        for (int early : {0, 1}) {
            att("", 1, 8192, 2, 1, true, 48, 48);
            v.back().sq = sq;
            v.back().combine_early = early;
            v.back().name = "MHA 48/48 b=1 8K sq" + std::to_string(sq) + ", 2 splits + combine, " +
                            (early ? "next let in early" : "next let in at its end");
        }
    // The same with stage 1 letting the combine in after its loop rather
    // than at its start, so that the combine's blocks do not wait beside it.
    for (int sq : {1, 8, 10}) {
        att("", 1, 8192, 2, 1, true, 48, 48);
        v.back().sq = sq;
        v.back().stage1_early = 0;
        v.back().name = "MHA 48/48 b=1 8K sq" + std::to_string(sq) + ", 2 splits + combine let in late";
    }
    // The narrow combine (a warp a row, 4 rows a block) against the one-row
    // blocks, with the combine rule applied to its grid.
    for (int cr : {1, 4}) {
        att("", 1, 8192, 2, 1, true, 48, 48);
        v.back().combine_rows = cr;
        v.back().name = std::string("combine rows ") + std::to_string(cr) + ": MHA 48/48 b=1 8K, 2 splits";
        att("", 32, 16384, 4, 1, true, 8, 1);
        v.back().combine_rows = cr;
        v.back().name = std::string("combine rows ") + std::to_string(cr) + ": MQA b=32 16K, 4 splits";
        att("", 1, 32768, 4, 1, true, 32, 32);
        v.back().combine_rows = cr;
        v.back().name = std::string("combine rows ") + std::to_string(cr) + ": MHA 32/32 b=1 32K, 4 splits";
        att("", 1, 8192, 2, 1, true, 48, 48);
        v.back().sq = 10;
        v.back().combine_rows = cr;
        v.back().name = std::string("combine rows ") + std::to_string(cr) + ": MHA 48/48 b=1 8K sq10, 2 splits";
    }
    // Whole items and a split tail (the planner's plan at b=8 with 10 query
    // tokens: 264 whole, 120 in 2 splits, a combine of 1200 one-row blocks),
    // with the combine let in at stage 1's start (as now) or after its loop.
    for (int s1e : {-1, 0}) {
        att("", 8, 4096, 2, 1, true, 48, 48);
        v.back().sq = 10;
        v.back().whole = 264;
        v.back().stage1_early = s1e;
        v.back().name = std::string("MHA 48/48 b=8 4K sq10, 264 whole + 120 in 2 splits, combine let in ") +
                        (s1e ? "early" : "late");
    }
    // MHA, one query row per KV head: unsplit, cuDNN's launch shape (one
    // block per sequence and head), against the planner's 3 splits, and
    // b=2 (96 blocks, one an SM) as the lone-block reference.
    att("MHA 48/48 b=2 4K, 1 split", 2, 4096, 1, 1, true, 48, 48);
    att("MHA 48/48 b=3 4K, 1 split", 3, 4096, 1, 1, true, 48, 48);
    att("MHA 48/48 b=3 4K, 3 splits + combine", 3, 4096, 3, 1, true, 48, 48);
    // More blocks than the 264 an H200 holds at once: a second, partial
    // wave (288 and 384 blocks of 64 tiles), against 3 splits and the
    // combine, and b=128 1K's four waves of 16-tile blocks.
    att("MHA 48/48 b=6 4K, 1 split", 6, 4096, 1, 1, true, 48, 48);
    att("MHA 48/48 b=6 4K, 3 splits + combine", 6, 4096, 3, 1, true, 48, 48);
    att("MHA 48/48 b=8 4K, 1 split", 8, 4096, 1, 1, true, 48, 48);
    att("b=128 1K, 1 split", 128, 1024, 1, 1);
    att("b=46 4K, 1 split", 46, 4096, 1, 1);
    att("b=64 4K, 1 split", 64, 4096, 1, 1);
    att("b=32 16K, 1 split", 32, 16384, 1, 1);
    // Balanced splits on equal lengths against the plan's own count, both
    // reading the lengths from a tensor: what balancing costs where it
    // changes nothing (BENCHMARKS.md, "Ragged batches"), with the plans
    // flash_decode.plan(..., lengths=True) gives. b=32 at 2K keys: one split
    // each, balanced at most 17 and a combine of 16-row blocks after it;
    // b=8 at 32K: 2 splits, at most 17, the narrow combine; MQA b=4 at 32K:
    // 32 splits, at most 128, the 4-warp combine. Balanced also without the
    // blocks past the splits equal lengths take (no idle blocks), with them
    // as a launch of their own after stage 1, and with them exiting before
    // the library's code: which of their presence, placement or work costs.
    struct Bal {
        const char *name;
        int b, L, n, most, hq, hkv, rows;
    };
    for (const Bal &c : {Bal{"b=32 2K", 32, 2048, 1, 17, 32, 8, 16}, Bal{"b=8 32K", 8, 32768, 2, 17, 32, 8, 4},
                         Bal{"MQA b=4 32K", 4, 32768, 32, 128, 8, 1, 1}})
        for (bool bal : {false, true}) {
            att("", c.b, c.L, bal ? c.most : c.n, 1, true, c.hq, c.hkv);
            v.back().lens_tensor = true;
            v.back().balance = bal ? c.n : 0;
            v.back().combine_rows = c.rows;
            v.back().name = std::string("lengths tensor, ") + c.name + (bal ? ", balanced" : ", the plan's own count");
            // And with the other combine: which of the two stages costs; and
            // balanced without the blocks that find no split.
            if (c.n > 1) {
                v.push_back(v.back());
                v.back().twin = bal ? 0 : 1;
                v.back().name += bal ? ", the plain combine" : ", the balanced combine";
            }
            if (bal) {
                for (int twin : c.n > 1 ? std::vector<int>{0, -1} : std::vector<int>{-1}) {
                    v.push_back(v.back());
                    v.back().twin = twin;
                    v.back().exact_grid = true;
                    v.back().name = std::string("lengths tensor, ") + c.name + ", balanced, no idle blocks" +
                                    (twin == 0 ? ", the plain combine" : "");
                }
                v.push_back(v.back());
                v.back().twin = -1;
                v.back().exact_grid = true;
                v.back().spare_kernel = true;
                v.back().name = std::string("lengths tensor, ") + c.name + ", balanced, spare blocks launched after";
                v.push_back(v.back());
                v.back().spare_kernel = false;
                v.back().exact_grid = false;
                v.back().idle_exit = true;
                v.back().name = std::string("lengths tensor, ") + c.name + ", balanced, idle blocks exit at once";
            }
        }
    // The b=32 1K full-matrix effect (BENCHMARKS, "where the cache sits").
    const char *where[] = {"own allocations", "carved back to back", "own, after 6.4 GB freed",
                           "carved from 2.2 GB"};
    for (int pl = 0; pl < 4; ++pl) {
        att("", 32, 1024, 1, 1);
        v.back().name = std::string("b=32 1K, 1 split, ") + where[pl];
        v.back().placement = pl;
    }
    // What a memset node before stage 1 costs in the graph.
    att("b=1 1K, 16 splits + combine, memset 1 KB", 1, 1024, 16, 1);
    v.back().memset_bytes = 1024;
    att("b=1 32K, 16 splits + combine, memset 1 KB", 1, 32768, 16, 1);
    v.back().memset_bytes = 1024;
    rd("plain read 4 MB, 264 blocks", MB134 / 32, 264, 4);
    rd("plain read 4 MB, 264 blocks, one layer (in L2)", MB134 / 32, 264, 4);
    v.back().layers = 1;
    rd("plain read 134 MB, 264 blocks", MB134, 264, 8);
    rd("plain read 134 MB, 8192 blocks", MB134, 8192, 4);
    rd("plain read 537 MB (b=128 1K), 264 blocks", 4 * MB134, 264, 8);
    rd("plain read 805 MB (MHA 48/48 b=8 4K), 264 blocks", 6 * MB134, 264, 8);
    // The placement effect on a plain read of b=32 1K's cache, in 256
    // blocks as its attention grid (if the read slows too, it is the
    // memory), and in 8192 blocks that each read 16 KB.
    for (int blocks : {256, 8192})
        for (int pl : {0, 2}) {
            rd("", MB134, blocks, 4);
            v.back().name = "plain read 134 MB, " + std::to_string(blocks) + " blocks, " + where[pl];
            v.back().placement = pl;
        }
    // Runs against chunks dealt round robin (as the split kernel deals its
    // tiles): how evenly the blocks end.
    for (int blocks : {128, 264})
        for (bool rr : {false, true}) {
            rd("", 4 * MB134, blocks, 8);
            v.back().name = "plain read 537 MB, " + std::to_string(blocks) + " blocks" + (rr ? ", 32 KB round robin" : ", in runs");
            v.back().interleave = rr;
        }
    for (auto &s : v)
        if (argc < 2 || (argv[1][0] == '=' ? s.name == argv[1] + 1 : s.name.find(argv[1]) != std::string::npos))
            run(s);
    return 0;
}
