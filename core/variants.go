package core

import (
	"fmt"
	"strings"
)

// Variant is one compiled stage-1 kernel and the combine kernels that pair
// with it, with the launch facts the planner needs. The build compiles the
// kernels this table names (Kernels), and nvcc checks the numbers the
// kernels also decide at compile time against it.
type Variant struct {
	Kernel  string // stage-1 (split-KV) function name in the fatbin
	Combine string // stage-2 (combine) function name in the fatbin
	DType   DType  // element type of q and out (and of k and v unless FP8Cache)
	// FP8Cache says k and v are fp8, either format (the kernels read which
	// from their arguments: Float8E4M3 or Float8E5M2, Shape.CacheDType).
	FP8Cache    bool
	HeadDim     int // head dim the kernel is compiled for; smaller multiples of 8 run padded
	Rows        int // query rows (group x seqlen_q) one block holds; more rows use more blocks
	Threads     int // stage-1 threads per block
	KeysPerTile int // keys a block loads per pipeline step; splits are whole tiles
	SharedBytes int // stage-1 dynamic shared memory per block
	// ClusterSharedBytes is the dynamic shared memory a cluster launch of
	// stage 1 asks for (the kernel uses SharedBytes of it); more than half
	// an SM's keeps the blocks of a cluster on separate SMs.
	ClusterSharedBytes int
	// ClusterDenseSharedBytes, when not 0, is what a cluster launch asks for
	// in a grid of more blocks than SMs (pairs of splits, see
	// mergePairs): SharedBytes plus the push merge's inbox, so that two
	// blocks still fit an SM as in a plain launch. 0 for the variants that
	// merge by pulling (head dim 256, 32 rows), whose clusters run slower
	// there than the combine.
	ClusterDenseSharedBytes int
	CombineThreads          int // stage-2 threads per block
	CombineRows             int // output rows one stage-2 block merges
	// CombineNarrow, when set, is the combine that plans of at most
	// combineUnroll splits launch instead of Combine: a warp per output row,
	// CombineNarrowRows rows a block of 32*CombineNarrowRows threads, each
	// warp loading its row's splits in one round trip to L2, with no
	// exchange between warps and a quarter of Combine's blocks.
	CombineNarrow     string
	CombineNarrowRows int
	// CombineNarrowDense, when set, is the narrow combine with
	// CombineNarrowDenseRows rows a block, which a plan launches instead of
	// CombineNarrow where CombineNarrow's grid would outnumber stage 1's
	// blocks or the SMs and its own would not: only then does the combine
	// let the next kernel in early (Plan.CombineEarlyDependents).
	CombineNarrowDense     string
	CombineNarrowDenseRows int
	// CombineWide, when set, is the combine that plans launch instead of
	// Combine when their splits outnumber the ones Combine loads in one
	// round trip to L2 (combineSplitsPerStep): CombineWideThreads threads a
	// block, each block merging CombineWideCols columns of a row (0: whole
	// rows), so that a row's partials are read by several SMs at once.
	CombineWide        string
	CombineWideThreads int
	CombineWideCols    int
	// Form is which form of stage 1 Kernel is (Shape.Form picks it); every
	// form of a dtype, head dim and row count has the same launch facts.
	Form Form
	// Append is the kernel the plans of a form other than FormPlain run
	// before stage 1 to write the new tokens into the cache (and the rotated
	// q into the workspace) when they append and the form does not append
	// itself (fd_append_kv_<dtype>); "" for FormPlain.
	Append string
}

// BalancedCombine is the balanced twin of combine kernel name
// (Kernel.Balanced), which a plan with Plan.BalanceSplits launches instead:
// it merges each row's own split count, which it works out from the
// lengths as stage 1 does (kernels/balance.cuh).
func BalancedCombine(name string) string { return name + "_bal" }

// Form is a form of stage 1: which of the policy types fd_form_* of
// kernels/split_kv_forms.cuh a variant is compiled as. The plain form reads a contiguous cache with no
// serving argument; the others read the serving fields of fd_params.
type Form int

const (
	// FormPlain is fd_split_kv_*: a contiguous cache, none of the serving
	// arguments (Shape.Serving false).
	FormPlain Form = iota
	// FormServing is fd_split_kv_serving_*: every serving feature (paged
	// caches of any page size, batch index, leftpad, window, softcap,
	// ALiBi, appended tokens, a rotated q).
	FormServing
	// FormPaged is fd_split_kv_paged_*: a paged cache whose pages hold a
	// multiple of 8 keys, with or without an append (the append kernel
	// first) and rotary, and no other serving feature (Shape.Paged). A
	// thread looks up one page per 8 keys it copies instead of one per key.
	FormPaged
	// FormPagedAppend is fd_split_kv_paged_append_*: the paged form that
	// reads a few new tokens (at most maxFusedAppend, no rotary) from k and
	// v and writes them into the pages itself, so no append kernel runs.
	FormPagedAppend
	// FormAppend is fd_split_kv_append_*: FormPagedAppend's counterpart for
	// a contiguous cache with no other serving feature (Shape.Contiguous).
	FormAppend
)

var formNames = [...]string{FormPlain: "plain", FormServing: "serving", FormPaged: "paged",
	FormPagedAppend: "paged_append", FormAppend: "append"}

// String returns the form's name as the plan JSON gives it ("paged_append").
func (f Form) String() string {
	if f >= 0 && int(f) < len(formNames) {
		return formNames[f]
	}
	return fmt.Sprintf("Form(%d)", int(f))
}

// Serving reports whether f reads the serving fields of the kernels'
// arguments: every form but FormPlain.
func (f Form) Serving() bool { return f != FormPlain }

// Paged reports whether f is one of the paged forms (FormPaged,
// FormPagedAppend).
func (f Form) Paged() bool { return f == FormPaged || f == FormPagedAppend }

// FusedAppend reports whether f writes the new tokens itself, so that its
// plans run no append kernel (FormPagedAppend, FormAppend).
func (f Form) FusedAppend() bool { return f == FormPagedAppend || f == FormAppend }

// Balances reports whether v's stage 1 can balance its splits by the
// lengths on the device (Plan.BalanceSplits): every variant but the
// serving forms' 32-row ones, which run at their register limit without
// that code (kernels/split_kv_config.cuh kFormsBalance, which nvcc checks
// against this).
func (v Variant) Balances() bool { return v.Form == FormPlain || v.Rows < 32 }

// Stage-1 launch facts shared by every variant (kernels/split_kv_config.cuh,
// fd_split_kv_config). A tile of K plus a tile of V is always 32 KiB:
// KeysPerTile = 8192 / HeadDim keys, one warp per 16 keys of a tile and
// half of the output columns at head dim 256 (splitKVDimSplit), so
// Threads = 32 * KeysPerTile / 16 * splitKVDimSplit. The 3-stage cp.async
// pipeline then needs
//
//	SharedBytes = 3 stages * (K tile + V tile) * KeysPerTile * HeadDim * 2 bytes
//	            = 3 * 2 * 8192 * 2 = 98304
//
// for every head dim: two blocks per SM on sm_80/sm_90, one on sm_86/sm_89
// (99 KB a block there).
const (
	splitKVStages      = 3
	splitKVSharedBytes = splitKVStages * 2 * 8192 * 2
	combineThreads     = 128 // fd_combine_<dtype>: 4 warps share a row's splits
	combineWideThreads = 128 // fd_combine_<dtype>_c32: 4 warps
	combineWideCols    = 32  // kernels/combine.cuh FD_COMBINE_COLS: the columns of a row a c32 block merges
	combineRows        = 1   // one output row per combine block
	combineNarrowRows  = 4   // fd_combine_<dtype>_r4: a warp per row, 4 rows a block
	combineDenseRows   = 16  // fd_combine_<dtype>_r16: a warp per row, 16 rows a block
	combineUnroll      = 8   // kernels/combine.cuh FD_COMBINE_UNROLL: splits a warp loads at once
	appendThreads      = 128 // fd_append_kv_<dtype>: threads per block (Shape.appendParts blocks per token and sequence)

	// oneBlockPerSMBytes is shared memory of which an sm_90 SM (228 KB,
	// 1 KB reserved per block) holds one block only. A cluster's blocks are
	// placed together in one GPC, and two of them sharing an SM while other
	// SMs idle would halve their bandwidth, so a cluster launch of a kernel
	// of 4 or more warps (one block per SM is its target, see
	// targetWarpsPerSM) asks for this much.
	oneBlockPerSMBytes = 120 * 1024
)

// splitKVDimSplit is how many warps share each 16 keys of a tile, each
// with its part of the output columns (fd_split_kv_config::kDimSplit): two
// at head dim 256, whose 32-key tiles would otherwise keep only 2 warps.
func splitKVDimSplit(headDim int) int {
	if headDim == 256 {
		return 2
	}
	return 1
}

// splitKVKeyGroups is how many groups of 16 keys of a tile each warp
// owns (fd_split_kv_config::kKeyGroups): two at head dim 64, whose 128-key
// tiles then take 4 warps, not 8.
func splitKVKeyGroups(headDim int) int {
	if headDim == 64 {
		return 2
	}
	return 1
}

// dtypeNames are the dtypes' names in the kernels' names.
var dtypeNames = map[DType]string{Float16: "f16", BFloat16: "bf16"}

// fp8Suffix follows the dtype in the names of the kernels that read or
// write an fp8 cache.
const fp8Suffix = "_fp8"

// splitKV describes the stage-1 kernel fd_split_kv_<dtype>_d<headDim>_r<rows>.
func splitKV(dt DType, headDim, rows int) Variant {
	return splitKVCache(dt, false, headDim, rows)
}

// splitKVCache is splitKV for a cache of q's dtype (fp8 false) or an fp8
// one: fd_split_kv_<dtype>_fp8_d<headDim>_r<rows>, with the same launch
// facts (its tiles hold as many keys in half the bytes, kernels/split_kv_config.cuh).
func splitKVCache(dt DType, fp8 bool, headDim, rows int) Variant {
	name := dtypeNames[dt]
	if fp8 {
		name += fp8Suffix
	}
	keys := 8192 / headDim
	threads := 32 * keys / 16 / splitKVKeyGroups(headDim) * splitKVDimSplit(headDim)
	clusterShared := splitKVSharedBytes
	if threads >= 32*targetWarpsPerSM {
		clusterShared = oneBlockPerSMBytes
	}
	// The push merge's inbox (kernels/split_kv_config.cuh kInboxBytes), where a
	// thread sends at most 4 items (kPushMerge).
	dense := 0
	if items := rows * headDim / 4; items <= 4*threads {
		dense = splitKVSharedBytes + MaxCluster*rows*4 + (items+MaxCluster)*16
	}
	return Variant{
		Kernel:                  fmt.Sprintf("fd_split_kv_%s_d%d_r%d", name, headDim, rows),
		Combine:                 combineKernel(dt).Name,
		DType:                   dt,
		FP8Cache:                fp8,
		HeadDim:                 headDim,
		Rows:                    rows,
		Threads:                 threads,
		KeysPerTile:             keys,
		SharedBytes:             splitKVSharedBytes,
		ClusterSharedBytes:      clusterShared,
		ClusterDenseSharedBytes: dense,
		CombineThreads:          combineThreads,
		CombineRows:             combineRows,
		CombineNarrow:           combineRowsKernel(dt, combineNarrowRows).Name,
		CombineNarrowRows:       combineNarrowRows,
		CombineNarrowDense:      combineRowsKernel(dt, combineDenseRows).Name,
		CombineNarrowDenseRows:  combineDenseRows,
		CombineWide:             combineColsKernel(dt).Name,
		CombineWideThreads:      combineWideThreads,
		CombineWideCols:         combineWideCols,
	}
}

// formKV describes splitKV(dt, headDim, rows) in form f, with its append
// kernel: fd_split_kv_<form>_<dtype>_d<headDim>_r<rows>.
func formKV(f Form, dt DType, headDim, rows int) Variant {
	return formKVCache(f, dt, false, headDim, rows)
}

// formKVCache is formKV of splitKVCache, with the append kernel of its cache.
func formKVCache(f Form, dt DType, fp8 bool, headDim, rows int) Variant {
	v := splitKVCache(dt, fp8, headDim, rows)
	v.Kernel = strings.Replace(v.Kernel, "fd_split_kv_", "fd_split_kv_"+f.String()+"_", 1)
	v.Form = f
	v.Append = appendKernelCache(dt, fp8).Name
	return v
}

// withFP8Caches is vs followed by the fp8-cache twin of each of its
// variants.
func withFP8Caches(vs []Variant) []Variant {
	out := append([]Variant(nil), vs...)
	for _, v := range vs {
		if v.Form == FormPlain {
			out = append(out, splitKVCache(v.DType, true, v.HeadDim, v.Rows))
		} else {
			out = append(out, formKVCache(v.Form, v.DType, true, v.HeadDim, v.Rows))
		}
	}
	return out
}

// combineSplitsPerStep is how many splits a combine of `threads` threads
// loads in one round trip to L2: FD_COMBINE_UNROLL per lane, where a warp's
// lanes share one split's row (cols 0: 128 columns, a float4 a lane) or
// 128/cols splits of a group of cols columns. Each further round trip adds
// to every call, so plans with more splits than the 4-warp combine takes at
// once (32) run the column-group one (128 at once), and plans of at most 8
// run the narrow one, a warp a row (Variant.CombineNarrow).
func combineSplitsPerStep(threads, cols int) int {
	perLoad := 1
	if cols > 0 {
		perLoad = 128 / cols
	}
	return threads / 32 * combineUnroll * perLoad
}

// variants is the dispatch table, the stage-1 part of the kernel table
// (Kernels): SelectVariant takes the kernels of the form asked for
// (MakePlan: Shape.Form), then the smallest HeadDim >= the head dim, then
// the smallest Rows >= the packed rows, else the largest Rows with more row
// tiles. Rows are whole 16-row tensor-core tiles; 32 rows exist only for
// head dim 128, where they still fit two blocks per SM in registers. Every
// form has the same dtypes, head dims and rows, with the same launch facts,
// and each variant an fp8-cache twin (Variant.FP8Cache), after all of them.
var variants = withFP8Caches([]Variant{
	splitKV(Float16, 64, 16),
	splitKV(Float16, 128, 16),
	splitKV(Float16, 128, 32),
	splitKV(Float16, 256, 16),
	splitKV(BFloat16, 64, 16),
	splitKV(BFloat16, 128, 16),
	splitKV(BFloat16, 128, 32),
	splitKV(BFloat16, 256, 16),
	formKV(FormServing, Float16, 64, 16),
	formKV(FormServing, Float16, 128, 16),
	formKV(FormServing, Float16, 128, 32),
	formKV(FormServing, Float16, 256, 16),
	formKV(FormServing, BFloat16, 64, 16),
	formKV(FormServing, BFloat16, 128, 16),
	formKV(FormServing, BFloat16, 128, 32),
	formKV(FormServing, BFloat16, 256, 16),
	formKV(FormPaged, Float16, 64, 16),
	formKV(FormPaged, Float16, 128, 16),
	formKV(FormPaged, Float16, 128, 32),
	formKV(FormPaged, Float16, 256, 16),
	formKV(FormPaged, BFloat16, 64, 16),
	formKV(FormPaged, BFloat16, 128, 16),
	formKV(FormPaged, BFloat16, 128, 32),
	formKV(FormPaged, BFloat16, 256, 16),
	formKV(FormPagedAppend, Float16, 64, 16),
	formKV(FormPagedAppend, Float16, 128, 16),
	formKV(FormPagedAppend, Float16, 128, 32),
	formKV(FormPagedAppend, Float16, 256, 16),
	formKV(FormPagedAppend, BFloat16, 64, 16),
	formKV(FormPagedAppend, BFloat16, 128, 16),
	formKV(FormPagedAppend, BFloat16, 128, 32),
	formKV(FormPagedAppend, BFloat16, 256, 16),
	formKV(FormAppend, Float16, 64, 16),
	formKV(FormAppend, Float16, 128, 16),
	formKV(FormAppend, Float16, 128, 32),
	formKV(FormAppend, Float16, 256, 16),
	formKV(FormAppend, BFloat16, 64, 16),
	formKV(FormAppend, BFloat16, 128, 16),
	formKV(FormAppend, BFloat16, 128, 32),
	formKV(FormAppend, BFloat16, 256, 16),
})

// SelectVariant returns the kernel variant of form f that runs the given
// dtype (q's and the caches'), head dim and number of packed query rows
// (query heads per K/V head x seqlen_q).
func SelectVariant(dt DType, headDim, rows int, f Form) (Variant, error) {
	return SelectCacheVariant(dt, dt, headDim, rows, f)
}

// SelectCacheVariant is SelectVariant for caches of dtype kv
// (Shape.CacheDType): dt's own, or either fp8 format.
func SelectCacheVariant(dt, kv DType, headDim, rows int, f Form) (Variant, error) {
	if kv != dt && !kv.FP8() {
		return Variant{}, fmt.Errorf("no kernel for dtype %v with a %v cache", dt, kv)
	}
	var best *Variant
	for i := range variants {
		v := &variants[i]
		if v.DType != dt || v.FP8Cache != kv.FP8() || v.HeadDim < headDim || v.Form != f {
			continue
		}
		if best != nil && v.HeadDim > best.HeadDim {
			continue // the smallest fitting head dim wins
		}
		if best == nil || v.HeadDim < best.HeadDim {
			best = v
			continue
		}
		// Same head dim: prefer the smallest Rows >= rows, else the largest Rows.
		switch {
		case best.Rows >= rows && v.Rows >= rows && v.Rows < best.Rows:
			best = v
		case best.Rows < rows && v.Rows > best.Rows:
			best = v
		}
	}
	if best == nil {
		return Variant{}, fmt.Errorf("no %v kernel for dtype %v, head dim %d", f, dt, headDim)
	}
	return *best, nil
}

// Variants returns a copy of the dispatch table: every kernel variant the
// fatbin holds, in search order.
func Variants() []Variant { return append([]Variant(nil), variants...) }

// KernelKind is what a kernel of the fatbin does (Kernel.Kind).
type KernelKind int

const (
	// KernelSplitKV is stage 1: Kernel.Variant, in its form.
	KernelSplitKV KernelKind = iota
	// KernelCombine is fd_combine_<dtype>: Threads/32 warps share each
	// row's splits (Variant.Combine).
	KernelCombine
	// KernelCombineRows is fd_combine_<dtype>_r<rows>: a warp a row,
	// Threads/32 rows a block (Variant.CombineNarrow, CombineNarrowDense).
	KernelCombineRows
	// KernelCombineCols is fd_combine_<dtype>_c32: a block a group of
	// Variant.CombineWideCols columns of a row (Variant.CombineWide).
	KernelCombineCols
	// KernelMergeStates is fd_merge_states_<dtype> (MergeKernel).
	KernelMergeStates
	// KernelAppend is fd_append_kv_<dtype> (Variant.Append).
	KernelAppend
)

// Kernel is one function of the fatbin. The build compiles exactly the
// kernels of Kernels: core/cuda/internal/instances writes them out as the
// list kernels/flashdecode.cu instantiates.
type Kernel struct {
	Name  string
	Kind  KernelKind
	DType DType
	// FP8Cache: stage 1 and the append of an fp8 cache (Variant.FP8Cache).
	FP8Cache bool
	Threads  int // threads a block launches with at most (its launch bounds)
	// MinBlocks is how many blocks of Threads an SM must hold at once, which
	// bounds the registers ptxas gives a thread; 0 asks for none.
	MinBlocks int
	// Balanced says the kernel runs the plans that balance their splits
	// (Plan.BalanceSplits): a combine through its twin BalancedCombine(Name),
	// compiled beside it; a stage-1 variant in its own code
	// (Variant.Balances).
	Balanced bool
	Variant  Variant // KernelSplitKV: the variant (Name is Variant.Kernel)
}

// splitKVMinBlocks is the stage-1 blocks an SM holds at once (the kernels'
// launch bounds).
const splitKVMinBlocks = 2

// combineKernel is fd_combine_<dtype>, the 4-warp combine. It and the
// column-group one ask for one block an SM, the narrow ones for none
// (kernels/flashdecode.cu says why).
func combineKernel(dt DType) Kernel {
	return Kernel{Name: "fd_combine_" + dtypeNames[dt], Kind: KernelCombine, DType: dt,
		Threads: combineThreads, MinBlocks: 1, Balanced: true}
}

// combineRowsKernel is fd_combine_<dtype>_r<rows>, the narrow combine of a
// warp a row.
func combineRowsKernel(dt DType, rows int) Kernel {
	return Kernel{Name: fmt.Sprintf("fd_combine_%s_r%d", dtypeNames[dt], rows), Kind: KernelCombineRows,
		DType: dt, Threads: 32 * rows, Balanced: true}
}

// combineColsKernel is fd_combine_<dtype>_c32, the column-group combine.
func combineColsKernel(dt DType) Kernel {
	return Kernel{Name: fmt.Sprintf("fd_combine_%s_c%d", dtypeNames[dt], combineWideCols), Kind: KernelCombineCols,
		DType: dt, Threads: combineWideThreads, MinBlocks: 1, Balanced: true}
}

// mergeStatesKernel is MergeKernel(dt), of up to mergeMaxWarps warps.
func mergeStatesKernel(dt DType) Kernel {
	return Kernel{Name: MergeKernel(dt), Kind: KernelMergeStates, DType: dt, Threads: 32 * mergeMaxWarps}
}

// appendKernel is fd_append_kv_<dtype>.
func appendKernel(dt DType) Kernel { return appendKernelCache(dt, false) }

// appendKernelCache is appendKernel into a cache of dt (fp8 false) or an
// fp8 one: fd_append_kv_<dtype>_fp8.
func appendKernelCache(dt DType, fp8 bool) Kernel {
	name := "fd_append_kv_" + dtypeNames[dt]
	if fp8 {
		name += fp8Suffix
	}
	return Kernel{Name: name, Kind: KernelAppend, DType: dt, FP8Cache: fp8, Threads: appendThreads}
}

// otherKernels is the kernel table beside stage 1: the combines the
// variants name, the merge API's kernels and the append kernels.
var otherKernels = []Kernel{
	combineKernel(Float16),
	combineKernel(BFloat16),
	combineRowsKernel(Float16, combineNarrowRows),
	combineRowsKernel(BFloat16, combineNarrowRows),
	combineRowsKernel(Float16, combineDenseRows),
	combineRowsKernel(BFloat16, combineDenseRows),
	combineColsKernel(Float16),
	combineColsKernel(BFloat16),
	mergeStatesKernel(Float16),
	mergeStatesKernel(BFloat16),
	mergeStatesKernel(Float32),
	appendKernel(Float16),
	appendKernel(BFloat16),
	appendKernelCache(Float16, true),
	appendKernelCache(BFloat16, true),
}

// Kernels returns the kernel table: every kernel the fatbin holds, the
// stage-1 variants (Variants) first.
func Kernels() []Kernel {
	ks := make([]Kernel, 0, len(variants)+len(otherKernels))
	for _, v := range variants {
		ks = append(ks, Kernel{Name: v.Kernel, Kind: KernelSplitKV, DType: v.DType, FP8Cache: v.FP8Cache, Threads: v.Threads,
			MinBlocks: splitKVMinBlocks, Balanced: v.Balances(), Variant: v})
	}
	return append(ks, otherKernels...)
}

// compiledHeadDims lists the head dims the variant table has for dt.
func compiledHeadDims(dt DType) string {
	var ds []string
	seen := map[int]bool{}
	for _, v := range variants {
		if v.DType == dt && !seen[v.HeadDim] {
			seen[v.HeadDim] = true
			ds = append(ds, fmt.Sprint(v.HeadDim))
		}
	}
	if len(ds) == 0 {
		return "none"
	}
	return strings.Join(ds, ", ")
}
