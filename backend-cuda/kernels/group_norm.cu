// Group normalization of x[C, S] in `groups` groups of C / groups channels, then * w[C] + b[C].
// One thread per group: two passes for the mean and the variance, one to write.
extern "C" __global__ void group_norm(const float* x, const float* w, const float* b, float* out,
                                      unsigned int c, unsigned int s, unsigned int groups,
                                      float eps) {
    unsigned int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    unsigned int cg = c / groups;
    size_t n = (size_t)cg * s, base = (size_t)g * n;
    float mean = 0.f;
    for (size_t i = 0; i < n; i++) mean += x[base + i];
    mean /= (float)n;
    float v = 0.f;
    for (size_t i = 0; i < n; i++) { float d = x[base + i] - mean; v += d * d; }
    float inv = rsqrtf(v / (float)n + eps);
    for (unsigned int j = 0; j < cg; j++) {
        unsigned int ch = g * cg + j;
        for (unsigned int i = 0; i < s; i++) {
            size_t at = base + (size_t)j * s + i;
            out[at] = (x[at] - mean) * inv * w[ch] + b[ch];
        }
    }
}
