package core

import (
	"math"
	"testing"
)

func TestSinksValidate(t *testing.T) {
	sinks := func(p *Problem) { p.HasSinks, p.Sinks = true, 0x19000000 }
	with := func(base func() Problem) func() Problem {
		return func() Problem { p := base(); sinks(&p); return p }
	}
	tests := []problemCase{
		{"plain", with(validProblem), func(p *Problem) {}, "", nil},
		{"every serving feature", with(allProblem), func(p *Problem) {}, "", nil},
		{"paged", with(pagedProblem), func(p *Problem) {}, "", nil},
		{"null", validProblem, func(p *Problem) { p.HasSinks = true }, "sinks", ErrInvalid},
		{"without HasSinks", validProblem, func(p *Problem) { p.Sinks = 0x19000000 }, "sinks", ErrInvalid},
		{"misaligned", with(validProblem), func(p *Problem) { p.Sinks += 2 }, "sinks", ErrInvalid},
		// q [0x10000, 0x14000), out [0x20000, 0x24000), 32 heads: 128 bytes of sinks.
		{"out over sinks", with(validProblem), func(p *Problem) { p.Sinks = 0x24000 - 64 }, "out", ErrInvalid},
		{"sinks right after out", with(validProblem), func(p *Problem) { p.Sinks = 0x24000 }, "", nil},
		{"lse over sinks", with(validProblem), func(p *Problem) { p.LSE = 0x50000; p.Sinks = 0x50000 + 64 }, "lse", ErrInvalid},
		{"sinks in q", with(validProblem), func(p *Problem) { p.Sinks = 0x10000 }, "", nil}, // both are read
		{"the append's caches over sinks", with(appendProblem), func(p *Problem) { p.Sinks = p.K.Ptr + 4096 }, "sinks", ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.base()
			tt.edit(&p)
			checkErr(t, p.Validate(), tt.arg, tt.want)
		})
	}
	p := with(validProblem)()
	if err := p.CheckWorkspace(p.Sinks-256, 512); err == nil {
		t.Error("a workspace over sinks was accepted")
	}
	// Sinks leave the plan alone: the same shape, so the same plan.
	plain := validProblem()
	if p.PlanShape() != plain.PlanShape() {
		t.Errorf("PlanShape with sinks %+v, without %+v", p.PlanShape(), plain.PlanShape())
	}
}

func TestLayoutSinks(t *testing.T) {
	for _, l := range []Layout{denseLayout(), servingLayout()} {
		l.Sinks = 1
		p, err := l.Problem()
		if err != nil || !p.HasSinks {
			t.Fatalf("Problem() = %+v, %v; want HasSinks", p, err)
		}
		if back := LayoutOf(&p); back.Sinks != 1 {
			t.Errorf("LayoutOf(Problem()).Sinks = %d, want 1", back.Sinks)
		}
	}
}

// sinkLogits returns a logit a query head: around the rows' own LSEs (a
// few nats for these inputs) and far above and below them.
func sinkLogits(heads int) []float32 {
	x := make([]float32, heads)
	for i := range x {
		x[i] = []float32{0, 2.5, -1, 40, -40, 6}[i%6]
	}
	return x
}

func TestReferenceSinksMatchesNaive(t *testing.T) {
	tests := []struct {
		name string
		h    *HostProblem
	}{
		{"ragged causal, rows that see nothing", randomHost(Shape{DType: Float16, Batch: 3, SeqlenQ: 4, HeadsQ: 12, HeadsKV: 2, HeadDim: 16, SeqlenCache: 50, Seqlen: -1}, []int32{50, 0, 2}, true, 11)},
		{"mha", randomHost(Shape{DType: BFloat16, Batch: 2, SeqlenQ: 1, HeadsQ: 6, HeadsKV: 6, HeadDim: 8, SeqlenCache: 37, Seqlen: -1}, nil, false, 12)},
		{"window, softcap, alibi", servingHost(Shape{DType: Float16, Batch: 2, SeqlenQ: 3, HeadsQ: 8, HeadsKV: 2, HeadDim: 16, SeqlenCache: 64, Seqlen: -1}, []int32{64, 30}, true,
			serving{window: Window{Enabled: true, Left: 9, Right: -1}, softcap: 5, alibi: 2}, 13)},
	}
	for _, tt := range tests {
		tt.h.Sinks = sinkLogits(tt.h.HeadsQ)
		matchesNaive(t, tt.name, tt.h, []int{1, 2, 7}, []int{1, 16})
	}
}

// TestReferenceSinksNoKey: a row that sees no key gets out = 0 and lse =
// its sink, a sink of -inf is none, and a row far below its sink has out
// near 0.
func TestReferenceSinksNoKey(t *testing.T) {
	s := Shape{DType: Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 6, HeadsKV: 1, HeadDim: 8, SeqlenCache: 10, Seqlen: -1}
	h := randomHost(s, []int32{0, 10}, false, 5)
	h.Sinks = sinkLogits(s.HeadsQ)
	h.Sinks[5] = float32(math.Inf(-1))
	plain := *h
	plain.Sinks = nil
	_, plainLSE, err := ReferenceDecode(&plain, 1, 4)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{1, 3} {
		out, lse, err := ReferenceDecode(h, n, 4)
		if err != nil {
			t.Fatal(err)
		}
		for hq := range s.HeadsQ {
			if got, want := lse[hq], h.Sinks[hq]; got != want {
				t.Errorf("splits %d: empty row of head %d: lse %v, want its sink %v", n, hq, got, want)
			}
			for _, x := range out[hq*8:][:8] {
				if x != 0 {
					t.Fatalf("splits %d: empty row of head %d: out %v, want 0", n, hq, out[hq*8:][:8])
				}
			}
		}
		if d := lse[6+5] - plainLSE[6+5]; math.Abs(float64(d)) > 1e-6 {
			t.Errorf("splits %d: a sink of -inf moved the lse by %v", n, d)
		}
		if o := out[(6+3)*8:][:8]; math.Abs(float64(o[0])) > 1e-12 {
			t.Errorf("splits %d: a row 40 nats below its sink: out %v, want about 0", n, o)
		}
	}
}

// TestSinksMergeStates: merge_states of two shards of the keys, the sink
// in exactly one of them, is the whole cache with the sink.
func TestSinksMergeStates(t *testing.T) {
	s := Shape{DType: Float16, Batch: 2, SeqlenQ: 2, HeadsQ: 8, HeadsKV: 2, HeadDim: 16, SeqlenCache: 40, Seqlen: -1}
	whole := randomHost(s, nil, false, 21)
	whole.Sinks = sinkLogits(s.HeadsQ)
	want, wantLSE, err := NaiveAttention(whole)
	if err != nil {
		t.Fatal(err)
	}
	// Shard i holds keys [i*cut, ...) of every sequence; out (b, q, h, d)
	// and lse (b, h, q) are both row-major over rows, in different orders,
	// so states are compared in out's order.
	const cut = 15
	var outs, lses [][]float64
	for i, keys := range [][2]int{{0, cut}, {cut, s.SeqlenCache}} {
		sh := *whole
		sh.SeqlenCache = keys[1] - keys[0]
		sh.K, sh.V = keyRange(whole.K, s, keys), keyRange(whole.V, s, keys)
		if i == 1 {
			sh.Sinks = nil
		}
		o, l, err := NaiveAttention(&sh)
		if err != nil {
			t.Fatal(err)
		}
		outs, lses = append(outs, o), append(lses, outOrder(l, s))
	}
	out, lse, err := MergeStatesReference(outs, lses, s.HeadDim)
	if err != nil {
		t.Fatal(err)
	}
	wantLSE = outOrder(wantLSE, s)
	for r := range lse {
		if math.Abs(lse[r]-wantLSE[r]) > 1e-9 {
			t.Fatalf("row %d: lse %v, whole cache %v", r, lse[r], wantLSE[r])
		}
	}
	for i := range out {
		if math.Abs(out[i]-want[i]) > 1e-9 {
			t.Fatalf("out[%d] = %v, whole cache %v", i, out[i], want[i])
		}
	}
}

// keyRange copies keys [r[0], r[1]) of every sequence of a (batch, seq,
// heads, dim) cache of shape s.
func keyRange(x []float32, s Shape, r [2]int) []float32 {
	row := s.HeadsKV * s.HeadDim
	var y []float32
	for b := range s.Batch {
		y = append(y, x[(b*s.SeqlenCache+r[0])*row:(b*s.SeqlenCache+r[1])*row]...)
	}
	return y
}

// outOrder reorders an lse (batch, heads, seqlen_q) into out's row order
// (batch, seqlen_q, heads).
func outOrder(lse []float64, s Shape) []float64 {
	y := make([]float64, len(lse))
	for b := range s.Batch {
		for h := range s.HeadsQ {
			for i := range s.SeqlenQ {
				y[(b*s.SeqlenQ+i)*s.HeadsQ+h] = lse[(b*s.HeadsQ+h)*s.SeqlenQ+i]
			}
		}
	}
	return y
}
