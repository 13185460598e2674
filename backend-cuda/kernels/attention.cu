// Scaled dot-product attention, q[Hq, Tq, D] over k, v[Hkv, Tk, D], grouped-query (query head h
// reads key/value head h / (Hq / Hkv)), causal (query i sees keys up to i + Tk - Tq) and padding
// (key_mask[j] == 0). Blocked as flash attention is: a block of 128 threads takes 64 query rows
// of one head, two threads a row, each holding half of the row's q and of its output
// accumulator in registers; keys and values go through shared memory in tiles of 32 (32 KiB),
// read by all 64 rows. Per tile a row computes its 32 scores (each thread half of every dot,
// one shuffle adds the halves), takes the tile's maximum, rescales its accumulator once and adds
// the tile's weighted values: an online softmax by tiles, no score matrix in memory. D <= 128
// (checked on the host); smaller D runs on zero padding.
#define BQ 64
#define BK 32
#define MAX_D 128
#define HALF4 (MAX_D / 8)
extern "C" __launch_bounds__(128) __global__ void attention(const float* q, const float* k,
    const float* v, const float* key_mask, float* out, unsigned int hq, unsigned int hkv,
    unsigned int tq, unsigned int tk, unsigned int d, unsigned int causal, unsigned int has_mask,
    float scale) {
    __shared__ float4 ks[BK][MAX_D / 4];
    __shared__ float4 vs[BK][MAX_D / 4];
    unsigned int h = blockIdx.y;
    unsigned int row = threadIdx.x >> 1, part = threadIdx.x & 1;
    unsigned int i = blockIdx.x * BQ + row;
    unsigned int kh = h / (hq / hkv);
    bool active = i < tq;
    // This thread's half of the row: dims [part * MAX_D / 2, (part + 1) * MAX_D / 2).
    unsigned int e0 = part * (MAX_D / 2);
    float4 qr[HALF4], acc[HALF4];
    const float* qrow = q + ((size_t)h * tq + (active ? i : 0)) * d;
#pragma unroll
    for (int c = 0; c < HALF4; c++) {
        unsigned int e = e0 + 4 * c;
        qr[c].x = (active && e < d) ? qrow[e] : 0.f;
        qr[c].y = (active && e + 1 < d) ? qrow[e + 1] : 0.f;
        qr[c].z = (active && e + 2 < d) ? qrow[e + 2] : 0.f;
        qr[c].w = (active && e + 3 < d) ? qrow[e + 3] : 0.f;
        acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    unsigned int limit = active ? (causal ? min(tk, i + tk - tq + 1) : tk) : 0;
    unsigned int last_i = min(tq, blockIdx.x * BQ + BQ) - 1;
    unsigned int block_limit = causal ? min(tk, last_i + tk - tq + 1) : tk;
    float m = -3.0e38f, l = 0.f;
    // A score that is NaN or infinite (an overflow) makes the row NaN: fmaxf skips NaN, and
    // l > 0 below would turn it into zeros that look like a masked row.
    bool bad = false;
    const float neg_inf = __int_as_float(0xff800000u);
    float* kflat = (float*)ks;
    float* vflat = (float*)vs;
    for (unsigned int j0 = 0; j0 < block_limit; j0 += BK) {
        __syncthreads();
        for (unsigned int t = threadIdx.x; t < BK * MAX_D; t += blockDim.x) {
            unsigned int jj = t / MAX_D, e = t % MAX_D;
            bool ok = j0 + jj < tk && e < d;
            size_t src = ((size_t)kh * tk + j0 + jj) * d + e;
            kflat[t] = ok ? k[src] : 0.f;
            vflat[t] = ok ? v[src] : 0.f;
        }
        __syncthreads();
        float s[BK];
        float tmax = m;
#pragma unroll
        for (int jj = 0; jj < BK; jj++) {
            float dot = 0.f;
#pragma unroll
            for (int c = 0; c < HALF4; c++) {
                float4 kk = ks[jj][part * HALF4 + c];
                dot = fmaf(qr[c].x, kk.x, dot);
                dot = fmaf(qr[c].y, kk.y, dot);
                dot = fmaf(qr[c].z, kk.z, dot);
                dot = fmaf(qr[c].w, kk.w, dot);
            }
            // Every lane runs this (no branch above it): the pair's halves added.
            dot += __shfl_xor_sync(0xffffffffu, dot, 1);
            unsigned int j = j0 + jj;
            bool use = j < limit && !(has_mask && key_mask[j] == 0.f);
            float sc = dot * scale;
            bad = bad || (use && !isfinite(sc));
            s[jj] = use ? sc : neg_inf;
            tmax = use ? fmaxf(tmax, sc) : tmax;
        }
        if (tmax > m) {
            float corr = expf(m - tmax);
            l *= corr;
#pragma unroll
            for (int c = 0; c < HALF4; c++) {
                acc[c].x *= corr;
                acc[c].y *= corr;
                acc[c].z *= corr;
                acc[c].w *= corr;
            }
            m = tmax;
        }
#pragma unroll
        for (int jj = 0; jj < BK; jj++) {
            if (s[jj] == neg_inf) continue;
            float w = expf(s[jj] - m);
            l += w;
#pragma unroll
            for (int c = 0; c < HALF4; c++) {
                float4 vv = vs[jj][part * HALF4 + c];
                acc[c].x = fmaf(w, vv.x, acc[c].x);
                acc[c].y = fmaf(w, vv.y, acc[c].y);
                acc[c].z = fmaf(w, vv.z, acc[c].z);
                acc[c].w = fmaf(w, vv.w, acc[c].w);
            }
        }
    }
    if (!active) return;
    float* orow = out + ((size_t)h * tq + i) * d;
#pragma unroll
    for (int c = 0; c < HALF4; c++) {
        float r[4] = {acc[c].x, acc[c].y, acc[c].z, acc[c].w};
#pragma unroll
        for (int x = 0; x < 4; x++) {
            unsigned int e = e0 + 4 * c + x;
            if (e < d)
                orow[e] = bad ? __int_as_float(0x7fc00000) : (l > 0.f ? r[x] / l : 0.f);
        }
    }
}
