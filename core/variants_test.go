package core

import (
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// instantiation is one kernel kernels/flashdecode.cu instantiates: its
// macro's arguments.
type instantiation struct {
	macro, name, dtype string
	headDim, rows      int
	form               string // fd_form_* for FD_SPLIT_KV_FORM, else ""
}

// kernelTable reads the FD_SPLIT_KV*, FD_COMBINE* and FD_APPEND_KV lines of
// kernels/flashdecode.cu.
func kernelTable(t *testing.T) []instantiation {
	t.Helper()
	src, err := os.ReadFile("../kernels/flashdecode.cu")
	if err != nil {
		t.Fatal(err)
	}
	line := regexp.MustCompile(`(?m)^(FD_SPLIT_KV|FD_SPLIT_KV_SERVING|FD_SPLIT_KV_FORM|FD_COMBINE|FD_COMBINE_ROWS|FD_COMBINE_GROUPS|FD_APPEND_KV)\(([^)]*)\)`)
	var out []instantiation
	for _, m := range line.FindAllStringSubmatch(string(src), -1) {
		args := strings.Split(m[2], ",")
		for i := range args {
			args[i] = strings.TrimSpace(args[i])
		}
		in := instantiation{macro: m[1], name: args[0], dtype: args[1]}
		if strings.HasPrefix(m[1], "FD_SPLIT_KV") {
			if len(args) < 4 {
				t.Fatalf("%s: %d arguments", m[0], len(args))
			}
			in.headDim, _ = strconv.Atoi(args[2])
			in.rows, _ = strconv.Atoi(args[3])
			if m[1] == "FD_SPLIT_KV_FORM" && len(args) == 5 {
				in.form = args[4]
			}
		}
		out = append(out, in)
	}
	return out
}

// TestVariantsMatchTheKernels: the dispatch table and kernels/flashdecode.cu
// name the same stage-1 kernels, with the same dtype, head dim, rows and
// form, and every combine and append kernel a variant launches is
// instantiated there.
func TestVariantsMatchTheKernels(t *testing.T) {
	dtypes := map[string]DType{"half": Float16, "__nv_bfloat16": BFloat16}
	macroForm := map[string]Form{"FD_SPLIT_KV": FormPlain, "FD_SPLIT_KV_SERVING": FormServing}
	split, other := map[string]instantiation{}, map[string]bool{}
	for _, in := range kernelTable(t) {
		if strings.HasPrefix(in.macro, "FD_SPLIT_KV") {
			split[in.name] = in
		} else {
			other[in.name] = true
		}
	}
	if len(split) == 0 || len(other) == 0 {
		t.Fatalf("read %d stage-1 and %d other kernels from kernels/flashdecode.cu", len(split), len(other))
	}
	vs := Variants()
	if len(vs) != len(split) {
		t.Errorf("%d variants, %d stage-1 kernels instantiated", len(vs), len(split))
	}
	for _, v := range vs {
		in, ok := split[v.Kernel]
		if !ok {
			t.Errorf("%s is not instantiated in kernels/flashdecode.cu", v.Kernel)
			continue
		}
		form, ok := macroForm[in.macro]
		if in.macro == "FD_SPLIT_KV_FORM" {
			form, ok = v.Form, in.form == "fd_form_"+v.Form.String()
		}
		if !ok || form != v.Form || dtypes[in.dtype] != v.DType || in.headDim != v.HeadDim || in.rows != v.Rows {
			t.Errorf("%s: instantiated as %+v, the table has form %v, %v, head dim %d, %d rows",
				v.Kernel, in, v.Form, v.DType, v.HeadDim, v.Rows)
		}
		for _, name := range []string{v.Combine, v.CombineWide, v.CombineNarrow, v.Append} {
			if name != "" && !other[name] {
				t.Errorf("%s: kernel %s is not instantiated in kernels/flashdecode.cu", v.Kernel, name)
			}
		}
	}
}
