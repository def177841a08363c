// common.cuh: what the CUDA programs in dev/ share (developer tools, not part
// of the library): a check on every CUDA runtime call, and a block's clock
// and SM.
#ifndef FLASHDECODE_DEV_COMMON_CUH
#define FLASHDECODE_DEV_COMMON_CUH

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

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

#endif  // FLASHDECODE_DEV_COMMON_CUH
