package core

import (
	"fmt"
	"math"
	"math/bits"
)

// Limits of the kernels, checked by Validate.
const (
	MaxSeqlenQ = 16  // most query tokens per sequence (speculative decoding)
	MaxHeadDim = 256 // largest head dim; any multiple of 8 up to it runs
	// MaxSeqlenCache is the largest K/V length per sequence: the kernels
	// count keys in 32-bit ints, and round a length up to whole tiles of up
	// to 1024 keys.
	MaxSeqlenCache = 1 << 30
	// MaxRows is the most output rows (Batch * HeadsQ * SeqlenQ): the
	// kernels number the rows of out, lse and the workspace in 32-bit ints.
	MaxRows   = math.MaxInt32
	maxGridYZ = 65535 // CUDA's limit on gridDim.y and gridDim.z
)

// Shape is the part of a Problem the planner reads: sizes and options that
// fix the launch shapes. It never holds device data, so a Plan made from it
// stays valid for every call with the same shapes (CUDA-graph replays too).
type Shape struct {
	DType DType // q, out and the new tokens: Float16 or BFloat16
	// KVDType is the caches' element type: 0 for DType (CacheDType), or an
	// fp8 format whose values are scaled by Problem.KDescale and VDescale.
	KVDType     DType
	Batch       int // sequences
	SeqlenQ     int // new query tokens per sequence, 1..16
	HeadsQ      int // query heads; a multiple of HeadsKV
	HeadsKV     int // key/value heads
	HeadDim     int // multiple of 8, at most 256
	SeqlenCache int // K/V rows per sequence (the cache's capacity); 0 is allowed

	// Seqlen is the valid length of every sequence when Problem.CacheSeqlens
	// is 0; a negative value means SeqlenCache. The planner sizes the split
	// from it (or from SeqlenCache when negative), never from device data;
	// with CacheSeqlens set, a Seqlen >= 0 is only that sizing hint, and
	// each sequence is still split by its own length on the device.
	Seqlen int

	NumSplits int // 0: let the planner choose; n > 0: ask for n (clamped, see MakePlan)

	// DeviceLengths says that the lengths come as a device array
	// (Problem.CacheSeqlens), which lets a plan of several sequences balance
	// its splits by them on the device (Plan.BalanceSplits; not with
	// cache_leftpad, which Problem.PlanShape clears it for). The caller sets
	// it where it passes the array: a plan with it and a call without the
	// array is still right (every sequence then has Seqlen keys), only the
	// workspace and grid differ from the plan without it.
	DeviceLengths bool

	// The serving features' part of the plan. Problem.PlanShape sets them
	// from the Problem's serving fields; all zero plans the plain kernels.
	Serving    bool // run the serving variant of stage 1 (any serving feature; see Problem.Serving)
	SeqlenNew  int  // tokens appended to each sequence before attention (Problem.New.Seqlen)
	WindowKeys int  // > 0: a sliding window lets a sequence's rows see at most this many keys
	RotaryQ    bool // the rotated q is kept in the workspace (Problem.Rotary.Dim > 0)
	// Paged runs a paged form of the serving kernel (FormPaged or
	// FormPagedAppend, Shape.Form): Serving, with a paged cache of pages of
	// a multiple of 8 keys and no serving feature but an append and rotary
	// (Problem.PagedForm).
	Paged bool
	// Contiguous marks a contiguous cache with no serving feature but an
	// append and rotary (Problem.ContiguousForm): with 1 to 16 new tokens
	// and no rotary it runs the contiguous cache's appending form of the
	// serving kernel (FormAppend), otherwise the serving form (Shape.Form).
	Contiguous bool

	// BatchInvariant makes a sequence's result bits depend only on its own
	// inputs and options, never on its batch, the other lengths or the
	// GPU: a fixed key budget a split from the layout, each sequence's
	// split count from its own length, one merge (Plan.InvariantTiles).
	BatchInvariant bool
}

// CacheDType returns the caches' element type.
func (s *Shape) CacheDType() DType {
	if s.KVDType == 0 {
		return s.DType
	}
	return s.KVDType
}

// Descale is an fp8 cache's scale: the attended value of an element x is
// x * descale, descale read from Ptr, a float32 (Batch, HeadsKV) device
// array with these strides (both 0: one value), or Value where Ptr is 0.
type Descale struct {
	Ptr                     uintptr
	BatchStride, HeadStride int64
	Value                   float32 // 0 is taken as 1
}

// Tensor locates a 4-D (batch, seq, heads, head_dim) tensor in device memory.
// Strides count elements; the head_dim dimension is contiguous.
type Tensor struct {
	Ptr         uintptr // device address of element [0,0,0,0]
	BatchStride int64
	SeqStride   int64
	HeadStride  int64
}

// Problem is one flash-decoding call: shapes, device tensors and options.
// It is what every caller (Go, C through capi, Python through the binding)
// fills in; Validate checks it and MakePlan turns its Shape into a Plan.
type Problem struct {
	Shape

	// Q is (Batch, SeqlenQ, HeadsQ, HeadDim); K and V are (Batch,
	// SeqlenCache, HeadsKV, HeadDim) in CacheDType; Out is (Batch, SeqlenQ,
	// HeadsQ, HeadDim) in DType and must not overlap itself.
	Q, K, V, Out Tensor

	// LSE, if not 0, receives the natural-log log-sum-exp as float32
	// (Batch, HeadsQ, SeqlenQ), contiguous; (HeadsQ, TotalQ) with Ragged.
	LSE uintptr
	// CacheSeqlens, if not 0, is an int32 (Batch,) device array of valid
	// lengths; values are clamped to [0, SeqlenCache] on the device.
	CacheSeqlens uintptr

	// Scale is the softmax scale; 0 means 1/sqrt(HeadDim). A caller whose
	// own API says "default" some other way (Python's None) converts an
	// explicit scale with ExplicitScale, which never yields 0.
	Scale  float32
	Causal bool // bottom-right aligned causal mask

	// The serving features (flash_attn_with_kvcache's arguments); their zero
	// values turn each off, and any one on runs the serving kernels (see
	// Serving and core/serving.go). Layout fields are checked by
	// ValidateLayout, the device addresses (per call) by CheckPointers.

	// BlockTable, per call, is an int32 (Batch, MaxPages) device array of
	// page ids when PageSize > 0: K and V are then paged, (NumPages,
	// PageSize, HeadsKV, HeadDim), their BatchStride the page stride and
	// SeqStride the row stride in a page, and SeqlenCache is
	// MaxPages*PageSize. BlockTableStride counts elements between sequences.
	BlockTable                   uintptr
	BlockTableStride             int64
	PageSize, NumPages, MaxPages int
	// CacheBatchIdx, per call, is an int32 (Batch,) device array naming the
	// cache row of each sequence when CacheBatch > 0, K and V then holding
	// CacheBatch rows (contiguous caches only).
	CacheBatchIdx uintptr
	CacheBatch    int
	// CacheLeftpad, per call, is an int32 (Batch,) device array of the first
	// valid key of each sequence when Leftpad is set.
	CacheLeftpad uintptr
	Leftpad      bool
	Window       Window  // sliding window (window_size)
	Softcap      float32 // > 0: scores become Softcap*tanh(score/Softcap)
	// AlibiSlopes, per call, is a float32 (HeadsQ,) or (Batch, HeadsQ)
	// device array of ALiBi slopes when Alibi is set; AlibiBatchStride is 0
	// for the first form, the row stride for the second.
	Alibi            bool
	AlibiBatchStride int64
	AlibiSlopes      uintptr
	New              Append // new tokens written into the cache before attention
	Rotary           Rotary // rotary embedding of q and the new keys (with New only)

	// KDescale and VDescale scale an fp8 cache (Shape.KVDType): values, or
	// with DescaleArrays per-call device arrays (their Ptr, both given).
	KDescale, VDescale Descale
	DescaleArrays      bool
	// Sinks, per call, is a float32 (HeadsQ,) device array of sink logits
	// when HasSinks is set: each row's softmax gets exp(Sinks[head]) more
	// in its denominator, with no value, and its LSE includes it (see
	// core/sinks.go). Every form runs it; it leaves the plan alone.
	HasSinks bool
	Sinks    uintptr

	// Ragged query lengths (core/ragged.go): with Ragged, q, out and the
	// new tokens are TotalQ flattened rows (their BatchStride unused, 0),
	// SeqlenQ is max_seqlen_q, and CuSeqlensQ, per call, is the int32
	// (Batch+1,) device array of each sequence's first row; LSE is then
	// (HeadsQ, TotalQ).
	Ragged     bool
	TotalQ     int
	CuSeqlensQ uintptr
}

// minNormalFloat32 is the smallest positive normal float32, 2^-126.
const minNormalFloat32 = 0x1p-126

// ExplicitScale returns scale as a Problem.Scale for a caller that gave it
// explicitly: it must round to a positive normal float32, so that it can
// neither read as the default (a tiny scale rounds to 0) nor lose its
// precision or finiteness in the conversion. Otherwise it returns an *Error
// naming softmax_scale that wraps ErrInvalid.
func ExplicitScale(scale float64) (float32, error) {
	if f := float32(scale); f >= minNormalFloat32 && f <= math.MaxFloat32 {
		return f, nil
	}
	return 0, invalid("decode", "softmax_scale", fmt.Sprintf("%v; must be a positive normal float32, %g to %g", scale, minNormalFloat32, math.MaxFloat32))
}

// Validate reports the first thing wrong with s as an *Error that names the
// argument and wraps ErrInvalid or ErrUnsupported.
func (s Shape) Validate() error { return s.validate("plan") }

// validate is Validate for operation op: validateSizes, then the serving
// fields (validateServing).
func (s Shape) validate(op string) error {
	if err := s.validateSizes(op); err != nil {
		return err
	}
	return s.validateServing(op)
}

// validateSizes checks the sizes every problem has, for Problem's checks
// (whose Shape holds no serving field: PlanShape sets them).
func (s Shape) validateSizes(op string) error {
	if !s.DType.Valid() {
		return unsupported(op, "dtype", fmt.Sprintf("%d; supported: %d (float16), %d (bfloat16)", int(s.DType), int(Float16), int(BFloat16)))
	}
	if s.Batch < 1 {
		return invalid(op, "batch", fmt.Sprintf("%d; must be at least 1", s.Batch))
	}
	if s.Batch > maxGridYZ {
		return unsupported(op, "batch", fmt.Sprintf("%d; at most %d (the launch grid's z limit)", s.Batch, maxGridYZ))
	}
	if s.SeqlenQ < 1 {
		return invalid(op, "seqlen_q", fmt.Sprintf("%d; must be at least 1", s.SeqlenQ))
	}
	if s.SeqlenQ > MaxSeqlenQ {
		return unsupported(op, "seqlen_q", fmt.Sprintf("%d; supported: 1 to %d", s.SeqlenQ, MaxSeqlenQ))
	}
	if s.HeadsQ < 1 {
		return invalid(op, "nheads_q", fmt.Sprintf("%d; must be at least 1", s.HeadsQ))
	}
	if s.HeadsKV < 1 {
		return invalid(op, "nheads_kv", fmt.Sprintf("%d; must be at least 1", s.HeadsKV))
	}
	if s.HeadsQ > math.MaxInt32 {
		return unsupported(op, "nheads_q", fmt.Sprintf("%d; at most %d", s.HeadsQ, math.MaxInt32))
	}
	if s.HeadsQ%s.HeadsKV != 0 {
		return invalid(op, "nheads_q", fmt.Sprintf("%d is not a multiple of nheads_kv=%d", s.HeadsQ, s.HeadsKV))
	}
	// Batch, SeqlenQ and HeadsQ are bounded above, so the product fits an int64.
	if rows := int64(s.Batch) * int64(s.HeadsQ) * int64(s.SeqlenQ); rows > MaxRows {
		return unsupported(op, "nheads_q", fmt.Sprintf("%d with batch=%d and seqlen_q=%d makes %d output rows; at most %d (the kernels index rows in 32 bits)", s.HeadsQ, s.Batch, s.SeqlenQ, rows, MaxRows))
	}
	if s.HeadDim < 1 {
		return invalid(op, "headdim", fmt.Sprintf("%d; must be positive", s.HeadDim))
	}
	if s.HeadDim%8 != 0 || s.HeadDim > MaxHeadDim {
		return unsupported(op, "headdim", fmt.Sprintf("%d; supported: multiples of 8 from 8 to %d", s.HeadDim, MaxHeadDim))
	}
	if s.SeqlenCache < 0 {
		return invalid(op, "seqlen_cache", fmt.Sprintf("%d; must not be negative", s.SeqlenCache))
	}
	if s.SeqlenCache > MaxSeqlenCache {
		return unsupported(op, "seqlen_cache", fmt.Sprintf("%d; at most %d (the kernels count keys in 32 bits)", s.SeqlenCache, MaxSeqlenCache))
	}
	if s.Seqlen > s.SeqlenCache {
		return invalid(op, "cache_seqlens", fmt.Sprintf("%d exceeds seqlen_cache=%d", s.Seqlen, s.SeqlenCache))
	}
	if s.NumSplits < 0 {
		return invalid(op, "num_splits", fmt.Sprintf("%d; must be 0 (automatic) or positive", s.NumSplits))
	}
	return s.validateKVDType(op)
}

// Validate reports the first thing wrong with p: its Shape (see
// Shape.Validate), then what a C or Python caller can get wrong about the
// device tensors. It returns an *Error that names the argument.
//
// Checked: q, k_cache, v_cache and out are non-null (the caches may be
// null when SeqlenCache is 0), 16-byte aligned, with non-negative strides
// that are multiples of 8 elements (the kernels load 8 elements at a time)
// and whose largest element offset fits in 64 bits; out does not overlap
// itself; out and lse (and with an append the caches) share no memory
// with the other tensors; lse and cache_seqlens are 4-byte aligned; the
// scale is finite and not negative.
// What cannot be checked from the host (that the memory is allocated, on
// the right device, and large enough) is the caller's part. Validate is
// ValidateLayout then CheckPointers.
func (p *Problem) Validate() error {
	if err := p.ValidateLayout(); err != nil {
		return err
	}
	return p.CheckPointers()
}

// ValidateLayout is Validate without the device addresses: the Shape, the
// strides and the scale. A caller that decodes the same layout every step
// checks it once and then only CheckPointers per call (see
// cuda.Prepare).
func (p *Problem) ValidateLayout() error {
	const op = "decode"
	if p == nil {
		return invalid(op, "", "nil Problem")
	}
	if err := p.validateRagged(op); err != nil {
		return err
	}
	if err := p.Shape.validateSizes(op); err != nil {
		return err
	}
	s := p.Shape
	el, cel := s.DType.Size(), s.CacheDType().Size()
	qBatch, qRows := p.qDims(s.SeqlenQ)
	for _, x := range [...]struct {
		name  string
		t     Tensor
		batch int
		seq   int
		hds   int
		elem  int
	}{
		{"q", p.Q, qBatch, qRows, s.HeadsQ, el},
		{"k_cache", p.K, s.Batch, s.SeqlenCache, s.HeadsKV, cel},
		{"v_cache", p.V, s.Batch, s.SeqlenCache, s.HeadsKV, cel},
		{"out", p.Out, qBatch, qRows, s.HeadsQ, el},
	} {
		if err := checkStrides(op, x.name, x.t, [4]int{x.batch, x.seq, x.hds, s.HeadDim}, x.elem, x.name == "out"); err != nil {
			return err
		}
	}
	if sc := float64(p.Scale); math.IsNaN(sc) || math.IsInf(sc, 0) || sc < 0 {
		return invalid(op, "softmax_scale", fmt.Sprintf("%v; must be finite and not negative", p.Scale))
	}
	if overflows32(float64(p.Scale) * math.Log2E) { // the kernels scale by it in base 2, in float32
		return invalid(op, "softmax_scale", fmt.Sprintf("%v; softmax_scale*log2(e) must fit in float32", p.Scale))
	}
	if err := p.validateFP8(op); err != nil {
		return err
	}
	return p.validateServing(op)
}

// CheckPointers checks p's device addresses: q, k_cache, v_cache and out
// non-null and 16-byte aligned (k_cache and v_cache may be null when
// SeqlenCache is 0: nothing is read), lse and cache_seqlens (optional)
// 4-byte aligned, the descale arrays given exactly with DescaleArrays and
// 4-byte aligned, and that what the kernels write shares no byte with
// anything else: out and lse with every other tensor of the call, and,
// with an append, k_cache and v_cache with every other tensor, and with
// each other element by element (they may interleave in one buffer). The
// other checks compare byte ranges (from the address to the end of the
// last element), so they also refuse two tensors that interleave in one
// buffer without sharing an element. p's layout must be valid
// (ValidateLayout).
func (p *Problem) CheckPointers() error {
	const op = "decode"
	if p == nil {
		return invalid(op, "", "nil Problem")
	}
	for _, x := range [...]struct {
		name string
		ptr  uintptr
	}{{"q", p.Q.Ptr}, {"k_cache", p.K.Ptr}, {"v_cache", p.V.Ptr}, {"out", p.Out.Ptr}} {
		if x.ptr == 0 {
			if p.SeqlenCache == 0 && (x.name == "k_cache" || x.name == "v_cache") {
				continue
			}
			return invalid(op, x.name, "null device pointer")
		}
		if x.ptr%16 != 0 {
			return unsupported(op, x.name, fmt.Sprintf("address %#x is not 16-byte aligned; the kernels load 8 elements at a time (a fresh tensor, such as a .clone(), is aligned)", x.ptr))
		}
	}
	if p.LSE%4 != 0 {
		return invalid(op, "lse", fmt.Sprintf("address %#x is not 4-byte aligned", p.LSE))
	}
	if p.CacheSeqlens%4 != 0 {
		return invalid(op, "cache_seqlens", fmt.Sprintf("address %#x is not 4-byte aligned", p.CacheSeqlens))
	}
	if err := p.checkServingPointers(op); err != nil {
		return err
	}
	if err := p.checkDescalePointers(op); err != nil {
		return err
	}
	if err := p.checkSinks(op); err != nil {
		return err
	}
	if err := p.checkCuSeqlensQ(op); err != nil {
		return err
	}
	return p.checkOverlaps(op)
}

// byteRange is the bytes [lo, hi) a tensor spans; empty when lo == hi.
type byteRange struct {
	name   string
	lo, hi uint64
}

func (a byteRange) overlaps(b byteRange) bool { return a.lo < b.hi && b.lo < a.hi }

// tensorRange is the byte range of a (batch, seq, heads, head_dim) tensor
// of elem-byte elements with the given sizes, from t.Ptr to the end of its
// last element (saturated at the top of the address space).
func tensorRange(name string, t Tensor, size [4]int, elem int) byteRange {
	if t.Ptr == 0 || size[0] <= 0 || size[1] <= 0 || size[2] <= 0 || size[3] <= 0 {
		return byteRange{name: name}
	}
	// ValidateLayout keeps the largest element offset within int64.
	last := int64(size[0]-1)*t.BatchStride + int64(size[1]-1)*t.SeqStride + int64(size[2]-1)*t.HeadStride + int64(size[3]-1)
	return spanOf(name, t.Ptr, uint64(last)+1, elem)
}

// spanOf is the byte range of n elem-byte elements at ptr (empty at ptr 0).
func spanOf(name string, ptr uintptr, n uint64, elem int) byteRange {
	if ptr == 0 {
		return byteRange{name: name}
	}
	hi, bytes := bits.Mul64(n, uint64(elem))
	end, carry := bits.Add64(uint64(ptr), bytes, 0)
	if hi != 0 || carry != 0 {
		end = math.MaxUint64
	}
	return byteRange{name, uint64(ptr), end}
}

// spans is the byte range of each of p's tensors: the inputs (q,
// k_cache, v_cache first), then out, then lse.
func (p *Problem) spans() [18]byteRange {
	s := p.Shape
	qBatch, qRows := p.qDims(s.SeqlenQ)
	_, newRows := p.qDims(p.New.Seqlen)
	el, cel := s.DType.Size(), s.CacheDType().Size()
	rows, seq := p.cacheDims() // paged caches hold NumPages pages of PageSize keys
	var table, slopes uint64   // elements of a rotary table and of alibi_slopes
	if p.Rotary.Dim > 0 && p.Rotary.Rows > 0 {
		table = uint64(p.Rotary.Rows-1)*uint64(p.Rotary.Stride) + uint64(p.Rotary.Dim/2)
	}
	if p.Alibi {
		slopes = uint64(max(s.Batch-1, 0))*uint64(p.AlibiBatchStride) + uint64(s.HeadsQ)
	}
	var kScales, vScales uint64 // elements of the descale arrays
	if p.DescaleArrays {
		kScales, vScales = p.KDescale.scales(s.Batch, s.HeadsKV), p.VDescale.scales(s.Batch, s.HeadsKV)
	}
	return [...]byteRange{
		tensorRange("q", p.Q, [4]int{qBatch, qRows, s.HeadsQ, s.HeadDim}, el),
		tensorRange("k_cache", p.K, [4]int{rows, seq, s.HeadsKV, s.HeadDim}, cel),
		tensorRange("v_cache", p.V, [4]int{rows, seq, s.HeadsKV, s.HeadDim}, cel),
		spanOf("cache_seqlens", p.CacheSeqlens, uint64(s.Batch), 4),
		tensorRange("k", p.New.K, [4]int{qBatch, newRows, s.HeadsKV, s.HeadDim}, el),
		tensorRange("v", p.New.V, [4]int{qBatch, newRows, s.HeadsKV, s.HeadDim}, el),
		spanOf("rotary_cos", p.Rotary.Cos, table, el),
		spanOf("rotary_sin", p.Rotary.Sin, table, el),
		spanOf("block_table", p.BlockTable, uint64(max(s.Batch-1, 0))*uint64(p.BlockTableStride)+uint64(p.MaxPages), 4),
		spanOf("cache_batch_idx", p.CacheBatchIdx, uint64(s.Batch), 4),
		spanOf("cache_leftpad", p.CacheLeftpad, uint64(s.Batch), 4),
		spanOf("alibi_slopes", p.AlibiSlopes, slopes, 4),
		spanOf("k_descale", p.KDescale.Ptr, kScales, 4),
		spanOf("v_descale", p.VDescale.Ptr, vScales, 4),
		spanOf("sinks", p.Sinks, uint64(s.HeadsQ), 4),
		spanOf("cu_seqlens_q", p.CuSeqlensQ, uint64(s.Batch)+1, 4),
		tensorRange("out", p.Out, [4]int{qBatch, qRows, s.HeadsQ, s.HeadDim}, el),
		spanOf("lse", p.LSE, p.lseElems(), 4),
	}
}

// checkOverlaps refuses what the kernels write sharing a byte with another
// tensor of p (see CheckPointers): out and lse, and with an append the
// caches, which then must not share memory with anything the call reads.
// k_cache and v_cache may interleave (one buffer of both), since the
// append writes each key's row in both together.
func (p *Problem) checkOverlaps(op string) error {
	// Tensors are told apart by their index in spans (no string compares:
	// this runs every call).
	const kIdx, vIdx, outIdx, lseIdx = 1, 2, 16, 17
	all := p.spans()
	inputs := all[:lseIdx] // the inputs and out
	kCache, vCache := all[kIdx], all[vIdx]
	for _, wi := range [...]int{outIdx, lseIdx} {
		w := &all[wi]
		for ri := range inputs {
			if r := &inputs[ri]; ri != wi && w.overlaps(*r) {
				return invalid(op, w.name, fmt.Sprintf("bytes [%#x, %#x) overlap %s's [%#x, %#x); what the kernels write must not share memory with another tensor", w.lo, w.hi, r.name, r.lo, r.hi))
			}
		}
	}
	if p.New.Seqlen == 0 {
		return nil
	}
	if p.cachesShareElements(kCache, vCache) {
		return invalid(op, "v_cache", "shares elements with k_cache, and the append writes both (one buffer may hold both when they interleave)")
	}
	for _, w := range [...]byteRange{kCache, vCache} {
		for ri, r := range inputs {
			if ri != kIdx && ri != vIdx && w.overlaps(r) {
				return invalid(op, r.name, fmt.Sprintf("bytes [%#x, %#x) overlap %s's [%#x, %#x); the append writes into the caches, which must not share memory with what the call reads (new keys already in the cache: pass k=None and count them in cache_seqlens)", r.lo, r.hi, w.name, w.lo, w.hi))
			}
		}
	}
	return nil
}

// CheckWorkspace checks a workspace of the given bytes at ptr for a call
// of p, whose pointers are valid (CheckPointers): 16-byte aligned (the
// kernels move partials and the rotated q 16 bytes at a time) and sharing
// no byte with any tensor of the call, since the kernels write it while
// they read them. A workspace of 0 bytes is not checked.
func (p *Problem) CheckWorkspace(ptr uintptr, bytes int) error {
	const op = "decode"
	if bytes <= 0 {
		return nil
	}
	if ptr%16 != 0 {
		return unsupported(op, "workspace", fmt.Sprintf("address %#x is not 16-byte aligned", ptr))
	}
	ws := spanOf("workspace", ptr, uint64(bytes), 1)
	for _, r := range p.spans() {
		if ws.overlaps(r) {
			return invalid(op, "workspace", fmt.Sprintf("bytes [%#x, %#x) overlap %s's [%#x, %#x); the kernels write the workspace while they read the call's tensors", ws.lo, ws.hi, r.name, r.lo, r.hi))
		}
	}
	return nil
}

// checkStrides checks the strides of one (batch, seq, heads, head_dim)
// tensor of elem-byte elements with the given sizes; exclusive means it is
// written and must not overlap itself.
func checkStrides(op, name string, t Tensor, size [4]int, elem int, exclusive bool) error {
	stride := [4]int64{t.BatchStride, t.SeqStride, t.HeadStride, 1}
	dims := [3]string{"batch", "seq", "head"}
	load := int64(16 / elem) // the elements of a 16-byte load
	for i, st := range stride[:3] {
		if st < 0 {
			return invalid(op, name, fmt.Sprintf("negative %s stride %d", dims[i], st))
		}
		if st%load != 0 {
			return unsupported(op, name, fmt.Sprintf("%s stride %d is not a multiple of %d elements; the kernels load %d elements at a time", dims[i], st, load, load))
		}
	}
	// The largest element offset must fit in the kernels' 64-bit arithmetic
	// (an empty tensor, such as the caches of an empty cache, has none).
	var last int64
	for i := range stride {
		n := int64(size[i] - 1)
		if n < 0 {
			break
		}
		if n > 0 && stride[i] > (math.MaxInt64-last)/n {
			return invalid(op, name, "strides too large: element offsets overflow 64 bits")
		}
		last += n * stride[i]
	}
	if exclusive && overlaps(size[:], stride[:]) {
		return invalid(op, name, fmt.Sprintf("strides (%d, %d, %d, 1) make elements overlap", t.BatchStride, t.SeqStride, t.HeadStride))
	}
	return nil
}

// overflows32 reports whether x is past float32's range.
func overflows32(x float64) bool { return math.Abs(x) > math.MaxFloat32 }

// EffectiveScale is the softmax scale the kernels use: Scale, or
// 1/sqrt(HeadDim) where it is 0 (the default).
func (p *Problem) EffectiveScale() float32 {
	if p.Scale == 0 {
		return float32(1 / math.Sqrt(float64(p.HeadDim)))
	}
	return p.Scale
}

// overlaps reports whether two different indices of a tensor with the given
// sizes and strides can share an address. Dimensions of size 1 never move
// the address; the others, innermost (smallest stride) first, must each step
// past everything the inner ones span. This is the usual sufficient check:
// it accepts every permuted dense or padded layout.
func overlaps(size []int, stride []int64) bool {
	type dim struct {
		n  int64
		st int64
	}
	var buf [5]dim // room for every caller's dimensions: no allocation (it runs per call)
	ds := buf[:0]
	for i := range size {
		if size[i] > 1 {
			d := dim{int64(size[i]), stride[i]}
			j := len(ds) // insertion by stride: a handful of dimensions
			ds = append(ds, d)
			for ; j > 0 && ds[j-1].st > d.st; j-- {
				ds[j] = ds[j-1]
			}
			ds[j] = d
		}
	}
	span := int64(1) // addresses [0, span) reached by the inner dimensions
	for _, d := range ds {
		if d.st < span {
			return true
		}
		span += d.st * (d.n - 1)
	}
	return false
}

// ceilDiv is a/b rounded up, for a >= 0 and b > 0.
func ceilDiv(a, b int) int { return (a + b - 1) / b }
