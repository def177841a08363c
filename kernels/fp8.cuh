// fp8.cuh: fp8 caches (float8_e4m3fn or float8_e5m2 beside fp16 / bf16 q):
// reading their bytes as T's mma operands (fd_fp8_cvt), writing new tokens
// into them (fd_quantize8) and their descales (fd_descale).
#ifndef FLASHDECODE_FP8_CUH
#define FLASHDECODE_FP8_CUH

#include <cuda_fp8.h>

#include "params.h"
#include "ptx.cuh"

// fp8 caches (float8_e4m3fn or float8_e5m2, the format a run-time field:
// fd_params.kv_e5m2) read into T's mma operands by bit moves, on every
// architecture. Four fp8 bytes x = [x0 x1 x2 x3] become two T x2 registers,
// even(x) = (x0, x2) and odd(x) = (x1, x3): each byte's sign to the top of
// its half, its other 7 bits shifted under it (T's exponent field then holds
// the fp8 exponent, subnormals included). For half that is the value times
// 2^-8 (e4m3) or the value (e5m2): the factor (fold) goes into the fp32
// scales of the scores and the output. For bf16 it is the value times
// 2^-120 (e4m3) or 2^-112 (e5m2), too small for fp32 products, so the
// registers are multiplied back in bf16 (exact).
template <typename T>
struct fd_fp8_cvt;

template <>
struct fd_fp8_cvt<half> {
    int shift;      // 1 e4m3, 0 e5m2
    uint32_t mask;  // the 7 bits' place in each half
    float fold;     // what the fp32 scales multiply by (2^8 e4m3)
    __device__ __forceinline__ explicit fd_fp8_cvt(bool e5m2)
        : shift(e5m2 ? 0 : 1), mask(e5m2 ? 0x7f007f00u : 0x3f803f80u), fold(e5m2 ? 1.f : 256.f) {}
    __device__ __forceinline__ uint32_t odd(uint32_t x) const { return (x & 0x80008000u) | ((x >> shift) & mask); }
    __device__ __forceinline__ uint32_t even(uint32_t x) const {
        return ((x << 8) & 0x80008000u) | ((x << (8 - shift)) & mask);
    }
};

template <>
struct fd_fp8_cvt<__nv_bfloat16> {
    int shift;      // 4 e4m3, 3 e5m2
    uint32_t mask;
    uint32_t mul;   // bf16x2 2^120 (e4m3) or 2^112 (e5m2)
    float fold = 1.f;
    __device__ __forceinline__ explicit fd_fp8_cvt(bool e5m2)
        : shift(e5m2 ? 3 : 4), mask(e5m2 ? 0x0fe00fe0u : 0x07f007f0u), mul(e5m2 ? 0x77807780u : 0x7b807b80u) {}
    __device__ __forceinline__ uint32_t scaled(uint32_t x) const {
        __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162 *>(&x), *reinterpret_cast<const __nv_bfloat162 *>(&mul));
        return *reinterpret_cast<uint32_t *>(&r);
    }
    __device__ __forceinline__ uint32_t odd(uint32_t x) const { return scaled((x & 0x80008000u) | ((x >> shift) & mask)); }
    __device__ __forceinline__ uint32_t even(uint32_t x) const {
        return scaled(((x << 8) & 0x80008000u) | ((x << (8 - shift)) & mask));
    }
};

// x as an fp8 code by bit moves (before sm_89, which has no conversion
// instruction and whose library emulation takes some hundred instructions
// a pair): saturated to the largest finite value, then rounded to nearest
// even, below the smallest normal as a multiple of the smallest subnormal,
// above it by rounding the float's mantissa to the fp8's and rebiasing its
// exponent (a carry moves to the next exponent). NaN stays NaN.
__device__ __forceinline__ uint32_t fd_to_fp8(float x, bool e5m2) {
    const uint32_t sign = (__float_as_uint(x) >> 24) & 0x80u;
    if (x != x) return sign | 0x7fu;
    const float a = fminf(fabsf(x), e5m2 ? 57344.f : 448.f);
    const uint32_t sub = __float2uint_rn(a * (e5m2 ? 0x1p16f : 0x1p9f));
    const int shift = e5m2 ? 21 : 20;  // the float mantissa bits the fp8 one drops
    uint32_t bits = __float_as_uint(a);
    bits += (1u << (shift - 1)) - 1u + ((bits >> shift) & 1u);
    const uint32_t normal = (bits >> shift) - (e5m2 ? (127u - 15u) << 2 : (127u - 7u) << 3);
    return sign | (a < (e5m2 ? 0x1p-14f : 0x1p-6f) ? sub : normal);
}

// Two floats to fp8 as torch's .to(float8_*) rounds them: saturated to the
// largest finite value, rounded to nearest even; lo in the low byte.
__device__ __forceinline__ uint32_t fd_to_fp8x2(float lo, float hi, bool e5m2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
#else
    return fd_to_fp8(lo, e5m2) | fd_to_fp8(hi, e5m2) << 8;
#endif
}

// x / d rounded to nearest even, as IEEE division rounds it, without the
// division's slow-path call (whose registers stage 1 at 32 rows lacks): r
// = 1 / d rounded, the product x * r corrected by its exact residual
// (Markstein's theorem), for a finite d > 0; an overflowing quotient stays
// infinite, to saturate.
__device__ __forceinline__ float fd_div(float x, float d, float r) {
    const float q = __fmul_rn(x, r);
    if (isinf(q)) return q;
    return __fmaf_rn(__fmaf_rn(-q, d, x), r, q);
}

// A descale and its reciprocal, for fd_div.
struct fd_quant {
    float descale, rcp;
    __device__ __forceinline__ explicit fd_quant(float d) : descale(d), rcp(1.f / d) {}
};

// Eight T (one 16-byte chunk) divided by the descale and stored as eight
// fp8 bytes (fd_to_fp8x2), element 0 in the low byte.
template <typename T>
__device__ __forceinline__ uint2 fd_quantize8(uint4 u, const fd_quant &d, bool e5m2) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    uint32_t q[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float lo, hi;
        fd_dtype<T>::unpack(w[j], lo, hi);
        q[j] = fd_to_fp8x2(fd_div(lo, d.descale, d.rcp), fd_div(hi, d.descale, d.rcp), e5m2);
    }
    return make_uint2(q[0] | q[1] << 16, q[2] | q[3] << 16);
}

// Eight elements from src quantized (fd_quantize8), or zeros where !in.
template <typename T>
__device__ __forceinline__ uint2 fd_quantize_half(const T *src, bool in, const fd_quant &descale, bool e5m2) {
    return in ? fd_quantize8<T>(*reinterpret_cast<const uint4 *>(src), descale, e5m2) : make_uint2(0u, 0u);
}

// Stage 1's fp8 output accumulators, whose P V mmas gathered a 16-dim
// slice's even dims in o[.][2s] and its odd ones in o[.][2s + 1] (lane t4:
// dims 16s + 4t4 .. + 3 of its rows), back to the mma layout the fp16
// variants have (o[.][n]: dims 8n + 2t4, +1) by shuffles within each quad
// of lanes, and multiplied by mul (the V descale and the conversion's
// factor): once a block, after its key loop.
template <int MTILES, int NTILES>
__device__ __forceinline__ void fd_fp8_o_in_place(float (&o)[MTILES][NTILES][4], float mul, int t4) {
    const int lane = threadIdx.x % 32;
    const int src_lo = (lane & ~3) | (t4 >> 1), src_hi = src_lo + 2;  // the lanes holding dims 2t4.. and 8 + 2t4..
    const bool odd_lane = t4 & 1;
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
        for (int s = 0; s < NTILES / 2; ++s)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // The lane's dims 16s + 4t4 + i, i = 0..3, of row g (+8 h).
                const float x[4] = {o[mt][2 * s][2 * h], o[mt][2 * s + 1][2 * h], o[mt][2 * s][2 * h + 1],
                                    o[mt][2 * s + 1][2 * h + 1]};
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float lo0 = __shfl_sync(0xffffffffu, x[e], src_lo);
                    const float lo1 = __shfl_sync(0xffffffffu, x[2 + e], src_lo);
                    const float hi0 = __shfl_sync(0xffffffffu, x[e], src_hi);
                    const float hi1 = __shfl_sync(0xffffffffu, x[2 + e], src_hi);
                    o[mt][2 * s][2 * h + e] = (odd_lane ? lo1 : lo0) * mul;
                    o[mt][2 * s + 1][2 * h + e] = (odd_lane ? hi1 : hi0) * mul;
                }
            }
}

// A sequence's K/V head's descale: ptr[b * batch_stride + kv_head *
// head_stride] where ptr is set, else value (0 taken as 1). Read after the
// PDL wait: the kernel before may have written it.
__device__ __forceinline__ float fd_descale(fd_devptr ptr, long long batch_stride, long long head_stride, float value,
                                            int b, int kv_head) {
    return ptr ? fd_ptr<const float>(ptr)[b * batch_stride + kv_head * head_stride] : value == 0.f ? 1.f : value;
}

#endif  // FLASHDECODE_FP8_CUH
