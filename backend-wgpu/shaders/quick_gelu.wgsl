// CLIP's quick_gelu: out = x * sigmoid(1.702 x).
struct Params { n: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn quick_gelu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.n) { return; }
    let v = x[i];
    out[i] = v / (1.0 + exp(-1.702 * v));
}
