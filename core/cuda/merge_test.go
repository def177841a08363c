package cuda

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/flash-decode/flash-decode/core"
	"gorgonia.org/cu"
)

// A merge the host can check without a device: 2 stacked fp32 states of 4
// rows of head dim 8, at made-up (aligned) addresses.
func fakeMerge() core.MergeProblem {
	return core.MergeProblem{DType: core.Float32, NumStates: 2, Rows: [3]int{1, 1, 4}, HeadDim: 8,
		Outs: core.MergeInput{Ptrs: [core.MergePointers]uintptr{1 << 20}, NumPtrs: 1, StateStride: 32, Strides: [3]int64{0, 0, 8}},
		LSEs: core.MergeInput{Ptrs: [core.MergePointers]uintptr{2 << 20}, NumPtrs: 1, StateStride: 4, Strides: [3]int64{0, 0, 1}},
		Out:  core.MergeOutput{Ptr: 3 << 20, Strides: [3]int64{0, 0, 8}},
	}
}

func TestMergeStatesChecksBeforeTheDevice(t *testing.T) {
	p := fakeMerge()
	p.HeadDim = 6
	if err := MergeStates(&p, 0, 0); !errors.Is(err, core.ErrUnsupported) {
		t.Errorf("head dim 6: %v, want ErrUnsupported", err)
	}
	p = fakeMerge()
	p.Outs.Ptrs[0] = 0
	var e *core.Error
	if err := MergeStates(&p, 0, 0); !errors.As(err, &e) || e.Arg != "outs" || !errors.Is(err, core.ErrInvalid) {
		t.Errorf("null outs: %v, want ErrInvalid naming outs", err)
	}
	p = fakeMerge()
	for _, dev := range []int{-1, maxDevices} {
		if err := MergeStates(&p, dev, 0); !errors.As(err, &e) || e.Arg != "device" {
			t.Errorf("device %d: %v, want an error naming device", dev, err)
		}
	}
	if n, err := cu.NumDevices(); err == nil && n == 0 {
		// No GPU (the stand-in driver): a valid merge fails on the device, without a crash.
		if err := MergeStates(&p, 0, 0); err == nil {
			t.Error("merge on a machine without a device succeeded")
		}
	}
}

// mergeCase is a merge on the GPU against core.MergeStatesReference.
type mergeCase struct {
	name    string
	dtype   core.DType
	states  int
	rows    [3]int
	headDim int
	list    bool // one pointer per state (else stacked)
	lseT    bool // the LSEs stored with their last two row dimensions swapped
	padOut  int  // extra elements between out rows
	noLSE   bool // no lse output
}

func TestMergeStatesMatchesReference(t *testing.T) {
	gpu(t)
	var tests []mergeCase
	for _, dt := range []core.DType{core.Float16, core.BFloat16, core.Float32} {
		name := map[core.DType]string{core.Float16: "fp16", core.BFloat16: "bf16", core.Float32: "fp32"}[dt]
		for _, n := range []int{1, 2, 3, 7, 20, 130} {
			tests = append(tests, mergeCase{name: fmt.Sprintf("%s %d stacked", name, n), dtype: dt, states: n, rows: [3]int{2, 3, 5}, headDim: 128})
			if n <= core.MergePointers {
				tests = append(tests, mergeCase{name: fmt.Sprintf("%s %d list lse transposed", name, n), dtype: dt, states: n, rows: [3]int{2, 3, 5}, headDim: 64, list: true, lseT: true})
			}
		}
		tests = append(tests,
			mergeCase{name: name + " 9 d256 padded out", dtype: dt, states: 9, rows: [3]int{1, 4, 3}, headDim: 256, padOut: 12, lseT: true},
			mergeCase{name: name + " 3 d4 one row dim", dtype: dt, states: 3, rows: [3]int{1, 1, 77}, headDim: 4},
			mergeCase{name: name + " 2 d100 no lse", dtype: dt, states: 2, rows: [3]int{3, 1, 2}, headDim: 100, list: true, noLSE: true})
	}
	r := rand.New(rand.NewPCG(5, 6))
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			gpu(t)
			runMergeCase(t, r, tc)
		})
	}
}

func runMergeCase(t *testing.T, r *rand.Rand, tc mergeCase) {
	R0, R1, R2 := tc.rows[0], tc.rows[1], tc.rows[2]
	rows, d := R0*R1*R2, tc.headDim
	// Host states, row-major (rows, d): outputs exact in every dtype, LSEs
	// spread over a range wide enough for weights to differ by e^30. State 1
	// is empty (LSE -inf, its output NaN: it must weigh nothing); row 0 is
	// empty in every state.
	outs, lses := make([][]float64, tc.states), make([][]float64, tc.states)
	hostOuts := make([][]float32, tc.states)
	for s := range outs {
		hostOuts[s] = randomExact(r, rows*d)
		outs[s], lses[s] = make([]float64, rows*d), make([]float64, rows)
		for i, x := range hostOuts[s] {
			outs[s][i] = float64(x)
		}
		for i := range lses[s] {
			lses[s][i] = float64(float32(r.NormFloat64() * 10))
			if i == 0 || (s == 1 && tc.states > 1) {
				lses[s][i] = math.Inf(-1)
			}
		}
	}
	want, wantLSE, err := core.MergeStatesReference(outs, lses, d)
	if err != nil {
		t.Fatal(err)
	}
	if tc.states > 1 {
		for i := range hostOuts[1] {
			hostOuts[1][i] = float32(math.NaN())
		}
	}

	// The LSEs of state s, (R0, R1, R2) or stored (R0, R2, R1) with lseT.
	lseStrides := [3]int64{int64(R1 * R2), int64(R2), 1}
	if tc.lseT {
		lseStrides = [3]int64{int64(R1 * R2), 1, int64(R1)}
	}
	storedLSE := func(s int) []float32 {
		x := make([]float32, rows)
		for i0 := range R0 {
			for i1 := range R1 {
				for i2 := range R2 {
					x[int64(i0)*lseStrides[0]+int64(i1)*lseStrides[1]+int64(i2)*lseStrides[2]] = float32(lses[s][(i0*R1+i1)*R2+i2])
				}
			}
		}
		return x
	}
	p := core.MergeProblem{DType: tc.dtype, NumStates: tc.states, Rows: tc.rows, HeadDim: d}
	p.Outs.Strides = [3]int64{int64(R1 * R2 * d), int64(R2 * d), int64(d)}
	p.LSEs.Strides = lseStrides
	if tc.list {
		p.Outs.NumPtrs, p.LSEs.NumPtrs = tc.states, tc.states
		for s := range tc.states {
			p.Outs.Ptrs[s] = uploadMerge(t, tc.dtype, hostOuts[s])
			p.LSEs.Ptrs[s] = uintptr(upload(t, storedLSE(s)))
		}
	} else {
		var allOuts, allLSEs []float32
		for s := range tc.states {
			allOuts, allLSEs = append(allOuts, hostOuts[s]...), append(allLSEs, storedLSE(s)...)
		}
		p.Outs.NumPtrs, p.Outs.StateStride, p.Outs.Ptrs[0] = 1, int64(rows*d), uploadMerge(t, tc.dtype, allOuts)
		p.LSEs.NumPtrs, p.LSEs.StateStride, p.LSEs.Ptrs[0] = 1, int64(rows), uintptr(upload(t, allLSEs))
	}
	rowStride := d + tc.padOut
	p.Out.Strides = [3]int64{int64(R1 * R2 * rowStride), int64(R2 * rowStride), int64(rowStride)}
	outBytes := rows * rowStride * mergeSize(tc.dtype)
	p.Out.Ptr = uintptr(upload(t, make([]byte, outBytes)))
	if err := cu.MemsetD8(cu.DevicePtr(p.Out.Ptr), 0xff, int64(outBytes)); err != nil { // NaN: unwritten
		t.Fatal(err)
	}
	if !tc.noLSE {
		p.LSE.Ptr = uintptr(upload(t, make([]float32, rows)))
		p.LSE.Strides = [3]int64{int64(R1 * R2), int64(R2), 1}
	}
	if l := p.Launch(); l.Grid != rows || l.Threads != 32*min(max((tc.states+7)/8, 1), 16) {
		t.Fatalf("launch %+v", l)
	}
	if err := MergeStates(&p, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := cu.Synchronize(); err != nil {
		t.Fatal(err)
	}

	got := downloadMerge(t, tc.dtype, p.Out.Ptr, rows*rowStride)
	tol := map[core.DType]float64{core.Float32: 1e-5, core.Float16: 2e-3, core.BFloat16: 1.6e-2}[tc.dtype]
	for row := range rows {
		for e := range d {
			g, w := float64(got[row*rowStride+e]), want[row*d+e]
			if !(math.Abs(g-w) <= tol) {
				t.Fatalf("out[%d][%d] = %v, want %v", row, e, g, w)
			}
		}
	}
	if tc.noLSE {
		return
	}
	lse := make([]float32, rows)
	download(t, cu.DevicePtr(p.LSE.Ptr), lse)
	for i, g := range lse {
		w := wantLSE[i]
		if math.IsInf(w, -1) != math.IsInf(float64(g), -1) || (!math.IsInf(w, -1) && !(math.Abs(float64(g)-w) <= 1e-5*max(1, math.Abs(w)))) {
			t.Fatalf("lse[%d] = %v, want %v", i, g, w)
		}
	}
}

func mergeSize(dt core.DType) int {
	if dt == core.Float32 {
		return 4
	}
	return 2
}

// uploadMerge copies x to the device in dtype dt (values exact in fp16 and
// bf16, or NaN).
func uploadMerge(t *testing.T, dt core.DType, x []float32) uintptr {
	t.Helper()
	if dt == core.Float32 {
		return uintptr(upload(t, x))
	}
	bits := encode(dt, x)
	for i, v := range x {
		if math.IsNaN(float64(v)) {
			bits[i] = map[core.DType]uint16{core.Float16: 0x7e00, core.BFloat16: 0x7fc0}[dt]
		}
	}
	return uintptr(upload(t, bits))
}

// downloadMerge copies n elements of dtype dt back as float32.
func downloadMerge(t *testing.T, dt core.DType, ptr uintptr, n int) []float32 {
	t.Helper()
	if dt == core.Float32 {
		x := make([]float32, n)
		download(t, cu.DevicePtr(ptr), x)
		return x
	}
	bits := make([]uint16, n)
	download(t, cu.DevicePtr(ptr), bits)
	return decode(dt, bits)
}
