// diffusers' get_timestep_embedding: for t[B], half = dim / 2,
// arg_i = scale * t * exp(-ln(max_period) * i / (half - shift)); [sin | cos], or [cos | sin] when flipped.
// In double, as the CPU backends compute it: arguments reach ~1000, where one f32 ulp (6e-5) of
// the argument is already a visible part of the conformance bound (2e-4).
extern "C" __global__ void timestep_embedding(const float* t, float* out, unsigned int b, unsigned int dim,
                                              unsigned int flip, float shift, float scale, float max_period) {
    unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= b * dim) return;
    unsigned int half = dim / 2, col = idx % dim, i = col % half;
    double e = exp(-log((double)max_period) * (double)i / ((double)half - (double)shift));
    double arg = (double)scale * (double)t[idx / dim] * e;
    bool first = col < half;
    bool use_cos = (flip != 0) == first;
    out[idx] = (float)(use_cos ? cos(arg) : sin(arg));
}
