// Rotary embedding of x[T, H, D] with cos/sin[T, D/2]. mode 0: rotate-half (i with i + D/2,
// Llama); mode 1: interleaved pairs (2i with 2i + 1, Flux). One invocation per pair.
struct Params { t: u32, h: u32, d: u32, mode: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> cosv: array<f32>;
@group(0) @binding(3) var<storage, read_write> sinv: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = linear_index(gid, nwg);
    let half = p.d / 2u;
    if (idx >= p.t * p.h * half) { return; }
    let i = idx % half;
    let row = idx / half;
    let ti = row / p.h;
    let base = row * p.d;
    var a: u32;
    var b: u32;
    if (p.mode == 0u) { a = base + i; b = base + i + half; } else { a = base + 2u * i; b = a + 1u; }
    let c = cosv[ti * half + i];
    let s = sinv[ti * half + i];
    let x1 = x[a];
    let x2 = x[b];
    out[a] = x1 * c - x2 * s;
    out[b] = x2 * c + x1 * s;
}
