// wgmma_check.cuh: check_wg, which runs a wgmma loop of wgmma.cuh on random
// data and compares it with a softmax computed on the host (dev/stream).
#ifndef FLASHDECODE_DEV_STREAM_WGMMA_CHECK_CUH
#define FLASHDECODE_DEV_STREAM_WGMMA_CHECK_CUH

// Runs the wgmma loop on one block over `tiles` tiles of random K and V and
// a random Q, merges its warps' states and prints the largest error against
// the softmax computed here (scores taken as base-2 logits, as the loop does).
// X: the unpadded loop (stream_wgx) instead of stream_wg.
template <int STAGES, bool AHEAD, bool X = false>
void check_wg(half *src, int tiles, long long tiles_total, unsigned long long *stamps, float *sink,
              const CUtensorMap &map) {
    std::vector<half> kv((size_t)tiles * 2 * TILE_ELEMS), q(16 * D);
    std::vector<float> kvf(kv.size()), qf(q.size());
    srand(1234 + tiles);
    for (size_t i = 0; i < kv.size(); ++i) kv[i] = __float2half(rand() / (float)RAND_MAX * 2.f - 1.f), kvf[i] = __half2float(kv[i]);
    for (size_t i = 0; i < q.size(); ++i) q[i] = __float2half(rand() / (float)RAND_MAX - 0.5f), qf[i] = __half2float(q[i]);
    CK(cudaMemcpy(src, kv.data(), kv.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpyToSymbol(g_q, q.data(), q.size() * 2));
    const int one = 1, zero = 0;
    CK(cudaMemcpyToSymbol(g_check, &one, sizeof one));
    const int smem = STAGES * TILE_BYTES + 16 * D * 2 + 2048 + 1024;
    auto kernel = X ? stream_wgx<STAGES, 0> : stream_wg<STAGES, AHEAD>;
    {
        std::vector<float> zeros(4 * 16 * (2 + D), 0.f);
        for (int w = 1; w < 4; ++w)
            for (int r = 0; r < 16; ++r) zeros[(w * 16 + r) * (2 + D)] = -1e30f;  // X: slots 1-3 weigh nothing
        CK(cudaMemcpyToSymbol(g_dump, zeros.data(), zeros.size() * 4));
    }
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<1, 128, smem>>>(src, tiles_total, 0, tiles, -1, stamps, sink, map);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpyToSymbol(g_check, &zero, sizeof zero));
    std::vector<float> dump(4 * 16 * (2 + D));
    CK(cudaMemcpyFromSymbol(dump.data(), g_dump, dump.size() * 4));
    double worst = 0;
    for (int r = 0; r < 16; ++r) {
        const int keys = tiles * KEYS;
        std::vector<double> sc(keys);
        double mx = -1e300;
        for (int j = 0; j < keys; ++j) {
            const float *k = &kvf[((size_t)(j / KEYS) * 2 * KEYS + j % KEYS) * D];
            double x = 0;
            for (int d = 0; d < D; ++d) x += qf[r * D + d] * k[d];
            sc[j] = x;
            mx = std::max(mx, x);
        }
        std::vector<double> ref(D, 0.0);
        double sum = 0;
        for (int j = 0; j < keys; ++j) {
            const double p = exp2(sc[j] - mx);
            sum += p;
            const float *v = &kvf[((size_t)(j / KEYS) * 2 * KEYS + KEYS + j % KEYS) * D];
            for (int d = 0; d < D; ++d) ref[d] += p * v[d];
        }
        double big = -1e300;
        for (int w = 0; w < 4; ++w) big = std::max(big, (double)dump[(w * 16 + r) * (2 + D)]);
        double l = 0;
        for (int w = 0; w < 4; ++w) l += dump[(w * 16 + r) * (2 + D) + 1] * exp2(dump[(w * 16 + r) * (2 + D)] - big);
        for (int d = 0; d < D; ++d) {
            double x = 0;
            for (int w = 0; w < 4; ++w)
                x += dump[(w * 16 + r) * (2 + D) + 2 + d] * exp2(dump[(w * 16 + r) * (2 + D)] - big);
            worst = std::max(worst, std::fabs(x / l - ref[d] / sum));
        }
    }
    printf("check %s, %d stages%s, %d tiles: max |error| %.2e (%s)\n", X ? "wgx" : "wg", STAGES, AHEAD ? ", ahead" : "",
           tiles, worst, worst < 1e-2 ? "ok" : "WRONG");
}

#endif  // FLASHDECODE_DEV_STREAM_WGMMA_CHECK_CUH
