package core

import (
	"encoding/json"
	"fmt"
	"strings"
)

// MaxSplits is the most splits of one sequence's keys the planner makes or
// accepts: the combine reads every split of a row, and beyond 128 splits the
// partials cost more memory traffic than a split saves on any cache the
// heuristic would split that finely.
const MaxSplits = 128

// Split heuristic constants (see autoSplits).
const (
	// minSplitKeys is the fewest keys a split gets from the automatic
	// heuristic: one 64-key tile at head dim 128. A split of a block with r
	// packed rows writes r*d fp32 partial outputs and the combine reads them
	// back (8*r*d bytes) while it reads 4*keys*d bytes of fp16/bf16 K and V,
	// so minKeysPerSplit also asks for 16*r keys, which keeps that extra
	// traffic at or below 1/8. The combine's own cost grows with the splits
	// and is in the cost model (combineRoundCost) rather than in this floor.
	// Measured on the H200 (b=1, 32/8 heads, d128): 1024 keys run in 7.4 us
	// with 16 splits of 64 keys, 8.0 us with 4 of 256, 10.2 us with 2 of 512.
	minSplitKeys = 64
	// combineRoundCost is what one round of the combine costs in the
	// half-tile units of splitCost: a combine block fetches 32 splits of a
	// row per L2 round trip (4 warps x 8 loads), about 2.5 tile loads of a
	// slot. Fitted on the H200, MQA 8/1, b=1, 16384 keys: 11.3, 10.5 and
	// 12.3 us with 32, 64 and 128 splits.
	combineRoundCost      = 5
	combineSplitsPerRound = 32
	// splitTolerancePct: among split counts whose modelled time is within
	// this many percent of the best, the smallest wins (fewer partials, a
	// cheaper combine).
	splitTolerancePct = 5
	// busySlotsPct: with at least this share of the block slots streaming
	// without splitting, HBM is close to saturated (bandwidth is shared by
	// the whole GPU, not owned per slot), so the cost model's promised gain
	// of under 1/4 would mostly not materialize and would not pay for the
	// partials and the combine launch. To be tuned on the H200.
	busySlotsPct = 80
	// targetWarpsPerSM is how many resident stage-1 warps per SM the
	// heuristic fills, in whole blocks: one block of 4 or more warps, two of
	// the 2-warp head-dim-256 kernel. A block's 3-stage cp.async pipeline
	// keeps 64 KiB of K/V in flight, enough on its own to cover HBM latency,
	// while every extra split costs partial traffic and combine work.
	// Measured on the H200 (b=1, 32/8 heads, 32768 keys, fp16): at d128
	// (4 warps) stage 1 streams 3.84 TB/s with 16 splits (one block per SM)
	// and 3.79 TB/s with 33 (two), and stage 1 + combine 3.24 against 2.89
	// TB/s; at d256 (2 warps) one block per SM leaves its warps stalled on
	// fixed-latency dependencies (Nsight Compute: 44% issue-active, DRAM at
	// 52%), and 8192 keys take 26.4 us in 32 splits against 28.6 us in 16.
	targetWarpsPerSM = 4
)

// Occupancy returns how many blocks of the stage-1 kernel of v can be
// resident on one SM at once. On a GPU the driver answers it
// (cuOccupancyMaxActiveBlocksPerMultiprocessor); DefaultOccupancy estimates it
// without one.
type Occupancy func(v Variant) int

// Per-SM limits of sm_90 (H100/H200) used by DefaultOccupancy.
const (
	smWarps          = 64         // 2048 threads
	smBlocks         = 32         // resident blocks
	smSharedBytes    = 228 * 1024 // shared memory per SM (at most 227 KB of it per block)
	smSharedReserved = 1024       // shared memory the system reserves per block
)

// DefaultOccupancy estimates the resident blocks of v per SM from its threads
// (whole warps, 2048 threads per SM) and dynamic shared memory (228 KB per SM,
// of which 1 KB is reserved per block) under sm_90's limit of 32 blocks. It
// ignores registers and static shared memory, so it may overestimate; it
// returns 0 when a block does not fit at all.
func DefaultOccupancy(v Variant) int {
	n := smBlocks
	if v.Threads > 0 {
		n = min(n, smWarps/((v.Threads+31)/32))
	}
	return min(n, smSharedBytes/(max(v.SharedBytes, 0)+smSharedReserved))
}

// Plan is everything a launch needs, computed once from a Shape and device
// facts and reusable for every call (every layer) with that Shape. Launch
// shapes depend on shapes only, never on device data, so a captured CUDA
// graph stays correct when cache_seqlens changes.
type Plan struct {
	Variant   Variant `json:"variant"`    // the kernels that run
	NumSplits int     `json:"num_splits"` // splits of each sequence's keys: stage-1 grid.x
	RowTiles  int     `json:"row_tiles"`  // ceil(HeadsQ/HeadsKV*SeqlenQ / Variant.Rows)
	// Grid is the stage-1 grid: (NumSplits, HeadsKV*RowTiles, Batch).
	Grid        [3]int `json:"grid"`
	Threads     int    `json:"threads"`      // stage-1 threads per block
	SharedBytes int    `json:"shared_bytes"` // stage-1 dynamic shared memory per block
	// CombineGrid blocks of CombineThreads run the combine; both are 0 when
	// NumSplits == 1 (stage 1 then writes out and lse itself).
	CombineGrid    int `json:"combine_grid"`
	CombineThreads int `json:"combine_threads"`
	// The workspace holds o_partial, float32 [NumSplits][rows][HeadDim]
	// at offset 0, and lse_partial, float32 [NumSplits][rows] at
	// LSEPartialOffset (256-byte aligned), rows = Batch*HeadsQ*SeqlenQ and
	// HeadDim the problem's own (not the variant's padded) head dim. Both are
	// 0 when NumSplits == 1.
	LSEPartialOffset int `json:"lse_partial_offset"`
	WorkspaceBytes   int `json:"workspace_bytes"`
	SMs              int `json:"sms"`           // SM count planned for
	BlocksPerSM      int `json:"blocks_per_sm"` // resident stage-1 blocks per SM planned for
}

// MakePlan picks the kernel variant for s (SelectVariant), asks occ how many
// of its blocks fit on an SM (nil means DefaultOccupancy), and plans the
// launch on a device of sms SMs with PlanVariant.
//
// With s.NumSplits == 0 the split count comes from the heuristic described
// in the package documentation and at autoSplits. A request n > 0 is
// clamped to [1, min(MaxSplits, key tiles)], key tiles being
// ceil(length/Variant.KeysPerTile) for the length the plan uses (Seqlen if
// >= 0, else SeqlenCache): more splits than tiles would only add empty
// splits.
func MakePlan(s Shape, sms int, occ Occupancy) (Plan, error) {
	const op = "plan"
	if err := s.validate(op); err != nil {
		return Plan{}, err
	}
	if sms < 1 {
		return Plan{}, invalid(op, "sms", fmt.Sprintf("%d; must be at least 1", sms))
	}
	v, err := SelectVariant(s.DType, s.HeadDim, s.HeadsQ/s.HeadsKV*s.SeqlenQ)
	if err != nil {
		return Plan{}, &Error{Op: op, Arg: "headdim", Err: ErrUnsupported,
			Msg: fmt.Sprintf("%d with dtype %v: %v; compiled head dims: %s", s.HeadDim, s.DType, err, compiledHeadDims(s.DType))}
	}
	if occ == nil {
		occ = DefaultOccupancy
	}
	bps := occ(v)
	if bps < 1 {
		return Plan{}, unsupported(op, "", fmt.Sprintf("kernel %s does not fit on an SM of this device (occupancy %d)", v.Kernel, bps))
	}
	return planVariant(op, s, v, sms, bps)
}

// PlanVariant plans s for the given variant on a device of sms SMs holding
// blocksPerSM resident blocks of it each. MakePlan calls it after choosing
// the variant; tuning tools and tests call it to plan a variant of their
// choice. Splits are chosen or clamped as MakePlan describes.
func PlanVariant(s Shape, v Variant, sms, blocksPerSM int) (Plan, error) {
	const op = "plan"
	if err := s.validate(op); err != nil {
		return Plan{}, err
	}
	return planVariant(op, s, v, sms, blocksPerSM)
}

func planVariant(op string, s Shape, v Variant, sms, blocksPerSM int) (Plan, error) {
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
	length := s.SeqlenCache
	if s.Seqlen >= 0 {
		length = s.Seqlen
	}
	tiles := ceilDiv(length, v.KeysPerTile)

	splits := s.NumSplits
	if splits > 0 {
		splits = clampSplits(splits, tiles)
	} else {
		blocks := s.Batch * s.HeadsKV * rowTiles
		maxN := maxAutoSplits(tiles, ceilDiv(minKeysPerSplit(min(packed, v.Rows)), v.KeysPerTile))
		splits = autoSplits(blocks, sms*targetBlocks(v, blocksPerSM), tiles, maxN)
	}

	rows := s.Batch * s.HeadsQ * s.SeqlenQ
	p := Plan{
		Variant:     v,
		NumSplits:   splits,
		RowTiles:    rowTiles,
		Grid:        [3]int{splits, s.HeadsKV * rowTiles, s.Batch},
		Threads:     v.Threads,
		SharedBytes: v.SharedBytes,
		SMs:         sms,
		BlocksPerSM: blocksPerSM,
	}
	p.LSEPartialOffset, p.WorkspaceBytes = workspaceLayout(splits, rows, s.HeadDim)
	if splits > 1 {
		p.CombineGrid = ceilDiv(rows, v.CombineRows)
		p.CombineThreads = v.CombineThreads
	}
	return p, nil
}

// checkVariant reports why v cannot run s, or nil.
func checkVariant(s Shape, v Variant) error {
	switch {
	case v.DType != s.DType:
		return fmt.Errorf("%s is for %v, not %v", v.Kernel, v.DType, s.DType)
	case v.HeadDim < s.HeadDim:
		return fmt.Errorf("%s is for head dims up to %d, not %d", v.Kernel, v.HeadDim, s.HeadDim)
	case v.Rows < 1 || v.Threads < 1 || v.KeysPerTile < 1 || v.SharedBytes < 0 ||
		v.CombineRows < 1 || v.CombineThreads < 1:
		return fmt.Errorf("%s has a non-positive size: %+v", v.Kernel, v)
	}
	return nil
}

// workspaceLayout is the one place that lays out the workspace: o_partial
// (float32 [splits][rows][headDim]) at 0, lse_partial (float32
// [splits][rows]) at lseOffset, the first 256-byte boundary after it. It
// returns 0, 0 for a single split, which needs no workspace.
func workspaceLayout(splits, rows, headDim int) (lseOffset, total int) {
	if splits <= 1 {
		return 0, 0
	}
	const f32, align = 4, 256
	lseOffset = ceilDiv(splits*rows*headDim*f32, align) * align
	return lseOffset, lseOffset + splits*rows*f32
}

// minKeysPerSplit is the fewest keys the heuristic gives one split when a
// block holds rows packed query rows: max(minSplitKeys, 16*rows), which
// keeps partial traffic (8*rows*d bytes) within 1/8 of the K/V bytes
// (4*keys*d) the split reads.
func minKeysPerSplit(rows int) int { return max(minSplitKeys, 16*rows) }

// maxAutoSplits is the most splits the heuristic considers for a length of
// tiles key tiles when a split must hold at least minTiles of them:
// min(MaxSplits, tiles/minTiles), and at least 1.
func maxAutoSplits(tiles, minTiles int) int {
	return max(1, min(MaxSplits, tiles/max(minTiles, 1)))
}

// clampSplits is what a requested split count n > 0 becomes:
// n clamped to [1, min(MaxSplits, tiles)].
func clampSplits(n, tiles int) int {
	return max(1, min(n, MaxSplits, tiles))
}

// splitCost models the time of a decode, in half key-tile loads of one
// block slot, when blocks (batch x K/V heads x row tiles) are each split n
// ways over slots resident block slots: stage 1 takes the waves times the
// tiles each split streams, 2 * ceil(blocks*n/slots) * ceil(tiles/n) (decode
// is memory-bound, so a slot's time is the bytes it streams), and with n > 1
// the combine adds combineRoundCost per combineSplitsPerRound splits.
func splitCost(blocks, slots, tiles, n int) int {
	cost := 2 * ceilDiv(blocks*n, slots) * ceilDiv(tiles, n)
	if n > 1 {
		cost += combineRoundCost * ceilDiv(n, combineSplitsPerRound)
	}
	return cost
}

// autoSplits is the num_splits=0 heuristic. Decode streams the whole K/V
// cache once and is memory-bound; its unsplit grid has only blocks =
// batch x K/V heads x row tiles blocks, often far fewer than the slots =
// SMs x blocks-per-SM the GPU can keep streaming. Splitting each sequence's
// keys n ways gives every slot a part of the cache, at the cost of writing
// fp32 partials and a combine launch. So:
//
//   - blocks >= 80% of slots (about a full wave already; busySlotsPct) or
//     maxN <= 1: 1 split;
//   - else the n in [1, maxN] with the least splitCost, preferring the
//     smallest n within splitTolerancePct of it (fewer partials), which
//     favours whole waves and splits that divide the tiles evenly.
//
// (planVariant passes slots = SMs x targetBlocks: one block per SM for the
// kernels of 4 or more warps.)
//
// Worked example: batch 1, 32 query and 8 K/V heads (one row tile of 4
// rows), 32768 keys in tiles of 64 (512 tiles), 132 SMs x 1 block = 132
// slots. blocks = 8; a split holds >= 64 keys = 1 tile, so maxN = 128.
// For n <= 16 the 8n blocks fit one wave: cost 2*ceil(512/n) + 5, which is
// 69 at n=16; more splits take more waves and never cost less (n=32:
// 2*2*16 + 5 = 69; n=128: 2*8*4 + 4*5 = 84). The smallest n at the least
// cost is 16: grid (16, 8, 1), 128 of 132 SMs busy, 2048 keys each. With
// batch 16 (128 blocks >= 80% of 132) it is 1; with 1024 keys (16 tiles)
// it is 16 again: one tile each, cost 2 + 5.
func autoSplits(blocks, slots, tiles, maxN int) int {
	if maxN <= 1 || blocks*100 >= slots*busySlotsPct {
		return 1
	}
	costs := make([]int, maxN+1)
	best := splitCost(blocks, slots, tiles, 1)
	for n := 1; n <= maxN; n++ {
		costs[n] = splitCost(blocks, slots, tiles, n)
		best = min(best, costs[n])
	}
	for n := 1; n <= maxN; n++ {
		if costs[n]*100 <= best*(100+splitTolerancePct) {
			return n
		}
	}
	return 1 // unreachable: the best cost itself qualifies
}

// targetBlocks is how many resident blocks of v per SM the heuristic fills:
// enough for targetWarpsPerSM warps, at least one, at most blocksPerSM.
func targetBlocks(v Variant, blocksPerSM int) int {
	warps := max(1, ceilDiv(v.Threads, 32))
	return max(1, min(blocksPerSM, ceilDiv(targetWarpsPerSM, warps)))
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

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

// String returns a one-line summary of p, for logs and error reports.
func (p Plan) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s grid (%d,%d,%d) x %d threads, %d B shared, %d/SM on %d SMs",
		p.Variant.Kernel, p.Grid[0], p.Grid[1], p.Grid[2], p.Threads, p.SharedBytes, p.BlocksPerSM, p.SMs)
	if p.NumSplits <= 1 {
		b.WriteString("; 1 split, no combine, no workspace")
		return b.String()
	}
	fmt.Fprintf(&b, "; %d splits; combine %s %d x %d threads; workspace %d B (lse_partial at %d)",
		p.NumSplits, p.Variant.Combine, p.CombineGrid, p.CombineThreads, p.WorkspaceBytes, p.LSEPartialOffset)
	return b.String()
}

// variantJSON is Variant with snake_case JSON names.
type variantJSON struct {
	Kernel         string `json:"kernel"`
	Combine        string `json:"combine"`
	DType          string `json:"dtype"`
	HeadDim        int    `json:"head_dim"`
	Rows           int    `json:"rows"`
	Threads        int    `json:"threads"`
	KeysPerTile    int    `json:"keys_per_tile"`
	SharedBytes    int    `json:"shared_bytes"`
	CombineThreads int    `json:"combine_threads"`
	CombineRows    int    `json:"combine_rows"`
}

// MarshalJSON encodes p with snake_case names throughout, the variant's
// dtype as its torch name ("float16"), for the Python and C callers.
func (p Plan) MarshalJSON() ([]byte, error) {
	type plain Plan // drops the methods: no recursion
	v := p.Variant
	return json.Marshal(struct {
		Variant variantJSON `json:"variant"`
		plain
	}{variantJSON{v.Kernel, v.Combine, v.DType.String(), v.HeadDim, v.Rows, v.Threads,
		v.KeysPerTile, v.SharedBytes, v.CombineThreads, v.CombineRows}, plain(p)})
}
