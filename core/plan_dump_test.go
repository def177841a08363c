package core

import (
	"bufio"
	"compress/gzip"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"testing"
)

// dumpForms are the plan dump's serving configurations: each form of stage
// 1, with and without the lengths on the device, the append kernel and rotary.
var dumpForms = []struct {
	name string
	set  func(*Shape)
}{
	{"plain", func(s *Shape) {}},
	{"plain_lengths", func(s *Shape) { s.DeviceLengths = true }},
	{"serving_window", func(s *Shape) { s.Serving, s.WindowKeys, s.DeviceLengths = true, 128, true }},
	{"serving", func(s *Shape) { s.Serving, s.DeviceLengths = true, true }},
	{"paged", func(s *Shape) { s.Serving, s.Paged, s.DeviceLengths = true, true, true }},
	{"paged_append1", func(s *Shape) { s.Serving, s.Paged, s.SeqlenNew, s.DeviceLengths = true, true, 1, true }},
	{"append4", func(s *Shape) { s.Serving, s.Contiguous, s.SeqlenNew = true, true, 4 }},
	{"append1_rotary", func(s *Shape) { s.Serving, s.Contiguous, s.SeqlenNew, s.RotaryQ = true, true, 1, true }},
	{"paged_append16_rotary", func(s *Shape) { s.Serving, s.Paged, s.SeqlenNew, s.RotaryQ = true, true, 16, true }},
}

// TestPlanDump plans 829,440 shapes (every combination below) and writes
// each plan's JSON, or its refusal, one line a shape, to the gzip file
// FD_PLAN_DUMP names; it logs the SHA-256 of the lines. The "merge" field is
// left out, so that a refactor of the planner can be compared against a
// commit from before that field: the two dumps must be identical. Without
// FD_PLAN_DUMP it is skipped.
func TestPlanDump(t *testing.T) {
	path := os.Getenv("FD_PLAN_DUMP")
	if path == "" {
		t.Skip("set FD_PLAN_DUMP=file.gz to dump every plan")
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zw := gzip.NewWriter(f)
	w := bufio.NewWriter(zw)
	sum := sha256.New()
	out := io.MultiWriter(w, sum)
	devices := []struct {
		name string
		d    Device
	}{{"h200", H200}, {"sm108_noclusters", Device{SMs: 108}}}
	heads := [][2]int{{8, 8}, {32, 8}, {32, 32}, {64, 8}, {8, 1}, {128, 2}}
	n, merges := 0, map[string]int{}
	for _, dt := range []DType{Float16, BFloat16} {
		for _, batch := range []int{1, 2, 3, 8, 16, 33, 132, 1024} {
			for _, seqlenQ := range []int{1, 2, 16} {
				for _, h := range heads {
					for _, headDim := range []int{64, 128, 256, 72} {
						for _, cache := range []int{256, 1024, 4096, 32768, 262144} {
							for _, seqlen := range []int{-1, cache / 3} {
								for _, splits := range []int{0, 1, 5, 64} {
									for _, form := range dumpForms {
										for _, dev := range devices {
											s := Shape{DType: dt, Batch: batch, SeqlenQ: seqlenQ, HeadsQ: h[0], HeadsKV: h[1],
												HeadDim: headDim, SeqlenCache: cache, Seqlen: seqlen, NumSplits: splits}
											form.set(&s)
											key := fmt.Sprintf("%v b%d q%d h%d/%d d%d c%d s%d n%d %s %s", dt, batch, seqlenQ,
												h[0], h[1], headDim, cache, seqlen, splits, form.name, dev.name)
											fmt.Fprintf(out, "%s\t%s\n", key, dumpPlan(t, s, dev.d, merges))
											n++
										}
									}
								}
							}
						}
					}
				}
			}
		}
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	names := make([]string, 0, len(merges))
	for m := range merges {
		names = append(names, m)
	}
	sort.Strings(names)
	for _, m := range names {
		t.Logf("merge %q: %d plans", m, merges[m])
	}
	t.Logf("%d plans, sha256 %x", n, sum.Sum(nil))
}

// dumpPlan is one line of the dump: the plan's JSON with sorted keys and
// without "merge" (counted in merges), and whether it lets the next kernels
// in early, or the refusal.
func dumpPlan(t *testing.T, s Shape, d Device, merges map[string]int) string {
	p, err := MakePlan(s, d)
	if err != nil {
		return "error: " + err.Error()
	}
	m := planFields(t, p)
	if mode, ok := m["merge"].(string); ok {
		merges[mode]++
	}
	delete(m, "merge")
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%s early=%v combine_early=%v", b, p.EarlyDependents(), p.CombineEarlyDependents())
}

// planFields is p as its JSON object, for tests that read a plan's fields by their JSON names.
func planFields(t *testing.T, p Plan) map[string]any {
	t.Helper()
	b, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}
