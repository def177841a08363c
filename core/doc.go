// Package core is the pure-Go heart of flash-decode: it validates a decode
// attention problem, plans its launch, and holds a CPU reference of the
// algorithm the CUDA kernels run. It uses no cgo and no GPU; package
// core/cuda launches the kernels, and the C library (capi) and the Python
// package reach the same planner through it.
//
// # The problem
//
// Decoding attends a few new query tokens (SeqlenQ, 1 to 16) of each
// sequence to that sequence's whole K/V cache. Every cached key and value is
// read once and used by only the HeadsQ/HeadsKV query heads that share it,
// so the work is a stream over the cache: it is memory-bound, and its speed
// is bytes of cache read per second.
//
// # Two stages
//
// Stage 1 (kernels/split_kv.cuh) runs one block per (split, K/V head and
// tile of packed query rows, sequence). A block packs the query heads of one
// K/V head times the SeqlenQ tokens into one tile, so K and V stream from
// memory once for all of them, and keeps an online softmax in fp32 over its
// part of the keys. Unsplit, the grid has only Batch x HeadsKV blocks; at
// batch 1 with 8 K/V heads that is 8 blocks on a 132-SM GPU, and 124 SMs
// would idle while 8 read the cache. Splitting each sequence's keys n ways
// gives every SM a part of the cache (its key tiles dealt round robin: split
// s takes tiles s, s+n, s+2n, ..., so a sequence's blocks read neighbouring
// tiles at any moment); each split writes its partial output,
// normalized by its own softmax sum, and its log-sum-exp (LSE) to a
// workspace.
//
// Stage 2 (kernels/combine.cuh) merges the splits of every output row: with
// M the largest split LSE, split s weighs exp(lse_s - M), the output is the
// weighted mean of the partials and the row's LSE is M + log(sum of weights).
// A split that saw no key has LSE -inf and weight 0; a row that saw no key
// at all (length 0, or masked by the causal mask) gets out = 0 and
// LSE = -inf. With one split, stage 1 writes the output itself and no
// combine runs. The combine gives a row 4 warps; for more than 32 splits a
// block of 4 warps to each 32 columns of a row, a lane one split's 4
// columns; for at most 8 splits one warp, 4 or 16 rows a block
// (Plan.Combine names the one a plan runs), so that all of a row's splits
// are loaded at once: in one round trip to L2 for the first two, a few
// for the narrow one, which keeps fewer registers so as to share an SM with
// stage 1 (kernels/flashdecode.cu). ReferenceDecode does exactly this on
// the CPU and the tests check it against NaiveAttention.
//
// On sm_90 (H100/H200) short splits can skip the second stage: the splits
// of one (sequence, K/V head, row tile) run as one thread-block cluster,
// park their rows in shared memory, and after a cluster barrier each block
// merges a slice of the rows over all of them through distributed shared
// memory, with the same formula (kernels/cluster_merge.cuh,
// fd_split_kv_cluster_merge; at head dim 64 and 128 with 16 rows the
// blocks push their rows to the owners instead, fd_cluster_push_merge). No
// workspace, no second launch, no partials through HBM; Plan.Cluster says
// when a plan does it.
//
// # How num_splits = 0 picks
//
// MakePlan chooses the kernel variant (SelectVariant), then the split count
// from the grid's blocks without splitting, the SM count, the blocks each
// SM holds at once (occupancy; the heuristic fills one block of 4 or more
// warps per SM, which every kernel has: a block's copy pipeline alone keeps
// enough bytes in flight to cover HBM latency) and the key tiles of the
// length the shape promises (Seqlen, or SeqlenCache when per-sequence
// lengths live on the device).
//
//   - It never splits when the unsplit grid already keeps 80-100% of the
//     block slots busy in one wave, never makes a split shorter than 64
//     keys (4 per packed query row, so the fp32 partials, which go through
//     L2, stay under half the K/V bytes; 16 in a tail split; but a sequence
//     of 8 tiles or more may always take 8 splits, which merge on chip in
//     a cluster), and never makes more than MaxSplits.
//   - Otherwise it takes the count that streams the cache soonest by a
//     model of each block's bytes (the SMs given two blocks end last, HBM
//     bounds a grid of more blocks than SMs, and a block of 32 query rows
//     takes longer over a tile than one of 16), plus a fixed cost and the
//     merge's: the combine's launch and L2 round trips, or a cluster's
//     barrier where the device runs every cluster at once (Device.Clusters)
//     and the splits are short, or, for 2 splits in a grid of more blocks
//     than SMs, pairs merged in clusters at two blocks per SM.
//   - A grid of more items (batch x K/V heads x row tiles) than the GPU
//     holds at once keeps its full waves whole and splits only the items of
//     its last, partial wave, so that their blocks fill the slots as the
//     full waves end (Plan.WholeItems).
//   - With the lengths on the device (Shape.DeviceLengths), a batch of one
//     split a sequence or whose splits merge through the combine takes its
//     split count for equal lengths and balances the splits by the lengths
//     there: each sequence gets its share of them, so that a long one among
//     short ones is not left streaming on a few blocks (Plan.BalanceSplits;
//     Plan.BalancedSplitCounts works the counts out on the host).
//
// Batch 1, 32/8 heads, head dim 128 and 32768 keys on an H200 gives 16
// splits and the combine: 128 blocks, one wave, 2048 keys each; 1024 or
// 4096 keys give 8 splits merged in clusters of 8. A requested num_splits
// n > 0 is clamped to [1, min(MaxSplits, key tiles)] and splits every item.
// The model's constants are fitted to split sweeps on an H200
// (docs/tuning.md), and a test checks every pick against them.
//
// Launch shapes depend on shapes only, never on device data, so a Plan can
// be computed once per shape and reused for every layer, and a captured CUDA
// graph stays right when the lengths in cache_seqlens change: each block
// splits its own sequence's true length on the device (and, in a balanced
// plan, works out from all of them which sequence and split it takes).
//
// A Plan also says when stage 1 lets the next kernel in the stream start
// (Plan.EarlyDependents, for programmatic dependent launch on sm_90): as it
// starts when a combine follows or its grid fits one block an SM, else once
// each block has streamed its keys, so that the next layer's call cannot
// crowd a grid of more blocks than SMs onto half of them; and, where the
// splits merge in clusters and are a tile or two each, that each block
// sends its keys into L2 before that wait (Plan.PrefetchTiles). Where the
// combine has no more blocks than stage 1 and than SMs, the combine lets
// the next kernel in as soon as stage 1 has ended
// (Plan.CombineEarlyDependents); otherwise that kernel starts after it.
//
// # Where things live
//
//   - problem.go, dtype.go: Shape, Tensor, Problem, DType and their checks.
//   - serving.go: the serving arguments (paged cache, append, rotary,
//     window, softcap, ALiBi; Window, Append, Rotary), their checks, and
//     what of a problem picks the form of stage 1 (PagedForm,
//     ContiguousForm; Shape.Form in plan.go).
//   - merge.go: MergeProblem, the merge API's checks, launch shape and CPU
//     reference.
//   - variants.go: the compiled kernels (Variant), their forms (Form: plain,
//     serving, paged and the two appending forms, kernels/split_kv.cuh's
//     fd_form) and SelectVariant.
//   - device.go: what the planner knows of a GPU (Device, H200, the
//     occupancy estimates used without a GPU).
//   - plan.go: Plan, MakePlan and PlanVariant: grid, merge and workspace.
//   - splits.go: the num_splits=0 cost model (autoSplits, splitCost,
//     tailSplit) and its fitted constants, with a worked example.
//   - plan_encoding.go: Plan.String and the JSON the Python and C callers read.
//   - reference.go: HostProblem, ReferenceDecode, ReferenceAppend and
//     NaiveAttention on the CPU.
//   - errors.go: Error, ErrInvalid and ErrUnsupported.
//
// # Errors
//
// Every function returns an *Error naming the operation and the argument as
// Python users know it (q, k_cache, nheads_q, headdim, num_splits, ...) and
// wrapping ErrInvalid (ValueError in Python) or ErrUnsupported
// (NotImplementedError). Nothing in the package panics or exits.
package core
