// out = x / sqrt(mean(x^2) + eps) * w over rows of length d. One invocation per row.
struct Params { rows: u32, d: u32, eps: f32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn rms_norm(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = linear_index(gid, nwg);
    if (r >= p.rows) { return; }
    let base = r * p.d;
    var ss = 0.0;
    for (var i = 0u; i < p.d; i++) { ss += x[base + i] * x[base + i]; }
    let inv = inverseSqrt(ss / f32(p.d) + p.eps);
    for (var i = 0u; i < p.d; i++) { out[base + i] = x[base + i] * inv * w[i]; }
}
