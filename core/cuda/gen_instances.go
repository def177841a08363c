//go:build ignore

// gen_instances writes the kernel list of core's kernel table to the file
// its argument names (go generate, see gen.go).
package main

import (
	"fmt"
	"os"

	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda/internal/instances"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: go run gen_instances.go OUTPUT")
		os.Exit(2)
	}
	src, err := instances.Source(core.Kernels())
	if err == nil {
		err = os.WriteFile(os.Args[1], src, 0o644)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "gen_instances:", err)
		os.Exit(1)
	}
}
