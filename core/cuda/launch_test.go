package cuda

import (
	"strings"
	"testing"

	"github.com/flash-decode/flash-decode/core"
)

// The device's page division must equal n / d for every key below 2^31; the
// hard cases are the keys at and just below each multiple of d, and the
// largest keys.
func TestPageDivider(t *testing.T) {
	for _, d := range []int{1, 2, 3, 7, 15, 16, 17, 100, 255, 256, 257, 1000, 4096, 65535, 1 << 20, 1<<31 - 1} {
		m, l := pageDivider(d)
		div := func(n uint32) uint32 { return uint32((uint64(n)*uint64(m))>>32+uint64(n)) >> l }
		check := func(n uint32) {
			if got, want := div(n), n/uint32(d); got != want {
				t.Fatalf("d=%d: %d / d = %d, want %d (m=%d, l=%d)", d, n, got, want, m, l)
			}
		}
		for n := uint32(0); n < 1<<14; n++ {
			check(n)
		}
		for q := uint64(1); q*uint64(d) < 1<<31; q = q*3 + 1 {
			for _, n := range []uint64{q*uint64(d) - 1, q * uint64(d), q*uint64(d) + 1} {
				if n < 1<<31 {
					check(uint32(n))
				}
			}
		}
		for n := uint32(1<<31 - 1); n > 1<<31-1<<12; n-- {
			check(n)
		}
	}
}

// sassArchitectures is how many SASS images gen.go's nvcc line puts in the
// fatbin (sm_80, sm_86, sm_89, sm_90).
const sassArchitectures = 4

// TestFatbinHoldsEveryKernel: every kernel the variant table and the merge
// API launch is in each SASS image of the embedded fatbin, by the name the
// launch looks up (a NUL-terminated symbol name in each image's string
// table), so a table entry the kernels do not instantiate fails here rather
// than on a GPU's first call.
func TestFatbinHoldsEveryKernel(t *testing.T) {
	img, err := kernelImage()
	if err != nil {
		t.Skip(err)
	}
	names := map[string]bool{}
	for _, v := range core.Variants() {
		for _, n := range []string{v.Kernel, v.Combine, v.CombineWide, v.CombineNarrow, v.CombineNarrowDense, v.Append} {
			if n != "" {
				names[n] = true
			}
		}
		for _, n := range []string{v.Combine, v.CombineWide, v.CombineNarrow, v.CombineNarrowDense} {
			if n != "" {
				names[core.BalancedCombine(n)] = true
			}
		}
	}
	for _, dt := range []core.DType{core.Float16, core.BFloat16, core.Float32} {
		names[core.MergeKernel(dt)] = true
	}
	for n := range names {
		if c := strings.Count(img, "\x00"+n+"\x00"); c < sassArchitectures {
			t.Errorf("%s: in %d of the fatbin's %d SASS images", n, c, sassArchitectures)
		}
	}
}

// TestLayoutParamsReadNoAddress: a Prepared keeps layoutParams from call to
// call and sets only the addresses and the length (setCall), so
// layoutParams must depend on neither, and the two must give params' struct.
func TestLayoutParamsReadNoAddress(t *testing.T) {
	const ws = uintptr(10) << 30
	for _, tc := range launchCases() {
		p := tc.p
		pl, err := core.MakePlan(p.PlanShape(), core.H200)
		if err != nil {
			t.Fatal(err)
		}
		zero := p
		zero.Q.Ptr, zero.K.Ptr, zero.V.Ptr, zero.Out.Ptr, zero.LSE, zero.CacheSeqlens = 0, 0, 0, 0, 0, 0
		zero.BlockTable, zero.CacheBatchIdx, zero.CacheLeftpad, zero.AlibiSlopes = 0, 0, 0, 0
		zero.New.K.Ptr, zero.New.V.Ptr, zero.Rotary.Cos, zero.Rotary.Sin, zero.Sinks, zero.CuSeqlensQ = 0, 0, 0, 0, 0, 0
		zero.Seqlen = 7
		k := layoutParams(&zero, &pl)
		if k != layoutParams(&p, &pl) {
			t.Errorf("%s: layoutParams reads an address or the length", tc.name)
		}
		setCall(&k, &p, &pl, ws)
		if k != params(&p, &pl, ws) {
			t.Errorf("%s: layoutParams and setCall differ from params", tc.name)
		}
		if k == layoutParams(&p, &pl) {
			t.Errorf("%s: setCall set no address", tc.name)
		}
	}
}

// TestRaggedParams: ragged query lengths hand the kernels cu_seqlens_q,
// total_q, the flattened tensors' zero batch strides and lse's (heads_q,
// total_q) strides; other calls get no offsets and lse (batch, heads_q,
// seqlen_q).
func TestRaggedParams(t *testing.T) {
	ragged := 0
	for _, tc := range launchCases() {
		p := tc.p
		if err := p.Validate(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		pl, err := core.MakePlan(p.PlanShape(), core.H200)
		if err != nil {
			t.Fatal(err)
		}
		k := params(&p, &pl, 10<<30)
		if !p.Ragged {
			if k.cu_seqlens_q != 0 || k.total_q != 0 || int(k.lse_batch_stride) != p.HeadsQ*p.SeqlenQ || int(k.lse_head_stride) != p.SeqlenQ {
				t.Errorf("%s: cu_seqlens_q %#x, total_q %d, lse strides %d, %d", tc.name, k.cu_seqlens_q, k.total_q, k.lse_batch_stride, k.lse_head_stride)
			}
			continue
		}
		ragged++
		if uintptr(k.cu_seqlens_q) != p.CuSeqlensQ || int(k.total_q) != p.TotalQ || k.lse_batch_stride != 0 ||
			int(k.lse_head_stride) != p.TotalQ || k.q_batch_stride != 0 || k.out_batch_stride != 0 ||
			k.k_new_batch_stride != 0 || int(k.seqlen_q) != p.SeqlenQ {
			t.Errorf("%s: params %+v", tc.name, k)
		}
	}
	if ragged == 0 {
		t.Error("no ragged launch case")
	}
}
