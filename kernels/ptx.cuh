// ptx.cuh: the few sm_80+ instructions the kernels are built from, and the
// per-dtype pieces (fp16 / bf16) that differ between the two element types.
//
//   cp.async 16-byte copies    global -> shared without a register round trip,
//                              with zero fill for masked chunks (src-size 0)
//   ldmatrix (.trans)          8x8 b16 tiles from shared memory into mma fragments
//   mma.sync m16n8k16          tensor-core multiply with fp32 accumulation
//   griddepcontrol             programmatic dependent launch (sm_90+)
//   barrier.cluster, mapa,     thread-block clusters (sm_90+): a barrier over the
//   ld.shared::cluster,        blocks of a cluster, loads from another block's
//   mbarrier, st.async         shared memory (distributed shared memory), and
//                              stores into it counted on its transaction barrier
//
// Shared-memory tiles are rows of D b16 elements stored in 16-byte chunks with
// an XOR swizzle (chunk c of row r lives at chunk c ^ (r % 8)), so the eight
// rows one ldmatrix reads, and the rows cp.async writes, hit eight different
// bank groups instead of one.
#ifndef FLASHDECODE_PTX_CUH
#define FLASHDECODE_PTX_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled tile
// whose rows hold D elements (D a multiple of 64: at least 8 chunks a row).
template <int D>
__device__ __forceinline__ int fd_swizzle(int row, int chunk) {
    static_assert(D % 64 == 0, "swizzle needs at least 8 chunks per row");
    return row * D + ((chunk ^ (row & 7)) << 3);
}

// The same for a tile of KV elements: an fp8 row of D bytes holds D / 16
// chunks. From 8 chunks a row on, its swizzle is that of a b16 row of D / 2
// elements; a row of 4 chunks (D 64) XORs with (row / 2) % 4, so that the
// eight rows one ldmatrix reads (two to a 128-byte line) still hit eight
// different bank groups.
template <int D, typename KV>
__device__ __forceinline__ int fd_kv_swizzle(int row, int chunk) {
    if constexpr (sizeof(KV) == 2) {
        return fd_swizzle<D>(row, chunk);
    } else if constexpr (D >= 128) {
        return fd_swizzle<D / 2>(row, chunk) * 2;
    } else {
        static_assert(D == 64, "an fp8 row of 64 bytes is 4 chunks");
        return row * D + ((chunk ^ ((row >> 1) & 3)) << 4);
    }
}

// 2^x on the MUFU unit alone. exp2f also rescales inputs below -126 so that
// their results come out denormal (three more instructions a call); these
// flush to 0 instead, which a softmax weight below 2^-126 can afford.
__device__ __forceinline__ float fd_exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t fd_smem_addr(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// An 8-byte store to shared memory that the compiler keeps in program
// order with the memory accesses around it.
__device__ __forceinline__ void fd_st_shared8(void *smem, uint2 v) {
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(fd_smem_addr(smem)), "r"(v.x), "r"(v.y) : "memory");
}

// Copies 16 bytes from global to shared memory asynchronously; copies
// nothing and writes zeros when !valid (src is then never read).
__device__ __forceinline__ void fd_cp_async_16(void *smem, const void *gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fd_smem_addr(smem)),
                 "l"(gmem), "r"(valid ? 16 : 0)
                 : "memory");
}

// As fd_cp_async_16, copying the first `bytes` (0..16) and zero-filling
// the rest: an fp8 row's last chunk where head_dim is not a multiple of 16.
__device__ __forceinline__ void fd_cp_async_bytes(void *smem, const void *gmem, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fd_smem_addr(smem)), "l"(gmem), "r"(bytes)
                 : "memory");
}

// As fd_cp_async_16 for 4 bytes (through L1: .ca is the only form below 16).
__device__ __forceinline__ void fd_cp_async_4(void *smem, const void *gmem, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(fd_smem_addr(smem)), "l"(gmem),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void fd_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void fd_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Barrier ID (1-15; 0 is __syncthreads') for THREADS threads of the block,
// whole warps: lets a few warps meet without stopping the others. Both are
// immediates, so ptxas counts only the barriers used.
template <int ID, int THREADS>
__device__ __forceinline__ void fd_bar_sync() {
    asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(THREADS) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void fd_ldmatrix_x4(uint32_t r[4], const void *smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fd_smem_addr(smem)));
}

// As fd_ldmatrix_x4, each matrix transposed.
__device__ __forceinline__ void fd_ldmatrix_x4_trans(uint32_t r[4], const void *smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fd_smem_addr(smem)));
}

// Programmatic dependent launch. A kernel launched with the
// programmatic-stream-serialization attribute may start while the kernel
// before it in the stream is still running; fd_pdl_wait blocks until that
// kernel has finished and its writes are visible, and
// fd_pdl_launch_dependents lets the next such kernel be scheduled. Both are
// no-ops for an ordinary launch and before sm_90.
__device__ __forceinline__ void fd_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Kernel arguments live in the constant bank, whose first read of each
// 64-byte line on an SM misses to L2. fd_touch_params reads the given values
// (computed from arguments: pass one from each line the kernel's first
// instructions need) and stores their XOR to shared memory from one thread,
// then fences: a side effect the compiler cannot move past the PDL wait that
// follows (an unused value, or a plain store, it would sink below the wait),
// so those misses overlap the wait instead of delaying the first loads
// after it.
template <typename... V>
__device__ __forceinline__ void fd_touch_params(const V &...v) {
    __shared__ unsigned long long sink;
    const unsigned long long x = (0ull ^ ... ^ (unsigned long long)v);
    if (threadIdx.x == 0) *static_cast<volatile unsigned long long *>(&sink) = x;
    __threadfence_block();  // keeps the store (and the loads it needs) before what follows
}

// Starts moving the 128-byte line at ptr from HBM into L2; no register
// waits on it, and a later load of that line reads what it always would.
__device__ __forceinline__ void fd_prefetch_l2(const void *ptr) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
}

__device__ __forceinline__ void fd_pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Thread-block clusters (sm_90+). A kernel launched with cluster dims
// (n, 1, 1) runs n blocks at once on one GPC, and each may read and write the others'
// shared memory. Without a cluster launch (and before sm_90) a block is a
// cluster of one: rank 0 of size 1, and none of the rest is ever called.
__device__ __forceinline__ int fd_cluster_size() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
    return static_cast<int>(n);
#else
    return 1;
#endif
}

__device__ __forceinline__ int fd_cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return static_cast<int>(r);
#else
    return 0;
#endif
}

// Every thread of every block of the cluster arrives, then waits for all:
// shared-memory writes before it are visible to the cluster's reads after it.
__device__ __forceinline__ void fd_cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// The cluster barrier in two halves, for a block that must know the others
// have started (and initialized their mbarriers) before it writes to their
// shared memory: every thread arrives at its start (relaxed: it orders
// nothing except an mbarrier initialization fenced by fd_mbar_init) and
// waits just before its first write. The wait lasts until the cluster's
// last block has started, which can be late (the blocks of a cluster start
// as the previous kernel frees SMs), so it belongs as late as it can be.
__device__ __forceinline__ void fd_cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void fd_cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// The shared::cluster address of `local` (an address in this block's shared
// memory) in the shared memory of cluster block `rank`.
__device__ __forceinline__ uint32_t fd_cluster_addr(const void *local, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(fd_smem_addr(local)), "r"(rank));
    return a;
#else
    return fd_smem_addr(local);
#endif
}

__device__ __forceinline__ float fd_cluster_ld(uint32_t addr) {
    float x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(addr) : "memory");
#else
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(addr) : "memory");
#endif
    return x;
}

__device__ __forceinline__ float4 fd_cluster_ld4(uint32_t addr) {
    float4 x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(addr) : "memory");
#else
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(addr) : "memory");
#endif
    return x;
}

// An mbarrier (sm_90 transaction barrier) in this block's shared memory,
// initialized by one thread for one arrival, and made visible to the
// cluster's other blocks before their first st.async to it (the fence, then
// the cluster barrier's arrive and wait).
__device__ __forceinline__ void fd_mbar_init(uint64_t *bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n"
                 "fence.mbarrier_init.release.cluster;\n" ::"r"(fd_smem_addr(bar))
                 : "memory");
#endif
}

// The one arrival, announcing `bytes` to come by st.async: the barrier's
// phase 0 completes when all of them have landed.
__device__ __forceinline__ void fd_mbar_expect_bytes(uint64_t *bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(fd_smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
#endif
}

// Waits until phase 0 of `bar` has completed; the st.async writes it counted
// are then visible to the calling thread.
__device__ __forceinline__ void fd_mbar_wait_phase0(uint64_t *bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], 0;\n"
        "@!done bra wait;\n"
        "}\n" ::"r"(fd_smem_addr(bar))
        : "memory");
#endif
}

// Fire-and-forget stores into another block's shared memory (addresses from
// fd_cluster_addr), each counted in bytes on that block's mbarrier `bar`
// (its fd_cluster_addr too): no round trip, no barrier over the cluster.
__device__ __forceinline__ void fd_st_async4(uint32_t addr, float4 v, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(addr),
        "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
        : "memory");
#endif
}

__device__ __forceinline__ void fd_st_async1(uint32_t addr, float v, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];\n" ::"r"(addr),
                 "f"(v), "r"(bar)
                 : "memory");
#endif
}

// The element types. Each provides
//   pack(lo, hi)          two floats rounded into one b16x2 register (lo in the low half)
//   unpack(x, lo, hi)     the reverse
//   mma(c, a, b0, b1)     c[16x8] += a[16x16] * b[16x8], fp32 accumulators
template <typename T>
struct fd_dtype;

template <>
struct fd_dtype<half> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    static __device__ __forceinline__ void unpack(uint32_t x, float &lo, float &hi) {
        float2 f = __half22float2(*reinterpret_cast<half2 *>(&x));
        lo = f.x;
        hi = f.y;
    }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                               uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

template <>
struct fd_dtype<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    static __device__ __forceinline__ void unpack(uint32_t x, float &lo, float &hi) {
        float2 f = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 *>(&x));
        lo = f.x;
        hi = f.y;
    }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                               uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// Stores four floats as four T at dst (8-byte aligned).
template <typename T>
__device__ __forceinline__ void fd_store4(T *dst, float4 v) {
    uint2 u;
    u.x = fd_dtype<T>::pack(v.x, v.y);
    u.y = fd_dtype<T>::pack(v.z, v.w);
    *reinterpret_cast<uint2 *>(dst) = u;
}

#endif  // FLASHDECODE_PTX_CUH
