// one_shot.cu: the one-shot all-reduce of metrale-comm over peer memory
// (the ranks of one node, 2 to 8), for bf16, f16 and f32: one entry point
// per type (bf16_one_shot_all_reduce, f16_one_shot_all_reduce,
// f32_one_shot_all_reduce), one protocol, the type only in how 16 bytes
// become f32 values and back.
//
// Compiled to PTX by `cargo xtask ptx` (nvcc --ptx -arch=compute_80) into
// one_shot.ptx beside this file; the PTX is committed and loaded at run
// time with cuModuleLoadData. The CPU emulator (crates/gpu-emu/src/kernels/one_shot.rs)
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
//     1. pushes its input, 16 bytes at a time (a thread loads two of its
//        units before it stores either), into slot `rank` of that half of
//        every peer's buffer, after replacing the word 0x80000000 by 0 (so
//        its data never looks like the sentinel);
//     2. for each 16 bytes, in rank order 0..world-1, takes its own
//        (replaced) input or spins on the peer's slot in its own buffer until
//        no word is the sentinel, writes the sentinel back (the slot is clean
//        for the call that uses this half next), and adds in f32; a thread
//        issues its first loads of a unit from every peer (in worlds of
//        more than 4, from 4 peers at a time) before it waits for any, so
//        it waits about one memory latency per unit (two above 5 ranks),
//        not one per unit and peer;
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
//   params: ctrl  device pointer to this rank's OsCtrl (abi.h);
//           data  device pointer to n values of the entry's type, read and
//                 written in place;
//           n     element count, 1 <= n, n * sizeof(type) <= ctrl->slot_bytes;
//           lane  0 (eager) or 1 (captured into a graph).
//   block:  8 to OS_BLOCK (512) threads in x; any grid of fewer than 2^31
//           threads is correct (grid-stride loops, 32-bit counts); the host
//           uses at most 32 blocks so that spinning calls never fill the
//           GPU.
//   shared memory: static only.
// Peer memory is reached with plain volatile loads and stores (over NVLink
// between the GPUs of one node); no multicast, no multimem.
//
// Uncommitted builds (`cargo xtask ptx --variants DIR`; the committed PTX
// defines none of these, which `cargo xtask ptx --check` proves):
//   NORM_ONE_BARRIER  the one-block fused entries sum a row's squares and
//                     its stop flags behind one barrier (os_block_sum), and
//                     the separate kernel its squares (norm.cuh): the same
//                     bits, for timing against the committed build;
//   OS_PROBE_NOSUM    timing probes of the fused entries, wrong results
//   OS_PROBE_NOINV    (norm_local with METRALE_NORM_LOCAL_NO_CHECK=1): no
//   OS_PROBE_BARE     block sum (a thread's own squares), no inverse root
//                     (the sum itself), or no norm at all (the sums are
//                     stored into x and the residual is left alone);
//   OS_PROBE_EMPTY    a timing probe: the fused entries return at once
//                     (the launch alone);
//   OS_FUSED_WORLD=k  timing probes: the fused entries compute rows at one
//                     class of worlds only (2, 4: 3-4 ranks, 8: 5-8), no
//                     code for the others (os_fused_world).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "abi.h"
#include "norm.cuh"

// The ABI this module was compiled against (crates/kernel-abi): the host
// refuses a module whose value is not its own.
extern "C" __device__ const unsigned long long metrale_kernel_abi = METRALE_KERNEL_ABI;

__device__ __forceinline__ unsigned long long os_clock()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// This launch's owner tag, in the high 56 bits of a lane's claim word:
// v = %gridid mod 2^OS_TAG_HALF_BITS (a new number for every launch in the
// context) and its complement, v | ~v << OS_TAG_HALF_BITS. Every tag has
// exactly OS_TAG_HALF_BITS bits set, so no tag is 0 and the OR of two
// different tags is no tag. Two launches alike in it are 2^28 launches
// apart, never running at once.
__device__ __forceinline__ unsigned long long os_tag()
{
    unsigned long long g;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
    const unsigned long long mask = (1ull << OS_TAG_HALF_BITS) - 1ull;
    const unsigned long long v = g & mask;
    return v | ((~v & mask) << OS_TAG_HALF_BITS);
}

__device__ __forceinline__ unsigned int os_ld32(const unsigned int* addr)
{
    return *reinterpret_cast<const volatile unsigned int*>(addr);
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
        flags[OS_FLAG_STATUS] = code;
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

// Elements PER u .. PER u + PER - 1 of `data` as four words, one at a
// time (a misaligned `data`, or the call's last unit); elements at or past
// `n` read as +0.0.
template <class E>
__device__ __forceinline__ uint4 os_load_each(const typename E::Bits* data, unsigned int n,
                                           unsigned int u)
{
    const unsigned int i = u * E::PER;
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

// Elements PER u .. PER u + PER - 1 of `data` as four words; elements at or
// past `n` read as +0.0.
template <class E>
__device__ __forceinline__ uint4 os_load(const typename E::Bits* data, unsigned int n,
                                         unsigned int u, bool aligned)
{
    if (aligned && (u + 1u) * E::PER <= n) {
        return *reinterpret_cast<const uint4*>(data + u * E::PER);
    }
    return os_load_each<E>(data, n, u);
}

// Writes the elements of `v` that lie below `n` to elements PER u ..
// PER u + PER - 1, one at a time.
template <class E>
__device__ __forceinline__ void os_store_each(typename E::Bits* data, unsigned int n,
                                           unsigned int u, uint4 v)
{
    const unsigned int i = u * E::PER;
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

// Writes the elements of `v` that lie below `n` to elements PER u ..
// PER u + PER - 1.
template <class E>
__device__ __forceinline__ void os_store(typename E::Bits* data, unsigned int n,
                                         unsigned int u, bool aligned, uint4 v)
{
    if (aligned && (u + 1u) * E::PER <= n) {
        *reinterpret_cast<uint4*>(data + u * E::PER) = v;
        return;
    }
    os_store_each<E>(data, n, u, v);
}

// Adds 16 bytes of 16-bit values into 8 sums.
template <class E>
__device__ __forceinline__ void os_acc(float* acc, uint4 v)
{
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        acc[2 * k] += E::lo(w[k]);
        acc[2 * k + 1] += E::hi(w[k]);
    }
}

// Adds 16 bytes of f32 values into 4 sums.
template <>
__device__ __forceinline__ void os_acc<OsF32>(float* acc, uint4 v)
{
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        acc[k] += __uint_as_float(w[k]);
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

// What a thread's part of a call needs, read once. Counts and byte offsets
// within the receive buffer are 32-bit: a launch with a slot of more than
// OS_MAX_SLOT bytes is refused.
struct OsCall {
    unsigned int n;
    unsigned int cnt;  // this thread's units: tid, tid + stride, ...
    unsigned int tid;
    unsigned int stride;
    unsigned int slot;
    unsigned long long mine;  // this rank's receive buffer, the call's half
    OsCtrl* ctrl;
    const unsigned long long* t0;  // the block's start, in shared memory
    unsigned int world;
    unsigned int rank;
    bool aligned;
};

// A unit loaded from a peer's slot, and whether the wait for it ended
// with the data (false: a status is recorded, the call stops).
struct OsGot {
    uint4 v;
    bool ok;
};

// Spins on `src` (16 bytes of a peer's slot, `v` its last load) until no
// word is the sentinel, within the call's bounds (`t0`: the block's start);
// the bounds are read from the control block only here, so a unit that
// has arrived by its first load reads none of them.
__device__ __forceinline__ OsGot os_wait(unsigned long long src, uint4 v, OsCtrl* ctrl,
                                      unsigned long long t0)
{
    unsigned int* failed = &ctrl->failed;
    volatile unsigned int* flags = reinterpret_cast<volatile unsigned int*>(ctrl->flags);
    const unsigned long long timeout = ctrl->timeout_ns;
    unsigned int spins = 0;
    while (!os_arrived(v)) {
        if (++spins % OS_POLL_EVERY == 0u) {
            const unsigned long long waited = os_clock() - t0;
            if (os_ld32(failed) != 0u) {
                return OsGot{v, false};
            }
            if (waited > OS_HOST_POLL_AFTER_NS && flags[OS_FLAG_ABORT] != 0u) {
                os_fail(failed, flags, OS_STATUS_ABORTED);
                return OsGot{v, false};
            }
            if (waited > timeout) {
                os_fail(failed, flags, OS_STATUS_TIMEOUT);
                return OsGot{v, false};
            }
        }
        v = os_ld(src);
    }
    return OsGot{v, true};
}

// Where unit `u` of the q-th peer (rank order, without this rank) lands in
// this rank's buffer, for q + 1 < world.
__device__ __forceinline__ unsigned long long os_src(const OsCall& c, unsigned int q,
                                                     unsigned int u)
{
    const unsigned int p = q < c.rank ? q : q + 1u;
    return c.mine + (p * c.slot + u * 16u);
}

// The first loads of unit `u` from the q-th peers for q in [g, g + G),
// issued together; +0 words for q past the last peer.
template <int G>
__device__ __forceinline__ void os_issue(const OsCall& c, unsigned int u, int g, uint4 (&v)[G])
{
#pragma unroll
    for (int j = 0; j < G; ++j) {
        const unsigned int q = (unsigned int)(g + j);
        if (q + 1u < c.world) {
            v[j] = os_ld(os_src(c, q, u));
        } else {
            v[j] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// Unit `u` of this rank (`o`, already loaded and canonical) and of every
// peer, for worlds of at most MP + 1 ranks, in groups of G peers (`v`: the
// first group's loads, already issued; each later group's loads go out
// together once the group before it is added): waits for each, clears its
// slot, adds all in rank order, and returns the rounded sum in `out`.
// False if the call stopped.
template <class E, int MP, int G>
__device__ __forceinline__ bool os_sum(const OsCall& c, unsigned int u, uint4 o,
                                       const uint4 (&v)[G], uint4& out)
{
    const uint4 clear = make_uint4(OS_SENTINEL, OS_SENTINEL, OS_SENTINEL, OS_SENTINEL);
    constexpr int QMAX = (MP + G - 1) / G * G;
    // -0.0 + x is x for every x but a NaN (which comes out canonical, as
    // it does from the second add a world of 2 or more always makes), so
    // the sums start there.
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        acc[k] = -0.0f;
    }
#pragma unroll
    for (int g = 0; g < QMAX; g += G) {
        uint4 w[G];
        if (g == 0) {
#pragma unroll
            for (int j = 0; j < G; ++j) {
                w[j] = v[j];
            }
        } else {
            os_issue<G>(c, u, g, w);
        }
#pragma unroll
        for (int j = 0; j < G; ++j) {
            const unsigned int q = (unsigned int)(g + j);
            if (q == c.rank) {
                os_acc<E>(acc, o);
            }
            if (q + 1u < c.world) {
                const unsigned long long src = os_src(c, q, u);
                uint4 x = w[j];
                if (!os_arrived(x)) {
                    const OsGot got = os_wait(src, x, c.ctrl, *c.t0);
                    if (!got.ok) {
                        return false;
                    }
                    x = got.v;
                }
                os_st(src, clear);
                os_acc<E>(acc, x);
            }
        }
    }
    if (c.rank >= (unsigned int)QMAX) {
        os_acc<E>(acc, o);
    }
    out = os_pack<E>(acc);
    return true;
}

// os_sum, written into `data`.
template <class E, int MP, int G>
__device__ __forceinline__ bool os_finish(const OsCall& c, typename E::Bits* data, unsigned int u,
                                          uint4 o, const uint4 (&v)[G])
{
    uint4 out;
    if (!os_sum<E, MP, G>(c, u, o, v, out)) {
        return false;
    }
    os_store<E>(data, c.n, u, c.aligned, out);
    return true;
}

// Phases 2-3 for one thread, for worlds of at most MP + 1 ranks, one unit
// at a time: the unit's loads from G peers at a time go out together
// before any is waited for, so a thread waits about one memory latency per
// group of peers rather than one per peer. False if the call stopped.
template <class E, int MP, int G>
__device__ __forceinline__ bool os_reduce(const OsCall& c, typename E::Bits* data, uint4 first)
{
    for (unsigned int i = 0; i < c.cnt; ++i) {
        const unsigned int u = c.tid + i * c.stride;
        uint4 v[G];
        os_issue<G>(c, u, 0, v);
        uint4 o = first;
        if (i != 0u) {
            o = os_canon(os_load<E>(data, c.n, u, c.aligned));
        }
        if (!os_finish<E, MP, G>(c, data, u, o, v)) {
            return false;
        }
    }
    return true;
}

// The kernel of every type: `data` holds `n` values of E.
template <class E>
__device__ __forceinline__ void os_one_shot(OsCtrl* ctrl, typename E::Bits* data,
                                            unsigned long long n, unsigned int lane)
{
    __shared__ unsigned int s_epoch;
    __shared__ unsigned int s_go;
    __shared__ unsigned long long s_peer[OS_MAX_RANKS];
    __shared__ unsigned long long s_t0;

    OsCall c;
    c.ctrl = ctrl;
    c.t0 = &s_t0;
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
        s_t0 = os_clock();
        f = os_ld32(failed);
        w = atomicOr(&l->claim, tag << OS_EPOCH_BITS);
    }
    volatile unsigned int* flags = reinterpret_cast<volatile unsigned int*>(ctrl->flags);
    // A count no slot can hold loads nothing (the launch is refused below).
    c.n = n <= OS_MAX_SLOT ? (unsigned int)n : 0u;
    c.world = ctrl->world;
    c.rank = ctrl->rank;
    const unsigned long long slot = ctrl->slot_bytes;
    c.slot = (unsigned int)slot;
    const unsigned int units = (c.n + E::PER - 1u) / E::PER;
    c.aligned = (reinterpret_cast<unsigned long long>(data) & 15ull) == 0ull;
    c.tid = blockIdx.x * blockDim.x + threadIdx.x;
    c.stride = gridDim.x * blockDim.x;
    c.cnt = c.tid < units ? (units - c.tid + c.stride - 1u) / c.stride : 0u;
    const bool bad = lane >= OS_LANES || c.world < 2u || c.world > OS_MAX_RANKS || c.rank >= c.world ||
                     c.n == 0u || (unsigned long long)c.n * sizeof(typename E::Bits) > slot ||
                     slot > OS_MAX_SLOT || (slot & 15ull) != 0ull;
    uint4 first = make_uint4(0u, 0u, 0u, 0u);
    if (c.cnt != 0u) {
        first = os_canon(os_load<E>(data, c.n, c.tid, c.aligned));
    }

    if (threadIdx.x == 0) {
        unsigned int go = 0u;
        if (bad) {
            os_fail(failed, flags, OS_STATUS_BAD_LAUNCH);
        } else if (f == 0u) {
            go = ((w >> OS_EPOCH_BITS) == 0ull || (w >> OS_EPOCH_BITS) == tag) ? 1u : 0u;
            if (go == 0u) {
                os_fail(failed, flags, OS_STATUS_CONCURRENT);
            }
        }
        s_go = go;
        s_epoch = (unsigned int)(w & ((1ull << OS_EPOCH_BITS) - 1ull));
    }
    if (threadIdx.x < OS_MAX_RANKS) {
        s_peer[threadIdx.x] = ctrl->peer[threadIdx.x];
    }
    __syncthreads();
    if (s_go == 0u) {
        return;
    }

    const unsigned int half = s_epoch & 1u;
    const unsigned int region = (lane * OS_HALVES + half) * c.world * c.slot;
    c.mine = s_peer[c.rank] + region;

    // 1. Push this rank's contribution into slot `rank` of every peer, two
    // units' loads issued before their stores.
    const unsigned int out = region + c.rank * c.slot;
    for (unsigned int i = 0; i < c.cnt; i += 2u) {
        const unsigned int u0 = c.tid + i * c.stride;
        const unsigned int u1 = u0 + c.stride;
        const bool two = i + 1u < c.cnt;
        uint4 a = first;
        if (i != 0u) {
            a = os_canon(os_load<E>(data, c.n, u0, c.aligned));
        }
        uint4 b = make_uint4(0u, 0u, 0u, 0u);
        if (two) {
            b = os_canon(os_load<E>(data, c.n, u1, c.aligned));
        }
        for (unsigned int p = 0; p < c.world; ++p) {
            if (p != c.rank) {
                os_st(s_peer[p] + (out + u0 * 16u), a);
                if (two) {
                    os_st(s_peer[p] + (out + u1 * 16u), b);
                }
            }
        }
    }

    // 2-3. Wait for every contribution, add in rank order, clear, round:
    // the world's size bounds how many peers' loads go out together.
    bool ok;
    if (c.world == 2u) {
        ok = os_reduce<E, 1, 1>(c, data, first);
    } else if (c.world <= 4u) {
        ok = os_reduce<E, 3, 3>(c, data, first);
    } else {
        ok = os_reduce<E, 7, 4>(c, data, first);
    }

    // 4. The last block to arrive frees the lane at the next epoch, in one
    // store; a one-block call needs no count. No fence: the next call on
    // the lane is ordered after this one by its stream (or graph), and a
    // kernel's writes are performed before the work after it starts.
    if (__syncthreads_or(ok ? 0 : 1)) {
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
            atomicExch(&l->claim,
                       (unsigned long long)((s_epoch + 1u) & ((1u << OS_EPOCH_BITS) - 1u)));
        }
    }
}

// The fused entries: the one-shot all-reduce of x, then the residual add +
// RMSNorm (norm.cuh) on the sums while they are in registers:
// residual <- sum + residual, x <- rms_norm(residual) * weight. A row's
// 16-byte units are split over the row's threads (unit j of a row: t,
// t + T, ... for thread t of T), and a row's unit j is unit
// row * units_row + j of the call, so the slots, the push and the sums are
// the plain kernel's (bit for bit) and the norm is add_rms_norm.cu's (the
// same chunks, threads and tree).
//
// Two builds of the same code (OsSplit):
// - {bf16,f16,f32}_one_shot_add_rms_norm (one_shot.ptx, compute_80): a
//   row is a block's: T = blockDim.x, rows b, b + gridDim.x, ... of block b;
//   the squares are summed over the block (norm_block_sum).
// - {bf16,f16,f32}_one_shot_add_rms_norm_cluster (one_shot_sm90.ptx, this
//   file with OS_CLUSTER, compute_90): a row is a thread block cluster's,
//   its c blocks' threads in block rank order (T = c * blockDim.x, thread
//   rank * blockDim.x + threadIdx.x), rows k, k + (clusters), ... of
//   cluster k; each warp's butterfly sum goes into every block's shared
//   memory (distributed shared memory), and after one cluster barrier every
//   warp adds the T / 32 warp sums by the same butterfly: the same tree, so
//   the same bits, as one block of T threads. A row's units spread over c
//   SMs instead of one.
//
// Launch contract (refused with the bad-launch status otherwise):
//   params: ctrl, lane as the plain entries; x: rows * hidden values, read
//           (this rank's contribution) and written (the output); residual:
//           rows * hidden values, read and written; weight: hidden values;
//           hidden: 1 to NORM_MAX_HIDDEN, hidden * size a multiple of 16;
//           rows >= 1, rows * hidden * size <= ctrl->slot_bytes; eps.
//   x, residual and weight 16-byte aligned.
//   block: T = norm_threads(hidden, size) threads a row (a multiple of 32,
//          at most NORM_BLOCK): blockDim.x = T, or for the cluster entries
//          blockDim.x = T / c (a multiple of 32) in clusters of (c, 1, 1),
//          c at most NORM_MAX_CLUSTER; grid: at most 32 blocks (the host's
//          min(rows, 32), in clusters: as many blocks in all); any grid is
//          correct. At most 64 registers a thread (OS_MIN_BLOCKS), as the
//          plain entries: 8 ranks' calls simulated on one GPU must all be
//          resident at once.

#ifdef OS_CLUSTER
__device__ __forceinline__ unsigned int os_cta_rank()
{
    unsigned int r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ unsigned int os_cta_count()
{
    unsigned int r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ unsigned int os_cluster_id()
{
    unsigned int r;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    return r;
}

__device__ __forceinline__ unsigned int os_clusters()
{
    unsigned int r;
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return r;
}

// The address of `p` (in this block's shared memory) in the shared memory
// of block `rank` of the cluster.
__device__ __forceinline__ unsigned int os_map(const void* p, unsigned int rank)
{
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
    unsigned int d;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(rank));
    return d;
}

// Every thread of every block of the cluster arrives (its shared-memory
// writes released) and waits for all (theirs acquired).
__device__ __forceinline__ void os_cluster_sync()
{
    asm volatile("barrier.cluster.arrive;\n\tbarrier.cluster.wait;" ::: "memory");
}

// The start of a cluster entry: every thread arrives first thing, and
// waits once (os_cluster_started), on every path, after the call's checks
// and before any store into another block's shared memory, which exists
// only once that block has started: the arrival of all of the block's
// threads says it has.
__device__ __forceinline__ void os_cluster_arrive()
{
    asm volatile("barrier.cluster.arrive;" ::: "memory");
}

__device__ __forceinline__ void os_cluster_started()
{
    asm volatile("barrier.cluster.wait;" ::: "memory");
}

// The row's sum of `v` over the cluster's T threads, in every thread, by
// norm_block_sum's tree, and in `stop` whether any thread's `ok` was
// false. Called by every thread of every block of the cluster, once a row,
// after the start's wait (os_cluster_arrive). `par` alternates between a
// block's consecutive rows: a block writes buffer p for row i into another
// block's memory after the barrier of row i - 1, which that block reached
// after reading buffer p for row i - 2, so one barrier a row suffices; and
// after a block's last barrier no other block touches its memory, so it
// may exit.
__device__ __forceinline__ float os_cluster_sum(float v, bool ok, unsigned int par, bool& stop)
{
    __shared__ float s_sum[2][NORM_BLOCK / 32];
    __shared__ unsigned int s_stop[2][NORM_BLOCK / 32];
    v = norm_warp_sum(v);
    const unsigned int any = __any_sync(0xFFFFFFFFu, ok ? 0 : 1);
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int c = os_cta_count();
    const unsigned int w = os_cta_rank() * (blockDim.x >> 5) + (threadIdx.x >> 5);
    // Every lane holds the warp's sum; lane r writes it into block r.
    if (lane < c) {
        asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(os_map(&s_sum[par][w], lane)), "f"(v)
                     : "memory");
        asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(os_map(&s_stop[par][w], lane)),
                     "r"(any)
                     : "memory");
    }
    os_cluster_sync();
    const unsigned int warps = (c * blockDim.x) >> 5;
    stop = __any_sync(0xFFFFFFFFu, lane < warps && s_stop[par][lane] != 0u) != 0;
    const float t = lane < warps ? s_sum[par][lane] : 0.0f;
    return norm_warp_sum(t);
}
#endif

#ifdef NORM_ONE_BARRIER
// The variant `one-barrier` (norm.cuh's norm_block_sum): the row's sum of
// `v` over the block's threads by norm_block_sum's tree, and in `stop`
// whether any thread's `ok` was false, behind one barrier a row: each
// warp's sum and stop flag go into buffer `par`, as norm_block_sum's.
__device__ __forceinline__ float os_block_sum(float v, bool ok, unsigned int par, bool& stop)
{
    __shared__ float s_sum[2][NORM_BLOCK / 32];
    __shared__ unsigned int s_stop[2][NORM_BLOCK / 32];
    v = norm_warp_sum(v);
    const unsigned int any = __any_sync(0xFFFFFFFFu, ok ? 0 : 1);
    const unsigned int lane = threadIdx.x & 31u;
    if (lane == 0u) {
        s_sum[par][threadIdx.x >> 5] = v;
        s_stop[par][threadIdx.x >> 5] = any;
    }
    __syncthreads();
    const unsigned int warps = blockDim.x >> 5;
    stop = __any_sync(0xFFFFFFFFu, lane < warps && s_stop[par][lane] != 0u) != 0;
    const float t = lane < warps ? s_sum[par][lane] : 0.0f;
    return norm_warp_sum(t);
}
#endif

// Where a thread's part of the call lies: its index among a row's
// threads (t), their count (n), the first of its block's (cluster's) rows
// and the step to the next; read from the special registers where used,
// so they hold no register across the call.
template <bool CL>
struct OsSplit {
    static __device__ __forceinline__ unsigned int t() { return threadIdx.x; }
    static __device__ __forceinline__ unsigned int n() { return blockDim.x; }
    static __device__ __forceinline__ unsigned int first() { return blockIdx.x; }
    static __device__ __forceinline__ unsigned int step() { return gridDim.x; }
};

#ifdef OS_CLUSTER
template <>
struct OsSplit<true> {
    static __device__ __forceinline__ unsigned int t()
    {
        return os_cta_rank() * blockDim.x + threadIdx.x;
    }
    static __device__ __forceinline__ unsigned int n() { return os_cta_count() * blockDim.x; }
    static __device__ __forceinline__ unsigned int first() { return os_cluster_id(); }
    static __device__ __forceinline__ unsigned int step() { return os_clusters(); }
};
#endif

// The row's sum of squares over its threads (`it`: the row's index among
// the block's or cluster's rows); false when a thread's `ok` was false (the
// call stopped). Every thread of the row calls it.
template <bool CL>
__device__ __forceinline__ bool os_row_sum(float acc, bool ok, unsigned int it, float& ss)
{
    if constexpr (CL) {
#ifdef OS_CLUSTER
        bool stop;
        ss = os_cluster_sum(acc, ok, it & 1u, stop);
        return !stop;
#else
        return false;
#endif
    } else {
#ifdef NORM_ONE_BARRIER
        bool stop;
        ss = os_block_sum(acc, ok, it & 1u, stop);
        return !stop;
#else
        ss = norm_block_sum(acc, it & 1u);
        return !__syncthreads_or(ok ? 0 : 1);
#endif
    }
}

// Steps 3 and 4 of a row: its sum of squares over its threads
// (os_row_sum) and the scale 1 / sqrt(ss / hidden + eps) in `inv`; false
// when the call stopped. (The probes OS_PROBE_NOSUM and OS_PROBE_NOINV
// leave out one step each.)
template <bool CL>
__device__ __forceinline__ bool os_row_inv(float acc, bool ok, unsigned int it,
                                           unsigned int hidden, float eps, float& inv)
{
    float ss;
#ifdef OS_PROBE_NOSUM
    ss = acc;
    if (!ok) {
        return false;
    }
#else
    if (!os_row_sum<CL>(acc, ok, it, ss)) {
        return false;
    }
#endif
#ifdef OS_PROBE_NOINV
    inv = ss;
#else
    inv = norm_inv(ss, hidden, eps);
#endif
    return true;
}

// A cluster entry's arrival at its start, and its one wait for every
// block's (os_cluster_arrive); nothing in the one-block entries.
template <bool CL>
__device__ __forceinline__ void os_cluster_begin()
{
#ifdef OS_CLUSTER
    if constexpr (CL) {
        os_cluster_arrive();
    }
#endif
}

template <bool CL>
__device__ __forceinline__ void os_cluster_wait_started()
{
#ifdef OS_CLUSTER
    if constexpr (CL) {
        os_cluster_started();
    }
#endif
}

// One row: waits, sums, clears (os_sum), adds the residual, reduces the
// squares over the row's threads, scales. Every thread of the row calls it
// and gets the same answer (false: the call stopped).
template <class E, class N, int MP, int G, bool CL>
__device__ __forceinline__ bool os_fused_row(const OsCall& c,
                                             typename E::Bits* x, typename E::Bits* res,
                                             const typename E::Bits* weight, unsigned int row,
                                             unsigned int it, unsigned int units_row,
                                             unsigned int hidden, float eps)
{
    typedef OsSplit<CL> S;
    typename E::Bits* xr = x + (unsigned long long)row * hidden;
    typename E::Bits* rr = res + (unsigned long long)row * hidden;
    float acc = 0.0f;
    bool ok = true;
    for (unsigned int j = S::t(); ok && j < units_row; j += S::n()) {
        const unsigned int u = row * units_row + j;
        uint4 v[G];
        os_issue<G>(c, u, 0, v);
        const uint4 o = os_canon(*reinterpret_cast<const uint4*>(xr + j * E::PER));
        uint4 sum;
        ok = os_sum<E, MP, G>(c, u, o, v, sum);
        if (ok) {
#ifdef OS_PROBE_BARE
            *reinterpret_cast<uint4*>(xr + j * E::PER) = sum;
#else
            uint4* at = reinterpret_cast<uint4*>(rr + j * E::PER);
            *at = norm_add<N>(sum, *at, acc);
#endif
        }
    }
#ifdef OS_PROBE_BARE
    return ok;
#endif
    float inv;
    if (!os_row_inv<CL>(acc, ok, it, hidden, eps, inv)) {
        return false;
    }
    for (unsigned int j = S::t(); j < units_row; j += S::n()) {
        const uint4 r = *reinterpret_cast<const uint4*>(rr + j * E::PER);
        const uint4 w = *reinterpret_cast<const uint4*>(weight + j * E::PER);
        *reinterpret_cast<uint4*>(xr + j * E::PER) = norm_scale<N>(r, w, inv);
    }
    return true;
}

// The units of a row a thread holds in registers from its sum to its
// scaling (bf16 and f16 rows up to 8,192 values, f32 up to 4,096, at
// NORM_BLOCK threads a row), in worlds of 2 ranks; a longer row, or a
// larger world, takes os_fused_row. At 3-8 ranks the wider waits' loads
// beside the held units pass the 64 registers a thread (OS_MIN_BLOCKS) and
// spill: that build was up to 15 % slower at 8 simulated ranks (one H100,
// norm_local), where at 2 ranks this path is 0-9 % faster.
constexpr unsigned int OS_ROW_REGS = 2u;
static_assert(OS_ROW_REGS == 2u, "os_fused's push names the registers xv[0] and xv[1]");

// os_fused_row for a row of at most OS_ROW_REGS units a thread: the
// residual's and the weight's units are loaded beside the peers' (one
// round trip, not one after the sum and one after the row's sum), and
// the new residual stays in registers for the scaling. The arithmetic
// and its order are os_fused_row's.
template <class E, class N, int MP, int G, bool CL>
__device__ __forceinline__ bool os_fused_row_regs(const OsCall& c,
                                                  typename E::Bits* x, typename E::Bits* res,
                                                  const typename E::Bits* weight,
                                                  unsigned int row, unsigned int it,
                                                  unsigned int units_row, unsigned int hidden,
                                                  float eps)
{
    typedef OsSplit<CL> S;
    typename E::Bits* xr = x + (unsigned long long)row * hidden;
    typename E::Bits* rr = res + (unsigned long long)row * hidden;
    float acc = 0.0f;
    bool ok = true;
    uint4 r[OS_ROW_REGS];
    uint4 wv[OS_ROW_REGS];
#pragma unroll
    for (unsigned int k = 0; k < OS_ROW_REGS; ++k) {
        const unsigned int j = S::t() + k * S::n();
        r[k] = make_uint4(0u, 0u, 0u, 0u);
        wv[k] = r[k];
        if (ok && j < units_row) {
            const unsigned int u = row * units_row + j;
            uint4 v[G];
            os_issue<G>(c, u, 0, v);
            const uint4 o = os_canon(*reinterpret_cast<const uint4*>(xr + j * E::PER));
            const uint4 old = *reinterpret_cast<const uint4*>(rr + j * E::PER);
            wv[k] = *reinterpret_cast<const uint4*>(weight + j * E::PER);
            uint4 sum;
            ok = os_sum<E, MP, G>(c, u, o, v, sum);
            if (ok) {
#ifdef OS_PROBE_BARE
                *reinterpret_cast<uint4*>(xr + j * E::PER) = sum;
#else
                r[k] = norm_add<N>(sum, old, acc);
                *reinterpret_cast<uint4*>(rr + j * E::PER) = r[k];
#endif
            }
        }
    }
#ifdef OS_PROBE_BARE
    return ok;
#endif
    float inv;
    if (!os_row_inv<CL>(acc, ok, it, hidden, eps, inv)) {
        return false;
    }
#pragma unroll
    for (unsigned int k = 0; k < OS_ROW_REGS; ++k) {
        const unsigned int j = S::t() + k * S::n();
        if (j < units_row) {
            *reinterpret_cast<uint4*>(xr + j * E::PER) = norm_scale<N>(r[k], wv[k], inv);
        }
    }
    return true;
}

// Whether this build's fused entries compute rows at worlds of class `k`
// (2: two ranks, 4: three or four, 8: five to eight): every class, but in
// the timing probes OS_FUSED_WORLD=k (wrong results at the other worlds),
// which show what the other classes' code costs the one measured.
__device__ __forceinline__ constexpr bool os_fused_world(unsigned int k)
{
#ifdef OS_FUSED_WORLD
    return k == OS_FUSED_WORLD;
#else
    (void)k;
    return true;
#endif
}

template <class E, class N, bool CL>
__device__ __forceinline__ void os_fused(OsCtrl* ctrl, typename E::Bits* x, typename E::Bits* res,
                                         const typename E::Bits* weight,
                                         unsigned long long hidden64, unsigned long long rows64,
                                         float eps, unsigned int lane)
{
    __shared__ unsigned int s_epoch;
    __shared__ unsigned int s_go;
    __shared__ unsigned long long s_peer[OS_MAX_RANKS];
    __shared__ unsigned long long s_t0;

    typedef OsSplit<CL> S;
#ifdef OS_PROBE_EMPTY
    return;
#endif
    os_cluster_begin<CL>();
    OsCall c;
    c.ctrl = ctrl;
    c.t0 = &s_t0;
    OsLane* l = &ctrl->lane[lane & 1u];
    unsigned int* failed = &ctrl->failed;
    const unsigned long long tag = os_tag();
    unsigned int f = 0u;
    unsigned long long w = 0ull;
    if (threadIdx.x == 0) {
        s_t0 = os_clock();
        f = os_ld32(failed);
        w = atomicOr(&l->claim, tag << OS_EPOCH_BITS);
    }
    volatile unsigned int* flags = reinterpret_cast<volatile unsigned int*>(ctrl->flags);
    c.world = ctrl->world;
    c.rank = ctrl->rank;
    const unsigned long long slot = ctrl->slot_bytes;
    c.slot = (unsigned int)slot;
    const unsigned long long size = sizeof(typename E::Bits);
    const bool shape_ok = hidden64 != 0ull && hidden64 <= NORM_MAX_HIDDEN && rows64 != 0ull &&
                          rows64 <= OS_MAX_SLOT && ((hidden64 * size) & 15ull) == 0ull &&
                          hidden64 * rows64 * size <= slot;
    const unsigned int hidden = shape_ok ? (unsigned int)hidden64 : 0u;
    const unsigned int rows = shape_ok ? (unsigned int)rows64 : 0u;
    c.n = hidden * rows;
    c.aligned = true;
    const unsigned int units_row = (unsigned int)(hidden * size / 16ull);
    // The units of the first row that a thread pushes are loaded beside
    // the claim, as the plain kernel's first unit is (they need nothing of
    // the control block); only the launch's own parameters decide them (a
    // shape or alignment the launch contract refuses loads nothing).
    const bool params_ok = hidden64 != 0ull && hidden64 <= NORM_MAX_HIDDEN && rows64 != 0ull &&
                           rows64 <= OS_MAX_SLOT && ((hidden64 * size) & 15ull) == 0ull &&
                           (blockDim.x & 31u) == 0u &&
                           ((reinterpret_cast<unsigned long long>(x) |
                             reinterpret_cast<unsigned long long>(res) |
                             reinterpret_cast<unsigned long long>(weight)) & 15ull) == 0ull;
    const unsigned int units_p = params_ok ? (unsigned int)(hidden64 * size / 16ull) : 0u;
    const bool regs = units_p != 0u && units_p <= OS_ROW_REGS * S::n();
    uint4 xv[OS_ROW_REGS];
#pragma unroll
    for (unsigned int k = 0; k < OS_ROW_REGS; ++k) {
        const unsigned int j = S::t() + k * S::n();
        xv[k] = make_uint4(0u, 0u, 0u, 0u);
        if (j < units_p && S::first() < rows64) {
            xv[k] = *reinterpret_cast<const uint4*>(
                x + ((unsigned long long)S::first() * units_p + j) * E::PER);
        }
    }
    const bool bad = !shape_ok || lane >= OS_LANES || c.world < 2u || c.world > OS_MAX_RANKS ||
                     c.rank >= c.world || slot > OS_MAX_SLOT || (slot & 15ull) != 0ull ||
                     (blockDim.x & 31u) != 0u || (CL && S::n() > NORM_BLOCK) ||
                     ((reinterpret_cast<unsigned long long>(x) |
                       reinterpret_cast<unsigned long long>(res) |
                       reinterpret_cast<unsigned long long>(weight)) & 15ull) != 0ull;

    if (threadIdx.x == 0) {
        unsigned int go = 0u;
        if (bad) {
            os_fail(failed, flags, OS_STATUS_BAD_LAUNCH);
        } else if (f == 0u) {
            go = ((w >> OS_EPOCH_BITS) == 0ull || (w >> OS_EPOCH_BITS) == tag) ? 1u : 0u;
            if (go == 0u) {
                os_fail(failed, flags, OS_STATUS_CONCURRENT);
            }
        }
        s_go = go;
        s_epoch = (unsigned int)(w & ((1ull << OS_EPOCH_BITS) - 1ull));
    }
    if (threadIdx.x < OS_MAX_RANKS) {
        s_peer[threadIdx.x] = ctrl->peer[threadIdx.x];
    }
    __syncthreads();
    os_cluster_wait_started<CL>();
    if (s_go == 0u) {
        // A cluster's blocks decide `go` each for itself (`bad` alike, the
        // rest from their own reads): a block that does not go still takes
        // its cluster's first barrier, saying stop, so that no block of
        // the cluster waits at a barrier for it (the others' waits end at
        // the status it found or recorded).
        if constexpr (CL) {
            if (!bad && S::first() < rows) {
                float ss;
                os_row_sum<CL>(0.0f, false, 0u, ss);
            }
        }
        return;
    }

    const unsigned int half = s_epoch & 1u;
    const unsigned int region = (lane * OS_HALVES + half) * c.world * c.slot;
    c.mine = s_peer[c.rank] + region;

    // 1. Push this block's (cluster's) rows into slot `rank` of every peer
    // (the first row's units a thread loaded beside the claim, OS_ROW_REGS
    // of them).
    const unsigned int out = region + c.rank * c.slot;
    for (unsigned int row = S::first(); row < rows; row += S::step()) {
        for (unsigned int j = S::t(); j < units_row; j += S::n()) {
            const unsigned int u = row * units_row + j;
            const unsigned int k = (j - S::t()) / S::n();
            const uint4 a = os_canon(
                row == S::first() && k < OS_ROW_REGS
                    ? (k == 0u ? xv[0] : xv[1])
                    : *reinterpret_cast<const uint4*>(x + (unsigned long long)u * E::PER));
            for (unsigned int p = 0; p < c.world; ++p) {
                if (p != c.rank) {
                    os_st(s_peer[p] + (out + u * 16u), a);
                }
            }
        }
    }

    // 2-3 and the norm, row by row: a row held in registers at 2 ranks,
    // else os_fused_row. (The branches are written as they were measured
    // on the GPU; folding the first one's worlds into the second changes
    // the PTX.)
    bool ok = true;
    unsigned int it = 0u;
    for (unsigned int row = S::first(); ok && row < rows; row += S::step(), ++it) {
        if (regs) {
            if (c.world == 2u) {
                if (os_fused_world(2u)) {
                    ok = os_fused_row_regs<E, N, 1, 1, CL>(c, x, res, weight, row, it,
                                                           units_row, hidden, eps);
                }
            } else if (c.world <= 4u) {
                if (os_fused_world(4u)) {
                    ok = os_fused_row<E, N, 3, 3, CL>(c, x, res, weight, row, it, units_row,
                                                      hidden, eps);
                }
            } else if (os_fused_world(8u)) {
                ok = os_fused_row<E, N, 7, 4, CL>(c, x, res, weight, row, it, units_row, hidden,
                                                  eps);
            }
        } else if (c.world == 2u) {
            if (os_fused_world(2u)) {
                ok = os_fused_row<E, N, 1, 1, CL>(c, x, res, weight, row, it, units_row, hidden,
                                                  eps);
            }
        } else if (c.world <= 4u) {
            if (os_fused_world(4u)) {
                ok = os_fused_row<E, N, 3, 3, CL>(c, x, res, weight, row, it, units_row, hidden,
                                                  eps);
            }
        } else if (os_fused_world(8u)) {
            ok = os_fused_row<E, N, 7, 4, CL>(c, x, res, weight, row, it, units_row, hidden, eps);
        }
    }

    // 4. As the plain kernel: the last block frees the lane. (In a
    // cluster `ok` is the cluster's: every block stopped at the same row.)
    if (__syncthreads_or(ok ? 0 : 1)) {
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
            atomicExch(&l->claim,
                       (unsigned long long)((s_epoch + 1u) & ((1u << OS_EPOCH_BITS) - 1u)));
        }
    }
}

#ifdef OS_CLUSTER
extern "C" __global__ void __launch_bounds__(NORM_BLOCK, OS_MIN_BLOCKS)
bf16_one_shot_add_rms_norm_cluster(OsCtrl* ctrl, unsigned short* x, unsigned short* residual,
                                   const unsigned short* weight, unsigned long long hidden,
                                   unsigned long long rows, float eps, unsigned int lane)
{
    os_fused<OsBf16, NormBf16, true>(ctrl, x, residual, weight, hidden, rows, eps, lane);
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK, OS_MIN_BLOCKS)
f16_one_shot_add_rms_norm_cluster(OsCtrl* ctrl, unsigned short* x, unsigned short* residual,
                                  const unsigned short* weight, unsigned long long hidden,
                                  unsigned long long rows, float eps, unsigned int lane)
{
    os_fused<OsF16, NormF16, true>(ctrl, x, residual, weight, hidden, rows, eps, lane);
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK, OS_MIN_BLOCKS)
f32_one_shot_add_rms_norm_cluster(OsCtrl* ctrl, unsigned int* x, unsigned int* residual,
                                  const unsigned int* weight, unsigned long long hidden,
                                  unsigned long long rows, float eps, unsigned int lane)
{
    os_fused<OsF32, NormF32, true>(ctrl, x, residual, weight, hidden, rows, eps, lane);
}
#else
extern "C" __global__ void __launch_bounds__(NORM_BLOCK, OS_MIN_BLOCKS)
bf16_one_shot_add_rms_norm(OsCtrl* ctrl, unsigned short* x, unsigned short* residual,
                           const unsigned short* weight, unsigned long long hidden,
                           unsigned long long rows, float eps, unsigned int lane)
{
    os_fused<OsBf16, NormBf16, false>(ctrl, x, residual, weight, hidden, rows, eps, lane);
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK, OS_MIN_BLOCKS)
f16_one_shot_add_rms_norm(OsCtrl* ctrl, unsigned short* x, unsigned short* residual,
                          const unsigned short* weight, unsigned long long hidden,
                          unsigned long long rows, float eps, unsigned int lane)
{
    os_fused<OsF16, NormF16, false>(ctrl, x, residual, weight, hidden, rows, eps, lane);
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK, OS_MIN_BLOCKS)
f32_one_shot_add_rms_norm(OsCtrl* ctrl, unsigned int* x, unsigned int* residual,
                          const unsigned int* weight, unsigned long long hidden,
                          unsigned long long rows, float eps, unsigned int lane)
{
    os_fused<OsF32, NormF32, false>(ctrl, x, residual, weight, hidden, rows, eps, lane);
}

extern "C" __global__ void __launch_bounds__(OS_BLOCK, OS_MIN_BLOCKS)
bf16_one_shot_all_reduce(OsCtrl* ctrl, unsigned short* data, unsigned long long n,
                         unsigned int lane)
{
    os_one_shot<OsBf16>(ctrl, data, n, lane);
}

extern "C" __global__ void __launch_bounds__(OS_BLOCK, OS_MIN_BLOCKS)
f16_one_shot_all_reduce(OsCtrl* ctrl, unsigned short* data, unsigned long long n,
                        unsigned int lane)
{
    os_one_shot<OsF16>(ctrl, data, n, lane);
}

extern "C" __global__ void __launch_bounds__(OS_BLOCK, OS_MIN_BLOCKS)
f32_one_shot_all_reduce(OsCtrl* ctrl, unsigned int* data, unsigned long long n,
                        unsigned int lane)
{
    os_one_shot<OsF32>(ctrl, data, n, lane);
}
#endif
