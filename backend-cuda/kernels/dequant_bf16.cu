// GEMM path of the 4-bit linear (many rows): dequantize a tile of W to bf16 in a scratch buffer,
// which cuBLASLt then multiplies with f32 accumulation. out[i] = bf16(code[q] * absmax) for the
// elements [first, first + n) of the weight (first given as two 32-bit halves).
#include <cuda_bf16.h>
extern "C" __global__ void dequant_bf16(const unsigned char* packed, const float* absmax, const float* code,
                                        __nv_bfloat16* out, unsigned int first_lo, unsigned int first_hi,
                                        unsigned int n, unsigned int blocksize) {
    unsigned long long first = ((unsigned long long)first_hi << 32) | first_lo;
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned long long e = first + i;
    unsigned char b = packed[e >> 1];
    unsigned int q = (e & 1) ? (b & 0xF) : (b >> 4);
    out[i] = __float2bfloat16_rn(__fmul_rn(code[q], absmax[e / blocksize]));
}
