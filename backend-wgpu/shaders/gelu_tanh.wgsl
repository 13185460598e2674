// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
struct Params { n: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn gelu_tanh(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.n) { return; }
    let v = x[i];
    let u = 0.7978845608028654 * (v + 0.044715 * v * v * v);
    // tanh written with exp of a non-positive argument, so large |u| cannot overflow.
    let e = exp(-2.0 * abs(u));
    let th = sign(u) * (1.0 - e) / (1.0 + e);
    out[i] = 0.5 * v * (1.0 + th);
}
