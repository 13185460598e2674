// Scaled dot-product attention for few query rows (decode; the blocked `attention` kernel takes
// 32 rows or more), q[Hq, Tq, D] over k, v[Hkv, Tk, D], grouped-query (query head h
// reads key/value head h / (Hq / Hkv)), causal (query i sees keys up to i + Tk - Tq) and padding
// (key_mask[j] == 0). Tiled with an online softmax, no score matrix in memory: a block of 4 warps
// takes 4 queries of one head; each warp owns one query, each lane 4 of its D <= 128 dims; the
// keys and values go through shared memory in tiles of 32.
#define TILE_K 32
#define MAX_D 128
#define QPB 4
extern "C" __global__ void attention_rows(const float* q, const float* k, const float* v, const float* key_mask,
                                     float* out, unsigned int hq, unsigned int hkv, unsigned int tq,
                                     unsigned int tk, unsigned int d, unsigned int causal,
                                     unsigned int has_mask, float scale) {
    __shared__ float ks[TILE_K][MAX_D];
    __shared__ float vs[TILE_K][MAX_D];
    unsigned int h = blockIdx.y;
    unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    unsigned int i = blockIdx.x * QPB + warp;
    unsigned int kh = h / (hq / hkv);
    bool active = i < tq;
    float qr[4], acc[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        unsigned int e = lane + 32 * r;
        qr[r] = (active && e < d) ? q[((size_t)h * tq + i) * d + e] : 0.f;
        acc[r] = 0.f;
    }
    unsigned int limit = active ? (causal ? min(tk, i + tk - tq + 1) : tk) : 0;
    unsigned int last_i = min(tq, blockIdx.x * QPB + QPB) - 1;
    unsigned int block_limit = causal ? min(tk, last_i + tk - tq + 1) : tk;
    float m = -3.0e38f, l = 0.f;
    // A score that is NaN or infinite (an overflow) makes the row NaN: fmaxf skips NaN, and
    // l > 0 below would turn it into zeros that look like a masked row.
    bool bad = false;
    for (unsigned int j0 = 0; j0 < block_limit; j0 += TILE_K) {
        for (unsigned int t = threadIdx.x; t < TILE_K * MAX_D; t += blockDim.x) {
            unsigned int jj = t / MAX_D, e = t % MAX_D;
            bool ok = j0 + jj < tk && e < d;
            size_t src = ((size_t)kh * tk + j0 + jj) * d + e;
            ks[jj][e] = ok ? k[src] : 0.f;
            vs[jj][e] = ok ? v[src] : 0.f;
        }
        __syncthreads();
        for (unsigned int jj = 0; jj < TILE_K && j0 + jj < limit; jj++) {
            unsigned int j = j0 + jj;
            if (has_mask && key_mask[j] == 0.f) continue;
            float dot = 0.f;
#pragma unroll
            for (int r = 0; r < 4; r++) dot += qr[r] * ks[jj][lane + 32 * r];
            for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
            float s = dot * scale;
            bad = bad || !isfinite(s);
            float mn = fmaxf(m, s);
            float corr = expf(m - mn), w = expf(s - mn);
            l = l * corr + w;
#pragma unroll
            for (int r = 0; r < 4; r++) acc[r] = acc[r] * corr + w * vs[jj][lane + 32 * r];
            m = mn;
        }
        __syncthreads();
    }
    if (active) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            unsigned int e = lane + 32 * r;
            if (e < d)
                out[((size_t)h * tq + i) * d + e] =
                    bad ? __int_as_float(0x7fc00000) : (l > 0.f ? acc[r] / l : 0.f);
        }
    }
}
