package core

import (
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"
)

// pagedProblem is validProblem over a paged cache: 600 pages of 16 keys,
// 256 pages a sequence (4096 keys). The serving arrays of these problems lie
// far from validProblem's tensors.
func pagedProblem() Problem {
	p := validProblem()
	page := Tensor{BatchStride: 16 * 8 * 128, SeqStride: 8 * 128, HeadStride: 128}
	kp, vp := p.K.Ptr, p.V.Ptr
	p.K, p.V = page, page
	p.K.Ptr, p.V.Ptr = kp, vp
	p.PageSize, p.NumPages, p.MaxPages = 16, 600, 256
	p.BlockTable, p.BlockTableStride = 0x10000000, 256
	return p
}

// appendProblem is validProblem appending 3 tokens a sequence, rotated
// over 64 channels, after the lengths at cache_seqlens.
func appendProblem() Problem {
	p := validProblem()
	fresh := Tensor{BatchStride: 3 * 8 * 128, SeqStride: 8 * 128, HeadStride: 128}
	p.New = Append{K: fresh, V: fresh, Seqlen: 3}
	p.New.K.Ptr, p.New.V.Ptr = 0x12000000, 0x13000000
	p.CacheSeqlens = 0x11000000
	p.Rotary = Rotary{Cos: 0x14000000, Sin: 0x15000000, Stride: 32, Dim: 64, Rows: 8192, Interleaved: true}
	return p
}

// allProblem has every serving feature on but the paged cache (which
// excludes cache_batch_idx).
func allProblem() Problem {
	p := appendProblem()
	p.CacheBatch, p.CacheBatchIdx = 5, 0x16000000
	// A cache of 5 rows, K and V interleaved row by row in one buffer.
	p.V.Ptr = p.K.Ptr + uintptr(p.K.BatchStride)*2
	p.K.BatchStride *= 2
	p.V.BatchStride = p.K.BatchStride
	p.Leftpad, p.CacheLeftpad = true, 0x17000000
	p.Window = Window{Enabled: true, Left: 255, Right: 0}
	p.Softcap = 30
	p.Alibi, p.AlibiSlopes, p.AlibiBatchStride = true, 0x18000000, 32
	return p
}

// problemCase is a validation case: a fixture, an edit of it, and the
// argument and sentinel the error must carry ("" and nil: valid).
type problemCase struct {
	name string
	base func() Problem
	edit func(*Problem)
	arg  string
	want error
}

func TestServingValidate(t *testing.T) {
	plain := validProblem
	tests := []problemCase{
		{"plain", plain, func(p *Problem) {}, "", nil},
		{"paged", pagedProblem, func(p *Problem) {}, "", nil},
		{"paged, page 1", pagedProblem, func(p *Problem) { p.PageSize, p.MaxPages, p.K.BatchStride, p.V.BatchStride = 1, 4096, 1024, 1024 }, "", nil},
		{"paged, page 7", pagedProblem, func(p *Problem) { p.PageSize, p.MaxPages, p.SeqlenCache = 7, 100, 700 }, "", nil},
		{"paged, one table row for all", pagedProblem, func(p *Problem) { p.BlockTableStride = 0 }, "", nil},
		{"append and rotary", appendProblem, func(p *Problem) {}, "", nil},
		{"append, seqlen int", appendProblem, func(p *Problem) { p.CacheSeqlens, p.Seqlen = 0, 4093 }, "", nil},
		{"append, no rotary", appendProblem, func(p *Problem) { p.Rotary = Rotary{} }, "", nil},
		{"append the whole cache", appendProblem, func(p *Problem) {
			p.New.Seqlen, p.New.K.BatchStride, p.New.V.BatchStride = 4096, 4096*8*128, 4096*8*128
		}, "", nil},
		{"rotary over all channels, neox", appendProblem, func(p *Problem) { p.Rotary.Dim, p.Rotary.Interleaved = 128, false }, "", nil},
		{"every feature", allProblem, func(p *Problem) {}, "", nil},
		{"window off as (-1, -1)", plain, func(p *Problem) { p.Window = Window{Left: -1, Right: -1} }, "", nil},
		{"window (-1, -1) on", plain, func(p *Problem) { p.Window = Window{Enabled: true, Left: -1, Right: -1} }, "", nil},
		{"alibi (nheads_q,)", plain, func(p *Problem) { p.Alibi, p.AlibiSlopes = true, 0x18000000 }, "", nil},

		{"page_size -1", pagedProblem, func(p *Problem) { p.PageSize = -1 }, "page_size", ErrInvalid},
		{"no pages", pagedProblem, func(p *Problem) { p.NumPages = 0 }, "k_cache", ErrInvalid},
		{"too many pages", pagedProblem, func(p *Problem) { p.NumPages = math.MaxInt32 + 1 }, "k_cache", ErrUnsupported},
		{"no pages a sequence", pagedProblem, func(p *Problem) { p.MaxPages = 0 }, "block_table", ErrInvalid},
		{"page stride of 2^32", pagedProblem, func(p *Problem) { p.K.BatchStride = math.MaxUint32 + 1 }, "k_cache", ErrUnsupported},
		{"a page over 2^31 elements", pagedProblem, func(p *Problem) { p.V.SeqStride = math.MaxInt32/16 + 1 }, "v_cache", ErrUnsupported},
		{"seqlen_cache not max_pages*page_size", pagedProblem, func(p *Problem) { p.MaxPages = 255 }, "seqlen_cache", ErrInvalid},
		{"negative block table stride", pagedProblem, func(p *Problem) { p.BlockTableStride = -256 }, "block_table", ErrInvalid},
		{"block table stride overflow", pagedProblem, func(p *Problem) { p.BlockTableStride = math.MaxInt64 / 2 }, "block_table", ErrInvalid},
		{"paged with cache_batch_idx", pagedProblem, func(p *Problem) { p.CacheBatch, p.CacheBatchIdx = 2, 0x16000000 }, "cache_batch_idx", ErrInvalid},
		{"page stride not a multiple of 8", pagedProblem, func(p *Problem) { p.V.BatchStride += 4 }, "v_cache", ErrUnsupported},
		{"page stride overflow", pagedProblem, func(p *Problem) { p.K.BatchStride = math.MaxInt64 / 512 * 8 }, "k_cache", ErrUnsupported},
		{"pages without page_size", plain, func(p *Problem) { p.NumPages = 600 }, "page_size", ErrInvalid},
		{"block_table without page_size", plain, func(p *Problem) { p.BlockTable = 0x10000000 }, "block_table", ErrInvalid},
		{"block_table null", pagedProblem, func(p *Problem) { p.BlockTable = 0 }, "block_table", ErrInvalid},
		{"block_table misaligned", pagedProblem, func(p *Problem) { p.BlockTable = 0x10000002 }, "block_table", ErrInvalid},

		{"cache rows negative", plain, func(p *Problem) { p.CacheBatch = -1 }, "cache_batch_idx", ErrInvalid},
		{"cache rows stride overflow", allProblem, func(p *Problem) { p.K.BatchStride = math.MaxInt64 / 4 / 8 * 8 }, "k_cache", ErrInvalid},
		{"cache_batch_idx null", allProblem, func(p *Problem) { p.CacheBatchIdx = 0 }, "cache_batch_idx", ErrInvalid},
		{"cache_batch_idx without cache rows", plain, func(p *Problem) { p.CacheBatchIdx = 0x16000000 }, "cache_batch_idx", ErrInvalid},
		{"cache_leftpad null", allProblem, func(p *Problem) { p.CacheLeftpad = 0 }, "cache_leftpad", ErrInvalid},
		{"cache_leftpad without Leftpad", plain, func(p *Problem) { p.CacheLeftpad = 0x17000000 }, "cache_leftpad", ErrInvalid},
		{"cache_leftpad misaligned", allProblem, func(p *Problem) { p.CacheLeftpad = 0x17000001 }, "cache_leftpad", ErrInvalid},

		{"window left -2", plain, func(p *Problem) { p.Window = Window{Enabled: true, Left: -2, Right: 0} }, "window_size", ErrInvalid},
		{"window right -3", plain, func(p *Problem) { p.Window = Window{Enabled: true, Left: 4, Right: -3} }, "window_size", ErrInvalid},
		{"window huge", plain, func(p *Problem) { p.Window = Window{Enabled: true, Left: math.MaxInt32 + 1, Right: 0} }, "window_size", ErrUnsupported},
		{"window set but off", plain, func(p *Problem) { p.Window = Window{Left: 128, Right: 0} }, "window_size", ErrInvalid},

		{"softcap negative", plain, func(p *Problem) { p.Softcap = -1 }, "softcap", ErrInvalid},
		{"softcap nan", plain, func(p *Problem) { p.Softcap = float32(math.NaN()) }, "softcap", ErrInvalid},
		{"softcap inf", plain, func(p *Problem) { p.Softcap = float32(math.Inf(1)) }, "softcap", ErrInvalid},

		{"alibi_slopes null", allProblem, func(p *Problem) { p.AlibiSlopes = 0 }, "alibi_slopes", ErrInvalid},
		{"alibi_slopes without Alibi", plain, func(p *Problem) { p.AlibiSlopes = 0x18000000 }, "alibi_slopes", ErrInvalid},
		{"alibi_slopes misaligned", allProblem, func(p *Problem) { p.AlibiSlopes = 0x18000002 }, "alibi_slopes", ErrInvalid},
		{"alibi negative stride", allProblem, func(p *Problem) { p.AlibiBatchStride = -32 }, "alibi_slopes", ErrInvalid},
		{"alibi stride without Alibi", plain, func(p *Problem) { p.AlibiBatchStride = 32 }, "alibi_slopes", ErrInvalid},

		{"seqlen_new negative", plain, func(p *Problem) { p.New.Seqlen = -1 }, "k", ErrInvalid},
		{"seqlen_new past the cache", appendProblem, func(p *Problem) { p.New.Seqlen = 4097 }, "k", ErrInvalid},
		{"k stride not a multiple of 8", appendProblem, func(p *Problem) { p.New.K.SeqStride = 1020 }, "k", ErrUnsupported},
		{"v negative stride", appendProblem, func(p *Problem) { p.New.V.HeadStride = -128 }, "v", ErrInvalid},
		{"k null", appendProblem, func(p *Problem) { p.New.K.Ptr = 0 }, "k", ErrInvalid},
		// The append writes the caches: their elements must be their own.
		{"append into v_cache = k_cache", appendProblem, func(p *Problem) { p.V = p.K }, "v_cache", ErrInvalid},
		{"append into v_cache half a row into k_cache", appendProblem, func(p *Problem) { p.V.Ptr = p.K.Ptr + 128 }, "v_cache", ErrInvalid},
		{"append into caches of other strides that meet", appendProblem, func(p *Problem) {
			p.V.Ptr, p.V.BatchStride = p.K.Ptr+16, p.K.BatchStride*2
		}, "v_cache", ErrInvalid},
		{"append into a cache whose heads alias", appendProblem, func(p *Problem) { p.K.HeadStride = 0 }, "k_cache", ErrInvalid},
		{"append into a cache broadcast over the batch", appendProblem, func(p *Problem) { p.V.BatchStride = 0 }, "v_cache", ErrInvalid},
		{"read-only caches may alias", plain, func(p *Problem) { p.V = p.K }, "", nil},
		{"softcap past float32 in base 2", plain, func(p *Problem) { p.Softcap = 3e38 }, "softcap", ErrInvalid},
		{"softcap so small scale/softcap overflows", plain, func(p *Problem) { p.Softcap = 1e-40 }, "softcap", ErrInvalid},
		{"a small softcap", plain, func(p *Problem) { p.Softcap = 1e-30 }, "", nil},
		{"v misaligned", appendProblem, func(p *Problem) { p.New.V.Ptr += 8 }, "v", ErrUnsupported},
		{"k without seqlen_new", plain, func(p *Problem) { p.New.K.Ptr = 0x12000000 }, "k", ErrInvalid},
		{"append without cache_seqlens", appendProblem, func(p *Problem) { p.CacheSeqlens = 0 }, "cache_seqlens", ErrInvalid},
		{"append past the int seqlen", appendProblem, func(p *Problem) { p.CacheSeqlens, p.Seqlen = 0, 4094 }, "cache_seqlens", ErrInvalid},

		{"rotary without append", plain, func(p *Problem) { p.Rotary = appendProblem().Rotary }, "rotary_cos", ErrInvalid},
		{"rotary_dim negative", appendProblem, func(p *Problem) { p.Rotary.Dim = -16 }, "rotary_dim", ErrInvalid},
		{"rotary_dim odd", appendProblem, func(p *Problem) { p.Rotary.Dim = 33 }, "rotary_dim", ErrInvalid},
		{"rotary_dim past headdim", appendProblem, func(p *Problem) { p.Rotary.Dim = 144 }, "rotary_dim", ErrInvalid},
		{"rotary_dim not a multiple of 16", appendProblem, func(p *Problem) { p.Rotary.Dim = 24 }, "rotary_dim", ErrUnsupported},
		{"rotary rows 0", appendProblem, func(p *Problem) { p.Rotary.Rows = 0 }, "rotary_cos", ErrInvalid},
		{"rotary stride negative", appendProblem, func(p *Problem) { p.Rotary.Stride = -32 }, "rotary_cos", ErrInvalid},
		{"rotary stride not a multiple of 8", appendProblem, func(p *Problem) { p.Rotary.Stride = 36 }, "rotary_cos", ErrUnsupported},
		{"rotary stride overflow", appendProblem, func(p *Problem) { p.Rotary.Stride = math.MaxInt64 / 8 * 8 }, "rotary_cos", ErrInvalid},
		{"rotary_cos null", appendProblem, func(p *Problem) { p.Rotary.Cos = 0 }, "rotary_cos", ErrInvalid},
		{"rotary_sin misaligned", appendProblem, func(p *Problem) { p.Rotary.Sin += 4 }, "rotary_sin", ErrUnsupported},
		{"rotary_cos without rotary_dim", appendProblem, func(p *Problem) { p.Rotary.Dim = 0 }, "rotary_cos", ErrInvalid},

		// An append writes into the caches (k_cache [0x1000000, 0x2000000),
		// v_cache [0x3000000, 0x4000000)): nothing the call reads may lie
		// there, but the caches may interleave.
		{"k inside k_cache", appendProblem, func(p *Problem) { p.New.K.Ptr = 0x1800000 }, "k", ErrInvalid},
		{"v inside v_cache", appendProblem, func(p *Problem) { p.New.V.Ptr = 0x4000000 - 0x1000 }, "v", ErrInvalid},
		{"k inside v_cache", appendProblem, func(p *Problem) { p.New.K.Ptr = 0x3000000 }, "k", ErrInvalid},
		{"k right after k_cache", appendProblem, func(p *Problem) { p.New.K.Ptr = 0x2000000 }, "", nil},
		{"q inside k_cache", appendProblem, func(p *Problem) { p.Q.Ptr = 0x1000000 }, "q", ErrInvalid},
		{"rotary_sin inside v_cache", appendProblem, func(p *Problem) { p.Rotary.Sin = 0x3100000 }, "rotary_sin", ErrInvalid},
		{"cache_seqlens inside k_cache", appendProblem, func(p *Problem) { p.CacheSeqlens = 0x1000100 }, "cache_seqlens", ErrInvalid},
		{"block_table inside k_cache", func() Problem {
			p := pagedProblem()
			p.New, p.CacheSeqlens = appendProblem().New, 0x11000000
			return p
		}, func(p *Problem) { p.BlockTable = 0x1000000 }, "block_table", ErrInvalid},
		{"cache_leftpad inside v_cache", allProblem, func(p *Problem) { p.CacheLeftpad = 0x3000040 }, "cache_leftpad", ErrInvalid},
		{"alibi_slopes inside k_cache", allProblem, func(p *Problem) { p.AlibiSlopes = 0x1000000 }, "alibi_slopes", ErrInvalid},
		{"caches interleaved", appendProblem, func(p *Problem) {
			p.K.BatchStride, p.K.SeqStride = 2*p.K.BatchStride, 2*p.K.SeqStride
			p.V, p.V.Ptr = p.K, p.K.Ptr+8*128*2
		}, "", nil},
		{"no append: q inside k_cache", pagedProblem, func(p *Problem) { p.Q.Ptr = 0x1000000 }, "", nil},
		{"out over rotary_sin", appendProblem, func(p *Problem) { p.Out.Ptr = 0x15000000 + 0x1000 }, "out", ErrInvalid},
		{"out right after rotary_cos", appendProblem, func(p *Problem) { p.Out.Ptr = 0x14000000 + (8191*32+32)*2 }, "", nil},
		{"lse inside alibi_slopes", allProblem, func(p *Problem) { p.LSE = 0x18000000 + 4*33 }, "lse", ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.base()
			tt.edit(&p)
			err := p.Validate()
			checkOpErr(t, err, "decode", tt.arg, tt.want)
			// What ValidateSizes refuses, Validate refuses for the same argument.
			var se, ve *Error
			if serr := p.ValidateSizes(); serr != nil &&
				(!errors.As(serr, &se) || !errors.As(err, &ve) || se.Arg != ve.Arg || se.Err != ve.Err) {
				t.Errorf("ValidateSizes: %v; Validate: %v", serr, err)
			}
		})
	}
}

// checkOpErr is checkErr for an error that must also name operation op.
func checkOpErr(t *testing.T, err error, op, arg string, want error) {
	t.Helper()
	checkErr(t, err, arg, want)
	if err != nil && !strings.HasPrefix(err.Error(), "flashdecode: "+op+": ") {
		t.Errorf("error %q does not name the %s operation", err, op)
	}
}

// TestValidateSizes checks what a workspace query refuses before the
// tensors exist: ValidateSizes reads no stride and no address.
func TestValidateSizes(t *testing.T) {
	bare := func(base func() Problem) func() Problem {
		return func() Problem {
			p := base()
			p.Q, p.K, p.V, p.Out, p.New.K, p.New.V = Tensor{}, Tensor{}, Tensor{}, Tensor{}, Tensor{}, Tensor{}
			p.BlockTable, p.CacheBatchIdx, p.CacheLeftpad, p.AlibiSlopes, p.CacheSeqlens = 0, 0, 0, 0, 0
			p.Rotary.Cos, p.Rotary.Sin = 0, 0
			p.DeviceLengths = base().CacheSeqlens != 0
			return p
		}
	}
	tests := []problemCase{
		{"plain", bare(validProblem), func(p *Problem) {}, "", nil},
		{"paged", bare(pagedProblem), func(p *Problem) {}, "", nil},
		{"every feature", bare(allProblem), func(p *Problem) {}, "", nil},
		{"append at an int length", bare(appendProblem), func(p *Problem) { p.DeviceLengths, p.Seqlen = false, 4093 }, "", nil},
		{"headdim 100", bare(validProblem), func(p *Problem) { p.HeadDim = 100 }, "headdim", ErrUnsupported},
		{"page_size -5", bare(pagedProblem), func(p *Problem) { p.PageSize = -5 }, "page_size", ErrInvalid},
		{"seqlen_cache not max_pages*page_size", bare(pagedProblem), func(p *Problem) { p.MaxPages = 3 }, "seqlen_cache", ErrInvalid},
		{"window (-7, -9)", bare(validProblem), func(p *Problem) { p.Window = Window{Enabled: true, Left: -7, Right: -9} }, "window_size", ErrInvalid},
		{"softcap -3", bare(validProblem), func(p *Problem) { p.Softcap = -3 }, "softcap", ErrInvalid},
		{"rotary_dim 24", bare(appendProblem), func(p *Problem) { p.Rotary.Dim = 24 }, "rotary_dim", ErrUnsupported},
		{"append past the int length", bare(appendProblem), func(p *Problem) { p.DeviceLengths, p.Seqlen = false, 4094 }, "cache_seqlens", ErrInvalid},
		{"append with no lengths", bare(appendProblem), func(p *Problem) { p.DeviceLengths, p.Seqlen = false, -1 }, "cache_seqlens", ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.base()
			tt.edit(&p)
			checkOpErr(t, p.ValidateSizes(), "plan", tt.arg, tt.want)
		})
	}
}

func TestServingAndPlanShape(t *testing.T) {
	tests := []struct {
		name    string
		p       Problem
		serving bool
		shape   func(*Shape) // the PlanShape fields beyond p.Shape
	}{
		{"plain", validProblem(), false, func(*Shape) {}},
		{"causal alone is plain", func() Problem { p := validProblem(); p.Causal = true; return p }(), false, func(*Shape) {}},
		{"paged", pagedProblem(), true, func(s *Shape) { s.Serving, s.Paged = true, true }},
		{"append with rotary", appendProblem(), true, func(s *Shape) { s.Serving, s.SeqlenNew, s.RotaryQ, s.Contiguous = true, 3, true, true }},
		{"every feature", allProblem(), true, func(s *Shape) { s.Serving, s.SeqlenNew, s.RotaryQ, s.WindowKeys = true, 3, true, 257 }},
		{"softcap", func() Problem { p := validProblem(); p.Softcap = 5; return p }(), true, func(s *Shape) { s.Serving = true }},
		{"right window only", func() Problem {
			p := validProblem()
			p.Window = Window{Enabled: true, Left: -1, Right: 3}
			return p
		}(), true, func(s *Shape) { s.Serving = true }},
		{"serving asked for", func() Problem { p := validProblem(); p.Shape.Serving = true; return p }(), false, func(s *Shape) { s.Serving = true }},
	}
	for _, tt := range tests {
		want := tt.p.Shape
		tt.shape(&want)
		if got := tt.p.Serving(); got != tt.serving {
			t.Errorf("%s: Serving() = %v, want %v", tt.name, got, tt.serving)
		}
		if got := tt.p.PlanShape(); got != want {
			t.Errorf("%s: PlanShape() = %+v, want %+v", tt.name, got, want)
		}
	}
}

// TestServingPlans: a serving shape runs the serving form of the variant
// a plain one would, on the same block shape, split to fill both block
// slots of every SM (targetBlocks) where the plain plan fills one; an append
// adds the append kernel, a rotary embedding the rotated q in the workspace,
// and a window plans only the keys it lets in.
func TestServingPlans(t *testing.T) {
	base := Shape{DType: BFloat16, Batch: 3, SeqlenQ: 2, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 32768, Seqlen: -1}
	rows := 3 * 32 * 2
	// 24 items (3 sequences x 8 K/V heads) of 512 tiles: the plain plan
	// splits them 5 ways (120 blocks, one an SM), the serving plan 11 ways
	// (264 blocks, two an SM).
	const plainSplits, autoSplits = 5, 11
	for _, tt := range []struct {
		name        string
		edit        func(*Shape)
		splits      int    // 0: autoSplits, below
		appendGrid  [3]int // 128 chunks of k and v a token (one block), 512 of q with rotary (four more)
		qRot, total int    // 0: the plain plan's workspace, no q_rot
	}{
		{"serving alone", func(s *Shape) {}, 0, [3]int{}, 0, 0},
		{"append", func(s *Shape) { s.SeqlenNew = 5 }, 0, [3]int{5, 3, 1}, 0, 0},
		{"append 1 of 2 rows", func(s *Shape) { s.SeqlenNew = 1 }, 0, [3]int{2, 3, 1}, 0, 0},
		{"append and rotary, 1 split", func(s *Shape) { s.SeqlenNew, s.RotaryQ, s.NumSplits = 2, true, 1 }, 1, [3]int{2, 3, 5}, 0, rows * 128 * 2},
		{"append and rotary, combine", func(s *Shape) { s.SeqlenNew, s.RotaryQ, s.NumSplits = 2, true, 40 }, 40, [3]int{2, 3, 5},
			40*rows*128*4 + 40*rows*4, 40*rows*128*4 + 40*rows*4 + rows*128*2},
		{"rotary, head dim 72", func(s *Shape) { s.SeqlenNew, s.RotaryQ, s.NumSplits, s.HeadDim = 2, true, 1, 72 }, 1, [3]int{2, 3, 3}, 0, rows * 72 * 2},
		{"window of 100 keys: 2 tiles", func(s *Shape) { s.WindowKeys, s.NumSplits = 100, 9 }, 2, [3]int{}, 0, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := base
			s.Serving = true
			tt.edit(&s)
			p, err := MakePlan(s, H200)
			if err != nil {
				t.Fatal(err)
			}
			plainShape := s
			plainShape.Serving, plainShape.SeqlenNew, plainShape.RotaryQ, plainShape.WindowKeys = false, 0, false, 0
			plain, err := MakePlan(plainShape, H200)
			if err != nil {
				t.Fatal(err)
			}
			v := plain.Variant
			if p.Variant.Form != FormServing || p.Variant.Kernel != strings.Replace(v.Kernel, "fd_split_kv_", "fd_split_kv_serving_", 1) ||
				p.Variant.Append != "fd_append_kv_bf16" || p.Threads != v.Threads || p.Variant.KeysPerTile != v.KeysPerTile {
				t.Fatalf("serving variant %+v for plain %+v", p.Variant, v)
			}
			want := tt.splits
			if want == 0 {
				want = autoSplits
				if plain.NumSplits != plainSplits {
					t.Errorf("plain plan %v: want %d splits", plain, plainSplits)
				}
			}
			if p.NumSplits != want || p.Grid != [3]int{want, 8, 3} {
				t.Errorf("%v: want %d splits, grid (%d, 8, 3)", p, want, want)
			}
			if p.AppendGrid != tt.appendGrid || (p.Append != "") != (s.SeqlenNew > 0) ||
				(p.Append != "" && (p.Append != "fd_append_kv_bf16" || p.AppendThreads != 128)) {
				t.Errorf("%v: append %q grid %v x %d, want grid %v", p, p.Append, p.AppendGrid, p.AppendThreads, tt.appendGrid)
			}
			wantTotal, wantBytes := tt.total, 0
			if s.RotaryQ {
				wantBytes = rows * s.HeadDim * 2
			} else if tt.splits == 0 {
				wantTotal = autoSplits*rows*128*4 + autoSplits*rows*4
			}
			if p.QRotBytes != wantBytes || p.QRotOffset != tt.qRot || (wantTotal > 0 && p.WorkspaceBytes != wantTotal) ||
				p.QRotOffset%256 != 0 || p.QRotOffset+p.QRotBytes > p.WorkspaceBytes && p.QRotBytes > 0 {
				t.Errorf("%v: q_rot %d B at %d of %d; want %d B at %d of %d", p, p.QRotBytes, p.QRotOffset, p.WorkspaceBytes, wantBytes, tt.qRot, wantTotal)
			}
			if p.CombineGrid > 0 && p.QRotBytes > 0 && p.QRotOffset < p.LSEPartialOffset+p.NumSplits*rows*4 {
				t.Errorf("%v: q_rot at %d overlaps lse_partial", p, p.QRotOffset)
			}
		})
	}
}

// TestServingPlanErrors: serving fields a Shape holds without Serving, or
// out of range, are refused, as is a variant of the other form.
func TestServingPlanErrors(t *testing.T) {
	s := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1}
	serving := s
	serving.Serving = true
	for _, tt := range []struct {
		name string
		s    Shape
		edit func(*Shape)
		arg  string
	}{
		{"append without Serving", s, func(s *Shape) { s.SeqlenNew = 1 }, "k"},
		{"window without Serving", s, func(s *Shape) { s.WindowKeys = 10 }, "window_size"},
		{"seqlen_new negative", serving, func(s *Shape) { s.SeqlenNew = -1 }, "k"},
		{"seqlen_new past the cache", serving, func(s *Shape) { s.SeqlenNew = 4097 }, "k"},
		{"window keys negative", serving, func(s *Shape) { s.WindowKeys = -1 }, "window_size"},
		{"rotary without append", serving, func(s *Shape) { s.RotaryQ = true }, "rotary_cos"},
	} {
		sh := tt.s
		tt.edit(&sh)
		_, err := MakePlan(sh, H200)
		checkErr(t, err, tt.arg, ErrInvalid)
		_, err = PlanVariant(sh, testVariant, twoPerSM)
		checkErr(t, err, tt.arg, ErrInvalid)
	}
	// The plain variant for a serving shape, and the serving one for a plain shape.
	sv, err := SelectVariant(Float16, 128, 4, FormServing)
	if err != nil {
		t.Fatal(err)
	}
	_, err = PlanVariant(serving, testVariant, twoPerSM)
	checkErr(t, err, "variant", ErrInvalid)
	_, err = PlanVariant(s, sv, twoPerSM)
	checkErr(t, err, "variant", ErrInvalid)
	noAppend := sv
	noAppend.Append = ""
	appending := serving
	appending.SeqlenNew = 1
	_, err = PlanVariant(appending, noAppend, twoPerSM)
	checkErr(t, err, "variant", ErrInvalid)
}

// TestServingVariantTable: every plain variant has each other form (serving,
// paged and the two appending forms) with the same launch facts and an
// append kernel, named as kernels/flashdecode.cu instantiates them, and
// SelectVariant picks the same head dim and rows in every form.
func TestServingVariantTable(t *testing.T) {
	forms := []Form{FormServing, FormPaged, FormPagedAppend, FormAppend}
	byName, plain := map[string]Variant{}, []Variant{}
	for _, v := range Variants() {
		byName[v.Kernel] = v
		if v.Form == FormPlain {
			plain = append(plain, v)
		}
	}
	if len(plain) != 16 || len(byName) != len(plain)*(1+len(forms)) {
		t.Fatalf("%d variants, %d plain; want 16 plain (8 of an fp8 cache) and each in %d more forms", len(byName), len(plain), len(forms))
	}
	for _, p := range plain {
		if p.Append != "" {
			t.Errorf("%s: plain variant with append kernel %q", p.Kernel, p.Append)
		}
		for _, f := range forms {
			name := strings.Replace(p.Kernel, "fd_split_kv_", "fd_split_kv_"+f.String()+"_", 1)
			v, ok := byName[name]
			if !ok || v.Form != f {
				t.Fatalf("no %v form %s of %s", f, name, p.Kernel)
			}
			if a := v.Append; a != appendKernelCache(p.DType, p.FP8Cache).Name {
				t.Errorf("%s: append kernel %q", name, a)
			}
			if v.Kernel, v.Form, v.Append = p.Kernel, FormPlain, ""; v != p {
				t.Errorf("%s: launch facts %+v differ from %+v", name, v, p)
			}
		}
	}
	for _, dt := range []DType{Float16, BFloat16} {
		for _, rows := range []int{1, 16, 17, 40} {
			for _, d := range []int{40, 64, 128, 200, 256} {
				p, err := SelectVariant(dt, d, rows, FormPlain)
				if err != nil || p.Form != FormPlain {
					t.Fatalf("SelectVariant(%v, %d, %d, plain): %v (%v)", dt, d, rows, p.Kernel, err)
				}
				for _, f := range forms {
					v, err := SelectVariant(dt, d, rows, f)
					if err != nil || v.Form != f || v.HeadDim != p.HeadDim || v.Rows != p.Rows {
						t.Errorf("SelectVariant(%v, %d, %d, %v): %v (%v), plain %v", dt, d, rows, f, v.Kernel, err, p.Kernel)
					}
				}
			}
		}
	}
}

// TestForm: which form a shape runs, and the forms' names and properties.
func TestForm(t *testing.T) {
	base := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 1024, Seqlen: -1}
	tests := []struct {
		name string
		edit func(*Shape)
		want Form
	}{
		{"plain", func(s *Shape) {}, FormPlain},
		{"serving", func(s *Shape) { s.Serving = true }, FormServing},
		{"window", func(s *Shape) { s.Serving, s.WindowKeys = true, 64 }, FormServing},
		{"paged", func(s *Shape) { s.Serving, s.Paged = true, true }, FormPaged},
		{"paged, append", func(s *Shape) { s.Serving, s.Paged, s.SeqlenNew = true, true, 1 }, FormPagedAppend},
		{"paged, 16 new", func(s *Shape) { s.Serving, s.Paged, s.SeqlenNew = true, true, 16 }, FormPagedAppend},
		{"paged, 17 new", func(s *Shape) { s.Serving, s.Paged, s.SeqlenNew = true, true, 17 }, FormPaged},
		{"paged, append, rotary", func(s *Shape) { s.Serving, s.Paged, s.SeqlenNew, s.RotaryQ = true, true, 1, true }, FormPaged},
		{"contiguous, append", func(s *Shape) { s.Serving, s.Contiguous, s.SeqlenNew = true, true, 4 }, FormAppend},
		{"contiguous, append, rotary", func(s *Shape) { s.Serving, s.Contiguous, s.SeqlenNew, s.RotaryQ = true, true, 4, true }, FormServing},
		{"append, other features", func(s *Shape) { s.Serving, s.SeqlenNew = true, 1 }, FormServing},
	}
	for _, tt := range tests {
		s := base
		tt.edit(&s)
		if got := s.Form(); got != tt.want {
			t.Errorf("%s: Form() = %v, want %v", tt.name, got, tt.want)
		}
		p, err := MakePlan(s, H200)
		if err != nil || p.Variant.Form != tt.want || p.FusedAppend() != tt.want.FusedAppend() {
			t.Errorf("%s: planned %s (fused %v, %v), want the %v form", tt.name, p.Variant.Kernel, p.FusedAppend(), err, tt.want)
		}
	}
	props := []struct {
		f                          Form
		name                       string
		serving, paged, fusedAppnd bool
	}{
		{FormPlain, "plain", false, false, false},
		{FormServing, "serving", true, false, false},
		{FormPaged, "paged", true, true, false},
		{FormPagedAppend, "paged_append", true, true, true},
		{FormAppend, "append", true, false, true},
		{Form(9), "Form(9)", true, false, false},
	}
	for _, tt := range props {
		if tt.f.String() != tt.name || tt.f.Serving() != tt.serving || tt.f.Paged() != tt.paged || tt.f.FusedAppend() != tt.fusedAppnd {
			t.Errorf("%d: %q serving %v paged %v fused %v, want %q %v %v %v", int(tt.f), tt.f, tt.f.Serving(), tt.f.Paged(),
				tt.f.FusedAppend(), tt.name, tt.serving, tt.paged, tt.fusedAppnd)
		}
	}
}

// TestServingPlanJSONAndString: the serving fields show in the JSON and
// the summary only when set.
func TestServingPlanJSONAndString(t *testing.T) {
	s := Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 32768, Seqlen: -1,
		Serving: true, SeqlenNew: 1, RotaryQ: true}
	for _, tt := range []struct {
		splits int
		want   []string
	}{
		{0, []string{"fd_append_kv_f16 grid (1,1,5) x 128 threads, then fd_split_kv_serving_f16_d128_r16 grid (32,8,1)",
			"lse_partial at 524288, q_rot at 528384"}},
		{1, []string{"1 split, no combine; workspace 8192 B (q_rot)"}},
	} {
		s.NumSplits = tt.splits
		p, err := MakePlan(s, H200)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range tt.want {
			if !strings.Contains(p.String(), w) {
				t.Errorf("String() = %q lacks %q", p, w)
			}
		}
		m := planFields(t, p)
		v, _ := m["variant"].(map[string]any)
		if m["append"] != "fd_append_kv_f16" || m["q_rot_bytes"] != 8192.0 || m["append_threads"] != 128.0 ||
			v["serving"] != true || v["append"] != "fd_append_kv_f16" {
			t.Errorf("JSON %v lacks the serving fields", m)
		}
		if g, _ := m["append_grid"].([]any); len(g) != 3 || g[0] != 1.0 || g[1] != 1.0 || g[2] != 5.0 {
			t.Errorf("JSON %v: append_grid %v", m, m["append_grid"])
		}
	}
	// Without them the JSON keeps its keys (TestPlanJSONAndString counts them).
	s.Serving, s.SeqlenNew, s.RotaryQ = false, 0, false
	p, _ := MakePlan(s, H200)
	b, _ := json.Marshal(p)
	for _, k := range []string{"q_rot", "append", "serving"} {
		if strings.Contains(string(b), k) {
			t.Errorf("plain plan's JSON %s has %q", b, k)
		}
	}
}

// A serving variant plans like the plain one where its splits merge in
// clusters, and fills both slots of an SM otherwise: alone, a serving block
// streams slower than a plain one.
func TestServingPlansFillBothSlotsUnlessClustered(t *testing.T) {
	for _, tt := range []struct {
		name                   string
		batch, seqlen          int
		splits, cluster, plain int // plain: the plain plan's splits
	}{
		{"b=8, 4096 keys: clusters of 2, as plain", 8, 4096, 2, 2, 2},
		{"b=8, 32768 keys: 4 splits and the combine", 8, 32768, 4, 1, 2},
		{"b=1, 32768 keys", 1, 32768, 32, 1, 16},
		{"b=32, 8192 keys: unsplit", 32, 8192, 1, 1, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := Shape{DType: Float16, Batch: tt.batch, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128,
				SeqlenCache: tt.seqlen, Seqlen: -1}
			plain, err := MakePlan(s, H200)
			if err != nil {
				t.Fatal(err)
			}
			s.Serving = true
			p, err := MakePlan(s, H200)
			if err != nil {
				t.Fatal(err)
			}
			if p.NumSplits != tt.splits || p.Cluster != tt.cluster || plain.NumSplits != tt.plain {
				t.Errorf("serving %v, plain %v: want %d splits in clusters of %d, plain %d splits",
					p, plain, tt.splits, tt.cluster, tt.plain)
			}
		})
	}
}

// TestPagedForm: a paged cache of pages of a multiple of 8 keys runs the
// paged form (with an append and rotary too), and any other serving feature,
// or pages of other sizes, the serving form, on the same plan otherwise.
func TestPagedForm(t *testing.T) {
	withPages := func(n int) func(*Problem) { return func(p *Problem) { p.PageSize = n } }
	tests := []struct {
		name  string
		edit  func(*Problem)
		paged bool
	}{
		{"pages of 16", func(*Problem) {}, true},
		{"pages of 8", withPages(8), true},
		{"pages of 24", withPages(24), true},
		{"pages of 256", withPages(256), true},
		{"pages of 1", withPages(1), false},
		{"pages of 4", withPages(4), false},
		{"pages of 12", withPages(12), false},
		{"append with rotary", func(p *Problem) {
			a := appendProblem()
			p.New, p.Rotary, p.CacheSeqlens = a.New, a.Rotary, a.CacheSeqlens
		}, true},
		{"leftpad", func(p *Problem) { p.Leftpad, p.CacheLeftpad = true, 0x17000000 }, false},
		{"window", func(p *Problem) { p.Window = Window{Enabled: true, Left: 255, Right: 0} }, false},
		{"right window only", func(p *Problem) { p.Window = Window{Enabled: true, Left: -1, Right: 3} }, false},
		{"softcap", func(p *Problem) { p.Softcap = 30 }, false},
		{"alibi", func(p *Problem) { p.Alibi, p.AlibiSlopes = true, 0x18000000 }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := pagedProblem()
			tt.edit(&p)
			if got := p.PagedForm(); got != tt.paged {
				t.Fatalf("PagedForm() = %v, want %v", got, tt.paged)
			}
			s := p.PlanShape()
			pl, err := MakePlan(s, H200)
			if err != nil {
				t.Fatal(err)
			}
			if pl.Variant.Form.Paged() != tt.paged || !pl.Variant.Form.Serving() || strings.Contains(pl.Variant.Kernel, "_paged_") != tt.paged {
				t.Errorf("kernel %s (%v form), want the paged form %v", pl.Variant.Kernel, pl.Variant.Form, tt.paged)
			}
			s.Paged = !s.Paged // the other form: the same plan but for the kernel
			other, err := MakePlan(s, H200)
			if s.Paged && s.WindowKeys > 0 {
				if !errors.Is(err, ErrInvalid) {
					t.Errorf("the paged form with a window: %v, want ErrInvalid", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			other.Variant = pl.Variant
			if other != pl {
				t.Errorf("the two forms plan differently:\n%v\n%v", pl, other)
			}
		})
	}
	if _, err := MakePlan(Shape{DType: Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 8, HeadsKV: 8, HeadDim: 128, SeqlenCache: 64, Seqlen: -1, Paged: true}, H200); !errors.Is(err, ErrInvalid) {
		t.Errorf("Paged without Serving: %v, want ErrInvalid", err)
	}
}

// TestFusedAppend: the appending forms write the new tokens themselves (no
// append kernel), up to maxFusedAppend of them without rotary, into pages
// of a multiple of 8 keys or a contiguous cache with no other feature;
// otherwise the append kernel runs first.
func TestFusedAppend(t *testing.T) {
	contiguous := func(p *Problem) { p.PageSize, p.NumPages, p.MaxPages, p.BlockTable, p.BlockTableStride = 0, 0, 0, 0, 0 }
	tests := []struct {
		name   string
		edit   func(*Problem)
		kernel string // the append kernel; "" where stage 1 appends
		form   string // the stage-1 kernel's name up to its dtype
	}{
		{"paged, one token", func(p *Problem) { p.New.Seqlen, p.Rotary = 1, Rotary{} }, "", "fd_split_kv_paged_append_"},
		{"paged, 16 tokens", func(p *Problem) { p.New.Seqlen, p.Rotary = 16, Rotary{} }, "", "fd_split_kv_paged_append_"},
		{"paged, 17 tokens", func(p *Problem) { p.New.Seqlen, p.Rotary = 17, Rotary{} }, "fd_append_kv_f16", "fd_split_kv_paged_"},
		{"paged, rotary", func(*Problem) {}, "fd_append_kv_f16", "fd_split_kv_paged_"},
		{"pages of 1", func(p *Problem) { p.Rotary, p.PageSize, p.MaxPages = Rotary{}, 1, 4096 }, "fd_append_kv_f16", "fd_split_kv_serving_"},
		{"contiguous", func(p *Problem) { contiguous(p); p.Rotary = Rotary{} }, "", "fd_split_kv_append_"},
		{"contiguous, rotary", contiguous, "fd_append_kv_f16", "fd_split_kv_serving_"},
		{"contiguous, 17 tokens", func(p *Problem) { contiguous(p); p.New.Seqlen = 17 }, "fd_append_kv_f16", "fd_split_kv_serving_"},
		{"contiguous, cache_batch_idx", func(p *Problem) {
			contiguous(p)
			p.CacheBatch, p.CacheBatchIdx = 2, 0x16000000
		}, "fd_append_kv_f16", "fd_split_kv_serving_"},
		{"contiguous, softcap", func(p *Problem) { contiguous(p); p.Softcap = 30 }, "fd_append_kv_f16", "fd_split_kv_serving_"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := pagedProblem()
			a := appendProblem()
			p.New, p.Rotary, p.CacheSeqlens = a.New, a.Rotary, a.CacheSeqlens
			tt.edit(&p)
			pl, err := MakePlan(p.PlanShape(), H200)
			if err != nil {
				t.Fatal(err)
			}
			fused := tt.kernel == ""
			if pl.Append != tt.kernel || pl.FusedAppend() != fused || pl.Variant.Form.FusedAppend() != fused ||
				!strings.HasPrefix(pl.Variant.Kernel, tt.form+"f16_") || (pl.QRotBytes > 0) != (p.Rotary.Dim > 0 && !fused) {
				t.Errorf("%v: append %q, fused %v; want %q and %sf16_*", pl, pl.Append, pl.FusedAppend(), tt.kernel, tt.form)
			}
		})
	}
}

// CheckPointers runs on every call of a prepared layout: with an append
// into K and V interleaved in one buffer, its element-wise check of the
// two caches allocates nothing either.
func TestCheckPointersOfInterleavedCachesAllocatesNothing(t *testing.T) {
	p := allProblem() // K and V interleaved row by row, an append
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	if allocs := testing.AllocsPerRun(100, func() { p.CheckPointers() }); allocs != 0 {
		t.Errorf("CheckPointers allocates %v times a call", allocs)
	}
}
