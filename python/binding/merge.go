package binding

import (
	"unsafe"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// MergeTensorFields returns the fields of a merge's tensor record
// (core.MergeTensor) as LayoutFields does.
func MergeTensorFields() (fields string) {
	defer recoverText(&fields)
	return core.MergeTensorFieldsText()
}

// MergeTensors merges attention states (see core.MergeTensors) on the
// CUstream handle stream and returns the number of rows merged, or a
// negative error id. tensors is the host address of size bytes of
// records packed in MergeTensorFields' order: numOuts outs, numLSEs lses,
// then out and lse; flags: 1 outs stacked, 2 lses stacked, 4 merge_state's
// pair (core.MergeOutsStacked, ...).
func MergeTensors(tensors uintptr, size, numOuts, numLSEs, flags int, stream uintptr) (rows int) {
	defer recoverError(&rows)
	m, err := readMerge(tensors, size, numOuts, numLSEs, flags)
	if err == nil {
		rows, err = cuda.MergeTensors(&m, stream)
	}
	if err != nil {
		return fail(err)
	}
	return rows
}

// MergeStacks checks the records as MergeTensors does but for their
// device and addresses (a trace's) and returns which of the lists must be
// stacked for MergeTensors to take them (1 outs, 2 lses), or a negative
// error id.
func MergeStacks(tensors uintptr, size, numOuts, numLSEs, flags int) (stacks int) {
	defer recoverError(&stacks)
	m, err := readMerge(tensors, size, numOuts, numLSEs, flags)
	var s int64
	if err == nil {
		s, err = m.Stacks()
	}
	if err != nil {
		return fail(err)
	}
	return int(s)
}

func readMerge(tensors uintptr, size, numOuts, numLSEs, flags int) (core.MergeTensors, error) {
	if tensors == 0 || size <= 0 {
		return core.MergeTensors{}, &core.Error{Op: "merge_states", Arg: "tensors", Msg: "no records", Err: core.ErrInvalid}
	}
	b := unsafe.Slice(*(**byte)(unsafe.Pointer(&tensors)), size)
	return core.ReadMergeTensors(b, int64(numOuts), int64(numLSEs), int64(flags))
}
