// len entries from start along an axis of size n: outer rows, inner values per entry.
struct Params { outer: u32, n: u32, start: u32, len: u32, inner: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn slice(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = linear_index(gid, nwg);
    let per = p.len * p.inner;
    if (idx >= p.outer * per) { return; }
    let r = idx / per;
    let rest = idx % per;
    out[idx] = x[(r * p.n + p.start) * p.inner + rest];
}
