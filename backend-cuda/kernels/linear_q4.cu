// GEMV path of the 4-bit linear (decode and batched decode: rows <= GEMV_MAX_ROWS = 8, more go to
// cuBLAS): y[m, col0 + c] = sum_kk x[m, kk] * W[c, kk] (+ bias[col0 + c]), out's row stride n_total,
// W in bitsandbytes 4-bit: element e = c * k + kk is byte e >> 1 of `packed`, high nibble for even
// e, low for odd; its value __fmul_rn(code[q], absmax[e / blocksize]) (rounded to f32, then times
// x, f32 accumulation).
//
// Launch shape (backend-cuda/src/lib.rs launch_config, LINEAR_Q4_COLS_PER_BLOCK there):
//   block (LQ4_THREADS = 256, 1, 1); grid (ceil(n / LQ4_COLS_PER_BLOCK), 1, 1), LQ4_COLS_PER_BLOCK
//   = 32 columns; no dynamic shared memory (33,344 bytes static).
// Each of a block's 8 warps owns LQ4_COLS = 4 consecutive output columns and each lane keeps
// rows x 4 accumulators, so each weight row is read once for all rows of x (up to LQ4_MAX_ROWS = 8
// per pass; more rows, which the backend never sends here, take further passes). x is staged in
// shared memory in chunks (1024 columns for 8 rows, 7392 for one; LQ4_XS floats in all), read by
// the 32 columns of the block; the code table lives in shared memory too.
// Fast path (k % 32 == 0, `packed` 16-byte aligned, blocksize a power of two >= 32): a lane reads
// the 32 codes of a column's 32-column group with one 16-byte load (32 codes never straddle an
// absmax block), two groups per column in flight (the first ones issued before x is staged). Any
// other shape takes the element-wise path. Warp shuffle reduction at the end.
// Memory-bound on `packed`: half a byte per multiply-add of each row of x.

constexpr unsigned int LQ4_THREADS = 256;
constexpr unsigned int LQ4_COLS = 4;  // columns per warp
constexpr unsigned int LQ4_COLS_PER_BLOCK = (LQ4_THREADS / 32) * LQ4_COLS;  // 32
constexpr unsigned int LQ4_MAX_ROWS = 8;
// Floats of x in shared memory (32.5 KiB). A chunk of x is G groups of 32 columns; group g holds
// its nr rows one after the other (row m at float 32m) and takes gs = 32 nr + 4 floats: the pad
// puts the groups that the 8 lanes of a quarter warp read at once (same row and float4, 8
// consecutive groups) in 8 distinct bank quads. G = LQ4_XS / gs (32 for 8 rows).
constexpr unsigned int LQ4_XS = 8320;

// table[q] from its shared-memory address, which one byte permute makes: the table is 256-byte
// aligned, so its address with the low byte replaced by 4q (what the nibble masks below give) is
// that of table[q], with no add per code.
__device__ __forceinline__ float lq4_code(const float* table, unsigned int addr) {
#ifdef __CUDA_ARCH__
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
    return v;
#else
    // CPU emulation (scripts/cuda-emu): the 32 low bits of the table's host address.
    return *(const float*)(((size_t)table & ~(size_t)0xFFFFFFFFu) | addr);
#endif
}

// The 16-byte loads (32 codes per column) of group g of this chunk, and their scales.
__device__ __forceinline__ void lq4_load(uint4 (&wd)[LQ4_COLS], float (&s)[LQ4_COLS],
                                         const uint4* p, const float* absmax,
                                         const size_t (&base)[LQ4_COLS], unsigned int k0,
                                         unsigned int g, unsigned int bshift) {
#pragma unroll
    for (unsigned int c = 0; c < LQ4_COLS; c++) {
        const size_t e = base[c] + k0 + (size_t)g * 32;
        wd[c] = p[e >> 5];
        s[c] = absmax[e >> bshift];
    }
}

// acc[m][c] += x[m, group g] . W[column c, group g] for the 32 codes of group g of the chunk and
// the nr rows of this pass; xg: the group's x in shared memory.
__device__ __forceinline__ void lq4_group(float (&acc)[LQ4_MAX_ROWS][LQ4_COLS],
                                          const uint4 (&wd)[LQ4_COLS], const float (&s)[LQ4_COLS],
                                          const float4* xg, const float* table, unsigned int tbase,
                                          unsigned int nr) {
#pragma unroll
    for (unsigned int w = 0; w < 4; w++) {
        // Byte j of hi / lo: 4 * the high / low nibble of byte j of the word.
        unsigned int hi[LQ4_COLS], lo[LQ4_COLS];
#pragma unroll
        for (unsigned int c = 0; c < LQ4_COLS; c++) {
            const unsigned int word = w == 0 ? wd[c].x : w == 1 ? wd[c].y : w == 2 ? wd[c].z : wd[c].w;
            hi[c] = (word >> 2) & 0x3C3C3C3Cu;
            lo[c] = (word << 2) & 0x3C3C3C3Cu;
        }
#pragma unroll
        for (unsigned int h = 0; h < 2; h++) {
            // Codes 8w + 4h .. 8w + 4h + 3: bytes 2h and 2h + 1 of the word, high nibble first.
            float wv[LQ4_COLS][4];
#pragma unroll
            for (unsigned int c = 0; c < LQ4_COLS; c++) {
#pragma unroll
                for (unsigned int b = 0; b < 2; b++) {
                    // Byte 2h + b of hi / lo below the table address' upper three bytes.
                    const unsigned int sel = 0x7650u + 2 * h + b;
                    wv[c][2 * b] = __fmul_rn(lq4_code(table, __byte_perm(hi[c], tbase, sel)), s[c]);
                    wv[c][2 * b + 1] = __fmul_rn(lq4_code(table, __byte_perm(lo[c], tbase, sel)), s[c]);
                }
            }
#pragma unroll
            for (unsigned int m = 0; m < LQ4_MAX_ROWS; m++) {
                if (m >= nr) break;
                const float4 xv = xg[m * 8 + 2 * w + h];
#pragma unroll
                for (unsigned int c = 0; c < LQ4_COLS; c++) {
                    float a = acc[m][c];
                    a += xv.x * wv[c][0];
                    a += xv.y * wv[c][1];
                    a += xv.z * wv[c][2];
                    a += xv.w * wv[c][3];
                    acc[m][c] = a;
                }
            }
        }
    }
}

extern "C" __launch_bounds__(LQ4_THREADS, 2) __global__ void linear_q4(
    const float* x, const unsigned char* packed, const float* absmax, const float* code,
    const float* bias, float* out, unsigned int rows, unsigned int n, unsigned int k,
    unsigned int blocksize, unsigned int has_bias, unsigned int n_total, unsigned int col0) {
    __shared__ __align__(256) float table[16];  // 256-byte aligned: see lq4_code
    __shared__ float4 xs4[LQ4_XS / 4];
    float* xs = (float*)xs4;
    if (rows == 0 || n == 0) return;  // the whole block, before any barrier
    if (threadIdx.x < 16) table[threadIdx.x] = code[threadIdx.x];  // read after the barriers below
    const bool pow2 = blocksize >= 32 && (blocksize & (blocksize - 1)) == 0;
    const bool vec16 = pow2 && k % 32 == 0 && ((size_t)packed) % 16 == 0;
    const unsigned int bshift = pow2 ? (unsigned int)(__ffs((int)blocksize) - 1) : 0u;
    const bool x16 = k % 4 == 0 && ((size_t)x) % 16 == 0;
    const uint4* p = (const uint4*)packed;
    const unsigned int tbase = (unsigned int)__cvta_generic_to_shared(table);  // low byte 0
    const unsigned int lane = threadIdx.x & 31;
    const unsigned int col_first = blockIdx.x * LQ4_COLS_PER_BLOCK + (threadIdx.x >> 5) * LQ4_COLS;
    // Warps whose columns are all past n (in the ragged last block) only help stage x: every
    // thread reaches every barrier.
    const bool active = col_first < n;
    // First element of each weight row (64-bit: c * k passes 2^31); columns past n read the last
    // row, and their sums are not written.
    size_t base[LQ4_COLS];
#pragma unroll
    for (unsigned int c = 0; c < LQ4_COLS; c++) base[c] = (size_t)min(col_first + c, n - 1) * k;

    // Passes of up to LQ4_MAX_ROWS rows (the backend sends at most that many: one pass).
    for (unsigned int m0 = 0; m0 < rows; m0 += LQ4_MAX_ROWS) {
        const unsigned int nr = min(rows - m0, LQ4_MAX_ROWS);
        const unsigned int gs4 = nr * 8 + 1;        // float4s per group of 32 columns (see LQ4_XS)
        const unsigned int kc4 = LQ4_XS / 4 / gs4 * 8;  // float4s per row per chunk
        const unsigned int kc = kc4 * 4;               // x columns per chunk: a multiple of 32
        float acc[LQ4_MAX_ROWS][LQ4_COLS];
#pragma unroll
        for (unsigned int m = 0; m < LQ4_MAX_ROWS; m++)
#pragma unroll
            for (unsigned int c = 0; c < LQ4_COLS; c++) acc[m][c] = 0.f;

        for (unsigned int k0 = 0; k0 < k; k0 += kc) {
            const unsigned int len = min(kc, k - k0);
            const unsigned int ng = len >> 5;  // fast path: len is a multiple of 32
            // The fast path's first loads go out before x is staged.
            uint4 wa[LQ4_COLS], wb[LQ4_COLS];
            float sa[LQ4_COLS], sb[LQ4_COLS];
            if (active && vec16) {
                if (lane < ng) lq4_load(wa, sa, p, absmax, base, k0, lane, bshift);
                if (lane + 32 < ng) lq4_load(wb, sb, p, absmax, base, k0, lane + 32, bshift);
            }
            __syncthreads();  // the previous chunk of x is consumed (and the code table written)
            if (x16) {
                const unsigned int len4 = len / 4;
#pragma unroll
                for (unsigned int r = 0; r < (LQ4_XS / 4 + LQ4_THREADS - 1) / LQ4_THREADS; r++) {
                    const unsigned int i = r * LQ4_THREADS + threadIdx.x;
                    const unsigned int m = i / kc4, t4 = i - m * kc4;
                    if (m < nr && t4 < len4)
                        xs4[(t4 >> 3) * gs4 + m * 8 + (t4 & 7u)] =
                            ((const float4*)(x + (size_t)(m0 + m) * k + k0))[t4];
                }
            } else {
#pragma unroll 8
                for (unsigned int r = 0; r < (LQ4_XS + LQ4_THREADS - 1) / LQ4_THREADS; r++) {
                    const unsigned int i = r * LQ4_THREADS + threadIdx.x;
                    const unsigned int m = i / kc, t = i - m * kc;
                    if (m < nr && t < len)
                        xs[(t >> 5) * gs4 * 4 + m * 32 + (t & 31u)] = x[(size_t)(m0 + m) * k + k0 + t];
                }
            }
            __syncthreads();
            if (!active) continue;
            if (vec16) {
                for (unsigned int g = lane; g < ng; g += 64) {
                    lq4_group(acc, wa, sa, xs4 + g * gs4, table, tbase, nr);
                    if (g + 64 < ng) lq4_load(wa, sa, p, absmax, base, k0, g + 64, bshift);
                    if (g + 32 < ng) {
                        lq4_group(acc, wb, sb, xs4 + (g + 32) * gs4, table, tbase, nr);
                        if (g + 96 < ng) lq4_load(wb, sb, p, absmax, base, k0, g + 96, bshift);
                    }
                }
            } else {
                for (unsigned int t = lane; t < len; t += 32) {
                    float wv[LQ4_COLS];
#pragma unroll
                    for (unsigned int c = 0; c < LQ4_COLS; c++) {
                        const size_t e = base[c] + k0 + t;
                        const unsigned int b = packed[e >> 1];
                        const unsigned int q = (e & 1) ? (b & 0xFu) : (b >> 4);
                        wv[c] = __fmul_rn(table[q], absmax[e / blocksize]);
                    }
                    const float* xr = xs + (t >> 5) * gs4 * 4 + (t & 31u);
#pragma unroll
                    for (unsigned int m = 0; m < LQ4_MAX_ROWS; m++) {
                        if (m >= nr) break;
                        const float xv = xr[m * 32];
#pragma unroll
                        for (unsigned int c = 0; c < LQ4_COLS; c++) acc[m][c] += xv * wv[c];
                    }
                }
            }
        }
        if (!active) continue;
#pragma unroll
        for (unsigned int m = 0; m < LQ4_MAX_ROWS; m++) {
            if (m >= nr) break;
#pragma unroll
            for (unsigned int c = 0; c < LQ4_COLS; c++) {
                float v = acc[m][c];
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
                const unsigned int col = col_first + c;
                // Every lane holds every sum: lane 4m + c writes (m, c).
                if (lane == m * LQ4_COLS + c && col < n) {
                    if (has_bias) v += bias[col0 + col];
                    out[(size_t)(m0 + m) * n_total + col0 + col] = v;
                }
            }
        }
    }
}
