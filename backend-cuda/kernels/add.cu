// out = a + b, b the same shape as a or a vector over a's last dim (length bn).
extern "C" __global__ void add(const float* a, const float* b, float* out, unsigned int n, unsigned int bn) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i % bn];
}
