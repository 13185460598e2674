// Scaled dot-product attention, q[Hq, Tq, D] over k, v[Hkv, Tk, D] (grouped-query: query head h
// reads key/value head h / (Hq / Hkv)); causal masks keys after i + Tk - Tq; key_mask[j] == 0
// masks padding. For fewer than 32 query rows (decode, short prompts; the blocked `attention`
// takes more): one invocation per query row with an online softmax over the keys, so no score
// matrix is ever stored; D <= 256 (checked on the host).
struct Params { hq: u32, hkv: u32, tq: u32, tk: u32, d: u32, causal: u32, has_mask: u32, scale: f32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> q: array<f32>;
@group(0) @binding(2) var<storage, read_write> k: array<f32>;
@group(0) @binding(3) var<storage, read_write> v: array<f32>;
@group(0) @binding(4) var<storage, read_write> key_mask: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn attention_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = linear_index(gid, nwg);
    if (row >= p.hq * p.tq) { return; }
    let i = row % p.tq;
    let h = row / p.tq;
    let kh = h / (p.hq / p.hkv);
    let qb = row * p.d;
    var limit = p.tk;
    if (p.causal != 0u) { limit = min(p.tk, i + p.tk - p.tq + 1u); }
    var acc: array<f32, 256>;
    for (var c = 0u; c < p.d; c++) { acc[c] = 0.0; }
    var m = -3.0e38;
    var l = 0.0;
    // A score that is NaN or infinite (an overflow) makes the row NaN: max() may skip NaN, and
    // l > 0 below would turn it into zeros that look like a masked row.
    var bad = false;
    for (var j = 0u; j < limit; j++) {
        if (p.has_mask != 0u && key_mask[j] == 0.0) { continue; }
        let kb = (kh * p.tk + j) * p.d;
        var dot = 0.0;
        for (var e = 0u; e < p.d; e++) { dot += q[qb + e] * k[kb + e]; }
        let s = dot * p.scale;
        bad = bad || (bitcast<u32>(s) & 0x7f800000u) == 0x7f800000u;
        let m_new = max(m, s);
        let corr = exp(m - m_new);
        let w = exp(s - m_new);
        l = l * corr + w;
        for (var c = 0u; c < p.d; c++) { acc[c] = acc[c] * corr + w * v[kb + c]; }
        m = m_new;
    }
    // A NaN made at run time (a constant NaN is a shader error).
    let nan = bitcast<f32>(0x7fc00000u | (p.d & 0u));
    for (var c = 0u; c < p.d; c++) {
        out[qb + c] = select(select(0.0, acc[c] / l, l > 0.0), nan, bad);
    }
}
