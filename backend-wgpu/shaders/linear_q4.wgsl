// y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n]) with W in bitsandbytes 4-bit, dequantized on the fly
// (the weight stays packed on the device). One invocation per output; f32 accumulation.
struct Params { rows: u32, n: u32, k: u32, blocksize: u32, has_bias: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> packed: array<u32>;
@group(0) @binding(3) var<storage, read_write> absmax: array<f32>;
@group(0) @binding(4) var<storage, read_write> code: array<f32, 16>;
@group(0) @binding(5) var<storage, read_write> bias: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

fn weight(i: u32) -> f32 {
    let byte = (packed[i / 8u] >> (8u * ((i / 2u) % 4u))) & 0xffu;
    let q = select(byte & 0xfu, byte >> 4u, i % 2u == 0u);
    return code[q] * absmax[i / p.blocksize];
}

@compute @workgroup_size(64)
fn linear_q4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = linear_index(gid, nwg);
    if (idx >= p.rows * p.n) { return; }
    let m = idx / p.n;
    let col = idx % p.n;
    var acc = 0.0;
    for (var kk = 0u; kk < p.k; kk++) {
        acc += x[m * p.k + kk] * weight(col * p.k + kk);
    }
    if (p.has_bias != 0u) { acc += bias[col]; }
    out[idx] = acc;
}
