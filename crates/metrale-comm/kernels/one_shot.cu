// one_shot.cu: the one-shot all-reduce of metrale-comm over peer memory
// (the ranks of one node, 2 to 8), for bf16, f16 and f32: one entry point
// per type (bf16_one_shot_all_reduce, f16_one_shot_all_reduce,
// f32_one_shot_all_reduce), one protocol, the type only in how 16 bytes
// become f32 values and back.
//
// Compiled to PTX by `cargo xtask ptx` (nvcc --ptx -arch=compute_80) into
// one_shot.ptx beside this file; the PTX is committed and loaded at run
// time with cuModuleLoadData. The CPU emulator (crates/gpu-emu/src/one_shot.rs)
// runs the same protocol and arithmetic by these kernels' names.
//
// Protocol (a Lamport-style push: the data says it has arrived, no barrier):
//   Every rank owns a receive buffer that every peer maps (CUDA IPC, or a
//   direct pointer with peer access in one process). It holds 2 lanes (0:
//   eager work, 1: work captured into graphs) x 2 halves x `world` slots of
//   `slot_bytes`; slot p of a half receives rank p's contribution. Outside a
//   call every 32-bit word of it is the sentinel 0x80000000 (the bf16 or
//   f16 pair (+0.0, -0.0), the f32 -0.0).
//   A call on lane L uses half (epoch of L) & 1. Each rank
//     0. claims the lane: thread 0 of every block ORs the launch's owner tag
//        into the lane's claim word (tag << 8 | epoch mod 256), one atomic
//        that also returns the epoch; the block goes on if the word held no
//        tag or exactly this launch's tag (another of its blocks came
//        first), and otherwise records the concurrent-use status;
//     1. pushes its input, 16 bytes at a time, into slot `rank` of that half
//        of every peer's buffer, after replacing the word 0x80000000 by 0
//        (so its data never looks like the sentinel);
//     2. for each 16 bytes, in rank order 0..world-1, takes its own
//        (replaced) input or spins on the peer's slot in its own buffer until
//        no word is the sentinel, writes the sentinel back (the slot is clean
//        for the call that uses this half next), and adds in f32;
//     3. rounds the f32 sums to the type (nearest even) into the data, in
//        place (f32: no rounding);
//     4. frees the lane at the next epoch with one store of the claim word,
//        from the last block to arrive (a one-block call counts nothing).
//   The path from launch to push is one round trip to device memory (the
//   claim, with `failed`, the control block and the input loaded beside
//   it), and the end has no fence: the next call on a lane is ordered after
//   this one by its stream or graph, and a kernel's writes are performed
//   before the work after it starts.
//   A peer can only be one call ahead: it finishes call k only after this
//   rank's push for k, so its push for k + 1 goes to the other half, and its
//   push for k + 2 comes after this rank's call k + 1 started, i.e. after this
//   rank's call k (and its clearing) ended. Two halves suffice because the
//   slot is cleared by its reader inside the call that read it.
//
// Arithmetic: out[i] = round(((v0 + v1) + v2) + ...) in f32, v_r rank r's
// input with the word 0x80000000 read as 0: for bf16 and f16 the pair
// (+0.0, -0.0), aligned to even element indices of the call, reads as
// (+0.0, +0.0); for f32 -0.0 reads as +0.0. Every rank adds in the same
// order, so every rank's result is bit-identical.
//
// Bounds: a spinning thread reads the control block's `failed` word and the
// global timer every OS_POLL_EVERY tries, and once it has waited
// OS_HOST_POLL_AFTER_NS also the host-pinned abort word; past `timeout_ns`,
// or once the abort word is set, it records a status and the kernel exits.
// A status is recorded once (the first wins, through `failed` in device
// memory) and mirrored into the host-pinned status word for the host. A
// kernel that finds `failed` set, or its lane held by another call (two
// one-shots at once on one lane of one rank: the backend's ordering rule
// broken), records one and exits without touching any buffer; its OR
// leaves no valid tag in the claim word, so blocks of the holding call yet
// to claim fail too, and a peer waiting for their part times out rather
// than finishing on partial data. After a status is set the path stays
// failed until the backend sets it up again (reconnect).
//
// No read of host memory is on the path of a call that does not wait: one
// read over PCIe costs microseconds, and one per block at the start of
// every call cost 65 us at 256 KiB on one H200 (the one_shot_local bench).
// So a kernel launched after the abort word was set runs like any other
// and stops at the abort only once it has waited OS_HOST_POLL_AFTER_NS;
// the backend launches nothing after poisoning, and graphs must not be
// replayed after a reconnect or shutdown.
//
// Launch contract:
//   params: ctrl  device pointer to this rank's OsCtrl (below);
//           data  device pointer to n values of the entry's type, read and
//                 written in place;
//           n     element count, 1 <= n, n * sizeof(type) <= ctrl->slot_bytes;
//           lane  0 (eager) or 1 (captured into a graph).
//   block:  8 to OS_BLOCK (512) threads in x; any grid size is correct
//           (grid-stride loops); the host uses at most 32 blocks so that
//           spinning calls never fill the GPU.
//   shared memory: static only.
// Peer memory is reached with plain volatile loads and stores (over NVLink
// between the GPUs of one node); no multicast, no multimem.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define OS_BLOCK 512
#define OS_MAX_RANKS 8
#define OS_SENTINEL 0x80000000u
#define OS_POLL_EVERY 256
#define OS_HOST_POLL_AFTER_NS 100000ull

#define OS_STATUS_TIMEOUT 1u
#define OS_STATUS_ABORTED 2u
#define OS_STATUS_CONCURRENT 3u
#define OS_STATUS_BAD_LAUNCH 4u

// One lane's state, in this rank's device memory.
struct OsLane {
    unsigned long long claim;  // owner tag << 8 | epoch mod 256; free: tag 0
    unsigned int arrived;      // blocks of the running call that finished
    unsigned int pad;
};

// This rank's control block (136 bytes), in its device memory; the host
// writes it at set-up. The offsets are a contract with the host code
// (metrale-comm's nccl_backend/one_shot.rs) and the emulator.
struct OsCtrl {
    unsigned long long peer[OS_MAX_RANKS];  //   0: each rank's receive buffer, as mapped here
    unsigned long long flags;               //  64: host-pinned u32 words: [0] abort, [1] status
    unsigned long long timeout_ns;          //  72: how long a thread may spin
    unsigned int rank;                      //  80
    unsigned int world;                     //  84
    unsigned long long slot_bytes;          //  88: bytes of one slot, a multiple of 16
    OsLane lane[2];                         //  96, 112
    unsigned int failed;                    // 128: the status recorded, 0: none
    unsigned int pad;                       // 132
};

__device__ __forceinline__ unsigned long long os_clock()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// This launch's owner tag, in the high 56 bits of a lane's claim word:
// v = %gridid mod 2^28 (a new number for every launch in the context) and
// its complement, v | ~v << 28. Every tag has exactly 28 bits set, so no
// tag is 0 and the OR of two different tags is no tag. Two launches alike
// in it are 2^28 launches apart, never running at once.
__device__ __forceinline__ unsigned long long os_tag()
{
    unsigned long long g;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
    const unsigned long long v = g & 0xFFFFFFFull;
    return v | ((~v & 0xFFFFFFFull) << 28);
}

__device__ __forceinline__ unsigned int os_ld32(const unsigned int* addr)
{
    return *reinterpret_cast<const volatile unsigned int*>(addr);
}

__device__ __forceinline__ unsigned long long os_ld64(const unsigned long long* addr)
{
    return *reinterpret_cast<const volatile unsigned long long*>(addr);
}

__device__ __forceinline__ uint4 os_ld(unsigned long long addr)
{
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(addr));
    return v;
}

__device__ __forceinline__ void os_st(unsigned long long addr, uint4 v)
{
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :
                 : "l"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// Records `code` as the status unless one is recorded already (in `failed`,
// then in the host-pinned status word for the host).
__device__ __forceinline__ void os_fail(unsigned int* failed, volatile unsigned int* flags,
                                        unsigned int code)
{
    if (atomicCAS(failed, 0u, code) == 0u) {
        flags[1] = code;
        __threadfence_system();
    }
}

__device__ __forceinline__ unsigned int os_word(unsigned int w)
{
    return w == OS_SENTINEL ? 0u : w;
}

__device__ __forceinline__ uint4 os_canon(uint4 v)
{
    v.x = os_word(v.x);
    v.y = os_word(v.y);
    v.z = os_word(v.z);
    v.w = os_word(v.w);
    return v;
}

__device__ __forceinline__ bool os_arrived(uint4 v)
{
    return v.x != OS_SENTINEL && v.y != OS_SENTINEL && v.z != OS_SENTINEL &&
           v.w != OS_SENTINEL;
}

// The element types: `Bits` is how one value is stored, PER values fill
// 16 bytes; `acc` adds (or, for the first rank, sets) 16 bytes of values
// into PER f32 sums; `pack` rounds the sums back into 16 bytes.
struct OsBf16 {
    typedef unsigned short Bits;
    static constexpr int PER = 8;
    static __device__ __forceinline__ float lo(unsigned int w) { return __uint_as_float(w << 16); }
    static __device__ __forceinline__ float hi(unsigned int w)
    {
        return __uint_as_float(w & 0xFFFF0000u);
    }
    static __device__ __forceinline__ unsigned int bits(float x)
    {
        return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
};

struct OsF16 {
    typedef unsigned short Bits;
    static constexpr int PER = 8;
    static __device__ __forceinline__ float lo(unsigned int w)
    {
        return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFFu)));
    }
    static __device__ __forceinline__ float hi(unsigned int w)
    {
        return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
    }
    static __device__ __forceinline__ unsigned int bits(float x)
    {
        return __half_as_ushort(__float2half_rn(x));
    }
};

struct OsF32 {
    typedef unsigned int Bits;
    static constexpr int PER = 4;
};

// Elements PER u .. PER u + PER - 1 of `data` as four words; elements at or
// past `n` read as +0.0.
template <class E>
__device__ __forceinline__ uint4 os_load(const typename E::Bits* data, unsigned long long n,
                                         unsigned long long u, bool aligned)
{
    const unsigned long long i = u * E::PER;
    if (aligned && i + E::PER <= n) {
        return *reinterpret_cast<const uint4*>(data + i);
    }
    unsigned int e[E::PER];
#pragma unroll
    for (int k = 0; k < E::PER; ++k) {
        e[k] = (i + k < n) ? (unsigned int)data[i + k] : 0u;
    }
    if constexpr (E::PER == 8) {
        return make_uint4(e[0] | (e[1] << 16), e[2] | (e[3] << 16), e[4] | (e[5] << 16),
                          e[6] | (e[7] << 16));
    } else {
        return make_uint4(e[0], e[1], e[2], e[3]);
    }
}

// Writes the elements of `v` that lie below `n` to elements PER u ..
// PER u + PER - 1.
template <class E>
__device__ __forceinline__ void os_store(typename E::Bits* data, unsigned long long n,
                                         unsigned long long u, bool aligned, uint4 v)
{
    const unsigned long long i = u * E::PER;
    if (aligned && i + E::PER <= n) {
        *reinterpret_cast<uint4*>(data + i) = v;
        return;
    }
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < E::PER; ++k) {
        if (i + k < n) {
            if constexpr (E::PER == 8) {
                data[i + k] = (typename E::Bits)(w[k / 2] >> (16 * (k % 2)));
            } else {
                data[i + k] = (typename E::Bits)w[k];
            }
        }
    }
}

// 16 bytes of 16-bit values into 8 sums.
template <class E>
__device__ __forceinline__ void os_acc(float* acc, uint4 v, bool first)
{
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if (first) {
            acc[2 * k] = E::lo(w[k]);
            acc[2 * k + 1] = E::hi(w[k]);
        } else {
            acc[2 * k] += E::lo(w[k]);
            acc[2 * k + 1] += E::hi(w[k]);
        }
    }
}

// 16 bytes of f32 values into 4 sums.
template <>
__device__ __forceinline__ void os_acc<OsF32>(float* acc, uint4 v, bool first)
{
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if (first) {
            acc[k] = __uint_as_float(w[k]);
        } else {
            acc[k] += __uint_as_float(w[k]);
        }
    }
}

template <class E>
__device__ __forceinline__ uint4 os_pack(const float* acc)
{
    uint4 out;
    out.x = E::bits(acc[0]) | (E::bits(acc[1]) << 16);
    out.y = E::bits(acc[2]) | (E::bits(acc[3]) << 16);
    out.z = E::bits(acc[4]) | (E::bits(acc[5]) << 16);
    out.w = E::bits(acc[6]) | (E::bits(acc[7]) << 16);
    return out;
}

template <>
__device__ __forceinline__ uint4 os_pack<OsF32>(const float* acc)
{
    return make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]),
                      __float_as_uint(acc[3]));
}

// The kernel of every type: `data` holds `n` values of E.
template <class E>
__device__ __forceinline__ void os_one_shot(OsCtrl* ctrl, typename E::Bits* data,
                                            unsigned long long n, unsigned int lane)
{
    __shared__ unsigned int s_epoch;
    __shared__ unsigned int s_go;
    __shared__ unsigned long long s_peer[OS_MAX_RANKS];

    const unsigned long long t0 = os_clock();
    // Everything the call's start reads is loaded at once, with no load
    // depending on another: `failed` and the lane's claim word (thread 0),
    // the control block's fixed words and every thread's first input unit
    // (`data` holds `n` values by the launch contract).
    OsLane* l = &ctrl->lane[lane & 1u];
    unsigned int* failed = &ctrl->failed;
    // Every block claims the lane with one atomic OR of the launch's tag,
    // which also returns the epoch: the lane is this launch's if the word
    // held no tag (this block is the first) or exactly this launch's tag
    // (another of its blocks was). Any other word means another launch
    // holds the lane, and the OR leaves no valid tag in it.
    const unsigned long long tag = os_tag();
    unsigned int f = 0u;
    unsigned long long w = 0ull;
    if (threadIdx.x == 0) {
        f = os_ld32(failed);
        w = atomicOr(&l->claim, tag << 8);
    }
    volatile unsigned int* flags = reinterpret_cast<volatile unsigned int*>(ctrl->flags);
    const unsigned int world = ctrl->world;
    const unsigned int rank = ctrl->rank;
    const unsigned long long slot = ctrl->slot_bytes;
    const unsigned long long timeout = ctrl->timeout_ns;
    const unsigned long long units = (n + E::PER - 1ull) / E::PER;
    const bool aligned = (reinterpret_cast<unsigned long long>(data) & 15ull) == 0ull;
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const bool bad = lane > 1u || world < 2u || world > OS_MAX_RANKS || rank >= world ||
                     n == 0ull || n * sizeof(typename E::Bits) > slot || (slot & 15ull) != 0ull;
    uint4 first = make_uint4(0u, 0u, 0u, 0u);
    if (tid < units) {
        first = os_canon(os_load<E>(data, n, tid, aligned));
    }

    if (threadIdx.x == 0) {
        unsigned int go = 0u;
        if (bad) {
            os_fail(failed, flags, OS_STATUS_BAD_LAUNCH);
        } else if (f == 0u) {
            go = ((w >> 8) == 0ull || (w >> 8) == tag) ? 1u : 0u;
            if (go == 0u) {
                os_fail(failed, flags, OS_STATUS_CONCURRENT);
            }
        }
        s_go = go;
        s_epoch = (unsigned int)(w & 0xFFull);
    }
    if (threadIdx.x < OS_MAX_RANKS) {
        s_peer[threadIdx.x] = ctrl->peer[threadIdx.x];
    }
    __syncthreads();
    if (s_go == 0u) {
        return;
    }

    const unsigned long long half = s_epoch & 1u;
    const unsigned long long region = (lane * 2ull + half) * world * slot;

    // 1. Push this rank's contribution into slot `rank` of every peer.
    for (unsigned long long u = tid; u < units; u += stride) {
        const uint4 v = u == tid ? first : os_canon(os_load<E>(data, n, u, aligned));
        for (unsigned int p = 0; p < world; ++p) {
            if (p != rank) {
                os_st(s_peer[p] + region + rank * slot + u * 16ull, v);
            }
        }
    }

    // 2-3. Wait for every contribution, add in rank order, clear, round.
    const uint4 clear = make_uint4(OS_SENTINEL, OS_SENTINEL, OS_SENTINEL, OS_SENTINEL);
    const unsigned long long mine = s_peer[rank] + region;
    bool bail = false;
    unsigned int spins = 0;
    for (unsigned long long u = tid; u < units && !bail; u += stride) {
        float acc[8];
        for (unsigned int p = 0; p < world && !bail; ++p) {
            uint4 v;
            if (p == rank) {
                v = u == tid ? first : os_canon(os_load<E>(data, n, u, aligned));
            } else {
                const unsigned long long src = mine + p * slot + u * 16ull;
                v = os_ld(src);
                while (!os_arrived(v)) {
                    if (++spins % OS_POLL_EVERY == 0u) {
                        const unsigned long long waited = os_clock() - t0;
                        if (os_ld32(failed) != 0u) {
                            bail = true;
                        } else if (waited > OS_HOST_POLL_AFTER_NS && flags[0] != 0u) {
                            os_fail(failed, flags, OS_STATUS_ABORTED);
                            bail = true;
                        } else if (waited > timeout) {
                            os_fail(failed, flags, OS_STATUS_TIMEOUT);
                            bail = true;
                        }
                        if (bail) {
                            break;
                        }
                    }
                    v = os_ld(src);
                }
                if (bail) {
                    break;
                }
                os_st(src, clear);
            }
            os_acc<E>(acc, v, p == 0u);
        }
        if (!bail) {
            os_store<E>(data, n, u, aligned, os_pack<E>(acc));
        }
    }

    // 4. The last block to arrive frees the lane at the next epoch, in one
    // store; a one-block call needs no count. No fence: the next call on
    // the lane is ordered after this one by its stream (or graph), and a
    // kernel's writes are performed before the work after it starts.
    if (__syncthreads_or(bail ? 1 : 0)) {
        return;
    }
    if (threadIdx.x == 0) {
        bool last = true;
        if (gridDim.x > 1u) {
            last = atomicAdd(&l->arrived, 1u) == gridDim.x - 1u;
            if (last) {
                l->arrived = 0u;
            }
        }
        if (last) {
            atomicExch(&l->claim, (unsigned long long)((s_epoch + 1u) & 0xFFu));
        }
    }
}

extern "C" __global__ void __launch_bounds__(OS_BLOCK)
bf16_one_shot_all_reduce(OsCtrl* ctrl, unsigned short* data, unsigned long long n,
                         unsigned int lane)
{
    os_one_shot<OsBf16>(ctrl, data, n, lane);
}

extern "C" __global__ void __launch_bounds__(OS_BLOCK)
f16_one_shot_all_reduce(OsCtrl* ctrl, unsigned short* data, unsigned long long n,
                        unsigned int lane)
{
    os_one_shot<OsF16>(ctrl, data, n, lane);
}

extern "C" __global__ void __launch_bounds__(OS_BLOCK)
f32_one_shot_all_reduce(OsCtrl* ctrl, unsigned int* data, unsigned long long n,
                        unsigned int lane)
{
    os_one_shot<OsF32>(ctrl, data, n, lane);
}
