package core

import (
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

// planInput is one planner input drawn by TestPlanInvariants or
// FuzzMakePlan: sizes in and just outside the valid ranges.
type planInput struct {
	dtype, batch, seqlenQ, headsKV, group, headDim int
	seqlenCache, seqlen, numSplits, seqlenNew      int
	windowKeys, sms                                int
	serving, rotary, clusters, paged, lengths      bool
	invariant                                      bool
}

func (in planInput) shape() (Shape, Device) {
	s := Shape{
		DType: DType(in.dtype), Batch: in.batch, SeqlenQ: in.seqlenQ, HeadsQ: in.headsKV * in.group,
		HeadsKV: in.headsKV, HeadDim: in.headDim, SeqlenCache: in.seqlenCache, Seqlen: in.seqlen,
		NumSplits: in.numSplits, Serving: in.serving, SeqlenNew: in.seqlenNew, WindowKeys: in.windowKeys,
		RotaryQ: in.rotary, Paged: in.paged, DeviceLengths: in.lengths, BatchInvariant: in.invariant,
	}
	d := Device{SMs: in.sms}
	switch {
	case in.clusters && in.sms == H200.SMs:
		d.Clusters = DefaultClusters
	case in.clusters:
		// A device that reports room for clusters of any size: the planner
		// still keeps to MaxCluster.
		d.Clusters = func(v Variant, size int) int { return 2 * in.sms / max(size, 1) }
	}
	return s, d
}

// checkPlanInvariants plans in and checks what every plan must satisfy
// for the kernels to run it: refusals are *Errors of the two kinds, and an
// accepted shape gets a grid within CUDA's limits that covers every row,
// a merge that matches its split count, and a workspace that holds what
// the merge and the rotated q need.
func checkPlanInvariants(t *testing.T, in planInput) {
	t.Helper()
	s, d := in.shape()
	p, err := MakePlan(s, d)
	if err != nil {
		var e *Error
		if !errors.As(err, &e) || e.Op != "plan" || !(errors.Is(err, ErrInvalid) || errors.Is(err, ErrUnsupported)) {
			t.Fatalf("%+v: MakePlan refused with %T %v; want an *Error wrapping ErrInvalid or ErrUnsupported", in, err, err)
		}
		return
	}
	fail := func(what string) { t.Helper(); t.Fatalf("%+v: %s\nplan %v", in, what, p) }
	if again, err := MakePlan(s, d); err != nil || again != p {
		fail("a second MakePlan differs")
	}
	if again, err := MakePlan(s.PlanKey(), d); err != nil || again != p {
		fail("the shape's PlanKey plans differently")
	}
	if _, err := json.Marshal(p); err != nil || p.String() == "" {
		fail("the plan does not print")
	}
	v := p.Variant
	if v.DType != s.DType || v.HeadDim < s.HeadDim || v.Form != s.Form() || v.Form.Serving() != s.Serving ||
		v.Form.Paged() != s.Paged {
		fail("the variant does not run the shape")
	}
	tiles := ceilDiv(s.plannedKeys(), v.KeysPerTile)
	if p.NumSplits < 1 || p.NumSplits > MaxSplits || p.NumSplits > max(1, tiles) {
		fail("split count out of [1, min(MaxSplits, key tiles)]")
	}
	if s.NumSplits > 0 && p.NumSplits != clampSplits(s.NumSplits, tiles) {
		fail("a requested split count is not clamped as documented")
	}
	packed := s.HeadsQ / s.HeadsKV * s.SeqlenQ
	if p.RowTiles*v.Rows < packed || (p.RowTiles-1)*v.Rows >= packed {
		fail("row tiles do not cover the packed rows exactly")
	}
	items := s.Batch * s.HeadsKV * p.RowTiles
	switch {
	case p.BalanceSplits > 0 && (!s.DeviceLengths || p.WholeItems > 0 || p.NumSplits <= p.BalanceSplits ||
		p.Grid != [3]int{items * (p.BalanceSplits + 1), 1, 1}):
		fail("a balanced plan is not a 1-D grid of n + 1 blocks an item whose sequences may take more than n splits")
	case p.BalanceSplits == 0 && p.WholeItems == 0 && p.Grid != [3]int{p.NumSplits, s.HeadsKV * p.RowTiles, s.Batch}:
		fail("grid is not (splits, heads x row tiles, batch)")
	case p.WholeItems > 0 && (p.WholeItems >= items || p.Grid != [3]int{p.WholeItems + (items-p.WholeItems)*p.NumSplits, 1, 1}):
		fail("a tail-split grid does not hold the whole items and the split rest")
	case p.Grid[0] < 1 || p.Grid[1] < 1 || p.Grid[2] < 1 || p.Grid[1] > maxGridYZ || p.Grid[2] > maxGridYZ || p.Grid[0] > 1<<31-1:
		fail("grid outside CUDA's limits")
	}
	modeFields := map[Merge]bool{
		MergeNone:     p.NumSplits == 1 && p.Cluster == 1 && p.WholeItems == 0 && p.BalanceSplits == 0,
		MergeCombine:  p.NumSplits > 1 && p.Cluster == 1 && p.WholeItems == 0 && p.BalanceSplits == 0,
		MergeCluster:  p.NumSplits > 1 && p.Cluster == p.NumSplits && p.SharedBytes == v.ClusterSharedBytes,
		MergePairs:    p.NumSplits == 2 && p.Cluster == 2 && p.SharedBytes == v.ClusterDenseSharedBytes,
		MergeTail:     p.WholeItems > 0 && p.BalanceSplits == 0,
		MergeBalanced: p.BalanceSplits > 0 && p.WholeItems == 0,
		MergeInvariant: p.InvariantTiles > 0 && p.NumSplits > 1 && p.Cluster == 1 && p.WholeItems == 0 &&
			p.BalanceSplits == 0,
	}
	if ok, known := modeFields[p.Merge]; !known || !ok || (p.PrefetchTiles > 0 && p.Merge != MergeCluster) {
		fail("the merge mode does not match the fields it sets")
	}
	if p.Threads != v.Threads || p.Threads%32 != 0 || p.Threads > 1024 || p.SharedBytes > 227*1024 {
		fail("block size or shared memory outside sm_90's limits")
	}
	if (p.Cluster == 1 && p.SharedBytes != v.SharedBytes) || p.BlocksPerSM != d.blocksPerSM(v) {
		fail("a plain launch's shared memory or blocks per SM is not the variant's")
	}
	rows := s.Batch * s.HeadsQ * s.SeqlenQ
	combines := p.NumSplits > 1 && p.Cluster == 1
	if combines != p.Merge.Combines() {
		fail("the merge mode's combine does not run exactly when the splits are not merged in stage 1")
	}
	groups := 1 // blocks a row: the column-group combine's groups
	if (p.Combine == v.CombineWide || p.Combine == BalancedCombine(v.CombineWide)) && v.CombineWideCols > 0 {
		groups = ceilDiv(s.HeadDim, v.CombineWideCols)
	}
	switch {
	case p.Cluster != 1 && (p.Cluster != p.NumSplits || p.Cluster > MaxCluster || d.Clusters == nil || p.WholeItems > 0):
		fail("a cluster is not one cluster of every split")
	case combines != (p.CombineGrid > 0) || combines != (p.Combine != ""):
		fail("the combine runs exactly when splits are not merged in stage 1")
	case combines && (p.BalanceSplits > 0 || p.InvariantTiles > 0) != strings.HasSuffix(p.Combine, BalancedCombine("")):
		fail("a balanced plan's combine is not the balanced twin, or a plain plan's is")
	case combines && (p.CombineGrid%groups != 0 || p.CombineGrid > math.MaxInt32 ||
		p.CombineGrid/groups*p.CombineRows < rows-p.CombineRow0 || (p.CombineGrid/groups-1)*p.CombineRows >= rows-p.CombineRow0):
		fail("the combine grid does not cover the split rows (each in its column groups) exactly")
	case p.WholeItems == 0 && p.CombineRow0 != 0, p.CombineRow0 < 0 || p.CombineRow0 >= max(rows, 1):
		fail("the combine's first row is outside the rows")
	case p.WholeItems > 0 && p.CombineRow0 != p.WholeItems/p.RowTiles*packed+p.WholeItems%p.RowTiles*v.Rows:
		// Items run (sequence, K/V head, row tile) and a K/V head's packed
		// rows are consecutive output rows: the whole items' rows come first.
		fail("the tail's combine does not start at the first row of the first split item")
	case combines && !knownCombine(p, v):
		fail("the combine is not one of the variant's with its threads and rows a block")
	}
	if p.PrefetchTiles > 0 && (p.PrefetchTiles != ceilDiv(tiles, p.NumSplits) || p.PrefetchTiles > prefetchMaxTiles || v.Form != FormPlain) {
		fail("a prefetch is not all of a plain split's tiles, within what its pipeline loads first")
	}
	end := 0      // the end of the partials
	if combines { // the partials of the rows the combine merges
		if p.LSEPartialOffset%256 != 0 || p.LSEPartialOffset < p.NumSplits*(rows-p.CombineRow0)*s.HeadDim*4 {
			fail("lse_partial overlaps o_partial or is misaligned")
		}
		end = p.LSEPartialOffset + p.NumSplits*(rows-p.CombineRow0)*4
	}
	if s.RotaryQ {
		if p.QRotBytes != rows*s.HeadDim*s.DType.Size() || p.QRotOffset%256 != 0 || p.QRotOffset < end {
			fail("the rotated q's room is misplaced or the wrong size")
		}
		end = p.QRotOffset + p.QRotBytes
	} else if p.QRotBytes != 0 || p.QRotOffset != 0 {
		fail("room for a rotated q without rotary")
	}
	if p.WorkspaceBytes != end {
		fail("the workspace is not exactly the partials and the rotated q")
	}
	if p.FusedAppend() && (p.Append != "" || s.RotaryQ || v.Form.Paged() != s.Paged || s.Paged == s.Contiguous) {
		fail("stage 1 appends itself only as the appending form of its cache's layout, without rotary and without the append kernel")
	}
	chunks := s.HeadsKV * s.HeadDim / 8 // 16-byte chunks of a token's new k (and v) rows
	if s.RotaryQ {
		chunks += s.HeadsQ * s.HeadDim / 8 // and of its q rows to rotate
	}
	if (s.SeqlenNew > 0) != (p.Append != "" || p.FusedAppend()) || (p.Append != "" && (p.AppendGrid[1] != s.Batch ||
		p.AppendGrid[0] != max(s.SeqlenNew, s.SeqlenQ) || p.AppendThreads < 1 || p.AppendGrid[2] > maxGridYZ ||
		p.AppendGrid[2]*p.AppendThreads < chunks || (p.AppendGrid[2]-1)*p.AppendThreads >= chunks)) {
		fail("the new tokens are appended exactly when there are some: by stage 1, or by the append kernel over every new and query token of every sequence, a thread for each chunk of k, v and the q to rotate")
	}
	if p.Append == "" && (p.AppendGrid != [3]int{} || p.AppendThreads != 0) {
		fail("an append grid without the append kernel")
	}
	if p.SMs != d.SMs || p.BlocksPerSM < 1 {
		fail("the plan does not record the device it was made for")
	}
	if s.BatchInvariant != (p.InvariantTiles > 0) || (s.BatchInvariant && (p.Merge != MergeNone && p.Merge != MergeInvariant ||
		p.Combine != "" && p.Combine != BalancedCombine(v.Combine) || p.InvariantTiles != invariantTiles(s, v))) {
		fail("a batch-invariant plan is not exactly one of the invariant tile budget, merged by the 4-warp combine's balanced twin")
	}
}

// knownCombine reports whether p's combine, its threads and its rows a block
// are one of v's combines as combineFor and setCombine configure them (a
// balanced plan's in its balanced twin): the combine kernel indexes its rows
// by them.
func knownCombine(p Plan, v Variant) bool {
	for _, c := range []struct {
		name          string
		threads, rows int
	}{
		{v.Combine, v.CombineThreads, v.CombineRows},
		{v.CombineNarrow, 32 * v.CombineNarrowRows, v.CombineNarrowRows},
		{v.CombineNarrowDense, 32 * v.CombineNarrowDenseRows, v.CombineNarrowDenseRows},
		{v.CombineWide, v.CombineWideThreads, 1},
	} {
		name := c.name
		if p.Merge == MergeBalanced || p.Merge == MergeInvariant {
			name = BalancedCombine(name)
		}
		if c.name != "" && p.Combine == name && p.CombineThreads == c.threads && p.CombineRows == c.rows {
			return true
		}
	}
	return false
}

// drawPlanInput draws sizes around the planner's boundaries: each valid
// most of the time, now and then one step outside its limit.
func drawPlanInput(r *rand.Rand) planInput {
	pick := func(xs ...int) int { return xs[r.IntN(len(xs))] }
	// or returns one of bad once in 32 draws, else v.
	or := func(v int, bad ...int) int {
		if r.IntN(32) == 0 {
			return pick(bad...)
		}
		return v
	}
	in := planInput{
		dtype:       or(pick(int(Float16), int(BFloat16)), 0, 7),
		batch:       or(pick(1, 1, 2, 3, 8, 33, 256, 4096, 65535), 0, 65536),
		seqlenQ:     or(pick(1, 1, 1, 2, 4, 7, 16), 0, 17),
		headsKV:     pick(1, 2, 8, 8, 32, 48, 128),
		group:       pick(1, 1, 4, 8, 16, 64),
		headDim:     or(pick(64, 128, 128, 256, 8, 72, 136), 0, 100, 264),
		seqlenCache: or(pick(0, 1, 15, 16, 255, 1024, 4096, 32768, 131072, 1<<20, MaxSeqlenCache), -1, MaxSeqlenCache+1),
		numSplits:   or(pick(0, 0, 0, 1, 2, 3, 16, 17, 128, 129, 1000), -1),
		sms:         or(pick(132, 132, 132, 1, 7, 78, 108, 114, 264), 0),
		serving:     r.IntN(2) == 0,
		clusters:    r.IntN(4) != 0,
	}
	in.seqlen = or(pick(-1, -1, 0, 1, in.seqlenCache/3, in.seqlenCache), in.seqlenCache+1)
	if in.serving {
		in.seqlenNew = or(pick(0, 0, 1, 1, 4, 16, 17, in.seqlenCache), in.seqlenCache+1, -1)
		in.windowKeys = or(pick(0, 0, 1, 100, 4097), -1)
		in.rotary = in.seqlenNew > 0 && r.IntN(2) == 0 || r.IntN(32) == 0
	}
	in.paged = in.serving && r.IntN(2) == 0 || r.IntN(64) == 0
	in.lengths = r.IntN(2) == 0
	in.invariant = r.IntN(4) == 0
	if in.invariant && r.IntN(8) != 0 {
		in.numSplits = 0
	}
	return in
}

// TestPlanInvariants plans thousands of drawn shapes (a fixed seed, so a
// failure repeats) and checks each plan's invariants.
func TestPlanInvariants(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	n := 20000
	if testing.Short() {
		n = 2000
	}
	for range n {
		checkPlanInvariants(t, drawPlanInput(r))
	}
}

// FuzzMakePlan checks the same invariants on inputs the fuzzer chooses
// (go test -fuzz FuzzMakePlan ./core); without -fuzz it runs the seeds.
func FuzzMakePlan(f *testing.F) {
	f.Add(int(Float16), 1, 1, 8, 4, 128, 32768, -1, 0, 0, 0, 132, false, false, true, false, false, false)
	f.Add(int(BFloat16), 8, 4, 8, 8, 256, 4096, 1000, 0, 1, 0, 132, true, true, true, true, true, false)
	f.Add(int(Float16), 64, 1, 1, 64, 64, 131072, -1, 0, 0, 4097, 132, true, false, true, false, true, false)
	f.Add(int(Float16), 3, 16, 2, 1, 72, 16, 15, 3, 16, 0, 7, true, true, false, false, false, false)
	f.Add(int(Float16), 65535, 1, 1, 1, 8, 1, -1, 0, 0, 0, 1, false, false, false, false, true, false)
	f.Add(int(Float16), 2, 1, 8, 4, 128, 4096, -1, 0, 1, 0, 132, true, false, true, true, false, false)
	f.Add(int(Float16), 8, 1, 8, 4, 128, 32768, 64, 0, 0, 0, 132, false, false, true, false, true, false)
	f.Add(int(Float16), 64, 1, 8, 4, 128, 32768, -1, 0, 0, 0, 108, true, false, false, true, true, true)
	// A tail split past gridDim.x's limit, with an append kernel that must not launch.
	f.Add(int(Float16), 32774, 1, 65524, 1, 128, 1024, -1, 0, 1, 0, 132, true, true, true, false, false, false)
	f.Fuzz(func(t *testing.T, dtype, batch, seqlenQ, headsKV, group, headDim, seqlenCache, seqlen, numSplits,
		seqlenNew, windowKeys, sms int, serving, rotary, clusters, paged, lengths, invariant bool) {
		in := planInput{dtype, batch, seqlenQ, headsKV, group, headDim, seqlenCache, seqlen, numSplits,
			seqlenNew, windowKeys, sms, serving, rotary, clusters, paged, lengths, invariant}
		// Sizes beyond these only repeat the limits Validate checks, and
		// would make the checker's products overflow.
		if headsKV < 1 || headsKV > 1<<16 || group < 1 || group > 1<<16 || sms > 1<<12 || windowKeys > 1<<31 {
			t.Skip()
		}
		checkPlanInvariants(t, in)
	})
}

// FuzzProblemValidate edits the serving problems of the table tests with the
// fuzzer's values and checks that Validate never panics and refuses with an
// *Error of the two kinds, and that a problem it accepts plans, or is
// refused by the planner the same way.
func FuzzProblemValidate(f *testing.F) {
	// Seeds the checks accept: paged with a window; every feature but
	// paging; an append of 16 tokens rotated over all channels.
	f.Add(uint8(0), 16, 600, 256, int64(256), 0, 255, 0, float32(30), int64(0), 0, 0, 0, int64(0), int64(1024), uint64(1))
	f.Add(uint8(1), 0, 0, 0, int64(0), 5, 255, 0, float32(30), int64(32), 3, 64, 8192, int64(32), int64(1024), uint64(15))
	f.Add(uint8(2), 0, 0, 0, int64(0), 0, -1, -1, float32(0), int64(0), 16, 128, 1, int64(64), int64(1024), uint64(24|100<<32))
	f.Fuzz(func(t *testing.T, base uint8, pageSize, numPages, maxPages int, tableStride int64, cacheBatch, left, right int,
		softcap float32, alibiStride int64, seqlenNew, rotaryDim, rotaryRows int, rotaryStride, kSeqStride int64, flags uint64) {
		p := [...]func() Problem{pagedProblem, allProblem, appendProblem}[int(base)%3]()
		if pageSize != 0 || p.PageSize != 0 {
			p.PageSize, p.NumPages, p.MaxPages, p.BlockTableStride = pageSize, numPages, maxPages, tableStride
			p.SeqlenCache = max(0, min(pageSize*maxPages, 1<<31))
		}
		if p.PageSize == 0 {
			p.CacheBatch = cacheBatch
		}
		p.Window = Window{Enabled: flags&1 != 0, Left: left, Right: right}
		p.Softcap, p.Alibi, p.AlibiBatchStride = softcap, flags&2 != 0, alibiStride
		p.New.Seqlen = seqlenNew
		p.Rotary.Dim, p.Rotary.Rows, p.Rotary.Stride = rotaryDim, rotaryRows, rotaryStride
		p.K.SeqStride, p.Leftpad, p.Causal = kSeqStride, flags&4 != 0, flags&8 != 0
		if flags&16 != 0 {
			p.CacheSeqlens, p.Seqlen = 0, int(flags>>32)%(p.SeqlenCache+1)
		}
		kind := func(err error) bool {
			var e *Error
			return errors.As(err, &e) && (errors.Is(err, ErrInvalid) || errors.Is(err, ErrUnsupported))
		}
		if err := p.Validate(); err != nil {
			if !kind(err) {
				t.Fatalf("Validate refused with %T %v", err, err)
			}
			return
		}
		if _, err := MakePlan(p.PlanShape(), H200); err != nil && !kind(err) {
			t.Fatalf("MakePlan of an accepted problem refused with %T %v", err, err)
		}
	})
}
