// Bit-exact bitsandbytes 4-bit dequantization: out[i] = code[nibble(i)] * absmax[i / blocksize],
// element 2j in the high nibble of byte j. One f32 multiply, as bitsandbytes does.
extern "C" __global__ void dequant4(const unsigned char* packed, const float* absmax, const float* code,
                                    float* out, unsigned int n, unsigned int blocksize) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned char b = packed[i >> 1];
    unsigned int q = (i & 1) ? (b & 0xF) : (b >> 4);
    out[i] = __fmul_rn(code[q], absmax[i / blocksize]);
}
