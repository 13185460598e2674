// Nearest-neighbour 2x upsampling of x[C, H, W] to out[C, 2H, 2W].
extern "C" __global__ void upsample2x(const float* x, float* out, unsigned int c, unsigned int h,
                                      unsigned int w) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t w2 = 2 * (size_t)w, h2 = 2 * (size_t)h;
    if (i >= (size_t)c * h2 * w2) return;
    size_t xx = i % w2, y = (i / w2) % h2, ch = i / (w2 * h2);
    out[i] = x[(ch * h + y / 2) * w + xx / 2];
}
