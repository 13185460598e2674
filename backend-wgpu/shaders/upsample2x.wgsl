// Nearest-neighbour 2x upsampling of x[C, H, W] to out[C, 2H, 2W].
struct Params { c: u32, h: u32, w: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn upsample2x(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    let w2 = 2u * p.w;
    let h2 = 2u * p.h;
    if (i >= p.c * h2 * w2) { return; }
    let xx = i % w2;
    let y = (i / w2) % h2;
    let ch = i / (w2 * h2);
    out[i] = x[(ch * p.h + y / 2u) * p.w + xx / 2u];
}
