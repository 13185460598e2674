// GELU with erf: 0.5 x (1 + erf(x / sqrt 2)).
extern "C" __global__ void gelu(const float* x, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 0.5f * x[i] * (1.f + erff(x[i] * 0.70710678118654752f));
}
