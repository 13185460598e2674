// Scaled dot-product attention, q[Hq, Tq, D] over k, v[Hkv, Tk, D] (grouped-query: query head h
// reads key/value head h / (Hq / Hkv)); causal masks keys after i + Tk - Tq; key_mask[j] == 0
// masks padding. One invocation per output element, with an online softmax over the keys (no
// score matrix in memory).
struct Params { hq: u32, hkv: u32, tq: u32, tk: u32, d: u32, causal: u32, has_mask: u32, scale: f32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> q: array<f32>;
@group(0) @binding(2) var<storage, read_write> k: array<f32>;
@group(0) @binding(3) var<storage, read_write> v: array<f32>;
@group(0) @binding(4) var<storage, read_write> key_mask: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn attention(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = linear_index(gid, nwg);
    if (idx >= p.hq * p.tq * p.d) { return; }
    let c = idx % p.d;
    let i = (idx / p.d) % p.tq;
    let h = idx / (p.d * p.tq);
    let kh = h / (p.hq / p.hkv);
    var limit = p.tk;
    if (p.causal != 0u) { limit = min(p.tk, i + p.tk - p.tq + 1u); }
    var m = -3.0e38;
    var l = 0.0;
    var acc = 0.0;
    var any = false;
    for (var j = 0u; j < limit; j++) {
        if (p.has_mask != 0u && key_mask[j] == 0.0) { continue; }
        var dot = 0.0;
        for (var e = 0u; e < p.d; e++) {
            dot += q[(h * p.tq + i) * p.d + e] * k[(kh * p.tk + j) * p.d + e];
        }
        let s = dot * p.scale;
        let m_new = max(m, s);
        let corr = exp(m - m_new);
        let w = exp(s - m_new);
        l = l * corr + w;
        acc = acc * corr + w * v[(kh * p.tk + j) * p.d + c];
        m = m_new;
        any = true;
    }
    out[idx] = select(0.0, acc / l, any);
}
