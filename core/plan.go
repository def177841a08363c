package core

import (
	"fmt"
	"math"
)

// Plan is everything a launch needs, computed once from a Shape and device
// facts and reusable for every call (every layer) with that Shape. Launch
// shapes depend on shapes only, never on device data, so a captured CUDA
// graph stays correct when cache_seqlens changes.
type Plan struct {
	Variant   Variant `json:"variant"`    // the kernels that run
	NumSplits int     `json:"num_splits"` // splits of each sequence's keys (of the items after WholeItems when that is > 0)
	RowTiles  int     `json:"row_tiles"`  // ceil(HeadsQ/HeadsKV*SeqlenQ / Variant.Rows)
	// Grid is the stage-1 grid: (NumSplits, HeadsKV*RowTiles, Batch), or
	// one-dimensional where WholeItems > 0 (below).
	Grid        [3]int `json:"grid"`
	Threads     int    `json:"threads"`      // stage-1 threads per block
	SharedBytes int    `json:"shared_bytes"` // stage-1 dynamic shared memory per block
	// Cluster is the thread-block cluster size along x: NumSplits when the
	// splits of each (sequence, K/V head, row tile) run as one cluster and
	// merge their outputs through distributed shared memory at the end of
	// stage 1 (no combine kernel, no workspace), else 1. SharedBytes then
	// says how: Variant.ClusterSharedBytes, one block per SM, or
	// Variant.ClusterDenseSharedBytes, two (pairs in a larger grid).
	Cluster int `json:"cluster"`
	// CombineGrid blocks of CombineThreads run the combine kernel Combine
	// (Variant.CombineNarrow for splits one warp loads at once, or
	// Variant.CombineNarrowDense where only its grid lets the next kernel
	// in early, Variant.CombineWide for more than Variant.Combine does, else
	// Variant.Combine), each merging CombineRows output rows (CombineWide:
	// Variant.CombineWideCols columns of one row); all are zero
	// when NumSplits == 1 (stage 1 then writes out and lse itself) or
	// Cluster > 1.
	Combine        string `json:"combine"`
	CombineGrid    int    `json:"combine_grid"`
	CombineThreads int    `json:"combine_threads"`
	CombineRows    int    `json:"combine_rows"`
	// The workspace holds o_partial, float32 [NumSplits][rows][HeadDim]
	// at offset 0, and lse_partial, float32 [NumSplits][rows] at
	// LSEPartialOffset (256-byte aligned), rows = Batch*HeadsQ*SeqlenQ -
	// CombineRow0 (the rows the combine merges, in order) and HeadDim the
	// problem's own (not the variant's padded) head dim; both
	// only when a combine runs. With a rotary embedding (Shape.RotaryQ) it
	// also holds the rotated q, QRotBytes of (Batch, SeqlenQ, HeadsQ,
	// HeadDim) contiguous in the dtype, at QRotOffset (256-byte aligned,
	// after the partials). WorkspaceBytes is 0 when it holds nothing.
	LSEPartialOffset int `json:"lse_partial_offset"`
	WorkspaceBytes   int `json:"workspace_bytes"`
	QRotOffset       int `json:"q_rot_offset,omitzero"`
	QRotBytes        int `json:"q_rot_bytes,omitzero"`
	// Append, when not "", is the kernel (Variant.Append) that runs before
	// stage 1 to write the new tokens into the cache and, with rotary, the
	// rotated q into the workspace: grid AppendGrid = (max(SeqlenNew,
	// SeqlenQ), Batch, parts) blocks of AppendThreads, a token's 16-byte
	// chunks of k and v (and of q with rotary) dealt over its parts blocks,
	// one chunk a thread (appendParts).
	Append        string `json:"append,omitzero"`
	AppendGrid    [3]int `json:"append_grid,omitzero"`
	AppendThreads int    `json:"append_threads,omitzero"`
	// WholeItems > 0 makes the stage-1 grid one-dimensional (Grid =
	// (WholeItems + rest*NumSplits, 1, 1)): its first WholeItems blocks
	// each stream one whole item (batch, K/V head, row tile, in that
	// order), and the rest of the items follow in NumSplits splits each,
	// which the combine merges from output row CombineRow0 on (CombineGrid
	// covers only those rows). A grid of more items than the GPU holds at
	// once keeps its full waves whole and splits only the last, partial
	// one, whose blocks then fill the slots as the full waves end.
	WholeItems  int `json:"whole_items"`
	CombineRow0 int `json:"combine_row0"`
	// BalanceSplits > 0 balances the splits of a batch by its lengths on
	// the device (kernels/balance.cuh), where they come as a device array
	// the planner cannot read (Shape.DeviceLengths): BalanceSplits is the
	// split count the plan gives equal lengths, and each sequence then
	// takes its own count, at most NumSplits, so that every split holds
	// about the same number of key tiles whatever the lengths. The grid is
	// one-dimensional, Batch * HeadsKV * RowTiles * (BalanceSplits + 1)
	// blocks, of which those past the sequences' splits exit. The combine,
	// the balanced twin of the one for NumSplits (BalancedCombine), works
	// out each row's count from the lengths too.
	BalanceSplits int `json:"balance_splits,omitzero"`
	// PrefetchTiles, when not 0, is how many key tiles (all of its split's)
	// each block of a plain stage 1 sends into L2 before it waits on the
	// kernel before it (programmatic dependent launch), so that they stream
	// while that kernel ends. Set where the splits merge in clusters and are
	// at most the pipeline's depth: such a block's keys are all of its
	// work, and it would otherwise load them only after the wait. Longer
	// splits gain nothing from it, and on some shapes lose.
	PrefetchTiles int `json:"prefetch_tiles,omitzero"`
	SMs           int `json:"sms"`           // SM count planned for
	BlocksPerSM   int `json:"blocks_per_sm"` // resident stage-1 blocks per SM planned for
}

// EarlyDependents reports whether stage 1 lets the next kernel in the
// stream be scheduled as soon as it starts (programmatic dependent launch,
// sm_90 and newer) rather than once each of its blocks has streamed its keys.
// Early when the combine follows (its small blocks wait on the slots stage
// 1 leaves, and its launch hides behind stage 1) or when the grid has no
// more blocks than SMs (the next grid's blocks wait in the second slots and
// start the moment this grid ends). A grid of more blocks than SMs lets the
// next kernel in late: that kernel is often this one again, the next
// layer's attention, whose blocks, let in early, would take the free slots
// while this grid streams and then run two to an SM on some SMs and none on
// others.
func (p Plan) EarlyDependents() bool {
	return p.CombineGrid > 0 || p.Grid[0]*p.Grid[1]*p.Grid[2] <= p.SMs
}

// CombineEarlyDependents reports whether the combine lets the next kernel in
// the stream be scheduled once stage 1 has finished (programmatic dependent
// launch), so that the next kernel's blocks wait on the SMs the combine
// leaves idle rather than being scheduled after it ends: where the combine
// has no more blocks than stage 1 and than the GPU has SMs. Behind a
// combine of more blocks than stage 1, the next layer's stage 1, let in
// early, ran far slower (docs/tuning.md).
func (p Plan) CombineEarlyDependents() bool {
	return p.CombineGrid > 0 && p.CombineGrid <= min(p.Grid[0]*p.Grid[1]*p.Grid[2], p.SMs)
}

// FusedAppend reports whether stage 1 is an appending form
// (Variant.Form.FusedAppend; Append is then ""): it reads the new keys from
// k and v and writes them into the cache itself, so no append kernel runs
// ahead of it. The plan JSON has it as fused_append.
func (p Plan) FusedAppend() bool { return p.Variant.Form.FusedAppend() }

// prefetchMaxTiles is the longest split whose tiles a plain stage 1 sends
// into L2 before its PDL wait (Plan.PrefetchTiles): the tiles its pipeline
// loads first, so the prefetch covers the split's loads and no more.
const prefetchMaxTiles = splitKVStages - 1

// MakePlan picks the kernel variant for s (SelectVariant) and plans its
// launch on device d with PlanVariant.
//
// With s.NumSplits == 0 the split count comes from the heuristic described
// in the package documentation and at autoSplits. A request n > 0 is
// clamped to [1, min(MaxSplits, key tiles)], key tiles being
// ceil(length/Variant.KeysPerTile) for the length the plan uses: Seqlen +
// SeqlenNew (at most SeqlenCache) if Seqlen >= 0, else SeqlenCache, and at
// most WindowKeys when that is set. More splits than tiles would only add
// empty splits.
func MakePlan(s Shape, d Device) (Plan, error) {
	const op = "plan"
	if err := s.validate(op); err != nil {
		return Plan{}, err
	}
	if err := s.validateServing(op); err != nil {
		return Plan{}, err
	}
	if d.SMs < 1 {
		return Plan{}, invalid(op, "sms", fmt.Sprintf("%d; must be at least 1", d.SMs))
	}
	v, err := SelectVariant(s.DType, s.HeadDim, s.HeadsQ/s.HeadsKV*s.SeqlenQ, s.Form())
	if err != nil {
		return Plan{}, &Error{Op: op, Arg: "headdim", Err: ErrUnsupported,
			Msg: fmt.Sprintf("%d with dtype %v: %v; compiled head dims: %s", s.HeadDim, s.DType, err, compiledHeadDims(s.DType))}
	}
	if bps := d.blocksPerSM(v); bps < 1 {
		return Plan{}, unsupported(op, "", fmt.Sprintf("kernel %s does not fit on an SM of this device (occupancy %d)", v.Kernel, bps))
	}
	return planVariant(op, s, v, d)
}

// PlanVariant plans s for the given variant on device d. MakePlan calls it
// after choosing the variant; tuning tools and tests call it to plan a
// variant of their choice. Splits are chosen or clamped as MakePlan
// describes.
func PlanVariant(s Shape, v Variant, d Device) (Plan, error) {
	const op = "plan"
	if err := s.validate(op); err != nil {
		return Plan{}, err
	}
	if err := s.validateServing(op); err != nil {
		return Plan{}, err
	}
	return planVariant(op, s, v, d)
}

// planVariant is MakePlan and PlanVariant past their checks: the split
// count (requested, tailSplit or autoSplits), the merge, grid, workspace
// and append.
func planVariant(op string, s Shape, v Variant, d Device) (Plan, error) {
	sms, blocksPerSM := d.SMs, d.blocksPerSM(v)
	if sms < 1 {
		return Plan{}, invalid(op, "sms", fmt.Sprintf("%d; must be at least 1", sms))
	}
	if blocksPerSM < 1 {
		return Plan{}, invalid(op, "blocks_per_sm", fmt.Sprintf("%d; must be at least 1", blocksPerSM))
	}
	if err := checkVariant(s, v); err != nil {
		return Plan{}, &Error{Op: op, Arg: "variant", Msg: err.Error(), Err: ErrInvalid}
	}
	packed := s.HeadsQ / s.HeadsKV * s.SeqlenQ // query rows sharing one K/V head
	rowTiles := ceilDiv(packed, v.Rows)
	if s.HeadsKV*rowTiles > maxGridYZ {
		return Plan{}, unsupported(op, "nheads_kv", fmt.Sprintf("%d heads x %d row tiles exceed the launch grid's y limit %d", s.HeadsKV, rowTiles, maxGridYZ))
	}
	tiles := ceilDiv(s.plannedKeys(), v.KeysPerTile)

	// Unsplit, the grid has `blocks` blocks; split n ways, as many clusters
	// of n, which merge their splits themselves if they all run at once
	// (mergeCluster), or, two splits in a grid of more blocks than SMs, in
	// pairs among the other blocks (mergePairs).
	blocks := s.Batch * s.HeadsKV * rowTiles
	merging := func(n int) merge {
		if n < 2 || n > MaxCluster || d.Clusters == nil {
			return mergeCombine
		}
		perSplit, grid := ceilDiv(tiles, n), blocks*n
		fills := grid*100 >= sms*busySlotsPct && grid <= sms
		if blocks <= d.Clusters(v, n) && (perSplit <= clusterMaxTiles || (fills && perSplit <= clusterLongMaxTiles)) {
			return mergeCluster
		}
		if n == 2 && grid > sms && perSplit <= clusterLongMaxTiles && v.ClusterDenseSharedBytes > 0 && d.Clusters(v, 2) > 0 {
			return mergePairs
		}
		return mergeCombine
	}
	// A requested count splits every item. Automatically, a grid of more
	// items than the GPU holds at once keeps its full waves whole and splits
	// only the last, partial wave's items (tailSplit); otherwise autoSplits.
	splits, whole := s.NumSplits, 0
	if splits > 0 {
		splits = clampSplits(splits, tiles)
	} else {
		rows := min(packed, v.Rows)
		maxN := autoSplitCap(tiles, ceilDiv(minKeysPerSplit(rows, minSplitRowKeys), v.KeysPerTile))
		tailN := maxAutoSplits(tiles, ceilDiv(minKeysPerSplit(rows, minTailSplitRowKeys), v.KeysPerTile))
		if w, m := tailSplit(blocks, sms*blocksPerSM, tailN); m > 1 {
			splits, whole = m, w
		} else {
			costs := blockCostsOf(v)
			splits = autoSplits(blocks, sms*targetBlocks(v, blocksPerSM), sms*blocksPerSM, tiles, maxN, costs, merging)
			// A serving block (page lookups, per-row key ranges) streams
			// slower alone than a plain one, which only a cluster merge's
			// one-wave grid makes up for; other plans fill every slot.
			if v.Form.Serving() && (splits < 2 || merging(splits) != mergeCluster) {
				splits = autoSplits(blocks, sms*blocksPerSM, sms*blocksPerSM, tiles, maxN, costs, merging)
			}
		}
	}

	// Lengths on the device: a plan of one split or merging through the
	// combine balances its splits by them there (balancedSplits).
	rows := s.Batch * s.HeadsQ * s.SeqlenQ
	balanced := 0
	if s.NumSplits == 0 && whole == 0 && v.Balances() && (splits == 1 || merging(splits) == mergeCombine) {
		balanced = balancedSplits(s, splits, blocks/s.Batch, sms*targetBlocks(v, blocksPerSM), tiles, rows*(s.HeadDim+1)*4)
	}

	p := Plan{
		Variant:     v,
		NumSplits:   splits,
		RowTiles:    rowTiles,
		Grid:        [3]int{splits, s.HeadsKV * rowTiles, s.Batch},
		Threads:     v.Threads,
		SharedBytes: v.SharedBytes,
		Cluster:     1,
		SMs:         sms,
		BlocksPerSM: blocksPerSM,
	}
	partials := 0       // splits whose partials the workspace holds: the combine's
	partialRows := rows // rows a split's partials hold: from CombineRow0 on
	switch {
	case balanced > 0:
		// The combine equal lengths take (its fold steps through more
		// splits where a row has them), in its balanced twin.
		p.BalanceSplits = splits
		p.Grid = [3]int{blocks * (splits + 1), 1, 1}
		p.setCombine(v, rows, s.HeadDim)
		p.Combine = BalancedCombine(p.Combine)
		p.NumSplits, partials = balanced, balanced
	case whole > 0:
		// The items after the whole ones, split: their rows start at the
		// first packed row of item `whole` (items are batch, K/V head, row tile).
		p.WholeItems = whole
		p.Grid = [3]int{whole + (blocks-whole)*splits, 1, 1}
		p.CombineRow0 = whole/rowTiles*packed + whole%rowTiles*v.Rows
		partials, partialRows = splits, rows-p.CombineRow0
		p.setCombine(v, rows-p.CombineRow0, s.HeadDim)
	case merging(splits) == mergeCluster:
		p.Cluster = splits
		p.SharedBytes = v.ClusterSharedBytes
		if perSplit := ceilDiv(tiles, splits); v.Form == FormPlain && perSplit <= prefetchMaxTiles {
			p.PrefetchTiles = perSplit
		}
	case merging(splits) == mergePairs:
		p.Cluster = splits
		p.SharedBytes = v.ClusterDenseSharedBytes
	case splits > 1:
		partials = splits
		p.setCombine(v, rows, s.HeadDim)
	}
	if s.RotaryQ {
		p.QRotBytes = rows * s.HeadDim * s.DType.Size()
	}
	p.LSEPartialOffset, p.QRotOffset, p.WorkspaceBytes = workspaceLayout(partials, partialRows, s.HeadDim, p.QRotBytes)
	if s.SeqlenNew > 0 && !v.Form.FusedAppend() {
		p.Append, p.AppendThreads = v.Append, appendThreads
		p.AppendGrid = [3]int{max(s.SeqlenNew, s.SeqlenQ), s.Batch, s.appendParts()}
	}
	return p, nil
}

// maxFusedAppend is the most new tokens the appending forms write
// themselves: one block of each K/V head writes them, a 16-byte chunk a
// thread, so a few decode tokens take one step of its threads.
const maxFusedAppend = MaxSeqlenQ

// Form is the form of stage 1 that runs s: the plain form without serving
// arguments; an appending form (FormPagedAppend, FormAppend) for the paged
// form or a contiguous cache with no other serving feature
// (Shape.Contiguous) appending 1 to maxFusedAppend new tokens without
// rotary; else the paged form (Shape.Paged) or the serving form. With
// rotary the append kernel runs first: it rotates q too, which stage 1
// then reads rotated (see docs/tuning.md on rotating in stage 1).
func (s Shape) Form() Form {
	fused := (s.Paged || s.Contiguous) && s.SeqlenNew > 0 && s.SeqlenNew <= maxFusedAppend && !s.RotaryQ
	switch {
	case !s.Serving:
		return FormPlain
	case fused && s.Paged:
		return FormPagedAppend
	case fused:
		return FormAppend
	case s.Paged:
		return FormPaged
	}
	return FormServing
}

// appendParts is the blocks the append kernel gives each token: enough for
// one 16-byte chunk a thread of the token's new k and v rows and, with
// rotary, its q rows. The chunks' loads then all wait on one memory round
// trip instead of one per chunk a thread, which at batch 1 and 32 query
// heads was five in a row.
func (s Shape) appendParts() int {
	chunks := s.HeadDim / 8
	items := s.HeadsKV * chunks
	if s.RotaryQ {
		items += s.HeadsQ * chunks
	}
	return max(1, ceilDiv(items, appendThreads))
}

// PlanKeyQuantum divides every Variant.KeysPerTile (8192 / a compiled
// head dim of at most MaxHeadDim): lengths that round up to one multiple
// of it have the same key tiles in every variant (see Shape.PlanKey).
const PlanKeyQuantum = 8192 / MaxHeadDim

// PlanKey returns s with Seqlen moved up to the last length that has its
// key tiles: the appended tokens and Seqlen rounded up to a multiple of
// PlanKeyQuantum (32) keys, within the cache. MakePlan reads Seqlen only through the key tiles
// of plannedKeys, so s and s.PlanKey() plan alike, and a plan cache keyed
// by PlanKey plans an int length that grows a token a step once every 32
// tokens, not at every step. A Seqlen that is negative, or past what the
// cache holds, is left as it is.
func (s Shape) PlanKey() Shape {
	if s.Seqlen < 0 || s.Seqlen+s.SeqlenNew > s.SeqlenCache {
		return s
	}
	rounded := ceilDiv(s.Seqlen+s.SeqlenNew, PlanKeyQuantum) * PlanKeyQuantum
	s.Seqlen = min(rounded, s.SeqlenCache) - s.SeqlenNew
	return s
}

// plannedKeys is the keys per sequence a plan of s is sized for: Seqlen +
// SeqlenNew (at most SeqlenCache) if Seqlen >= 0, else SeqlenCache, and at
// most WindowKeys when that is set.
func (s Shape) plannedKeys() int {
	length := s.SeqlenCache
	if s.Seqlen >= 0 {
		length = min(s.Seqlen+s.SeqlenNew, s.SeqlenCache)
	}
	if s.WindowKeys > 0 {
		length = min(length, s.WindowKeys)
	}
	return length
}

// combineFor is the combine kernel that merges n splits of v, with its
// threads and the output rows a block merges: v.CombineNarrow where v has
// one and a warp loads all n at once, v.CombineWide (one row a block, or
// part of one) where v has one and n outnumbers the splits v.Combine loads
// in one round trip to L2, else v.Combine.
func combineFor(v Variant, n int) (name string, threads, rows int) {
	switch {
	case v.CombineNarrow != "" && v.CombineNarrowRows > 0 && n <= combineUnroll:
		return v.CombineNarrow, 32 * v.CombineNarrowRows, v.CombineNarrowRows
	case v.CombineWide != "" && v.CombineWideThreads > 0 && n > combineSplitsPerStep(v.CombineThreads, 0):
		return v.CombineWide, v.CombineWideThreads, 1
	}
	return v.Combine, v.CombineThreads, v.CombineRows
}

// setCombine sets the combine that merges p's splits of `rows` output rows
// of headDim columns (combineFor) and its grid: a block a row's column group
// for v.CombineWide. Where the narrow combine's grid would outnumber
// stage 1's blocks or the SMs, so that it could not let the next kernel in
// early (CombineEarlyDependents), it takes v.CombineNarrowDenseRows rows a
// block instead if that grid fits.
func (p *Plan) setCombine(v Variant, rows, headDim int) {
	p.Combine, p.CombineThreads, p.CombineRows = combineFor(v, p.NumSplits)
	p.CombineGrid = ceilDiv(rows, p.CombineRows)
	if p.Combine == v.CombineWide && v.CombineWideCols > 0 {
		if groups := ceilDiv(headDim, v.CombineWideCols); p.CombineGrid <= math.MaxInt32/groups {
			p.CombineGrid *= groups
		} else { // beyond the launch grid's x limit: whole rows, a round trip per 32 splits
			p.Combine, p.CombineThreads, p.CombineRows = v.Combine, v.CombineThreads, v.CombineRows
			p.CombineGrid = ceilDiv(rows, p.CombineRows)
		}
	}
	if p.Combine != v.CombineNarrow || p.CombineEarlyDependents() || v.CombineNarrowDense == "" || v.CombineNarrowDenseRows < 1 {
		return
	}
	if dense := ceilDiv(rows, v.CombineNarrowDenseRows); dense <= min(p.Grid[0]*p.Grid[1]*p.Grid[2], p.SMs) {
		p.Combine, p.CombineThreads, p.CombineRows = v.CombineNarrowDense, 32*v.CombineNarrowDenseRows, v.CombineNarrowDenseRows
		p.CombineGrid = dense
	}
}

// checkVariant reports why v cannot run s, or nil.
func checkVariant(s Shape, v Variant) error {
	switch {
	case v.DType != s.DType:
		return fmt.Errorf("%s is for %v, not %v", v.Kernel, v.DType, s.DType)
	case v.HeadDim < s.HeadDim:
		return fmt.Errorf("%s is for head dims up to %d, not %d", v.Kernel, v.HeadDim, s.HeadDim)
	case v.Form != s.Form():
		return fmt.Errorf("%s is the %v form; the shape runs the %v form", v.Kernel, v.Form, s.Form())
	case s.SeqlenNew > 0 && v.Append == "":
		return fmt.Errorf("%s has no append kernel for the new tokens", v.Kernel)
	case v.Rows < 1 || v.Threads < 1 || v.KeysPerTile < 1 || v.SharedBytes < 0 ||
		v.CombineRows < 1 || v.CombineThreads < 1:
		return fmt.Errorf("%s has a non-positive size: %+v", v.Kernel, v)
	}
	return nil
}

// workspaceLayout is the one place that lays out the workspace (the
// kernels address the partials through kernels/partials.cuh): for
// splits > 1 (merged by the combine), o_partial (float32
// [splits][rows][headDim]) at 0 and lse_partial (float32 [splits][rows])
// at lseOffset, the first 256-byte boundary after it; then qRotBytes of
// rotated q at qRotOffset, the first 256-byte boundary after those (0
// without them). It returns all zeros for a single split without q_rot,
// which needs no workspace.
func workspaceLayout(splits, rows, headDim, qRotBytes int) (lseOffset, qRotOffset, total int) {
	const f32, align = 4, 256
	if splits > 1 {
		lseOffset = ceilDiv(splits*rows*headDim*f32, align) * align
		total = lseOffset + splits*rows*f32
	}
	if qRotBytes > 0 {
		qRotOffset = ceilDiv(total, align) * align
		total = qRotOffset + qRotBytes
	}
	return lseOffset, qRotOffset, total
}

// ceilDiv is a/b rounded up, for a >= 0 and b > 0.
func ceilDiv(a, b int) int { return (a + b - 1) / b }
