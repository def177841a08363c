package cuda

import (
	"encoding/binary"
	"slices"
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

// sassArchitectures are the SASS images gen.go's nvcc line (and fd_cuda12.py's
// ARCHS) put in the fatbin.
var sassArchitectures = []int{80, 86, 89, 90, 100, 120}

// fatbinImage is one entry of a fatbin: SASS (an ELF image) or PTX, for arch,
// its payload compressed or not.
type fatbinImage struct {
	sass       bool
	arch       int
	compressed bool
	payload    string
}

// fatbinImages walks the fatbin's containers (a 16-byte header: magic,
// version, header size, payload size) and their entries (kind, header size,
// payload size, ..., arch at 28, flags at 40: 0x2000 LZ4, 0x8000 zstd).
func fatbinImages(t *testing.T, img string) []fatbinImage {
	var out []fatbinImage
	b := []byte(img)
	for off := 0; off+16 <= len(b) && binary.LittleEndian.Uint32(b[off:]) == 0xBA55ED50; {
		end := off + int(binary.LittleEndian.Uint16(b[off+6:])) + int(binary.LittleEndian.Uint64(b[off+8:]))
		for p := off + int(binary.LittleEndian.Uint16(b[off+6:])); p+64 <= end; {
			hdr := int(binary.LittleEndian.Uint32(b[p+4:]))
			size := int(binary.LittleEndian.Uint64(b[p+8:]))
			if p+hdr+size > end {
				t.Fatalf("fatbin entry at %d runs past its container", p)
			}
			out = append(out, fatbinImage{sass: binary.LittleEndian.Uint16(b[p:]) == 2,
				arch:       int(binary.LittleEndian.Uint32(b[p+28:])),
				compressed: binary.LittleEndian.Uint64(b[p+40:])&(0x2000|0x8000) != 0,
				payload:    img[p+hdr : p+hdr+size]})
			p += hdr + size
		}
		off = end
	}
	return out
}

// TestFatbinHoldsEveryKernel: the embedded fatbin holds SASS for each of
// sassArchitectures, and every kernel the variant table and the merge API
// launch is in each of its plain SASS images, by the name the launch looks up
// (a NUL-terminated symbol name in each image's string table), so a table
// entry the kernels do not instantiate fails here rather than on a GPU's
// first call. Both builds store the sm_100 and sm_120 images compressed
// (nvcc 13: zstd, nvFatbin 12.8: LZ4); they come from the same source, kernel
// list and PTX as the sm_90 one.
func TestFatbinHoldsEveryKernel(t *testing.T) {
	img, err := kernelImage()
	if err != nil {
		t.Skip(err)
	}
	var archs []int
	var plain []fatbinImage
	for _, f := range fatbinImages(t, img) {
		if f.sass {
			archs = append(archs, f.arch)
			if !f.compressed {
				plain = append(plain, f)
			}
		}
	}
	slices.Sort(archs)
	if !slices.Equal(archs, sassArchitectures) || len(plain) == 0 {
		t.Fatalf("the fatbin's SASS is for %v (%d plain), want %v", archs, len(plain), sassArchitectures)
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
		for _, f := range plain {
			if !strings.Contains(f.payload, "\x00"+n+"\x00") {
				t.Errorf("%s: not in the fatbin's sm_%d SASS", n, f.arch)
			}
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
