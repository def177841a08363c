package core

import (
	"fmt"
	"reflect"
	"strings"
	"unsafe"
)

// TensorDims is how many dimensions a TensorDesc describes: a merge's
// stacked states (num_states, *rows, headdim) take up to 8.
const TensorDims = 8

// TensorDesc is one tensor argument of a call as a framework holds it:
// given or not, its dtype, device, rank, shape and strides (elements).
type TensorDesc struct {
	Given   int64             `layout:"given"`   // 1: a tensor; 0: not given (None)
	DType   int64             `layout:"dtype"`   // its DType code; 0: a type with no code
	Device  int64             `layout:"device"`  // its CUDA device ordinal; -1: not on a CUDA device
	Rank    int64             `layout:"rank"`    // dimensions; those past TensorDims are not described
	Shape   [TensorDims]int64 `layout:"shape"`   // the first Rank sizes
	Strides [TensorDims]int64 `layout:"strides"` // the first Rank strides
}

// Tensors is a call as flash_attn_with_kvcache takes it: a descriptor of
// each tensor argument and the options, a flat record of 8-byte fields
// like Layout (TensorsFieldsText names them; fd_tensors in C). Its Layout
// method checks that the tensors agree (ranks, dtypes, shapes, devices,
// contiguous index tensors) and derives the Layout, which Layout.Problem
// then validates. An int cache_seqlens is no tensor: it goes with each run.
type Tensors struct {
	Q             TensorDesc `layout:"q"`
	KCache        TensorDesc `layout:"k_cache"`
	VCache        TensorDesc `layout:"v_cache"`
	K             TensorDesc `layout:"k"`
	V             TensorDesc `layout:"v"`
	RotaryCos     TensorDesc `layout:"rotary_cos"`
	RotarySin     TensorDesc `layout:"rotary_sin"`
	CacheSeqlens  TensorDesc `layout:"cache_seqlens"`
	CacheBatchIdx TensorDesc `layout:"cache_batch_idx"`
	CacheLeftpad  TensorDesc `layout:"cache_leftpad"`
	BlockTable    TensorDesc `layout:"block_table"`
	AlibiSlopes   TensorDesc `layout:"alibi_slopes"`
	Sinks         TensorDesc `layout:"sinks"`
	Out           TensorDesc `layout:"out"`
	KDescale      TensorDesc `layout:"k_descale"`
	VDescale      TensorDesc `layout:"v_descale"`
	CuSeqlensQ    TensorDesc `layout:"cu_seqlens_q"`

	Scale             float64 `layout:"softmax_scale"` // 0: 1/sqrt(headdim)
	Causal            int64   `layout:"causal"`
	WindowLeft        int64   `layout:"window_left"` // -1: unbounded
	WindowRight       int64   `layout:"window_right"`
	Softcap           float64 `layout:"softcap"` // 0: off
	RotaryInterleaved int64   `layout:"rotary_interleaved"`
	NumSplits         int64   `layout:"num_splits"` // 0: the planner chooses
	BatchInvariant    int64   `layout:"batch_invariant"`
	MaxSeqlenQ        int64   `layout:"max_seqlen_q"`    // with cu_seqlens_q, 1 to 16; 0: not given
	KDescaleValue     float64 `layout:"k_descale_value"` // without descale tensors: 0 for 1
	VDescaleValue     float64 `layout:"v_descale_value"`
}

// TensorsBytes is the size of a Tensors record in bytes.
const TensorsBytes = int(unsafe.Sizeof(Tensors{}))

var tensorsFields = recordFields(reflect.TypeOf(Tensors{}), "", 0)

// TensorsFields returns the Tensors record's fields in order: a
// descriptor's are q.given, q.dtype, ..., q.shape[0], ...
func TensorsFields() []LayoutField { return append([]LayoutField(nil), tensorsFields...) }

// TensorsFieldsText is TensorsFields as LayoutFieldsText writes them.
func TensorsFieldsText() string { return fieldsText(tensorsFields) }

// ReadTensors reads a Tensors record from its bytes in memory, as
// ReadLayout reads a Layout.
func ReadTensors(b []byte) (Tensors, error) {
	var t Tensors
	err := readRecord("tensors", unsafe.Slice((*byte)(unsafe.Pointer(&t)), TensorsBytes), b)
	return t, err
}

// argCheck checks one call's descriptors, the first error kept; op names
// the call in errors ("": prepare).
type argCheck struct {
	err error
	op  string
}

const tensorsOp = "prepare"

func (c *argCheck) fail(err error) {
	if c.err == nil {
		c.err = err
	}
}

func (c *argCheck) opName() string {
	if c.op == "" {
		return tensorsOp
	}
	return c.op
}

func (c *argCheck) invalidf(arg, format string, a ...any) {
	c.fail(invalid(c.opName(), arg, fmt.Sprintf(format, a...)))
}

func (c *argCheck) typef(arg, format string, a ...any) {
	c.fail(wrongType(c.opName(), arg, fmt.Sprintf(format, a...)))
}

// shapeText is d's shape as Python prints it: (2, 40, 8).
func shapeText(d *TensorDesc) string {
	n := int(min(max(d.Rank, 0), TensorDims))
	parts := make([]string, n)
	for i := range parts {
		parts[i] = fmt.Sprint(d.Shape[i])
	}
	if d.Rank > TensorDims {
		parts = append(parts, "...")
	}
	if n == 1 {
		return "(" + parts[0] + ",)"
	}
	return "(" + strings.Join(parts, ", ") + ")"
}

func stridesText(d *TensorDesc) string {
	e := TensorDesc{Rank: min(d.Rank, TensorDims), Shape: d.Strides}
	return shapeText(&e)
}

// dtypeText names a DType code as torch does.
func dtypeText(code int64) string {
	if code < 1 || code > int64(Float64) {
		return "a dtype with no code"
	}
	return "torch." + DType(code).String()
}

// tensor checks that d is given, of rank (0: any) dims and of one of
// dtypes (none: float16 or bfloat16); sameAs names the argument whose
// dtype dtypes[0] is ("" for a fixed type).
func (c *argCheck) tensor(name string, d *TensorDesc, rank int64, dims string, sameAs string, dtypes ...DType) {
	if c.err != nil {
		return
	}
	switch d.Given {
	case 0:
		c.typef(name, "must be a tensor, got none")
		return
	case 1:
	default:
		c.invalidf(name, "given=%d; must be 0 or 1", d.Given)
		return
	}
	if rank != 0 && d.Rank != rank {
		s := ""
		if rank > 1 {
			s = "s"
		}
		c.invalidf(name, "must have %d dimension%s %s, got shape %s", rank, s, dims, shapeText(d))
		return
	}
	if d.Rank < 0 || d.Rank > TensorDims && rank == 0 {
		c.invalidf(name, "%d dimensions; at most %d are described", d.Rank, TensorDims)
		return
	}
	for _, dt := range dtypes {
		if d.DType == int64(dt) {
			return
		}
	}
	got := dtypeText(d.DType)
	switch {
	case len(dtypes) == 0:
		if DType(d.DType).Valid() {
			return
		}
		c.typef(name, "must be torch.float16 or torch.bfloat16, got %s", got)
	case sameAs != "" && len(dtypes) > 1:
		others := make([]string, len(dtypes)-1)
		for i, dt := range dtypes[1:] {
			others[i] = dtypeText(int64(dt))
		}
		c.typef(name, "must have %s's dtype %s or be %s, got %s", sameAs, dtypeText(int64(dtypes[0])), strings.Join(others, " or "), got)
	case sameAs != "":
		c.typef(name, "must have %s's dtype %s, got %s", sameAs, dtypeText(int64(dtypes[0])), got)
	default:
		c.typef(name, "must be a %s tensor, got %s", dtypeText(int64(dtypes[0])), got)
	}
}

// sameShape checks that d has the shape of ref (named other).
func (c *argCheck) sameShape(name string, d *TensorDesc, other string, ref *TensorDesc) {
	if c.err == nil && (d.Rank != ref.Rank || d.Shape != ref.Shape) {
		c.invalidf(name, "must have %s's shape %s, got %s", other, shapeText(ref), shapeText(d))
	}
}

// index checks an int32 (batch,) tensor, contiguous (a layout holds no
// stride for it), or with table an int32 (batch, max_blocks) one.
func (c *argCheck) index(name string, d *TensorDesc, batch int64, table bool) {
	dims, rank := fmt.Sprintf("(batch,) = (%d,)", batch), int64(1)
	if table {
		dims, rank = fmt.Sprintf("(batch=%d, max_blocks)", batch), 2
	}
	c.tensor(name, d, rank, dims, "", Int32)
	switch {
	case c.err != nil:
	case d.Shape[0] != batch:
		c.invalidf(name, "must have shape %s, got %s", dims, shapeText(d))
	case !table && batch > 1 && d.Strides[0] != 1:
		c.invalidf(name, "must be contiguous, got stride %s", stridesText(d))
	}
}

// contiguous returns the strides of a contiguous tensor of shape.
func contiguous(shape ...int64) [TensorDims]int64 {
	var s [TensorDims]int64
	step := int64(1)
	for i := len(shape) - 1; i >= 0; i-- {
		s[i] = step
		step *= shape[i]
	}
	return s
}

// rowsOf returns the 4-D strides of a (rows, heads, head_dim) tensor
// flattened as ragged lengths take it: batch stride 0.
func rowsOf(d *TensorDesc) [4]int64 { return [4]int64{0, d.Strides[0], d.Strides[1], d.Strides[2]} }

// strides4 returns the 4-D strides of a (batch, rows, heads, head_dim) tensor.
func strides4(d *TensorDesc) [4]int64 { return [4]int64(d.Strides[:4]) }

// Layout checks what the Layout cannot say about t (each tensor's rank,
// dtype and shape against q's and the caches', the pairs given together,
// that the tensors share q's device) and returns the Layout t describes.
// Errors name the argument, as flash_attn_with_kvcache calls it; an error
// of a tensor's type wraps ErrType.
func (t *Tensors) Layout() (Layout, error) {
	l, _, err := t.check(false)
	return l, err
}

// DeviceLayout is Layout for a call that runs: q must be on a CUDA device
// (checked before the others are checked against it), which it returns.
func (t *Tensors) DeviceLayout() (Layout, int, error) {
	return t.check(true)
}

func (t *Tensors) check(onDevice bool) (Layout, int, error) {
	var c argCheck
	l := t.layout(&c)
	if onDevice && c.err == nil && t.Q.Device < 0 {
		c.invalidf("q", "must be a CUDA tensor, got device %d (not a CUDA device)", t.Q.Device)
	}
	c.devices(t)
	if c.err != nil {
		return Layout{}, 0, c.err
	}
	return l, int(min(t.Q.Device, 1<<31-1)), nil
}

func (t *Tensors) layout(c *argCheck) Layout {
	q, kc, vc := &t.Q, &t.KCache, &t.VCache
	ragged := t.CuSeqlensQ.Given != 0 || t.MaxSeqlenQ != 0
	if ragged {
		c.tensor("q", q, 3, "(total_q, nheads_q, headdim) with cu_seqlens_q", "")
	} else {
		c.tensor("q", q, 4, "(batch, seqlen_q, nheads_q, headdim)", "")
	}
	dims := "(batch, seqlen_cache, nheads_kv, headdim)"
	if t.BlockTable.Given != 0 {
		dims = "(num_blocks, page_size, nheads_kv, headdim)"
	}
	qd := DType(q.DType)
	c.tensor("k_cache", kc, 4, dims, "q", qd, Float8E4M3, Float8E5M2)
	c.tensor("v_cache", vc, 4, dims, "q", qd, Float8E4M3, Float8E5M2)
	if c.err == nil && vc.DType != kc.DType {
		c.typef("v_cache", "must have k_cache's dtype %s (the caches are q's dtype or both one fp8 format), got %s", dtypeText(kc.DType), dtypeText(vc.DType))
	}
	if c.err != nil {
		return Layout{}
	}
	rows, seqlenCache, headsKV := kc.Shape[0], kc.Shape[1], kc.Shape[2]
	var batch, seqlenQ, headsQ, headDim int64
	qStrides := strides4
	if ragged {
		batch, seqlenQ = t.ragged(c)
		if c.err != nil {
			return Layout{}
		}
		headsQ, headDim, qStrides = q.Shape[1], q.Shape[2], rowsOf
	} else {
		batch, seqlenQ, headsQ, headDim = q.Shape[0], q.Shape[1], q.Shape[2], q.Shape[3]
	}
	if kc.Shape[3] != headDim || rows != batch && t.BlockTable.Given == 0 && t.CacheBatchIdx.Given == 0 {
		c.invalidf("k_cache", "must have shape (batch=%d, seqlen_cache, nheads_kv, headdim=%d) to match q (other rows with cache_batch_idx or block_table), got %s", batch, headDim, shapeText(kc))
	}
	c.sameShape("v_cache", vc, "k_cache", kc)
	if t.CacheSeqlens.Given != 0 {
		c.index("cache_seqlens", &t.CacheSeqlens, batch, false)
	}
	outDims := "(batch, seqlen_q, nheads_q, headdim)"
	if ragged {
		outDims = "(total_q, nheads_q, headdim)"
	}
	var out [4]int64
	if t.Out.Given != 0 {
		c.tensor("out", &t.Out, q.Rank, outDims, "q", qd)
		c.sameShape("out", &t.Out, "q", q)
		out = qStrides(&t.Out)
	} else if ragged {
		out = rowsOf(&TensorDesc{Strides: contiguous(q.Shape[:3]...)})
	} else {
		out = strides4(&TensorDesc{Strides: contiguous(q.Shape[:4]...)})
	}
	l := Layout{DType: q.DType, Batch: batch, SeqlenQ: seqlenQ, HeadsQ: headsQ, HeadsKV: headsKV, HeadDim: headDim,
		SeqlenCache: seqlenCache, NumSplits: t.NumSplits, DeviceLengths: t.CacheSeqlens.Given, Causal: t.Causal,
		Scale: t.Scale, Q: qStrides(q), KCache: strides4(kc), VCache: strides4(vc), Out: out,
		WindowLeft: t.WindowLeft, WindowRight: t.WindowRight, Softcap: t.Softcap, BatchInvariant: t.BatchInvariant}
	if kd := DType(kc.DType); kd.FP8() {
		l.KVDType = kc.DType
	}
	t.descales(c, &l)
	if ragged {
		l.Ragged, l.TotalQ = 1, q.Shape[0]
	}
	if bt := &t.BlockTable; bt.Given != 0 {
		c.index("block_table", bt, batch, true)
		l.PageSize, l.NumPages, l.MaxPages = seqlenCache, rows, bt.Shape[1]
		l.SeqlenCache, l.BlockTable = bt.Shape[1]*seqlenCache, [2]int64{bt.Strides[0], bt.Strides[1]}
	}
	if t.CacheBatchIdx.Given != 0 {
		c.index("cache_batch_idx", &t.CacheBatchIdx, batch, false)
		l.CacheBatch = rows
	}
	if t.CacheLeftpad.Given != 0 {
		c.index("cache_leftpad", &t.CacheLeftpad, batch, false)
		l.Leftpad = 1
	}
	if a := &t.AlibiSlopes; a.Given != 0 {
		c.tensor("alibi_slopes", a, 0, "", "", Float32)
		if c.err == nil && !(a.Rank == 1 && a.Shape[0] == headsQ || a.Rank == 2 && a.Shape[0] == batch && a.Shape[1] == headsQ) {
			c.invalidf("alibi_slopes", "must have shape (nheads_q,) = (%d,) or (batch, nheads_q) = (%d, %d), got %s", headsQ, batch, headsQ, shapeText(a))
		}
		l.Alibi, l.AlibiSlopes = 1, [2]int64{0, a.Strides[0]} // batch stride 0: one slope per head
		if a.Rank == 2 {
			l.AlibiSlopes = [2]int64{a.Strides[0], a.Strides[1]}
		}
	}
	if s := &t.Sinks; s.Given != 0 {
		dims := fmt.Sprintf("(nheads_q,) = (%d,)", headsQ)
		c.tensor("sinks", s, 1, dims, "", Float32)
		switch {
		case c.err != nil:
		case s.Shape[0] != headsQ:
			c.invalidf("sinks", "must have shape %s, got %s", dims, shapeText(s))
		case headsQ > 1 && s.Strides[0] != 1: // no stride in the layout
			c.invalidf("sinks", "must be contiguous, got stride %s", stridesText(s))
		}
		l.Sinks = 1
	}
	t.appended(c, &l, qStrides)
	return l
}

// ragged checks cu_seqlens_q and max_seqlen_q, and that the (batch, ...)
// tensors agree with its batch; it returns (batch, max_seqlen_q).
func (t *Tensors) ragged(c *argCheck) (int64, int64) {
	cu := &t.CuSeqlensQ
	if cu.Given == 0 {
		c.invalidf("max_seqlen_q", "is given without cu_seqlens_q: it is the most rows a sequence of ragged query lengths has")
		return 0, 0
	}
	c.tensor("cu_seqlens_q", cu, 1, "(batch + 1,)", "", Int32)
	switch n := cu.Shape[0]; {
	case c.err != nil:
	case t.MaxSeqlenQ == 0:
		c.invalidf("max_seqlen_q", "must be given with cu_seqlens_q: the most rows a sequence has (1 to %d), which the call is planned for (no host sync reads it from cu_seqlens_q)", MaxSeqlenQ)
	case n < 2:
		c.invalidf("cu_seqlens_q", "must have batch + 1 >= 2 elements, got shape %s", shapeText(cu))
	case cu.Strides[0] != 1:
		c.invalidf("cu_seqlens_q", "must be contiguous, got stride %s", stridesText(cu))
	default:
		kc := &t.KCache
		if t.BlockTable.Given != 0 || t.CacheBatchIdx.Given != 0 {
			kc = &TensorDesc{}
		}
		for _, x := range [...]struct {
			name string
			d    *TensorDesc
		}{{"cache_seqlens", &t.CacheSeqlens}, {"block_table", &t.BlockTable}, {"cache_batch_idx", &t.CacheBatchIdx},
			{"cache_leftpad", &t.CacheLeftpad}, {"k_cache", kc}} {
			if x.d.Given != 0 && x.d.Rank >= 1 && x.d.Shape[0] != n-1 {
				c.invalidf("cu_seqlens_q", "must have batch + 1 = %d elements (%s has batch %d), got %d", x.d.Shape[0]+1, x.name, x.d.Shape[0], n)
				break
			}
		}
		return n - 1, t.MaxSeqlenQ
	}
	return 0, 0
}

// descales checks the descale tensors (both or neither, float32 of one
// element or (batch, nheads_kv)) and sets l's descale fields; the core
// checks the values, and that the caches are fp8.
func (t *Tensors) descales(c *argCheck, l *Layout) {
	k, v := &t.KDescale, &t.VDescale
	if k.Given != v.Given {
		given, other := "k_descale", "v_descale"
		if v.Given != 0 {
			given, other = other, given
		}
		c.invalidf(other, "must be a tensor too: %s is one, and descale tensors come together", given)
		return
	}
	if k.Given == 0 {
		l.KDescaleValue, l.VDescaleValue = t.KDescaleValue, t.VDescaleValue
		return
	}
	l.Descale = 1
	for _, x := range [...]struct {
		name    string
		d       *TensorDesc
		strides *[2]int64
		value   float64
	}{{"k_descale", k, &l.KDescale, t.KDescaleValue}, {"v_descale", v, &l.VDescale, t.VDescaleValue}} {
		c.tensor(x.name, x.d, 0, "", "", Float32)
		if c.err != nil {
			return
		}
		numel := int64(1)
		for i := range min(x.d.Rank, TensorDims) {
			numel *= x.d.Shape[i]
		}
		switch {
		case x.value != 0:
			c.invalidf(x.name, "is a tensor, with a value (%v) given too", x.value)
		case numel == 1:
		case x.d.Rank == 2 && x.d.Shape[0] == l.Batch && x.d.Shape[1] == l.HeadsKV:
			*x.strides = [2]int64{x.d.Strides[0], x.d.Strides[1]}
		default:
			c.invalidf(x.name, "must have 1 element or shape (batch, nheads_kv) = (%d, %d), got %s", l.Batch, l.HeadsKV, shapeText(x.d))
		}
	}
}

// appended checks the new tokens k, v and the rotary tables, each pair
// given together, and sets l's append and rotary fields.
func (t *Tensors) appended(c *argCheck, l *Layout, qStrides func(*TensorDesc) [4]int64) {
	for _, p := range [...]struct {
		a, b string
		da   *TensorDesc
		db   *TensorDesc
		what string
	}{{"k", "v", &t.K, &t.V, "the new keys and values are appended"},
		{"rotary_cos", "rotary_sin", &t.RotaryCos, &t.RotarySin, "the rotary tables come"}} {
		if (p.da.Given == 0) != (p.db.Given == 0) {
			missing, other := p.a, p.b
			if p.db.Given == 0 {
				missing, other = other, missing
			}
			c.invalidf(missing, "is None but %s is not: %s together", other, p.what)
		}
	}
	if c.err != nil {
		return
	}
	q, qd, ragged := &t.Q, DType(t.Q.DType), l.Ragged != 0
	if k := &t.K; k.Given != 0 { // ragged: flattened as q is, each sequence appending its own rows
		dims := fmt.Sprintf("(batch=%d, seqlen_new, nheads_kv=%d, headdim=%d)", l.Batch, l.HeadsKV, l.HeadDim)
		if ragged {
			dims = fmt.Sprintf("(total_q=%d, nheads_kv=%d, headdim=%d)", q.Shape[0], l.HeadsKV, l.HeadDim)
		}
		c.tensor("k", k, q.Rank, dims, "q", qd)
		c.tensor("v", &t.V, q.Rank, dims, "q", qd)
		if c.err != nil {
			return
		}
		ok := k.Shape[0] == l.Batch && k.Shape[1] >= 1 && k.Shape[2] == l.HeadsKV && k.Shape[3] == l.HeadDim
		with := "seqlen_new >= 1"
		if ragged {
			ok, with = k.Shape[0] == q.Shape[0] && k.Shape[1] == l.HeadsKV && k.Shape[2] == l.HeadDim, "cu_seqlens_q"
		}
		if !ok {
			c.invalidf("k", "must have shape %s with %s, got %s", dims, with, shapeText(k))
		}
		c.sameShape("v", &t.V, "k", k)
		l.SeqlenNew, l.KNew, l.VNew = k.Shape[1], qStrides(k), qStrides(&t.V)
		if ragged {
			l.SeqlenNew = l.SeqlenQ
		}
	}
	if cos := &t.RotaryCos; cos.Given != 0 {
		c.tensor("rotary_cos", cos, 2, "(seqlen_ro, rotary_dim / 2)", "q", qd)
		c.tensor("rotary_sin", &t.RotarySin, 2, "(seqlen_ro, rotary_dim / 2)", "q", qd)
		c.sameShape("rotary_sin", &t.RotarySin, "rotary_cos", cos)
		l.RotaryDim, l.RotaryRows, l.RotaryInterleaved = 2*cos.Shape[1], cos.Shape[0], t.RotaryInterleaved
		l.RotaryCos = [2]int64{cos.Strides[0], cos.Strides[1]}
		l.RotarySin = [2]int64{t.RotarySin.Strides[0], t.RotarySin.Strides[1]}
	}
}

// devices checks that every tensor given is on q's device (cache_seqlens,
// descales: those of the layout).
func (c *argCheck) devices(t *Tensors) {
	if c.err != nil {
		return
	}
	for _, x := range [...]struct {
		name string
		d    *TensorDesc
	}{{"k_cache", &t.KCache}, {"v_cache", &t.VCache}, {"k", &t.K}, {"v", &t.V}, {"rotary_cos", &t.RotaryCos},
		{"rotary_sin", &t.RotarySin}, {"cache_seqlens", &t.CacheSeqlens}, {"cache_batch_idx", &t.CacheBatchIdx},
		{"cache_leftpad", &t.CacheLeftpad}, {"block_table", &t.BlockTable}, {"alibi_slopes", &t.AlibiSlopes},
		{"sinks", &t.Sinks}, {"out", &t.Out}, {"k_descale", &t.KDescale}, {"v_descale", &t.VDescale},
		{"cu_seqlens_q", &t.CuSeqlensQ}} {
		if x.d.Given != 0 && x.d.Device != t.Q.Device {
			c.invalidf(x.name, "must be on q's device %s, got %s", deviceText(t.Q.Device), deviceText(x.d.Device))
			return
		}
	}
}

// deviceText names a descriptor's device as torch does.
func deviceText(d int64) string {
	if d < 0 {
		return "a device that is not CUDA"
	}
	return fmt.Sprintf("cuda:%d", d)
}
