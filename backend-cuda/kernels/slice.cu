// len entries from start along an axis of size n: outer rows, inner values per entry.
extern "C" __global__ void slice(const float* x, float* out, unsigned int outer, unsigned int n,
                                 unsigned int start, unsigned int len, unsigned int inner) {
    unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int per = len * inner;
    if (idx >= outer * per) return;
    unsigned int r = idx / per, rest = idx % per;
    out[idx] = x[((size_t)r * n + start) * inner + rest];
}
