package core

import (
	"strings"
	"testing"
)

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
			if rows[v.Append].FP8Cache != v.FP8Cache {
				t.Errorf("%s (fp8 cache %t) appends with %s", v.Kernel, v.FP8Cache, v.Append)
			}
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

// TestFP8CacheVariants: every variant has an fp8-cache twin, named with
// _fp8 after the dtype, with the same launch facts, and SelectCacheVariant
// picks it for either fp8 format as SelectVariant picks the other; a cache
// of another dtype than q's that is not fp8 has no kernel.
func TestFP8CacheVariants(t *testing.T) {
	byName := map[string]Variant{}
	for _, v := range Variants() {
		byName[v.Kernel] = v
	}
	n := 0
	for _, v := range Variants() {
		if v.FP8Cache {
			n++
			continue
		}
		d := dtypeNames[v.DType]
		name := strings.Replace(v.Kernel, "_"+d+"_", "_"+d+fp8Suffix+"_", 1)
		w, ok := byName[name]
		if !ok || !w.FP8Cache {
			t.Fatalf("%s: no fp8-cache twin %s", v.Kernel, name)
		}
		wantAppend := ""
		if v.Form != FormPlain {
			wantAppend = v.Append + fp8Suffix
		}
		if w.Append != wantAppend {
			t.Errorf("%s: append kernel %q, want %q", name, w.Append, wantAppend)
		}
		w.Kernel, w.FP8Cache, w.Append = v.Kernel, false, v.Append
		if w != v {
			t.Errorf("%s: launch facts %+v differ from %+v", name, w, v)
		}
	}
	if n*2 != len(byName) {
		t.Errorf("%d fp8-cache variants of %d", n, len(byName))
	}
	for _, dt := range []DType{Float16, BFloat16} {
		for _, kv := range []DType{Float8E4M3, Float8E5M2} {
			for _, f := range []Form{FormPlain, FormServing, FormPaged, FormPagedAppend, FormAppend} {
				for _, rows := range []int{1, 16, 17, 40} {
					for _, d := range []int{40, 64, 128, 200, 256} {
						want, err := SelectVariant(dt, d, rows, f)
						if err != nil {
							t.Fatal(err)
						}
						got, err := SelectCacheVariant(dt, kv, d, rows, f)
						if err != nil || !got.FP8Cache || got.HeadDim != want.HeadDim || got.Rows != want.Rows || got.Form != f {
							t.Fatalf("SelectCacheVariant(%v, %v, %d, %d, %v) = %s, %v; the same cache of %v: %s",
								dt, kv, d, rows, f, got.Kernel, err, dt, want.Kernel)
						}
					}
				}
			}
		}
		for _, kv := range []DType{Float32, Float16 + BFloat16 - dt} {
			if v, err := SelectCacheVariant(dt, kv, 128, 16, FormPlain); err == nil {
				t.Errorf("SelectCacheVariant(%v, %v) = %s, want an error", dt, kv, v.Kernel)
			}
		}
	}
}
