// Every storage binding is read_write: the executor binds slices of one arena buffer, and a
// dispatch may not mix read-only and read-write usage of the same buffer.
// Bit-exact bitsandbytes 4-bit dequantization: out[i] = code[nibble(i)] * absmax[i / blocksize],
// element 2j in the high nibble of byte j. One f32 multiply, as bitsandbytes does.
struct Params { n: u32, blocksize: u32, }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> packed: array<u32>;
@group(0) @binding(2) var<storage, read_write> absmax: array<f32>;
@group(0) @binding(3) var<storage, read_write> code: array<f32, 16>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

fn nibble(i: u32) -> u32 {
    let byte = (packed[i / 8u] >> (8u * ((i / 2u) % 4u))) & 0xffu;
    return select(byte & 0xfu, byte >> 4u, i % 2u == 0u);
}

@compute @workgroup_size(64)
fn dequant4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.n) { return; }
    out[i] = code[nibble(i)] * absmax[i / p.blocksize];
}
