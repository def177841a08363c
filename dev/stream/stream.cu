// stream.cu: how fast one thread block streams key tiles into shared memory,
// and what of stage 1's tile loop slows it (a developer tool, not part of the
// library).
//
// A stage-1 block at head dim 128 streams tiles of 64 keys (a 16 KiB K tile
// and a 16 KiB V tile) through a pipeline of shared-memory stages, and on
// each landed tile runs its loop: ldmatrix reads of K and V, the Q K^T and
// P V mmas, the online softmax between them. This program streams the same
// tiles with the same pipeline and lets each part of that work be switched
// on alone, so that the rate of a lone block can be taken apart:
//
//   source   copy:  cp.async, 16 bytes a copy, every thread a share (stage 1's way),
//                   rows swizzled as stage 1 swizzles them (conflict-free ldmatrix)
//            bulk:  cp.async.bulk (the TMA engine), one copy a 256-byte row from the
//                   first 128 threads, rows padded to 272 bytes (conflict-free ldmatrix),
//                   an mbarrier a stage counting the bytes
//            tensor: cp.async.bulk.tensor (the TMA engine with a tensor map), four copies a
//                   tile from one thread, each a 64-key x 64-dim box (8 KiB) laid out with the
//                   TMA's 128-byte swizzle (conflict-free ldmatrix), an mbarrier a stage
//            ldg:   no shared memory: 16-byte loads into registers, a stage's tiles a round
//            wide:  cp.async as copy, 128-key tiles (64 KiB): each of 4 warps owns 32 keys
//                   (one softmax update and one rescale of its output for both halves),
//                   or each of 8 warps 16; rates still counted in 64-key tiles
//   work     none, ld (each warp's ldmatrix reads of its 16 keys of K and V),
//            mma (ld and the mmas on them), soft (mma and the softmax between)
//   stages   tiles in the pipeline (one fewer in flight while a tile is worked on)
//   blocks   lone: one block on the GPU; pair: two blocks on one SM (a grid of two
//            an SM, all but SM 0's returning at once); full: one or two blocks on
//            every SM, each streaming 64 tiles, as stage 1 at b=8 8K keys does
//
// It prints, per configuration, each working block's tiles a microsecond
// (median over blocks, from %globaltimer at its start and its end) and the
// GB/s of all working blocks together. Zero data, fp16.
//
//     nvcc -O3 -std=c++17 -arch=sm_90a -o stream dev/stream/stream.cu -lcuda && ./stream
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../../kernels/ptx.cuh"
#include "../common.cuh"

constexpr int D = 128;
constexpr int KEYS = 64;                      // keys a tile
constexpr int TILE_ELEMS = KEYS * D;          // one K (or V) tile, 16 KiB
constexpr int TILE_BYTES = 2 * TILE_ELEMS * 2;  // K and V, 32 KiB
constexpr int PAD = D + 8;                    // bulk rows: 272 bytes

enum Source { kCopy, kBulk, kLdg, kWide, kTensor };
enum Work { kNone, kLd, kMma, kSoft };
static const char *kSourceName[] = {"copy", "bulk", "ldg", "wide", "tensor"};
static const char *kWorkName[] = {"none", "ld", "mma", "soft"};

// Element offset of (row, 16-byte chunk) in a K or V tile: swizzled for
// cp.async, padded for bulk copies, and for tensor copies two 64-dim halves
// of 128-byte rows, each with the TMA's 128-byte swizzle (chunk ^ row % 8);
// all keep ldmatrix free of bank conflicts.
template <int SRC>
__device__ __forceinline__ int at(int row, int chunk) {
    if constexpr (SRC == kBulk) return row * PAD + chunk * 8;
    else if constexpr (SRC == kTensor) return (chunk / 8) * KEYS * 64 + row * 64 + (((chunk % 8) ^ (row % 8)) << 3);
    else return fd_swizzle<D>(row, chunk);
}

__device__ __forceinline__ void mbar_init(uint64_t *bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(fd_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(fd_smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, int parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait;\n"
        "}\n" ::"r"(fd_smem_addr(bar)),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, int bytes, uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            fd_smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(fd_smem_addr(bar))
        : "memory");
}

// One box of the tensor map at (dim, row) into shared memory, counted on bar.
__device__ __forceinline__ void tensor_copy(void *dst, const CUtensorMap *map, int dim, int row, uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            fd_smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(dim), "r"(row), "r"(fd_smem_addr(bar))
        : "memory");
}

// Stage 1's tile work on one landed tile (WORK >= kLd), for a warp's G
// groups of 16 keys (one online-softmax update for all of them).
template <int SRC, int WORK, int G>
struct TileWork {
    uint32_t qf[8][4];  // a fixed Q fragment: 16 rows x 128 dims
    float o[16][4];     // P V accumulators: 16 rows x 128 columns
    float m[2], l[2];
    uint32_t bits;

    __device__ void init() {
        for (int kk = 0; kk < 8; ++kk)
            for (int i = 0; i < 4; ++i) qf[kk][i] = 0x3c003c00u ^ (threadIdx.x * 7 + kk * 4 + i);
        for (int n = 0; n < 16; ++n)
            for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
        m[0] = m[1] = -1e30f;
        l[0] = l[1] = 0.f;
        bits = 0;
    }

    __device__ void run(const half *k_s, const half *v_s) {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int key0 = warp * 16 * G;
        float sc[G][2][4] = {}, sc_odd[G][2][4] = {};
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                uint32_t kf[4];
                fd_ldmatrix_x4(kf, k_s + at<SRC>(key0 + 16 * g + (lane / 16) * 8 + lane % 8, 2 * kk + (lane / 8) % 2));
                if constexpr (WORK == kLd) {
                    bits ^= kf[0] ^ kf[1] ^ kf[2] ^ kf[3];
                } else {
                    float(&acc)[2][4] = kk % 2 ? sc_odd[g] : sc[g];
                    fd_dtype<half>::mma(acc[0], qf[kk], kf[0], kf[1]);
                    fd_dtype<half>::mma(acc[1], qf[kk], kf[2], kf[3]);
                }
            }
        }
        uint32_t pf[G][4];
        if constexpr (WORK >= kMma) {
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int e = 0; e < 8; ++e) sc[g][e / 4][e % 4] += sc_odd[g][e / 4][e % 4];
            if constexpr (WORK == kSoft) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float mx = -1e30f;
#pragma unroll
                    for (int g = 0; g < G; ++g)
                        mx = fmaxf(mx, fmaxf(fmaxf(sc[g][0][2 * h], sc[g][0][2 * h + 1]),
                                             fmaxf(sc[g][1][2 * h], sc[g][1][2 * h + 1])));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float m_new = fmaxf(m[h], mx);
                    const float alpha = fd_exp2_ftz(m[h] - m_new);
                    m[h] = m_new;
                    float sum = 0.f;
#pragma unroll
                    for (int g = 0; g < G; ++g)
#pragma unroll
                        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                float &x = sc[g][nt][2 * h + e];
                                x = fd_exp2_ftz(x - m_new);
                                sum += x;
                            }
                    l[h] = l[h] * alpha + sum;
#pragma unroll
                    for (int n = 0; n < 16; ++n) {
                        o[n][2 * h] *= alpha;
                        o[n][2 * h + 1] *= alpha;
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                pf[g][0] = fd_dtype<half>::pack(sc[g][0][0], sc[g][0][1]);
                pf[g][1] = fd_dtype<half>::pack(sc[g][0][2], sc[g][0][3]);
                pf[g][2] = fd_dtype<half>::pack(sc[g][1][0], sc[g][1][1]);
                pf[g][3] = fd_dtype<half>::pack(sc[g][1][2], sc[g][1][3]);
            }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                uint32_t vf[4];
                fd_ldmatrix_x4_trans(vf, v_s + at<SRC>(key0 + 16 * g + ((lane / 8) % 2) * 8 + lane % 8,
                                                       2 * j + lane / 16));
                if constexpr (WORK == kLd) {
                    bits ^= vf[0] ^ vf[1] ^ vf[2] ^ vf[3];
                } else {
                    fd_dtype<half>::mma(o[2 * j], pf[g], vf[0], vf[1]);
                    fd_dtype<half>::mma(o[2 * j + 1], pf[g], vf[2], vf[3]);
                }
            }
        }
    }

    __device__ float result() const {
        float s = __uint_as_float(bits & 0x007fffffu) + l[0] + l[1];
        for (int n = 0; n < 16; ++n) s += o[n][0] + o[n][1] + o[n][2] + o[n][3];
        return s;
    }
};

// Streams `tiles` tiles from src (tile j of block x is tile (first + x *
// tiles + j) mod tiles_total) through STAGES shared-memory stages. A grid with
// only_sm >= 0 works on that SM alone. Stamps: start, end, SM.
template <int SRC, int WORK, int STAGES, int THREADS>
__global__ void __launch_bounds__(THREADS) stream(const half *src, long long tiles_total, long long first, int tiles,
                                                  int only_sm, unsigned long long *stamps, float *sink,
                                                  const __grid_constant__ CUtensorMap map) {
    if (only_sm >= 0 && smid() != (unsigned)only_sm) return;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ uint64_t bars[STAGES];
    constexpr bool kTma = SRC == kBulk || SRC == kTensor;  // stages complete on mbarriers
    // The TMA's 128-byte swizzle repeats every 1024 bytes: stages start on one.
    half *smem = reinterpret_cast<half *>(SRC == kTensor ? smem_raw + (-fd_smem_addr(smem_raw) & 1023u) : smem_raw);
    constexpr int kW = SRC == kWide ? 2 : 1;  // 64-key tiles a tile
    constexpr int kTileKeys = kW * KEYS;
    constexpr int kStageElems = 2 * kTileKeys * (SRC == kBulk ? PAD : D);
    const unsigned long long t0 = gtime();
    const auto tile_src = [&](int j) {
        return src + (first + ((long long)blockIdx.x * tiles + j) * kW) % tiles_total * (2 * TILE_ELEMS);
    };
    TileWork<SRC, WORK, kTileKeys / 16 / (THREADS / 32)> work;
    work.init();
    float ldg_acc = 0.f;

    if constexpr (SRC == kLdg) {
        // A round: STAGES tiles' loads in flight, then their sum.
        constexpr int kPerThread = TILE_BYTES / 16 / THREADS;
        for (int j = 0; j < tiles; j += STAGES) {
            float4 x[STAGES][kPerThread];
#pragma unroll
            for (int s = 0; s < STAGES; ++s)
#pragma unroll
                for (int i = 0; i < kPerThread; ++i)
                    x[s][i] = j + s < tiles ? __ldcg(reinterpret_cast<const float4 *>(tile_src(j + s)) + i * THREADS +
                                                     threadIdx.x)
                                            : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int s = 0; s < STAGES; ++s)
#pragma unroll
                for (int i = 0; i < kPerThread; ++i) ldg_acc += x[s][i].x + x[s][i].y + x[s][i].z + x[s][i].w;
        }
    } else {
        if constexpr (kTma) {
            if (threadIdx.x == 0) {
                for (int s = 0; s < STAGES; ++s) mbar_init(&bars[s]);
                asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
            }
            __syncthreads();
        }
        const auto load = [&](int j, int stage) {
            half *dst = smem + stage * kStageElems;
            const half *from = tile_src(j);
            if constexpr (SRC == kCopy || SRC == kWide) {
                // Thread t copies chunk t % 16 of keys t / 16, + THREADS / 16, ... of K and of V.
                const int chunk = threadIdx.x % 16;
#pragma unroll
                for (int key = threadIdx.x / 16; key < kTileKeys; key += THREADS / 16) {
                    fd_cp_async_16(dst + at<SRC>(key, chunk), from + key * D + chunk * 8, true);
                    fd_cp_async_16(dst + kW * TILE_ELEMS + at<SRC>(key, chunk),
                                   from + kW * TILE_ELEMS + key * D + chunk * 8, true);
                }
            } else if constexpr (SRC == kTensor) {
                // The map's rows are the buffer's 128-dim rows: a tile is 64 K rows, then 64 V rows.
                if (threadIdx.x == 0) {
                    mbar_expect(&bars[stage], TILE_BYTES);
                    const int row = (int)((from - src) / D);
#pragma unroll
                    for (int kv = 0; kv < 2; ++kv)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            tensor_copy(dst + kv * TILE_ELEMS + h * KEYS * 64, &map, h * 64, row + kv * KEYS, &bars[stage]);
                }
            } else {
                // Thread r < 128 copies row r: keys 0-63 of K, then of V.
                if (threadIdx.x == 0) mbar_expect(&bars[stage], TILE_BYTES);
                if (threadIdx.x < 2 * KEYS) bulk_copy(dst + threadIdx.x * PAD, from + threadIdx.x * D, D * 2, &bars[stage]);
            }
        };
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < tiles) load(s, s);
            if constexpr (!kTma) fd_cp_async_commit();
        }
        for (int it = 0; it < tiles; ++it) {
            const int stage = it % STAGES;
            if constexpr (!kTma) fd_cp_async_wait<STAGES - 2>();
            else mbar_wait(&bars[stage], (it / STAGES) & 1);
            __syncthreads();  // tile `it` landed for all; tile it-1's stage is free
            const int next = it + STAGES - 1;
            if (next < tiles) load(next, next % STAGES);
            if constexpr (!kTma) fd_cp_async_commit();
            if constexpr (WORK != kNone) {
                const half *k_s = smem + stage * kStageElems;
                work.run(k_s, k_s + kStageElems / 2);
            }
        }
    }
    const unsigned long long t1 = gtime();
    if (threadIdx.x == 0) {
        stamps[3 * blockIdx.x] = t0;
        stamps[3 * blockIdx.x + 1] = t1;
        stamps[3 * blockIdx.x + 2] = smid() + 1;  // 0: the block returned without working
    }
    const float r = work.result() + ldg_acc;
    if (r == 1.2345f) sink[threadIdx.x] = r;  // keeps the work; never true for zero data
}

struct Config {
    const char *blocks;  // lone, pair, full1, full2
    int src, work, stages, threads;
    void (*kernel)(const half *, long long, long long, int, int, unsigned long long *, float *, const CUtensorMap);
    int smem;
};

template <int SRC, int WORK, int STAGES, int THREADS>
Config make(const char *blocks) {
    const int keys = SRC == kWide ? 2 * KEYS : KEYS;
    const int smem = SRC == kLdg ? 0 : STAGES * 2 * keys * (SRC == kBulk ? PAD : D) * 2 + (SRC == kTensor ? 1024 : 0);
    return Config{blocks, SRC, WORK, STAGES, THREADS, stream<SRC, WORK, STAGES, THREADS>, smem};
}

int main(int argc, char **argv) {
    const char *only = argc > 1 ? argv[1] : nullptr;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const long long buffer_bytes = 2ll << 30;  // rotates far past the 60 MB L2
    const long long tiles_total = buffer_bytes / TILE_BYTES;
    half *src;
    CK(cudaMalloc(&src, buffer_bytes));
    CK(cudaMemset(src, 0, buffer_bytes));
    unsigned long long *stamps;
    float *sink;
    CK(cudaMalloc(&stamps, 3 * 4 * sms * sizeof(unsigned long long)));
    CK(cudaMalloc(&sink, 1024 * sizeof(float)));
    // The buffer as rows of 128 fp16 dims, in boxes of 64 rows x 64 dims.
    CUtensorMap map;
    const cuuint64_t dims[2] = {D, (cuuint64_t)(buffer_bytes / (2 * D))};
    const cuuint64_t strides[1] = {2 * D};
    const cuuint32_t box[2] = {64, KEYS}, unit[2] = {1, 1};
    if (cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, src, dims, strides, box, unit,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        printf("cuTensorMapEncodeTiled failed\n");
        return 1;
    }

    std::vector<Config> configs = {
        // cp.async as stage 1 issues it; bytes in flight; a block's own work on top.
        make<kCopy, kNone, 2, 128>("lone"), make<kCopy, kNone, 3, 128>("lone"),
        make<kCopy, kNone, 4, 128>("lone"), make<kCopy, kNone, 6, 128>("lone"),
        make<kCopy, kNone, 3, 256>("lone"), make<kCopy, kNone, 6, 256>("lone"),
        make<kCopy, kLd, 3, 128>("lone"),   make<kCopy, kMma, 3, 128>("lone"),
        make<kCopy, kSoft, 3, 128>("lone"), make<kCopy, kLd, 5, 128>("lone"),
        make<kCopy, kMma, 5, 128>("lone"),  make<kCopy, kSoft, 5, 128>("lone"),
        // The TMA engine instead of the threads' copies.
        make<kBulk, kNone, 2, 128>("lone"), make<kBulk, kNone, 3, 128>("lone"),
        make<kBulk, kNone, 6, 128>("lone"), make<kBulk, kLd, 3, 128>("lone"),
        make<kBulk, kMma, 3, 128>("lone"),  make<kBulk, kSoft, 3, 128>("lone"),
        make<kBulk, kSoft, 5, 128>("lone"),
        // Tiles of 128 keys: 4 warps of 32 keys, or 8 of 16.
        make<kWide, kNone, 3, 128>("lone"), make<kWide, kSoft, 2, 128>("lone"),
        make<kWide, kSoft, 3, 128>("lone"), make<kWide, kSoft, 3, 256>("lone"),
        make<kWide, kSoft, 3, 128>("full1"), make<kWide, kSoft, 3, 256>("full1"),
        // Loads into registers: a lone SM's read with no shared memory at all.
        make<kLdg, kNone, 1, 1024>("lone"), make<kLdg, kNone, 2, 1024>("lone"),
        make<kLdg, kNone, 4, 1024>("lone"), make<kLdg, kNone, 4, 512>("lone"),
        // Two blocks on one SM.
        make<kCopy, kNone, 3, 128>("pair"), make<kCopy, kSoft, 3, 128>("pair"),
        make<kBulk, kNone, 3, 128>("pair"), make<kBulk, kSoft, 3, 128>("pair"),
        // Every SM, as in a grid that fills the GPU.
        make<kCopy, kNone, 3, 128>("full2"), make<kBulk, kNone, 3, 128>("full2"),
        make<kCopy, kSoft, 3, 128>("full1"), make<kCopy, kSoft, 3, 128>("full2"),
        make<kBulk, kSoft, 3, 128>("full1"), make<kBulk, kSoft, 3, 128>("full2"),
        make<kBulk, kSoft, 5, 128>("full1"), make<kLdg, kNone, 4, 1024>("full2"),
        // Tensor copies: four instructions a tile from one thread.
        make<kTensor, kNone, 2, 128>("lone"), make<kTensor, kNone, 3, 128>("lone"),
        make<kTensor, kNone, 6, 128>("lone"), make<kTensor, kLd, 3, 128>("lone"),
        make<kTensor, kMma, 3, 128>("lone"),  make<kTensor, kSoft, 3, 128>("lone"),
        make<kTensor, kSoft, 4, 128>("lone"), make<kTensor, kSoft, 3, 128>("pair"),
        make<kTensor, kNone, 3, 128>("full2"), make<kTensor, kSoft, 3, 128>("full1"),
        make<kTensor, kSoft, 3, 128>("full2"),
    };
    printf("%-6s %-5s %-5s %6s %7s %7s %12s %9s\n", "blocks", "src", "work", "stages", "threads", "working",
           "tiles/us/blk", "GB/s all");
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    long long rotate = 0;
    for (const Config &c : configs) {
        char name[64];
        snprintf(name, sizeof name, "%s %s %s %d %d", c.blocks, kSourceName[c.src], kWorkName[c.work], c.stages,
                 c.threads);
        if (only && !strstr(name, only)) continue;
        const std::string blocks = c.blocks;
        // full1 asks for more shared memory than two blocks of an SM can share.
        const int smem = blocks == "full1" ? std::max(c.smem, 120 * 1024) : c.smem;
        if (smem > 48 * 1024)
            CK(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        const int w = c.src == kWide ? 2 : 1;  // the kernel counts 128-key tiles, this program 64-key ones
        int grid = 1, tiles = 2048, only_sm = -1;
        if (blocks == "pair") grid = 2 * sms, only_sm = 0;
        if (blocks == "full1") grid = sms, tiles = 64;
        if (blocks == "full2") grid = 2 * sms, tiles = 64;
        std::vector<double> rates;
        double gbs = 0;
        int working = 0;
        for (int rep = 0; rep < 3; ++rep) {
            CK(cudaMemset(stamps, 0, 3 * grid * sizeof(unsigned long long)));
            // Each launch starts where the last one ended, so no tile is in L2.
            const long long first = rotate;
            rotate = (rotate + (long long)grid * tiles) % tiles_total;
            c.kernel<<<grid, c.threads, smem>>>(src, tiles_total, first, tiles / w, only_sm, stamps, sink, map);
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            std::vector<unsigned long long> h(3 * grid);
            CK(cudaMemcpy(h.data(), stamps, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
            if (rep == 0) continue;  // warm-up
            unsigned long long lo = ~0ull, hi = 0;
            working = 0;
            rates.clear();
            for (int x = 0; x < grid; ++x) {
                if (h[3 * x + 2] == 0) continue;
                ++working;
                lo = std::min(lo, h[3 * x]);
                hi = std::max(hi, h[3 * x + 1]);
                rates.push_back(tiles * 1e3 / double(h[3 * x + 1] - h[3 * x]));
            }
            gbs = double(working) * tiles * TILE_BYTES / double(hi - lo);
        }
        std::sort(rates.begin(), rates.end());
        printf("%-6s %-5s %-5s %6d %7d %7d %12.2f %9.1f\n", c.blocks, kSourceName[c.src], kWorkName[c.work], c.stages,
               c.threads, working, rates[rates.size() / 2], gbs);
    }
    return 0;
}
