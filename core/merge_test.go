package core

import (
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

// validMerge is a good merge of 3 stacked fp16 states of (2, 5, 8) rows of
// head dim 64, out and lse contiguous.
func validMerge() MergeProblem { return validMergeD(64) }

// validMergeD is validMerge with head dim d.
func validMergeD(d int64) MergeProblem {
	const rows = 2 * 5 * 8
	return MergeProblem{
		DType: Float16, NumStates: 3, Rows: [3]int{2, 5, 8}, HeadDim: int(d),
		Outs: MergeInput{Ptrs: [MergePointers]uintptr{1 << 20}, NumPtrs: 1, StateStride: rows * d, Strides: [3]int64{5 * 8 * d, 8 * d, d}},
		LSEs: MergeInput{Ptrs: [MergePointers]uintptr{2 << 20}, NumPtrs: 1, StateStride: rows, Strides: [3]int64{5 * 8, 8, 1}},
		Out:  MergeOutput{Ptr: 3 << 20, Strides: [3]int64{5 * 8 * d, 8 * d, d}},
		LSE:  MergeOutput{Ptr: 4 << 20, Strides: [3]int64{5 * 8, 8, 1}},
	}
}

func TestMergeProblemValidate(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(p *MergeProblem)
		want   error  // nil: valid
		arg    string // the argument the error names
	}{
		{"valid stacked", func(p *MergeProblem) {}, nil, ""},
		{"valid list", func(p *MergeProblem) {
			p.Outs.NumPtrs, p.Outs.Ptrs[1], p.Outs.Ptrs[2], p.Outs.StateStride = 3, 5<<20, 6<<20, 0
			p.LSEs.NumPtrs, p.LSEs.Ptrs[1], p.LSEs.Ptrs[2], p.LSEs.StateStride = 3, 7<<20+4, 8<<20+8, -1
		}, nil, ""},
		{"valid fp32", func(p *MergeProblem) { p.DType = Float32 }, nil, ""},
		{"valid bf16", func(p *MergeProblem) { p.DType = BFloat16 }, nil, ""},
		{"valid no lse", func(p *MergeProblem) { p.LSE = MergeOutput{} }, nil, ""},
		// flash_decode's lse (b, h, sq) seen as (b, sq, h).
		{"valid transposed lse", func(p *MergeProblem) { p.LSEs.Strides = [3]int64{5 * 8, 1, 5} }, nil, ""},
		{"valid broadcast state", func(p *MergeProblem) { p.Outs.StateStride, p.LSEs.StateStride = 0, 0 }, nil, ""},
		{"valid one state", func(p *MergeProblem) { p.NumStates, p.Outs.StateStride = 1, -5 }, nil, ""},
		{"valid size-1 dims ignore strides", func(p *MergeProblem) {
			p.Rows = [3]int{1, 1, 8}
			p.Outs.Strides[0], p.Out.Strides[1], p.LSEs.Strides[0], p.LSE.Strides[1] = -3, 0, -1, 0
		}, nil, ""},
		{"valid head dim 4", func(p *MergeProblem) { p.HeadDim = 4 }, nil, ""},
		{"valid head dim 100", func(p *MergeProblem) { *p = validMergeD(100) }, nil, ""},
		{"valid head dim 256", func(p *MergeProblem) { *p = validMergeD(256) }, nil, ""},
		{"head dim past the row stride", func(p *MergeProblem) { p.HeadDim = 128 }, ErrInvalid, "out"},
		{"valid 8-byte aligned fp16", func(p *MergeProblem) { p.Outs.Ptrs[0] += 8; p.Out.Ptr += 8 }, nil, ""},

		{"dtype 0", func(p *MergeProblem) { p.DType = 0 }, ErrUnsupported, "dtype"},
		{"dtype 7", func(p *MergeProblem) { p.DType = 7 }, ErrUnsupported, "dtype"},
		{"no states", func(p *MergeProblem) { p.NumStates = 0 }, ErrInvalid, "num_states"},
		{"row size 0", func(p *MergeProblem) { p.Rows[1] = 0 }, ErrInvalid, "rows"},
		{"row size negative", func(p *MergeProblem) { p.Rows[2] = -1 }, ErrInvalid, "rows"},
		{"too many rows", func(p *MergeProblem) { p.Rows = [3]int{1 << 16, 1 << 16, 1} }, ErrUnsupported, "rows"},
		{"head dim 0", func(p *MergeProblem) { p.HeadDim = 0 }, ErrInvalid, "headdim"},
		{"head dim 6", func(p *MergeProblem) { p.HeadDim = 6 }, ErrUnsupported, "headdim"},
		{"head dim 260", func(p *MergeProblem) { p.HeadDim = 260 }, ErrUnsupported, "headdim"},
		{"outs null", func(p *MergeProblem) { p.Outs.Ptrs[0] = 0 }, ErrInvalid, "outs"},
		{"outs no pointers", func(p *MergeProblem) { p.Outs.NumPtrs = 0 }, ErrInvalid, "outs"},
		{"outs 2 pointers for 3 states", func(p *MergeProblem) { p.Outs.NumPtrs, p.Outs.Ptrs[1] = 2, 5<<20 }, ErrInvalid, "outs"},
		{"outs 9 pointers", func(p *MergeProblem) { p.NumStates, p.Outs.NumPtrs = 9, 9 }, ErrInvalid, "outs"},
		{"outs list state null", func(p *MergeProblem) { p.Outs.NumPtrs, p.Outs.Ptrs[1] = 3, 5<<20 }, ErrInvalid, "outs"},
		{"outs misaligned fp16", func(p *MergeProblem) { p.Outs.Ptrs[0] += 4 }, ErrUnsupported, "outs"},
		{"outs misaligned fp32", func(p *MergeProblem) { p.DType = Float32; p.Outs.Ptrs[0] += 8 }, ErrUnsupported, "outs"},
		{"outs state stride odd", func(p *MergeProblem) { p.Outs.StateStride += 2 }, ErrUnsupported, "outs"},
		{"outs row stride odd", func(p *MergeProblem) { p.Outs.Strides[1] = 66 }, ErrUnsupported, "outs"},
		{"outs negative stride", func(p *MergeProblem) { p.Outs.Strides[0] = -64 }, ErrInvalid, "outs"},
		{"outs offsets overflow", func(p *MergeProblem) { p.Outs.StateStride = math.MaxInt64 / 2 &^ 3 }, ErrInvalid, "outs"},
		{"lses null", func(p *MergeProblem) { p.LSEs.Ptrs[0] = 0 }, ErrInvalid, "lses"},
		{"lses misaligned", func(p *MergeProblem) { p.LSEs.Ptrs[0] += 2 }, ErrInvalid, "lses"},
		{"lses negative stride", func(p *MergeProblem) { p.LSEs.Strides[2] = -1 }, ErrInvalid, "lses"},
		{"lses negative state stride", func(p *MergeProblem) { p.LSEs.StateStride = -1 }, ErrInvalid, "lses"},
		{"lses list of 2", func(p *MergeProblem) { p.LSEs.NumPtrs = 2 }, ErrInvalid, "lses"},
		{"out null", func(p *MergeProblem) { p.Out.Ptr = 0 }, ErrInvalid, "out"},
		{"out misaligned", func(p *MergeProblem) { p.Out.Ptr += 2 }, ErrUnsupported, "out"},
		{"out rows overlap", func(p *MergeProblem) { p.Out.Strides[2] = 32 }, ErrInvalid, "out"},
		{"out broadcast", func(p *MergeProblem) { p.Out.Strides[0] = 0 }, ErrInvalid, "out"},
		{"out stride odd", func(p *MergeProblem) { p.Out.Strides[0] = 5*8*64 + 2 }, ErrUnsupported, "out"},
		{"lse misaligned", func(p *MergeProblem) { p.LSE.Ptr += 1 }, ErrInvalid, "lse"},
		{"lse overlap", func(p *MergeProblem) { p.LSE.Strides = [3]int64{8, 1, 1} }, ErrInvalid, "lse"},
		{"lse negative", func(p *MergeProblem) { p.LSE.Strides[0] = -40 }, ErrInvalid, "lse"},
		// What the merge writes shares no byte with what it reads, or with the other output.
		{"out inside outs", func(p *MergeProblem) { p.Out.Ptr = 1<<20 + 64 }, ErrInvalid, "out"},
		{"out right after outs", func(p *MergeProblem) { p.Out.Ptr = 1<<20 + 3*80*64*2 }, nil, ""},
		{"lse on the lses", func(p *MergeProblem) { p.LSE.Ptr = 2 << 20 }, ErrInvalid, "lse"},
		{"lse inside out", func(p *MergeProblem) { p.LSE.Ptr = 3<<20 + 4 }, ErrInvalid, "lse"},
		{"out over list state 2", func(p *MergeProblem) {
			p.Outs.NumPtrs, p.Outs.Ptrs[1], p.Outs.Ptrs[2], p.Outs.StateStride = 3, 5<<20, 6<<20, 0
			p.Out.Ptr = 6<<20 + 128
		}, ErrInvalid, "out"},
		{"out over broadcast outs", func(p *MergeProblem) { p.Outs.StateStride, p.Out.Ptr = 0, 1<<20+80*64*2-8 }, ErrInvalid, "out"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := validMerge()
			tc.mutate(&p)
			err := p.Validate()
			if tc.want == nil {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			var e *Error
			if !errors.Is(err, tc.want) || !errors.As(err, &e) || e.Arg != tc.arg || e.Op != "merge_states" {
				t.Fatalf("Validate: %v; want %v naming %q", err, tc.want, tc.arg)
			}
		})
	}
	if err := (*MergeProblem)(nil).Validate(); !errors.Is(err, ErrInvalid) {
		t.Errorf("nil problem: %v", err)
	}
}

func TestMergeListErrorNamesState(t *testing.T) {
	p := validMerge()
	p.Outs.NumPtrs, p.Outs.Ptrs[1], p.Outs.Ptrs[2] = 3, 5<<20, 6<<20+4
	err := p.Validate()
	if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "outs: not supported: state 2: address 0x600004") {
		t.Fatalf("misaligned third state: %v", err)
	}
}

func TestMergeLaunch(t *testing.T) {
	tests := []struct {
		dtype          DType
		states         int
		kernel         string
		threads, bytes int
	}{
		{Float16, 1, "fd_merge_states_f16", 32, 0},
		{BFloat16, 2, "fd_merge_states_bf16", 32, 0},
		{Float32, 8, "fd_merge_states_f32", 32, 0},
		{Float16, 9, "fd_merge_states_f16", 64, 1032},
		{Float16, 20, "fd_merge_states_f16", 96, 2 * 1032},
		{Float16, 128, "fd_merge_states_f16", 512, 15 * 1032},
		{Float16, 129, "fd_merge_states_f16", 512, 15 * 1032},
		{Float16, 100000, "fd_merge_states_f16", 512, 15 * 1032},
	}
	for _, tc := range tests {
		p := validMerge()
		p.DType, p.NumStates = tc.dtype, tc.states
		p.Outs.StateStride, p.LSEs.StateStride = 0, 0 // every state at one address: no span reaches out
		if err := p.Validate(); err != nil {
			t.Fatal(err)
		}
		got := p.Launch()
		want := MergeLaunch{Kernel: tc.kernel, Grid: 80, Threads: tc.threads, SharedBytes: tc.bytes}
		if got != want {
			t.Errorf("%v, %d states: %+v, want %+v", tc.dtype, tc.states, got, want)
		}
	}
	if MergeKernel(7) != "" {
		t.Errorf("MergeKernel(7) = %q", MergeKernel(7))
	}
}

// softmaxAttention is one query row's attention over keys, in float64: its
// output and natural-log LSE (0 and -inf without keys).
func softmaxAttention(q []float64, keys, values [][]float64) ([]float64, float64) {
	out := make([]float64, len(q))
	if len(keys) == 0 {
		return out, math.Inf(-1)
	}
	scores := make([]float64, len(keys))
	mx := math.Inf(-1)
	for j, k := range keys {
		for e := range q {
			scores[j] += q[e] * k[e]
		}
		mx = max(mx, scores[j])
	}
	var sum float64
	for j, s := range scores {
		p := math.Exp(s - mx)
		sum += p
		for e := range out {
			out[e] += p * values[j][e]
		}
	}
	for e := range out {
		out[e] /= sum
	}
	return out, mx + math.Log(sum)
}

// TestMergeStatesReferenceMatchesSoftmax splits each row's keys into chunks
// (some empty, some rows without any key), takes the attention over each
// chunk as a state and checks that merging them gives the attention over
// all the keys at once.
func TestMergeStatesReferenceMatchesSoftmax(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	const rows, d = 6, 12
	for _, states := range []int{1, 2, 3, 7, 20} {
		outs, lses := make([][]float64, states), make([][]float64, states)
		for s := range outs {
			outs[s], lses[s] = make([]float64, rows*d), make([]float64, rows)
		}
		want, wantLSE := make([]float64, rows*d), make([]float64, rows)
		for row := range rows {
			q := randomVector(r, d, 2)
			var allK, allV [][]float64
			for s := range states {
				n := r.IntN(5) // chunk sizes 0..4
				if row == 0 {
					n = 0 // a row without any key
				}
				if row == 1 && s > 0 {
					n = 0 // a row whose keys are all in the first state
				}
				var keys, values [][]float64
				for range n {
					keys, values = append(keys, randomVector(r, d, 2)), append(values, randomVector(r, d, 1))
				}
				o, l := softmaxAttention(q, keys, values)
				if n == 0 && s%2 == 1 {
					o[0] = math.NaN() // an empty state's output weighs nothing, whatever it holds
				}
				copy(outs[s][row*d:], o)
				lses[s][row] = l
				allK, allV = append(allK, keys...), append(allV, values...)
			}
			o, l := softmaxAttention(q, allK, allV)
			copy(want[row*d:], o)
			wantLSE[row] = l
		}
		got, gotLSE, err := MergeStatesReference(outs, lses, d)
		if err != nil {
			t.Fatal(err)
		}
		for i := range want {
			if !(math.Abs(got[i]-want[i]) <= 1e-12) {
				t.Fatalf("%d states: out[%d] = %v, want %v", states, i, got[i], want[i])
			}
		}
		for i := range wantLSE {
			w := wantLSE[i]
			if math.IsInf(w, -1) != math.IsInf(gotLSE[i], -1) || (!math.IsInf(w, -1) && !(math.Abs(gotLSE[i]-w) <= 1e-12)) {
				t.Fatalf("%d states: lse[%d] = %v, want %v", states, i, gotLSE[i], w)
			}
		}
		if !math.IsInf(gotLSE[0], -1) || got[0] != 0 {
			t.Fatalf("%d states: a row without keys: lse %v, out[0] %v; want -inf and 0", states, gotLSE[0], got[0])
		}
	}
}

func randomVector(r *rand.Rand, n int, scale float64) []float64 {
	x := make([]float64, n)
	for i := range x {
		x[i] = scale * r.NormFloat64()
	}
	return x
}

func TestMergeStatesReferenceErrors(t *testing.T) {
	ok := [][]float64{make([]float64, 8)}
	tests := []struct {
		name       string
		outs, lses [][]float64
		d          int
		arg        string
	}{
		{"no states", nil, nil, 4, "lses"},
		{"state counts differ", ok, nil, 4, "lses"},
		{"head dim 0", ok, [][]float64{{0, 0}}, 0, "headdim"},
		{"sizes differ", [][]float64{make([]float64, 8), make([]float64, 4)}, [][]float64{{0, 0}, {0, 0}}, 4, "outs"},
	}
	for _, tc := range tests {
		_, _, err := MergeStatesReference(tc.outs, tc.lses, tc.d)
		var e *Error
		if !errors.Is(err, ErrInvalid) || !errors.As(err, &e) || e.Arg != tc.arg {
			t.Errorf("%s: %v; want ErrInvalid naming %s", tc.name, err, tc.arg)
		}
	}
}
