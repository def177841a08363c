// launch.h: the one way core/cuda launches a kernel, for the cgo preambles of
// launch.go (decode: stage 1, the combine, the append kernel) and merge.go
// (merge_states). The kernel's one argument is its parameter struct, passed
// by value through params.
#ifndef FLASHDECODE_CORE_CUDA_LAUNCH_H
#define FLASHDECODE_CORE_CUDA_LAUNCH_H

#include <cuda.h>

// Sets a to launch in clusters of `cluster` blocks along x.
static inline void fd_cluster_attr(CUlaunchAttribute *a, unsigned cluster) {
	a->id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
	a->value.clusterDim.x = cluster;
	a->value.clusterDim.y = 1;
	a->value.clusterDim.z = 1;
}

// A launch of a (gx, gy, gz) grid of threads-thread blocks with smem bytes
// of dynamic shared memory on stream, with n attributes.
static inline CUlaunchConfig fd_launch_config(unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                                              unsigned smem, CUstream stream, CUlaunchAttribute *attrs,
                                              unsigned n) {
	CUlaunchConfig cfg = {0};
	cfg.gridDimX = gx;
	cfg.gridDimY = gy;
	cfg.gridDimZ = gz;
	cfg.blockDimX = threads;
	cfg.blockDimY = 1;
	cfg.blockDimZ = 1;
	cfg.sharedMemBytes = smem;
	cfg.hStream = stream;
	cfg.attrs = attrs;
	cfg.numAttrs = n;
	return cfg;
}

// Launches f on a (gx, gy, gz) grid of threads-thread blocks with smem bytes
// of dynamic shared memory on stream. With pdl set (sm_90+) the kernel may be
// scheduled while the previous kernel in the stream drains; the kernels start
// with griddepcontrol.wait, so they read nothing before that kernel has
// finished: it hides most of a launch's latency behind the tail of the kernel
// before. With cluster > 1 (sm_90+) every `cluster` blocks along x run
// together as one thread-block cluster.
static inline CUresult fd_launch_kernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                                        unsigned smem, CUstream stream, int pdl, unsigned cluster, void *params) {
	void *args[1] = {params};
	CUlaunchAttribute attrs[2];
	unsigned n = 0;
	if (pdl) {
		attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
		attrs[n].value.programmaticStreamSerializationAllowed = 1;
		n++;
	}
	if (cluster > 1) fd_cluster_attr(&attrs[n++], cluster);
	CUlaunchConfig cfg = fd_launch_config(gx, gy, gz, threads, smem, stream, attrs, n);
	return cuLaunchKernelEx(&cfg, f, args, NULL);
}

#endif  // FLASHDECODE_CORE_CUDA_LAUNCH_H
