// split_kv_config.cuh: the compile-time shape of a stage-1 variant and its
// dynamic shared memory, shared by the stage-1 files and cluster_merge.cuh.
#ifndef FLASHDECODE_SPLIT_KV_CONFIG_CUH
#define FLASHDECODE_SPLIT_KV_CONFIG_CUH

// Stage 1's dynamic shared memory: the cp.async pipeline (kSharedBytes),
// then, in a push-merge cluster launch, the inbox (kInboxBytes).
extern __shared__ __align__(128) unsigned char fd_dynamic_smem[];

// A compile-time flag passed as an argument, for a generic lambda to branch on.
template <bool B>
struct fd_bool {
    static constexpr bool value = B;
};

// Compile-time shape of a stage-1 variant whose cache elements are KVB
// bytes (2: q's type; 1: fp8). An fp8 variant has the same tiles of keys,
// warps and dynamic shared memory; its tiles are half the bytes, so its
// pipeline is deeper (kStages) to keep as many bytes in flight, except at
// head dim 64, where a deeper page ring (static shared memory) would not
// fit beside 96 KB on sm_86/sm_89.
template <int D, int ROWS, int KVB = 2>
struct fd_split_kv_config {
    static_assert(KVB == 1 || KVB == 2, "cache elements are 2 bytes or fp8");
    static_assert(D == 64 || D == 128 || D == 256, "head dim must be 64, 128 or 256");
    static_assert(ROWS % 16 == 0, "rows are whole mma tiles of 16");
    static constexpr int kKeys = 8192 / D;                // keys per tile (32 KiB of K+V)
    // Groups of 16 keys a warp owns in a tile: two at head dim 64, so that
    // its 128-key tiles take 4 warps, as head dim 128's 64-key ones do,
    // each with one softmax step (max, rescale) for 32 keys.
    static constexpr int kKeyGroups = D == 64 ? 2 : 1;
    static constexpr int kKeyWarps = kKeys / 16 / kKeyGroups;  // each owns kKeyGroups * 16 keys of a tile
    // Warps per 16 keys, each accumulating D / kDimSplit output columns of
    // P V, and Q K^T over D / kDimSplit of the head dim: the two warps of
    // 16 keys add their halves of the scores through shared memory (kXchg),
    // meeting at a barrier of their own. At D 256 a tile has only 32 keys:
    // two warps alone, each with 64 dependent mmas a tile and one warp per
    // scheduler at two blocks per SM, stall on fixed-latency dependencies.
    // Four warps hide them, and splitting Q K^T as well (rather than both
    // warps of 16 keys computing all of it) halves each warp's share.
    static constexpr int kDimSplit = D == 256 ? 2 : 1;
    static constexpr int kWarpDim = D / kDimSplit;        // head dims (Q K^T) and output columns (P V) a warp covers
    static constexpr int kWarps = kKeyWarps * kDimSplit;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kStages = KVB == 2 || D == 64 ? 3 : 5;  // tiles in the cp.async pipeline
    static constexpr int kMTiles = ROWS / 16;             // mma row tiles
    // Independent accumulators of each score tile in Q K^T (split_kv.cuh): two
    // with one row tile; more row tiles already interleave their own chains
    // (and 32 rows have no registers to spare).
    // (Key groups are chains of their own too.)
    static constexpr int kQkChains = kMTiles == 1 && kKeyGroups == 1 ? 2 : 1;
    static constexpr int kXchg = kDimSplit > 1 ? kWarps * kMTiles * 8 * 32 : 1;  // floats: [warp][score][lane]
    static constexpr int kChunkElems = 16 / KVB;          // cache elements a 16-byte chunk
    static constexpr int kChunks = D / kChunkElems;       // 16-byte chunks per key row
    static constexpr int kTileElems = kKeys * D;          // one K (or V) tile
    static constexpr int kCopiesPerThread = kTileElems / kChunkElems / kThreads;
    static constexpr int kCopyKeyStep = kThreads / kChunks;  // keys between a thread's copies of a tile
    // The dynamic shared memory (the same for both element sizes; what the
    // merge scratch and the cluster inbox are placed by), and the
    // pipeline's part of it.
    static constexpr int kSharedBytes = 3 * 2 * kTileElems * 2;
    static constexpr int kPipeBytes = kStages * 2 * kTileElems * KVB;
    static_assert(kPipeBytes <= kSharedBytes, "the pipeline must fit the dynamic shared memory");
    // Whether the closing merge always weighs the key warps once a row, for
    // all of its (row, 4 columns) items (split_kv.cuh), rather than in each
    // item: with 32 rows, 8 items a thread at head dim 128. Blocks of fewer
    // rows do so where their rows give a thread more than two items.
    static constexpr bool kMergeByRow = ROWS == 32;
    // Whether the forms other than the plain one (which always can) balance
    // their splits by the lengths (split_kv.cuh fd_balance): all but 32 rows
    // a block, which run at their register limit without that code.
    static constexpr bool kFormsBalance = ROWS != 32;
    // End-of-block merge scratch, reusing the pipeline buffers: every key
    // warp's unnormalized output (rows padded by 8 floats; the halves of D
    // fill their own columns) and its max and sum, then each row's weights
    // of the key warps and its LSE (for a merge by row).
    static constexpr int kMergeStride = D + 8;
    static constexpr int kMergeBytes = (kKeyWarps * ROWS * kMergeStride + 3 * kKeyWarps * ROWS + ROWS) * 4;
    // With a cluster launch, each block's merged rows for the other blocks of
    // its cluster: normalized output [ROWS][D] and base-2 LSE [ROWS], after
    // the merge scratch.
    static constexpr int kMaxCluster = 16;                // non-portable cluster size on sm_90
    static constexpr int kParkBytes = (ROWS * D + ROWS) * 4;
    // Or, where each thread has at most 4 (row, 4 columns) items to send
    // (head dim 64 and 128 at 16 rows), the blocks push their rows to the
    // block that merges them instead (fd_cluster_push): into its inbox after
    // the pipeline buffers, every block's base-2 LSEs [kMaxCluster][ROWS],
    // then [n][per_block] float4s, per_block = ceil(kItems / n). The cluster
    // launch's 120 KB (core/variants.go oneBlockPerSMBytes) covers it.
    static constexpr int kItems = ROWS * (D / 4);         // (row, 4 columns) items of a block's rows
    static constexpr bool kPushMerge = kItems <= 4 * kThreads;
    static constexpr int kInboxBytes = kMaxCluster * ROWS * 4 + (kItems + kMaxCluster) * 16;
    static_assert(kThreads % kChunks == 0, "a thread copies the same chunk of every key it copies");
    static_assert(32 % kChunks == 0 && kChunks % kCopiesPerThread == 0,
                  "a warp's lanes of one key group cover its copies (the paged offsets' shuffle)");
    static_assert(kMergeBytes + kParkBytes <= kSharedBytes, "merge scratch must fit in the pipeline buffers");
    static_assert(!kPushMerge || kSharedBytes + kInboxBytes <= 120 * 1024, "the inbox must fit a cluster launch");
};

#endif  // FLASHDECODE_SPLIT_KV_CONFIG_CUH
