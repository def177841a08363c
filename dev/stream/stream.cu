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
//            still: no copies in the loop: every tile is the first one, already landed
//            ptens: tensor copies issued by a fifth, producer warp (stream_prod); the
//                   four compute warps wait on a stage's mbarrier and free it on their own
//            pcopy: the same with the producer's 32 lanes issuing cp.async
//            sprd2, sprd4: cp.async as copy, the next tile's copies issued in 2 or 4
//                   parts between the steps of this tile's work
//   work     none, ld (each warp's ldmatrix reads of its 16 keys of K and V),
//            mma (ld and the mmas on them), soft (mma and the softmax between),
//            regs (soft with K and V fragments made in registers: no shared-memory
//            reads), spin (SPIN clocks a tile of nothing, 600 unless set);
//            wg, wgah, wgx: the loop on wgmma (sm_90a, tensor copies; stream_wg,
//            stream_wgx), wgx-mma / wgx-math / wgx-mm: wgx without its softmax /
//            its copies / both. `./stream check` compares the wgmma loops' outputs
//            with a softmax computed on the host.
//   stages   tiles in the pipeline (one fewer in flight while a tile is worked on,
//            except with a producer warp)
//   blocks   lone: one block on the GPU; pair: two blocks on one SM (a grid of two
//            an SM, all but SM 0's returning at once); full: one or two blocks on
//            every SM, each streaming 64 tiles, as stage 1 at b=8 8K keys does;
//            half1 / half4: 64 blocks, one an SM, streaming 64 / 256 tiles each,
//            as 8 splits of b=1 32768 / 131072 keys (8 K/V heads) in clusters;
//            of96: 96 blocks of 64 tiles, as 48/48 heads at b=1, 8192 keys, 2 splits
//
// It prints, per configuration, each working block's tiles a microsecond
// (median over blocks, from %globaltimer at its start and its end) and the
// GB/s of all working blocks together; with PHASES=1 also, for the loop of
// stream(), block 0's clocks a tile in the copies' wait, the barrier, the
// issue of the next copies and the work, and (stream() and stream_prod())
// its clocks from its start to its first tile landed. Zero data, fp16.
//
//     nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o stream dev/stream/stream.cu -lcuda
//     ./stream [name part | check | first | b1]
// (first: a first tile's clocks from its copies' issue to landed, cp.async
// against tensor copies with and without the map's prefetch; b1: batch 1's
// cluster plan end to end with a producer warp, b1.cuh.)
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cmath>
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

enum Source { kCopy, kBulk, kLdg, kWide, kTensor, kStill, kProdTensor, kProdCopy, kSpread2, kSpread4 };
enum Work { kNone, kLd, kMma, kSoft, kWg, kWgAhead, kWgx, kWgxMma, kWgxMath, kWgxMmaMath, kRegs, kSpin };
static const char *kSourceName[] = {"copy", "bulk", "ldg", "wide", "tensor", "still", "ptens", "pcopy", "sprd2", "sprd4"};
static const char *kWorkName[] = {"none", "ld", "mma", "soft", "wg", "wgah", "wgx", "wgx-mma", "wgx-math", "wgx-mm", "regs", "spin"};

// Element offset of (row, 16-byte chunk) in a K or V tile: swizzled for
// cp.async, padded for bulk copies, and for tensor copies two 64-dim halves
// of 128-byte rows, each with the TMA's 128-byte swizzle (chunk ^ row % 8);
// all keep ldmatrix free of bank conflicts.
template <int SRC>
__device__ __forceinline__ int at(int row, int chunk) {
    if constexpr (SRC == kBulk) return row * PAD + chunk * 8;
    else if constexpr (SRC == kTensor || SRC == kProdTensor) return (chunk / 8) * KEYS * 64 + row * 64 + (((chunk % 8) ^ (row % 8)) << 3);
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

// Tile `tile` of the buffer (64 K rows, then 64 V rows of 128 dims) into dst
// by four tensor copies of 64 keys x 64 dims, counted on bar; one thread.
__device__ __forceinline__ void tensor_tile(half *dst, const CUtensorMap *map, long long tile, uint64_t *bar) {
    const int row = (int)(tile * 2 * KEYS);
    mbar_expect(bar, TILE_BYTES);
#pragma unroll
    for (int kv = 0; kv < 2; ++kv)
#pragma unroll
        for (int h = 0; h < 2; ++h) tensor_copy(dst + kv * TILE_ELEMS + h * KEYS * 64, map, h * 64, row + kv * KEYS, bar);
}

// The block's start and end (%globaltimer) and its SM + 1 (0: the block
// returned without working), from thread 0.
__device__ __forceinline__ void stamp(unsigned long long t0, unsigned long long *stamps) {
    const unsigned long long t1 = gtime();
    if (threadIdx.x == 0) {
        stamps[3 * blockIdx.x] = t0;
        stamps[3 * blockIdx.x + 1] = t1;
        stamps[3 * blockIdx.x + 2] = smid() + 1;
    }
}

__device__ long long g_spin = 600;  // spin: clocks a tile (SPIN=n in the environment)
__device__ long long g_phase[5];    // block 0's thread 0: clocks in each part of the loop, and from its
                                    // start to its first tile landed (PHASES=1 prints them)

// The buffer's tile that block x's j-th tile is: (first + x * per_block + j)
// mod tiles_total, base being that for j = 0 (one 64-bit modulo a block: a
// software division a tile would cost a lone block several percent).
__device__ __forceinline__ long long tile_at(long long base, long long j, long long tiles_total) {
    const long long t = base + j;
    return t >= tiles_total ? t - tiles_total : t;
}

// Stage 1's tile work on one landed tile (WORK >= kLd), for a warp's G
// groups of 16 keys (one online-softmax update for all of them). regs: the
// whole loop with K and V fragments made in registers instead of read with
// ldmatrix (no shared-memory reads); spin: g_spin clocks of nothing.
template <int SRC, int WORK, int G>
struct TileWork {
    static constexpr bool kMath = WORK == kMma || WORK == kSoft || WORK == kRegs;
    static constexpr bool kSoftmax = WORK == kSoft || WORK == kRegs;
    uint32_t round = 0;
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
        run(k_s, v_s, [](int) {});
    }
    // between(i) runs at four points of the tile's work: 0 before Q K^T, 1
    // after it, 2 after the softmax, 3 after P V.
    template <typename F>
    __device__ void run(const half *k_s, const half *v_s, F &&between) {
        if constexpr (WORK == kSpin) {
            const long long t = clock64();
            while (clock64() - t < g_spin) {
            }
            return;
        }
        ++round;
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int key0 = warp * 16 * G;
        between(0);
        float sc[G][2][4] = {}, sc_odd[G][2][4] = {};
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                uint32_t kf[4];
                if constexpr (WORK == kRegs) {
                    for (int i = 0; i < 4; ++i) kf[i] = qf[kk][i] ^ round;
                } else {
                    fd_ldmatrix_x4(kf, k_s + at<SRC>(key0 + 16 * g + (lane / 16) * 8 + lane % 8, 2 * kk + (lane / 8) % 2));
                }
                if constexpr (WORK == kLd) {
                    bits ^= kf[0] ^ kf[1] ^ kf[2] ^ kf[3];
                } else {
                    float(&acc)[2][4] = kk % 2 ? sc_odd[g] : sc[g];
                    fd_dtype<half>::mma(acc[0], qf[kk], kf[0], kf[1]);
                    fd_dtype<half>::mma(acc[1], qf[kk], kf[2], kf[3]);
                }
            }
        }
        between(1);
        uint32_t pf[G][4];
        if constexpr (kMath) {
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int e = 0; e < 8; ++e) sc[g][e / 4][e % 4] += sc_odd[g][e / 4][e % 4];
            if constexpr (kSoftmax) {
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
        between(2);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                uint32_t vf[4];
                if constexpr (WORK == kRegs) {
                    for (int i = 0; i < 4; ++i) vf[i] = qf[j][i] + round;
                } else {
                    fd_ldmatrix_x4_trans(vf, v_s + at<SRC>(key0 + 16 * g + ((lane / 8) % 2) * 8 + lane % 8,
                                                           2 * j + lane / 16));
                }
                if constexpr (WORK == kLd) {
                    bits ^= vf[0] ^ vf[1] ^ vf[2] ^ vf[3];
                } else {
                    fd_dtype<half>::mma(o[2 * j], pf[g], vf[0], vf[1]);
                    fd_dtype<half>::mma(o[2 * j + 1], pf[g], vf[2], vf[3]);
                }
            }
        }
        between(3);
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
    const long long k0 = clock64();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ uint64_t bars[STAGES];
    constexpr bool kTma = SRC == kBulk || SRC == kTensor;  // stages complete on mbarriers
    // The TMA's 128-byte swizzle repeats every 1024 bytes: stages start on one.
    half *smem = reinterpret_cast<half *>(SRC == kTensor ? smem_raw + (-fd_smem_addr(smem_raw) & 1023u) : smem_raw);
    constexpr int kW = SRC == kWide ? 2 : 1;  // 64-key tiles a tile
    constexpr int kTileKeys = kW * KEYS;
    constexpr int kStageElems = 2 * kTileKeys * (SRC == kBulk ? PAD : D);
    const unsigned long long t0 = gtime();
    const long long base = (first + (long long)blockIdx.x * tiles * kW) % tiles_total;
    const auto tile_src = [&](int j) {
        return src + tile_at(base, (long long)j * kW, tiles_total) * (2 * TILE_ELEMS);
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
            if constexpr (SRC == kCopy || SRC == kWide || SRC == kStill || SRC == kSpread2 || SRC == kSpread4) {
                // Thread t copies chunk t % 16 of keys t / 16, + THREADS / 16, ... of K and of V.
                const int chunk = threadIdx.x % 16;
#pragma unroll
                for (int key = threadIdx.x / 16; key < kTileKeys; key += THREADS / 16) {
                    fd_cp_async_16(dst + at<SRC>(key, chunk), from + key * D + chunk * 8, true);
                    fd_cp_async_16(dst + kW * TILE_ELEMS + at<SRC>(key, chunk),
                                   from + kW * TILE_ELEMS + key * D + chunk * 8, true);
                }
            } else if constexpr (SRC == kTensor) {
                if (threadIdx.x == 0) tensor_tile(dst, &map, (from - src) / (2 * TILE_ELEMS), &bars[stage]);
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
        if constexpr (SRC == kStill) {  // the loop's work alone: every tile is the first one
            fd_cp_async_wait<0>();
            __syncthreads();
            for (int it = 0; it < tiles; ++it) {
                __syncthreads();
                if constexpr (WORK != kNone) work.run(smem, smem + kStageElems / 2);
            }
        }
        long long phase[4] = {0, 0, 0, 0};  // clocks in the wait, the barrier, the copies' issue, the work
        for (int it = 0; it < (SRC == kStill ? 0 : tiles); ++it) {
            const int stage = it % STAGES;
            const long long c0 = clock64();
            if constexpr (!kTma) fd_cp_async_wait<STAGES - 2>();
            else mbar_wait(&bars[stage], (it / STAGES) & 1);
            const long long c1 = clock64();
            if (it == 0 && blockIdx.x == 0 && threadIdx.x == 0) g_phase[4] = c1 - k0;
            __syncthreads();  // tile `it` landed for all; tile it-1's stage is free
            const long long c2 = clock64();
            const int next = it + STAGES - 1;
            constexpr bool kSpread = SRC == kSpread2 || SRC == kSpread4;
            if (!kSpread && next < tiles) load(next, next % STAGES);
            if constexpr (!kTma && !kSpread) fd_cp_async_commit();
            const long long c3 = clock64();
            if constexpr (kSpread) {
                // The next tile's copies in parts between the steps of this tile's work.
                const half *k_s = smem + stage * kStageElems;
                half *dst = smem + (next % STAGES) * kStageElems;
                const half *from = next < tiles ? tile_src(next) : nullptr;
                const int chunk = threadIdx.x % 16;
                work.run(k_s, k_s + kStageElems / 2, [&](int point) {
                    constexpr int kParts = SRC == kSpread4 ? 4 : 2;
                    const int part = kParts == 4 ? point : point - 1;  // sprd2: after Q K^T, after the softmax
                    if (from == nullptr || part < 0 || part >= kParts) return;
#pragma unroll
                    for (int i = 0; i < 8 / kParts; ++i) {
                        const int key = threadIdx.x / 16 + (part * (8 / kParts) + i) * (THREADS / 16);
                        fd_cp_async_16(dst + at<SRC>(key, chunk), from + key * D + chunk * 8, true);
                        fd_cp_async_16(dst + TILE_ELEMS + at<SRC>(key, chunk), from + TILE_ELEMS + key * D + chunk * 8,
                                       true);
                    }
                });
                fd_cp_async_commit();
            } else if constexpr (WORK != kNone) {
                const half *k_s = smem + stage * kStageElems;
                work.run(k_s, k_s + kStageElems / 2);
            }
            const long long c4 = clock64();
            phase[0] += c1 - c0, phase[1] += c2 - c1, phase[2] += c3 - c2, phase[3] += c4 - c3;
        }
        if (blockIdx.x == 0 && threadIdx.x == 0)
            for (int i = 0; i < 4; ++i) g_phase[i] = phase[i];
    }
    stamp(t0, stamps);
    const float r = work.result() + ldg_acc;
    if (r == 1.2345f) sink[threadIdx.x] = r;  // keeps the work; never true for zero data
}

// ---------------------------------------------------------------------------
// A producer warp. In the loop above a tile's copies cost the block about
// 450 clocks to issue (2048 cp.async through the LSU, or the issuing thread
// held by its four tensor copies), on the path of every tile: a lone block
// pays them on top of its work. Here a fifth warp only issues the copies
// (ptens: tensor copies from one lane; pcopy: cp.async from all 32 lanes,
// each lane's completion counted on the stage's mbarrier), and the four
// compute warps run the same tile work, each warp releasing a stage on its
// own (no block barrier a tile): the copies' issue leaves their path.
__device__ __forceinline__ void mbar_init_count(uint64_t *bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(fd_smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(fd_smem_addr(bar)) : "memory");
}
// An arrival on bar once this thread's cp.async copies so far have landed.
__device__ __forceinline__ void cp_async_arrive(uint64_t *bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(fd_smem_addr(bar)) : "memory");
}

template <int SRC, int WORK, int STAGES>
__global__ void __launch_bounds__(160) stream_prod(const half *src, long long tiles_total, long long first, int tiles,
                                                   int only_sm, unsigned long long *stamps, float *sink,
                                                   const __grid_constant__ CUtensorMap map) {
    if (only_sm >= 0 && smid() != (unsigned)only_sm) return;
    const long long k0 = clock64();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ uint64_t full[STAGES], empty[STAGES];
    half *smem = reinterpret_cast<half *>(smem_raw + (-fd_smem_addr(smem_raw) & 1023u));
    constexpr int kStageElems = 2 * TILE_ELEMS;
    const unsigned long long t0 = gtime();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init_count(&full[s], SRC == kProdTensor ? 1 : 32);
            mbar_init_count(&empty[s], 4);  // one arrival a compute warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const long long base = (first + (long long)blockIdx.x * tiles) % tiles_total;
    if (warp == 4) {  // the producer
        for (int j = 0; j < tiles; ++j) {
            const int stage = j % STAGES;
            if (j >= STAGES) mbar_wait(&empty[stage], (j / STAGES - 1) & 1);
            half *dst = smem + stage * kStageElems;
            const long long tile = tile_at(base, j, tiles_total);
            if constexpr (SRC == kProdTensor) {
                if (lane == 0) tensor_tile(dst, &map, tile, &full[stage]);
            } else {
                const half *from = src + tile * (2 * TILE_ELEMS);
                const int chunk = lane % 16;
#pragma unroll 8
                for (int key = lane / 16; key < KEYS; key += 2) {
                    fd_cp_async_16(dst + at<SRC>(key, chunk), from + key * D + chunk * 8, true);
                    fd_cp_async_16(dst + TILE_ELEMS + at<SRC>(key, chunk), from + TILE_ELEMS + key * D + chunk * 8, true);
                }
                cp_async_arrive(&full[stage]);
            }
        }
        if constexpr (SRC != kProdTensor) fd_cp_async_wait<0>();
        return;
    }
    TileWork<SRC, WORK, 1> work;
    work.init();
    for (int it = 0; it < tiles; ++it) {
        const int stage = it % STAGES;
        mbar_wait(&full[stage], (it / STAGES) & 1);
        if (it == 0 && blockIdx.x == 0 && threadIdx.x == 0) g_phase[4] = clock64() - k0;
        if constexpr (WORK != kNone) {
            const half *k_s = smem + stage * kStageElems;
            work.run(k_s, k_s + TILE_ELEMS);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[stage]);
    }
    stamp(t0, stamps);
    const float r = work.result();
    if (r == 1.2345f) sink[threadIdx.x] = r;  // keeps the work; never true for zero data
}

#include "b1.cuh"     // batch 1's cluster plan end to end: b1_cluster
#include "wgmma.cuh"  // the loop on wgmma: stream_wg, stream_wgx

// How long a block's first tile takes to land once its copies are issued,
// the block having started 4000 clocks before (about the time a stage-1
// block spends before its first copies: its setup and the PDL wait). SRC
// copy or tensor; PREFETCH: the tensor map's fetch (prefetch.tensormap)
// issued at the block's start. Each block writes its issue-to-landed
// clocks to lat[blockIdx.x].
template <int SRC, bool PREFETCH>
__global__ void __launch_bounds__(128) first_tile(const half *src, long long tiles_total, long long first,
                                                  long long *lat, const __grid_constant__ CUtensorMap map) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ uint64_t bar;
    half *smem = reinterpret_cast<half *>(smem_raw + (-fd_smem_addr(smem_raw) & 1023u));
    const long long k0 = clock64();
    if (PREFETCH && threadIdx.x == 0)
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
    if (threadIdx.x == 0) {
        mbar_init(&bar);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    while (clock64() - k0 < 4000) {
    }
    const long long tile = (first + blockIdx.x) % tiles_total;
    const long long c0 = clock64();
    if constexpr (SRC == kTensor) {
        if (threadIdx.x == 0) tensor_tile(smem, &map, tile, &bar);
        mbar_wait(&bar, 0);
    } else {
        const half *from = src + tile * (2 * TILE_ELEMS);
        const int chunk = threadIdx.x % 16;
#pragma unroll
        for (int key = threadIdx.x / 16; key < KEYS; key += 8) {
            fd_cp_async_16(smem + at<kCopy>(key, chunk), from + key * D + chunk * 8, true);
            fd_cp_async_16(smem + TILE_ELEMS + at<kCopy>(key, chunk), from + TILE_ELEMS + key * D + chunk * 8, true);
        }
        fd_cp_async_commit();
        fd_cp_async_wait<0>();
    }
    __syncthreads();
    if (threadIdx.x == 0) lat[blockIdx.x] = clock64() - c0;
}

struct Config {
    const char *blocks;  // lone, pair, full1, full2, half1, half4, of96
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

template <int SRC, int WORK, int STAGES>
Config make_prod(const char *blocks) {
    return Config{blocks, SRC, WORK, STAGES, 160, stream_prod<SRC, WORK, STAGES>, STAGES * TILE_BYTES + 1024};
}

// The wgmma loop (source tensor, work wg or wgah).
template <int STAGES, bool AHEAD>
Config make_wg(const char *blocks) {
    return Config{blocks, kTensor, AHEAD ? kWgAhead : kWg, STAGES, 128, stream_wg<STAGES, AHEAD>,
                  STAGES * TILE_BYTES + 16 * D * 2 + 1024};
}

template <int STAGES, int PART = 0>
Config make_wgx(const char *blocks) {
    return Config{blocks, kTensor, kWgx + PART, STAGES, 128, stream_wgx<STAGES, PART>, STAGES * TILE_BYTES + 16 * D * 2 + 2048 + 1024};
}

#include "wgmma_check.cuh"  // check_wg: the wgmma loops against the host

int main(int argc, char **argv) {
    const char *only = argc > 1 ? argv[1] : nullptr;
    if (const char *spin = getenv("SPIN")) {
        const long long clocks = atoll(spin);
        CK(cudaMemcpyToSymbol(g_spin, &clocks, sizeof clocks));
    }
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

    if (only && !strcmp(only, "b1")) {  // batch 1 in clusters of 8, µs a call in a CUDA graph
        half *out;
        CK(cudaMalloc(&out, kB1Heads * 16 * D * sizeof(half)));
        cudaStream_t stream;
        CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        const struct {
            const char *name;
            void (*kernel)(half *, int, const CUtensorMap);
            int stages;
        } kinds[] = {{"3 stages", b1_cluster<3>, 3}, {"4 stages", b1_cluster<4>, 4}};
        for (int keys : {32768, 131072}) {
            for (const auto &k : kinds) {
                const int smem = k.stages * TILE_BYTES + 1024;
                CK(cudaFuncSetAttribute(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                constexpr int kCalls = 20;
                cudaGraph_t graph;
                cudaGraphExec_t exec;
                CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
                for (int i = 0; i < kCalls; ++i)
                    k.kernel<<<dim3(kB1Splits, kB1Heads), 160, smem, stream>>>(out, keys / KEYS, map);
                CK(cudaStreamEndCapture(stream, &graph));
                CK(cudaGraphInstantiate(&exec, graph, 0));
                std::vector<float> per_call = time_graph(exec, stream, 6);
                per_call.erase(per_call.begin());  // warm-up
                for (float &t : per_call) t *= 1e3f / kCalls;
                std::sort(per_call.begin(), per_call.end());
                const double bytes = double(kB1Heads) * keys * TILE_BYTES / KEYS;
                printf("b1 %6d keys, 8 heads, clusters of 8, %s: %.1f us a call (median of 5 graphs of %d), %.2f TB/s\n",
                       keys, k.name, per_call[per_call.size() / 2], kCalls, bytes / per_call[per_call.size() / 2] / 1e6);
                CK(cudaGraphExecDestroy(exec));
                CK(cudaGraphDestroy(graph));
            }
        }
        return 0;
    }
    if (only && !strcmp(only, "first")) {  // first tiles: issue to landed, clocks (median over blocks)
        long long *lat;
        CK(cudaMalloc(&lat, 1024 * sizeof(long long)));
        const struct {
            const char *name;
            void (*kernel)(const half *, long long, long long, long long *, const CUtensorMap);
        } kinds[] = {{"cp.async", first_tile<kCopy, false>},
                     {"tensor", first_tile<kTensor, false>},
                     {"tensor, map prefetched", first_tile<kTensor, true>}};
        long long rotate = 0;
        for (int grid : {1, 64, 132}) {
            for (const auto &k : kinds) {
                CK(cudaFuncSetAttribute(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
                std::vector<long long> all;
                for (int rep = 0; rep < 6; ++rep) {
                    k.kernel<<<grid, 128, 120 * 1024>>>(src, tiles_total, rotate, lat, map);
                    rotate = (rotate + 4096) % tiles_total;
                    CK(cudaDeviceSynchronize());
                    std::vector<long long> h(grid);
                    CK(cudaMemcpy(h.data(), lat, grid * sizeof(long long), cudaMemcpyDeviceToHost));
                    if (rep > 0) all.insert(all.end(), h.begin(), h.end());
                }
                std::sort(all.begin(), all.end());
                printf("first tile, %3d blocks, %-22s: %lld clocks (median), %lld-%lld\n", grid, k.name,
                       all[all.size() / 2], all.front(), all.back());
            }
        }
        return 0;
    }
    if (only && !strcmp(only, "check")) {
        for (int tiles : {1, 5, 8}) {
            check_wg<3, false>(src, tiles, tiles_total, stamps, sink, map);
            check_wg<3, true>(src, tiles, tiles_total, stamps, sink, map);
            check_wg<4, true>(src, tiles, tiles_total, stamps, sink, map);
            check_wg<3, false, true>(src, tiles, tiles_total, stamps, sink, map);
            check_wg<4, false, true>(src, tiles, tiles_total, stamps, sink, map);
        }
        CK(cudaMemset(src, 0, buffer_bytes));
        return 0;
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
        // The tile loop on wgmma.
        make_wg<3, false>("lone"), make_wg<4, false>("lone"), make_wg<3, true>("lone"), make_wg<4, true>("lone"),
        make_wg<5, true>("lone"), make_wg<3, true>("pair"), make_wg<3, false>("full1"), make_wg<3, true>("full1"),
        make_wg<3, true>("full2"), make_wg<4, true>("full1"),
        make_wgx<3>("lone"), make_wgx<4>("lone"), make_wgx<5>("lone"), make_wgx<3>("pair"), make_wgx<3>("full1"),
        make_wgx<3>("full2"), make_wgx<4>("full1"),
        make_wgx<3, 1>("lone"), make_wgx<3, 2>("lone"), make_wgx<3, 3>("lone"),
        // Does the tile loop's work overlap the copies? The loop without its
        // shared-memory reads, and a spin of g_spin clocks a tile.
        make<kCopy, kRegs, 3, 128>("lone"), make<kCopy, kRegs, 5, 128>("lone"), make<kStill, kRegs, 3, 128>("lone"),
        make<kCopy, kSpin, 3, 128>("lone"), make<kCopy, kSpin, 5, 128>("lone"), make<kStill, kSpin, 3, 128>("lone"),
        make<kTensor, kSpin, 3, 128>("lone"), make<kTensor, kSpin, 5, 128>("lone"),
        // A producer warp issuing the copies.
        make_prod<kProdTensor, kNone, 2>("lone"), make_prod<kProdTensor, kNone, 3>("lone"),
        make_prod<kProdTensor, kNone, 6>("lone"), make_prod<kProdTensor, kSoft, 2>("lone"),
        make_prod<kProdTensor, kSoft, 3>("lone"), make_prod<kProdTensor, kSoft, 4>("lone"),
        make_prod<kProdTensor, kSoft, 6>("lone"), make_prod<kProdTensor, kSpin, 3>("lone"),
        make_prod<kProdTensor, kSoft, 3>("pair"), make_prod<kProdTensor, kSoft, 3>("full1"),
        make_prod<kProdTensor, kSoft, 3>("full2"),
        make_prod<kProdTensor, kSoft, 3>("half1"), make_prod<kProdTensor, kSoft, 4>("half1"),
        make_prod<kProdTensor, kSoft, 3>("half4"), make_prod<kProdTensor, kSoft, 4>("half4"),
        make<kCopy, kSoft, 3, 128>("half1"), make<kCopy, kSoft, 3, 128>("half4"),
        make<kTensor, kSoft, 3, 128>("half1"), make<kTensor, kSoft, 3, 128>("half4"),
        make<kCopy, kSoft, 3, 128>("of96"), make<kTensor, kSoft, 3, 128>("of96"),
        make_prod<kProdTensor, kSoft, 3>("of96"), make_prod<kProdTensor, kSoft, 4>("of96"),
        make_prod<kProdCopy, kNone, 3>("lone"), make_prod<kProdCopy, kNone, 6>("lone"),
        make_prod<kProdCopy, kSoft, 3>("lone"), make_prod<kProdCopy, kSoft, 4>("lone"),
        make_prod<kProdCopy, kSoft, 6>("lone"), make_prod<kProdCopy, kSpin, 3>("lone"),
        make_prod<kProdCopy, kSoft, 3>("pair"), make_prod<kProdCopy, kSoft, 3>("full1"),
        make_prod<kProdCopy, kSoft, 3>("full2"),
        // The next tile's copies spread over this tile's work, in 2 or 4 parts.
        make<kSpread2, kSoft, 3, 128>("lone"), make<kSpread4, kSoft, 3, 128>("lone"),
        make<kSpread2, kSoft, 4, 128>("lone"), make<kSpread4, kSoft, 4, 128>("lone"),
        make<kSpread4, kSoft, 3, 128>("pair"), make<kSpread4, kSoft, 3, 128>("half1"),
        make<kSpread4, kSoft, 3, 128>("full2"),
        // The mma.sync loop's work alone, on the first tile over and over.
        make<kStill, kLd, 3, 128>("lone"), make<kStill, kMma, 3, 128>("lone"), make<kStill, kSoft, 3, 128>("lone"),
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
        const int smem = blocks == "full1" || blocks[0] == 'h' || blocks[0] == 'o' ? std::max(c.smem, 120 * 1024) : c.smem;
        if (smem > 48 * 1024)
            CK(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        const int w = c.src == kWide ? 2 : 1;  // the kernel counts 128-key tiles, this program 64-key ones
        int grid = 1, tiles = 2048, only_sm = -1;
        if (blocks == "pair") grid = 2 * sms, only_sm = 0;
        if (blocks == "full1") grid = sms, tiles = 64;
        if (blocks == "full2") grid = 2 * sms, tiles = 64;
        if (blocks == "half1") grid = 64, tiles = 64;  // b=1, 8 K/V heads, 32768 keys in 8 splits
        if (blocks == "half4") grid = 64, tiles = 256;  // 131072 keys
        if (blocks == "of96") grid = 96, tiles = 64;    // 48/48 heads, b=1, 8192 keys in 2 splits
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
        if (getenv("PHASES")) {
            long long ph[5];
            CK(cudaMemcpyFromSymbol(ph, g_phase, sizeof ph));
            printf("  clocks a tile: wait %.0f, barrier %.0f, issue %.0f, work %.0f; first tile landed %lld clocks in\n",
                   ph[0] / double(tiles / w), ph[1] / double(tiles / w), ph[2] / double(tiles / w),
                   ph[3] / double(tiles / w), ph[4]);
            const long long zero[5] = {0, 0, 0, 0, 0};
            CK(cudaMemcpyToSymbol(g_phase, zero, sizeof zero));
        }
        printf("%-6s %-5s %-5s %6d %7d %7d %12.2f %9.1f\n", c.blocks, kSourceName[c.src], kWorkName[c.work], c.stages,
               c.threads, working, rates[rates.size() / 2], gbs);
    }
    return 0;
}
