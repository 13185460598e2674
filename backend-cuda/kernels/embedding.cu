// Rows of table[V, D] picked by ids[T] (ids checked against V on the host); a table split into
// row pieces [row0, row0 + rows) writes only its rows.
extern "C" __global__ void embedding(const unsigned int* ids, const float* table, float* out,
                                     unsigned int t, unsigned int d, unsigned int row0, unsigned int rows) {
    unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= t * d) return;
    unsigned int id = ids[idx / d];
    if (id < row0 || id >= row0 + rows) return;
    out[idx] = table[(size_t)(id - row0) * d + idx % d];
}
