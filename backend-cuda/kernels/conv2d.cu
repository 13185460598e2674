// 2-D convolution of x[C, H, W] with w[O, C, k, k] (+ b[O]), stride 1, zero padding `pad`:
// out[O, OH, OW]. One thread per output value.
extern "C" __global__ void conv2d(const float* x, const float* wt, const float* b, float* out,
                                  unsigned int c, unsigned int h, unsigned int w, unsigned int o,
                                  unsigned int oh, unsigned int ow, unsigned int k,
                                  unsigned int pad, unsigned int has_bias) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)o * oh * ow) return;
    unsigned int ox = i % ow, oy = (i / ow) % oh, oc = i / ((size_t)ow * oh);
    float acc = has_bias ? b[oc] : 0.f;
    for (unsigned int ic = 0; ic < c; ic++) {
        for (unsigned int ky = 0; ky < k; ky++) {
            int iy = (int)(oy + ky) - (int)pad;
            if (iy < 0 || iy >= (int)h) continue;
            for (unsigned int kx = 0; kx < k; kx++) {
                int ix = (int)(ox + kx) - (int)pad;
                if (ix < 0 || ix >= (int)w) continue;
                acc += x[((size_t)ic * h + iy) * w + ix] * wt[(((size_t)oc * c + ic) * k + ky) * k + kx];
            }
        }
    }
    out[i] = acc;
}
