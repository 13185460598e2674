// Joins a and b along an axis: with outer = product of dims before it, ia / ib = product of a's /
// b's dims from it on, each outer row is a's ia values then b's ib values.
struct Params { outer: u32, ia: u32, ib: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn concat(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = linear_index(gid, nwg);
    let row = p.ia + p.ib;
    if (idx >= p.outer * row) { return; }
    let r = idx / row;
    let c = idx % row;
    out[idx] = select(b[r * p.ib + c - p.ia], a[r * p.ia + c], c < p.ia);
}
