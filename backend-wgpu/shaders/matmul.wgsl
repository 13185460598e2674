// Batched out[b, m, n] = sum_k a[b, m, k] * B[b, k, n] (B stored [b, n, k] when transposed).
struct Params { batch: u32, m: u32, n: u32, k: u32, transpose_b: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn matmul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = linear_index(gid, nwg);
    if (idx >= p.batch * p.m * p.n) { return; }
    let bi = idx / (p.m * p.n);
    let i = (idx / p.n) % p.m;
    let j = idx % p.n;
    var acc = 0.0;
    for (var kk = 0u; kk < p.k; kk++) {
        var bv: f32;
        if (p.transpose_b != 0u) { bv = b[(bi * p.n + j) * p.k + kk]; } else { bv = b[(bi * p.k + kk) * p.n + j]; }
        acc += a[(bi * p.m + i) * p.k + kk] * bv;
    }
    out[idx] = acc;
}
