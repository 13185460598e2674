// Rows of table[V, D] picked by ids[T] (ids are checked against V on the host). A table over the
// binding limit is bound as row pieces [row0, row0 + rows): each piece writes only its rows.
struct Params { t: u32, d: u32, row0: u32, rows: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> table: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn embedding(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = linear_index(gid, nwg);
    if (idx >= p.t * p.d) { return; }
    let id = ids[idx / p.d];
    if (id < p.row0 || id >= p.row0 + p.rows) { return; }
    out[idx] = table[(id - p.row0) * p.d + idx % p.d];
}
