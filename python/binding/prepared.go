package binding

import (
	"encoding/json"
	"fmt"
	"unsafe"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// prepared is the process's table of held layouts.
var prepared cuda.Handles

// Prepare reads the layout record of size bytes at host address layout
// (packed in LayoutFields' order), validates it for GPU device (< 0: plan
// for an H200 without one; Run is then refused) and returns its handle,
// or a negative error id. The same layout gets the same handle; each
// Prepare holds it once more, each Release once less.
func Prepare(layout uintptr, size int, device int) (handle int) {
	defer recoverError(&handle)
	b, err := record("layout", layout, size, core.LayoutBytes)
	if err != nil {
		return fail(err)
	}
	l, err := core.ReadLayout(b)
	if err != nil {
		return fail(err)
	}
	h, err := prepared.Prepare(&l, device)
	if err != nil {
		return fail(err)
	}
	return int(h)
}

// TensorsFields returns the fields of a call's tensors record
// (core.Tensors) as LayoutFields does.
func TensorsFields() (fields string) {
	defer recoverText(&fields)
	return core.TensorsFieldsText()
}

// PrepareTensors reads the tensors record of size bytes at host address
// tensors (packed in TensorsFields' order), checks it, and returns the
// handle of its layout on q's device as Prepare does, or a negative error
// id.
func PrepareTensors(tensors uintptr, size int) (handle int) {
	defer recoverError(&handle)
	ts, err := readTensors(tensors, size)
	if err != nil {
		return fail(err)
	}
	h, err := prepared.PrepareTensors(&ts)
	if err != nil {
		return fail(err)
	}
	return int(h)
}

// TensorsLayout checks the tensors record as PrepareTensors does, but
// for q's device, and writes its layout record (LayoutFields' order)
// into the layoutSize bytes at host address layout: 0, or a negative
// error id. It prepares nothing: for a caller that checks without a GPU
// (a trace) or prepares for another device (a plan).
func TensorsLayout(tensors uintptr, size int, layout uintptr, layoutSize int) (ret int) {
	defer recoverError(&ret)
	ts, err := readTensors(tensors, size)
	if err != nil {
		return fail(err)
	}
	dst, err := record("layout", layout, layoutSize, core.LayoutBytes)
	if err != nil {
		return fail(err)
	}
	l, err := ts.Layout()
	if err != nil {
		return fail(err)
	}
	copy(dst, unsafe.Slice((*byte)(unsafe.Pointer(&l)), core.LayoutBytes))
	return 0
}

func readTensors(tensors uintptr, size int) (core.Tensors, error) {
	b, err := record("tensors", tensors, size, core.TensorsBytes)
	if err != nil {
		return core.Tensors{}, err
	}
	return core.ReadTensors(b)
}

// record returns the size bytes at host address addr, a record named
// name that this build's are want bytes of; the caller keeps them alive
// for the call.
func record(name string, addr uintptr, size, want int) ([]byte, error) {
	if addr == 0 {
		return nil, &core.Error{Op: "prepare", Arg: name, Msg: "null address", Err: core.ErrInvalid}
	}
	if size != want {
		return nil, &core.Error{Op: "prepare", Arg: name, Err: core.ErrInvalid,
			Msg: fmt.Sprintf("the record is %d bytes; this build's is %d (pack it from its fields)", size, want)}
	}
	return unsafe.Slice(*(**byte)(unsafe.Pointer(&addr)), size), nil
}

// Release holds handle once less (see Prepare); 0 or a negative error id.
func Release(handle int) (ret int) {
	defer recoverError(&ret)
	if err := prepared.Release(int64(handle)); err != nil {
		return fail(err)
	}
	return 0
}

// Workspace returns the bytes of device workspace Run needs for the layout
// under handle with this seqlen (as Run's), or a negative error id. It
// opens the GPU on first use.
func Workspace(handle, seqlen int) (bytes int) {
	defer recoverError(&bytes)
	r, err := prepared.Get(int64(handle))
	if err != nil {
		return fail(err)
	}
	n, err := r.Workspace(seqlen)
	if err != nil {
		return fail(err)
	}
	return n
}

// PlanJSON returns the plan Run launches for the layout under handle with
// this seqlen, as JSON (core.Plan's fields), or "" where Workspace would
// fail (ask it for the error).
func PlanJSON(handle, seqlen int) (plan string) {
	defer recoverText(&plan)
	r, err := prepared.Get(int64(handle))
	if err != nil {
		return ""
	}
	pl, err := r.Plan(seqlen)
	if err != nil {
		return ""
	}
	js, err := json.Marshal(pl)
	if err != nil {
		return ""
	}
	return string(js)
}

// Run launches the decode prepared under handle on these device addresses
// (0 for those the layout has not; lse may be 0) with this seqlen (-1: the
// whole cache; an int length, or with device lengths the bound
// max_seqlen_k) on the CUstream handle stream, and returns the number of
// splits it used, or a negative error id. The workspace needs
// Workspace(handle, seqlen) bytes.
func Run(handle, seqlen int, q, k, v, out, lse, cacheSeqlens, blockTable, cacheBatchIdx, cacheLeftpad, alibiSlopes,
	kNew, vNew, rotaryCos, rotarySin, kDescale, vDescale, sinks, cuSeqlensQ, workspace uintptr, workspaceBytes int,
	stream uintptr) (splits int) {
	defer recoverError(&splits)
	r, err := prepared.Get(int64(handle))
	if err != nil {
		return fail(err)
	}
	pl, err := r.Run(&cuda.Args{Q: q, K: k, V: v, Out: out, LSE: lse, CacheSeqlens: cacheSeqlens,
		BlockTable: blockTable, CacheBatchIdx: cacheBatchIdx, CacheLeftpad: cacheLeftpad, AlibiSlopes: alibiSlopes,
		KNew: kNew, VNew: vNew, RotaryCos: rotaryCos, RotarySin: rotarySin,
		KDescale: kDescale, VDescale: vDescale, Sinks: sinks, CuSeqlensQ: cuSeqlensQ,
		Workspace: workspace, WorkspaceBytes: workspaceBytes}, seqlen, stream)
	if err != nil {
		return fail(err)
	}
	return pl.NumSplits
}

// ShapesFields returns the fields of plan()'s shapes record (core.Shapes)
// as LayoutFields does.
func ShapesFields() (fields string) {
	defer recoverText(&fields)
	return core.ShapesFieldsText()
}

// DescribeShapes sets the descriptors of the tensors record of tsize bytes
// at host address tensors to contiguous tensors of the shapes record of
// size bytes at shapes (core.Shapes.Describe): 0, or a negative error id.
func DescribeShapes(shapes uintptr, size int, tensors uintptr, tsize int) (ret int) {
	defer recoverError(&ret)
	b, err := record("shapes", shapes, size, core.ShapesBytes)
	if err != nil {
		return fail(err)
	}
	s, err := core.ReadShapes(b)
	if err != nil {
		return fail(err)
	}
	ts, err := readTensors(tensors, tsize)
	if err != nil {
		return fail(err)
	}
	if err := s.Describe(&ts); err != nil {
		return fail(err)
	}
	dst, _ := record("tensors", tensors, tsize, core.TensorsBytes)
	copy(dst, unsafe.Slice((*byte)(unsafe.Pointer(&ts)), core.TensorsBytes))
	return 0
}
