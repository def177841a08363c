package core

import (
	"encoding/json"
	"os"
	"strconv"
	"testing"
)

// sweepFile is testdata/splits_sweep.json: split sweeps measured on an H200,
// the time of one call at each split count tried (docs/tuning.md).
type sweepFile struct {
	Device  string       `json:"device"`
	DType   string       `json:"dtype"`
	Unit    string       `json:"unit"`
	Command string       `json:"command"`
	Method  string       `json:"method"`
	Sweeps  []splitSweep `json:"sweeps"`
}

// splitSweep is one shape's sweep.
type splitSweep struct {
	Name    string `json:"name"`
	Batch   int    `json:"batch"`
	HeadsQ  int    `json:"heads_q"`
	HeadsKV int    `json:"heads_kv"`
	HeadDim int    `json:"head_dim"`
	Seqlen  int    `json:"seqlen"`
	SeqlenQ int    `json:"seqlen_q"`
	// US is the time in µs by split count, and by tailSplitKey for the
	// tail split (tailSplit, Plan.WholeItems).
	US map[string]float64 `json:"us"`
}

// tailSplitKey holds a sweep's time of the tail split, which num_splits=0
// plans for grids of more items than the GPU holds at once.
const tailSplitKey = "tail"

// sweepTolerance is how much slower than the best count tried the planner's
// pick may run: about the run-to-run noise of the small shapes.
const sweepTolerance = 0.05

// loadSweeps reads and checks testdata/splits_sweep.json.
func loadSweeps(t *testing.T) []splitSweep {
	t.Helper()
	b, err := os.ReadFile("testdata/splits_sweep.json")
	if err != nil {
		t.Fatal(err)
	}
	var f sweepFile
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	if f.DType != Float16.String() || len(f.Sweeps) == 0 {
		t.Fatalf("splits_sweep.json: dtype %q and %d sweeps, want float16 sweeps", f.DType, len(f.Sweeps))
	}
	for _, sw := range f.Sweeps {
		for k, us := range sw.US {
			if n, err := strconv.Atoi(k); ((err != nil || n < 1) && k != tailSplitKey) || !(us > 0) {
				t.Fatalf("splits_sweep.json, %s: time %q: %v", sw.Name, k, us)
			}
		}
	}
	return f.Sweeps
}

// TestPlanAgainstH200Sweeps checks the num_splits=0 planner, as MakePlan
// runs it for an H200 without asking the GPU, against the measured sweeps:
// its pick must be a count that was timed, and run within sweepTolerance of
// the fastest count.
func TestPlanAgainstH200Sweeps(t *testing.T) {
	for _, sw := range loadSweeps(t) {
		t.Run(sw.Name, func(t *testing.T) {
			s := Shape{DType: Float16, Batch: sw.Batch, SeqlenQ: sw.SeqlenQ, HeadsQ: sw.HeadsQ, HeadsKV: sw.HeadsKV,
				HeadDim: sw.HeadDim, SeqlenCache: sw.Seqlen, Seqlen: -1}
			p, err := MakePlan(s, H200)
			if err != nil {
				t.Fatal(err)
			}
			key := strconv.Itoa(p.NumSplits)
			if p.WholeItems > 0 {
				key = tailSplitKey
			}
			got, ok := sw.US[key]
			if !ok {
				t.Fatalf("the planner picks %v, which the sweep did not time (%v): sweep it", p, sw.US)
			}
			best, bestKey := got, key
			for k, us := range sw.US {
				if us < best {
					best, bestKey = us, k
				}
			}
			if excess := got/best - 1; excess > sweepTolerance {
				t.Errorf("%s splits (%s) run in %.1f us, %.0f%% over %s splits (%.1f us)",
					key, p, got, 100*excess, bestKey, best)
			}
		})
	}
}
