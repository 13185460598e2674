// diffusers' get_timestep_embedding: for t[B], half = dim / 2,
// arg_i = scale * t * exp(-ln(max_period) * i / (half - shift)); [sin | cos] or [cos | sin].
struct Params { b: u32, dim: u32, flip: u32, shift: f32, scale: f32, max_period: f32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> t: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn timestep_embedding(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = linear_index(gid, nwg);
    if (idx >= p.b * p.dim) { return; }
    let half = p.dim / 2u;
    let col = idx % p.dim;
    let i = col % half;
    let arg = p.scale * t[idx / p.dim] * exp(-log(p.max_period) * f32(i) / (f32(half) - p.shift));
    let first_half = col < half;
    // flip: cos first.
    let use_cos = (p.flip != 0u) == first_half;
    out[idx] = select(sin(arg), cos(arg), use_cos);
}
