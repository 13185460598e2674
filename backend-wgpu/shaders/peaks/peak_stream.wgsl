// The device's read bandwidth: every invocation sums `per` vec4s of `src`, strided by the number
// of invocations so that each round reads one contiguous span of the buffer, and writes its sum.
struct Params { per: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn peak_stream(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let n = nwg.x * nwg.y * 64u;
    let i = gid.x + gid.y * nwg.x * 64u;
    var acc = vec4<f32>(0.0);
    for (var r = 0u; r < p.per; r++) { acc += src[i + r * n]; }
    out[i] = acc.x + acc.y + acc.z + acc.w;
}
