// GEMV path of the 4-bit linear, for few rows (decode): y[m, n] = sum_k x[m, k] * W[n, k] + b[n]
// with W in bitsandbytes 4-bit, dequantized on the fly (the weight stays packed). One workgroup
// of 64 per output: the invocations stride over k, then reduce in workgroup memory.
// n: columns of this piece of W; a weight over the binding limit is split into row pieces
// that write columns col0.. of an output n_total wide.
struct Params { rows: u32, n: u32, k: u32, blocksize: u32, has_bias: u32, n_total: u32, col0: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> packed: array<u32>;
@group(0) @binding(3) var<storage, read_write> absmax: array<f32>;
@group(0) @binding(4) var<storage, read_write> code: array<f32, 16>;
@group(0) @binding(5) var<storage, read_write> bias: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

var<workgroup> partial: array<f32, 64>;

fn weight(i: u32) -> f32 {
    let byte = (packed[i / 8u] >> (8u * ((i / 2u) % 4u))) & 0xffu;
    let q = select(byte & 0xfu, byte >> 4u, i % 2u == 0u);
    return code[q] * absmax[i / p.blocksize];
}

@compute @workgroup_size(64)
fn linear_q4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let idx = wg.x + wg.y * nwg.x;
    let valid = idx < p.rows * p.n;
    let m = idx / max(p.n, 1u);
    let col = idx % max(p.n, 1u);
    var acc = 0.0;
    if (valid) {
        for (var kk = lid; kk < p.k; kk += 64u) {
            acc += x[m * p.k + kk] * weight(col * p.k + kk);
        }
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s /= 2u) {
        if (lid < s) { partial[lid] += partial[lid + s]; }
        workgroupBarrier();
    }
    if (lid == 0u && valid) {
        var y = partial[0];
        if (p.has_bias != 0u) { y += bias[p.col0 + col]; }
        out[m * p.n_total + p.col0 + col] = y;
    }
}
