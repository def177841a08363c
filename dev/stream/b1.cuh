// b1.cuh: batch 1's cluster plan end to end with a producer warp, for
// dev/stream/stream.cu (which includes it after stream_prod; a developer
// tool, not the library): 8 K/V heads of 16 rows at head dim 128, each
// head's tiles split 8 ways, round robin as stage 1 deals them, in clusters
// of 8 blocks that merge their splits through distributed shared memory.
// The tile work is TileWork's (no masking, zero data); `./stream b1` times it
// per call against what stage 1 plus the combine take in dev/trace. It reads
// the same bytes every call, where the library's benchmark rotates its caches
// past L2; stage 1 built this way ran slower (docs/tuning.md, "Tried and not
// kept").
#ifndef FLASHDECODE_DEV_STREAM_B1_CUH
#define FLASHDECODE_DEV_STREAM_B1_CUH

#include "../../kernels/state.cuh"

constexpr int kB1Splits = 8, kB1Heads = 8;

template <int STAGES>
__global__ void __cluster_dims__(kB1Splits, 1, 1) __launch_bounds__(160)
    b1_cluster(half *out, int tiles_per_head, const __grid_constant__ CUtensorMap map) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ uint64_t full[STAGES], empty[STAGES];
    half *smem = reinterpret_cast<half *>(smem_raw + (-fd_smem_addr(smem_raw) & 1023u));
    constexpr int kStageElems = 2 * TILE_ELEMS;
    const int split = blockIdx.x, head = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init_count(&full[s], 1);
            mbar_init_count(&empty[s], 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int tiles = tiles_per_head / kB1Splits;
    TileWork<kProdTensor, kSoft, 1> work;
    work.init();
    if (warp == 4) {  // the producer: this split's tiles of the head, split + 8 j
        if (lane == 0) {
            for (int j = 0; j < tiles; ++j) {
                const int stage = j % STAGES;
                if (j >= STAGES) mbar_wait(&empty[stage], (j / STAGES - 1) & 1);
                tensor_tile(smem + stage * kStageElems, &map, (long long)head * tiles_per_head + split + kB1Splits * j,
                            &full[stage]);
            }
        }
    } else {
        for (int it = 0; it < tiles; ++it) {
            const int stage = it % STAGES;
            mbar_wait(&full[stage], (it / STAGES) & 1);
            const half *k_s = smem + stage * kStageElems;
            work.run(k_s, k_s + TILE_ELEMS);
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[stage]);
        }
    }
    __syncthreads();  // every tile consumed: the stages are the merge's scratch

    // The four warps' states and outputs, then the block's 16 rows merged.
    constexpr int kStride = D + 8;
    float *so = reinterpret_cast<float *>(smem);  // [warp][row][kStride]
    float *sm = so + 4 * 16 * kStride, *sl = sm + 4 * 16;
    float *park_o = sl + 4 * 16, *park_lse = park_o + 16 * D;  // [row][D], [row]
    if (warp < 4) {
        const int g = lane / 4, t4 = lane % 4;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = work.l[h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int row = warp * 16 + g + 8 * h;
#pragma unroll
            for (int n = 0; n < 16; ++n)
                *reinterpret_cast<float2 *>(so + row * kStride + 8 * n + 2 * t4) =
                    make_float2(work.o[n][2 * h], work.o[n][2 * h + 1]);
            if (t4 == 0) sm[row] = work.m[h], sl[row] = sum;
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < 16 * (D / 4); idx += 160) {
        const int row = idx / (D / 4), d = (idx % (D / 4)) * 4;
        fd_state st = fd_state_empty();
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            float sa, sb;
            fd_state_merge(st, fd_state{sm[w * 16 + row], sl[w * 16 + row]}, sa, sb);
            acc = fd_axpby4(acc, sa, *reinterpret_cast<const float4 *>(so + (w * 16 + row) * kStride + d), sb);
        }
        *reinterpret_cast<float4 *>(park_o + row * D + d) = fd_scale4(acc, fd_state_norm(st));
        if (d == 0) park_lse[row] = fd_state_lse2(st);
    }

    // Block `rank` merges rows 2 rank, 2 rank + 1 of the cluster's 8 splits.
    fd_cluster_sync();
    const int rank = fd_cluster_rank();
    for (int idx = threadIdx.x; idx < 2 * (D / 4); idx += 160) {
        const int row = 2 * rank + idx / (D / 4), d = (idx % (D / 4)) * 4;
        fd_state st = fd_state_empty();
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int s = 0; s < kB1Splits; ++s) {
            float sa, sb;
            fd_state_merge(st, fd_state{fd_cluster_ld(fd_cluster_addr(park_lse + row, s)), 1.f}, sa, sb);
            acc = fd_axpby4(acc, sa, fd_cluster_ld4(fd_cluster_addr(park_o + row * D + d, s)), sb);
        }
        fd_store4(out + ((long long)head * 16 + row) * D + d, fd_scale4(acc, fd_state_norm(st)));
    }
    fd_cluster_sync();  // no block leaves while another reads its rows
}

#endif  // FLASHDECODE_DEV_STREAM_B1_CUH
