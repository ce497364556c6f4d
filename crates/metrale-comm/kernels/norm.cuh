// norm.cuh: the residual add + RMSNorm's device code, shared by the
// separate kernel (add_rms_norm.cu) and the fused one-shot entries
// (one_shot.cu). The arithmetic is crates/kernel-abi/src/norm.rs's `row`,
// step for step: every f32 operation an explicit round-to-nearest
// intrinsic (__fadd_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn), so nvcc
// contracts nothing into an FMA and the host computes the same bits.
//
// A row of `hidden` values splits into 16-byte chunks (chunk j: elements
// j * PER .. j * PER + PER - 1 of the row); thread t of the block's
// blockDim.x (= norm_threads(hidden), a multiple of 32) takes chunks t,
// t + blockDim.x, ..., and every thread of the block calls the block-wide
// steps (norm_block_sum) the same number of times.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "abi.h"

struct NormBf16 {
    typedef unsigned short Bits;
    static constexpr int PER = 8;
    static __device__ __forceinline__ float f(unsigned int b) { return __uint_as_float(b << 16); }
    static __device__ __forceinline__ unsigned int r(float x)
    {
        return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
    // `lo` and `hi` rounded, packed: lo in the low 16 bits.
    static __device__ __forceinline__ unsigned int r2(float lo, float hi)
    {
        const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return (unsigned int)__bfloat16_as_ushort(v.x) |
               ((unsigned int)__bfloat16_as_ushort(v.y) << 16);
    }
};

struct NormF16 {
    typedef unsigned short Bits;
    static constexpr int PER = 8;
    static __device__ __forceinline__ float f(unsigned int b)
    {
        return __half2float(__ushort_as_half((unsigned short)b));
    }
    static __device__ __forceinline__ unsigned int r(float x)
    {
        return __half_as_ushort(__float2half_rn(x));
    }
    // `lo` and `hi` rounded, packed: lo in the low 16 bits.
    static __device__ __forceinline__ unsigned int r2(float lo, float hi)
    {
        const __half2 v = __floats2half2_rn(lo, hi);
        return (unsigned int)__half_as_ushort(v.x) | ((unsigned int)__half_as_ushort(v.y) << 16);
    }
};

struct NormF32 {
    typedef unsigned int Bits;
    static constexpr int PER = 4;
    static __device__ __forceinline__ float f(unsigned int b) { return __uint_as_float(b); }
    static __device__ __forceinline__ unsigned int r(float x) { return __float_as_uint(x); }
};

// Value k (0 .. PER - 1) of a chunk packed in 16 bytes.
template <class E>
__device__ __forceinline__ unsigned int norm_get(const uint4& v, int k)
{
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
    if constexpr (E::PER == 8) {
        return (w[k / 2] >> (16 * (k % 2))) & 0xFFFFu;
    } else {
        return w[k];
    }
}

template <class E>
__device__ __forceinline__ void norm_put(uint4& v, int k, unsigned int b)
{
    unsigned int w[4] = {v.x, v.y, v.z, v.w};
    if constexpr (E::PER == 8) {
        const int s = 16 * (k % 2);
        w[k / 2] = (w[k / 2] & ~(0xFFFFu << s)) | ((b & 0xFFFFu) << s);
    } else {
        w[k] = b;
    }
    v = make_uint4(w[0], w[1], w[2], w[3]);
}

// Chunk j of a row of `hidden` values; values at or past `hidden` read as
// 0. `vec`: the row's address is 16-byte aligned.
template <class E>
__device__ __forceinline__ uint4 norm_load(const typename E::Bits* row, unsigned int hidden,
                                           unsigned int j, bool vec)
{
    const unsigned int i = j * E::PER;
    if (vec && i + E::PER <= hidden) {
        return *reinterpret_cast<const uint4*>(row + i);
    }
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int k = 0; k < E::PER; ++k) {
        if (i + k < hidden) {
            norm_put<E>(v, k, (unsigned int)row[i + k]);
        }
    }
    return v;
}

// Writes the values of chunk j below `hidden`.
template <class E>
__device__ __forceinline__ void norm_store(typename E::Bits* row, unsigned int hidden,
                                           unsigned int j, bool vec, uint4 v)
{
    const unsigned int i = j * E::PER;
    if (vec && i + E::PER <= hidden) {
        *reinterpret_cast<uint4*>(row + i) = v;
        return;
    }
#pragma unroll
    for (int k = 0; k < E::PER; ++k) {
        if (i + k < hidden) {
            row[i + k] = (typename E::Bits)norm_get<E>(v, k);
        }
    }
}

// Step 1 and this chunk's part of step 2: r = round(s + res) into `res`
// (returned), squares added to `acc` in element order. Values past
// `hidden` are 0 in both and add +0.0.
template <class E>
__device__ __forceinline__ uint4 norm_add(uint4 s, uint4 res, float& acc)
{
#ifdef NORM_PACK2
    if constexpr (E::PER == 8) {
        // The variant `pack2`: a word's two values rounded by one packing
        // conversion, the squares read back from the packed word; the same
        // bits (each value rounded to nearest even alone, in element order).
        const unsigned int sw[4] = {s.x, s.y, s.z, s.w};
        const unsigned int rw[4] = {res.x, res.y, res.z, res.w};
        unsigned int o[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const float lo = __fadd_rn(E::f(sw[m] & 0xFFFFu), E::f(rw[m] & 0xFFFFu));
            const float hi = __fadd_rn(E::f(sw[m] >> 16), E::f(rw[m] >> 16));
            o[m] = E::r2(lo, hi);
            const float x0 = E::f(o[m] & 0xFFFFu);
            const float x1 = E::f(o[m] >> 16);
            acc = __fadd_rn(acc, __fmul_rn(x0, x0));
            acc = __fadd_rn(acc, __fmul_rn(x1, x1));
        }
        return make_uint4(o[0], o[1], o[2], o[3]);
    }
#endif
    uint4 r = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int k = 0; k < E::PER; ++k) {
        const unsigned int b = E::r(__fadd_rn(E::f(norm_get<E>(s, k)), E::f(norm_get<E>(res, k))));
        norm_put<E>(r, k, b);
        const float x = E::f(b);
        acc = __fadd_rn(acc, __fmul_rn(x, x));
    }
    return r;
}

// Step 5 for a chunk: round((r * inv) * w).
template <class E>
__device__ __forceinline__ uint4 norm_scale(uint4 r, uint4 w, float inv)
{
    uint4 o = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int k = 0; k < E::PER; ++k) {
        const float y = __fmul_rn(__fmul_rn(E::f(norm_get<E>(r, k)), inv), E::f(norm_get<E>(w, k)));
        norm_put<E>(o, k, E::r(y));
    }
    return o;
}

// The five butterfly steps of a warp: every lane ends with the same sum
// (a + b is b + a), lane 0's as the host computes it.
__device__ __forceinline__ float norm_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    }
    return v;
}

// Step 3: the block's sum of `v`, in every thread. Called by every thread
// of the block; blockDim.x a multiple of 32, at most NORM_BLOCK.
__device__ __forceinline__ float norm_block_sum(float v)
{
    __shared__ float s_warp[NORM_BLOCK / 32];
    v = norm_warp_sum(v);
    __syncthreads();  // the previous row's reads of s_warp are done
    if ((threadIdx.x & 31u) == 0u) {
        s_warp[threadIdx.x >> 5] = v;
    }
    __syncthreads();
    const unsigned int lane = threadIdx.x & 31u;
    const float t = lane < (blockDim.x >> 5) ? s_warp[lane] : 0.0f;
    return norm_warp_sum(t);
}

// Step 3 as the kernels call it, once a row (`par`: the row's index among
// the block's rows, mod 2): norm_block_sum, or in the variant
// `one-barrier` (`cargo xtask ptx --variants`; not in the committed PTX)
// the same tree, so the same bits, behind one barrier a row: each warp's
// sum goes into buffer `par`; a warp writes buffer p for row i after the
// barrier of row i - 1, which every warp reached after reading buffer p
// for row i - 2.
__device__ __forceinline__ float norm_block_sum(float v, unsigned int par)
{
#ifndef NORM_ONE_BARRIER
    (void)par;
    return norm_block_sum(v);
#else
    __shared__ float s_warp2[2][NORM_BLOCK / 32];
    v = norm_warp_sum(v);
    if ((threadIdx.x & 31u) == 0u) {
        s_warp2[par][threadIdx.x >> 5] = v;
    }
    __syncthreads();
    const unsigned int lane = threadIdx.x & 31u;
    const float t = lane < (blockDim.x >> 5) ? s_warp2[par][lane] : 0.0f;
    return norm_warp_sum(t);
#endif
}

// Step 4: 1 / sqrt(ss / hidden + eps).
__device__ __forceinline__ float norm_inv(float ss, unsigned int hidden, float eps)
{
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)hidden), eps)));
}
