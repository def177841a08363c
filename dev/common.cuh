// common.cuh: what the CUDA programs in dev/ share (developer tools, not part
// of the library): a check on every CUDA runtime call, a block's clock and
// SM, and a CUDA graph's launches timed.
#ifndef FLASHDECODE_DEV_COMMON_CUH
#define FLASHDECODE_DEV_COMMON_CUH

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

// Exits with the error's name and place when a CUDA runtime call fails.
#define CK(x)                                                                               \
    do {                                                                                    \
        cudaError_t e = (x);                                                                \
        if (e != cudaSuccess) {                                                             \
            printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

// The GPU's global nanosecond timer (it ticks in 0.256 us steps on the H200).
__device__ __forceinline__ unsigned long long gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The SM the calling block runs on.
__device__ __forceinline__ unsigned smid() {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}

// Milliseconds of each of `reps` launches of a graph on stream s, timed by
// events around each launch.
inline std::vector<float> time_graph(cudaGraphExec_t exec, cudaStream_t s, int reps) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ms(reps);
    for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(e0, s));
        CK(cudaGraphLaunch(exec, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms[r], e0, e1));
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return ms;
}

#endif  // FLASHDECODE_DEV_COMMON_CUH
