package core

import (
	"fmt"
	"math"
)

// This file holds the serving features of a Problem (flash_attn_with_kvcache's
// paged cache, cache_batch_idx, cache_leftpad, window_size, softcap,
// alibi_slopes and the append of new tokens with rotary embedding) and
// their checks. Positions are absolute key indices of a sequence's cache:
// sequence b attends to len = (cache_seqlens[b] or Seqlen) + New.Seqlen keys,
// clamped to [0, SeqlenCache], from lo = cache_leftpad[b] (clamped to
// [0, len]) on, and its query row i sits at position len - SeqlenQ + i.

// Window is window_size: with Enabled, the query row at position pos sees
// keys pos-Left <= j <= pos+Right, a side of -1 being unbounded. Causal
// makes Right 0. Disabled, Left and Right are 0 or -1.
type Window struct {
	Enabled     bool
	Left, Right int
}

// Append is the new tokens k and v, (Batch, Seqlen, HeadsKV, HeadDim) in
// q's dtype, that a call writes into the cache before attention: token t
// of sequence b goes to key cache_seqlens[b] + t (writes past the cache
// are skipped) and is attended to. The caller advances cache_seqlens.
// Seqlen 0: nothing is appended.
type Append struct {
	K, V   Tensor
	Seqlen int // new tokens per sequence (seqlen_new), 0 to SeqlenCache
}

// Rotary is the rotary embedding applied with an Append: the first Dim
// channels of every new key t of sequence b are rotated at position
// cache_seqlens[b] + t, and those of query row i at cache_seqlens[b] + i
// when Causal or a window bound is set, else at cache_seqlens[b]; positions
// are clamped to [0, Rows-1]. A pair (x0, x1) at angle (cos, sin) becomes
// (x0*cos - x1*sin, x0*sin + x1*cos). The rotated q is kept in the
// workspace (Plan.QRotOffset), the rotated keys are what the cache gets.
type Rotary struct {
	Cos, Sin    uintptr // per call: (Rows, Dim/2) tables in q's dtype
	Stride      int64   // elements between rows of Cos and Sin
	Dim         int     // rotated channels: even, a multiple of 16, at most HeadDim; 0: no rotary
	Rows        int     // positions in the tables (seqlen_ro)
	Interleaved bool    // pairs (2m, 2m+1) (GPT-J); else (m, m+Dim/2) (GPT-NeoX)
}

// Serving reports whether any serving feature of p is on: a paged cache,
// cache_batch_idx, cache_leftpad, a window, softcap, ALiBi or an append.
// The serving kernels then run (Shape.Serving, see PlanShape).
func (p *Problem) Serving() bool {
	return p.PageSize != 0 || p.CacheBatch != 0 || p.Leftpad || p.Window.Enabled || p.Softcap != 0 ||
		p.Alibi || p.New.Seqlen != 0 || p.Rotary.Dim != 0
}

// PagedForm reports whether p runs the paged form of the serving kernel
// (Shape.Paged): a paged cache whose pages hold a multiple of 8 keys, so
// that the 8 (or 4) consecutive keys a thread copies lie in one page, and
// no serving feature besides an append and rotary.
func (p *Problem) PagedForm() bool {
	return p.PageSize > 0 && p.PageSize%8 == 0 && p.CacheBatch == 0 && !p.Leftpad && !p.Window.Enabled &&
		p.Softcap == 0 && !p.Alibi
}

// ContiguousForm reports whether p's cache is contiguous with no serving
// feature besides an append and rotary (Shape.Contiguous): with a few new
// tokens it runs the contiguous cache's appending form, which reads and
// writes row b of the cache (no cache_batch_idx).
func (p *Problem) ContiguousForm() bool {
	return p.PageSize == 0 && p.CacheBatch == 0 && !p.Leftpad && !p.Window.Enabled && p.Softcap == 0 && !p.Alibi
}

// PlanShape is the Shape p is planned with: p.Shape with its serving fields
// set from p's, so that MakePlan, cuda.PlanFor and the plan cache see
// everything the plan depends on. Serving is kept when p.Shape already
// has it (the serving kernels then run without any feature on); Paged is
// always p.PagedForm(), and Contiguous p.ContiguousForm() where p appends.
func (p *Problem) PlanShape() Shape {
	s := p.Shape
	s.Serving = s.Serving || p.Serving()
	s.SeqlenNew = p.New.Seqlen
	s.WindowKeys = windowKeys(p.Window, p.SeqlenQ)
	s.RotaryQ = p.Rotary.Dim > 0
	s.Paged = p.PagedForm()
	s.Contiguous = p.New.Seqlen > 0 && p.ContiguousForm()
	s.DeviceLengths = s.DeviceLengths && !p.Leftpad // balanced splits count every key from 0
	return s
}

// windowKeys is Shape.WindowKeys for window w and seqlenQ query rows: the
// rows at positions len-seqlenQ .. len-1 see no key before
// len-seqlenQ-Left, so at most Left+seqlenQ+1 keys; 0 without a left bound.
func windowKeys(w Window, seqlenQ int) int {
	if !w.Enabled || w.Left < 0 || w.Left > math.MaxInt32 {
		return 0
	}
	return w.Left + seqlenQ + 1
}

// validateServing checks the serving fields of a Shape: their ranges, and
// that they come with Serving (the plain kernels would ignore them).
func (s Shape) validateServing(op string) error {
	switch {
	case s.SeqlenNew < 0:
		return invalid(op, "k", fmt.Sprintf("seqlen_new %d; must not be negative", s.SeqlenNew))
	case s.SeqlenNew > s.SeqlenCache:
		return invalid(op, "k", fmt.Sprintf("%d new tokens exceed seqlen_cache=%d", s.SeqlenNew, s.SeqlenCache))
	case s.WindowKeys < 0:
		return invalid(op, "window_size", fmt.Sprintf("window keys %d; must not be negative", s.WindowKeys))
	case s.RotaryQ && s.SeqlenNew == 0:
		return invalid(op, "rotary_cos", "needs k and v: the rotary embedding is applied with an append")
	case !s.Serving && s.SeqlenNew > 0:
		return invalid(op, "k", "an append needs Shape.Serving (the serving kernels)")
	case !s.Serving && s.WindowKeys > 0:
		return invalid(op, "window_size", "a window needs Shape.Serving (the serving kernels)")
	case s.Paged && (!s.Serving || s.WindowKeys > 0):
		return invalid(op, "block_table", "the paged form needs Shape.Serving and no window")
	case s.Contiguous && (!s.Serving || s.WindowKeys > 0 || s.Paged || s.SeqlenNew == 0):
		return invalid(op, "k", "the contiguous cache's appending form needs Shape.Serving, an append, and no window or pages")
	}
	return nil
}

// validateServing is ValidateLayout's part for the serving features: their
// sizes and options (validateServingSizes), then the strides of the paged
// or batch-indexed caches and of the new tokens.
func (p *Problem) validateServing(op string) error {
	if err := p.validateServingSizes(op); err != nil {
		return err
	}
	return p.validateServingStrides(op)
}

// ValidateSizes reports the first thing wrong with what p's plan depends
// on: its Shape, and its serving features' sizes and options (the paged
// cache's page counts, the cache rows, the window, softcap, ALiBi's
// stride, the new tokens' count and the rotary tables' layout), and, for
// an append without cache_seqlens, that Seqlen plus the new tokens fit
// the cache. It reads neither the tensors' strides nor any address, so a
// caller can size the workspace (cuda.PlanFor of PlanShape) before it has
// the tensors; Validate checks everything.
func (p *Problem) ValidateSizes() error {
	const op = "plan"
	if err := p.validateRagged(op); err != nil {
		return err
	}
	if err := p.Shape.validateSizes(op); err != nil {
		return err
	}
	if err := p.validateServingSizes(op); err != nil {
		return err
	}
	if n := p.New.Seqlen; n > 0 && p.CacheSeqlens == 0 && !p.DeviceLengths {
		return p.checkAppendStart(op)
	}
	return nil
}

// validateServingSizes is validateServing's part that reads no tensor
// stride: the serving features' sizes and options.
func (p *Problem) validateServingSizes(op string) error {
	s := p.Shape
	switch {
	case p.PageSize < 0:
		return invalid(op, "page_size", fmt.Sprintf("%d; must be at least 1 (or 0: a contiguous cache)", p.PageSize))
	case p.PageSize > 0:
		switch {
		case p.NumPages < 1:
			return invalid(op, "k_cache", fmt.Sprintf("%d pages (k_cache.shape[0] of a paged cache); must be at least 1", p.NumPages))
		case p.NumPages > math.MaxInt32:
			return unsupported(op, "k_cache", fmt.Sprintf("%d pages; at most %d", p.NumPages, math.MaxInt32))
		case p.MaxPages < 1:
			return invalid(op, "block_table", fmt.Sprintf("%d pages per sequence (block_table.shape[1]); must be at least 1", p.MaxPages))
		case int64(p.MaxPages)*int64(p.PageSize) != int64(s.SeqlenCache):
			return invalid(op, "seqlen_cache", fmt.Sprintf("%d; a paged cache holds max_pages*page_size = %d*%d keys per sequence", s.SeqlenCache, p.MaxPages, p.PageSize))
		case p.BlockTableStride < 0:
			return invalid(op, "block_table", fmt.Sprintf("negative batch stride %d", p.BlockTableStride))
		case p.BlockTableStride > (math.MaxInt64-int64(p.MaxPages))/int64(s.Batch):
			return invalid(op, "block_table", "stride too large: offsets overflow 64 bits")
		case p.CacheBatch != 0:
			return invalid(op, "cache_batch_idx", "cannot be used with block_table (a paged cache)")
		}
	case p.NumPages != 0 || p.MaxPages != 0 || p.BlockTableStride != 0:
		return invalid(op, "page_size", fmt.Sprintf("0 (a contiguous cache), but num_pages %d, max_pages %d, block_table stride %d are set", p.NumPages, p.MaxPages, p.BlockTableStride))
	}
	switch {
	case p.CacheBatch < 0:
		return invalid(op, "cache_batch_idx", fmt.Sprintf("cache rows %d (k_cache.shape[0]); must not be negative", p.CacheBatch))
	case p.CacheBatch > math.MaxInt32:
		return unsupported(op, "cache_batch_idx", fmt.Sprintf("cache rows %d; at most %d", p.CacheBatch, math.MaxInt32))
	}
	w := p.Window
	switch {
	case w.Enabled && (w.Left < -1 || w.Right < -1):
		return invalid(op, "window_size", fmt.Sprintf("(%d, %d); each side must be -1 (unbounded) or at least 0", w.Left, w.Right))
	case w.Enabled && (w.Left > math.MaxInt32 || w.Right > math.MaxInt32):
		return unsupported(op, "window_size", fmt.Sprintf("(%d, %d); at most %d a side", w.Left, w.Right, math.MaxInt32))
	case !w.Enabled && !(w.Left == w.Right && (w.Left == 0 || w.Left == -1)):
		return invalid(op, "window_size", fmt.Sprintf("(%d, %d) given, but Window.Enabled is false", w.Left, w.Right))
	}
	if c := float64(p.Softcap); math.IsNaN(c) || math.IsInf(c, 0) || c < 0 {
		return invalid(op, "softcap", fmt.Sprintf("%v; must be finite and not negative (0: none)", p.Softcap))
	}
	// The kernels take softcap * log2(e) and scale / softcap in float32.
	if c := float64(p.Softcap); c > 0 && (overflows32(c*math.Log2E) || overflows32(float64(p.EffectiveScale())/c)) {
		return invalid(op, "softcap", fmt.Sprintf("%v; softcap*log2(e) and softmax_scale/softcap must fit in float32", p.Softcap))
	}
	if p.AlibiBatchStride < 0 || (!p.Alibi && p.AlibiBatchStride != 0) {
		return invalid(op, "alibi_slopes", fmt.Sprintf("batch stride %d; must be 0 (slopes (nheads_q,)) or positive, with Alibi", p.AlibiBatchStride))
	}
	if p.Alibi && p.AlibiBatchStride > (math.MaxInt64-int64(s.HeadsQ))/int64(s.Batch) {
		return invalid(op, "alibi_slopes", "stride too large: offsets overflow 64 bits")
	}

	n := p.New.Seqlen
	switch {
	case n < 0:
		return invalid(op, "k", fmt.Sprintf("seqlen_new %d; must not be negative", n))
	case n > s.SeqlenCache:
		return invalid(op, "k", fmt.Sprintf("%d new tokens (k.shape[1]) exceed seqlen_cache=%d", n, s.SeqlenCache))
	}
	return p.Rotary.validate(op, n, s.HeadDim)
}

// validateServingStrides is validateServing's part for the strides: the
// paged cache's within the serving kernels' 32-bit page addressing, the
// caches' at their real extents, and the new tokens'.
func (p *Problem) validateServingStrides(op string) error {
	s := p.Shape
	if p.PageSize > 0 {
		// The serving kernels address a key of a page in 32-bit pieces (a page's
		// offset as page id times a 32-bit stride, the row's in 32 bits).
		for _, c := range []struct {
			name string
			t    Tensor
		}{{"k_cache", p.K}, {"v_cache", p.V}} {
			switch {
			case c.t.BatchStride > math.MaxUint32:
				return unsupported(op, c.name, fmt.Sprintf("page stride %d elements; at most %d", c.t.BatchStride, uint32(math.MaxUint32)))
			case int64(p.PageSize)*c.t.SeqStride > math.MaxInt32:
				return unsupported(op, c.name, fmt.Sprintf("a page of %d rows %d elements apart spans more than %d elements", p.PageSize, c.t.SeqStride, math.MaxInt32))
			}
		}
	}
	// The caches' strides at their real extents (ValidateLayout assumed
	// (batch, seqlen_cache)), and with an append, which writes them, no two
	// elements of one sharing an address (across the two: CheckPointers).
	n := p.New.Seqlen
	if rows, seq := p.cacheDims(); rows != s.Batch || seq != s.SeqlenCache || n > 0 {
		for _, x := range [...]struct {
			name string
			t    Tensor
		}{{"k_cache", p.K}, {"v_cache", p.V}} {
			if err := checkStrides(op, x.name, x.t, [4]int{rows, seq, s.HeadsKV, s.HeadDim}, s.CacheDType().Size(), n > 0); err != nil {
				return err
			}
		}
	}
	if n > 0 {
		batch, rows := p.qDims(n)
		for _, x := range [...]struct {
			name string
			t    Tensor
		}{{"k", p.New.K}, {"v", p.New.V}} {
			if err := checkStrides(op, x.name, x.t, [4]int{batch, rows, s.HeadsKV, s.HeadDim}, s.DType.Size(), false); err != nil {
				return err
			}
		}
	}
	return nil
}

// cachesShareElements reports whether k_cache and v_cache, whose byte
// ranges are k and v, may share an element. Caches of equal strides whose addresses
// differ by a whole number of elements are one tensor with a fifth
// dimension of size 2 (K, V) and that distance as its stride, which must
// not overlap itself: this accepts K and V interleaved in one buffer and
// refuses v_cache == k_cache. Other layouts are refused where their byte
// ranges meet.
func (p *Problem) cachesShareElements(k, v byteRange) bool {
	if !k.overlaps(v) {
		return false
	}
	el := p.CacheDType().Size()
	rows, seq := p.cacheDims()
	size := [4]int{rows, seq, p.HeadsKV, p.HeadDim}
	d := int64(p.V.Ptr) - int64(p.K.Ptr)
	if d < 0 {
		d = -d
	}
	if p.K.BatchStride != p.V.BatchStride || p.K.SeqStride != p.V.SeqStride || p.K.HeadStride != p.V.HeadStride ||
		d%int64(el) != 0 {
		return true
	}
	return overlaps([]int{size[0], size[1], size[2], size[3], 2},
		[]int64{p.K.BatchStride, p.K.SeqStride, p.K.HeadStride, 1, d / int64(el)})
}

// cacheDims is the first two dimensions of K and V: (Batch, SeqlenCache),
// (NumPages, PageSize) for a paged cache, (CacheBatch, SeqlenCache) with
// cache_batch_idx. A check of the caches' extents uses them.
func (p *Problem) cacheDims() (rows, seq int) {
	switch {
	case p.PageSize > 0:
		return p.NumPages, p.PageSize
	case p.CacheBatch > 0:
		return p.CacheBatch, p.SeqlenCache
	}
	return p.Batch, p.SeqlenCache
}

// validate checks the rotary layout for an append of seqlenNew tokens of
// head dim headDim.
func (r Rotary) validate(op string, seqlenNew, headDim int) error {
	switch {
	case r.Dim == 0:
		return nil
	case r.Dim < 0:
		return invalid(op, "rotary_dim", fmt.Sprintf("%d; must be positive (or 0: no rotary)", r.Dim))
	case seqlenNew == 0:
		return invalid(op, "rotary_cos", "needs k and v: the rotary embedding is applied with an append")
	case r.Dim%2 != 0:
		return invalid(op, "rotary_dim", fmt.Sprintf("%d is odd; channels rotate in pairs", r.Dim))
	case r.Dim > headDim:
		return invalid(op, "rotary_dim", fmt.Sprintf("%d exceeds headdim=%d", r.Dim, headDim))
	case r.Dim%16 != 0:
		return unsupported(op, "rotary_dim", fmt.Sprintf("%d; supported: multiples of 16 (as in FlashAttention)", r.Dim))
	case r.Rows < 1:
		return invalid(op, "rotary_cos", fmt.Sprintf("%d rows (seqlen_ro); must be at least 1", r.Rows))
	case r.Rows > math.MaxInt32:
		return unsupported(op, "rotary_cos", fmt.Sprintf("%d rows; at most %d", r.Rows, math.MaxInt32))
	case r.Stride < 0:
		return invalid(op, "rotary_cos", fmt.Sprintf("negative row stride %d", r.Stride))
	case r.Stride%8 != 0:
		return unsupported(op, "rotary_cos", fmt.Sprintf("row stride %d is not a multiple of 8 elements; the kernels load 8 elements at a time", r.Stride))
	case r.Stride > (math.MaxInt64-int64(r.Dim))/int64(r.Rows):
		return invalid(op, "rotary_cos", "stride too large: offsets overflow 64 bits")
	}
	return nil
}

// checkServingPointers is CheckPointers' part for the serving features:
// each feature's arrays are given exactly when it is on, and aligned, and
// an append knows where each sequence's cached keys end.
func (p *Problem) checkServingPointers(op string) error {
	// Every call runs this: a layout without the features, called without their arrays, is done.
	if p.BlockTable|p.CacheBatchIdx|p.CacheLeftpad|p.AlibiSlopes|p.New.K.Ptr|p.New.V.Ptr|p.Rotary.Cos|p.Rotary.Sin == 0 &&
		p.PageSize <= 0 && p.CacheBatch <= 0 && !p.Leftpad && !p.Alibi && p.New.Seqlen <= 0 && p.Rotary.Dim <= 0 {
		return nil
	}
	addrs := [...]uintptr{p.BlockTable, p.CacheBatchIdx, p.CacheLeftpad, p.AlibiSlopes, p.New.K.Ptr, p.New.V.Ptr,
		p.Rotary.Cos, p.Rotary.Sin}
	on := [...]bool{p.PageSize > 0, p.CacheBatch > 0, p.Leftpad, p.Alibi, p.New.Seqlen > 0, p.New.Seqlen > 0,
		p.Rotary.Dim > 0, p.Rotary.Dim > 0}
	for i, addr := range addrs {
		x := &servingPointers[i]
		switch {
		case !on[i] && addr != 0:
			return invalid(op, x.name, fmt.Sprintf("address %#x given without %s", addr, x.with))
		case on[i] && addr == 0:
			return invalid(op, x.name, "null device pointer")
		case addr&(x.align-1) != 0 && x.align == 16:
			return unsupported(op, x.name, fmt.Sprintf("address %#x is not 16-byte aligned; the kernels load 8 elements at a time (a fresh tensor, such as a .clone(), is aligned)", addr))
		case addr&(x.align-1) != 0:
			return invalid(op, x.name, fmt.Sprintf("address %#x is not %d-byte aligned", addr, x.align))
		}
	}
	if p.New.Seqlen > 0 && p.CacheSeqlens == 0 {
		return p.checkAppendStart(op)
	}
	return nil
}

// servingPointers names checkServingPointers' arrays in its order: the
// argument, what turns it on, its alignment (a power of two; a table, not
// rebuilt per call).
var servingPointers = [...]struct {
	name, with string
	align      uintptr
}{
	{"block_table", "page_size", 4},
	{"cache_batch_idx", "cache_batch (the cache rows)", 4},
	{"cache_leftpad", "Leftpad", 4},
	{"alibi_slopes", "Alibi", 4},
	{"k", "seqlen_new", 16},
	{"v", "seqlen_new", 16},
	{"rotary_cos", "rotary_dim", 16},
	{"rotary_sin", "rotary_dim", 16},
}

// checkAppendStart checks where an append without cache_seqlens writes:
// every sequence at Seqlen, which must be given and leave room for the
// new tokens.
func (p *Problem) checkAppendStart(op string) error {
	n := p.New.Seqlen
	if p.Seqlen < 0 {
		return invalid(op, "cache_seqlens", "required with k and v: the new tokens go after each sequence's cached ones")
	}
	if p.Seqlen+n > p.SeqlenCache {
		return invalid(op, "cache_seqlens", fmt.Sprintf("%d + %d new tokens exceed seqlen_cache=%d", p.Seqlen, n, p.SeqlenCache))
	}
	return nil
}
