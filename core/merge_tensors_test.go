package core

import (
	"errors"
	"strings"
	"testing"
	"unsafe"
)

// mt is a contiguous tensor of shape on CUDA device 0 at data.
func mt(dtype DType, data int64, shape ...int64) MergeTensor {
	d := desc(dtype, shape...)
	return MergeTensor{Desc: d, Data: data}
}

// validMergeTensors is three (2, 3, 8) float16 states as lists, and the results.
func validMergeTensors() MergeTensors {
	m := MergeTensors{Out: mt(Float16, 1<<20, 2, 3, 8), LSE: mt(Float32, 2<<20, 2, 3)}
	for s := range int64(3) {
		m.Outs = append(m.Outs, mt(Float16, (4+s)<<20, 2, 3, 8))
		m.LSEs = append(m.LSEs, mt(Float32, (8+s)<<20, 2, 3))
	}
	return m
}

func TestMergeTensorsProblem(t *testing.T) {
	m := validMergeTensors()
	p, device, err := m.Problem()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	// Rows (2, 3) of contiguous tensors join into one dimension of 6.
	if device != 0 || p.NumStates != 3 || p.Rows != [3]int{1, 1, 6} || p.HeadDim != 8 || p.Outs.NumPtrs != 3 ||
		p.Outs.Strides != [3]int64{1, 1, 8} || p.LSEs.Strides != [3]int64{1, 1, 1} || p.Out.Ptr != 1<<20 {
		t.Errorf("problem %+v on device %d", p, device)
	}

	// flash_decode's out (b, sq, h, d) stacked, and its lse (b, h, sq) read as (b, sq, h).
	m = MergeTensors{Flags: MergeOutsStacked | MergeLSEsStacked, Out: mt(BFloat16, 1<<20, 2, 3, 4, 64),
		Outs: []MergeTensor{mt(BFloat16, 2<<20, 5, 2, 3, 4, 64)}, LSEs: []MergeTensor{mt(Float32, 3<<20, 5, 2, 4, 3)}}
	m.LSEs[0].Desc.Shape = [TensorDims]int64{5, 2, 3, 4}
	m.LSEs[0].Desc.Strides = [TensorDims]int64{24, 12, 1, 3}
	p, _, err = m.Problem()
	if err != nil {
		t.Fatal(err)
	}
	if p.Rows != [3]int{2, 3, 4} || p.Outs.NumPtrs != 1 || p.Outs.StateStride != 2*3*4*64 || p.LSEs.StateStride != 24 ||
		p.LSEs.Strides != [3]int64{12, 1, 3} || p.LSE.Ptr != 0 {
		t.Errorf("stacked problem %+v", p)
	}

	// No row: nothing to launch.
	m = validMergeTensors()
	for i := range m.Outs {
		m.Outs[i].Desc.Shape[0], m.LSEs[i].Desc.Shape[0] = 0, 0
	}
	m.Out.Desc.Shape[0], m.LSE.Desc.Shape[0] = 0, 0
	if p, _, err := m.Problem(); err != nil || p.NumRows() != 0 {
		t.Errorf("empty merge: %v, %d rows", err, p.NumRows())
	}
}

func TestMergeTensorsStacks(t *testing.T) {
	m := validMergeTensors()
	m.Outs[1].Desc.Strides = [TensorDims]int64{8, 16, 1}
	if s, err := m.Stacks(); err != nil || s != MergeOutsStacked {
		t.Errorf("strides differ: %d, %v", s, err)
	}
	if _, _, err := m.Problem(); !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "outs: not supported: a list of 3 states") {
		t.Errorf("Problem: %v", err)
	}
	m = validMergeTensors()
	for s := range int64(7) { // 10 states
		m.Outs, m.LSEs = append(m.Outs, mt(Float16, (16+s)<<20, 2, 3, 8)), append(m.LSEs, mt(Float32, (32+s)<<20, 2, 3))
	}
	if s, err := m.Stacks(); err != nil || s != MergeOutsStacked|MergeLSEsStacked {
		t.Errorf("10 states: %d, %v", s, err)
	}
	m.LSEs[9].Desc.DType = int64(Float16) // an error comes first
	if s, err := m.Stacks(); err == nil || s != 0 {
		t.Errorf("10 states, lses[9] float16: %d, %v", s, err)
	}
}

func TestMergeTensorsErrors(t *testing.T) {
	cases := []struct {
		name   string
		mutate func(*MergeTensors)
		arg    string
		kind   error
		want   string
	}{
		{"no states", func(m *MergeTensors) { m.Outs = nil }, "outs", ErrInvalid, "must hold at least one state"},
		{"stacked none", func(m *MergeTensors) {
			m.Flags, m.Outs = MergeOutsStacked, []MergeTensor{mt(Float16, 1<<24, 0, 2, 3, 8)}
		}, "outs", ErrInvalid, "got shape (0, 2, 3, 8)"},
		{"0-d", func(m *MergeTensors) { m.Outs[0].Desc.Rank = 0 }, "outs[0]", ErrInvalid, "at least 1 dimension"},
		{"float64", func(m *MergeTensors) {
			for i := range m.Outs {
				m.Outs[i].Desc.DType = int64(Float64)
			}
		}, "outs[0]", ErrType, "must be torch.float16, torch.bfloat16 or torch.float32, got torch.float64"},
		{"item shape", func(m *MergeTensors) { m.Outs[1].Desc.Shape[0] = 1 }, "outs[1]", ErrInvalid, "must have outs[0]'s shape (2, 3, 8), got (1, 3, 8)"},
		{"item dtype", func(m *MergeTensors) { m.Outs[2].Desc.DType = int64(Float32) }, "outs[2]", ErrType, "must have outs[0]'s dtype torch.float16"},
		{"head dim strided", func(m *MergeTensors) { m.Outs[0].Desc.Strides[2] = 2 }, "outs[0]", ErrInvalid, "contiguous in its last dimension"},
		{"item device", func(m *MergeTensors) { m.Outs[1].Desc.Device = -1 }, "outs[1]", ErrInvalid, "must be on the device of outs[0], cuda:0"},
		{"lses rows", func(m *MergeTensors) { m.LSEs[2].Desc.Shape[1] = 2 }, "lses[2]", ErrInvalid, "must have shape (2, 3) to match outs[0], got (2, 2)"},
		{"lses float16", func(m *MergeTensors) { m.LSEs[0].Desc.DType = int64(Float16) }, "lses[0]", ErrType, "must be torch.float32, got torch.float16"},
		{"lses count", func(m *MergeTensors) { m.LSEs = m.LSEs[:2] }, "lses", ErrInvalid, "must hold num_states=3 states to match outs, got 2"},
		{"on the host", func(m *MergeTensors) {
			for i := range m.Outs {
				m.Outs[i].Desc.Device, m.LSEs[i].Desc.Device = -1, -1
			}
		}, "outs[0]", ErrInvalid, "must be on a CUDA device"},
		{"lses elsewhere", func(m *MergeTensors) {
			for i := range m.LSEs {
				m.LSEs[i].Desc.Device = 1
			}
		}, "lses[0]", ErrInvalid, "must be on the device of outs[0], cuda:0, got cuda:1"},
		{"out dtype", func(m *MergeTensors) { m.Out.Desc.DType = int64(Float32) }, "out", ErrType, "torch.float16"},
		{"out shape", func(m *MergeTensors) { m.Out.Desc.Shape[2] = 4 }, "out", ErrInvalid, "must have shape (2, 3, 8)"},
		{"out missing", func(m *MergeTensors) { m.Out = MergeTensor{} }, "out", ErrType, "must be a tensor"},
		{"lse shape", func(m *MergeTensors) { m.LSE.Desc.Rank = 1 }, "lse", ErrInvalid, "must have 2 dimensions"},
		{"pair", func(m *MergeTensors) {
			m.Flags, m.Outs, m.LSEs = MergePair, m.Outs[:2], m.LSEs[:2]
			m.LSEs[1].Desc.DType = int64(Float64)
		}, "lse_b", ErrType, "must be torch.float32"},
		{"rows do not join", func(m *MergeTensors) {
			m.Flags = MergeOutsStacked | MergeLSEsStacked
			m.Outs = []MergeTensor{mt(Float32, 1<<24, 2, 2, 3, 4, 5, 8)}
			m.Outs[0].Desc.Strides = [TensorDims]int64{10000, 3000, 700, 100, 16, 1}
			m.LSEs = []MergeTensor{mt(Float32, 2<<24, 2, 2, 3, 4, 5)}
			m.Out, m.LSE = mt(Float32, 3<<24, 2, 3, 4, 5, 8), mt(Float32, 4<<24, 2, 3, 4, 5)
		}, "outs", ErrUnsupported, "with lses: the strides of the 4 row dimensions (2, 3, 4, 5) do not join into 3"},
	}
	for _, tc := range cases {
		m := validMergeTensors()
		tc.mutate(&m)
		_, _, err := m.Problem()
		var e *Error
		if !errors.As(err, &e) || e.Arg != tc.arg || !errors.Is(err, tc.kind) || !strings.Contains(e.Msg, tc.want) {
			t.Errorf("%s: %v; want %s: %v: ...%s...", tc.name, err, tc.arg, tc.kind, tc.want)
		}
	}
}

func TestReadMergeTensors(t *testing.T) {
	recs := []MergeTensor{mt(Float16, 1<<20, 2, 8), mt(Float32, 2<<20, 2), mt(Float16, 3<<20, 2, 8), {}}
	b := unsafe.Slice((*byte)(unsafe.Pointer(&recs[0])), len(recs)*MergeTensorBytes)
	m, err := ReadMergeTensors(b, 1, 1, 0)
	if err != nil || len(m.Outs) != 1 || len(m.LSEs) != 1 || m.Out.Data != 3<<20 || m.LSE.Desc.Given != 0 {
		t.Fatalf("%+v, %v", m, err)
	}
	if _, err := ReadMergeTensors(b, 2, 1, 0); err == nil || !strings.Contains(err.Error(), "tensors_size") {
		t.Errorf("a record short: %v", err)
	}
	if _, err := ReadMergeTensors(b, 1, 1, 8); err == nil || !strings.Contains(err.Error(), "flags") {
		t.Errorf("flag 8: %v", err)
	}
	if text := MergeTensorFieldsText(); !strings.HasPrefix(text, "desc.given:q,desc.dtype:q,") || !strings.HasSuffix(text, ",desc.strides[7]:q,data:q") {
		t.Errorf("MergeTensorFieldsText() = %q", text)
	}
}

// A good merge is checked without allocating.
func TestMergeTensorsProblemAllocates(t *testing.T) {
	m := validMergeTensors()
	if n := testing.AllocsPerRun(100, func() { _, _, _ = m.Problem() }); n != 0 {
		t.Errorf("Problem allocates %v times", n)
	}
}
