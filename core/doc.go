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
// from the unsplit grid's items (batch x K/V heads x row tiles), the SMs,
// their occupancy and the key tiles of the planned length (Seqlen, or
// SeqlenCache when the lengths live on the device), with a cost model of
// each block's bytes, the merge's cost and HBM's bound (splits.go):
//
//   - a grid that already fills one wave stays unsplit, and splits keep a
//     floor of keys a packed row, so that their partials stay cheap;
//   - a grid of more items than the GPU holds at once splits only its
//     last, partial wave's items (MergeTail);
//   - short splits whose clusters all run at once merge in stage 1
//     (MergeCluster, MergePairs), the others through the combine;
//   - with the lengths on the device, a plan of one split or of the
//     combine balances each sequence's splits by its length there
//     (MergeBalanced, Plan.BalancedSplitCounts).
//
// A requested num_splits n > 0 is clamped to [1, min(MaxSplits, key
// tiles)] and splits every item. A batch-invariant shape
// (Shape.BatchInvariant) skips the model: a split is a fixed number of key
// tiles from the layout, each sequence's count comes from its own length on
// the device, and the combine merges them (MergeInvariant,
// Plan.InvariantSplitCounts), so that no sequence's bits depend on its
// batch or the GPU. The model's constants are fitted to split
// sweeps on an H200; docs/tuning.md has them and a worked example, and a
// test checks every pick against the sweeps.
//
// A Plan reads shapes only, never device data, so it is computed once per
// shape and reused for every layer and by captured CUDA graphs: each block
// splits its own sequence's true length on the device. It also says when
// each kernel lets the next one in the stream start (EarlyDependents,
// CombineEarlyDependents) and whether stage 1 prefetches its keys into L2
// before that wait (PrefetchTiles).
//
// # Where things live
//
//   - dtype.go, errors.go: DType, Error, ErrInvalid and ErrUnsupported.
//   - problem.go, serving.go, fp8.go: Shape, Tensor, Problem, the serving
//     arguments (paged cache, append, rotary, window, softcap, ALiBi) and
//     the fp8 caches' descales, with their checks; merge.go: MergeProblem, the merge API's checks and
//     launch shape; reference.go: the CPU reference (ReferenceDecode,
//     ReferenceAppend, NaiveAttention).
//   - tensors.go, shapes.go, merge_tensors.go: a call's and a merge's
//     tensors as a framework holds them (Tensors, Shapes, MergeTensors),
//     checked by argument name into a Layout (layout.go) or a MergeProblem.
//   - variants.go, device.go: the compiled kernels (Variant, Form,
//     SelectVariant) and what the planner knows of a GPU (Device, H200).
//   - plan.go, splits.go, plan_encoding.go: the planner (Plan, Merge,
//     MakePlan, PlanVariant), its cost model, and the plan's String and JSON.
//
// Each group reads only the groups above it.
//
// # Errors
//
// Every function returns an *Error naming the operation and the argument as
// Python users know it (q, k_cache, nheads_q, headdim, num_splits, ...) and
// wrapping ErrInvalid (ValueError in Python) or ErrUnsupported
// (NotImplementedError). Nothing in the package panics or exits.
package core
