// Group normalization of x[C, S] in `groups` groups of C / groups channels, then * w[C] + b[C].
// One workgroup of 64 per group: strided partial sums reduced in workgroup memory for the mean,
// then for the variance, then every lane writes its share.
struct Params { c: u32, s: u32, groups: u32, eps: f32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

var<workgroup> red: array<f32, 64>;

fn reduce(lane: u32, v: f32) -> f32 {
    red[lane] = v;
    workgroupBarrier();
    for (var o = 32u; o > 0u; o = o / 2u) {
        if (lane < o) { red[lane] += red[lane + o]; }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(64)
fn group_norm(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lane: u32) {
    let g = linear_index(gid, nwg) / 64u;
    // Every lane reaches every barrier; lanes of a workgroup past the last group do no work.
    let live = g < p.groups;
    let cg = p.c / p.groups;
    let n = cg * p.s;
    let base = g * n;
    var s = 0.0;
    if (live) { for (var i = lane; i < n; i += 64u) { s += x[base + i]; } }
    let mean = reduce(lane, s) / f32(n);
    var v = 0.0;
    if (live) { for (var i = lane; i < n; i += 64u) { let d = x[base + i] - mean; v += d * d; } }
    let inv = inverseSqrt(reduce(lane, v) / f32(n) + p.eps);
    if (live) {
        for (var i = lane; i < n; i += 64u) {
            let ch = g * cg + i / p.s;
            out[base + i] = (x[base + i] - mean) * inv * w[ch] + b[ch];
        }
    }
}
