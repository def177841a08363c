package binding

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// pack packs a layout record from LayoutFields as Python does: values by
// field name, every other field 0.
func pack(t testing.TB, values map[string]float64) []byte {
	t.Helper()
	return packFields(t, LayoutFields(), values)
}

// packFields packs a record of fields (LayoutFields' form) from values.
func packFields(t testing.TB, fields string, values map[string]float64) []byte {
	t.Helper()
	var b []byte
	used := 0
	for _, f := range strings.Split(fields, ",") {
		name, kind, _ := strings.Cut(f, ":")
		v, ok := values[name]
		if ok {
			used++
		}
		switch kind {
		case "q":
			b = binary.NativeEndian.AppendUint64(b, uint64(int64(v)))
		case "d":
			b = binary.NativeEndian.AppendUint64(b, math.Float64bits(v))
		default:
			t.Fatalf("field %q", f)
		}
	}
	if used != len(values) {
		t.Fatalf("%d of %d values have a field", used, len(values))
	}
	return b
}

// dense is a contiguous b=1, 32/8-head, d128 layout of n cached keys.
func dense(n int) map[string]float64 {
	v := map[string]float64{"dtype": 1, "batch": 1, "seqlen_q": 1, "heads_q": 32, "heads_kv": 8, "head_dim": 128,
		"seqlen_cache": float64(n), "window_left": -1, "window_right": -1}
	for _, x := range []struct {
		name    string
		strides [4]float64
	}{
		{"q", [4]float64{32 * 128, 32 * 128, 128, 1}}, {"out", [4]float64{32 * 128, 32 * 128, 128, 1}},
		{"k_cache", [4]float64{float64(n) * 8 * 128, 8 * 128, 128, 1}}, {"v_cache", [4]float64{float64(n) * 8 * 128, 8 * 128, 128, 1}},
	} {
		for i, s := range x.strides {
			v[x.name+"["+string(rune('0'+i))+"]"] = s
		}
	}
	return v
}

func with(v map[string]float64, name string, x float64) map[string]float64 {
	w := map[string]float64{}
	for k, y := range v {
		w[k] = y
	}
	w[name] = x
	return w
}

// prepareBytes calls Prepare on b.
func prepareBytes(b []byte, device int) int {
	return Prepare(uintptr(unsafe.Pointer(&b[0])), len(b), device)
}

// checkFailure fails t unless ret is an error id of kind naming arg.
func checkFailure(t *testing.T, what string, ret int, kind cuda.Kind, arg string) {
	t.Helper()
	if ret >= 0 {
		t.Errorf("%s: %d, want an error", what, ret)
		return
	}
	if k, msg := ErrorKind(ret), ErrorMessage(ret); cuda.Kind(k) != kind || !strings.Contains(msg, ": "+arg+": ") {
		t.Errorf("%s: kind %d %q; want kind %d naming %s", what, k, msg, kind, arg)
	}
}

func TestLayoutFields(t *testing.T) {
	fields := strings.Split(LayoutFields(), ",")
	if len(fields)*8 != core.LayoutBytes || fields[0] != "dtype:q" || fields[len(fields)-1] != "total_q:q" {
		t.Errorf("LayoutFields() = %q", LayoutFields())
	}
}

func TestPrepareHandles(t *testing.T) {
	a := prepareBytes(pack(t, dense(1024)), -1)
	b := prepareBytes(pack(t, dense(2048)), -1)
	again := prepareBytes(pack(t, dense(1024)), -1)
	if a <= 0 || b <= 0 || a == b || again != a {
		t.Fatalf("handles %d, %d, %d", a, b, again)
	}
	// A size-1 dimension's stride is any: the same layout, the same handle.
	if odd := prepareBytes(pack(t, with(dense(1024), "q[1]", 7)), -1); odd != a {
		t.Errorf("q's seq stride (seqlen_q 1) changed the handle: %d, want %d", odd, a)
	}
	for _, h := range []int{a, a, a, b} {
		if r := Release(h); r != 0 {
			t.Fatalf("Release(%d) = %d: %s", h, r, ErrorMessage(r))
		}
	}
	checkFailure(t, "Release after the last", Release(a), cuda.KindInvalid, "handle")
	checkFailure(t, "Workspace of a released handle", Workspace(b, -1), cuda.KindInvalid, "handle")
}

func TestPrepareChecks(t *testing.T) {
	good := pack(t, dense(1024))
	checkFailure(t, "short record", Prepare(uintptr(unsafe.Pointer(&good[0])), len(good)-8, -1), cuda.KindInvalid, "layout")
	checkFailure(t, "null record", Prepare(0, len(good), -1), cuda.KindInvalid, "layout")
	for _, tt := range []struct {
		name  string
		field string
		value float64
		kind  cuda.Kind
		arg   string
	}{
		{"heads", "heads_q", 12, cuda.KindInvalid, "nheads_q"},
		{"head dim", "head_dim", 100, cuda.KindUnsupported, "headdim"},
		{"causal", "causal", 2, cuda.KindInvalid, "causal"},
		{"last stride", "k_cache[3]", 2, cuda.KindInvalid, "k_cache"},
		{"scale", "scale", -1, cuda.KindInvalid, "softmax_scale"},
		{"softcap", "softcap", 1e39, cuda.KindInvalid, "softcap"},
		{"dtype", "dtype", 3, cuda.KindUnsupported, "dtype"},
	} {
		checkFailure(t, tt.name, prepareBytes(pack(t, with(dense(1024), tt.field, tt.value)), -1), tt.kind, tt.arg)
	}
	checkFailure(t, "device", prepareBytes(good, 1<<20), cuda.KindInvalid, "device")
}

// Without a GPU: a layout prepared for device -1 answers Workspace and
// PlanJSON as cuda.PlanFor does, and Run checks the call and then refuses.
func TestWorkspacePlanRun(t *testing.T) {
	h := prepareBytes(pack(t, dense(4096)), -1)
	if h < 0 {
		t.Fatal(ErrorMessage(h))
	}
	defer Release(h)
	for _, seqlen := range []int{-1, 0, 100, 4096} {
		s := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 4096, Seqlen: seqlen}
		pl, err := cuda.PlanFor(s, -1)
		if err != nil {
			t.Fatal(err)
		}
		if got := Workspace(h, seqlen); got != pl.WorkspaceBytes {
			t.Errorf("seqlen %d: Workspace %d, PlanFor %d", seqlen, got, pl.WorkspaceBytes)
		}
		if want, err := json.Marshal(pl); err != nil || PlanJSON(h, seqlen) != string(want) {
			t.Errorf("seqlen %d: PlanJSON %s, PlanFor's %s (%v)", seqlen, PlanJSON(h, seqlen), want, err)
		}
	}
	checkFailure(t, "seqlen past the cache", Workspace(h, 4097), cuda.KindInvalid, "cache_seqlens")
	if js := PlanJSON(h, 4097); js != "" {
		t.Errorf("PlanJSON past the cache = %q", js)
	}
	const ok = uintptr(1) << 30
	run := func(q, ws uintptr) int {
		return Run(h, -1, q, 2*ok, 3*ok, 4*ok, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, ws, 0, 0)
	}
	checkFailure(t, "Run without a device", run(ok, 0), cuda.KindInvalid, "device")
	checkFailure(t, "Run of a made-up handle", Run(12345, -1, ok, 2*ok, 3*ok, 4*ok, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
		cuda.KindInvalid, "handle")
}

// Layouts prepared from several goroutines while others look handles up:
// every handle stays valid, one per layout (run with -race to check the table).
func TestPrepareConcurrent(t *testing.T) {
	const n = 64
	handles := make([]int, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			handles[i] = prepareBytes(pack(t, dense(1024+64*(i%16))), -1)
			if Workspace(handles[i], -1) < 0 {
				t.Errorf("Workspace of handle %d failed", handles[i])
			}
		}()
	}
	wg.Wait()
	for i, h := range handles {
		if want := handles[i%16]; h != want {
			t.Errorf("layout %d: handle %d, want %d", i, h, want)
		}
	}
	for _, h := range handles {
		if r := Release(h); r != 0 {
			t.Errorf("Release(%d): %s", h, ErrorMessage(r))
		}
	}
}

// A panic inside an exported function comes back as an error id of kind
// internal, whose message has the stack; an id not kept says so.
func TestPanicIsAnError(t *testing.T) {
	id := func() (ret int) {
		defer recoverError(&ret)
		panic("boom")
	}()
	if id >= 0 || cuda.Kind(ErrorKind(id)) != cuda.KindInternal || !strings.Contains(ErrorMessage(id), "panic: boom") {
		t.Errorf("id %d: kind %d, %q", id, ErrorKind(id), ErrorMessage(id))
	}
	text := func() (ret string) {
		defer recoverText(&ret)
		panic("boom")
	}()
	if text != "" {
		t.Errorf("a string result after a panic: %q", text)
	}
	if k, msg := ErrorKind(-1<<40), ErrorMessage(-1<<40); cuda.Kind(k) != cuda.KindInternal || !strings.Contains(msg, "not one of the last") {
		t.Errorf("an unknown id: %d %q", k, msg)
	}
}

// heldBuffers keeps the buffers tests pass by address on the heap.
var heldBuffers [][]byte

// A call's tensors, packed by name from TensorsFields: TensorsLayout writes the
// layout PrepareTensors prepares on q's device; errors come by kind.
func TestTensorsDoor(t *testing.T) {
	v := map[string]float64{"window_left": -1, "window_right": -1}
	for name, shape := range map[string][4]float64{"q": {1, 1, 32, 128}, "k_cache": {1, 64, 8, 128}, "v_cache": {1, 64, 8, 128}} {
		v[name+".given"], v[name+".dtype"], v[name+".device"], v[name+".rank"] = 1, 1, -1, 4
		stride := 1.0
		for i := 3; i >= 0; i-- {
			v[name+".shape["+string(rune('0'+i))+"]"], v[name+".strides["+string(rune('0'+i))+"]"] = shape[i], stride
			stride *= shape[i]
		}
	}
	rec := packFields(t, TensorsFields(), v)
	heldBuffers = append(heldBuffers, rec)
	addr := uintptr(unsafe.Pointer(&rec[0]))
	buf := make([]byte, core.LayoutBytes)
	heldBuffers = append(heldBuffers, buf) // on the heap: a stack the call grows would move it
	if ret := TensorsLayout(addr, len(rec), uintptr(unsafe.Pointer(&buf[0])), len(buf)); ret != 0 {
		t.Fatalf("TensorsLayout: %s", ErrorMessage(ret))
	}
	l, err := core.ReadLayout(buf)
	if err != nil {
		t.Fatal(err)
	}
	if l.Batch != 1 || l.HeadsQ != 32 || l.SeqlenCache != 64 || l.KCache != [4]int64{64 * 8 * 128, 8 * 128, 128, 1} {
		t.Errorf("layout %+v", l)
	}
	if id := PrepareTensors(addr, len(rec)); id >= 0 || ErrorKind(id) != int(cuda.KindInvalid) || !strings.Contains(ErrorMessage(id), ": q: ") {
		t.Errorf("q off CUDA: %d %q", id, ErrorMessage(id))
	}
	v["k_cache.dtype"] = 2
	rec = packFields(t, TensorsFields(), v)
	heldBuffers = append(heldBuffers, rec)
	if id := PrepareTensors(uintptr(unsafe.Pointer(&rec[0])), len(rec)); ErrorKind(id) != int(cuda.KindType) || !strings.Contains(ErrorMessage(id), ": k_cache: ") {
		t.Errorf("k_cache bfloat16: %d %q", id, ErrorMessage(id))
	}
	if id := PrepareTensors(addr, 8); ErrorKind(id) != int(cuda.KindInvalid) || !strings.Contains(ErrorMessage(id), ": tensors: ") {
		t.Errorf("8 bytes: %q", ErrorMessage(id))
	}
}
