package cuda

import (
	"testing"

	"github.com/flash-decode/flash-decode/core"
)

// TestPrepareFP8WithoutGPU: a layout of an fp8 cache with descale arrays
// prepares and plans without a GPU, and Run checks each call's arrays.
func TestPrepareFP8WithoutGPU(t *testing.T) {
	p := preparedLayout()
	p.KVDType, p.DescaleArrays = core.Float8E4M3, true
	p.KDescale, p.VDescale = core.Descale{BatchStride: 8, HeadStride: 1}, core.Descale{HeadStride: 1}
	l := core.LayoutOf(&p)
	r, err := Prepare(&l, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Problem(); got.KVDType != core.Float8E4M3 || !got.DescaleArrays || got.KDescale != p.KDescale {
		t.Fatalf("Problem() = %+v", got)
	}
	ok := Args{Q: 0x10000, K: 0x1000000, V: 0x3000000, Out: 0x20000, KDescale: 0x50000, VDescale: 0x60000}
	for _, tt := range []struct {
		name string
		edit func(*Args)
		arg  string
	}{
		{"null k_descale", func(a *Args) { a.KDescale = 0 }, "k_descale"},
		{"null v_descale", func(a *Args) { a.VDescale = 0 }, "v_descale"},
		{"k_descale at 64", func(a *Args) { a.KDescale = 64 }, "k_descale"},
		{"misaligned v_descale", func(a *Args) { a.VDescale += 2 }, "v_descale"},
		{"out over k_descale", func(a *Args) { a.Out = 0x50000 - 0x100 }, "out"},
	} {
		a := ok
		tt.edit(&a)
		_, err := r.Run(&a, -1, 0)
		checkErr(t, tt.name, err, tt.arg, core.ErrInvalid)
		_, err = DecodeLayout(&l, 0, &a, -1, 0)
		checkErr(t, tt.name+" (DecodeLayout)", err, tt.arg, core.ErrInvalid)
	}

	// One value each: no arrays in a call.
	v := preparedLayout()
	v.KVDType, v.KDescale.Value = core.Float8E5M2, 0.25
	lv := core.LayoutOf(&v)
	rv, err := Prepare(&lv, -1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rv.Plan(-1); err != nil {
		t.Errorf("Plan: %v", err)
	}
	a := ok
	a.VDescale = 0
	_, err = DecodeLayout(&lv, 0, &a, -1, 0)
	checkErr(t, "k_descale without arrays", err, "k_descale", core.ErrInvalid)

	// Layouts differing only in a descale are separate handles.
	var hs Handles
	h1, err1 := hs.Prepare(&lv, -1)
	other := lv
	other.KDescaleValue = 0.5
	h2, err2 := hs.Prepare(&other, -1)
	if err1 != nil || err2 != nil || h1 == h2 {
		t.Errorf("two descale values: handles %d, %d (%v, %v)", h1, h2, err1, err2)
	}
	bad := lv
	bad.KVDType = 0
	_, err = Prepare(&bad, -1)
	checkErr(t, "a descale value with a float16 cache", err, "k_descale", core.ErrInvalid)
}
