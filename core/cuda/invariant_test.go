package cuda

import (
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/flash-decode/flash-decode/core"
	"gorgonia.org/cu"
)

// invariantCase is a layout of batch-invariant calls: one sequence of
// length keys, decoded alone and in random batches.
type invariantCase struct {
	name                              string
	dt                                core.DType
	seqlenQ, headsQ, headsKV, headDim int
	length                            int
	pageSize                          int // > 0: a paged cache
	causal                            bool
}

// invariantRun is one call: the sequence at pos of a batch whose other
// sequences have lengths lens (lens[pos] is the sequence's), in a cache of
// cacheLen keys a sequence, planned for max_seqlen_k bound (-1: the
// cache). Batch 1 without an array: the length on the host.
type invariantRun struct {
	batch, pos, cacheLen, bound int
	lens                        []int32
}

// TestInvariantBitsAcrossBatches decodes one sequence alone and at a random
// place in random batches of 1-256 sequences of random lengths, caches and
// bounds, contiguous and paged: its output and LSE bits never change, and
// alone it matches naive attention.
func TestInvariantBitsAcrossBatches(t *testing.T) {
	gpu(t) // skips without a GPU
	f16, bf16 := core.Float16, core.BFloat16
	cases := []invariantCase{
		{name: "f16 d128 GQA 4, 9 splits", dt: f16, seqlenQ: 1, headsQ: 8, headsKV: 2, headDim: 128, length: 4500},
		{name: "bf16 d64 MQA 3 tokens causal, one split", dt: bf16, seqlenQ: 3, headsQ: 8, headsKV: 1, headDim: 64, length: 700, causal: true},
		{name: "f16 d128 paged 16, GQA 8 2 tokens", dt: f16, seqlenQ: 2, headsQ: 16, headsKV: 2, headDim: 128, length: 9000, pageSize: 16, causal: true},
		{name: "bf16 d256 paged 64, 32 rows in 2 row tiles", dt: bf16, seqlenQ: 4, headsQ: 16, headsKV: 2, headDim: 256, length: 3333, pageSize: 64},
	}
	r := rand.New(rand.NewPCG(7, 8))
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			gpu(t)
			row := c.headsKV * c.headDim
			q := randomExact(r, c.seqlenQ*c.headsQ*c.headDim)
			k, v := randomExact(r, c.length*row), randomExact(r, c.length*row)
			alone := invariantRun{batch: 1, cacheLen: c.roundUp(c.length), bound: -1}
			out, lse := c.run(t, r, alone, q, k, v)

			h := core.HostProblem{Shape: c.shape(alone), Causal: c.causal, Q: q, K: k, V: v}
			h.Shape.SeqlenCache, h.Shape.Seqlen = c.length, c.length
			want, wantLSE, err := core.NaiveAttention(&h)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := compareAttention(c.dt, c.headDim, decode(c.dt, out), want, lse, wantLSE); err != nil {
				t.Fatalf("alone: %v", err)
			}

			for i := range 8 {
				run := invariantRun{batch: 1 + r.IntN(256)}
				run.pos = r.IntN(run.batch)
				run.cacheLen = c.roundUp(c.length + r.IntN(2)*r.IntN(3*c.length))
				run.lens = make([]int32, run.batch)
				for b := range run.lens {
					run.lens[b] = int32(r.IntN(run.cacheLen + 1))
				}
				run.lens[run.pos] = int32(c.length)
				run.bound = -1
				if i%2 == 1 { // max_seqlen_k: at least every length
					run.bound = int(run.lens[0])
					for _, n := range run.lens {
						run.bound = max(run.bound, int(n))
					}
				}
				gotOut, gotLSE := c.run(t, r, run, q, k, v)
				for j := range out {
					if gotOut[j] != out[j] {
						t.Fatalf("batch %d (at %d, cache %d, bound %d): out[%d] bits %#x, alone %#x", run.batch, run.pos, run.cacheLen, run.bound, j, gotOut[j], out[j])
					}
				}
				for j := range lse {
					if math.Float32bits(gotLSE[j]) != math.Float32bits(lse[j]) {
						t.Fatalf("batch %d (at %d, cache %d, bound %d): lse[%d] %v, alone %v", run.batch, run.pos, run.cacheLen, run.bound, j, gotLSE[j], lse[j])
					}
				}
			}
		})
	}
}

// roundUp is n keys rounded up to whole pages.
func (c invariantCase) roundUp(n int) int {
	if c.pageSize == 0 {
		return n
	}
	return (n + c.pageSize - 1) / c.pageSize * c.pageSize
}

func (c invariantCase) shape(run invariantRun) core.Shape {
	return core.Shape{DType: c.dt, Batch: run.batch, SeqlenQ: c.seqlenQ, HeadsQ: c.headsQ, HeadsKV: c.headsKV,
		HeadDim: c.headDim, SeqlenCache: run.cacheLen, Seqlen: run.bound, DeviceLengths: run.lens != nil, BatchInvariant: true}
}

// run decodes the sequence (q, k, v) in run and returns its rows of out
// (bits) and lse. The other sequences' q and keys are a constant; paged,
// their pages are any of the pool's, the sequence's own among them.
func (c invariantCase) run(t *testing.T, r *rand.Rand, run invariantRun, q, k, v []float32) ([]uint16, []float32) {
	t.Helper()
	s := c.shape(run)
	if run.lens == nil {
		s.Seqlen = c.length
	}
	qRow, row := c.seqlenQ*c.headsQ*c.headDim, c.headsKV*c.headDim
	// The batch's caches are large: freed as the call returns, not as the test ends.
	var held []cu.DevicePtr
	defer func() {
		for _, p := range held {
			cu.MemFree(p)
		}
	}()
	fill := func(n int, at int, x []float32) cu.DevicePtr {
		p, err := cu.MemAlloc(int64(max(2*n, 256)))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, p)
		if err := cu.MemsetD16(p, 0x3c00, int64(n)); err != nil { // a constant (1.0 in fp16)
			t.Fatal(err)
		}
		h := encode(c.dt, x)
		if err := cu.MemcpyHtoD(p+cu.DevicePtr(2*at), unsafe.Pointer(&h[0]), int64(2*len(h))); err != nil {
			t.Fatal(err)
		}
		return p
	}
	p := core.Problem{Shape: s, Causal: c.causal,
		Q:   contiguous(fill(run.batch*qRow, run.pos*qRow, q), c.seqlenQ, c.headsQ, c.headDim),
		Out: contiguous(upload(t, make([]uint16, run.batch*qRow)), c.seqlenQ, c.headsQ, c.headDim),
		LSE: uintptr(upload(t, make([]float32, run.batch*c.headsQ*c.seqlenQ)))}
	if run.lens != nil {
		p.CacheSeqlens = uintptr(upload(t, run.lens))
	}
	if c.pageSize == 0 {
		at := run.pos * run.cacheLen * row
		p.K = contiguous(fill(run.batch*run.cacheLen*row, at, k), run.cacheLen, c.headsKV, c.headDim)
		p.V = contiguous(fill(run.batch*run.cacheLen*row, at, v), run.cacheLen, c.headsKV, c.headDim)
	} else {
		// A pool of the sequence's pages and 8 more, its pages shuffled.
		own, maxPages := c.roundUp(c.length)/c.pageSize, run.cacheLen/c.pageSize
		pages := own + 8
		perm := r.Perm(pages)
		kPaged, vPaged := make([]float32, pages*c.pageSize*row), make([]float32, pages*c.pageSize*row)
		for i := range kPaged {
			kPaged[i], vPaged[i] = 1, 1
		}
		for j := range own {
			n := min(c.pageSize, c.length-j*c.pageSize) * row
			copy(kPaged[perm[j]*c.pageSize*row:], k[j*c.pageSize*row:][:n])
			copy(vPaged[perm[j]*c.pageSize*row:], v[j*c.pageSize*row:][:n])
		}
		table := make([]int32, run.batch*maxPages)
		for i := range table {
			table[i] = int32(r.IntN(pages))
		}
		for j := range own {
			table[run.pos*maxPages+j] = int32(perm[j])
		}
		p.K = contiguous(fill(len(kPaged), 0, kPaged), c.pageSize, c.headsKV, c.headDim)
		p.V = contiguous(fill(len(vPaged), 0, vPaged), c.pageSize, c.headsKV, c.headDim)
		p.PageSize, p.NumPages, p.MaxPages = c.pageSize, pages, maxPages
		p.BlockTable, p.BlockTableStride = uintptr(upload(t, table)), int64(maxPages)
	}
	pl, err := PlanFor(p.PlanShape(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if pl.InvariantTiles == 0 {
		t.Fatalf("not a batch-invariant plan: %v", pl)
	}
	ws := upload(t, make([]byte, pl.WorkspaceBytes))
	if _, err := Decode(&p, uintptr(ws), pl.WorkspaceBytes, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := cu.Synchronize(); err != nil {
		t.Fatal(err)
	}
	out := make([]uint16, qRow)
	download(t, cu.DevicePtr(p.Out.Ptr)+cu.DevicePtr(2*run.pos*qRow), out)
	lse := make([]float32, c.headsQ*c.seqlenQ)
	download(t, cu.DevicePtr(p.LSE)+cu.DevicePtr(4*run.pos*len(lse)), lse)
	return out, lse
}

// TestInvariantParams: a batch-invariant plan hands the kernels its tile
// budget, MaxSplits, stage 1's tile keys and a window's cap, and no other
// mode's fields; other plans leave the budget 0.
func TestInvariantParams(t *testing.T) {
	for _, tc := range launchCases() {
		p := tc.p
		pl, err := core.MakePlan(p.PlanShape(), core.H200)
		if err != nil {
			t.Fatal(err)
		}
		k := params(&p, &pl, 10<<30)
		if !p.BatchInvariant {
			if k.invariant_tiles != 0 {
				t.Errorf("%s: invariant_tiles %d without batch_invariant", tc.name, k.invariant_tiles)
			}
			continue
		}
		if int(k.invariant_tiles) != pl.InvariantTiles || int(k.invariant_max_splits) != core.MaxSplits ||
			int(k.balance_tile_keys) != pl.Variant.KeysPerTile || k.balance_splits != 0 || k.whole_items != 0 ||
			int(k.num_splits) != pl.NumSplits || int(k.invariant_span_tiles) != pl.InvariantSpanTiles {
			t.Errorf("%s: params %+v for plan %v", tc.name, k, pl)
		}
	}
}
