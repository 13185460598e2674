// y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) with a dense f32 weight. One invocation per output.
// n: rows of this piece of w; a weight over the binding limit is split into row pieces that
// write columns col0.. of an output n_total wide.
struct Params { rows: u32, n: u32, k: u32, has_bias: u32, n_total: u32, col0: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn linear(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = linear_index(gid, nwg);
    if (idx >= p.rows * p.n) { return; }
    let m = idx / p.n;
    let col = idx % p.n;
    var acc = 0.0;
    for (var kk = 0u; kk < p.k; kk++) {
        acc += x[m * p.k + kk] * w[col * p.k + kk];
    }
    if (p.has_bias != 0u) { acc += bias[p.col0 + col]; }
    out[m * p.n_total + p.col0 + col] = acc;
}
