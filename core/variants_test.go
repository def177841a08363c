package core

import "testing"

// TestKernelTable: every kernel a variant or a merge launches is a row of
// the kernel table of its kind and dtype, with the launch facts the variant
// gives it; balanced plans' kernels are compiled; no row is one nothing
// launches, and no name is there twice.
func TestKernelTable(t *testing.T) {
	ks := Kernels()
	rows := map[string]Kernel{}
	for _, k := range ks {
		if _, dup := rows[k.Name]; dup {
			t.Errorf("kernel %s twice", k.Name)
		}
		rows[k.Name] = k
	}
	launched := map[string]bool{}
	want := func(from, name string, kind KernelKind, dt DType, threads int, balanced bool) {
		t.Helper()
		launched[name] = true
		k, ok := rows[name]
		switch {
		case !ok:
			t.Errorf("%s launches %s, which the kernel table lacks", from, name)
		case k.Kind != kind || k.DType != dt || k.Threads != threads:
			t.Errorf("%s launches %s as kind %d, %v, %d threads; the table has kind %d, %v, %d threads",
				from, name, kind, dt, threads, k.Kind, k.DType, k.Threads)
		case balanced && !k.Balanced:
			t.Errorf("%s balances its splits, but %s runs no balanced plans", from, name)
		}
	}
	vs := Variants()
	if len(vs) == 0 {
		t.Fatal("no variants")
	}
	for i, v := range vs {
		if k := ks[i]; k.Kind != KernelSplitKV || k.Variant != v {
			t.Errorf("Kernels()[%d] is %s, not variant %s", i, k.Name, v.Kernel)
		}
		bal := v.Balances()
		want(v.Kernel, v.Kernel, KernelSplitKV, v.DType, v.Threads, bal)
		want(v.Kernel, v.Combine, KernelCombine, v.DType, v.CombineThreads, bal)
		want(v.Kernel, v.CombineNarrow, KernelCombineRows, v.DType, 32*v.CombineNarrowRows, bal)
		want(v.Kernel, v.CombineNarrowDense, KernelCombineRows, v.DType, 32*v.CombineNarrowDenseRows, bal)
		want(v.Kernel, v.CombineWide, KernelCombineCols, v.DType, v.CombineWideThreads, bal)
		if v.Form != FormPlain {
			want(v.Kernel, v.Append, KernelAppend, v.DType, appendThreads, false)
		} else if v.Append != "" {
			t.Errorf("%s: the plain form runs no append kernel, not %s", v.Kernel, v.Append)
		}
	}
	for _, dt := range []DType{Float16, BFloat16, Float32} {
		want("merge_states", MergeKernel(dt), KernelMergeStates, dt, 32*mergeMaxWarps, false)
	}
	for _, k := range ks {
		if !launched[k.Name] {
			t.Errorf("nothing launches %s", k.Name)
		}
	}
}
