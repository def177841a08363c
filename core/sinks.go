package core

import "fmt"

// Attention sinks (gpt-oss; FlashInfer's sinks): query head h's softmax has
// one more term exp(sinks[h]) in its denominator, with no value:
//
//	out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sinks[h]))
//	lse = log(sum_j exp(s_j) + exp(sinks[h]))
//
// s_j being the final score (scaled, softcapped, ALiBi'd). A row that sees
// no key gets out = 0 and lse = sinks[h]. Split 0 of each row starts its
// online softmax from the sink, the state (sinks[h], 1) with output 0
// (kernels/sinks.cuh), and the merges of the splits count it once: sinks
// change neither the plan nor the tile loop.
//
// So does merge_states of attention states where exactly one carried the
// sink: that state's sum holds exp(sinks[h]), the others' do not, and the
// merge adds the sums.

// checkSinks is CheckPointers' part for the sinks array: given exactly
// when the layout has sinks, and 4-byte aligned.
func (p *Problem) checkSinks(op string) error {
	return checkLayoutArray(op, "sinks", p.HasSinks, p.Sinks, "", "without HasSinks (a layout with sinks=1)")
}

// checkLayoutArray checks the address of a per-call array of 4-byte
// elements that a call passes exactly where its layout has it (has): not
// null then (null: the message adds missing), null otherwise (given: the
// message adds unexpected), and aligned.
func checkLayoutArray(op, name string, has bool, ptr uintptr, missing, unexpected string) error {
	switch {
	case has && ptr == 0:
		return invalid(op, name, "null device pointer"+missing)
	case !has && ptr != 0:
		return invalid(op, name, fmt.Sprintf("address %#x given %s", ptr, unexpected))
	case ptr%4 != 0:
		return invalid(op, name, fmt.Sprintf("address %#x is not 4-byte aligned", ptr))
	}
	return nil
}
