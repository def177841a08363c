package binding

import (
	"strings"
	"testing"

	"gorgonia.org/cu"
)

// mergeArgs are MergeStates' arguments for 3 fp16 states, a pointer each, of
// (2, 3, 4) rows of head dim 64, at made-up aligned addresses, out and lse
// contiguous: each test case changes one.
type mergeArgs struct {
	dtype, states, r0, r1, r2, d int
	o                            [8]uintptr
	oPtrs                        int
	oState, oS0, oS1, oS2        int64
	l                            [8]uintptr
	lPtrs                        int
	lState, lS0, lS1, lS2        int64
	out                          uintptr
	outS0, outS1, outS2          int64
	lse                          uintptr
	lseS0, lseS1, lseS2          int64
	device                       int
}

func validMergeArgs() mergeArgs {
	return mergeArgs{dtype: 1, states: 3, r0: 2, r1: 3, r2: 4, d: 64,
		o: [8]uintptr{1 << 20, 2 << 20, 3 << 20}, oPtrs: 3, oS0: 768, oS1: 256, oS2: 64,
		l: [8]uintptr{4 << 20, 5 << 20, 6 << 20}, lPtrs: 3, lS0: 12, lS1: 4, lS2: 1,
		out: 7 << 20, outS0: 768, outS1: 256, outS2: 64, lse: 8 << 20, lseS0: 12, lseS1: 4, lseS2: 1}
}

func (a mergeArgs) call() int {
	return MergeStates(a.dtype, a.states, a.r0, a.r1, a.r2, a.d,
		a.o[0], a.o[1], a.o[2], a.o[3], a.o[4], a.o[5], a.o[6], a.o[7], a.oPtrs, a.oState, a.oS0, a.oS1, a.oS2,
		a.l[0], a.l[1], a.l[2], a.l[3], a.l[4], a.l[5], a.l[6], a.l[7], a.lPtrs, a.lState, a.lS0, a.lS1, a.lS2,
		a.out, a.outS0, a.outS1, a.outS2, a.lse, a.lseS0, a.lseS1, a.lseS2, a.device, 0)
}

// Each argument reaches the field the core checks: a bad value in it is
// refused naming that argument.
func TestMergeStatesArguments(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(a *mergeArgs)
		arg    string // the argument the error names
		text   string // and a part of its message
	}{
		{"dtype", func(a *mergeArgs) { a.dtype = 4 }, "dtype", "4"},
		{"states", func(a *mergeArgs) { a.states, a.oPtrs, a.lPtrs = 0, 1, 1 }, "num_states", "0"},
		{"rows", func(a *mergeArgs) { a.r2 = 0 }, "rows", "[2 3 0]"},
		{"headdim", func(a *mergeArgs) { a.d = 66 }, "headdim", "66"},
		{"third output", func(a *mergeArgs) { a.o[2] += 2 }, "outs", "state 2"},
		{"output pointers", func(a *mergeArgs) { a.oPtrs = 2 }, "outs", "2 pointers"},
		{"output state stride", func(a *mergeArgs) { a.oPtrs, a.oState = 1, 2 }, "outs", "stride 2"},
		{"output row stride", func(a *mergeArgs) { a.oS1 = -4 }, "outs", "negative stride -4"},
		{"second lse", func(a *mergeArgs) { a.l[1] = 0 }, "lses", "state 1"},
		{"lse state stride", func(a *mergeArgs) { a.lPtrs, a.lState = 1, -3 }, "lses", "negative stride -3"},
		{"lse row stride", func(a *mergeArgs) { a.lS2 = -5 }, "lses", "negative stride -5"},
		{"out", func(a *mergeArgs) { a.out = 0 }, "out", "null"},
		{"out strides", func(a *mergeArgs) { a.outS2 = 8 }, "out", "overlap"},
		{"lse", func(a *mergeArgs) { a.lse = 2 }, "lse", "aligned"},
		{"lse strides", func(a *mergeArgs) { a.lseS1 = 1 }, "lse", "overlap"},
		{"device", func(a *mergeArgs) { a.device = -2 }, "device", "-2"},
	}
	for _, tc := range tests {
		a := validMergeArgs()
		tc.mutate(&a)
		id := a.call()
		if msg := ErrorMessage(id); id >= 0 || !strings.Contains(msg, ": "+tc.arg+": ") || !strings.Contains(msg, tc.text) {
			t.Errorf("%s: %d %q; want an error naming %s with %q", tc.name, id, msg, tc.arg, tc.text)
		}
	}
	if n, err := cu.NumDevices(); err == nil && n == 0 {
		// The stand-in driver: the good call gets as far as the missing device.
		if id := validMergeArgs().call(); id >= 0 || !strings.Contains(ErrorMessage(id), "device") {
			t.Errorf("good merge without a device: %d %q", id, ErrorMessage(id))
		}
	}
}
