// GELU with erf: 0.5 x (1 + erf(x / sqrt 2)). WGSL has no erf: this uses the Abramowitz-Stegun
// 7.1.26 rational form refined to |error| < 1.5e-7.
struct Params { n: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

fn erf_approx(z: f32) -> f32 {
    let a = abs(z);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * exp(-a * a);
    return sign(z) * y;
}

@compute @workgroup_size(64)
fn gelu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.n) { return; }
    let v = x[i];
    out[i] = 0.5 * v * (1.0 + erf_approx(v * 0.70710678118654752));
}
