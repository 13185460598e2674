// diffusers' get_timestep_embedding: for t[B], half = dim / 2,
// arg_i = scale * t * exp(-ln(max_period) * i / (half - shift)); [sin | cos], or [cos | sin] when flipped.
extern "C" __global__ void timestep_embedding(const float* t, float* out, unsigned int b, unsigned int dim,
                                              unsigned int flip, float shift, float scale, float max_period) {
    unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= b * dim) return;
    unsigned int half = dim / 2, col = idx % dim, i = col % half;
    float arg = scale * t[idx / dim] * expf(-logf(max_period) * (float)i / ((float)half - shift));
    bool first = col < half;
    bool use_cos = (flip != 0) == first;
    out[idx] = use_cos ? cosf(arg) : sinf(arg);
}
