package binding

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// servingLayout is PrepareServing's JSON: a decode layout with serving
// features, each field named as the torch layer names it. A tensor's field
// holds its strides in elements, outermost first, the last included (it
// must be 1, which core.Tensor cannot say).
type servingLayout struct {
	DType       int `json:"dtype"` // 1: float16, 2: bfloat16
	Batch       int `json:"batch"`
	SeqlenQ     int `json:"seqlen_q"`
	HeadsQ      int `json:"nheads_q"`
	HeadsKV     int `json:"nheads_kv"`
	HeadDim     int `json:"headdim"`
	SeqlenCache int `json:"seqlen_cache"` // max_pages * page_size when paged
	NumSplits   int `json:"num_splits"`
	// DeviceLengths: the calls pass a cache_seqlens tensor (core.Shape.DeviceLengths).
	DeviceLengths bool `json:"device_lengths"`

	Q      [4]int64 `json:"q"`
	KCache [4]int64 `json:"k_cache"` // paged: (page, row in page, head, head_dim)
	VCache [4]int64 `json:"v_cache"`
	Out    [4]int64 `json:"out"`

	Scale        float64 `json:"softmax_scale"` // ignored with default_scale
	DefaultScale bool    `json:"default_scale"`
	Causal       bool    `json:"causal"`

	PageSize   int      `json:"page_size"` // 0: contiguous cache
	NumPages   int      `json:"num_pages"`
	MaxPages   int      `json:"max_pages"`
	BlockTable [2]int64 `json:"block_table"`

	CacheBatch int     `json:"cache_batch"` // > 0: rows of k_cache, indexed by cache_batch_idx
	Leftpad    bool    `json:"leftpad"`
	Window     [2]int  `json:"window_size"` // (left, right); -1: unbounded
	Softcap    float64 `json:"softcap"`

	Alibi       bool     `json:"alibi"`
	AlibiSlopes [2]int64 `json:"alibi_slopes"` // (batch, head); batch 0: one slope per head

	SeqlenNew int      `json:"seqlen_new"` // 0: no new tokens
	K         [4]int64 `json:"k"`
	V         [4]int64 `json:"v"`

	RotaryDim         int      `json:"rotary_dim"` // 0: no rotary
	RotaryRows        int      `json:"rotary_rows"`
	RotaryCos         [2]int64 `json:"rotary_cos"`
	RotarySin         [2]int64 `json:"rotary_sin"`
	RotaryInterleaved bool     `json:"rotary_interleaved"`
}

// parseLayout decodes PrepareServing's JSON. Fields left out keep the
// plain decode's values (no window, the default scale); an unknown field
// is an error, so a misspelt option never goes unnoticed.
func parseLayout(text string) (servingLayout, error) {
	l := servingLayout{Window: [2]int{-1, -1}, DefaultScale: true}
	dec := json.NewDecoder(bytes.NewReader([]byte(text)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&l); err != nil {
		return l, &core.Error{Op: "decode", Arg: "layout", Err: core.ErrInvalid, Msg: err.Error()}
	}
	return l, nil
}

// problem checks what only the binding sees (the last strides, rotary_sin
// sharing rotary_cos's layout, float64 options as float32) and returns
// the layout as a core.Problem for the core to validate.
func (l *servingLayout) problem() (core.Problem, error) {
	for _, x := range [...]struct {
		name string
		last int64
		used bool
	}{
		{"q", l.Q[3], true}, {"k_cache", l.KCache[3], true}, {"v_cache", l.VCache[3], true}, {"out", l.Out[3], true},
		{"k", l.K[3], l.SeqlenNew > 0}, {"v", l.V[3], l.SeqlenNew > 0},
		{"block_table", l.BlockTable[1], l.PageSize > 0},
		{"alibi_slopes", l.AlibiSlopes[1], l.Alibi},
		{"rotary_cos", l.RotaryCos[1], l.RotaryDim > 0}, {"rotary_sin", l.RotarySin[1], l.RotaryDim > 0},
	} {
		if x.used && x.last != 1 {
			return core.Problem{}, &core.Error{Op: "decode", Arg: x.name, Err: core.ErrInvalid,
				Msg: fmt.Sprintf("last dimension has stride %d; it must be contiguous (stride 1)", x.last)}
		}
	}
	if l.RotaryDim > 0 && l.RotarySin[0] != l.RotaryCos[0] {
		return core.Problem{}, &core.Error{Op: "decode", Arg: "rotary_sin", Err: core.ErrInvalid,
			Msg: fmt.Sprintf("row stride %d differs from rotary_cos's %d; the tables must share a layout", l.RotarySin[0], l.RotaryCos[0])}
	}
	var scale float32 // 0: the core's default
	if !l.DefaultScale {
		var err error
		if scale, err = core.ExplicitScale(l.Scale); err != nil {
			return core.Problem{}, err
		}
	}
	// The core checks the float32's value; a positive float64 must neither
	// round to 0 (softcap off) nor overflow.
	softcap := float32(l.Softcap)
	if l.Softcap > 0 && (softcap == 0 || math.IsInf(float64(softcap), 0)) {
		return core.Problem{}, &core.Error{Op: "decode", Arg: "softcap", Err: core.ErrInvalid,
			Msg: fmt.Sprintf("%v; a positive softcap must be a finite nonzero float32, at most %g", l.Softcap, math.MaxFloat32)}
	}
	tensor := func(s [4]int64) core.Tensor { return core.Tensor{BatchStride: s[0], SeqStride: s[1], HeadStride: s[2]} }
	sh := shape(l.DType, l.Batch, l.SeqlenQ, l.HeadsQ, l.HeadsKV, l.HeadDim, l.SeqlenCache, -1, l.NumSplits)
	sh.DeviceLengths = l.DeviceLengths
	return core.Problem{
		Shape:            sh,
		Q:                tensor(l.Q),
		K:                tensor(l.KCache),
		V:                tensor(l.VCache),
		Out:              tensor(l.Out),
		Scale:            scale,
		Causal:           l.Causal,
		BlockTableStride: l.BlockTable[0],
		PageSize:         l.PageSize,
		NumPages:         l.NumPages,
		MaxPages:         l.MaxPages,
		CacheBatch:       l.CacheBatch,
		Leftpad:          l.Leftpad,
		Window:           window(l.Window[0], l.Window[1]),
		Softcap:          softcap,
		Alibi:            l.Alibi,
		AlibiBatchStride: l.AlibiSlopes[0],
		New:              core.Append{K: tensor(l.K), V: tensor(l.V), Seqlen: l.SeqlenNew},
		Rotary:           core.Rotary{Stride: l.RotaryCos[0], Dim: l.RotaryDim, Rows: l.RotaryRows, Interleaved: l.RotaryInterleaved},
	}, nil
}

// PrepareServing validates a decode layout with serving features (paged
// cache, cache_batch_idx, cache_leftpad, window, softcap, ALiBi, appended
// tokens, rotary), given as JSON (see servingLayout), for GPU device and
// returns its handle for WorkspaceServing and RunServing. Handles are
// shared with Prepare: the same layout gets the same handle.
func PrepareServing(layout string, device int) (handle int, err error) {
	defer recoverError(&err)
	l, err := parseLayout(layout)
	if err != nil {
		return 0, err
	}
	p, err := l.problem()
	if err != nil {
		return 0, err
	}
	return prepared.add(&p, device)
}

// WorkspaceServing returns the bytes of device workspace RunServing needs
// for the layout under handle with this seqlen (as RunServing's); with
// rotary it includes the rotated q. It opens the GPU on first use.
func WorkspaceServing(handle, seqlen int) (bytes int, err error) {
	defer recoverError(&err)
	r, err := prepared.get(handle)
	if err != nil {
		return 0, err
	}
	return r.Workspace(seqlen)
}

// RunServing launches the decode prepared under handle on new device
// addresses, as Run does, with the serving features' tensors: the block
// table, cache_batch_idx, cache_leftpad, the ALiBi slopes, the new keys
// and values, and the rotary tables (0 for those the layout has not). It
// returns the number of splits it used. The workspace needs
// WorkspaceServing(handle, seqlen) bytes.
func RunServing(handle, seqlen int, q, k, v, out, lse, seqlens, blockTable, batchIdx, leftpad, alibi,
	kNew, vNew, cos, sin, workspace uintptr, workspaceBytes int, stream uintptr) (splits int, err error) {
	defer recoverError(&err)
	r, err := prepared.get(handle)
	if err != nil {
		return 0, err
	}
	pl, err := r.Run(&cuda.Args{Q: q, K: k, V: v, Out: out, LSE: lse, CacheSeqlens: seqlens,
		BlockTable: blockTable, CacheBatchIdx: batchIdx, CacheLeftpad: leftpad, AlibiSlopes: alibi,
		KNew: kNew, VNew: vNew, RotaryCos: cos, RotarySin: sin,
		Seqlen: seqlen, Workspace: workspace, WorkspaceBytes: workspaceBytes}, stream)
	if err != nil {
		return 0, err
	}
	return pl.NumSplits, nil
}
