package cuda

// The kernels of kernels/ compiled into one fatbin: SASS for sm_80, sm_86,
// sm_89 and sm_90 plus PTX for compute_90 so newer GPUs JIT it. The file is a
// build output (never committed); pip install and .ci/run make it first.
//go:generate nvcc -fatbin -O3 -std=c++17 -Xptxas=-warn-spills -gencode arch=compute_80,code=sm_80 -gencode arch=compute_86,code=sm_86 -gencode arch=compute_89,code=sm_89 -gencode arch=compute_90,code=[sm_90,compute_90] -o flashdecode.fatbin ../../kernels/flashdecode.cu

import _ "embed"

//go:embed flashdecode.fatbin
var fatbin string
