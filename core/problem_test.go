package core

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// validShape is b=2, 32 query heads over 8 K/V heads, headdim 128.
func validShape() Shape {
	return Shape{DType: Float16, Batch: 2, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128,
		SeqlenCache: 4096, Seqlen: -1}
}

func TestShapeValidate(t *testing.T) {
	tests := []struct {
		name string
		edit func(*Shape)
		arg  string // "" means valid
		want error
	}{
		{"valid", func(s *Shape) {}, "", nil},
		{"bf16", func(s *Shape) { s.DType = BFloat16 }, "", nil},
		{"mqa", func(s *Shape) { s.HeadsKV = 1 }, "", nil},
		{"gqa 5", func(s *Shape) { s.HeadsQ, s.HeadsKV = 40, 8 }, "", nil},
		{"seqlen_q 16", func(s *Shape) { s.SeqlenQ = 16 }, "", nil},
		{"headdim 8", func(s *Shape) { s.HeadDim = 8 }, "", nil},
		{"headdim 256", func(s *Shape) { s.HeadDim = 256 }, "", nil},
		{"headdim 96", func(s *Shape) { s.HeadDim = 96 }, "", nil},
		{"empty cache", func(s *Shape) { s.SeqlenCache = 0 }, "", nil},
		{"seqlen 0", func(s *Shape) { s.Seqlen = 0 }, "", nil},
		{"seqlen = cache", func(s *Shape) { s.Seqlen = 4096 }, "", nil},
		{"splits 7", func(s *Shape) { s.NumSplits = 7 }, "", nil},
		{"dtype 0", func(s *Shape) { s.DType = 0 }, "dtype", ErrUnsupported},
		{"dtype 3", func(s *Shape) { s.DType = 3 }, "dtype", ErrUnsupported},
		{"batch 0", func(s *Shape) { s.Batch = 0 }, "batch", ErrInvalid},
		{"batch huge", func(s *Shape) { s.Batch = 70000 }, "batch", ErrUnsupported},
		{"seqlen_q 0", func(s *Shape) { s.SeqlenQ = 0 }, "seqlen_q", ErrInvalid},
		{"seqlen_q 17", func(s *Shape) { s.SeqlenQ = 17 }, "seqlen_q", ErrUnsupported},
		{"heads_q 0", func(s *Shape) { s.HeadsQ = 0 }, "nheads_q", ErrInvalid},
		{"heads_kv 0", func(s *Shape) { s.HeadsKV = 0 }, "nheads_kv", ErrInvalid},
		{"heads_kv -1", func(s *Shape) { s.HeadsKV = -1 }, "nheads_kv", ErrInvalid},
		{"not multiple", func(s *Shape) { s.HeadsQ, s.HeadsKV = 12, 5 }, "nheads_q", ErrInvalid},
		{"more kv heads", func(s *Shape) { s.HeadsQ, s.HeadsKV = 4, 8 }, "nheads_q", ErrInvalid},
		{"headdim 0", func(s *Shape) { s.HeadDim = 0 }, "headdim", ErrInvalid},
		{"headdim 100", func(s *Shape) { s.HeadDim = 100 }, "headdim", ErrUnsupported},
		{"headdim 264", func(s *Shape) { s.HeadDim = 264 }, "headdim", ErrUnsupported},
		{"cache -1", func(s *Shape) { s.SeqlenCache = -1 }, "seqlen_cache", ErrInvalid},
		{"cache at the limit", func(s *Shape) { s.SeqlenCache = MaxSeqlenCache }, "", nil},
		{"cache past the limit", func(s *Shape) { s.SeqlenCache = MaxSeqlenCache + 1 }, "seqlen_cache", ErrUnsupported},
		{"cache past int32", func(s *Shape) { s.SeqlenCache = math.MaxInt32 }, "seqlen_cache", ErrUnsupported},
		{"rows at the limit", func(s *Shape) { s.Batch, s.SeqlenQ, s.HeadsQ, s.HeadsKV = 1, 1, math.MaxInt32, 1 }, "", nil},
		{"rows below the limit", func(s *Shape) { s.Batch, s.SeqlenQ, s.HeadsQ = 65535, 16, 2048 }, "", nil},
		{"rows past the limit", func(s *Shape) { s.Batch, s.SeqlenQ, s.HeadsQ = 65535, 16, 2056 }, "nheads_q", ErrUnsupported},
		{"rows past the limit, batch 2", func(s *Shape) { s.SeqlenQ, s.HeadsQ, s.HeadsKV = 1, 1<<30, 1 }, "nheads_q", ErrUnsupported},
		{"heads past int32", func(s *Shape) { s.Batch, s.SeqlenQ, s.HeadsQ, s.HeadsKV = 1, 1, math.MaxInt32+1, 1 }, "nheads_q", ErrUnsupported},
		{"seqlen > cache", func(s *Shape) { s.Seqlen = 4097 }, "cache_seqlens", ErrInvalid},
		{"splits -1", func(s *Shape) { s.NumSplits = -1 }, "num_splits", ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := validShape()
			tt.edit(&s)
			checkErr(t, s.Validate(), tt.arg, tt.want)
		})
	}
}

// The messages name the limit a value breaks.
func TestShapeValidateMessages(t *testing.T) {
	for _, tt := range []struct {
		edit func(*Shape)
		want string
	}{
		{func(s *Shape) { s.SeqlenQ = 17 }, "seqlen_q: not supported: 17; supported: 1 to 16"},
		{func(s *Shape) { s.HeadDim = 100 }, "headdim: not supported: 100; supported: multiples of 8 from 8 to 256"},
		{func(s *Shape) { s.HeadsQ, s.HeadsKV = 12, 5 }, "nheads_q: invalid argument: 12 is not a multiple of nheads_kv=5"},
		{func(s *Shape) { s.SeqlenCache = MaxSeqlenCache + 1 }, "seqlen_cache: not supported: 1073741825; at most 1073741824"},
		{func(s *Shape) { s.Batch, s.SeqlenQ, s.HeadsQ = 65535, 16, 2056 }, "makes 2155839360 output rows; at most 2147483647"},
		{func(s *Shape) { s.Seqlen = 4097 }, "cache_seqlens: invalid argument: 4097 exceeds seqlen_cache=4096"},
		{func(s *Shape) { s.NumSplits = -1 }, "num_splits: invalid argument: -1; must be 0 (automatic) or positive"},
	} {
		s := validShape()
		tt.edit(&s)
		if err := s.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("error %v, want it to contain %q", err, tt.want)
		}
	}
}

// checkErr fails unless err is nil (want == nil) or an *Error naming arg
// that wraps want.
func checkErr(t *testing.T, err error, arg string, want error) {
	t.Helper()
	if want == nil {
		if err != nil {
			t.Fatalf("unexpected error: %v", err)
		}
		return
	}
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v (%T) is not an *Error", err, err)
	}
	if e.Arg != arg || !errors.Is(err, want) {
		t.Fatalf("error %q: want arg %q wrapping %q", err, arg, want)
	}
	if !strings.HasPrefix(err.Error(), "flashdecode: ") {
		t.Fatalf("error %q lacks the flashdecode prefix", err)
	}
}

// validProblem is validShape with dense tensors at aligned addresses.
func validProblem() Problem {
	s := validShape()
	dense := func(ptr uintptr, seq, heads int) Tensor {
		d := int64(s.HeadDim)
		return Tensor{Ptr: ptr, BatchStride: int64(seq*heads) * d, SeqStride: int64(heads) * d, HeadStride: d}
	}
	// q and out span 16 KiB each, k_cache and v_cache 16 MiB.
	return Problem{
		Shape: s,
		Q:     dense(0x10000, s.SeqlenQ, s.HeadsQ),
		Out:   dense(0x20000, s.SeqlenQ, s.HeadsQ),
		K:     dense(0x1000000, s.SeqlenCache, s.HeadsKV),
		V:     dense(0x3000000, s.SeqlenCache, s.HeadsKV),
	}
}

func TestProblemValidate(t *testing.T) {
	tests := []struct {
		name string
		edit func(*Problem)
		arg  string
		want error
	}{
		{"valid", func(p *Problem) {}, "", nil},
		{"lse and lens", func(p *Problem) { p.LSE, p.CacheSeqlens = 0x50004, 0x60008 }, "", nil},
		{"scale", func(p *Problem) { p.Scale = 0.125 }, "", nil},
		{"scale past float32 in base 2", func(p *Problem) { p.Scale = 3e38 }, "softmax_scale", ErrInvalid},
		{"the largest scale", func(p *Problem) { p.Scale = 2e38 }, "", nil},
		{"kv slice of bigger buffer", func(p *Problem) { p.K.BatchStride *= 3; p.K.SeqStride *= 2 }, "", nil},
		{"shared cache over batch", func(p *Problem) { p.K.BatchStride = 0; p.V.BatchStride = 0 }, "", nil},
		{"out permuted (b,h,s,d)", func(p *Problem) {
			p.SeqlenQ = 4
			p.Out = Tensor{Ptr: 0x40000, BatchStride: 32 * 4 * 128, HeadStride: 4 * 128, SeqStride: 128} // q now spans 64 KiB
		}, "", nil},
		{"out size-1 dim stride 0", func(p *Problem) { p.Out.SeqStride = 0 }, "", nil},
		{"bad shape first", func(p *Problem) { p.HeadsKV = 5; p.Q.Ptr = 0 }, "nheads_q", ErrInvalid},
		{"q null", func(p *Problem) { p.Q.Ptr = 0 }, "q", ErrInvalid},
		{"k null", func(p *Problem) { p.K.Ptr = 0 }, "k_cache", ErrInvalid},
		{"v null", func(p *Problem) { p.V.Ptr = 0 }, "v_cache", ErrInvalid},
		{"out null", func(p *Problem) { p.Out.Ptr = 0 }, "out", ErrInvalid},
		{"q misaligned", func(p *Problem) { p.Q.Ptr += 2 }, "q", ErrUnsupported},
		{"k negative stride", func(p *Problem) { p.K.SeqStride = -1024 }, "k_cache", ErrInvalid},
		{"v odd stride", func(p *Problem) { p.V.HeadStride = 129 }, "v_cache", ErrUnsupported},
		{"k stride overflow", func(p *Problem) { p.K.SeqStride = math.MaxInt64 / 8 * 8 }, "k_cache", ErrInvalid},
		{"out batch stride 0", func(p *Problem) { p.Out.BatchStride = 0 }, "out", ErrInvalid},
		{"out heads overlap", func(p *Problem) { p.Out.HeadStride = 64 }, "out", ErrInvalid},
		{"lse misaligned", func(p *Problem) { p.LSE = 0x50002 }, "lse", ErrInvalid},
		{"lens misaligned", func(p *Problem) { p.CacheSeqlens = 0x60001 }, "cache_seqlens", ErrInvalid},
		{"scale negative", func(p *Problem) { p.Scale = -1 }, "softmax_scale", ErrInvalid},
		{"scale nan", func(p *Problem) { p.Scale = float32(math.NaN()) }, "softmax_scale", ErrInvalid},
		{"scale inf", func(p *Problem) { p.Scale = float32(math.Inf(1)) }, "softmax_scale", ErrInvalid},
		{"empty cache, null k and v", func(p *Problem) { p.SeqlenCache, p.K.Ptr, p.V.Ptr = 0, 0, 0 }, "", nil},
		{"empty cache, torch's strides", func(p *Problem) { // (batch, 0, heads, d) contiguous: batch stride 0
			p.Batch, p.SeqlenCache = 1, 0
			p.K = Tensor{BatchStride: 0, SeqStride: 8 * 128, HeadStride: 128}
			p.V = p.K
		}, "", nil},
		{"empty cache, k misaligned", func(p *Problem) { p.SeqlenCache, p.K.Ptr = 0, 0x1000008 }, "k_cache", ErrUnsupported},

		// What the kernels write (out, lse) against everything else. Byte
		// ranges: q [0x10000, 0x14000), out [0x20000, 0x24000), k_cache
		// [0x1000000, 0x2000000), v_cache [0x3000000, 0x4000000).
		{"out is q", func(p *Problem) { p.Out = p.Q }, "out", ErrInvalid},
		{"out is q, batches padded", func(p *Problem) { p.Out.Ptr = p.Q.Ptr; p.Out.BatchStride *= 2 }, "out", ErrInvalid},
		{"out ends inside q", func(p *Problem) { p.Out.Ptr = 0x10000 - 0x4000 + 16 }, "out", ErrInvalid},
		{"out starts inside q", func(p *Problem) { p.Out.Ptr = 0x14000 - 16 }, "out", ErrInvalid},
		{"out right before q", func(p *Problem) { p.Out.Ptr = 0x10000 - 0x4000 }, "", nil},
		{"out right after q", func(p *Problem) { p.Out.Ptr = 0x14000 }, "", nil},
		{"out inside k_cache", func(p *Problem) { p.Out.Ptr = 0x1800000 }, "out", ErrInvalid},
		{"out over v_cache's end", func(p *Problem) { p.Out.Ptr = 0x4000000 - 0x2000 }, "out", ErrInvalid},
		{"out right after v_cache", func(p *Problem) { p.Out.Ptr = 0x4000000 }, "", nil},
		{"out over cache_seqlens", func(p *Problem) { p.CacheSeqlens = 0x20100 }, "out", ErrInvalid},
		{"out next to cache_seqlens", func(p *Problem) { p.CacheSeqlens = 0x20000 - 8 }, "", nil},
		{"out over an empty cache", func(p *Problem) { p.SeqlenCache, p.K.Ptr = 0, p.Out.Ptr }, "", nil},
		{"lse inside out", func(p *Problem) { p.LSE = 0x20000 + 0x1000 }, "lse", ErrInvalid},
		{"lse over q's end", func(p *Problem) { p.LSE = 0x14000 - 4 }, "lse", ErrInvalid},
		{"lse inside v_cache", func(p *Problem) { p.LSE = 0x3000000 }, "lse", ErrInvalid},
		{"lse is cache_seqlens", func(p *Problem) { p.LSE, p.CacheSeqlens = 0x50000, 0x50000 }, "lse", ErrInvalid},
		{"lse right before out", func(p *Problem) { p.LSE = 0x20000 - 2*32*4 }, "", nil},
		{"lse right after out", func(p *Problem) { p.LSE = 0x24000 }, "", nil},
		{"lse one row before out's end", func(p *Problem) { p.LSE = 0x24000 - 4 }, "lse", ErrInvalid},
		{"k and v share a buffer", func(p *Problem) { p.V.Ptr = p.K.Ptr + 256 }, "", nil},
		{"out at the top of memory", func(p *Problem) { p.Out.Ptr = ^uintptr(0) &^ 15 }, "", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := validProblem()
			tt.edit(&p)
			err := p.Validate()
			checkErr(t, err, tt.arg, tt.want)
			if err != nil && !strings.HasPrefix(err.Error(), "flashdecode: decode: ") {
				t.Errorf("error %q does not name the decode operation", err)
			}
		})
	}
	var nilp *Problem
	checkErr(t, nilp.Validate(), "", ErrInvalid)
}

func TestExplicitScale(t *testing.T) {
	for _, tt := range []struct {
		in   float64
		want float32 // 0: refused
	}{
		{0.125, 0.125},
		{1, 1},
		{0x1p-126, 0x1p-126}, // the smallest normal float32
		{math.MaxFloat32, math.MaxFloat32},
		{1e-50, 0}, // rounds to 0, the default
		{1e-40, 0}, // a float32 subnormal
		{0, 0},
		{-0.5, 0},
		{1e39, 0}, // rounds to +Inf
		{math.Inf(1), 0},
		{math.NaN(), 0},
	} {
		got, err := ExplicitScale(tt.in)
		if tt.want == 0 {
			checkErr(t, err, "softmax_scale", ErrInvalid)
			if !strings.Contains(err.Error(), "positive normal float32") {
				t.Errorf("%v: error %q does not name the limit", tt.in, err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("ExplicitScale(%v) = %v, %v; want %v", tt.in, got, err, tt.want)
		}
	}
}

func TestOverlaps(t *testing.T) {
	tests := []struct {
		size   [4]int
		stride [4]int64
		want   bool
	}{
		{[4]int{2, 3, 4, 8}, [4]int64{96, 32, 8, 1}, false},   // dense
		{[4]int{2, 3, 4, 8}, [4]int64{8, 16, 48, 1}, false},   // permuted dense
		{[4]int{2, 3, 4, 8}, [4]int64{200, 64, 16, 1}, false}, // padded
		{[4]int{2, 3, 4, 8}, [4]int64{96, 32, 4, 1}, true},    // heads overlap
		{[4]int{2, 3, 4, 8}, [4]int64{0, 32, 8, 1}, true},     // batch broadcast
		{[4]int{1, 1, 4, 8}, [4]int64{0, 0, 8, 1}, false},     // size-1 dims ignored
		{[4]int{1, 1, 1, 8}, [4]int64{0, 0, 0, 1}, false},
		{[4]int{2, 2, 1, 8}, [4]int64{16, 8, 0, 1}, false}, // exactly adjacent
		{[4]int{2, 2, 1, 8}, [4]int64{8, 8, 0, 1}, true},
	}
	for _, tt := range tests {
		if got := overlaps(tt.size[:], tt.stride[:]); got != tt.want {
			t.Errorf("overlaps(%v, %v) = %v, want %v", tt.size, tt.stride, got, tt.want)
		}
	}
}

func TestDType(t *testing.T) {
	for _, tt := range []struct {
		d     DType
		name  string
		valid bool
	}{{Float16, "float16", true}, {BFloat16, "bfloat16", true}, {Float32, "float32", false}, {0, "invalid dtype", false},
		{Float8E4M3, "float8_e4m3fn", false}, {Float8E5M2, "float8_e5m2", false}, {9, "invalid dtype", false}} {
		if tt.d.String() != tt.name || tt.d.Valid() != tt.valid {
			t.Errorf("DType(%d): %q %v, want %q %v", int(tt.d), tt.d.String(), tt.d.Valid(), tt.name, tt.valid)
		}
	}
	if Float16.Size() != 2 || BFloat16.Size() != 2 || Float32.Size() != 4 || Float8E4M3.Size() != 1 || Float8E5M2.Size() != 1 {
		t.Errorf("sizes %d, %d, %d, %d, %d; want 2, 2, 4, 1, 1", Float16.Size(), BFloat16.Size(), Float32.Size(), Float8E4M3.Size(), Float8E5M2.Size())
	}
}

func TestCheckWorkspace(t *testing.T) {
	p := appendProblem() // q, out, caches, new tokens, lengths and rotary tables: every range
	p.LSE = 0x50000
	for _, tt := range []struct {
		name  string
		ptr   uintptr
		bytes int
		want  error
	}{
		{"apart", 0x40000000, 1 << 20, nil},
		{"no workspace", 0, 0, nil},
		{"misaligned", 0x40000008, 1 << 20, ErrUnsupported},
		{"inside k_cache", p.K.Ptr + 4096, 1 << 20, ErrInvalid},
		{"running into v_cache", p.V.Ptr - 256, 1 << 20, ErrInvalid},
		{"over lse", 0x4ff00, 1024, ErrInvalid},
		{"over the rotary table", p.Rotary.Cos, 16, ErrInvalid},
		{"just before q", p.Q.Ptr - 4096, 4096, nil},
	} {
		err := p.CheckWorkspace(tt.ptr, tt.bytes)
		if !errors.Is(err, tt.want) || (tt.want != nil && !strings.Contains(err.Error(), "workspace")) {
			t.Errorf("%s: %v; want %v naming workspace", tt.name, err, tt.want)
		}
	}
}

// TestSpansOrder: checkOverlaps tells the tensors apart by their index in spans.
func TestSpansOrder(t *testing.T) {
	p := allProblem()
	sp := p.spans()
	for i, name := range map[int]string{0: "q", 1: "k_cache", 2: "v_cache", 16: "out", 17: "lse"} {
		if sp[i].name != name {
			t.Errorf("spans()[%d] is %q, want %q", i, sp[i].name, name)
		}
	}
}

// BenchmarkCheckPointers measures the per-call address checks that every
// Run makes, for a plain problem and one with every serving feature.
func BenchmarkCheckPointers(b *testing.B) {
	for _, bc := range []struct {
		name string
		p    Problem
	}{{"plain", validProblem()}, {"all serving features", allProblem()}} {
		b.Run(bc.name, func(b *testing.B) {
			p := bc.p
			if err := p.CheckPointers(); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if err := p.CheckPointers(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
