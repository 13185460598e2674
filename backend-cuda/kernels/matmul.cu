// Batched out[b, i, j] = sum_k a[b, i, k] * B[b, k, j] (B stored [b, j, k] when transposed).
// 16 x 16 tiles staged in shared memory.
extern "C" __global__ void matmul(const float* a, const float* b, float* out, unsigned int batch,
                                  unsigned int m, unsigned int n, unsigned int k, unsigned int transpose_b) {
    __shared__ float at[16][17];
    __shared__ float bt[16][17];
    unsigned int bi = blockIdx.z;
    unsigned int i = blockIdx.y * 16 + threadIdx.y, j = blockIdx.x * 16 + threadIdx.x;
    float acc = 0.f;
    for (unsigned int k0 = 0; k0 < k; k0 += 16) {
        unsigned int ka = k0 + threadIdx.x, kb = k0 + threadIdx.y;
        at[threadIdx.y][threadIdx.x] = (i < m && ka < k) ? a[((size_t)bi * m + i) * k + ka] : 0.f;
        float bv = 0.f;
        if (j < n && kb < k) bv = transpose_b ? b[((size_t)bi * n + j) * k + kb] : b[((size_t)bi * k + kb) * n + j];
        bt[threadIdx.y][threadIdx.x] = bv;
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 16; e++) acc += at[threadIdx.y][e] * bt[e][threadIdx.x];
        __syncthreads();
    }
    if (bi < batch && i < m && j < n) out[((size_t)bi * m + i) * n + j] = acc;
}
