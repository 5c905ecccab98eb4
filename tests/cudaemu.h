// Run CUDA C kernels on the CPU: one std::thread per CUDA thread, one block at a time.
// __syncthreads is a block barrier; warp intrinsics rendezvous the lanes named in their mask
// and abort on what CUDA leaves undefined (a calling lane outside the mask, a source lane
// outside the mask, lanes of one mask at different intrinsics, a lane that never arrives).
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct emu_dim3 {
    unsigned int x = 0, y = 0, z = 0;
};
static thread_local emu_dim3 threadIdx, blockIdx;
static emu_dim3 blockDim, gridDim;

namespace emu {

[[noreturn]] inline void die(const char* what, unsigned a = 0, unsigned b = 0, unsigned c = 0) {
    std::fprintf(stderr, "cudaemu: %s (block %u thread %u; %08x %08x %08x)\n", what, blockIdx.x,
                 threadIdx.x, a, b, c);
    std::fflush(stderr);
    std::abort();
}

constexpr auto kWait = std::chrono::seconds(20);

struct Barrier {
    std::mutex m;
    std::condition_variable cv;
    int n = 0, count = 0;
    long gen = 0;
    void wait() {
        std::unique_lock<std::mutex> l(m);
        long g = gen;
        if (++count == n) {
            count = 0;
            ++gen;
            cv.notify_all();
            return;
        }
        if (!cv.wait_for(l, kWait, [&] { return gen != g; }))
            die("__syncthreads: not every thread of the block arrived", count, n);
    }
};

enum Kind { ACTIVE = 1, BALLOT, SHFL, SHFL_UP, SHFL_DOWN };

struct Op {
    int kind = 0;
    unsigned arrived = 0;
    bool done = false;
    unsigned readers = 0;
    unsigned long long val[32] = {};
};

struct Warp {
    std::mutex m;
    std::condition_variable cv;
    unsigned all = 0, exited = 0;
    std::map<unsigned long long, Op> ops;  // key: mask (ACTIVE: 1 << 32)

    // Every lane of `mask` (ACTIVE: every lane not exited) arrives with v; each gets all values.
    unsigned rendezvous(unsigned lane, unsigned mask, int kind, unsigned long long v,
                        unsigned long long* out) {
        std::unique_lock<std::mutex> l(m);
        unsigned long long key = kind == ACTIVE ? (1ull << 32) : mask;
        if (kind != ACTIVE && !(mask >> lane & 1u)) die("warp op called by a lane outside its mask", mask, lane);
        if (kind != ACTIVE && (mask & ~all)) die("warp op mask names lanes that do not exist", mask, all);
        while (ops.count(key) && ops[key].done) cv.wait(l);  // the last round still draining
        Op& op = ops[key];
        if (op.arrived && op.kind != kind) die("lanes of one mask reached different warp ops", mask, op.kind, kind);
        op.kind = kind;
        op.val[lane] = v;
        op.arrived |= 1u << lane;
        auto complete = [&] {
            return kind == ACTIVE ? ((op.arrived | exited) == all) : (op.arrived == mask);
        };
        if (complete()) {
            op.done = true;
            op.readers = __builtin_popcount(op.arrived);
            cv.notify_all();
        } else if (!cv.wait_for(l, kWait, [&] { return op.done; })) {
            die("warp op: a lane of the mask never arrived", mask, op.arrived, exited);
        }
        std::memcpy(out, op.val, sizeof(op.val));
        unsigned arrived = op.arrived;
        if (--op.readers == 0) {
            ops.erase(key);
            cv.notify_all();
        }
        return arrived;
    }

    void exit(unsigned lane) {
        std::lock_guard<std::mutex> l(m);
        exited |= 1u << lane;
        auto it = ops.find(1ull << 32);
        if (it != ops.end() && !it->second.done && (it->second.arrived | exited) == all) {
            it->second.done = true;
            it->second.readers = __builtin_popcount(it->second.arrived);
        }
        cv.notify_all();
    }
};

struct Block {
    Barrier bar;
    std::vector<Warp> warps;
};
static Block* block_ = nullptr;

inline unsigned lane() { return threadIdx.x & 31; }
inline Warp& warp() { return block_->warps[threadIdx.x >> 5]; }

template <class F>
void launch(unsigned grid, unsigned block, F body) {
    if (grid == 0 || grid > 2147483647u) die("grid size out of range", grid);
    if (block == 0 || block > 1024) die("block size out of range", block);
    gridDim.x = grid;
    blockDim.x = block;
    for (unsigned b = 0; b < grid; ++b) {
        Block blk;
        blk.bar.n = (int)block;
        blk.warps = std::vector<Warp>((block + 31) / 32);
        for (unsigned w = 0; w < blk.warps.size(); ++w) {
            unsigned lanes = block - 32 * w >= 32 ? 32 : block - 32 * w;
            blk.warps[w].all = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
        }
        block_ = &blk;
        std::vector<std::thread> ts;
        ts.reserve(block);
        for (unsigned t = 0; t < block; ++t) {
            ts.emplace_back([&, t, b] {
                threadIdx.x = t;
                blockIdx.x = b;
                body();
                blk.warps[t >> 5].exit(t & 31);
            });
        }
        for (auto& th : ts) th.join();
        block_ = nullptr;
    }
}

template <class T>
unsigned long long bits_of(T v) {
    static_assert(sizeof(T) <= 8, "at most 64 bits");
    unsigned long long u = 0;
    std::memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T>
T from_bits(unsigned long long u) {
    T v;
    std::memcpy(&v, &u, sizeof(T));
    return v;
}

template <class T>
T shfl(int kind, unsigned mask, T v, int src) {
    unsigned long long vals[32];
    emu::warp().rendezvous(emu::lane(), mask, kind, bits_of(v), vals);
    if (src < 0 || src > 31) return v;  // (shfl_up/down past the warp's end: own value)
    if (!(mask >> src & 1u)) die("shfl from a lane outside the mask", mask, (unsigned)src);
    return from_bits<T>(vals[src]);
}

}  // namespace emu

inline void __syncthreads() { emu::block_->bar.wait(); }
inline unsigned __activemask() {
    unsigned long long vals[32];
    return emu::warp().rendezvous(emu::lane(), 0, emu::ACTIVE, 0, vals);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    unsigned long long vals[32];
    emu::warp().rendezvous(emu::lane(), mask, emu::BALLOT, pred != 0, vals);
    unsigned r = 0;
    for (int j = 0; j < 32; ++j)
        if ((mask >> j & 1u) && vals[j]) r |= 1u << j;
    return r;
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src) {
    return emu::shfl(emu::SHFL, mask, v, src);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned d) {
    return emu::shfl(emu::SHFL_UP, mask, v, (int)emu::lane() - (int)d);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned d) {
    int src = (int)emu::lane() + (int)d;
    return emu::shfl(emu::SHFL_DOWN, mask, v, src > 31 ? -1 : src);
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
