// f32 activations to bf16 (round to nearest even), the input of the cuBLAS GEMM path.
#include <cuda_bf16.h>
extern "C" __global__ void to_bf16(const float* x, __nv_bfloat16* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16_rn(x[i]);
}
