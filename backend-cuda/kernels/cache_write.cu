// KV-cache append, in place: out is the cache [h, c, d]; rows pos .. pos + t of every head take
// x[h, t, d]. pos is read from device memory so that one launch shape serves every decode step;
// rows past the cache end are dropped (the host checks the bound).
extern "C" __global__ void cache_write(const float* x, const unsigned int* pos, float* out,
                                       unsigned int h, unsigned int c, unsigned int t,
                                       unsigned int d) {
    unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= h * t * d) return;
    unsigned int e = idx % d, ti = (idx / d) % t, hi = idx / (d * t);
    unsigned int row = pos[0] + ti;
    if (row >= c) return;
    out[((size_t)hi * c + row) * d + e] = x[idx];
}
