// The CUDA 4-bit GEMV (backend-cuda/kernels/linear_q4.cu) run on the CPU through emu.h and
// compared with the product in double computed straight from the packed bytes, absmax and NF4
// code table: 1 to 8 rows (and 12: two passes), k a multiple of 32 (the 16-byte path, one and
// several chunks of x), not (odd too: the element-wise path), packed not 16-byte aligned, x not
// 16-byte aligned, blocksizes 32 to 4096, with and without bias, n not a multiple of the block's
// columns, and output into a slice of a wider output (the columns around it keep their sentinel).
// Exits 1 on a difference over 1e-4 * (1 + sum |x w|).
#include "emu.h"

#include <cstdio>
#include <cstdlib>
#include <random>

#include "../../backend-cuda/kernels/linear_q4.cu"

static const float NF4[16] = {-1.0f,
                              -0.6961928009986877f,
                              -0.5250730514526367f,
                              -0.39491748809814453f,
                              -0.28444138169288635f,
                              -0.18477343022823334f,
                              -0.09105003625154495f,
                              0.0f,
                              0.07958029955625534f,
                              0.16093020141124725f,
                              0.24611230194568634f,
                              0.33791524171829224f,
                              0.44070982933044434f,
                              0.5626170039176941f,
                              0.7229568362236328f,
                              1.0f};

struct Case {
    unsigned rows, n, k, blocksize, has_bias, col0, n_total;
    unsigned packed_off;  // bytes: 8 makes `packed` 8- but not 16-byte aligned
    unsigned x_off;       // floats: 1 makes x 4- but not 16-byte aligned
};

// 64-byte aligned buffer, then `off` elements in.
template <typename T>
struct Buf {
    T* base;
    T* p;
    Buf(size_t count, unsigned off) {
        size_t bytes = ((count + off) * sizeof(T) + 63) / 64 * 64 + 64;
        base = static_cast<T*>(std::aligned_alloc(64, bytes));
        p = base + off;
    }
    ~Buf() { std::free(base); }
};

static int check(const Case& c) {
    std::mt19937 rng(c.rows * 7919 + c.n * 131 + c.k);
    std::normal_distribution<float> nd;
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> scale(0.25f, 2.f);
    size_t elems = (size_t)c.n * c.k, nblocks = (elems + c.blocksize - 1) / c.blocksize;
    Buf<unsigned char> packed((elems + 1) / 2, c.packed_off);
    Buf<float> x((size_t)c.rows * c.k, c.x_off);
    std::vector<float> absmax(nblocks), bias(c.n_total), out((size_t)c.rows * c.n_total, -7.f);
    for (size_t i = 0; i < (elems + 1) / 2; i++) packed.p[i] = (unsigned char)byte(rng);
    for (size_t i = 0; i < (size_t)c.rows * c.k; i++) x.p[i] = nd(rng);
    for (auto& a : absmax) a = scale(rng);
    for (auto& b : bias) b = nd(rng);
    unsigned blocks = (c.n + LQ4_COLS_PER_BLOCK - 1) / LQ4_COLS_PER_BLOCK;
    launch({blocks, 1, 1}, {LQ4_THREADS, 1, 1}, [&] {
        linear_q4(x.p, packed.p, absmax.data(), NF4, bias.data(), out.data(), c.rows, c.n, c.k,
                  c.blocksize, c.has_bias, c.n_total, c.col0);
    });
    double err = 0, rel = 0;
    bool ok = true;
    for (unsigned m = 0; m < c.rows; m++)
        for (unsigned j = 0; j < c.n_total; j++) {
            float got = out[(size_t)m * c.n_total + j];
            if (j < c.col0 || j >= c.col0 + c.n) {
                if (got != -7.f) ok = false;  // outside the slice: untouched
                continue;
            }
            unsigned col = j - c.col0;
            double y = 0, mag = 0;
            for (unsigned kk = 0; kk < c.k; kk++) {
                size_t e = (size_t)col * c.k + kk;
                unsigned b = packed.p[e >> 1], q = (e & 1) ? (b & 15) : (b >> 4);
                double w = (double)NF4[q] * absmax[e / c.blocksize];
                y += x.p[(size_t)m * c.k + kk] * w;
                mag += std::fabs(x.p[(size_t)m * c.k + kk] * w);
            }
            if (c.has_bias) y += bias[j];
            double d = std::fabs(y - got);
            err = std::max(err, d);
            rel = std::max(rel, d / (1 + mag));
            if (!(d <= 1e-4 * (1 + mag))) ok = false;
        }
    bool pow2 = c.blocksize >= 32 && (c.blocksize & (c.blocksize - 1)) == 0;
    bool vec16 = pow2 && c.k % 32 == 0 && (size_t)packed.p % 16 == 0;
    bool x16 = c.k % 4 == 0 && (size_t)x.p % 16 == 0;
    std::printf("linear_q4 rows %2u n %3u k %4u bs %4u bias %u col0 %2u n_total %3u %-12s x %-6s: "
                "max |diff| %.2e rel %.2e %s\n",
                c.rows, c.n, c.k, c.blocksize, c.has_bias, c.col0, c.n_total,
                vec16 ? "16-byte" : "element-wise", x16 ? "float4" : "scalar", err, rel,
                ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}

int main() {
    int failed = 0;
    for (Case c : {
             Case{1, 70, 64, 64, 0, 0, 70, 0, 0},        // ragged last block
             Case{3, 40, 1024, 64, 1, 5, 50, 0, 0},      // slice of a wider output
             Case{8, 33, 4160, 4096, 1, 0, 33, 0, 0},    // 5 chunks of x, the last 64 wide
             Case{1, 37, 8256, 128, 0, 0, 37, 0, 0},     // one row: 2 chunks
             Case{3, 50, 3000, 64, 1, 3, 60, 0, 0},      // k not a multiple of 32, 2 chunks
             Case{8, 20, 95, 32, 0, 0, 20, 0, 0},        // odd k
             Case{1, 65, 95, 64, 1, 0, 65, 0, 0},        // odd k, ragged
             Case{8, 64, 1024, 4096, 1, 64, 200, 0, 0},  // whole blocks, slice
             Case{3, 9, 4160, 32, 0, 0, 9, 0, 0},        // 2 chunks, blocksize 32
             Case{2, 45, 256, 64, 1, 0, 45, 8, 0},       // packed not 16-byte aligned
             Case{5, 45, 512, 256, 0, 0, 45, 0, 1},      // x not 16-byte aligned
             Case{4, 31, 1056, 32, 1, 0, 31, 0, 0},      // one block, last warp partial
             Case{7, 100, 2080, 2048, 0, 10, 120, 0, 0}, // odd group count per chunk
             Case{6, 16, 100, 64, 1, 0, 16, 0, 0},       // k % 4 == 0, not % 32
             Case{12, 40, 256, 64, 1, 2, 44, 0, 0},      // over 8 rows: two passes
         })
        failed += check(c);
    return failed ? 1 : 0;
}
