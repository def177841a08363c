package cuda

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/flash-decode/flash-decode/core"
	"gorgonia.org/cu"
)

// fakeDevice reports whether the driver is the stand-in with a fake device
// (python/build_backend/make_libcuda.py --fake-device): one sm_90 device of
// 132 SMs whose kernels do nothing and whose launches are logged to the file
// FAKECUDA_LAUNCH_LOG names. CI runs only the tests of this file on it (go
// test -run, as .ci/run names them): the other tests compute and check
// results, which the fake device cannot (those built on gpu() skip there).
func fakeDevice() bool { return os.Getenv("FLASH_DECODE_FAKE_DEVICE") == "1" }

// at is a contiguous (batch, seq, heads, dim) tensor at a made-up device
// address: the fake device never reads memory.
func at(addr uintptr, seq, heads, dim int) core.Tensor {
	return core.Tensor{Ptr: addr, BatchStride: int64(seq * heads * dim), SeqStride: int64(heads * dim), HeadStride: int64(dim)}
}

// launchLog is the absolute path of the fake device's launch log; it skips
// t where the driver is not the fake device or no log is named.
func launchLog(t *testing.T) string {
	t.Helper()
	log := os.Getenv("FAKECUDA_LAUNCH_LOG")
	if !fakeDevice() || log == "" {
		t.Skip("needs the fake-device driver: FLASH_DECODE_FAKE_DEVICE=1 and FAKECUDA_LAUNCH_LOG")
	}
	log, _ = filepath.Abs(log)
	return log
}

// launched reads and clears the fake device's launch log: one "kernel gx gy
// gz threads shared cluster pdl" line per launch.
func launched(t *testing.T, log string) []string {
	t.Helper()
	data, err := os.ReadFile(log)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	os.Remove(log)
	return strings.Fields(strings.ReplaceAll(strings.TrimSpace(string(data)), " ", "_"))
}

func launchLine(kernel string, gx, gy, gz, threads, shared, cluster, pdl int) string {
	return fmt.Sprintf("%s_%d_%d_%d_%d_%d_%d_%d", kernel, gx, gy, gz, threads, shared, cluster, pdl)
}

// launchCase is a problem and the path its plan must take.
type launchCase struct {
	name string
	p    core.Problem
	want string // the path the plan must take
}

// launchCases are problems at made-up addresses whose plans take every
// path a decode launches: one split, clusters, the combines, whole items,
// balanced splits, the append kernel, the appends fused into stage 1 and
// batch-invariant splits.
func launchCases() []launchCase {
	const gib = uintptr(1) << 30
	plain := func(b, hq, hkv, n, splits int) core.Problem {
		s := core.Shape{DType: core.Float16, Batch: b, SeqlenQ: 1, HeadsQ: hq, HeadsKV: hkv, HeadDim: 128, SeqlenCache: n, Seqlen: -1, NumSplits: splits}
		return core.Problem{Shape: s, Q: at(1*gib, 1, hq, 128), K: at(64*gib, n, hkv, 128),
			V: at(128*gib, n, hkv, 128), Out: at(2*gib, 1, hq, 128), LSE: 3 * gib, CacheSeqlens: 4 * gib}
	}
	paged := func() core.Problem {
		p := plain(2, 32, 8, 4096, 0)
		p.K, p.V = at(64*gib, 16, 8, 128), at(128*gib, 16, 8, 128) // pages of 16 keys
		p.PageSize, p.NumPages, p.MaxPages = 16, 512, 256
		p.BlockTable, p.BlockTableStride = 5*gib, 256
		p.New = core.Append{K: at(6*gib, 2, 8, 128), V: at(7*gib, 2, 8, 128), Seqlen: 2}
		p.Rotary = core.Rotary{Cos: 8 * gib, Sin: 9 * gib, Stride: 64, Dim: 128, Rows: 8192}
		p.Causal = true
		return p
	}
	// ragged flattens p's query rows (and new tokens): totalQ rows of at
	// most sq a sequence.
	ragged := func(p core.Problem, sq, totalQ int) core.Problem {
		p.SeqlenQ, p.Ragged, p.TotalQ, p.CuSeqlensQ = sq, true, totalQ, 12*gib
		p.Q.BatchStride, p.Out.BatchStride = 0, 0
		if p.New.Seqlen > 0 {
			p.New.Seqlen, p.New.K.BatchStride, p.New.V.BatchStride = sq, 0, 0
		}
		return p
	}
	return []launchCase{
		{"split and combine", plain(1, 32, 8, 32768, 32), "combine"},
		{"splits merged in clusters", plain(1, 32, 8, 1024, 0), "cluster"},
		{"unsplit", plain(4, 32, 8, 4096, 1), "one"},
		{"whole items and a split tail", plain(40, 32, 8, 8192, 0), "whole"},
		{"wide combine", plain(1, 8, 1, 131072, 0), "wide"},
		{"narrow combine", plain(32, 8, 1, 16384, 0), "narrow"},
		{"narrow combine, 16 rows a block", func() core.Problem {
			p := plain(1, 48, 48, 8192, 2)
			p.SeqlenQ, p.Q, p.Out = 10, at(1*gib, 10, 48, 128), at(2*gib, 10, 48, 128)
			return p
		}(), "dense"},
		{"paged append with rotary", paged(), "append"},
		{"paged append fused into stage 1", func() core.Problem { p := paged(); p.Rotary = core.Rotary{}; return p }(), "fused"},
		{"splits balanced by the lengths on the device", func() core.Problem {
			p := plain(8, 32, 8, 32768, 0)
			p.DeviceLengths = true
			return p
		}(), "balanced"},
		{"contiguous append fused into stage 1", func() core.Problem {
			p := plain(2, 32, 8, 4096, 0)
			p.New, p.Causal = paged().New, true
			return p
		}(), "fused"},
		{"an int length", func() core.Problem {
			p := plain(4, 32, 8, 4096, 0)
			p.CacheSeqlens, p.Seqlen = 0, 1000
			return p
		}(), "any"},
		{"sinks, the cluster merge", func() core.Problem {
			p := plain(1, 32, 8, 1024, 0)
			p.HasSinks, p.Sinks = true, 11*gib
			return p
		}(), "cluster"},
		{"sinks, the combine", func() core.Problem {
			p := plain(1, 32, 8, 32768, 32)
			p.HasSinks, p.Sinks = true, 11*gib
			return p
		}(), "combine"},
		{"an int length and an append", func() core.Problem {
			p := plain(2, 32, 8, 4096, 0)
			p.CacheSeqlens, p.Seqlen, p.New = 0, 1000, paged().New
			return p
		}(), "fused"},
		{"batch-invariant splits", func() core.Problem {
			p := plain(8, 32, 8, 32768, 0)
			p.DeviceLengths, p.BatchInvariant = true, true
			return p
		}(), "invariant"},
		{"batch-invariant paged append with rotary", func() core.Problem {
			p := paged()
			p.BatchInvariant = true
			return p
		}(), "invariant"},
		{"ragged queries, the combine", ragged(plain(2, 32, 8, 32768, 32), 4, 5), "combine"},
		{"ragged queries, the cluster merge", ragged(plain(1, 32, 8, 1024, 0), 3, 3), "cluster"},
		{"ragged paged append with rotary", ragged(paged(), 2, 3), "append"},
		{"ragged paged append fused into stage 1", func() core.Problem {
			p := paged()
			p.Rotary = core.Rotary{}
			return ragged(p, 2, 3)
		}(), "fused"},
	}
}

// TestLaunchesFollowThePlan: each call (Decode, and a Prepared's first and later Runs) launches exactly what its plan says,
// in order (the append kernel, stage 1, the combine), with the plan's grid,
// block size, shared memory and cluster, all with programmatic dependent
// launch (sm_90); MergeStates launches its MergeLaunch. On the fake device,
// so the launch path runs where CI runs.
func TestLaunchesFollowThePlan(t *testing.T) {
	log := launchLog(t)
	const gib = uintptr(1) << 30
	for _, tc := range launchCases() {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.p
			pl, err := PlanFor(p.PlanShape(), 0)
			if err != nil {
				t.Fatal(err)
			}
			takes := map[string]bool{"combine": pl.Combine != "" && pl.Cluster == 1, "cluster": pl.Cluster > 1,
				"one": pl.NumSplits == 1 && pl.Combine == "", "whole": pl.WholeItems > 0,
				"wide": pl.Combine == pl.Variant.CombineWide, "narrow": pl.Combine == pl.Variant.CombineNarrow,
				"dense":     pl.Combine == pl.Variant.CombineNarrowDense,
				"append":    pl.Append != "",
				"fused":     pl.FusedAppend() && pl.Append == "",
				"balanced":  pl.BalanceSplits > 0 && pl.Grid[1] == 1 && pl.CombineGrid > 0,
				"invariant": pl.InvariantTiles > 0 && pl.Merge == core.MergeInvariant && pl.Combine == core.BalancedCombine(pl.Variant.Combine),
				"any":       true}
			if !takes[tc.want] {
				t.Fatalf("the plan %+v does not take the %s path", pl, tc.want)
			}
			var want []string
			if pl.Append != "" {
				want = append(want, launchLine(pl.Append, pl.AppendGrid[0], pl.AppendGrid[1], pl.AppendGrid[2], pl.AppendThreads, 0, 1, 1))
			}
			want = append(want, launchLine(pl.Variant.Kernel, pl.Grid[0], pl.Grid[1], pl.Grid[2], pl.Threads, pl.SharedBytes, pl.Cluster, 1))
			if pl.CombineGrid > 0 {
				want = append(want, launchLine(pl.Combine, pl.CombineGrid, 1, 1, pl.CombineThreads, 0, 1, 1))
			}
			r := prepareProblem(t, &p)
			args := Args{Q: p.Q.Ptr, K: p.K.Ptr, V: p.V.Ptr, Out: p.Out.Ptr, LSE: p.LSE, CacheSeqlens: p.CacheSeqlens,
				BlockTable: p.BlockTable, KNew: p.New.K.Ptr, VNew: p.New.V.Ptr, RotaryCos: p.Rotary.Cos,
				RotarySin: p.Rotary.Sin, Sinks: p.Sinks, CuSeqlensQ: p.CuSeqlensQ, Workspace: 10 * gib, WorkspaceBytes: pl.WorkspaceBytes}
			for _, call := range []string{"Decode", "Prepared.Run", "Prepared.Run again"} {
				launched(t, log)
				if call == "Decode" {
					_, err = Decode(&p, 10*gib, pl.WorkspaceBytes, 0, 0)
				} else {
					_, err = r.Run(&args, p.Seqlen, 0)
				}
				if err != nil {
					t.Fatalf("%s: %v", call, err)
				}
				if got := launched(t, log); strings.Join(got, " ") != strings.Join(want, " ") {
					t.Errorf("%s launched\n  %v\nwant\n  %v", call, got, want)
				}
			}
		})
	}
	t.Run("merge_states", func(t *testing.T) {
		m := core.MergeProblem{DType: core.Float16, NumStates: 3, Rows: [core.MergeRowDims]int{4, 32, 1}, HeadDim: 128,
			Outs: core.MergeInput{Ptrs: [core.MergePointers]uintptr{1 * gib}, NumPtrs: 1, StateStride: 4 * 32 * 128, Strides: [core.MergeRowDims]int64{32 * 128, 128, 128}},
			LSEs: core.MergeInput{Ptrs: [core.MergePointers]uintptr{2 * gib}, NumPtrs: 1, StateStride: 4 * 32, Strides: [core.MergeRowDims]int64{32, 1, 1}},
			Out:  core.MergeOutput{Ptr: 3 * gib, Strides: [core.MergeRowDims]int64{32 * 128, 128, 128}},
			LSE:  core.MergeOutput{Ptr: 4 * gib, Strides: [core.MergeRowDims]int64{32, 1, 1}}}
		l := m.Launch()
		launched(t, log)
		if err := MergeStates(&m, 0, 0); err != nil {
			t.Fatal(err)
		}
		want := launchLine(l.Kernel, l.Grid, 1, 1, l.Threads, l.SharedBytes, 1, 1)
		if got := launched(t, log); strings.Join(got, " ") != want {
			t.Errorf("launched %v, want %v", got, want)
		}
	})
}

// TestRunRestoresTheContextAndAllocatesNothing: on the fake device, a
// Prepared.Run leaves the caller's current context as it found it (none, or
// the device's primary context) and allocates nothing in Go on the way to
// the launches.
func TestRunRestoresTheContextAndAllocatesNothing(t *testing.T) {
	if !fakeDevice() {
		t.Skip("needs the fake-device driver: FLASH_DECODE_FAKE_DEVICE=1")
	}
	if log, ok := os.LookupEnv("FAKECUDA_LAUNCH_LOG"); ok { // no file writes: the allocation count is Go's alone
		os.Unsetenv("FAKECUDA_LAUNCH_LOG")
		defer os.Setenv("FAKECUDA_LAUNCH_LOG", log)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const gib = uintptr(1) << 30
	_, r, pl := preparedSplitCall(t, 4096)
	args := Args{Q: 1 * gib, K: 64 * gib, V: 128 * gib, Out: 2 * gib, LSE: 3 * gib, CacheSeqlens: 4 * gib,
		Workspace: 10 * gib, WorkspaceBytes: pl.WorkspaceBytes}
	d, err := getDevice("decode", 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		ctx  cu.CUContext
	}{{"no context current", cu.CUContext{}}, {"the primary context current", d.ctx}} {
		if err := cu.SetCurrentContext(tc.ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := r.Run(&args, -1, 0); err != nil {
			t.Fatal(err)
		}
		if got, err := cu.CurrentContext(); err != nil || got != tc.ctx {
			t.Errorf("%s: after Run the current context is %v (%v), want %v", tc.name, got, err, tc.ctx)
		}
		if allocs := testing.AllocsPerRun(100, func() { r.Run(&args, -1, 0) }); allocs != 0 {
			t.Errorf("%s: Run allocates %v times a call", tc.name, allocs)
		}
	}
	// The one-shot path of a layout (capi's fd_decode) allocates nothing either.
	p, _, _ := preparedSplitCall(t, 4096)
	l := core.LayoutOf(&p)
	if _, err := DecodeLayout(&l, 0, &args, -1, 0); err != nil {
		t.Fatal(err)
	}
	if allocs := testing.AllocsPerRun(100, func() { DecodeLayout(&l, 0, &args, -1, 0) }); allocs != 0 {
		t.Errorf("DecodeLayout allocates %v times a call", allocs)
	}
	// Sizing hints in turn (max_seqlen_k buckets of interleaved batches): each is
	// planned once, then kept.
	hints := []int{-1, 512, 1024, 4096}
	for _, h := range hints {
		if _, err := r.Run(&args, h, 0); err != nil {
			t.Fatal(err)
		}
	}
	allocs := testing.AllocsPerRun(25, func() {
		for _, h := range hints {
			r.Run(&args, h, 0)
		}
	})
	if allocs != 0 {
		t.Errorf("Runs at %d hints in turn allocate %v times a round", len(hints), allocs)
	}
	// An int length growing a token a step: one plan for each block of 32 lengths.
	args.CacheSeqlens = 0
	if _, err := r.Run(&args, 993, 0); err != nil {
		t.Fatal(err)
	}
	allocs = testing.AllocsPerRun(10, func() {
		for n := 993; n <= 1024; n++ {
			if _, err := r.Run(&args, n, 0); err != nil {
				t.Fatal(err)
			}
		}
	})
	if allocs != 0 {
		t.Errorf("Runs at the 32 int lengths of one block allocate %v times a round", allocs)
	}
}

// TestRunFromManyGoroutines: on the fake device, one Prepared run from
// many goroutines at once, as Python threads share a layout's handle, each
// at its own int lengths, so that the kept plans and the device's plan cache
// change under the calls: every Run returns the plan PlanFor gives its
// length. CI runs it under the race detector too.
func TestRunFromManyGoroutines(t *testing.T) {
	if !fakeDevice() {
		t.Skip("needs the fake-device driver: FLASH_DECODE_FAKE_DEVICE=1")
	}
	if log, ok := os.LookupEnv("FAKECUDA_LAUNCH_LOG"); ok { // launches from many threads: no log
		os.Unsetenv("FAKECUDA_LAUNCH_LOG")
		defer os.Setenv("FAKECUDA_LAUNCH_LOG", log)
	}
	const gib, goroutines, calls = uintptr(1) << 30, 8, 200
	p, _, _ := preparedSplitCall(t, 32768)
	p.NumSplits = 0 // the planner's own count, which follows the length
	r := prepareProblem(t, &p)
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			args := Args{Q: 1 * gib, K: 64 * gib, V: 128 * gib, Out: 2 * gib, Workspace: 10 * gib, WorkspaceBytes: 64 << 20}
			for i := range calls {
				n := 1 + (g*4099+i*577)%32768 // lengths spread over the cache, a different order each goroutine
				got, err := r.Run(&args, n, 0)
				if err != nil {
					errs <- fmt.Errorf("goroutine %d, length %d: %v", g, n, err)
					return
				}
				s := p.PlanShape()
				s.Seqlen = n
				want, err := PlanFor(s, 0)
				if err != nil || !reflect.DeepEqual(got, want) {
					errs <- fmt.Errorf("goroutine %d, length %d: Run planned %v, PlanFor %v (%v)", g, n, got, want, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestRunRefusesABadWorkspace: on the fake device, a workspace that is
// misaligned or overlaps a tensor of the call is refused before anything
// launches, by Decode and by Prepared.Run alike.
func TestRunRefusesABadWorkspace(t *testing.T) {
	log := launchLog(t)
	const gib = uintptr(1) << 30
	p, r, pl := preparedSplitCall(t, 32768)
	if pl.WorkspaceBytes == 0 {
		t.Fatalf("plan %v: want a split plan with a workspace", pl)
	}
	launched(t, log)
	for _, tc := range []struct {
		name string
		ws   uintptr
		want error
	}{
		{"misaligned", 10*gib + 4, core.ErrUnsupported},
		{"over out", 2*gib - 256, core.ErrInvalid},
		{"inside k_cache", 64*gib + 4096, core.ErrInvalid},
	} {
		args := Args{Q: 1 * gib, K: 64 * gib, V: 128 * gib, Out: 2 * gib, Workspace: tc.ws, WorkspaceBytes: pl.WorkspaceBytes}
		if _, err := r.Run(&args, -1, 0); !errors.Is(err, tc.want) || !strings.Contains(err.Error(), "workspace") {
			t.Errorf("%s: Run: %v; want %v naming the workspace", tc.name, err, tc.want)
		}
		if _, err := Decode(&p, tc.ws, pl.WorkspaceBytes, 0, 0); !errors.Is(err, tc.want) {
			t.Errorf("%s: Decode: %v; want %v", tc.name, err, tc.want)
		}
		if got := launched(t, log); len(got) != 0 {
			t.Errorf("%s: launched %v", tc.name, got)
		}
	}
	args := Args{Q: 1 * gib, K: 64 * gib, V: 128 * gib, Out: 2 * gib, Workspace: 10 * gib, WorkspaceBytes: pl.WorkspaceBytes}
	if _, err := r.Run(&args, -1, 0); err != nil {
		t.Fatalf("a workspace apart from the tensors: %v", err)
	}
	if got := launched(t, log); len(got) != 2 {
		t.Errorf("launched %v; want stage 1 and the combine", got)
	}
}

// preparedSplitCall is a b=1, 32/8-head, d128 call of n keys in 32 splits
// at made-up addresses (q at 1 GiB, out at 2, k_cache at 64, v_cache at
// 128), prepared on device 0, and its plan.
func preparedSplitCall(t *testing.T, n int) (core.Problem, *Prepared, core.Plan) {
	t.Helper()
	const gib = uintptr(1) << 30
	s := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: n, Seqlen: -1, NumSplits: 32}
	p := core.Problem{Shape: s, Q: at(1*gib, 1, 32, 128), K: at(64*gib, n, 8, 128), V: at(128*gib, n, 8, 128), Out: at(2*gib, 1, 32, 128)}
	r := prepareProblem(t, &p)
	pl, err := PlanFor(s, 0)
	if err != nil {
		t.Fatal(err)
	}
	return p, r, pl
}

// prepareProblem prepares p's layout (core.LayoutOf) on device 0.
func prepareProblem(t *testing.T, p *core.Problem) *Prepared {
	t.Helper()
	l := core.LayoutOf(p)
	r, err := Prepare(&l, 0)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestOpenRefusesAGPUOlderThanSm80: on the fake device posing as sm_70,
// opening it reports core.ErrUnsupported and names the architecture, instead
// of failing in the module loader with a driver error.
func TestOpenRefusesAGPUOlderThanSm80(t *testing.T) {
	if !fakeDevice() {
		t.Skip("needs the fake-device driver: FLASH_DECODE_FAKE_DEVICE=1")
	}
	t.Setenv("FAKECUDA_CC_MAJOR", "7")
	_, err := openDevice("decode", 0)
	if !errors.Is(err, core.ErrUnsupported) || !strings.Contains(err.Error(), "sm_70; the kernels need sm_80 or newer") {
		t.Fatalf("opening an sm_70 device: %v, want core.ErrUnsupported naming sm_70", err)
	}
}

// TestOpenKeepsTheKernelsThatFit: on the fake device posing as an sm_86
// (99 KB of shared memory a block, no clusters), the device opens and plans;
// given less shared memory than a kernel needs, it still opens, and a plan
// needing that kernel is refused as core.ErrUnsupported naming headdim.
func TestOpenKeepsTheKernelsThatFit(t *testing.T) {
	if !fakeDevice() {
		t.Skip("needs the fake-device driver: FLASH_DECODE_FAKE_DEVICE=1")
	}
	t.Setenv("FAKECUDA_CC_MAJOR", "8")
	s := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 4096, Seqlen: -1}
	t.Setenv("FAKECUDA_SHARED_OPTIN", "101376")
	d, err := openDevice("decode", 0)
	if err != nil {
		t.Fatalf("opening an sm_86 device: %v", err)
	}
	if _, err := d.plan(s); err != nil {
		t.Fatalf("planning on an sm_86 device: %v", err)
	}
	t.Setenv("FAKECUDA_SHARED_OPTIN", "65536")
	if d, err = openDevice("decode", 0); err != nil {
		t.Fatalf("opening a device of 64 KB a block: %v", err)
	}
	if _, err = d.plan(s); !errors.Is(err, core.ErrUnsupported) || !strings.Contains(err.Error(), "headdim") {
		t.Fatalf("planning a kernel past the device's shared memory: %v, want core.ErrUnsupported naming headdim", err)
	}
}

// TestOpenRunsWithoutClustersWhereTheyDoNotFit: on the fake device posing as
// an sm_120 (clusters, but 99 KB of shared memory a block, less than a
// cluster launch asks), the device opens and plans, and no plan merges in a
// cluster: a shape that merges in clusters of 8 on sm_90 uses the combine.
func TestOpenRunsWithoutClustersWhereTheyDoNotFit(t *testing.T) {
	if !fakeDevice() {
		t.Skip("needs the fake-device driver: FLASH_DECODE_FAKE_DEVICE=1")
	}
	t.Setenv("FAKECUDA_CC_MAJOR", "12")
	t.Setenv("FAKECUDA_SHARED_OPTIN", "101376")
	d, err := openDevice("decode", 0)
	if err != nil {
		t.Fatalf("opening an sm_120 device: %v", err)
	}
	if len(d.unusable) != 0 || d.maxCluster < 2 {
		t.Fatalf("sm_120: unusable %v, maxCluster %d; want every kernel and clusters allowed", d.unusable, d.maxCluster)
	}
	s := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 1024, Seqlen: -1}
	p, err := d.plan(s)
	if err != nil {
		t.Fatalf("planning on an sm_120 device: %v", err)
	}
	if p.plan.Merge == core.MergeCluster || p.plan.Cluster > 1 || p.plan.SharedBytes > 101376 {
		t.Errorf("sm_120 plan: merge %v, cluster %d, %d B shared; want no cluster within 99 KB",
			p.plan.Merge, p.plan.Cluster, p.plan.SharedBytes)
	}
}

// TestRunRefusesAGridPastCUDAsLimits: on the fake device, a call whose plan
// would pass CUDA's grid limits (a tail split of batch 32774 x 65524 heads)
// is refused by name before anything launches, its append kernel included.
func TestRunRefusesAGridPastCUDAsLimits(t *testing.T) {
	log := launchLog(t)
	const tib = uintptr(1) << 40
	const b, h, n = 32774, 65524, 1024
	s := core.Shape{DType: core.Float16, Batch: b, SeqlenQ: 1, HeadsQ: h, HeadsKV: h, HeadDim: 128, SeqlenCache: n, Seqlen: -1}
	p := core.Problem{Shape: s, Q: at(1*tib, 1, h, 128), Out: at(2*tib, 1, h, 128), K: at(1<<60, n, h, 128),
		V: at(2<<60, n, h, 128), CacheSeqlens: 3 * tib}
	p.New = core.Append{K: at(4*tib, 1, h, 128), V: at(5*tib, 1, h, 128), Seqlen: 1}
	p.Rotary = core.Rotary{Cos: 6 * tib, Sin: 7 * tib, Stride: 64, Dim: 128, Rows: 64}
	launched(t, log)
	_, err := Decode(&p, 8*tib, 1<<40, 0, 0) // room for any plan's workspace
	var e *core.Error
	if !errors.As(err, &e) || !errors.Is(err, core.ErrUnsupported) || e.Arg != "batch" {
		t.Errorf("Decode: %v; want ErrUnsupported naming batch", err)
	}
	if got := launched(t, log); len(got) != 0 {
		t.Errorf("launched %v", got)
	}
}
