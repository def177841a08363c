package cuda

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"testing"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda/internal/instances"
)

// TestFatbinKernelList: the kernel list nvcc was last given (go generate
// writes it beside the fatbin) is the list of the kernel table this package
// launches from, so the fatbin holds the table's kernels.
func TestFatbinKernelList(t *testing.T) {
	want, err := instances.Source(core.Kernels())
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile("fatbin/" + instances.File)
	if errors.Is(err, fs.ErrNotExist) {
		t.Skip("no kernels built: go generate ./core/cuda")
	}
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("fatbin/%s is not the list of core.Kernels: run go generate ./core/cuda", instances.File)
	}
}
