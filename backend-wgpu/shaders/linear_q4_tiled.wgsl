// Tiled path of the 4-bit linear, for many rows (prefill, DiT tokens): 16 x 16 outputs per
// workgroup; each step stages a 16 x 16 tile of x and of the dequantized weight in workgroup
// memory. f32 accumulation.
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

var<workgroup> xt: array<array<f32, 16>, 16>;
var<workgroup> wt: array<array<f32, 16>, 16>;

fn weight(i: u32) -> f32 {
    let byte = (packed[i / 8u] >> (8u * ((i / 2u) % 4u))) & 0xffu;
    let q = select(byte & 0xfu, byte >> 4u, i % 2u == 0u);
    return code[q] * absmax[i / p.blocksize];
}

@compute @workgroup_size(16, 16)
fn linear_q4_tiled(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wg.y * 16u + lid.y;
    let col = wg.x * 16u + lid.x;
    let wrow = wg.x * 16u + lid.y;
    var acc = 0.0;
    for (var k0 = 0u; k0 < p.k; k0 += 16u) {
        let kx = k0 + lid.x;
        xt[lid.y][lid.x] = select(0.0, x[row * p.k + kx], row < p.rows && kx < p.k);
        wt[lid.y][lid.x] = select(0.0, weight(wrow * p.k + kx), wrow < p.n && kx < p.k);
        workgroupBarrier();
        for (var e = 0u; e < 16u; e++) {
            acc += xt[lid.y][e] * wt[lid.x][e];
        }
        workgroupBarrier();
    }
    if (row < p.rows && col < p.n) {
        if (p.has_bias != 0u) { acc += bias[p.col0 + col]; }
        out[row * p.n_total + p.col0 + col] = acc;
    }
}
