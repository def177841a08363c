package cuda

import (
	"errors"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"
	"unsafe"

	"github.com/flash-decode/flash-decode/core"
	"gorgonia.org/cu"
)

// gpu returns device 0 with its context current on this test's locked
// thread, or skips the test on a machine without a GPU.
func gpu(t *testing.T) *device {
	t.Helper()
	if n, err := cu.NumDevices(); err != nil || n == 0 {
		t.Skip("no CUDA device")
	}
	if fakeDevice() {
		t.Skip("the fake device computes nothing")
	}
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
	d, err := getDevice("decode", 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := cu.SetCurrentContext(d.ctx); err != nil {
		t.Fatal(err)
	}
	return d
}

// Values k/256 with |k| <= 256 are exact in fp16 and bf16, so the GPU and the
// host reference see the same inputs.
func randomExact(r *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.IntN(513)-256) / 256
	}
	return x
}

// encode turns exactly representable float32 values into fp16 or bf16 bits.
func encode(dt core.DType, x []float32) []uint16 {
	h := make([]uint16, len(x))
	for i, f := range x {
		b := math.Float32bits(f)
		if dt == core.BFloat16 {
			h[i] = uint16(b >> 16)
			continue
		}
		sign := uint16(b>>16) & 0x8000
		if b&0x7fffffff == 0 {
			h[i] = sign
			continue
		}
		exp := int(b>>23&0xff) - 127 + 15
		h[i] = sign | uint16(exp)<<10 | uint16(b>>13&0x3ff)
	}
	return h
}

// decode turns fp16 or bf16 bits into float32.
func decode(dt core.DType, h []uint16) []float32 {
	x := make([]float32, len(h))
	for i, v := range h {
		if dt == core.BFloat16 {
			x[i] = math.Float32frombits(uint32(v) << 16)
			continue
		}
		sign := float32(1)
		if v&0x8000 != 0 {
			sign = -1
		}
		exp, mant := int(v>>10&0x1f), float64(v&0x3ff)
		switch exp {
		case 0:
			x[i] = sign * float32(math.Ldexp(mant, -24))
		case 31:
			x[i] = sign * float32(math.Inf(1))
		default:
			x[i] = sign * float32(math.Ldexp(1024+mant, exp-25))
		}
	}
	return x
}

// upload copies a host slice to new device memory freed at test end.
func upload[T any](t *testing.T, x []T) cu.DevicePtr {
	t.Helper()
	bytes := int64(len(x)) * int64(unsafe.Sizeof(*new(T)))
	p, err := cu.MemAlloc(max(bytes, 256))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cu.MemFree(p) })
	if bytes > 0 {
		if err := cu.MemcpyHtoD(p, unsafe.Pointer(&x[0]), bytes); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

func download[T any](t *testing.T, p cu.DevicePtr, x []T) {
	t.Helper()
	if err := cu.MemcpyDtoH(unsafe.Pointer(&x[0]), p, int64(len(x))*int64(unsafe.Sizeof(x[0]))); err != nil {
		t.Fatal(err)
	}
}

func contiguous(p cu.DevicePtr, seq, heads, dim int) core.Tensor {
	return core.Tensor{Ptr: uintptr(p), BatchStride: int64(seq * heads * dim), SeqStride: int64(heads * dim), HeadStride: int64(dim)}
}

func TestDecodeMatchesNaiveAttention(t *testing.T) {
	gpu(t) // skips without a GPU
	tests := []struct {
		name      string
		shape     core.Shape
		lens      []int32 // nil: Shape.Seqlen for every sequence
		causal    bool
		noCluster bool // plan as on a GPU without clusters: the combine kernel merges
	}{
		{"fp16 gqa4 auto", core.Shape{DType: core.Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 3000, Seqlen: -1}, []int32{2999, 1}, false, false},
		{"bf16 gqa5 causal ragged", core.Shape{DType: core.BFloat16, Batch: 3, SeqlenQ: 4, HeadsQ: 20, HeadsKV: 4, HeadDim: 64, SeqlenCache: 777, Seqlen: -1, NumSplits: 7}, []int32{0, 5, 777}, true, false},
		{"fp16 mqa sq16 causal d256", core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 16, HeadsQ: 8, HeadsKV: 1, HeadDim: 256, SeqlenCache: 4096, Seqlen: 4000}, nil, true, false},
		{"fp16 mha d96 one split", core.Shape{DType: core.Float16, Batch: 2, SeqlenQ: 2, HeadsQ: 4, HeadsKV: 4, HeadDim: 96, SeqlenCache: 300, Seqlen: -1, NumSplits: 1}, nil, false, false},
		{"bf16 gqa8 many splits", core.Shape{DType: core.BFloat16, Batch: 1, SeqlenQ: 1, HeadsQ: 64, HeadsKV: 8, HeadDim: 128, SeqlenCache: 20000, Seqlen: -1, NumSplits: 100}, []int32{19999}, false, false},
		{"fp16 gqa8 ragged clusters of 16", core.Shape{DType: core.Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 16, HeadsKV: 2, HeadDim: 128, SeqlenCache: 5000, Seqlen: -1, NumSplits: 16}, []int32{5000, 17}, false, false},
		// The cluster push with padding columns (head dims 96 and 40 in the
		// d128 and d64 kernels) and padding rows (MHA: 1 row of 16; GQA 3).
		{"bf16 mha d96 clusters of 4", core.Shape{DType: core.BFloat16, Batch: 2, SeqlenQ: 1, HeadsQ: 4, HeadsKV: 4, HeadDim: 96, SeqlenCache: 700, Seqlen: -1, NumSplits: 4}, []int32{700, 130}, false, false},
		{"fp16 gqa3 d40 clusters of 3", core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 6, HeadsKV: 2, HeadDim: 40, SeqlenCache: 900, Seqlen: -1, NumSplits: 3}, nil, false, false},
		{"fp16 r32 causal cluster of 5", core.Shape{DType: core.Float16, Batch: 2, SeqlenQ: 4, HeadsQ: 64, HeadsKV: 8, HeadDim: 128, SeqlenCache: 1500, Seqlen: 1499, NumSplits: 5}, nil, true, false},
		{"bf16 gqa5 causal ragged combine", core.Shape{DType: core.BFloat16, Batch: 3, SeqlenQ: 4, HeadsQ: 20, HeadsKV: 4, HeadDim: 64, SeqlenCache: 777, Seqlen: -1, NumSplits: 7}, []int32{0, 5, 777}, true, true},
		{"fp16 auto without clusters", core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1}, nil, false, true},
		// Many sequences of lengths ending anywhere in a key tile, in more
		// blocks than SMs.
		{"bf16 d256 ragged batch 36", core.Shape{DType: core.BFloat16, Batch: 36, SeqlenQ: 1, HeadsQ: 8, HeadsKV: 4, HeadDim: 256, SeqlenCache: 200, Seqlen: -1, NumSplits: 1}, ragged(36, 200), false, false},
		{"fp16 r32 causal ragged batch 9", core.Shape{DType: core.Float16, Batch: 9, SeqlenQ: 3, HeadsQ: 64, HeadsKV: 8, HeadDim: 128, SeqlenCache: 700, Seqlen: -1, NumSplits: 2}, ragged(9, 700), true, false},
		// More than 32 splits: the column-group combine, with the 8 column
		// groups of head dim 256 and empty splits in the shorter sequence.
		{"fp16 d256 48 splits, column-group combine", core.Shape{DType: core.Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 16, HeadsKV: 4, HeadDim: 256, SeqlenCache: 4000, Seqlen: -1, NumSplits: 48}, []int32{4000, 1234}, false, true},
	}
	r := rand.New(rand.NewPCG(1, 2))
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := gpu(t) // a subtest runs on its own goroutine: lock it and make the context current
			if tc.noCluster {
				withoutClusters(t, d)
			}
			s := tc.shape
			h := core.HostProblem{Shape: s, CacheSeqlens: tc.lens, Causal: tc.causal,
				Q: randomExact(r, s.Batch*s.SeqlenQ*s.HeadsQ*s.HeadDim),
				K: randomExact(r, s.Batch*s.SeqlenCache*s.HeadsKV*s.HeadDim),
				V: randomExact(r, s.Batch*s.SeqlenCache*s.HeadsKV*s.HeadDim)}
			// The largest scores in the last tile and mid-sequence: a kernel that
			// skips either's tile or split is far off (TestTolerancesSeeADroppedTile).
			plantKeys(&h, lastAndMiddle(s.SeqlenQ))
			want, wantLSE, err := core.NaiveAttention(&h)
			if err != nil {
				t.Fatal(err)
			}
			p := core.Problem{Shape: s, Causal: tc.causal,
				Q:   contiguous(upload(t, encode(s.DType, h.Q)), s.SeqlenQ, s.HeadsQ, s.HeadDim),
				K:   contiguous(upload(t, encode(s.DType, h.K)), s.SeqlenCache, s.HeadsKV, s.HeadDim),
				V:   contiguous(upload(t, encode(s.DType, h.V)), s.SeqlenCache, s.HeadsKV, s.HeadDim),
				Out: contiguous(upload(t, make([]uint16, len(h.Q))), s.SeqlenQ, s.HeadsQ, s.HeadDim),
				LSE: uintptr(upload(t, make([]float32, len(wantLSE))))}
			if tc.lens != nil {
				p.CacheSeqlens = uintptr(upload(t, tc.lens))
			}
			pl, err := PlanFor(s, 0)
			if err != nil {
				t.Fatal(err)
			}
			ws := upload(t, make([]byte, pl.WorkspaceBytes))
			// Both entry points: Decode, and Prepare once then Run.
			for _, prepared := range []bool{false, true} {
				if err := cu.MemsetD8(cu.DevicePtr(p.Out.Ptr), 0xff, int64(len(h.Q)*2)); err != nil {
					t.Fatal(err)
				}
				var ran core.Plan
				var err error
				if prepared {
					var r *Prepared
					l := core.LayoutOf(&p)
					if r, err = Prepare(&l, 0); err == nil {
						ran, err = r.Run(&Args{Q: p.Q.Ptr, K: p.K.Ptr, V: p.V.Ptr, Out: p.Out.Ptr, LSE: p.LSE,
							CacheSeqlens: p.CacheSeqlens, Workspace: uintptr(ws), WorkspaceBytes: pl.WorkspaceBytes}, s.Seqlen, 0)
					}
				} else {
					ran, err = Decode(&p, uintptr(ws), pl.WorkspaceBytes, 0, 0)
				}
				if err != nil {
					t.Fatal(err)
				} else if ran != pl || (tc.noCluster && pl.Cluster != 1) || (s.NumSplits == 16 && d.clusters(pl.Variant, 16) > 0 && pl.Cluster != 16) {
					// 16 splits merge in one cluster only where the device runs clusters of
					// 16 (sm_90 with non-portable sizes); sm_8x merges them in the combine.
					t.Fatalf("ran %v, planned %v", ran, pl)
				}
				if err := cu.Synchronize(); err != nil {
					t.Fatal(err)
				}
				checkOutputs(t, &p, pl, want, wantLSE)
			}
		})
	}
}

// ragged returns n lengths spread over (0, longest], the last one longest.
func ragged(n, longest int) []int32 {
	lens := make([]int32, n)
	for i := range lens {
		lens[i] = int32(longest * (i + 1) / n)
	}
	return lens
}

// checkOutputs compares p's out and lse on the device with the reference,
// within compareAttention's bounds.
func checkOutputs(t *testing.T, p *core.Problem, pl core.Plan, want, wantLSE []float64) {
	t.Helper()
	s := p.Shape
	outBits := make([]uint16, len(want))
	download(t, cu.DevicePtr(p.Out.Ptr), outBits)
	lse := make([]float32, len(wantLSE))
	download(t, cu.DevicePtr(p.LSE), lse)
	if _, err := compareAttention(s.DType, s.HeadDim, decode(s.DType, outBits), want, lse, wantLSE); err != nil {
		t.Fatalf("%v: %v", pl, err)
	}
}

// withoutClusters makes d plan as a GPU without clusters until the test ends.
func withoutClusters(t *testing.T, d *device) {
	old := d.maxCluster
	d.mu.Lock()
	d.maxCluster, d.plans = 1, map[core.Shape]planned{}
	d.mu.Unlock()
	t.Cleanup(func() {
		d.mu.Lock()
		d.maxCluster, d.plans = old, map[core.Shape]planned{}
		d.mu.Unlock()
	})
}

func TestDeviceClusters(t *testing.T) {
	d := gpu(t)
	major, err := cu.Device(0).Attribute(cu.ComputeCapabilityMajor)
	if err != nil {
		t.Fatal(err)
	}
	if major < 9 {
		if d.maxCluster != 1 {
			t.Fatalf("sm_%d0: maxCluster %d, want 1", major, d.maxCluster)
		}
		return
	}
	for _, v := range core.Variants() {
		k := d.fns[v.Kernel]
		t.Logf("%s (%d B in a cluster launch): clusters at once by size 2..16: %v", v.Kernel, v.ClusterSharedBytes, k.clusters[2:])
		if clusterLimit() == core.MaxCluster && (k.clusters[2] < 1 || k.clusters[8] < 1) {
			t.Errorf("%s: no clusters of 2 or 8 on sm_%d0: %v", v.Kernel, major, k.clusters)
		}
	}
}

func TestDecodeRejectsSmallWorkspace(t *testing.T) {
	gpu(t)
	s := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 8, HeadsKV: 8, HeadDim: 64, SeqlenCache: 1 << 16, Seqlen: -1, NumSplits: 32}
	q := upload(t, make([]uint16, 8*64))
	kv := upload(t, make([]uint16, 1<<16*8*64))
	out := upload(t, make([]uint16, 8*64))
	p := core.Problem{Shape: s, Q: contiguous(q, 1, 8, 64), K: contiguous(kv, 1<<16, 8, 64), V: contiguous(kv, 1<<16, 8, 64), Out: contiguous(out, 1, 8, 64)}
	_, err := Decode(&p, uintptr(q), 16, 0, 0)
	if !errors.Is(err, core.ErrInvalid) {
		t.Fatalf("Decode with a 16-byte workspace: err = %v, want ErrInvalid", err)
	}
}

// servingCase is a GPU test of the serving features: a HostProblem built
// from contiguous exact inputs, then paged or batch-indexed as asked.
type servingCase struct {
	name     string
	shape    core.Shape // SeqlenNew: tokens appended
	lens     []int32
	causal   bool
	pageSize int     // > 0: a paged cache, pages shuffled, 5 more than the sequences own
	batchIdx []int32 // cache rows of the sequences in a cache of len(batchIdx)+2 rows
	leftpad  []int32
	window   core.Window
	softcap  float32
	alibi    bool // (batch, nheads_q) slopes
	rotary   int  // rotary_dim
	neox     bool
}

// host builds the case's HostProblem.
func (c servingCase) host(r *rand.Rand) *core.HostProblem {
	s := c.shape
	row := s.HeadsKV * s.HeadDim
	h := &core.HostProblem{Shape: s, CacheSeqlens: c.lens, Causal: c.causal, CacheLeftpad: c.leftpad,
		Window: c.window, Softcap: c.softcap,
		Q: randomExact(r, s.Batch*s.SeqlenQ*s.HeadsQ*s.HeadDim),
		K: randomExact(r, s.Batch*s.SeqlenCache*row), V: randomExact(r, s.Batch*s.SeqlenCache*row)}
	if c.batchIdx != nil {
		rows := len(c.batchIdx) + 2
		h.CacheBatchIdx = c.batchIdx
		h.K, h.V = randomExact(r, rows*s.SeqlenCache*row), randomExact(r, rows*s.SeqlenCache*row)
	}
	if c.pageSize > 0 {
		per := s.SeqlenCache / c.pageSize
		pages := s.Batch*per + 5
		h.PageSize, h.BlockTable = c.pageSize, make([]int32, s.Batch*per)
		for i, p := range r.Perm(pages)[:len(h.BlockTable)] {
			h.BlockTable[i] = int32(p)
		}
		h.K, h.V = randomExact(r, pages*c.pageSize*row), randomExact(r, pages*c.pageSize*row)
	}
	if c.alibi {
		h.AlibiSlopes = randomExact(r, s.Batch*s.HeadsQ)
		for i := range h.AlibiSlopes {
			h.AlibiSlopes[i] = (h.AlibiSlopes[i] + 1) / 16
		}
	}
	if s.SeqlenNew > 0 {
		h.KNew, h.VNew = randomExact(r, s.Batch*s.SeqlenNew*row), randomExact(r, s.Batch*s.SeqlenNew*row)
	}
	if c.rotary > 0 {
		// Tables of exact values k/256: products with q and k are exact in
		// fp32, so the kernel's rotation rounds like the reference's.
		h.RotaryDim, h.RotaryInterleaved = c.rotary, !c.neox
		h.RotaryCos, h.RotarySin = randomExact(r, (s.SeqlenCache+8)*c.rotary/2), randomExact(r, (s.SeqlenCache+8)*c.rotary/2)
	}
	return h
}

// problem is the device problem of h, its arrays uploaded.
func (c servingCase) problem(t *testing.T, h *core.HostProblem) core.Problem {
	s := h.Shape
	dt := s.DType
	kvRows := len(h.K) / (s.HeadsKV * s.HeadDim)
	p := core.Problem{Shape: s, Causal: h.Causal, Window: h.Window, Softcap: h.Softcap,
		Q:   contiguous(upload(t, encode(dt, h.Q)), s.SeqlenQ, s.HeadsQ, s.HeadDim),
		K:   contiguous(upload(t, encode(dt, h.K)), s.SeqlenCache, s.HeadsKV, s.HeadDim),
		V:   contiguous(upload(t, encode(dt, h.V)), s.SeqlenCache, s.HeadsKV, s.HeadDim),
		Out: contiguous(upload(t, make([]uint16, len(h.Q))), s.SeqlenQ, s.HeadsQ, s.HeadDim),
		LSE: uintptr(upload(t, make([]float32, s.Batch*s.HeadsQ*s.SeqlenQ)))}
	p.Shape.SeqlenNew = 0 // PlanShape sets it from p.New
	if h.CacheSeqlens != nil {
		p.CacheSeqlens = uintptr(upload(t, h.CacheSeqlens))
	}
	if h.PageSize > 0 {
		p.PageSize, p.NumPages, p.MaxPages = h.PageSize, kvRows/h.PageSize, s.SeqlenCache/h.PageSize
		p.BlockTable, p.BlockTableStride = uintptr(upload(t, h.BlockTable)), int64(p.MaxPages)
		p.K = contiguous(cu.DevicePtr(p.K.Ptr), h.PageSize, s.HeadsKV, s.HeadDim)
		p.V = contiguous(cu.DevicePtr(p.V.Ptr), h.PageSize, s.HeadsKV, s.HeadDim)
	}
	if h.CacheBatchIdx != nil {
		p.CacheBatch, p.CacheBatchIdx = kvRows/s.SeqlenCache, uintptr(upload(t, h.CacheBatchIdx))
	}
	if h.CacheLeftpad != nil {
		p.Leftpad, p.CacheLeftpad = true, uintptr(upload(t, h.CacheLeftpad))
	}
	if h.AlibiSlopes != nil {
		p.Alibi, p.AlibiSlopes, p.AlibiBatchStride = true, uintptr(upload(t, h.AlibiSlopes)), int64(s.HeadsQ)
	}
	if n := s.SeqlenNew; n > 0 {
		p.New = core.Append{Seqlen: n,
			K: contiguous(upload(t, encode(dt, h.KNew)), n, s.HeadsKV, s.HeadDim),
			V: contiguous(upload(t, encode(dt, h.VNew)), n, s.HeadsKV, s.HeadDim)}
	}
	if h.RotaryDim > 0 {
		p.Rotary = core.Rotary{Dim: h.RotaryDim, Rows: len(h.RotaryCos) / (h.RotaryDim / 2), Stride: int64(h.RotaryDim / 2),
			Interleaved: h.RotaryInterleaved,
			Cos:         uintptr(upload(t, encode(dt, h.RotaryCos))), Sin: uintptr(upload(t, encode(dt, h.RotarySin)))}
	}
	return p
}

// shape is a case's Shape: every sequence of the whole cache unless its
// lengths say otherwise, seqlenNew tokens appended.
func shape(dt core.DType, batch, sq, hq, hkv, d, cache, splits, seqlenNew int) core.Shape {
	return core.Shape{DType: dt, Batch: batch, SeqlenQ: sq, HeadsQ: hq, HeadsKV: hkv, HeadDim: d, SeqlenCache: cache,
		Seqlen: -1, NumSplits: splits, SeqlenNew: seqlenNew}
}

// TestDecodeServingMatchesNaiveAttention runs the serving kernels (the
// append, then stage 1 and its merge) against naive attention, and checks
// the caches after the append against ReferenceAppend exactly.
func TestDecodeServingMatchesNaiveAttention(t *testing.T) {
	gpu(t) // skips without a GPU
	f16, bf16 := core.Float16, core.BFloat16
	tests := []servingCase{
		{name: "bf16 d128 paged 16 causal", shape: shape(bf16, 3, 4, 32, 8, 128, 2048, 0, 0), lens: []int32{2048, 700, 1}, causal: true, pageSize: 16},
		{name: "f16 d64 paged 5, 7 splits", shape: shape(f16, 2, 1, 8, 2, 64, 1000, 7, 0), lens: []int32{999, 333}, pageSize: 5},
		{name: "f16 d128 cache_batch_idx, leftpad", shape: shape(f16, 3, 2, 16, 4, 128, 900, 0, 0), lens: []int32{900, 100, 640},
			batchIdx: []int32{4, 0, 2}, leftpad: []int32{0, 99, 300}},
		{name: "bf16 d128 window 300 causal, softcap, alibi", shape: shape(bf16, 2, 3, 32, 8, 128, 5000, 0, 0), lens: []int32{5000, 2000},
			causal: true, window: core.Window{Enabled: true, Left: 300, Right: -1}, softcap: 20, alibi: true},
		{name: "f16 d256 window (64, 8), 16 splits", shape: shape(f16, 1, 8, 8, 1, 256, 3000, 16, 0), window: core.Window{Enabled: true, Left: 64, Right: 8}},
		{name: "f16 d128 append 3, rotary, causal", shape: shape(f16, 2, 4, 16, 4, 128, 1024, 0, 3), lens: []int32{500, 0}, causal: true, rotary: 64},
		{name: "bf16 d64 paged 8, append 2, rotary neox", shape: shape(bf16, 2, 1, 8, 8, 64, 512, 0, 2), lens: []int32{200, 510}, pageSize: 8, rotary: 32, neox: true},
		{name: "f16 d128 r32 append 16, rotary, window, 5 splits", shape: shape(f16, 2, 4, 64, 8, 128, 2000, 5, 16), lens: []int32{1000, 1984},
			rotary: 128, window: core.Window{Enabled: true, Left: 100, Right: 0}},
		{name: "bf16 d256 cache_batch_idx, append 1", shape: shape(bf16, 2, 1, 4, 2, 256, 300, 0, 1), lens: []int32{299, 10}, batchIdx: []int32{1, 3}},
		{name: "f16 d128 everything, paged 32", shape: shape(f16, 3, 2, 32, 8, 128, 4096, 0, 2), lens: []int32{4000, 64, 2500}, causal: true,
			pageSize: 32, leftpad: []int32{10, 0, 1000}, window: core.Window{Enabled: true, Left: 1500, Right: -1}, softcap: 15, alibi: true, rotary: 64},
	}
	r := rand.New(rand.NewPCG(3, 4))
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			gpu(t)
			h := tc.host(r)
			want, wantLSE, err := core.NaiveAttention(h)
			if err != nil {
				t.Fatal(err)
			}
			wantK, wantV, _, err := core.ReferenceAppend(h)
			if err != nil {
				t.Fatal(err)
			}
			p := tc.problem(t, h)
			pl, err := PlanFor(p.PlanShape(), 0)
			if err != nil {
				t.Fatal(err)
			}
			if !pl.Variant.Form.Serving() {
				t.Fatalf("planned %v, not a serving form", pl)
			}
			decodeBothWays(t, &p, pl, want, wantLSE)
			for _, c := range []struct {
				name string
				ptr  uintptr
				want []float32
			}{{"k_cache", p.K.Ptr, wantK}, {"v_cache", p.V.Ptr, wantV}} {
				bits := make([]uint16, len(c.want))
				download(t, cu.DevicePtr(c.ptr), bits)
				for i, got := range decode(p.DType, bits) {
					if got != c.want[i] {
						t.Fatalf("%s[%d] = %v after the append, want %v", c.name, i, got, c.want[i])
					}
				}
			}
		})
	}
}

// decodeBothWays runs p (its arrays uploaded) as planned by pl through
// Decode, then through Prepare and Run (an append writes the same tokens
// again), and checks each result against the reference (checkOutputs).
func decodeBothWays(t *testing.T, p *core.Problem, pl core.Plan, want, wantLSE []float64) {
	t.Helper()
	ws := upload(t, make([]byte, pl.WorkspaceBytes))
	for _, prepared := range []bool{false, true} {
		if err := cu.MemsetD8(cu.DevicePtr(p.Out.Ptr), 0xff, int64(len(want)*2)); err != nil {
			t.Fatal(err)
		}
		var ran core.Plan
		var err error
		if prepared {
			l := core.LayoutOf(p)
			pr, err := Prepare(&l, 0)
			if err != nil {
				t.Fatal(err)
			}
			ran, err = pr.Run(&Args{Q: p.Q.Ptr, K: p.K.Ptr, V: p.V.Ptr, Out: p.Out.Ptr, LSE: p.LSE, CacheSeqlens: p.CacheSeqlens,
				BlockTable: p.BlockTable, CacheBatchIdx: p.CacheBatchIdx, CacheLeftpad: p.CacheLeftpad, AlibiSlopes: p.AlibiSlopes,
				KNew: p.New.K.Ptr, VNew: p.New.V.Ptr, RotaryCos: p.Rotary.Cos, RotarySin: p.Rotary.Sin, Sinks: p.Sinks,
				Workspace: uintptr(ws), WorkspaceBytes: pl.WorkspaceBytes}, p.Seqlen, 0)
			if err != nil {
				t.Fatal(err)
			}
		} else if ran, err = Decode(p, uintptr(ws), pl.WorkspaceBytes, 0, 0); err != nil {
			t.Fatal(err)
		}
		if ran != pl {
			t.Fatalf("ran %v, planned %v", ran, pl)
		}
		if err := cu.Synchronize(); err != nil {
			t.Fatal(err)
		}
		checkOutputs(t, p, pl, want, wantLSE)
	}
}

// Decode makes its device's context current for the launches only: a thread
// with no context current (or another one) finds it so again afterwards.
func TestDecodeRestoresTheCallersContext(t *testing.T) {
	gpu(t)
	s := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 8, HeadsKV: 8, HeadDim: 64, SeqlenCache: 256, Seqlen: -1}
	q := upload(t, make([]uint16, 8*64))
	kv := upload(t, make([]uint16, 256*8*64))
	out := upload(t, make([]uint16, 8*64))
	p := core.Problem{Shape: s, Q: contiguous(q, 1, 8, 64), K: contiguous(kv, 256, 8, 64), V: contiguous(kv, 256, 8, 64), Out: contiguous(out, 1, 8, 64)}
	if err := cu.SetCurrentContext(cu.CUContext{}); err != nil {
		t.Fatal(err)
	}
	if _, err := Decode(&p, 0, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	if ctx, err := cu.CurrentContext(); err != nil || ctx != (cu.CUContext{}) {
		t.Fatalf("after Decode the current context is %v (err %v), want none", ctx, err)
	}
}
