// Softmax over rows of length d (max subtracted first). One invocation per row.
struct Params { rows: u32, d: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn softmax(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = linear_index(gid, nwg);
    if (r >= p.rows) { return; }
    let base = r * p.d;
    var m = x[base];
    for (var i = 1u; i < p.d; i++) { m = max(m, x[base + i]); }
    var s = 0.0;
    for (var i = 0u; i < p.d; i++) { s += exp(x[base + i] - m); }
    for (var i = 0u; i < p.d; i++) { out[base + i] = exp(x[base + i] - m) / s; }
}
