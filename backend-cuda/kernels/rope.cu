// Rotary embedding of x[T, H, D] with cos/sin[T, D/2]. mode 0: rotate-half (i with i + D/2,
// Llama); mode 1: interleaved pairs (2i with 2i + 1, Flux). One thread per pair.
extern "C" __global__ void rope(const float* x, const float* cosv, const float* sinv, float* out,
                                unsigned int t, unsigned int h, unsigned int d, unsigned int mode) {
    unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int half = d / 2;
    if (idx >= t * h * half) return;
    unsigned int i = idx % half, row = idx / half, ti = row / h;
    size_t base = (size_t)row * d;
    size_t a = mode == 0 ? base + i : base + 2 * i;
    size_t b = mode == 0 ? base + i + half : a + 1;
    float c = cosv[ti * half + i], s = sinv[ti * half + i];
    float x1 = x[a], x2 = x[b];
    out[a] = x1 * c - x2 * s;
    out[b] = x2 * c + x1 * s;
}
