package binding

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// maxPrepared is the most layouts one process prepares. Handles never die
// (Python may hold any of them), so the table only grows; past this many
// layouts Prepare fails rather than grow without bound.
const maxPrepared = 1 << 16

// prepared is the process's table of layouts.
var prepared = layouts{limit: maxPrepared}

// layouts is a table of prepared layouts by handle. The same layout always
// gets the same handle, so Python may forget handles (its cache is
// bounded) and ask again.
type layouts struct {
	limit   int
	mu      sync.Mutex
	handles map[preparedKey]int
	table   atomic.Pointer[[]*cuda.Prepared] // append-only: get reads it without a lock
}

type preparedKey struct {
	p      core.Problem
	device int
}

// errTooManyLayouts wraps neither core sentinel: Python raises it as a
// RuntimeError.
var errTooManyLayouts = errors.New("too many layouts")

// add validates p's layout for device and returns its handle.
func (l *layouts) add(p *core.Problem, device int) (int, error) {
	key := preparedKey{*p, device}
	l.mu.Lock()
	defer l.mu.Unlock()
	if h, ok := l.handles[key]; ok {
		return h, nil
	}
	r, err := cuda.Prepare(p, device)
	if err != nil {
		return 0, err
	}
	var table []*cuda.Prepared
	if t := l.table.Load(); t != nil {
		table = *t
	}
	if len(table) >= l.limit {
		return 0, &core.Error{Op: "decode", Err: errTooManyLayouts,
			Msg: fmt.Sprintf("%d are prepared (one per distinct shapes, strides, dtype, options and device), the most one process holds", l.limit)}
	}
	if l.handles == nil {
		l.handles = map[preparedKey]int{}
	}
	// Appending writes only past the length get's readers loaded, and Store
	// publishes the new element with the new length.
	table = append(table, r)
	l.table.Store(&table)
	l.handles[key] = len(table) - 1
	return len(table) - 1, nil
}

// get returns the layout of a handle add returned.
func (l *layouts) get(handle int) (*cuda.Prepared, error) {
	t := l.table.Load()
	if t == nil || handle < 0 || handle >= len(*t) {
		return nil, &core.Error{Op: "decode", Arg: "handle", Msg: fmt.Sprintf("%d was not returned by Prepare", handle), Err: core.ErrInvalid}
	}
	return (*t)[handle], nil
}

// Prepare validates a decode layout once and returns its handle for
// Workspace and Run. Sizes and options are core.Problem's (dtype 1:
// float16, 2: bfloat16); the strides of q, k_cache, v_cache and out count
// elements in (batch, seq, head, head_dim) order, and the last must be 1.
// With defaultScale the softmax scale is 1/sqrt(headDim) and scale is
// ignored; otherwise scale must be a positive normal float32
// (core.ExplicitScale). deviceLengths: the calls pass a cache_seqlens
// tensor (core.Shape.DeviceLengths). Once maxPrepared layouts are prepared,
// a new one fails with an error that wraps neither core sentinel.
func Prepare(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache int,
	qB, qS, qH, qD, kB, kS, kH, kD, vB, vS, vH, vD, oB, oS, oH, oD int64,
	scale float64, defaultScale, causal bool, numSplits, device int, deviceLengths bool) (handle int, err error) {
	defer recoverError(&err)
	for _, x := range [...]struct {
		name   string
		stride int64
	}{{"q", qD}, {"k_cache", kD}, {"v_cache", vD}, {"out", oD}} {
		if x.stride != 1 {
			return 0, &core.Error{Op: "decode", Arg: x.name, Err: core.ErrInvalid,
				Msg: fmt.Sprintf("last (headdim) dimension has stride %d; it must be contiguous (stride 1)", x.stride)}
		}
	}
	var sc float32 // 0: the core's default
	if !defaultScale {
		if sc, err = core.ExplicitScale(scale); err != nil {
			return 0, err
		}
	}
	p := core.Problem{
		Shape:  shape(dtype, batch, seqlenQ, headsQ, headsKV, headDim, seqlenCache, -1, numSplits),
		Q:      core.Tensor{BatchStride: qB, SeqStride: qS, HeadStride: qH},
		K:      core.Tensor{BatchStride: kB, SeqStride: kS, HeadStride: kH},
		V:      core.Tensor{BatchStride: vB, SeqStride: vS, HeadStride: vH},
		Out:    core.Tensor{BatchStride: oB, SeqStride: oS, HeadStride: oH},
		Scale:  sc,
		Causal: causal,
	}
	p.DeviceLengths = deviceLengths
	return prepared.add(&p, device)
}

// Workspace returns the bytes of device workspace Run needs for the layout
// under handle with this seqlen (as Run's). It opens the GPU on first use.
func Workspace(handle, seqlen int) (bytes int, err error) {
	defer recoverError(&err)
	r, err := prepared.get(handle)
	if err != nil {
		return 0, err
	}
	return r.Workspace(seqlen)
}

// Run launches the decode prepared under handle on new device addresses
// (lse and seqlens may be 0; seqlen < 0 means the whole cache, or the
// lengths at seqlens) on the CUstream handle stream, and returns the number
// of splits it used. The workspace needs Workspace(handle, seqlen) bytes.
func Run(handle, seqlen int, q, k, v, out, lse, seqlens, workspace uintptr, workspaceBytes int, stream uintptr) (splits int, err error) {
	defer recoverError(&err)
	r, err := prepared.get(handle)
	if err != nil {
		return 0, err
	}
	pl, err := r.Run(&cuda.Args{Q: q, K: k, V: v, Out: out, LSE: lse, CacheSeqlens: seqlens,
		Seqlen: seqlen, Workspace: workspace, WorkspaceBytes: workspaceBytes}, stream)
	if err != nil {
		return 0, err
	}
	return pl.NumSplits, nil
}
