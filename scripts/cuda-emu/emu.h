// Just enough of CUDA to run a kernel's source on the CPU, for checking a kernel's indexing,
// tiling and synchronization against a reference where there is no GPU: one block at a time,
// one std::thread per CUDA thread, __syncthreads a barrier of the block, __shfl_xor_sync
// through memory between two barriers of the warp (so a warp may shuffle alone), __shared__ arrays function statics (shared by the block's threads).
// Numerics are the CPU's (no fast-math intrinsics), so this checks logic, not rounding.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct float4 {
    float x, y, z, w;
};
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct uint3 {
    unsigned int x, y, z;
};
struct uint4 {
    unsigned int x, y, z, w;
};
thread_local uint3 threadIdx, blockIdx;
static uint3 blockDim, gridDim;
static std::barrier<>* block_barrier;
static std::vector<std::barrier<>*> warp_barriers;
static float shuffle_slots[1024];

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int off) {
    std::barrier<>* warp = warp_barriers[threadIdx.x / 32];
    shuffle_slots[threadIdx.x] = v;
    warp->arrive_and_wait();
    float r = shuffle_slots[threadIdx.x ^ off];
    warp->arrive_and_wait();
    return r;
}
static inline float __int_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
// Byte i of the result: byte (s >> 4i) & 7 of y:x.
static inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned int r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned int)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
}
// Shared memory is ordinary memory here: its "shared address" is the 32 low bits of the host
// address (kernels that load through such an address rebuild the pointer from them).
static inline size_t __cvta_generic_to_shared(const void* p) { return (size_t)(unsigned int)(size_t)p; }
using std::isfinite;
static inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }

// Runs `kernel` over the grid, block after block.
static void launch(uint3 grid, uint3 block, const std::function<void()>& kernel) {
    blockDim = block;
    gridDim = grid;
    for (unsigned by = 0; by < grid.y; by++)
        for (unsigned bx = 0; bx < grid.x; bx++) {
            std::barrier<> b(block.x);
            block_barrier = &b;
            // Blocks here are whole warps.
            std::vector<std::unique_ptr<std::barrier<>>> warps;
            warp_barriers.clear();
            for (unsigned w = 0; w < block.x / 32; w++) {
                warps.push_back(std::make_unique<std::barrier<>>(32));
                warp_barriers.push_back(warps.back().get());
            }
            std::vector<std::thread> threads;
            for (unsigned t = 0; t < block.x; t++)
                threads.emplace_back([&, t] {
                    threadIdx = {t, 0, 0};
                    blockIdx = {bx, by, 0};
                    kernel();
                });
            for (auto& t : threads) t.join();
        }
}
