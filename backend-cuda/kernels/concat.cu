// Joins a and b along an axis: each of `outer` rows is a's ia values then b's ib values.
extern "C" __global__ void concat(const float* a, const float* b, float* out, unsigned int outer,
                                  unsigned int ia, unsigned int ib) {
    unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int row = ia + ib;
    if (idx >= outer * row) return;
    unsigned int r = idx / row, c = idx % row;
    out[idx] = c < ia ? a[(size_t)r * ia + c] : b[(size_t)r * ib + c - ia];
}
