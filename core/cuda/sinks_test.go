package cuda

import (
	"math/rand/v2"
	"testing"

	"github.com/flash-decode/flash-decode/core"
)

// TestPrepareSinksWithoutGPU: a layout with sinks keeps them, and each
// call passes the sinks array exactly when its layout has sinks.
func TestPrepareSinksWithoutGPU(t *testing.T) {
	p := preparedLayout()
	p.HasSinks = true
	l := core.LayoutOf(&p)
	r, err := Prepare(&l, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Problem(); !got.HasSinks || got.Sinks != 0 {
		t.Fatalf("Problem() = %+v", got)
	}
	plain := l
	plain.Sinks = 0
	ok := Args{Q: 0x10000, K: 0x1000000, V: 0x3000000, Out: 0x20000, Sinks: 0x60000}
	for _, tt := range []struct {
		name   string
		layout *core.Layout
		edit   func(*Args)
	}{
		{"null sinks", &l, func(a *Args) { a.Sinks = 0 }},
		{"sinks at 64", &l, func(a *Args) { a.Sinks = 64 }},
		{"misaligned sinks", &l, func(a *Args) { a.Sinks += 2 }},
		{"out over sinks", &l, func(a *Args) { a.Sinks = a.Out }},
		{"sinks not in the layout", &plain, func(a *Args) {}},
	} {
		a := ok
		tt.edit(&a)
		_, err := DecodeLayout(tt.layout, 0, &a, -1, 0)
		if tt.name == "out over sinks" {
			checkErr(t, tt.name, err, "out", core.ErrInvalid)
			continue
		}
		checkErr(t, tt.name, err, "sinks", core.ErrInvalid)
	}
	_, err = r.Run(&Args{Q: 0x10000, K: 0x1000000, V: 0x3000000, Out: 0x20000}, -1, 0)
	checkErr(t, "Run without sinks", err, "sinks", core.ErrInvalid)
}

// sinkCase is a GPU test of sinks: a servingCase (any form) and the plan's
// reduce path.
type sinkCase struct {
	servingCase
	noCluster bool // plan as on a GPU without clusters: the combine kernel merges
}

// TestDecodeSinksMatchesNaiveAttention runs sinks through every form and
// every way a row's splits meet (one split written by stage 1, per item or
// by row; the combines; the cluster merge, pull and push; whole items and
// a split tail; balanced splits) against naive attention with the sinks,
// through Decode and through Prepare and Run. Rows that see no key get
// out 0 and lse their sink.
func TestDecodeSinksMatchesNaiveAttention(t *testing.T) {
	gpu(t) // skips without a GPU
	f16, bf16 := core.Float16, core.BFloat16
	lengths := shape(f16, 8, 1, 16, 2, 64, 32768, 0, 0)
	lengths.DeviceLengths = true
	tests := []sinkCase{
		{servingCase: servingCase{name: "f16 d128 auto: clusters", shape: shape(f16, 2, 1, 32, 8, 128, 3000, 0, 0), lens: []int32{2999, 1}}},
		{servingCase: servingCase{name: "f16 d128 auto: narrow combine", shape: shape(f16, 2, 1, 32, 8, 128, 3000, 0, 0), lens: []int32{2999, 1}}, noCluster: true},
		{servingCase: servingCase{name: "bf16 d64 causal, empty rows, 7 splits", shape: shape(bf16, 3, 4, 20, 4, 64, 777, 7, 0), lens: []int32{0, 5, 777}, causal: true}},
		{servingCase: servingCase{name: "f16 r32 causal, cluster of 5", shape: shape(f16, 1, 4, 64, 8, 128, 1500, 5, 0), causal: true}},
		{servingCase: servingCase{name: "f16 r32 causal, 5 splits, 16-row combine", shape: shape(f16, 1, 4, 64, 8, 128, 1500, 5, 0), causal: true}, noCluster: true},
		{servingCase: servingCase{name: "f16 d128 16 splits, 4-warp combine", shape: shape(f16, 1, 1, 32, 8, 128, 8192, 16, 0), lens: []int32{8000}}, noCluster: true},
		{servingCase: servingCase{name: "f16 d256 48 splits, column-group combine", shape: shape(f16, 2, 1, 16, 4, 256, 4000, 48, 0), lens: []int32{4000, 1234}}},
		{servingCase: servingCase{name: "f16 d64 whole items and a split tail", shape: shape(f16, 40, 1, 32, 8, 64, 2048, 0, 0), lens: ragged(40, 2048)}},
		{servingCase: servingCase{name: "bf16 d64 one split, empty row", shape: shape(bf16, 4, 1, 8, 2, 64, 1000, 1, 0), lens: []int32{1000, 0, 17, 500}}},
		{servingCase: servingCase{name: "f16 r32 one split causal, empty rows", shape: shape(f16, 2, 4, 64, 8, 128, 600, 1, 0), lens: []int32{600, 2}, causal: true}},
		{servingCase: servingCase{name: "f16 d64 splits balanced by the lengths", shape: lengths, lens: ragged(8, 3000)}},
		{servingCase: servingCase{name: "bf16 d128 paged 16 causal", shape: shape(bf16, 3, 4, 32, 8, 128, 2048, 0, 0), lens: []int32{2048, 700, 1}, causal: true, pageSize: 16}},
		{servingCase: servingCase{name: "bf16 d128 paged, window 300 causal, softcap, alibi", shape: shape(bf16, 2, 3, 32, 8, 128, 5000, 0, 0), lens: []int32{5000, 2000},
			causal: true, pageSize: 16, window: core.Window{Enabled: true, Left: 300, Right: -1}, softcap: 20, alibi: true}},
		{servingCase: servingCase{name: "f16 d256 window (64, 8), 16 splits", shape: shape(f16, 1, 8, 8, 1, 256, 3000, 16, 0), window: core.Window{Enabled: true, Left: 64, Right: 8}}},
		{servingCase: servingCase{name: "f16 d128 append 3, rotary, causal", shape: shape(f16, 2, 4, 16, 4, 128, 1024, 0, 3), lens: []int32{500, 0}, causal: true, rotary: 64}},
		{servingCase: servingCase{name: "f16 d128 cache_batch_idx, leftpad past the length", shape: shape(f16, 3, 2, 16, 4, 128, 900, 0, 0), lens: []int32{900, 100, 640},
			batchIdx: []int32{4, 0, 2}, leftpad: []int32{0, 200, 300}}},
	}
	r := rand.New(rand.NewPCG(5, 6))
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := gpu(t)
			if tc.noCluster {
				withoutClusters(t, d)
			}
			h := tc.host(r)
			h.Sinks = make([]float32, h.HeadsQ)
			for i := range h.Sinks { // about a row's own LSE (log of its keys), and far above and below it
				h.Sinks[i] = []float32{0, 8, -1, 40, -40, 6, 3}[i%7]
			}
			want, wantLSE, err := core.NaiveAttention(h)
			if err != nil {
				t.Fatal(err)
			}
			p := tc.problem(t, h)
			p.HasSinks, p.Sinks = true, uintptr(upload(t, h.Sinks))
			pl, err := PlanFor(p.PlanShape(), 0)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%d splits, cluster %d, combine %q, whole items %d, balanced %d, kernel %s",
				pl.NumSplits, pl.Cluster, pl.Combine, pl.WholeItems, pl.BalanceSplits, pl.Variant.Kernel)
			decodeBothWays(t, &p, pl, want, wantLSE)
		})
	}
}
