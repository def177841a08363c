package binding

import (
	"errors"
	"testing"

	"github.com/flash-decode/flash-decode/core"
)

// prepare registers b=1, 32/8 heads, d128, a cache of n tokens, contiguous.
func prepare(n int, causal bool) (int, error) {
	const q, kv = 32 * 128, 8 * 128
	return Prepare(1, 1, 1, 32, 8, 128, n, q, q, 128, int64(n*kv), kv, 128, int64(n*kv), kv, 128, q, q, 128, 0, causal, 0, 0)
}

func TestPrepareHandles(t *testing.T) {
	a, err := prepare(4096, false)
	if err != nil {
		t.Fatal(err)
	}
	again, _ := prepare(4096, false)
	other, _ := prepare(4096, true)
	if a < 0 || again != a || other == a {
		t.Fatalf("handles %d, %d (same layout), %d (causal)", a, again, other)
	}
	if _, err := Prepare(1, 1, 1, 12, 5, 128, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, false, 0, 0); !errors.Is(err, core.ErrInvalid) {
		t.Errorf("12/5 heads: %v", err)
	}
	for _, h := range []int{-1, 1 << 30} {
		if _, err := Run(h, -1, 16, 16, 16, 16, 0, 0, 0, 0, 0); !errors.Is(err, core.ErrInvalid) {
			t.Errorf("Run(handle %d): %v", h, err)
		}
	}
	if _, err := Run(a, -1, 0, 16, 16, 16, 0, 0, 0, 0, 0); !errors.Is(err, core.ErrInvalid) {
		t.Errorf("Run with a null q: %v", err)
	}
}

// Layouts registered from several goroutines while others look handles up:
// every handle stays valid and distinct (run with -race to check the table).
func TestPrepareConcurrent(t *testing.T) {
	const n = 64
	handles := make([]int, n)
	done := make(chan struct{})
	go func() { // a reader: Run on every handle seen so far (a null q: an error before any GPU work)
		defer close(done)
		for range 200 {
			for h := 0; h < n; h++ {
				if _, err := Run(h, -1, 0, 16, 16, 16, 0, 0, 0, 0, 0); err == nil {
					t.Error("Run with a null q succeeded")
					return
				}
			}
		}
	}()
	errs := make(chan error, n)
	for i := range n {
		go func() {
			h, err := prepare(1024+64*i, false)
			handles[i] = h
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	<-done
	seen := map[int]bool{}
	for i, h := range handles {
		if again, _ := prepare(1024+64*i, false); again != h || seen[h] {
			t.Fatalf("layout %d: handle %d, again %d (seen before: %v)", i, h, again, seen[h])
		}
		seen[h] = true
	}
}
