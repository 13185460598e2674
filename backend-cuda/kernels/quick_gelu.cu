// CLIP's quick_gelu: out = x * sigmoid(1.702 x).
extern "C" __global__ void quick_gelu(const float* x, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] / (1.f + expf(-1.702f * x[i]));
}
