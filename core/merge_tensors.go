package core

import (
	"fmt"
	"reflect"
	"slices"
	"unsafe"
)

// MergeTensor is one tensor of a merge as a framework holds it: its
// descriptor and device address (fd_merge_tensor in C).
type MergeTensor struct {
	Desc TensorDesc `layout:"desc"`
	Data int64      `layout:"data"` // its device address; 0 where a trace only checks
}

// MergeTensorBytes is the size of a MergeTensor record in bytes.
const MergeTensorBytes = int(unsafe.Sizeof(MergeTensor{}))

var mergeTensorFields = recordFields(reflect.TypeOf(MergeTensor{}), "", 0)

// MergeTensorFieldsText names a MergeTensor record's fields as
// LayoutFieldsText does: desc.given, ..., desc.strides[7], data.
func MergeTensorFieldsText() string { return fieldsText(mergeTensorFields) }

// MergeTensors' Flags.
const (
	MergeOutsStacked = 1 << iota // Outs[0] is (num_states, *rows, headdim)
	MergeLSEsStacked             // LSEs[0] is (num_states, *rows)
	MergePair                    // merge_state's two states: named out_a, lse_a, out_b, lse_b
)

// MergeTensors is a merge as merge_states takes it: the states' outputs
// and LSEs, each one stacked tensor or one tensor per state, and the
// results it writes. Problem checks that they agree and derives the
// MergeProblem, joining the row dimensions into the kernel's three.
type MergeTensors struct {
	Outs, LSEs []MergeTensor // one (*rows, headdim) / (*rows) tensor per state, or one stacked (Flags)
	Flags      int64
	Out        MergeTensor // (*rows, headdim) in outs' dtype
	LSE        MergeTensor // (*rows) float32; not given: not wanted
}

// ReadMergeTensors reads a merge from the host memory of its records:
// numOuts outs, numLSEs lses, then out and lse, MergeTensorBytes each
// (8-byte aligned, the host's byte order); the MergeTensors shares it.
func ReadMergeTensors(b []byte, numOuts, numLSEs, flags int64) (MergeTensors, error) {
	n := numOuts + numLSEs + 2
	switch {
	case numOuts < 0 || numLSEs < 0 || numOuts > 1<<20 || numLSEs > 1<<20:
		return MergeTensors{}, invalid(mergeOp, "num_outs", fmt.Sprintf("%d outs and %d lses; counts run from 0 to 2^20", numOuts, numLSEs))
	case int64(len(b)) != n*int64(MergeTensorBytes):
		return MergeTensors{}, invalid(mergeOp, "tensors_size", fmt.Sprintf("%d bytes; %d records of %d bytes (num_outs + num_lses + 2) make %d", len(b), n, MergeTensorBytes, n*int64(MergeTensorBytes)))
	case flags&^(MergeOutsStacked|MergeLSEsStacked|MergePair) != 0:
		return MergeTensors{}, invalid(mergeOp, "flags", fmt.Sprintf("%#x; known: outs stacked 1, lses stacked 2, pair 4", flags))
	case uintptr(unsafe.Pointer(unsafe.SliceData(b)))%8 != 0:
		return MergeTensors{}, invalid(mergeOp, "tensors", "not 8-byte aligned")
	}
	ts := unsafe.Slice((*MergeTensor)(unsafe.Pointer(unsafe.SliceData(b))), n)
	return MergeTensors{Outs: ts[:numOuts], LSEs: ts[numOuts : numOuts+numLSEs], Flags: flags, Out: ts[n-2], LSE: ts[n-1]}, nil
}

// mergeInput is one input of a merge as checked: its tensors, stacked or
// one per state (pair: merge_state's, named a and b).
type mergeInput struct {
	name    string // outs, lses
	pair    [2]string
	ts      []MergeTensor
	stacked int // 1: ts[0] holds every state along its first dimension
}

func (m *MergeTensors) input(name string, ts []MergeTensor, stackedFlag int64, pair [2]string) mergeInput {
	in := mergeInput{name: name, ts: ts}
	if m.Flags&stackedFlag != 0 {
		in.stacked = 1
	} else if m.Flags&MergePair != 0 {
		in.pair = pair
	}
	return in
}

// item names in's tensor i as the caller knows it (made only for an error).
func (in *mergeInput) item(i int) string {
	switch {
	case in.stacked == 1:
		return in.name
	case i < 2 && in.pair[i] != "":
		return in.pair[i]
	}
	return fmt.Sprintf("%s[%d]", in.name, i)
}

func (in *mergeInput) first() *TensorDesc { return &in.ts[0].Desc }

// state returns the shape of one state (outs: with its head dim).
func (in *mergeInput) state() []int64 { d := in.first(); return d.Shape[in.stacked:d.Rank] }

// count returns the number of states in.
func (in *mergeInput) count() int64 {
	if in.stacked == 1 {
		return in.first().Shape[0]
	}
	return int64(len(in.ts))
}

// mergeInput checks an input's items: states held, dtypes, shapes, the
// head dim contiguous (outs), one device. lses (of: outs) have float32
// rows of outs'.
func (c *argCheck) mergeInput(in *mergeInput, of *mergeInput) {
	layout, minRank := "(num_states, *rows, headdim)", 1+in.stacked
	if of != nil {
		layout, minRank = "(num_states, *rows)", in.stacked
	}
	switch {
	case c.err != nil:
		return
	case len(in.ts) == 0:
		c.invalidf(in.name, "must hold at least one state %s, got an empty list", layout)
		return
	case in.stacked == 1 && len(in.ts) != 1:
		c.invalidf(in.name, "%d tensors given as one stacked tensor", len(in.ts))
		return
	}
	for i := range in.ts {
		d := &in.ts[i].Desc
		switch {
		case d.Given != 1:
			c.typef(in.item(i), "must be a tensor, got given=%d", d.Given)
		case d.Rank < 0 || d.Rank > TensorDims || slices.ContainsFunc(d.Shape[:d.Rank], func(n int64) bool { return n < 0 }):
			c.invalidf(in.item(i), "shape %s: at most %d dimensions, none negative", shapeText(d), TensorDims)
		}
	}
	first := in.first()
	switch {
	case c.err != nil:
	case in.stacked == 1 && (first.Rank < int64(minRank) || first.Shape[0] < 1):
		c.invalidf(in.name, "must hold at least one state %s, got shape %s", layout, shapeText(first))
	case first.Rank < int64(minRank):
		c.invalidf(in.item(0), "must have at least 1 dimension (*rows, headdim), got a 0-d tensor")
	case of == nil && MergeKernel(DType(first.DType)) == "":
		c.typef(in.item(0), "must be torch.float16, torch.bfloat16 or torch.float32, got %s", dtypeText(first.DType))
	}
	for i := range in.ts {
		d := &in.ts[i].Desc
		switch {
		case c.err != nil:
			return
		case of == nil && (d.Rank != first.Rank || d.Shape != first.Shape):
			c.invalidf(in.item(i), "must have %s's shape %s, got %s", in.item(0), shapeText(first), shapeText(d))
		case of == nil && d.DType != first.DType:
			c.typef(in.item(i), "must have %s's dtype %s, got %s", in.item(0), dtypeText(first.DType), dtypeText(d.DType))
		case of == nil && d.Shape[d.Rank-1] > 1 && d.Strides[d.Rank-1] != 1:
			c.invalidf(in.item(i), "must be contiguous in its last dimension (headdim), got strides %s", stridesText(d))
		case of != nil && !slices.Equal(d.Shape[in.stacked:d.Rank], of.rows()):
			want := append(d.Shape[:in.stacked:in.stacked], of.rows()...)
			c.invalidf(in.item(i), "must have shape %s to match %s, got %s", tupleText(want), of.item(0), shapeText(d))
		case of != nil && d.DType != int64(Float32):
			c.typef(in.item(i), "must be torch.float32, got %s", dtypeText(d.DType))
		case d.Device != first.Device:
			c.invalidf(in.item(i), "must be on the device of %s, %s, got %s", in.item(0), deviceText(first.Device), deviceText(d.Device))
		}
	}
	if c.err == nil && of != nil && in.count() != of.count() {
		c.invalidf(in.name, "must hold num_states=%d states to match outs, got %d", of.count(), in.count())
	}
}

// tupleText is sizes as Python prints a tuple.
func tupleText(sizes []int64) string {
	d := TensorDesc{Rank: int64(len(sizes))}
	copy(d.Shape[:], sizes)
	return shapeText(&d)
}

// rows returns the row dimensions of outs' states.
func (in *mergeInput) rows() []int64 { s := in.state(); return s[:len(s)-1] }

// stack reports whether a list input cannot go one pointer per state:
// more states than MergePointers, or of several layouts.
func (in *mergeInput) stack() bool {
	if in.stacked == 1 {
		return false
	}
	return len(in.ts) > MergePointers || slices.ContainsFunc(in.ts, func(t MergeTensor) bool { return t.Desc.Strides != in.ts[0].Desc.Strides })
}

// check checks m, and out and lse where given; it returns the inputs and
// which lists must be stacked (MergeOutsStacked, MergeLSEsStacked).
func (m *MergeTensors) check(c *argCheck, onDevice bool) (outs, lses mergeInput, stacks int64) {
	outs = m.input("outs", m.Outs, MergeOutsStacked, [2]string{"out_a", "out_b"})
	lses = m.input("lses", m.LSEs, MergeLSEsStacked, [2]string{"lse_a", "lse_b"})
	c.mergeInput(&outs, nil)
	c.mergeInput(&lses, &outs)
	if c.err != nil {
		return
	}
	o := outs.first()
	if onDevice && o.Device < 0 {
		c.invalidf(outs.item(0), "must be on a CUDA device, got %s", deviceText(o.Device))
	}
	if l := lses.first(); c.err == nil && l.Device != o.Device {
		c.invalidf(lses.item(0), "must be on the device of %s, %s, got %s", outs.item(0), deviceText(o.Device), deviceText(l.Device))
	}
	for _, r := range [...]struct {
		name, dims string
		d          *TensorDesc
		shape      []int64
		dtype      DType
	}{{"out", "(*rows, headdim)", &m.Out.Desc, outs.state(), DType(o.DType)}, {"lse", "(*rows)", &m.LSE.Desc, outs.rows(), Float32}} {
		if c.err != nil || r.d.Given == 0 && (r.name == "lse" || !onDevice) {
			continue
		}
		c.tensor(r.name, r.d, int64(len(r.shape)), r.dims, "", r.dtype)
		switch {
		case c.err != nil:
		case !slices.Equal(r.d.Shape[:r.d.Rank], r.shape):
			c.invalidf(r.name, "must have shape %s, got %s", tupleText(r.shape), shapeText(r.d))
		case r.d.Device != o.Device:
			c.invalidf(r.name, "must be on the device of %s, %s, got %s", outs.item(0), deviceText(o.Device), deviceText(r.d.Device))
		}
	}
	for _, in := range [...]struct {
		in   *mergeInput
		flag int64
	}{{&outs, MergeOutsStacked}, {&lses, MergeLSEsStacked}} {
		if c.err == nil && in.in.stack() {
			stacks |= in.flag
		}
	}
	return outs, lses, stacks
}

// Stacks checks m as Problem does but for the device and the addresses
// (a trace's tensors are on none) and returns which of its lists must be
// stacked for Problem to take them (MergeOutsStacked, MergeLSEsStacked):
// more states than MergePointers, or states of several layouts.
func (m *MergeTensors) Stacks() (int64, error) {
	c := argCheck{op: mergeOp}
	_, _, stacks := m.check(&c, false)
	return stacks, c.err
}

// Problem checks m (names as merge_states and merge_state call their
// arguments) and returns its MergeProblem, which MergeProblem.Validate
// then checks, and the CUDA device of the tensors. A merge of no row or
// element gives a problem of 0 rows: nothing to launch.
func (m *MergeTensors) Problem() (MergeProblem, int, error) {
	c := argCheck{op: mergeOp}
	outs, lses, _ := m.check(&c, true)
	if c.err != nil {
		return MergeProblem{}, 0, c.err
	}
	state := outs.state()
	rows, headDim := outs.rows(), state[len(state)-1]
	p := MergeProblem{DType: DType(outs.first().DType), NumStates: int(outs.count()), HeadDim: int(headDim)}
	device := int(outs.first().Device)
	if slices.Contains(rows, 0) || headDim == 0 {
		return p, device, nil // p.NumRows() == 0
	}
	for _, in := range [...]*mergeInput{&outs, &lses} {
		if in.stack() {
			return MergeProblem{}, 0, unsupported(mergeOp, in.name, fmt.Sprintf("a list of %d states: the kernel takes at most %d, of one layout (strides); stack them", len(in.ts), MergePointers))
		}
	}
	// Row dimensions every tensor steps through as one are joined (size-1 ones dropped).
	sets := [4][]int64{outs.rowStrides(len(rows)), lses.rowStrides(len(rows)), m.Out.Desc.Strides[:len(rows)],
		m.LSE.Desc.Strides[:len(rows)]}
	nsets := 3 + int(min(m.LSE.Desc.Given, 1))
	joined, strides, n := joinRows(rows, sets[:nsets])
	sizes := joined[:n]
	if len(sizes) > MergeRowDims {
		return MergeProblem{}, 0, unsupported(mergeOp, "outs", fmt.Sprintf("with lses: the strides of the %d row dimensions %s do not join into %d; pass contiguous tensors", len(rows), tupleText(rows), MergeRowDims))
	}
	pad := MergeRowDims - len(sizes) // leading dimensions of size 1
	p.Rows = [MergeRowDims]int{1, 1, 1}
	for i, n := range sizes {
		p.Rows[pad+i] = int(n)
	}
	fill := func(dst *[MergeRowDims]int64, k int) {
		*dst = [MergeRowDims]int64{1, 1, 1}
		for i := range sizes {
			dst[pad+i] = strides[i][k]
		}
	}
	for k, in := range [...]*MergeInput{&p.Outs, &p.LSEs} {
		src := [...]*mergeInput{&outs, &lses}[k]
		fill(&in.Strides, k)
		in.NumPtrs = len(src.ts)
		for i, t := range src.ts {
			in.Ptrs[i] = uintptr(t.Data)
		}
		if src.stacked == 1 {
			in.StateStride = src.first().Strides[0]
		}
	}
	p.Out.Ptr = uintptr(m.Out.Data)
	fill(&p.Out.Strides, 2)
	if m.LSE.Desc.Given != 0 {
		p.LSE.Ptr = uintptr(m.LSE.Data)
		fill(&p.LSE.Strides, 3)
	}
	return p, device, nil
}

// rowStrides returns the strides of the n row dimensions of in's states.
func (in *mergeInput) rowStrides(n int) []int64 { return in.first().Strides[in.stacked : in.stacked+n] }

// joinRows drops the dimensions of size 1 (at most TensorDims) and joins
// neighbours that every stride set (of 4 at most) steps through as one; it
// returns the n joined sizes and, per joined dimension, each set's stride.
func joinRows(sizes []int64, sets [][]int64) (ns [TensorDims]int64, sts [TensorDims][4]int64, n int) {
	for i, size := range sizes {
		if size == 1 {
			continue
		}
		var st [4]int64
		for k, s := range sets {
			st[k] = s[i]
		}
		if n > 0 && joins(&sts[n-1], &st, size, len(sets)) {
			ns[n-1], sts[n-1] = ns[n-1]*size, st
			continue
		}
		ns[n], sts[n] = size, st
		n++
	}
	return ns, sts, n
}

// joins reports whether each of the first k sets steps over a whole inner
// dimension of n elements with its outer stride.
func joins(outer, inner *[4]int64, n int64, k int) bool {
	for i := range k {
		if outer[i] != inner[i]*n {
			return false
		}
	}
	return true
}
