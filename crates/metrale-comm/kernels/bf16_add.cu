// bf16_add.cu: the in-place bf16 add used by the fast path of metrale-comm.
//
// Compiled to PTX by `cargo xtask ptx` (nvcc --ptx -arch=compute_80) into
// bf16_add.ptx beside this file; the PTX is committed and loaded at run time
// with cuModuleLoadData, so the driver JIT-compiles it for the GPU it finds.
//
// Arithmetic: dst[i] = bf16(float(dst[i]) + float(src[i])), rounding to
// nearest even (__float2bfloat16_rn). This is the arithmetic NCCL uses for a
// two-rank bf16 sum, so the result is bit-identical to ncclAllReduce(ncclSum).
//
// Launch contract:
//   params: dst  device pointer to n bf16 values, read and written;
//           src  device pointer to n bf16 values, read only;
//           n    element count (may be 0; may exceed 2^32).
//   dst and src may be equal (dst = 2 * dst) but must not otherwise overlap.
//   block:  BF16_ADD_BLOCK (256) threads in x. Any size from 1 to 256 is
//           correct; more than 256 fails to launch (__launch_bounds__).
//   grid:   min(ceil(ceil(n / 8) / 256), 132 * 8) blocks in x, at least 1;
//           any grid size is correct (the loops are grid-stride).
//   shared memory: none.
// When dst and src are both 16-byte aligned the body moves 8 values per
// 16-byte load; otherwise it falls back to one value per thread iteration.

#include <cuda_bf16.h>

#include "abi.h"

// The ABI this module was compiled against (crates/kernel-abi).
extern "C" __device__ const unsigned long long metrale_kernel_abi = METRALE_KERNEL_ABI;

// Adds the 8 bf16 values packed in b to those packed in a.
__device__ __forceinline__ uint4 add8(uint4 a, uint4 b)
{
    uint4 r;
    const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
    __nv_bfloat162* pr = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 fa = __bfloat1622float2(pa[k]);
        const float2 fb = __bfloat1622float2(pb[k]);
        pr[k] = __floats2bfloat162_rn(fa.x + fb.x, fa.y + fb.y);
    }
    return r;
}

extern "C" __global__ void __launch_bounds__(BF16_ADD_BLOCK)
bf16_add_inplace(__nv_bfloat16* dst, const __nv_bfloat16* src, unsigned long long n)
{
    const unsigned long long tid =
        (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;

    unsigned long long head = 0;
    if ((((unsigned long long)dst | (unsigned long long)src) & 15ull) == 0) {
        const unsigned long long vecs = n / 8;
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint4* s = reinterpret_cast<const uint4*>(src);
        for (unsigned long long v = tid; v < vecs; v += stride) {
            d[v] = add8(d[v], __ldg(&s[v]));
        }
        head = vecs * 8;
    }
    for (unsigned long long i = head + tid; i < n; i += stride) {
        dst[i] = __float2bfloat16_rn(__bfloat162float(dst[i]) + __bfloat162float(src[i]));
    }
}
