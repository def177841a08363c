package core_test

import (
	"errors"
	"fmt"

	"github.com/flash-decode/flash-decode/core"
)

// Plan batch 1 with 32 query heads over 8 K/V heads, head dim 128, on an
// H200 (132 SMs; occupancy and cluster counts as measured there, without
// asking a GPU). A 32768-token cache gets 16 splits and the combine kernel;
// a 1024-token one 8 splits merged inside their thread-block clusters, with
// no combine kernel and no workspace.
func ExampleMakePlan() {
	s := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128,
		SeqlenCache: 32768, Seqlen: -1}
	for _, n := range []int{32768, 1024} {
		s.SeqlenCache = n
		p, err := core.MakePlan(s, core.H200)
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("%d tokens: %s, num_splits %d, grid %v, cluster %d, workspace %d B\n",
			n, p.Variant.Kernel, p.NumSplits, p.Grid, p.Cluster, p.WorkspaceBytes)
	}
	// Output:
	// 32768 tokens: fd_split_kv_f16_d128_r16, num_splits 16, grid [16 8 1], cluster 1, workspace 264192 B
	// 1024 tokens: fd_split_kv_f16_d128_r16, num_splits 8, grid [8 8 1], cluster 8, workspace 0 B
}

// With the lengths in a device array (cache_seqlens as a tensor), a plan of
// batch 8 at 32768 tokens balances its splits on the GPU: 2 a sequence for
// equal lengths, and a sequence of 32768 tokens among seven of 1024 takes
// 14 while the others take 1 each (at most 17: the 132 SMs' blocks over its
// 8 K/V heads). BalancedSplitCounts works the counts out as the kernels do.
func ExamplePlan_BalancedSplitCounts() {
	s := core.Shape{DType: core.Float16, Batch: 8, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128,
		SeqlenCache: 32768, Seqlen: -1, DeviceLengths: true}
	p, err := core.MakePlan(s, core.H200)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%d splits for equal lengths, at most %d a sequence, grid %v, combine %s\n",
		p.BalanceSplits, p.NumSplits, p.Grid, p.Combine)
	fmt.Println(p.BalancedSplitCounts(s, []int{32768, 32768, 32768, 32768, 32768, 32768, 32768, 32768}))
	fmt.Println(p.BalancedSplitCounts(s, []int{32768, 1024, 1024, 1024, 1024, 1024, 1024, 1024}))
	// Output:
	// 2 splits for equal lengths, at most 17 a sequence, grid [192 1 1], combine fd_combine_f16_r4_bal
	// [2 2 2 2 2 2 2 2]
	// [14 1 1 1 1 1 1 1]
}

// Plan a variant of one's choosing on a device of one's choosing: the worked
// example of the split heuristic on a GPU that holds 2 of its blocks per SM,
// with the H200's clusters (sm_90) and without (sm_80).
func ExamplePlanVariant() {
	v := core.Variant{Kernel: "fd_split_kv_f16_d128_r16", Combine: "fd_combine_f16", DType: core.Float16,
		HeadDim: 128, Rows: 16, Threads: 128, KeysPerTile: 64, SharedBytes: 98304,
		ClusterSharedBytes: 122880, CombineThreads: 128, CombineRows: 4,
		CombineWide: "fd_combine_f16_c32", CombineWideThreads: 128, CombineWideCols: 32}
	s := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128,
		SeqlenCache: 32768, Seqlen: -1}
	twoPerSM := func(core.Variant) int { return 2 }
	sm90 := core.Device{SMs: 132, Occupancy: twoPerSM, Clusters: core.DefaultClusters}
	sm80 := core.Device{SMs: 132, Occupancy: twoPerSM}
	for _, c := range []struct {
		dev         core.Device
		name        string
		keys, split int
	}{{sm90, "sm_90", 32768, 0}, {sm90, "sm_90", 32768, 1}, {sm90, "sm_90", 32768, 1000},
		{sm90, "sm_90", 1024, 0}, {sm80, "sm_80", 1024, 0}} {
		s.SeqlenCache, s.NumSplits = c.keys, c.split
		p, err := core.PlanVariant(s, v, c.dev)
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("%s, %d keys, num_splits=%d: %v\n", c.name, c.keys, c.split, p)
	}
	// Output:
	// sm_90, 32768 keys, num_splits=0: fd_split_kv_f16_d128_r16 grid (16,8,1) x 128 threads, 98304 B shared, 2/SM on 132 SMs; 16 splits; combine fd_combine_f16 8 x 128 threads; workspace 264192 B (lse_partial at 262144)
	// sm_90, 32768 keys, num_splits=1: fd_split_kv_f16_d128_r16 grid (1,8,1) x 128 threads, 98304 B shared, 2/SM on 132 SMs; 1 split, no combine, no workspace
	// sm_90, 32768 keys, num_splits=1000: fd_split_kv_f16_d128_r16 grid (128,8,1) x 128 threads, 98304 B shared, 2/SM on 132 SMs; 128 splits; combine fd_combine_f16_c32 128 x 128 threads; workspace 2113536 B (lse_partial at 2097152)
	// sm_90, 1024 keys, num_splits=0: fd_split_kv_f16_d128_r16 grid (8,8,1) x 128 threads, 122880 B shared, 2/SM on 132 SMs; 8 splits merged in clusters of 8, no combine, no workspace
	// sm_80, 1024 keys, num_splits=0: fd_split_kv_f16_d128_r16 grid (16,8,1) x 128 threads, 98304 B shared, 2/SM on 132 SMs; 16 splits; combine fd_combine_f16 8 x 128 threads; workspace 264192 B (lse_partial at 262144)
}

// Errors name the argument and wrap a sentinel that tells its kind.
func ExampleShape_Validate() {
	s := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 12, HeadsKV: 5, HeadDim: 128, SeqlenCache: 64, Seqlen: -1}
	err := s.Validate()
	fmt.Println(err)
	fmt.Println(errors.Is(err, core.ErrInvalid))

	s.HeadsKV, s.HeadDim = 4, 100
	err = s.Validate()
	fmt.Println(err)
	fmt.Println(errors.Is(err, core.ErrUnsupported))
	// Output:
	// flashdecode: plan: nheads_q: invalid argument: 12 is not a multiple of nheads_kv=5
	// true
	// flashdecode: plan: headdim: not supported: 100; supported: multiples of 8 from 8 to 256
	// true
}

// The CPU reference splits 5 keys into 3 splits of tiles of 2 keys and
// merges them; one query sees every key.
func ExampleReferenceDecode() {
	h := &core.HostProblem{
		Shape: core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 1, HeadsKV: 1, HeadDim: 8,
			SeqlenCache: 5, Seqlen: -1},
		Q:     []float32{1, 0, 0, 0, 0, 0, 0, 0},
		K:     make([]float32, 5*8), // all scores 0: uniform weights
		V:     make([]float32, 5*8),
		Scale: 1,
	}
	for j := range 5 {
		h.V[j*8] = float32(j) // values 0..4 in the first element
	}
	out, lse, err := core.ReferenceDecode(h, 3, 2)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("out[0] = %.3f (mean of 0..4), lse = %.4f (log 5)\n", out[0], lse[0])
	// Output:
	// out[0] = 2.000 (mean of 0..4), lse = 1.6094 (log 5)
}

// A framework's binding describes a call by its tensors, as it holds them:
// q (2, 1, 32, 128) and the caches (2, 4096, 8, 128) on CUDA device 0, and
// an int64 cache_seqlens, which the core refuses by name before anything is
// planned. With an int32 one the call's Layout follows.
func ExampleTensors_Layout() {
	desc := func(dtype core.DType, shape ...int64) core.TensorDesc {
		d := core.TensorDesc{Given: 1, DType: int64(dtype), Rank: int64(len(shape))}
		stride := int64(1)
		for i := len(shape) - 1; i >= 0; i-- {
			d.Shape[i], d.Strides[i] = shape[i], stride
			stride *= shape[i]
		}
		return d
	}
	t := core.Tensors{Q: desc(core.Float16, 2, 1, 32, 128), KCache: desc(core.Float16, 2, 4096, 8, 128),
		VCache: desc(core.Float16, 2, 4096, 8, 128), CacheSeqlens: desc(core.Int64, 2), WindowLeft: -1, WindowRight: -1}
	_, err := t.Layout()
	fmt.Println(err, errors.Is(err, core.ErrType))
	t.CacheSeqlens.DType = int64(core.Int32)
	l, err := t.Layout()
	fmt.Println(l.Batch, l.HeadsQ, l.SeqlenCache, l.DeviceLengths, l.KCache, err)
	// Output:
	// flashdecode: prepare: cache_seqlens: wrong type: must be a torch.int32 tensor, got torch.int64 true
	// 2 32 4096 1 [4194304 1024 128 1] <nil>
}
