// Reorders up to 4 axes: out_dims are the output sizes, src_strides[i] the input stride of the
// axis that becomes output axis i (shapes padded to rank 4 with leading 1s).
struct Params { n: u32, d0: u32, d1: u32, d2: u32, d3: u32, s0: u32, s1: u32, s2: u32, s3: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn permute(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = linear_index(gid, nwg);
    if (idx >= p.n) { return; }
    let i3 = idx % p.d3;
    let i2 = (idx / p.d3) % p.d2;
    let i1 = (idx / (p.d3 * p.d2)) % p.d1;
    let i0 = idx / (p.d3 * p.d2 * p.d1);
    out[idx] = x[i0 * p.s0 + i1 * p.s1 + i2 * p.s2 + i3 * p.s3];
}
