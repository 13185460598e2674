// Group normalization of x[C, S] in `groups` groups of C / groups channels, then * w[C] + b[C].
// One invocation per group: two passes for the mean and the variance, one to write.
struct Params { c: u32, s: u32, groups: u32, eps: f32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn group_norm(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let g = linear_index(gid, nwg);
    if (g >= p.groups) { return; }
    let cg = p.c / p.groups;
    let n = cg * p.s;
    let base = g * n;
    var mean = 0.0;
    for (var i = 0u; i < n; i++) { mean += x[base + i]; }
    mean /= f32(n);
    var v = 0.0;
    for (var i = 0u; i < n; i++) { let d = x[base + i] - mean; v += d * d; }
    let inv = inverseSqrt(v / f32(n) + p.eps);
    for (var j = 0u; j < cg; j++) {
        let ch = g * cg + j;
        for (var i = 0u; i < p.s; i++) {
            let at = base + j * p.s + i;
            out[at] = (x[at] - mean) * inv * w[ch] + b[ch];
        }
    }
}
