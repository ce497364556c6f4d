// add_rms_norm.cu: the residual add + RMSNorm of metrale-comm, after an
// all-reduce: residual <- x + residual, x <- rms_norm(residual) * weight,
// row by row over `hidden`, in f32 (norm.cuh; the arithmetic is
// crates/kernel-abi/src/norm.rs's `row`, bit for bit). One entry per type:
// bf16_add_rms_norm, f16_add_rms_norm, f32_add_rms_norm.
//
// Compiled to PTX by `cargo xtask ptx` into add_rms_norm.ptx beside this
// file (committed, loaded at run time with cuModuleLoadData).
//
// Launch contract:
//   params: x        device pointer to rows * hidden values, read (the
//                    all-reduced input) and written (the output);
//           residual device pointer to rows * hidden values, read and
//                    written (the new residual);
//           weight   device pointer to hidden values, read;
//           hidden   1 to NORM_MAX_HIDDEN (65536);
//           rows     any count (block-stride loop over rows);
//           eps      finite and positive.
//   x, residual and weight are aligned to their element and do not overlap.
//   block: norm_threads(hidden, size) = min(NORM_BLOCK, ceil(chunks / 32)
//          * 32) threads in x (chunks = ceil(hidden / PER), PER = 16 /
//          size): that count fixes the reduction order the host reference
//          follows; a block that is not a whole number of warps does
//          nothing.
//   grid:  any; one block a row is the host's choice (at most 2^20 blocks).
//   shared memory: static only.
// A row of at most REG_CHUNKS chunks a thread (bf16 and f16 up to 8,192
// values, f32 up to 4,096) is held in registers: its loads go out
// together and the second pass reads them there. A longer row's residual
// is written in the first pass and read back by the same thread in the
// second (no register limit on hidden). Vector loads when a row's address
// is 16-byte aligned.
//
// Uncommitted builds (`cargo xtask ptx --variants DIR`; the committed PTX
// defines none of these, which `cargo xtask ptx --check` proves):
// NORM_ONE_BARRIER (norm.cuh) sums a row behind one barrier, the same
// bits; the timing probes NORM_PROBE_NOSUM, NORM_PROBE_NOINV,
// NORM_PROBE_BARE and NORM_PROBE_EMPTY (wrong results) leave out the block
// sum, the inverse root, the whole norm of a row held in registers (x
// gets the new residual), or everything (the launch alone). NORM_PDL (an
// sm_90 build, add_rms_norm_sm90-pdl.ptx) makes the kernel a programmatic
// dependent launch's secondary: launched with programmatic stream
// serialization (`Function::launch_programmatic`), its blocks start while
// the previous grid in the stream finishes, and wait for that grid's
// completion and its memory before touching any; the same bits.

#include "abi.h"
#include "norm.cuh"

// The ABI this module was compiled against (crates/kernel-abi).
extern "C" __device__ const unsigned long long metrale_kernel_abi = METRALE_KERNEL_ABI;

// The chunks a thread holds in registers across a row's two passes.
constexpr unsigned int REG_CHUNKS = 2u;

// Steps 3 and 4 of a row: the block's sum of the squares and the scale
// 1 / sqrt(ss / hidden + eps). The timing probes NORM_PROBE_NOSUM and
// NORM_PROBE_NOINV (`cargo xtask ptx --variants`; wrong results, never
// committed) leave out one step each.
__device__ __forceinline__ float norm_row_inv(float acc, unsigned int hidden, float eps,
                                              unsigned int par)
{
#ifdef NORM_PROBE_NOSUM
    (void)par;
    const float ss = acc;
#else
    const float ss = norm_block_sum(acc, par);
#endif
#ifdef NORM_PROBE_NOINV
    (void)hidden;
    (void)eps;
    return ss;
#else
    return norm_inv(ss, hidden, eps);
#endif
}

// A row of at most REG_CHUNKS chunks a thread: every load of the row
// (x, the residual, the weight) goes out before the first store, and the
// scaling reads the new residual from registers, so the row costs one
// round trip to memory instead of one per chunk and pass. The arithmetic
// and its order are norm_rows's two-pass loop's.
template <class E>
__device__ __forceinline__ void norm_row_in_registers(typename E::Bits* xr, typename E::Bits* rr,
                                                      const typename E::Bits* weight,
                                                      unsigned int hidden, unsigned int chunks,
                                                      bool vec, bool wvec, float eps,
                                                      unsigned int par)
{
    uint4 s[REG_CHUNKS];
    uint4 res[REG_CHUNKS];
    uint4 w[REG_CHUNKS];
#pragma unroll
    for (unsigned int c = 0; c < REG_CHUNKS; ++c) {
        const unsigned int j = threadIdx.x + c * blockDim.x;
        s[c] = make_uint4(0u, 0u, 0u, 0u);
        res[c] = s[c];
        w[c] = s[c];
        if (j < chunks) {
            s[c] = norm_load<E>(xr, hidden, j, vec);
            res[c] = norm_load<E>(rr, hidden, j, vec);
            w[c] = norm_load<E>(weight, hidden, j, wvec && vec);
        }
    }
    float acc = 0.0f;
#pragma unroll
    for (unsigned int c = 0; c < REG_CHUNKS; ++c) {
        const unsigned int j = threadIdx.x + c * blockDim.x;
        if (j < chunks) {
            res[c] = norm_add<E>(s[c], res[c], acc);
            norm_store<E>(rr, hidden, j, vec, res[c]);
        }
    }
#ifdef NORM_PROBE_BARE
    // The probe NORM_PROBE_BARE: the row's loads, add and stores, no norm.
#pragma unroll
    for (unsigned int c = 0; c < REG_CHUNKS; ++c) {
        const unsigned int j = threadIdx.x + c * blockDim.x;
        if (j < chunks) {
            norm_store<E>(xr, hidden, j, vec, res[c]);
        }
    }
    (void)w;
    (void)eps;
    (void)par;
    return;
#endif
    const float inv = norm_row_inv(acc, hidden, eps, par);
#pragma unroll
    for (unsigned int c = 0; c < REG_CHUNKS; ++c) {
        const unsigned int j = threadIdx.x + c * blockDim.x;
        if (j < chunks) {
            norm_store<E>(xr, hidden, j, vec, norm_scale<E>(res[c], w[c], inv));
        }
    }
}

template <class E>
__device__ __forceinline__ void norm_rows(typename E::Bits* x, typename E::Bits* residual,
                                          const typename E::Bits* weight,
                                          unsigned long long hidden64, unsigned long long rows,
                                          float eps)
{
#ifdef NORM_PDL
    // The previous grid's writes are visible after the wait; the next
    // grid may launch from then on (it waits for this one in turn), so at
    // most two grids of the stream are resident.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    if ((blockDim.x & 31u) != 0u || hidden64 == 0ull || hidden64 > NORM_MAX_HIDDEN) {
        return;
    }
#ifdef NORM_PROBE_EMPTY
    return;
#endif
    const unsigned int hidden = (unsigned int)hidden64;
    const unsigned int chunks = (hidden + E::PER - 1u) / E::PER;
    const bool wvec = (reinterpret_cast<unsigned long long>(weight) & 15ull) == 0ull;
    unsigned int par = 0u;
    for (unsigned long long row = blockIdx.x; row < rows; row += gridDim.x, par ^= 1u) {
        typename E::Bits* xr = x + row * hidden;
        typename E::Bits* rr = residual + row * hidden;
        const bool vec = ((reinterpret_cast<unsigned long long>(xr) |
                           reinterpret_cast<unsigned long long>(rr)) & 15ull) == 0ull;
        if (chunks <= REG_CHUNKS * blockDim.x) {
            norm_row_in_registers<E>(xr, rr, weight, hidden, chunks, vec, wvec, eps, par);
            continue;
        }
        float acc = 0.0f;
        for (unsigned int j = threadIdx.x; j < chunks; j += blockDim.x) {
            const uint4 s = norm_load<E>(xr, hidden, j, vec);
            const uint4 res = norm_load<E>(rr, hidden, j, vec);
            norm_store<E>(rr, hidden, j, vec, norm_add<E>(s, res, acc));
        }
        const float inv = norm_row_inv(acc, hidden, eps, par);
        for (unsigned int j = threadIdx.x; j < chunks; j += blockDim.x) {
            const uint4 r = norm_load<E>(rr, hidden, j, vec);
            const uint4 w = norm_load<E>(weight, hidden, j, wvec && vec);
            norm_store<E>(xr, hidden, j, vec, norm_scale<E>(r, w, inv));
        }
    }
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
bf16_add_rms_norm(unsigned short* x, unsigned short* residual, const unsigned short* weight,
                  unsigned long long hidden, unsigned long long rows, float eps)
{
    norm_rows<NormBf16>(x, residual, weight, hidden, rows, eps);
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
f16_add_rms_norm(unsigned short* x, unsigned short* residual, const unsigned short* weight,
                 unsigned long long hidden, unsigned long long rows, float eps)
{
    norm_rows<NormF16>(x, residual, weight, hidden, rows, eps);
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
f32_add_rms_norm(unsigned int* x, unsigned int* residual, const unsigned int* weight,
                 unsigned long long hidden, unsigned long long rows, float eps)
{
    norm_rows<NormF32>(x, residual, weight, hidden, rows, eps);
}
