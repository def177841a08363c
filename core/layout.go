package core

import (
	"fmt"
	"math"
	"math/bits"
	"reflect"
	"strings"
	"unsafe"
)

// Layout is a decode's layout as every door passes it: a flat record of
// 8-byte fields (int64, float64 where noted), the same in Go, in C
// (fd_layout in capi/flashdecode.h) and in Python (packed from
// LayoutFields). Strides count elements in (batch, seq, head, head_dim)
// order; flags are 0 or 1. Problem converts it, once, for every door.
type Layout struct {
	DType         int64   `layout:"dtype"` // DType's code: 1 float16, 2 bfloat16
	Batch         int64   `layout:"batch"`
	SeqlenQ       int64   `layout:"seqlen_q"`
	HeadsQ        int64   `layout:"heads_q"`
	HeadsKV       int64   `layout:"heads_kv"`
	HeadDim       int64   `layout:"head_dim"`
	SeqlenCache   int64   `layout:"seqlen_cache"` // max_pages * page_size when paged
	NumSplits     int64   `layout:"num_splits"`   // 0: the planner chooses
	DeviceLengths int64   `layout:"device_lengths"`
	Causal        int64   `layout:"causal"`
	Scale         float64 `layout:"scale"` // 0: 1/sqrt(head_dim); else a positive normal float32

	Q      [4]int64 `layout:"q"`
	KCache [4]int64 `layout:"k_cache"` // paged: (page, row in page, head, head_dim)
	VCache [4]int64 `layout:"v_cache"`
	Out    [4]int64 `layout:"out"`

	PageSize   int64    `layout:"page_size"` // 0: a contiguous cache
	NumPages   int64    `layout:"num_pages"`
	MaxPages   int64    `layout:"max_pages"`
	BlockTable [2]int64 `layout:"block_table"`

	CacheBatch  int64   `layout:"cache_batch"` // > 0: rows of k_cache, indexed by cache_batch_idx
	Leftpad     int64   `layout:"leftpad"`
	WindowLeft  int64   `layout:"window_left"` // -1: unbounded
	WindowRight int64   `layout:"window_right"`
	Softcap     float64 `layout:"softcap"` // 0: off

	Alibi       int64    `layout:"alibi"`
	AlibiSlopes [2]int64 `layout:"alibi_slopes"` // batch stride 0: one slope per head

	SeqlenNew int64    `layout:"seqlen_new"` // 0: no new tokens
	KNew      [4]int64 `layout:"k_new"`
	VNew      [4]int64 `layout:"v_new"`

	RotaryDim         int64    `layout:"rotary_dim"` // 0: no rotary
	RotaryRows        int64    `layout:"rotary_rows"`
	RotaryCos         [2]int64 `layout:"rotary_cos"`
	RotarySin         [2]int64 `layout:"rotary_sin"`
	RotaryInterleaved int64    `layout:"rotary_interleaved"`

	KVDType        int64    `layout:"kv_dtype"`  // the caches' DType code: 0 for dtype's, 4 float8_e4m3fn, 5 float8_e5m2
	Descale        int64    `layout:"descale"`   // 1: calls pass k_descale and v_descale, float32 arrays
	KDescale       [2]int64 `layout:"k_descale"` // their strides (batch, heads_kv); 0, 0: one value
	VDescale       [2]int64 `layout:"v_descale"`
	KDescaleValue  float64  `layout:"k_descale_value"` // without the arrays: k's scale (0: 1)
	VDescaleValue  float64  `layout:"v_descale_value"`
	Sinks          int64    `layout:"sinks"`           // 1: calls pass sinks, float32 (heads_q,) contiguous
	BatchInvariant int64    `layout:"batch_invariant"` // 1: a sequence's result never depends on its batch

	// Ragged query lengths (core/ragged.go): 1, calls pass cu_seqlens_q, and
	// q, out, k and v are (total_q, heads, head_dim), their batch strides
	// ignored; seqlen_q is then max_seqlen_q.
	Ragged int64 `layout:"ragged"`
	TotalQ int64 `layout:"total_q"` // with ragged: the rows of q
}

// LayoutBytes is the size of a Layout in bytes.
const LayoutBytes = int(unsafe.Sizeof(Layout{}))

// LayoutField is one 8-byte field of a flat record (a Layout, Tensors):
// an array's elements are fields of their own, named name[i], and a nested
// struct's name.field.
type LayoutField struct {
	Name   string
	Float  bool // float64; else int64
	Offset int  // bytes from the start of the record
}

// recordFields lists the 8-byte fields of the flat record type t in order,
// named by their layout tags, prefix before each name.
func recordFields(t reflect.Type, prefix string, base int) []LayoutField {
	var fs []LayoutField
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, off := prefix+f.Tag.Get("layout"), base+int(f.Offset)
		switch f.Type.Kind() {
		case reflect.Struct:
			fs = append(fs, recordFields(f.Type, name+".", off)...)
		case reflect.Array:
			for j := 0; j < f.Type.Len(); j++ {
				fs = append(fs, LayoutField{Name: fmt.Sprintf("%s[%d]", name, j), Offset: off + 8*j})
			}
		default:
			fs = append(fs, LayoutField{Name: name, Float: f.Type.Kind() == reflect.Float64, Offset: off})
		}
	}
	return fs
}

// fieldsText is fs as "name:q,name:d,...": q for an int64, d for a
// float64 (Python struct's codes), in order.
func fieldsText(fs []LayoutField) string {
	var b strings.Builder
	for i, f := range fs {
		if i > 0 {
			b.WriteByte(',')
		}
		kind := ":q"
		if f.Float {
			kind = ":d"
		}
		b.WriteString(f.Name + kind)
	}
	return b.String()
}

// readRecord copies the record b (the host's byte order) into dst, the
// bytes of a record named name of this build. A shorter record, of whole
// fields, is one from a caller built against an older, smaller record:
// the fields it lacks stay 0. A longer one is from a newer caller: the
// fields this build lacks must be 0.
func readRecord(name string, dst, b []byte) error {
	switch {
	case len(b) == 0 || len(b)%8 != 0:
		return invalid("prepare", name+"_size", fmt.Sprintf("%d bytes; a %s is whole 8-byte fields, %d bytes in this build", len(b), name, len(dst)))
	case len(b) > len(dst):
		for i, x := range b[len(dst):] {
			if x != 0 {
				return unsupported("prepare", name+"_size", fmt.Sprintf("%d bytes, with byte %d set; this build knows the first %d", len(b), len(dst)+i, len(dst)))
			}
		}
	}
	copy(dst, b)
	return nil
}

// layoutFields lists Layout's fields in order (read once from its tags).
var layoutFields = recordFields(reflect.TypeOf(Layout{}), "", 0)

// LayoutFields returns the Layout's fields in order, for the doors that
// pack or mirror it (Python packs its record from them; the C test checks
// fd_layout's offsets against them).
func LayoutFields() []LayoutField { return append([]LayoutField(nil), layoutFields...) }

// LayoutFieldsText is LayoutFields as "name:q,name:d,...": q for an
// int64, d for a float64 (Python struct's codes), in order.
func LayoutFieldsText() string { return fieldsText(layoutFields) }

// ReadLayout reads a Layout from its bytes in memory (the host's byte
// order), as readRecord says.
func ReadLayout(b []byte) (Layout, error) {
	var l Layout
	err := readRecord("layout", unsafe.Slice((*byte)(unsafe.Pointer(&l)), LayoutBytes), b)
	return l, err
}

// LayoutOf returns p's layout (its device addresses and Seqlen are not
// part of it): the inverse of Layout.Problem for a valid p.
func LayoutOf(p *Problem) Layout {
	l := Layout{
		DType: int64(p.DType), Batch: int64(p.Batch), SeqlenQ: int64(p.SeqlenQ), HeadsQ: int64(p.HeadsQ),
		HeadsKV: int64(p.HeadsKV), HeadDim: int64(p.HeadDim), SeqlenCache: int64(p.SeqlenCache),
		NumSplits: int64(p.NumSplits), DeviceLengths: layoutFlag(p.DeviceLengths), Causal: layoutFlag(p.Causal),
		Scale: float64(p.Scale),
		Q:     layoutStrides(p.Q), KCache: layoutStrides(p.K), VCache: layoutStrides(p.V), Out: layoutStrides(p.Out),
		PageSize: int64(p.PageSize), NumPages: int64(p.NumPages), MaxPages: int64(p.MaxPages),
		BlockTable: [2]int64{p.BlockTableStride, 1},
		CacheBatch: int64(p.CacheBatch), Leftpad: layoutFlag(p.Leftpad),
		WindowLeft: -1, WindowRight: -1,
		Softcap: float64(p.Softcap), Alibi: layoutFlag(p.Alibi), AlibiSlopes: [2]int64{p.AlibiBatchStride, 1},
		SeqlenNew: int64(p.New.Seqlen), KNew: layoutStrides(p.New.K), VNew: layoutStrides(p.New.V),
		RotaryDim: int64(p.Rotary.Dim), RotaryRows: int64(p.Rotary.Rows),
		RotaryCos: [2]int64{p.Rotary.Stride, 1}, RotarySin: [2]int64{p.Rotary.Stride, 1},
		RotaryInterleaved: layoutFlag(p.Rotary.Interleaved), BatchInvariant: layoutFlag(p.BatchInvariant),
		Sinks: layoutFlag(p.HasSinks), Ragged: layoutFlag(p.Ragged), TotalQ: int64(p.TotalQ),
	}
	if p.Window.Enabled {
		l.WindowLeft, l.WindowRight = int64(p.Window.Left), int64(p.Window.Right)
	}
	layoutFP8(&l, p)
	return l
}

func layoutFlag(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

func layoutStrides(t Tensor) [4]int64 { return [4]int64{t.BatchStride, t.SeqStride, t.HeadStride, 1} }

// Problem converts l, for every door, into the Problem it describes, with
// no device addresses and the whole cache as its length (Seqlen -1; a call
// sets its own, see CallSeqlen), and validates it (ValidateLayout). The
// stride of a dimension of size 1 (or 0) never moves an address, so it is
// set to 0 (the last dimension's to 1) whatever it was: frameworks give
// such dimensions any stride. Then it checks what Problem cannot hold: the
// last strides are 1, the flags 0 or 1, rotary_sin shares rotary_cos's
// layout, and the float64 options are float32s of the same meaning.
// Errors name the field.
func (l *Layout) Problem() (Problem, error) {
	p, err := l.convert()
	if err != nil {
		return Problem{}, err
	}
	if err := p.ValidateLayout(); err != nil {
		return Problem{}, err
	}
	return p, nil
}

// Sizes is Problem with only the checks a plan needs (Problem.ValidateSizes
// but the append's start, which CallSeqlen checks): for a caller that
// plans before it has the tensors' strides.
func (l *Layout) Sizes() (Problem, error) {
	const op = "plan"
	p, err := l.convert()
	if err != nil {
		return Problem{}, err
	}
	if err := p.validateRagged(op); err != nil {
		return Problem{}, err
	}
	if err := p.Shape.validate(op); err != nil {
		return Problem{}, err
	}
	if err := p.validateServingSizes(op); err != nil {
		return Problem{}, err
	}
	return p, nil
}

// convert is Problem without the core's validation.
func (l *Layout) convert() (Problem, error) {
	const op = "prepare"
	for _, f := range [...]struct {
		name string
		v    int64
	}{
		{"device_lengths", l.DeviceLengths}, {"causal", l.Causal}, {"leftpad", l.Leftpad},
		{"alibi", l.Alibi}, {"rotary_interleaved", l.RotaryInterleaved}, {"batch_invariant", l.BatchInvariant},
		{"sinks", l.Sinks}, {"ragged", l.Ragged},
	} {
		if f.v != 0 && f.v != 1 {
			return Problem{}, invalid(op, f.name, fmt.Sprintf("%d; must be 0 or 1", f.v))
		}
	}
	// Every size limit is below 2^31: clamping at 2^32 keeps the core's sums
	// of sizes from overflowing and its range checks refusing.
	n := func(v int64) int { return int(max(min(v, 1<<32), -1<<32)) }
	batch, seqQ, hq, hkv, d := n(l.Batch), n(l.SeqlenQ), n(l.HeadsQ), n(l.HeadsKV), n(l.HeadDim)
	rows, seq := batch, n(l.SeqlenCache)
	switch {
	case l.PageSize > 0:
		rows, seq = n(l.NumPages), n(l.PageSize)
	case l.CacheBatch > 0:
		rows = n(l.CacheBatch)
	}
	newTokens := l.SeqlenNew > 0
	rotary := l.RotaryDim > 0
	qBatch, qRows, newRows := batch, seqQ, n(l.SeqlenNew)
	if l.Ragged != 0 { // one batch of total_q flattened rows: the batch strides are not read
		qBatch, qRows, newRows = 1, n(l.TotalQ), n(l.TotalQ)
	}
	tensors := [...]struct {
		name    string
		strides [4]int64
		size    [4]int
		used    bool
	}{
		{"q", l.Q, [4]int{qBatch, qRows, hq, d}, true},
		{"k_cache", l.KCache, [4]int{rows, seq, hkv, d}, true},
		{"v_cache", l.VCache, [4]int{rows, seq, hkv, d}, true},
		{"out", l.Out, [4]int{qBatch, qRows, hq, d}, true},
		{"k", l.KNew, [4]int{qBatch, newRows, hkv, d}, newTokens},
		{"v", l.VNew, [4]int{qBatch, newRows, hkv, d}, newTokens},
	}
	var ts [len(tensors)]Tensor
	for i, x := range tensors {
		s := normalized(x.strides[:], x.size[:])
		if x.used && s[3] != 1 {
			return Problem{}, lastStride(op, x.name, s[3])
		}
		ts[i] = Tensor{BatchStride: s[0], SeqStride: s[1], HeadStride: s[2]}
	}
	tables := [...]struct {
		name    string
		strides [2]int64
		size    [2]int
		used    bool
	}{
		{"block_table", l.BlockTable, [2]int{batch, n(l.MaxPages)}, l.PageSize > 0},
		{"alibi_slopes", l.AlibiSlopes, [2]int{batch, hq}, l.Alibi != 0},
		{"rotary_cos", l.RotaryCos, [2]int{n(l.RotaryRows), n(l.RotaryDim / 2)}, rotary},
		{"rotary_sin", l.RotarySin, [2]int{n(l.RotaryRows), n(l.RotaryDim / 2)}, rotary},
	}
	var outer [len(tables)]int64
	for i, x := range tables {
		s := normalized(x.strides[:], x.size[:])
		if x.used && s[1] != 1 {
			return Problem{}, lastStride(op, x.name, s[1])
		}
		outer[i] = s[0]
	}
	if rotary && outer[3] != outer[2] {
		return Problem{}, invalid(op, "rotary_sin", fmt.Sprintf("row stride %d differs from rotary_cos's %d; the tables must share a layout", outer[3], outer[2]))
	}
	switch { // the fields of features this build does not run yet
	case l.BatchInvariant != 0 && l.NumSplits != 0:
		return Problem{}, invalid(op, "num_splits", fmt.Sprintf("%d with batch_invariant; must be 0: each sequence's own length sets its splits", l.NumSplits))
	}
	var scale float32 // 0: the core's default
	if l.Scale != 0 {
		var err error
		if scale, err = ExplicitScale(l.Scale); err != nil {
			return Problem{}, err
		}
	}
	// The core checks the float32's value; a positive float64 must neither
	// round to 0 (softcap off) nor overflow.
	softcap := float32(l.Softcap)
	if l.Softcap > 0 && (softcap == 0 || math.IsInf(float64(softcap), 0)) {
		return Problem{}, invalid(op, "softcap", fmt.Sprintf("%v; a positive softcap must be a finite nonzero float32, at most %g", l.Softcap, math.MaxFloat32))
	}
	p := Problem{
		Shape: Shape{DType: DType(n(l.DType)), Batch: batch, SeqlenQ: seqQ, HeadsQ: hq, HeadsKV: hkv, HeadDim: d,
			SeqlenCache: n(l.SeqlenCache), Seqlen: -1, NumSplits: n(l.NumSplits), DeviceLengths: l.DeviceLengths != 0,
			BatchInvariant: l.BatchInvariant != 0},
		Q: ts[0], K: ts[1], V: ts[2], Out: ts[3],
		Scale: scale, Causal: l.Causal != 0,
		BlockTableStride: outer[0], PageSize: n(l.PageSize), NumPages: n(l.NumPages), MaxPages: n(l.MaxPages),
		CacheBatch: n(l.CacheBatch), Leftpad: l.Leftpad != 0,
		Softcap: softcap, Alibi: l.Alibi != 0, AlibiBatchStride: outer[1],
		New:    Append{K: ts[4], V: ts[5], Seqlen: n(l.SeqlenNew)},
		Rotary: Rotary{Stride: outer[2], Dim: n(l.RotaryDim), Rows: n(l.RotaryRows), Interleaved: l.RotaryInterleaved != 0},
	}
	p.HasSinks = l.Sinks != 0
	p.Ragged, p.TotalQ = l.Ragged != 0, n(l.TotalQ)
	if l.WindowLeft != -1 || l.WindowRight != -1 {
		p.Window = Window{Enabled: true, Left: n(l.WindowLeft), Right: n(l.WindowRight)}
	}
	if err := p.convertFP8(op, l); err != nil {
		return Problem{}, err
	}
	return p, nil
}

// normalized returns strides (of up to 4 dimensions, in their places) with
// those of dimensions of size at most 1 set to 0, or 1 for the last.
func normalized(strides []int64, size []int) [4]int64 {
	var s [4]int64
	last := len(strides) - 1
	for i, st := range strides {
		switch {
		case size[i] > 1:
			s[i] = st
		case i == last:
			s[i] = 1
		}
	}
	return s
}

func lastStride(op, name string, stride int64) error {
	return invalid(op, name, fmt.Sprintf("last dimension has stride %d; it must be contiguous (stride 1)", stride))
}

// CallSeqlen returns the Shape.Seqlen a call of p's layout plans and runs
// with, from the seqlen it passes (-1: the whole cache), p's
// CacheSeqlens being the call's (0 when not known yet). With device
// lengths, seqlen is a bound on the keys a sequence attends
// (max_seqlen_k), which the core rounds up to a power of two (capped at
// the cache) less the new tokens, so that a bound growing a token a step
// meets a new plan once a doubling. Otherwise it is every sequence's
// length, at most SeqlenCache, which new tokens must fit after when no
// cache_seqlens array gives the lengths (with one, it only sizes the
// split). The error names cache_seqlens or max_seqlen_k.
func (p *Problem) CallSeqlen(seqlen int) (int, error) {
	const op = "decode"
	if p.DeviceLengths {
		switch {
		case seqlen == -1:
			return -1, nil
		case seqlen < 0:
			return 0, invalid(op, "max_seqlen_k", fmt.Sprintf("%d; must not be negative (-1: the whole cache)", seqlen))
		case seqlen == 0:
			return 0, nil
		}
		bucket := p.SeqlenCache
		if e := bits.Len(uint(seqlen - 1)); e < bits.UintSize-2 {
			bucket = min(bucket, 1<<e)
		}
		return max(0, bucket-p.New.Seqlen), nil
	}
	n := p.New.Seqlen
	switch {
	case seqlen < -1:
		return 0, invalid(op, "cache_seqlens", fmt.Sprintf("%d; must not be negative (-1: the whole cache)", seqlen))
	case seqlen > p.SeqlenCache:
		return 0, invalid(op, "cache_seqlens", fmt.Sprintf("%d exceeds seqlen_cache=%d", seqlen, p.SeqlenCache))
	case n == 0 || p.CacheSeqlens != 0:
	case seqlen == -1:
		return 0, invalid(op, "cache_seqlens", "required with k and v: the new tokens go after each sequence's cached ones")
	case seqlen+n > p.SeqlenCache:
		return 0, invalid(op, "cache_seqlens", fmt.Sprintf("%d + %d new tokens exceed seqlen_cache=%d", seqlen, n, p.SeqlenCache))
	}
	return seqlen, nil
}
