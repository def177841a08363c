package core

import (
	"fmt"
	"math"
)

// Plan is everything a launch needs, computed once from a Shape and device
// facts and reused for every call with that Shape. It reads shapes only,
// never device data, so a captured CUDA graph stays right when
// cache_seqlens changes. An item is one (sequence, K/V head, row tile).
type Plan struct {
	Variant Variant `json:"variant"` // the kernels that run
	Merge   Merge   `json:"merge"`   // how the splits' partial results are merged
	// NumSplits is the most splits any item's keys are cut into: the
	// workspace holds that many partials a merged row.
	NumSplits int `json:"num_splits"`
	RowTiles  int `json:"row_tiles"` // ceil(HeadsQ/HeadsKV*SeqlenQ / Variant.Rows)
	// Grid is the stage-1 grid: (NumSplits, HeadsKV*RowTiles, Batch), or
	// one-dimensional for MergeTail and MergeBalanced.
	Grid        [3]int `json:"grid"`
	Threads     int    `json:"threads"`       // stage-1 threads per block
	SharedBytes int    `json:"shared_bytes"`  // stage-1 dynamic shared memory per block
	SMs         int    `json:"sms"`           // SM count planned for
	BlocksPerSM int    `json:"blocks_per_sm"` // resident stage-1 blocks per SM planned for

	// The combine kernel, for MergeCombine, MergeTail and MergeBalanced (all
	// zero otherwise): CombineGrid blocks of CombineThreads, each merging
	// CombineRows output rows (combineFor; the column-group combine:
	// Variant.CombineWideCols columns of one row).
	Combine        string `json:"combine"`
	CombineGrid    int    `json:"combine_grid"`
	CombineThreads int    `json:"combine_threads"`
	CombineRows    int    `json:"combine_rows"`

	// The workspace (workspaceLayout): the combine's float32 partials,
	// o_partial [NumSplits][rows][HeadDim] at 0 and lse_partial
	// [NumSplits][rows] at LSEPartialOffset, rows being the output rows from
	// CombineRow0 on; then, with rotary, the rotated q at QRotOffset.
	// WorkspaceBytes is 0 when it holds nothing.
	LSEPartialOffset int `json:"lse_partial_offset"`
	WorkspaceBytes   int `json:"workspace_bytes"`
	QRotOffset       int `json:"q_rot_offset,omitzero"`
	QRotBytes        int `json:"q_rot_bytes,omitzero"`

	// The append kernel (Variant.Append), when not "": it runs before stage
	// 1 to write the new tokens into the cache (and the rotated q into the
	// workspace), grid (max(SeqlenNew, SeqlenQ), Batch, appendParts).
	Append        string `json:"append,omitzero"`
	AppendGrid    [3]int `json:"append_grid,omitzero"`
	AppendThreads int    `json:"append_threads,omitzero"`

	// MergeCluster and MergePairs: Cluster is NumSplits (1 in other modes),
	// and SharedBytes is Variant.ClusterSharedBytes (one block per SM) or
	// Variant.ClusterDenseSharedBytes (pairs, two per SM). PrefetchTiles
	// (MergeCluster, plain form) is the key tiles each block sends into L2
	// before its programmatic-dependent-launch wait: all of its split's.
	Cluster       int `json:"cluster"`
	PrefetchTiles int `json:"prefetch_tiles,omitzero"`

	// MergeTail: the first WholeItems blocks stream one item each, the rest
	// of the items follow in NumSplits splits each, and the combine merges
	// output rows from CombineRow0 on.
	WholeItems  int `json:"whole_items"`
	CombineRow0 int `json:"combine_row0"`

	// MergeBalanced: BalanceSplits is the split count equal lengths take;
	// each sequence takes its share of Batch*BalanceSplits splits by its
	// length on the device, at most NumSplits (kernels/balance.cuh), in a
	// grid of Batch*HeadsKV*RowTiles*(BalanceSplits+1) blocks.
	BalanceSplits int `json:"balance_splits,omitzero"`

	// Batch-invariant plans (Shape.BatchInvariant; MergeInvariant, or
	// MergeNone where no sequence splits): InvariantTiles is the key tiles
	// a split reads, from the layout alone; each sequence's split count
	// comes from its own length on the device (InvariantSplitCounts), at
	// most NumSplits, which only sizes the grid and the workspace for the
	// planned bound. InvariantSpanTiles (a window) caps the tiles counted.
	InvariantTiles     int `json:"invariant_tiles,omitzero"`
	InvariantSpanTiles int `json:"invariant_span_tiles,omitzero"`
}

// Merge is how a plan merges the splits of an item into out and lse.
type Merge int

const (
	// MergeNone: one split; stage 1 writes out and lse itself.
	MergeNone Merge = iota
	// MergeCombine: the combine kernel reads the partials back.
	MergeCombine
	// MergeCluster: the splits of an item run as one cluster that all runs
	// at once and merges through distributed shared memory.
	MergeCluster
	// MergePairs: clusters of two in a grid of more blocks than SMs, two
	// blocks per SM as in a plain launch.
	MergePairs
	// MergeTail: a grid of more items than the GPU holds at once keeps its
	// full waves' items whole and splits the last wave's; the combine merges.
	MergeTail
	// MergeBalanced: the lengths on the device size each sequence's splits;
	// the balanced combine merges.
	MergeBalanced
	// MergeInvariant: each sequence's own length sizes its splits at a
	// fixed tile budget (Shape.BatchInvariant); the balanced combine merges.
	MergeInvariant
)

var mergeNames = [...]string{MergeNone: "none", MergeCombine: "combine", MergeCluster: "cluster",
	MergePairs: "pairs", MergeTail: "tail", MergeBalanced: "balanced", MergeInvariant: "invariant"}

// String returns m's name as the plan JSON gives it ("combine").
func (m Merge) String() string {
	if m >= 0 && int(m) < len(mergeNames) {
		return mergeNames[m]
	}
	return fmt.Sprintf("Merge(%d)", int(m))
}

// MarshalText encodes m as its name, so that JSON has "merge": "combine".
func (m Merge) MarshalText() ([]byte, error) {
	if m < 0 || int(m) >= len(mergeNames) {
		return nil, fmt.Errorf("flashdecode: unknown merge mode %d", int(m))
	}
	return []byte(m.String()), nil
}

// UnmarshalText decodes a name MarshalText writes.
func (m *Merge) UnmarshalText(b []byte) error {
	for i, name := range mergeNames {
		if string(b) == name {
			*m = Merge(i)
			return nil
		}
	}
	return fmt.Errorf("flashdecode: unknown merge mode %q", b)
}

// Combines reports whether m runs the combine kernel (and so needs the
// workspace's partials).
func (m Merge) Combines() bool {
	return m == MergeCombine || m == MergeTail || m == MergeBalanced || m == MergeInvariant
}

// EarlyDependents reports whether stage 1 lets the next kernel in the
// stream be scheduled as soon as it starts (programmatic dependent launch):
// when a combine follows, whose launch then hides behind stage 1, or when
// the grid fits one block an SM. A larger grid lets it in only once its
// blocks have streamed their keys, so that the next layer's blocks cannot
// take its free slots and run two to an SM on some SMs and none on others.
func (p Plan) EarlyDependents() bool {
	return p.CombineGrid > 0 || p.Grid[0]*p.Grid[1]*p.Grid[2] <= p.SMs
}

// CombineEarlyDependents reports whether the combine lets the next kernel in
// once stage 1 has ended: where it has no more blocks than stage 1 and than
// SMs. Behind a larger combine an early next stage 1 ran far slower.
func (p Plan) CombineEarlyDependents() bool {
	return p.CombineGrid > 0 && p.CombineGrid <= min(p.Grid[0]*p.Grid[1]*p.Grid[2], p.SMs)
}

// FusedAppend reports whether stage 1 writes the new tokens itself
// (Variant.Form.FusedAppend; Append is then ""). The JSON has it as
// fused_append.
func (p Plan) FusedAppend() bool { return p.Variant.Form.FusedAppend() }

// prefetchMaxTiles is the longest split whose tiles a plain stage 1 sends
// into L2 before its PDL wait: what its pipeline loads first.
const prefetchMaxTiles = splitKVStages - 1

// MakePlan picks the kernel variant for s (SelectVariant) and plans its
// launch on device d. With s.NumSplits == 0 the heuristic (autoSplits,
// tailSplit) picks the split count; a request n > 0 is clamped to
// [1, min(MaxSplits, key tiles)] of the length plannedKeys gives.
func MakePlan(s Shape, d Device) (Plan, error) {
	if err := checkPlanInputs(s, d); err != nil {
		return Plan{}, err
	}
	v, err := SelectCacheVariant(s.DType, s.CacheDType(), s.HeadDim, s.HeadsQ/s.HeadsKV*s.SeqlenQ, s.Form())
	if err != nil {
		return Plan{}, &Error{Op: planOp, Arg: "headdim", Err: ErrUnsupported,
			Msg: fmt.Sprintf("%d with dtype %v: %v; compiled head dims: %s", s.HeadDim, s.DType, err, compiledHeadDims(s.DType))}
	}
	if bps := d.blocksPerSM(v); bps < 1 {
		return Plan{}, unsupported(planOp, "", fmt.Sprintf("kernel %s does not fit on an SM of this device (occupancy %d)", v.Kernel, bps))
	}
	return planVariant(s, v, d)
}

// PlanVariant plans s for variant v on device d, as MakePlan does after
// choosing the variant: for tuning tools and tests.
func PlanVariant(s Shape, v Variant, d Device) (Plan, error) {
	if err := checkPlanInputs(s, d); err != nil {
		return Plan{}, err
	}
	if bps := d.blocksPerSM(v); bps < 1 {
		return Plan{}, invalid(planOp, "blocks_per_sm", fmt.Sprintf("%d; must be at least 1", bps))
	}
	if err := checkVariant(s, v); err != nil {
		return Plan{}, &Error{Op: planOp, Arg: "variant", Msg: err.Error(), Err: ErrInvalid}
	}
	return planVariant(s, v, d)
}

// planOp is the Op of the planner's errors.
const planOp = "plan"

// checkPlanInputs is the planner's one check of its inputs: the shape
// (Shape.Validate) and the device.
func checkPlanInputs(s Shape, d Device) error {
	if err := s.validate(planOp); err != nil {
		return err
	}
	if d.SMs < 1 {
		return invalid(planOp, "sms", fmt.Sprintf("%d; must be at least 1", d.SMs))
	}
	return nil
}

// planVariant plans valid inputs: the split count (requested, tailSplit or
// autoSplits), the merge, the grids, the workspace and the append.
func planVariant(s Shape, v Variant, d Device) (Plan, error) {
	if s.BatchInvariant {
		return planInvariant(s, v, d)
	}
	sms, blocksPerSM := d.SMs, d.blocksPerSM(v)
	packed := s.HeadsQ / s.HeadsKV * s.SeqlenQ // query rows sharing one K/V head
	rowTiles, err := rowTilesOf(s, v)
	if err != nil {
		return Plan{}, err
	}
	tiles := ceilDiv(s.plannedKeys(), v.KeysPerTile)

	// items unsplit; split n ways, they merge in clusters where all of the
	// clusters run at once, in pairs (n == 2) in a grid of more blocks than
	// SMs, else through the combine.
	items := s.Batch * s.HeadsKV * rowTiles
	merging := func(n int) Merge {
		if n < 2 || n > MaxCluster || d.Clusters == nil {
			return MergeCombine
		}
		perSplit, grid := ceilDiv(tiles, n), items*n
		fills := grid*100 >= sms*busySlotsPct && grid <= sms
		if items <= d.Clusters(v, n) && (perSplit <= clusterMaxTiles || (fills && perSplit <= clusterLongMaxTiles)) {
			return MergeCluster
		}
		if n == 2 && grid > sms && perSplit <= clusterLongMaxTiles && v.ClusterDenseSharedBytes > 0 && d.Clusters(v, 2) > 0 {
			return MergePairs
		}
		return MergeCombine
	}
	// A requested count splits every item; the heuristic splits only a
	// partial last wave's items (tailSplit) or every item (autoSplits).
	splits, whole := s.NumSplits, 0
	if splits > 0 {
		splits = clampSplits(splits, tiles)
	} else {
		rows := min(packed, v.Rows)
		kv := s.CacheDType()
		maxN := autoSplitCap(tiles, ceilDiv(minKeysPerSplit(rows, rowKeysFor(minSplitRowKeys, kv)), v.KeysPerTile))
		tailN := maxAutoSplits(tiles, ceilDiv(minKeysPerSplit(rows, rowKeysFor(minTailSplitRowKeys, kv)), v.KeysPerTile))
		if w, m := tailSplit(items, sms*blocksPerSM, tailN); m > 1 {
			splits, whole = m, w
		} else {
			costs := blockCostsOf(v, kv)
			splits = autoSplits(items, sms*targetBlocks(v, blocksPerSM), sms*blocksPerSM, tiles, maxN, costs, merging)
			// A serving block streams slower alone than a plain one, which
			// only a cluster merge's one-wave grid makes up for: other
			// serving plans fill every slot.
			if v.Form.Serving() && (splits < 2 || merging(splits) != MergeCluster) {
				splits = autoSplits(items, sms*blocksPerSM, sms*blocksPerSM, tiles, maxN, costs, merging)
			}
		}
	}

	// With the lengths on the device, a plan of one split or of the combine
	// balances its splits by them there (balancedSplits): most is then the
	// most splits a sequence may take.
	rows := s.Batch * s.HeadsQ * s.SeqlenQ
	most := 0
	if s.NumSplits == 0 && whole == 0 && v.Balances() && (splits == 1 || merging(splits) == MergeCombine) {
		most = balancedSplits(s, splits, items/s.Batch, sms*targetBlocks(v, blocksPerSM), tiles, rows*(s.HeadDim+1)*4)
	}
	mode := MergeNone
	switch {
	case most > 0:
		mode = MergeBalanced
	case whole > 0:
		mode = MergeTail
	case splits > 1:
		mode = merging(splits)
	}

	p := newPlan(s, v, d, mode, splits, rowTiles)
	switch mode {
	case MergeBalanced:
		// The combine that equal lengths' count takes, in its balanced twin.
		p.BalanceSplits, p.NumSplits = splits, most
		p.Grid = [3]int{items * (splits + 1), 1, 1}
		p.setCombine(v, splits, rows, s.HeadDim)
		p.Combine = BalancedCombine(p.Combine)
	case MergeTail:
		// The split items' rows start at the first packed row of item
		// `whole` (items run batch, K/V head, row tile).
		p.WholeItems = whole
		p.Grid = [3]int{whole + (items-whole)*splits, 1, 1}
		p.CombineRow0 = whole/rowTiles*packed + whole%rowTiles*v.Rows
		p.setCombine(v, splits, rows-p.CombineRow0, s.HeadDim)
	case MergeCluster:
		p.Cluster, p.SharedBytes = splits, v.ClusterSharedBytes
		if perSplit := ceilDiv(tiles, splits); v.Form == FormPlain && perSplit <= prefetchMaxTiles {
			p.PrefetchTiles = perSplit
		}
	case MergePairs:
		p.Cluster, p.SharedBytes = splits, v.ClusterDenseSharedBytes
	case MergeCombine:
		p.setCombine(v, splits, rows, s.HeadDim)
	}
	if err := p.finish(s, v); err != nil {
		return Plan{}, err
	}
	return p, nil
}

// newPlan is a plan of s run by v on d that merges by mode, in a plain
// launch of the stage-1 grid (splits, K/V heads x row tiles, batch).
func newPlan(s Shape, v Variant, d Device, mode Merge, splits, rowTiles int) Plan {
	return Plan{Variant: v, Merge: mode, NumSplits: splits, RowTiles: rowTiles,
		Grid: [3]int{splits, s.HeadsKV * rowTiles, s.Batch}, Threads: v.Threads, SharedBytes: v.SharedBytes,
		SMs: d.SMs, BlocksPerSM: d.blocksPerSM(v), Cluster: 1}
}

// rowTilesOf is Plan.RowTiles for s run by v, refused where the K/V heads'
// row tiles pass the launch grid's y limit.
func rowTilesOf(s Shape, v Variant) (int, error) {
	rowTiles := ceilDiv(s.HeadsQ/s.HeadsKV*s.SeqlenQ, v.Rows)
	if s.HeadsKV*rowTiles > maxGridYZ {
		return 0, unsupported(planOp, "nheads_kv", fmt.Sprintf("%d heads x %d row tiles exceed the launch grid's y limit %d", s.HeadsKV, rowTiles, maxGridYZ))
	}
	return rowTiles, nil
}

// finish lays out the workspace of a plan whose merge and grids are set,
// adds the append kernel and checks the grids.
func (p *Plan) finish(s Shape, v Variant) error {
	rows := s.Batch * s.HeadsQ * s.SeqlenQ
	if s.RotaryQ {
		p.QRotBytes = rows * s.HeadDim * s.DType.Size()
	}
	partials := 0
	if p.Merge.Combines() {
		partials = p.NumSplits
	}
	p.LSEPartialOffset, p.QRotOffset, p.WorkspaceBytes = workspaceLayout(partials, rows-p.CombineRow0, s.HeadDim, p.QRotBytes)
	if s.SeqlenNew > 0 && !v.Form.FusedAppend() {
		p.Append, p.AppendThreads = v.Append, appendThreads
		p.AppendGrid = [3]int{max(s.SeqlenNew, s.SeqlenQ), s.Batch, s.appendParts()}
	}
	return p.checkGrids(s)
}

// checkGrids refuses a plan whose launches pass CUDA's grid limits
// (gridDim.x <= 2^31-1, y and z <= 65535), before anything launches: the
// append kernel runs first and would write the cache.
func (p *Plan) checkGrids(s Shape) error {
	const maxGridX = math.MaxInt32
	switch {
	case p.Grid[0] > maxGridX:
		return unsupported(planOp, "batch", fmt.Sprintf("%d with %d K/V heads x %d row tiles makes a stage-1 grid of %d blocks (%v merge); CUDA launches at most %d", s.Batch, s.HeadsKV, p.RowTiles, p.Grid[0], p.Merge, maxGridX))
	case p.CombineGrid > maxGridX:
		return unsupported(planOp, "batch", fmt.Sprintf("%d with %d query heads makes a combine grid of %d blocks; CUDA launches at most %d", s.Batch, s.HeadsQ, p.CombineGrid, maxGridX))
	case p.AppendGrid[2] > maxGridYZ:
		return unsupported(planOp, "nheads_q", fmt.Sprintf("%d query and %d K/V heads of dim %d to append and rotate; the append kernel takes at most %d*%d chunks of 8 channels", s.HeadsQ, s.HeadsKV, s.HeadDim, maxGridYZ, appendThreads))
	}
	return nil
}

// maxFusedAppend is the most new tokens the appending forms write
// themselves, a 16-byte chunk a thread of one block each K/V head.
const maxFusedAppend = MaxSeqlenQ

// Form is the form of stage 1 that runs s: plain without serving arguments;
// an appending form (FormPagedAppend, FormAppend) for a paged or contiguous
// cache (Shape.Paged, Shape.Contiguous) appending 1 to maxFusedAppend tokens
// without rotary; else FormPaged or FormServing. With rotary the append
// kernel runs first and rotates q too.
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

// appendParts is the blocks the append kernel gives each token: one
// 16-byte chunk a thread of its new k and v rows and, with rotary, its q
// rows, so that all of a token's loads wait on one memory round trip.
func (s Shape) appendParts() int {
	chunks := s.HeadDim / 8
	items := s.HeadsKV * chunks
	if s.RotaryQ {
		items += s.HeadsQ * chunks
	}
	return max(1, ceilDiv(items, appendThreads))
}

// PlanKeyQuantum divides every Variant.KeysPerTile (8192 / a head dim of at
// most MaxHeadDim): lengths that round up to one multiple of it have the
// same key tiles in every variant.
const PlanKeyQuantum = 8192 / MaxHeadDim

// PlanKey returns s with Seqlen moved up so that Seqlen + SeqlenNew is a
// multiple of PlanKeyQuantum, within the cache: s and s.PlanKey() plan
// alike, so a plan cache keyed by it plans a growing length once every 32
// tokens. A negative Seqlen, or one past the cache, is left as it is.
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

// combineFor is the combine that merges n splits of v, its threads and the
// output rows a block merges: the narrow one where a warp loads all n at
// once, the column-group one where n outnumbers what Combine loads in one
// round trip to L2, else Combine.
func combineFor(v Variant, n int) (name string, threads, rows int) {
	switch {
	case v.CombineNarrow != "" && v.CombineNarrowRows > 0 && n <= combineUnroll:
		return v.CombineNarrow, 32 * v.CombineNarrowRows, v.CombineNarrowRows
	case v.CombineWide != "" && v.CombineWideThreads > 0 && n > combineSplitsPerStep(v.CombineThreads, 0):
		return v.CombineWide, v.CombineWideThreads, 1
	}
	return v.Combine, v.CombineThreads, v.CombineRows
}

// setCombine sets the combine of n splits over `rows` output rows and its
// grid (a block a column group of a row for the column-group one). Where
// the narrow combine's grid could not let the next kernel in early
// (CombineEarlyDependents) and its 16-row twin's could, it takes the twin.
func (p *Plan) setCombine(v Variant, n, rows, headDim int) {
	p.Combine, p.CombineThreads, p.CombineRows = combineFor(v, n)
	p.CombineGrid = ceilDiv(rows, p.CombineRows)
	if p.Combine == v.CombineWide && v.CombineWideCols > 0 {
		if groups := ceilDiv(headDim, v.CombineWideCols); p.CombineGrid <= math.MaxInt32/groups {
			p.CombineGrid *= groups
		} else { // past the grid's x limit: whole rows
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

// workspaceLayout is the one layout of the workspace (kernels/partials.cuh
// addresses it): for splits > 1, o_partial (float32 [splits][rows][headDim])
// at 0 and lse_partial (float32 [splits][rows]) at lseOffset; then qRotBytes
// of rotated q at qRotOffset; each part 256-byte aligned. All zeros when it
// holds nothing.
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
