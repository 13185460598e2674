// KV-cache append, in place: out is the cache [h, c, d]; rows pos .. pos + t of every head take
// x[h, t, d]. pos comes from a u32 buffer so that one pipeline serves every decode step; rows
// past the cache end are dropped (the host checks the bound before the step).
struct Params { h: u32, c: u32, t: u32, d: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> pos: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn cache_write(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = linear_index(gid, nwg);
    if (idx >= p.h * p.t * p.d) { return; }
    let e = idx % p.d;
    let ti = (idx / p.d) % p.t;
    let hi = idx / (p.d * p.t);
    let row = pos[0] + ti;
    if (row >= p.c) { return; }
    out[(hi * p.c + row) * p.d + e] = x[idx];
}
