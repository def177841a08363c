package cuda_test

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"testing"
	"unsafe"

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

// A Go serving loop: a paged cache (pages of 16 keys, in any order), each
// step appending one token per sequence and attending over its keys. The
// layout (a core.Layout, as C and Python pass it too) is checked once by
// Prepare; each step only hands over the device addresses and a bound on
// the lengths (max_seqlen_k), which the core rounds to its plan key. Here
// the lengths advance on the host and are copied over; a real loop keeps
// them on the device.
func ExamplePrepare() {
	const batch, headsQ, headsKV, dim, page, pagesPerSeq = 2, 32, 8, 128, 16, 64 // up to 1024 keys a sequence
	const row, numPages = headsKV * dim, batch * pagesPerSeq
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	dev, _ := cu.Device(0).RetainPrimaryCtx()
	cu.SetCurrentContext(dev)

	// Strides in elements, (batch, seq, head, dim); paged caches are (num_pages, page, head, dim).
	l := core.Layout{DType: int64(core.Float16), Batch: batch, SeqlenQ: 1, HeadsQ: headsQ, HeadsKV: headsKV,
		HeadDim: dim, SeqlenCache: pagesPerSeq * page, DeviceLengths: 1, Causal: 1,
		Q: [4]int64{headsQ * dim, headsQ * dim, dim, 1}, Out: [4]int64{headsQ * dim, headsQ * dim, dim, 1},
		KCache: [4]int64{page * row, row, dim, 1}, VCache: [4]int64{page * row, row, dim, 1},
		PageSize: page, NumPages: numPages, MaxPages: pagesPerSeq, BlockTable: [2]int64{pagesPerSeq, 1},
		WindowLeft: -1, WindowRight: -1,
		SeqlenNew: 1, KNew: [4]int64{row, row, dim, 1}, VNew: [4]int64{row, row, dim, 1}}
	prepared, err := cuda.Prepare(&l, 0)
	if err != nil {
		fmt.Println(err)
		return
	}
	const bound = pagesPerSeq * page // max_seqlen_k: no sequence attends more keys
	wsBytes, err := prepared.Workspace(bound)
	if err != nil {
		fmt.Println(err)
		return
	}
	plan, err := prepared.Plan(bound)
	if err != nil {
		fmt.Println(err)
		return
	}

	alloc := func(bytes int) cu.DevicePtr { d, _ := cu.MemAlloc(int64(max(bytes, 1))); return d }
	q, out := alloc(batch*headsQ*dim*2), alloc(batch*headsQ*dim*2)
	kNew, vNew := alloc(batch*row*2), alloc(batch*row*2)
	kCache, vCache := alloc(numPages*page*row*2), alloc(numPages*page*row*2)
	table, seqlens, ws := alloc(batch*pagesPerSeq*4), alloc(batch*4), alloc(wsBytes)
	cu.MemsetD16(q, 0, batch*headsQ*dim)  // q = 0: every key weighs the same
	cu.MemsetD16(kNew, 0x3c00, batch*row) // 1.0 in fp16
	cu.MemsetD16(vNew, 0x4000, batch*row) // 2.0
	cu.MemsetD16(kCache, 0, numPages*page*row)
	cu.MemsetD16(vCache, 0, numPages*page*row)
	ids := make([]int32, batch*pagesPerSeq) // the pages in reverse order
	for i := range ids {
		ids[i] = int32(numPages - 1 - i)
	}
	cu.MemcpyHtoD(table, unsafe.Pointer(&ids[0]), int64(len(ids)*4))

	lens := []int32{100, 7} // keys cached so far
	for step := 0; step < 3; step++ {
		cu.MemcpyHtoD(seqlens, unsafe.Pointer(&lens[0]), int64(len(lens)*4))
		_, err := prepared.Run(&cuda.Args{Q: uintptr(q), K: uintptr(kCache), V: uintptr(vCache), Out: uintptr(out),
			CacheSeqlens: uintptr(seqlens), BlockTable: uintptr(table), KNew: uintptr(kNew), VNew: uintptr(vNew),
			Workspace: uintptr(ws), WorkspaceBytes: wsBytes}, bound, 0)
		if err != nil {
			fmt.Println(err)
			return
		}
		for b := range lens {
			lens[b]++ // this step's token is in the cache now
		}
	}

	// Sequence 0's last key, 102, is row 102 % 16 of its page 102 / 16.
	var key uint16
	at := (int(ids[102/page])*page + 102%page) * row * 2
	cu.MemcpyDtoH(unsafe.Pointer(&key), kCache+cu.DevicePtr(at), 2)
	var o uint16 // the mean of v over its 103 keys: 3 new ones of 2.0, 100 of 0
	cu.MemcpyDtoH(unsafe.Pointer(&o), out, 2)
	fmt.Printf("%s: key 102 %#x, out %#x\n", plan.Variant.Kernel, key, o)
}

// TestExamplePrepare runs ExamplePrepare where there is a GPU: the last
// appended key is in its page (stage 1 wrote it: the appending paged form),
// and out is 6/103 (0x2b75 in fp16, within a few units in the last place).
func TestExamplePrepare(t *testing.T) {
	if n, err := cu.NumDevices(); err != nil || n == 0 {
		t.Skip("no CUDA device")
	}
	printed := captureStdout(t, ExamplePrepare)
	var kernel string
	var key, out uint16
	if _, err := fmt.Sscanf(printed, "%s key 102 %v, out %v", &kernel, &key, &out); err != nil {
		t.Fatalf("ExamplePrepare printed %q: %v", printed, err)
	}
	if !strings.HasPrefix(kernel, "fd_split_kv_paged_append_f16_d128") || key != 0x3c00 || out < 0x2b71 || out > 0x2b79 {
		t.Fatalf("ExamplePrepare printed %q: want the appending paged form, key 0x3c00 and out 0x2b75 (6/103)", printed)
	}
}

// TestExampleDecode runs ExampleDecode where there is a GPU (examples without
// an Output comment are only compiled by go test).
func TestExampleDecode(t *testing.T) {
	if n, err := cu.NumDevices(); err != nil || n == 0 {
		t.Skip("no CUDA device")
	}
	printed := captureStdout(t, ExampleDecode)
	if !strings.Contains(printed, "fd_split_kv_f16_d128") {
		t.Fatalf("ExampleDecode printed %q, want its plan", printed)
	}
}

// captureStdout runs fn and returns what it printed.
func captureStdout(t *testing.T, fn func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	fn()
	os.Stdout = stdout
	w.Close()
	printed, _ := io.ReadAll(r)
	t.Logf("printed: %s", printed)
	return string(printed)
}
