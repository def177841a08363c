/*
 * compat/cuda.h: lets gorgonia.org/cu v0.9.6 build against CUDA 13 headers.
 *
 * CUDA 13.0 changed the signatures of five driver functions (their names now
 * map to _v2/_v4 entry points that take new argument types). gorgonia.org/cu
 * calls the pre-13 forms, which the driver still exports, so this header comes
 * first on the include path (CGO_CFLAGS=-I<repo>/core/cuda/compat), pulls in the
 * real cuda.h with #include_next, and points those names back at the old entry
 * points. flash-decode itself calls none of the five. With CUDA 12 headers this
 * header changes nothing.
 *
 * cuEventElapsedTime kept its signature, but CUDA 13 maps it to
 * cuEventElapsedTime_v2, which drivers older than CUDA 12.8 lack: a binary
 * that imports it does not load on them (Python loads extensions with
 * RTLD_NOW). It goes back to the old entry point too, so that the binaries ask
 * a driver for nothing newer than CUDA 12.0 (the kernels' own floor is their
 * compiler's: docs/tuning.md, "CUDA 12 build").
 */
#ifndef FLASHDECODE_COMPAT_CUDA_H
#define FLASHDECODE_COMPAT_CUDA_H

#include_next <cuda.h>

#if CUDA_VERSION >= 13000
#undef cuCtxCreate
#undef cuMemAdvise
#undef cuMemPrefetchAsync
#undef cuGraphGetEdges
#undef cuGraphAddDependencies
#undef cuEventElapsedTime

#define cuCtxCreate cuCtxCreate_v2
CUresult CUDAAPI cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult CUDAAPI cuMemAdvise(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUdevice device);
CUresult CUDAAPI cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream);
CUresult CUDAAPI cuGraphGetEdges(CUgraph hGraph, CUgraphNode *from, CUgraphNode *to, size_t *numEdges);
CUresult CUDAAPI cuGraphAddDependencies(CUgraph hGraph, const CUgraphNode *from, const CUgraphNode *to,
                                        size_t numDependencies);
CUresult CUDAAPI cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd);
#endif

#endif /* FLASHDECODE_COMPAT_CUDA_H */
