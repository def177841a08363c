package binding

import (
	"strings"
	"testing"
	"unsafe"

	"github.com/flash-decode/flash-decode/core"
	"gorgonia.org/cu"
)

// mergeRecords are 3 float16 states (2, 3, 4, 64) as a list, then out and
// lse, contiguous at made-up aligned addresses on device 0.
func mergeRecords() []core.MergeTensor {
	tensor := func(dtype core.DType, data int64, shape ...int64) core.MergeTensor {
		t := core.MergeTensor{Desc: core.TensorDesc{Given: 1, DType: int64(dtype), Rank: int64(len(shape))}, Data: data}
		step := int64(1)
		for i := len(shape) - 1; i >= 0; i-- {
			t.Desc.Shape[i], t.Desc.Strides[i] = shape[i], step
			step *= shape[i]
		}
		return t
	}
	var r []core.MergeTensor
	for s := range int64(3) {
		r = append(r, tensor(core.Float16, (1+s)<<20, 2, 3, 4, 64))
	}
	for s := range int64(3) {
		r = append(r, tensor(core.Float32, (4+s)<<20, 2, 3, 4))
	}
	return append(r, tensor(core.Float16, 7<<20, 2, 3, 4, 64), tensor(core.Float32, 8<<20, 2, 3, 4))
}

func mergeCall(r []core.MergeTensor, numOuts, flags int) (int, int) {
	addr, size := uintptr(unsafe.Pointer(&r[0])), len(r)*core.MergeTensorBytes
	return MergeTensors(addr, size, numOuts, len(r)-2-numOuts, flags, 0), MergeStacks(addr, size, numOuts, len(r)-2-numOuts, flags)
}

// The records reach the core's checks: a bad one is refused naming its
// argument, by MergeTensors and by MergeStacks but for the device.
func TestMergeTensorsArguments(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(r []core.MergeTensor)
		arg    string
		text   string
		stacks bool // MergeStacks takes it
	}{
		{"item shape", func(r []core.MergeTensor) { r[1].Desc.Shape[0] = 1 }, "outs[1]", "outs[0]'s shape", false},
		{"lse dtype", func(r []core.MergeTensor) { r[5].Desc.DType = int64(core.Float16) }, "lses[2]", "torch.float32", false},
		{"host", func(r []core.MergeTensor) {
			for i := range r {
				r[i].Desc.Device = -1
			}
		}, "outs[0]", "CUDA device", true},
		{"headdim", func(r []core.MergeTensor) {
			for _, i := range []int{0, 1, 2, 6} {
				r[i].Desc.Shape[3] = 66
			}
		}, "headdim", "66", true},
		{"misaligned", func(r []core.MergeTensor) { r[2].Data += 2 }, "outs", "state 2", true},
	}
	for _, tc := range tests {
		r := mergeRecords()
		tc.mutate(r)
		id, stacks := mergeCall(r, 3, 0)
		if msg := ErrorMessage(id); id >= 0 || !strings.Contains(msg, ": "+tc.arg+": ") || !strings.Contains(msg, tc.text) {
			t.Errorf("%s: %d %q; want an error naming %s with %q", tc.name, id, msg, tc.arg, tc.text)
		}
		if (stacks == 0) != tc.stacks {
			t.Errorf("%s: MergeStacks %d %q", tc.name, stacks, ErrorMessage(stacks))
		}
	}
	r := mergeRecords()
	r[1].Desc.Strides[0] = 1024 // a second layout: stacked first
	if _, stacks := mergeCall(r, 3, 0); stacks != 1 {
		t.Errorf("outs of two layouts: MergeStacks %d %q", stacks, ErrorMessage(stacks))
	}
	if id := MergeTensors(uintptr(unsafe.Pointer(&r[0])), core.MergeTensorBytes, 3, 3, 0, 0); !strings.Contains(ErrorMessage(id), "tensors_size") {
		t.Errorf("short records: %d %q", id, ErrorMessage(id))
	}
	if n, err := cu.NumDevices(); err == nil && n == 0 {
		// The stand-in driver: the good call gets as far as the missing device.
		if id, _ := mergeCall(mergeRecords(), 3, 0); id >= 0 || !strings.Contains(ErrorMessage(id), "device") {
			t.Errorf("good merge without a device: %d %q", id, ErrorMessage(id))
		}
	}
}
