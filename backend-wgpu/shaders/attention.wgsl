// Scaled dot-product attention, q[Hq, Tq, D] over k, v[Hkv, Tk, D] (grouped-query: query head h
// reads key/value head h / (Hq / Hkv)); causal masks keys after i + Tk - Tq; key_mask[j] == 0
// masks padding. Blocked: a workgroup takes 64 query rows of one head (one row an invocation,
// the row's q and output accumulator in registers) and walks the keys in tiles staged in
// workgroup memory (keys and values of up to 2048 / D keys, 16 KiB: WebGPU's default limit),
// which every row of the workgroup then reads. Per tile each row computes its scores, takes the
// tile's maximum and rescales its accumulator once (an online softmax by tiles), so no score
// matrix larger than a tile is ever stored; D <= 256 (checked on the host). The dispatch is
// Hq x ceil(Tq / 64) workgroups, folded into x and y.
struct Params { hq: u32, hkv: u32, tq: u32, tk: u32, d: u32, causal: u32, has_mask: u32, scale: f32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> q: array<f32>;
@group(0) @binding(2) var<storage, read_write> k: array<f32>;
@group(0) @binding(3) var<storage, read_write> v: array<f32>;
@group(0) @binding(4) var<storage, read_write> key_mask: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

const ROWS: u32 = 64u;
const STAGE: u32 = 4096u;
const MAX_TILE: u32 = 64u;
// A tile's keys (first half) and values (second half).
var<workgroup> kv: array<f32, 4096>;

@compute @workgroup_size(64)
fn attention(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>) {
    let blocks = (p.tq + ROWS - 1u) / ROWS;
    let wg = wid.x + wid.y * nwg.x;
    // Whole workgroups leave together (the barriers below are in uniform control flow).
    if (wg >= p.hq * blocks) { return; }
    let h = wg / blocks;
    let first = (wg % blocks) * ROWS;
    let i = first + lid.x;
    let live = i < p.tq;
    let kh = h / (p.hq / p.hkv);
    let qb = (h * p.tq + i) * p.d;
    // Keys per tile, and the keys any row of this workgroup sees.
    let tile = min(MAX_TILE, (STAGE / 2u) / p.d);
    let last = min(p.tq, first + ROWS) - 1u;
    var wg_limit = p.tk;
    if (p.causal != 0u) { wg_limit = min(p.tk, last + p.tk - p.tq + 1u); }
    var limit = 0u;
    if (live) {
        limit = p.tk;
        if (p.causal != 0u) { limit = min(p.tk, i + p.tk - p.tq + 1u); }
    }
    var qr: array<f32, 256>;
    var acc: array<f32, 256>;
    for (var c = 0u; c < p.d; c++) {
        acc[c] = 0.0;
        qr[c] = select(0.0, q[qb + c], live);
    }
    var s: array<f32, 64>;
    var m = -3.0e38;
    var l = 0.0;
    // A score that is NaN or infinite (an overflow) makes the row NaN: max() may skip NaN, and
    // l > 0 below would turn it into zeros that look like a masked row.
    var bad = false;
    let half = tile * p.d;
    for (var j0 = 0u; j0 < wg_limit; j0 += tile) {
        let n = min(tile, wg_limit - j0);
        workgroupBarrier();
        let src = (kh * p.tk + j0) * p.d;
        for (var t = lid.x; t < n * p.d; t += ROWS) {
            kv[t] = k[src + t];
            kv[half + t] = v[src + t];
        }
        workgroupBarrier();
        // This row's keys in the tile: [j0, j0 + mine).
        let mine = min(n, max(limit, j0) - j0);
        var tmax = m;
        for (var t = 0u; t < mine; t++) {
            var dot = 0.0;
            let kb = t * p.d;
            for (var e = 0u; e < p.d; e++) { dot += qr[e] * kv[kb + e]; }
            let sc = dot * p.scale;
            let masked = p.has_mask != 0u && key_mask[j0 + t] == 0.0;
            bad = bad || (!masked && (bitcast<u32>(sc) & 0x7f800000u) == 0x7f800000u);
            s[t] = select(sc, -3.0e38, masked);
            if (!masked) { tmax = max(tmax, sc); }
        }
        if (tmax > m) {
            let corr = exp(m - tmax);
            l = l * corr;
            for (var c = 0u; c < p.d; c++) { acc[c] = acc[c] * corr; }
            m = tmax;
        }
        for (var t = 0u; t < mine; t++) {
            if (s[t] == -3.0e38) { continue; }
            let w = exp(s[t] - m);
            l += w;
            let vb = half + t * p.d;
            for (var c = 0u; c < p.d; c++) { acc[c] += w * kv[vb + c]; }
        }
    }
    if (!live) { return; }
    // A NaN made at run time (a constant NaN is a shader error).
    let nan = bitcast<f32>(0x7fc00000u | (p.d & 0u));
    for (var c = 0u; c < p.d; c++) {
        out[qb + c] = select(select(0.0, acc[c] / l, l > 0.0), nan, bad);
    }
}
