// Reorders up to 4 axes: d0..d3 are the output sizes, s0..s3 the input strides of the axes that
// become output axes 0..3 (padded to rank 4 with leading 1s).
extern "C" __global__ void permute(const float* x, float* out, unsigned int n, unsigned int d0, unsigned int d1,
                                   unsigned int d2, unsigned int d3, unsigned int s0, unsigned int s1,
                                   unsigned int s2, unsigned int s3) {
    unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    unsigned int i3 = idx % d3, i2 = (idx / d3) % d2, i1 = (idx / (d3 * d2)) % d1, i0 = idx / (d3 * d2 * d1);
    out[idx] = x[(size_t)i0 * s0 + (size_t)i1 * s1 + (size_t)i2 * s2 + (size_t)i3 * s3];
}
