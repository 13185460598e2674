// out = (x - mean) / sqrt(var + eps) (* w + b when affine) over rows of length d.
struct Params { rows: u32, d: u32, eps: f32, affine: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn layer_norm(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = linear_index(gid, nwg);
    if (r >= p.rows) { return; }
    let base = r * p.d;
    var mean = 0.0;
    for (var i = 0u; i < p.d; i++) { mean += x[base + i]; }
    mean /= f32(p.d);
    var v = 0.0;
    for (var i = 0u; i < p.d; i++) { let c = x[base + i] - mean; v += c * c; }
    let inv = inverseSqrt(v / f32(p.d) + p.eps);
    for (var i = 0u; i < p.d; i++) {
        var y = (x[base + i] - mean) * inv;
        if (p.affine != 0u) { y = y * w[i] + b[i]; }
        out[base + i] = y;
    }
}
