// adaLN modulation: out = x * (1 + scale) + shift, scale and shift over the last dim d.
struct Params { n: u32, d: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> shift: array<f32>;
@group(0) @binding(3) var<storage, read_write> scale: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn adaln_modulate(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.n) { return; }
    out[i] = x[i] * (1.0 + scale[i % p.d]) + shift[i % p.d];
}
