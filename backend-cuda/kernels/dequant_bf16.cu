// GEMM path of the 4-bit linear (many rows): dequantize a tile of W to bf16 in a scratch buffer,
// which cuBLAS then multiplies with f32 accumulation. out[i] = bf16(code[q] * absmax) for the
// elements [first, first + n) of the weight (first given as two 32-bit halves); bf16 by the bit
// operations of to_bf16.cu (round to nearest even, NaN kept quiet).
extern "C" __global__ void dequant_bf16(const unsigned char* packed, const float* absmax, const float* code,
                                        unsigned short* out, unsigned int first_lo, unsigned int first_hi,
                                        unsigned int n, unsigned int blocksize) {
    unsigned long long first = ((unsigned long long)first_hi << 32) | first_lo;
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned long long e = first + i;
    unsigned char b = packed[e >> 1];
    unsigned int q = (e & 1) ? (b & 0xF) : (b >> 4);
    unsigned int u = __float_as_uint(__fmul_rn(code[q], absmax[e / blocksize]));
    out[i] = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 0x40u)
                                             : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
