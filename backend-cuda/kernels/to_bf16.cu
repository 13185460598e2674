// f32 activations to bf16 (round to nearest even, NaN kept quiet), the input of the cuBLAS GEMM
// path: bit operations, the same as the CPU's conversion (no cuda_bf16.h to find at run time).
extern "C" __global__ void to_bf16(const float* x, unsigned short* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned int u = __float_as_uint(x[i]);
    out[i] = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 0x40u)
                                             : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
