package core

import (
	"fmt"
	"math"
)

// Limits of the merge kernels (kernels/merge_states.cuh), checked by
// MergeProblem.Validate.
const (
	MergeRowDims    = 3   // row dimensions a merge addresses by strides
	MergePointers   = 8   // most states passed one pointer each
	MaxMergeHeadDim = 256 // largest head dim; any multiple of 4 up to it runs
)

// The merge kernels' launch facts; they mirror kernels/merge_states.cuh.
const (
	mergeUnroll      = 8             // FD_MERGE_UNROLL: states one warp loads at once
	mergeMaxWarps    = 16            // FD_MERGE_MAX_WARPS
	mergeWarpShared  = 2*32*16 + 8   // FD_MERGE_WARP_SHARED_BYTES: a warp's sums and state
	mergeVectorElems = 4             // elements a lane loads and stores at once
	mergeMaxGrid     = math.MaxInt32 // CUDA's limit on gridDim.x

	mergeOp = "merge_states" // the Op of merge errors
)

// MergeInput locates one input of every state of a merge: their outputs
// (Outs, in the problem's DType) or their LSEs (LSEs, float32). State s is at
// Ptrs[s] when NumPtrs == NumStates (one pointer per state, a list of
// tensors), or at Ptrs[0] + s*StateStride elements when NumPtrs == 1 (a
// stacked tensor). Its row (i0, i1, i2) is Strides[0]*i0 + Strides[1]*i1 +
// Strides[2]*i2 elements further; the HeadDim elements of a row are
// contiguous.
type MergeInput struct {
	Ptrs        [MergePointers]uintptr
	NumPtrs     int
	StateStride int64
	Strides     [MergeRowDims]int64
}

// MergeOutput locates an output of a merge: row (i0, i1, i2) at Ptr +
// Strides[0]*i0 + Strides[1]*i1 + Strides[2]*i2 elements.
type MergeOutput struct {
	Ptr     uintptr
	Strides [MergeRowDims]int64
}

// MergeProblem is one merge of attention states: NumStates partial results
// of attention over disjoint key sets (a shared prefix and each sequence's
// suffix, or the keys of several devices), each a normalized output and its
// natural-log LSE per row, merged into the result over all their keys:
//
//	lse = log(sum_s exp(lse_s)),  out = sum_s exp(lse_s - lse) * out_s
//
// An LSE of -inf is an empty state: it weighs nothing, whatever its output
// holds; a row whose states are all empty gets out = 0 and lse = -inf. It is
// what every caller (Go, C through capi, Python through the binding) fills
// in; Validate checks it and cuda.MergeStates runs it.
type MergeProblem struct {
	DType     DType // Float16, BFloat16 or Float32: Outs and Out
	NumStates int
	// Rows are the sizes of the row dimensions (i0, i1, i2); unused ones
	// are 1. Their product is the number of rows.
	Rows    [MergeRowDims]int
	HeadDim int // a multiple of 4, at most 256

	Outs MergeInput  // (NumStates, Rows..., HeadDim) in DType
	LSEs MergeInput  // (NumStates, Rows...) float32
	Out  MergeOutput // (Rows..., HeadDim) in DType; must not overlap itself or the inputs
	// LSE receives the merged float32 (Rows...) natural-log LSE; Ptr 0:
	// not wanted. It must not overlap itself or the inputs.
	LSE MergeOutput
}

// MergeLaunch is the launch cuda.MergeStates makes for a MergeProblem.
type MergeLaunch struct {
	Kernel      string // fd_merge_states_<dtype>
	Grid        int    // blocks: one per row
	Threads     int    // 32 per warp: ceil(NumStates/8) warps, 1 to 16
	SharedBytes int    // dynamic shared memory: the warps after the first leave their sums there
}

// MergeKernel returns the merge kernel's name for dtype d ("" for a dtype
// without one).
func MergeKernel(d DType) string {
	switch d {
	case Float16:
		return "fd_merge_states_f16"
	case BFloat16:
		return "fd_merge_states_bf16"
	case Float32:
		return "fd_merge_states_f32"
	}
	return ""
}

// NumRows returns the number of rows: the product of p.Rows.
func (p *MergeProblem) NumRows() int {
	return p.Rows[0] * p.Rows[1] * p.Rows[2]
}

// Launch returns the launch of a valid p: one block per row, with enough
// warps that every state's loads are in flight at once (8 a warp, up to 128
// states; more take further rounds).
func (p *MergeProblem) Launch() MergeLaunch {
	warps := min(max(ceilDiv(p.NumStates, mergeUnroll), 1), mergeMaxWarps)
	return MergeLaunch{Kernel: MergeKernel(p.DType), Grid: p.NumRows(), Threads: 32 * warps,
		SharedBytes: (warps - 1) * mergeWarpShared}
}

// Validate reports the first thing wrong with p as an *Error naming the
// argument (as the Python user knows it where one does: outs, lses,
// headdim) and wrapping ErrInvalid or ErrUnsupported.
//
// Checked: the dtype; NumStates and every row size at least 1, and at most
// 2^31-1 rows; HeadDim a multiple of 4 up to 256; for outs, lses, out and
// lse: non-null pointers (lse may be 0), aligned to what the kernel loads
// (4 elements of outs and out, 4 bytes of the LSEs), non-negative strides
// (those of dimensions of size 1 are never used and not checked), multiples
// of 4 elements for outs and out, element offsets that fit in 64 bits, one
// pointer or one per state (at most 8); out and lse do not overlap
// themselves, each other or any state's outs and lses (compared as byte
// ranges, from an address to the end of its last element). That the memory
// is allocated on the right device is the caller's part.
func (p *MergeProblem) Validate() error {
	const op = mergeOp
	if p == nil {
		return invalid(op, "", "nil MergeProblem")
	}
	if MergeKernel(p.DType) == "" {
		return unsupported(op, "dtype", fmt.Sprintf("%d; supported: %d (float16), %d (bfloat16), %d (float32)",
			int(p.DType), int(Float16), int(BFloat16), int(Float32)))
	}
	if p.NumStates < 1 {
		return invalid(op, "num_states", fmt.Sprintf("%d; must be at least 1", p.NumStates))
	}
	if p.NumStates > math.MaxInt32 {
		return unsupported(op, "num_states", fmt.Sprintf("%d; at most %d", p.NumStates, math.MaxInt32))
	}
	rows := int64(1)
	for i, n := range p.Rows {
		if n < 1 {
			return invalid(op, "rows", fmt.Sprintf("%v: row dimension %d has size %d; sizes must be at least 1 (unused dimensions 1)", p.Rows, i, n))
		}
		rows *= int64(n)
		if rows > mergeMaxGrid {
			return unsupported(op, "rows", fmt.Sprintf("%v: more than %d rows (the launch grid's limit)", p.Rows, mergeMaxGrid))
		}
	}
	if p.HeadDim < 1 {
		return invalid(op, "headdim", fmt.Sprintf("%d; must be positive", p.HeadDim))
	}
	if p.HeadDim%mergeVectorElems != 0 || p.HeadDim > MaxMergeHeadDim {
		return unsupported(op, "headdim", fmt.Sprintf("%d; supported: multiples of %d from %d to %d", p.HeadDim, mergeVectorElems, mergeVectorElems, MaxMergeHeadDim))
	}
	size := elemSize(p.DType)
	if err := p.checkInput("outs", p.Outs, size, p.HeadDim); err != nil {
		return err
	}
	if err := p.checkInput("lses", p.LSEs, 4, 1); err != nil {
		return err
	}
	if err := p.checkOutput("out", p.Out, size, p.HeadDim, true); err != nil {
		return err
	}
	if err := p.checkOutput("lse", p.LSE, 4, 1, false); err != nil {
		return err
	}
	return p.checkOverlaps(size)
}

// checkOverlaps refuses an out or lse that shares a byte with the states
// or with the other: each row's merge reads every state of that row only,
// so a block writing its row into another row's state would race with it.
func (p *MergeProblem) checkOverlaps(size int) error {
	out := p.outputRange("out", p.Out, size, p.HeadDim)
	lse := p.outputRange("lse", p.LSE, 4, 1)
	if out.overlaps(lse) {
		return invalid(mergeOp, "lse", "shares memory with out")
	}
	for _, in := range [...]struct {
		name      string
		in        MergeInput
		size, col int
	}{{"outs", p.Outs, size, p.HeadDim}, {"lses", p.LSEs, 4, 1}} {
		for s := range in.in.NumPtrs {
			r := p.inputRange(in.name, in.in, s, in.size, in.col)
			for _, o := range [...]byteRange{out, lse} {
				if o.overlaps(r) {
					what := ""
					if in.in.NumPtrs > 1 {
						what = fmt.Sprintf(" (state %d)", s)
					}
					return invalid(mergeOp, o.name, fmt.Sprintf("shares memory with %s%s", in.name, what))
				}
			}
		}
	}
	return nil
}

// lastOffset is the element offset of the last element of rows of cols
// elements over dimensions of the given sizes and strides (Validate has
// kept it within int64).
func lastOffset(sizes []int, strides []int64, cols int) uint64 {
	last := int64(cols - 1)
	for i, n := range sizes {
		last += int64(n-1) * strides[i]
	}
	return uint64(last)
}

// outputRange is the byte range of an output (empty when not wanted).
func (p *MergeProblem) outputRange(name string, out MergeOutput, size, cols int) byteRange {
	return spanOf(name, out.Ptr, lastOffset(p.Rows[:], out.Strides[:], cols)+1, size)
}

// inputRange is the byte range of pointer i of an input: state i's, or
// every state's of a stacked input.
func (p *MergeProblem) inputRange(name string, in MergeInput, i, size, cols int) byteRange {
	last := lastOffset(p.Rows[:], in.Strides[:], cols)
	if in.NumPtrs == 1 {
		last += lastOffset([]int{p.NumStates}, []int64{in.StateStride}, 1)
	}
	return spanOf(name, in.Ptrs[i], last+1, size)
}

// checkInput checks one input of p whose rows hold cols elements of size
// bytes (cols > 1: the rows are loaded 4 elements at a time).
func (p *MergeProblem) checkInput(name string, in MergeInput, size, cols int) error {
	const op = mergeOp
	if (in.NumPtrs != 1 && in.NumPtrs != p.NumStates) || in.NumPtrs > MergePointers {
		return invalid(op, name, fmt.Sprintf("%d pointers for num_states=%d; give 1 (a stacked tensor and a state stride) or one per state, at most %d",
			in.NumPtrs, p.NumStates, MergePointers))
	}
	for s, ptr := range in.Ptrs[:in.NumPtrs] {
		what := ""
		if in.NumPtrs > 1 {
			what = fmt.Sprintf("state %d: ", s)
		}
		if err := checkMergePointer(name, what, ptr, size, cols); err != nil {
			return err
		}
	}
	var sizes []int
	var strides []int64
	if in.NumPtrs == 1 {
		sizes, strides = append(sizes, p.NumStates), append(strides, in.StateStride)
	}
	sizes = append(sizes, p.Rows[:]...)
	strides = append(strides, in.Strides[:]...)
	return checkMergeStrides(name, sizes, strides, cols)
}

// checkOutput checks one output of p, like checkInput; a NULL pointer is
// allowed unless required.
func (p *MergeProblem) checkOutput(name string, out MergeOutput, size, cols int, required bool) error {
	const op = mergeOp
	if out.Ptr == 0 && !required {
		return nil
	}
	if err := checkMergePointer(name, "", out.Ptr, size, cols); err != nil {
		return err
	}
	if err := checkMergeStrides(name, p.Rows[:], out.Strides[:], cols); err != nil {
		return err
	}
	if overlaps([]int{p.Rows[0], p.Rows[1], p.Rows[2], cols}, []int64{out.Strides[0], out.Strides[1], out.Strides[2], 1}) {
		return invalid(op, name, fmt.Sprintf("strides %v make rows overlap", out.Strides))
	}
	return nil
}

// checkMergePointer checks a device address whose rows hold cols elements of
// size bytes: non-null and aligned to the kernel's accesses (4 elements, or
// one element when cols == 1). what prefixes the message ("state 2: ").
func checkMergePointer(name, what string, ptr uintptr, size, cols int) error {
	if ptr == 0 {
		return invalid(mergeOp, name, what+"null device pointer")
	}
	align := uintptr(size)
	if cols > 1 {
		align *= mergeVectorElems
	}
	if ptr%align != 0 {
		if cols == 1 {
			return invalid(mergeOp, name, fmt.Sprintf("%saddress %#x is not %d-byte aligned", what, ptr, align))
		}
		return unsupported(mergeOp, name, fmt.Sprintf("%saddress %#x is not %d-byte aligned; the kernel loads %d elements at a time (a fresh tensor, such as a .clone(), is aligned)", what, ptr, align, mergeVectorElems))
	}
	return nil
}

// checkMergeStrides checks the strides of the dimensions of the given sizes
// (those of size 1 are never used) in front of a contiguous row of cols
// elements: non-negative, multiples of 4 when cols > 1, and element offsets
// that fit in 64 bits.
func checkMergeStrides(name string, sizes []int, strides []int64, cols int) error {
	last := int64(cols - 1)
	for i, st := range strides {
		n := int64(sizes[i] - 1)
		if n == 0 {
			continue
		}
		if st < 0 {
			return invalid(mergeOp, name, fmt.Sprintf("negative stride %d", st))
		}
		if cols > 1 && st%mergeVectorElems != 0 {
			return unsupported(mergeOp, name, fmt.Sprintf("stride %d is not a multiple of %d elements; the kernel loads %d elements at a time", st, mergeVectorElems, mergeVectorElems))
		}
		if st > (math.MaxInt64-last)/n {
			return invalid(mergeOp, name, "strides too large: element offsets overflow 64 bits")
		}
		last += n * st
	}
	return nil
}

// MergeStatesReference merges attention states on the host in float64, as
// the merge kernels do: outs[s] holds state s's normalized outputs (rows x
// headDim, row-major) and lses[s] its rows' natural-log LSEs. With M a row's
// largest LSE, state s weighs w_s = exp(lse_s - M); a state of weight 0 (an
// empty one, lse -inf) is left out whatever its output holds; out = sum w_s
// out_s / sum w_s and lse = M + log(sum w_s). A row whose states are all
// empty gets out = 0 and lse = -inf. It returns out (rows x headDim) and lse
// (rows).
func MergeStatesReference(outs, lses [][]float64, headDim int) (out, lse []float64, err error) {
	const op = "merge_reference"
	if len(outs) < 1 || len(lses) != len(outs) {
		return nil, nil, invalid(op, "lses", fmt.Sprintf("%d outs and %d lses; need the same number, at least 1", len(outs), len(lses)))
	}
	if headDim < 1 {
		return nil, nil, invalid(op, "headdim", fmt.Sprintf("%d; must be positive", headDim))
	}
	rows := len(lses[0])
	for s := range outs {
		if len(lses[s]) != rows || len(outs[s]) != rows*headDim {
			return nil, nil, invalid(op, "outs", fmt.Sprintf("state %d has %d outputs and %d LSEs; want %d and %d", s, len(outs[s]), len(lses[s]), rows*headDim, rows))
		}
	}
	out = make([]float64, rows*headDim)
	lse = make([]float64, rows)
	for r := range rows {
		mx := math.Inf(-1)
		for s := range lses {
			mx = max(mx, lses[s][r])
		}
		if math.IsInf(mx, -1) {
			lse[r] = mx
			continue
		}
		o := out[r*headDim:][:headDim]
		var sum float64
		for s := range lses {
			w := math.Exp(lses[s][r] - mx)
			if w == 0 {
				continue
			}
			sum += w
			for e, x := range outs[s][r*headDim:][:headDim] {
				o[e] += w * x
			}
		}
		for e := range o {
			o[e] /= sum
		}
		lse[r] = mx + math.Log(sum)
	}
	return out, lse, nil
}
