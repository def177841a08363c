package binding

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// The prepared layouts, by handle. Python keeps the handle of each layout it
// has seen and calls Run with it; the same layout always gets the same
// handle, so Python may forget handles (its cache is bounded) and ask again.
// Handles never die: the table only grows, up to maxPrepared layouts, after
// which Prepare answers -1 and the caller uses Decode.
const maxPrepared = 1 << 16

var prepared struct {
	mu      sync.Mutex
	handles map[preparedKey]int
	table   atomic.Pointer[[]*cuda.Prepared] // append-only: Run reads it without a lock
}

type preparedKey struct {
	p      core.Problem
	device int
}

// Prepare validates a decode layout once (the arguments of Decode without
// device addresses and seqlen) and returns a handle for Run, or -1 when the
// table of layouts is full (then call Decode).
func Prepare(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache int,
	qB, qS, qH, kB, kS, kH, vB, vS, vH, oB, oS, oH int64,
	scale float64, causal bool, numSplits, device int) (int, error) {
	p := core.Problem{
		Shape:  shape(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, -1, numSplits),
		Q:      core.Tensor{BatchStride: qB, SeqStride: qS, HeadStride: qH},
		K:      core.Tensor{BatchStride: kB, SeqStride: kS, HeadStride: kH},
		V:      core.Tensor{BatchStride: vB, SeqStride: vS, HeadStride: vH},
		Out:    core.Tensor{BatchStride: oB, SeqStride: oS, HeadStride: oH},
		Scale:  float32(scale),
		Causal: causal,
	}
	key := preparedKey{p, device}
	prepared.mu.Lock()
	defer prepared.mu.Unlock()
	if h, ok := prepared.handles[key]; ok {
		return h, nil
	}
	r, err := cuda.Prepare(&p, device)
	if err != nil {
		return 0, err
	}
	var table []*cuda.Prepared
	if t := prepared.table.Load(); t != nil {
		table = *t
	}
	if len(table) >= maxPrepared {
		return -1, nil
	}
	if prepared.handles == nil {
		prepared.handles = map[preparedKey]int{}
	}
	// Appending writes only past the length Run's readers loaded, and Store
	// publishes the new element with the new length.
	table = append(table, r)
	prepared.table.Store(&table)
	prepared.handles[key] = len(table) - 1
	return len(table) - 1, nil
}

// Run launches the decode prepared under handle on new device addresses
// (lse and seqlens may be 0; seqlen < 0 means the whole cache, or the
// lengths at seqlens) on the CUstream handle stream, and returns the number
// of splits it used.
func Run(handle, seqlen int, q, k, v, out, lse, seqlens, workspace uintptr, workspaceBytes int, stream uintptr) (int, error) {
	t := prepared.table.Load()
	if t == nil || handle < 0 || handle >= len(*t) {
		return 0, &core.Error{Op: "decode", Arg: "handle", Msg: fmt.Sprintf("%d was not returned by Prepare", handle), Err: core.ErrInvalid}
	}
	pl, err := (*t)[handle].Run(&cuda.Args{Q: q, K: k, V: v, Out: out, LSE: lse, CacheSeqlens: seqlens,
		Seqlen: seqlen, Workspace: workspace, WorkspaceBytes: workspaceBytes}, stream)
	if err != nil {
		return 0, err
	}
	return pl.NumSplits, nil
}
