package cuda_test

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"testing"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
	"gorgonia.org/cu"
)

// A Go caller runs one decode step: one new query token per sequence over a
// KV cache already in GPU memory (here freshly allocated), on the default
// stream of device 0.
func ExampleDecode() {
	const batch, headsQ, headsKV, dim, cacheLen = 4, 32, 8, 128, 4096
	runtime.LockOSThread() // a CUDA context is current per OS thread
	defer runtime.UnlockOSThread()
	dev, _ := cu.Device(0).RetainPrimaryCtx() // the context PyTorch would use too
	cu.SetCurrentContext(dev)

	alloc := func(elems int) uintptr { p, _ := cu.MemAlloc(int64(elems) * 2); return uintptr(p) }
	tensor := func(ptr uintptr, seq, heads int) core.Tensor { // contiguous (batch, seq, heads, dim)
		return core.Tensor{Ptr: ptr, BatchStride: int64(seq * heads * dim), SeqStride: int64(heads * dim), HeadStride: dim}
	}
	p := core.Problem{
		Shape: core.Shape{DType: core.Float16, Batch: batch, SeqlenQ: 1, HeadsQ: headsQ, HeadsKV: headsKV,
			HeadDim: dim, SeqlenCache: cacheLen, Seqlen: -1}, // Seqlen -1: the whole cache
		Q:   tensor(alloc(batch*headsQ*dim), 1, headsQ),
		K:   tensor(alloc(batch*cacheLen*headsKV*dim), cacheLen, headsKV),
		V:   tensor(alloc(batch*cacheLen*headsKV*dim), cacheLen, headsKV),
		Out: tensor(alloc(batch*headsQ*dim), 1, headsQ),
	}

	plan, err := cuda.PlanFor(p.Shape, 0) // what num_splits=0 picks, and the workspace it needs
	if err != nil {
		fmt.Println(err)
		return
	}
	ws, _ := cu.MemAlloc(int64(max(plan.WorkspaceBytes, 1)))
	if _, err := cuda.Decode(&p, uintptr(ws), plan.WorkspaceBytes, 0, 0); err != nil {
		fmt.Println(err)
		return
	}
	cu.Synchronize() // only to read the result on the host; Decode itself never waits
	fmt.Println(plan)
}

// TestExampleDecode runs ExampleDecode where there is a GPU (examples without
// an Output comment are only compiled by go test).
func TestExampleDecode(t *testing.T) {
	if n, err := cu.NumDevices(); err != nil || n == 0 {
		t.Skip("no CUDA device")
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	ExampleDecode()
	os.Stdout = stdout
	w.Close()
	printed, _ := io.ReadAll(r)
	t.Logf("ExampleDecode printed: %s", printed)
	if !strings.Contains(string(printed), "fd_split_kv_f16_d128") {
		t.Fatalf("ExampleDecode printed %q, want its plan", printed)
	}
}
