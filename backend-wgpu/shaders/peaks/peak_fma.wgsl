// The device's f32 FMA peak: 8 independent vec4 fused multiply-add chains per invocation, `iters`
// rounds each (64 FLOP a round an invocation counts 8 x 4 lanes x 2), the sum written so that
// nothing is optimized away.
struct Params { iters: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn peak_fma(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    let s = f32(i & 7u) * 1e-3;
    let b = vec4<f32>(0.999, 0.998, 0.997, 0.996);
    let c = vec4<f32>(1e-4);
    var a0 = vec4<f32>(s); var a1 = a0 + 0.1; var a2 = a0 + 0.2; var a3 = a0 + 0.3;
    var a4 = a0 + 0.4; var a5 = a0 + 0.5; var a6 = a0 + 0.6; var a7 = a0 + 0.7;
    for (var r = 0u; r < p.iters; r++) {
        a0 = fma(a0, b, c); a1 = fma(a1, b, c); a2 = fma(a2, b, c); a3 = fma(a3, b, c);
        a4 = fma(a4, b, c); a5 = fma(a5, b, c); a6 = fma(a6, b, c); a7 = fma(a7, b, c);
    }
    let t = (a0 + a1) + (a2 + a3) + (a4 + a5) + (a6 + a7);
    out[i] = t.x + t.y + t.z + t.w;
}
