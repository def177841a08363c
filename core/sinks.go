package core

import (
	"fmt"
	"math"
)

// Attention sinks (gpt-oss; FlashInfer's sinks): query head h's softmax has
// one more term exp(sinks[h]) in its denominator, with no value:
//
//	out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sinks[h]))
//	lse = log(sum_j exp(s_j) + exp(sinks[h]))
//
// s_j being the final score (scaled, softcapped, ALiBi'd). A row that sees
// no key gets out = 0 and lse = sinks[h]. The kernels add the sink once, to
// a row's final state where it is normalized (kernels/sinks.cuh), so it
// changes neither the plan nor the partials of a split.
//
// merge_states of attention states where exactly one carried the sink gives
// the answer over all their keys: that state's sum holds exp(sinks[h]), the
// others' do not, and the merge adds the sums.

// checkSinks is CheckPointers' part for the sinks array: given exactly
// when the layout has sinks, and 4-byte aligned.
func (p *Problem) checkSinks(op string) error {
	switch {
	case p.HasSinks && p.Sinks == 0:
		return invalid(op, "sinks", "null device pointer")
	case !p.HasSinks && p.Sinks != 0:
		return invalid(op, "sinks", fmt.Sprintf("address %#x given without HasSinks (a layout with sinks=1)", p.Sinks))
	case p.Sinks%4 != 0:
		return invalid(op, "sinks", fmt.Sprintf("address %#x is not 4-byte aligned", p.Sinks))
	}
	return nil
}

// addSink merges a sink logit into a row's final output o (normalized) and
// natural-log lse as the kernels do, in base 2 and float32: the row's state
// (lse, 1) and the sink's (sink, 1) with output 0. It returns the row's lse.
func addSink(o []float32, lse, sink float32) float32 {
	l2, s2 := lse*math.Log2E, sink*math.Log2E
	m := max(l2, s2)
	if math.IsInf(float64(m), -1) {
		return lse
	}
	a, w := exp2(l2-m), exp2(s2-m) // a = 0 for a row that saw no key
	for e := range o {
		o[e] *= a / (a + w)
	}
	return (m + float32(math.Log2(float64(a+w)))) * math.Ln2
}
