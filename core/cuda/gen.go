package cuda

// The kernels of kernels/ compiled into one fatbin: SASS for sm_80, sm_86,
// sm_89, sm_90, sm_100 and sm_120 (each also runs on the later minor versions
// of its major) plus PTX for compute_90, which every GPU from sm_90 up can JIT
// (the kernels use nothing newer; compute_120's PTX would not run on sm_110).
// sm_100's and sm_120's SASS come from compute_90's PTX too (it spills less
// there than their own, docs/tuning.md), so code for them alone (__CUDA_ARCH__
// >= 1000) would need its own -gencode. First the list of kernels to
// instantiate is written from core's kernel table (core.Kernels,
// internal/instances) as fatbin/_instances.inc, which kernels/flashdecode.cu
// includes from nvcc's include path. Both files are build outputs (never
// committed, see fatbin/README.md); pip install and .ci/run make them first.
// --threads 0 compiles the architectures in parallel, one per CPU (the same
// fatbin, byte for byte). nvcc 13's cubins need a CUDA 13 driver;
// python/build_backend/fd_cuda12.py compiles the same list for the same
// architectures with CUDA 12 compilers instead (FD_CUDA=12, after `go generate
// -run gen_instances`), for CUDA 12 drivers.
//go:generate go run gen_instances.go fatbin/_instances.inc
//go:generate nvcc -fatbin -O3 -std=c++17 -Xptxas=-warn-spills --threads 0 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_86,code=sm_86 -gencode arch=compute_89,code=sm_89 -gencode arch=compute_90,code=[sm_90,sm_100,sm_120,compute_90] -I fatbin -o fatbin/flashdecode.fatbin ../../kernels/flashdecode.cu

import (
	"embed"
	"errors"
)

// The folder is embedded whole so that a checkout without the fatbin still
// builds (its README is always there).
//
//go:embed fatbin
var fatbinFS embed.FS

// errNoFatbin says that the kernels were not built into this binary; opening
// a device reports it as core.ErrUnsupported.
var errNoFatbin = errors.New("this build holds no CUDA kernels: run `go generate ./core/cuda` (needs nvcc) and rebuild")

// kernelImage returns the embedded fatbin, or errNoFatbin.
func kernelImage() (string, error) {
	b, err := fatbinFS.ReadFile("fatbin/flashdecode.fatbin")
	if err != nil || len(b) == 0 {
		return "", errNoFatbin
	}
	return string(b), nil
}
