// 2-D convolution of x[C, H, W] with w[O, C, k, k] (+ b[O]), stride 1, zero padding `pad`:
// out[O, OH, OW]. One invocation per output value.
struct Params { c: u32, h: u32, w: u32, o: u32, oh: u32, ow: u32, k: u32, pad: u32, has_bias: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> wt: array<f32>;
@group(0) @binding(3) var<storage, read_write> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn conv2d(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.o * p.oh * p.ow) { return; }
    let ox = i % p.ow;
    let oy = (i / p.ow) % p.oh;
    let oc = i / (p.ow * p.oh);
    var acc = 0.0;
    if (p.has_bias != 0u) { acc = b[oc]; }
    for (var ic = 0u; ic < p.c; ic++) {
        for (var ky = 0u; ky < p.k; ky++) {
            let iy = i32(oy + ky) - i32(p.pad);
            if (iy < 0 || iy >= i32(p.h)) { continue; }
            for (var kx = 0u; kx < p.k; kx++) {
                let ix = i32(ox + kx) - i32(p.pad);
                if (ix < 0 || ix >= i32(p.w)) { continue; }
                acc += x[(ic * p.h + u32(iy)) * p.w + u32(ix)] * wt[((oc * p.c + ic) * p.k + ky) * p.k + kx];
            }
        }
    }
    out[i] = acc;
}
