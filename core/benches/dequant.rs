//! NF4 dequantization throughput on a 4096 x 4096 weight (blocksize 64): the scalar reference
//! (`cpu_ref`) against the optimized CPU path (pair table, AVX2 where present, all cores).
//! Throughput is reported in bytes of f32 output.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nibble_core::format::bnb::{FloatDtype, QuantState, QuantStateJson, QuantType};

fn weight() -> (QuantState, Vec<u8>) {
    let (rows, cols) = (4096u64, 4096u64);
    let n = (rows * cols) as usize;
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let packed: Vec<u8> = (0..n / 2)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    let absmax = (0..n / 64)
        .map(|j| 0.01 + (j % 251) as f32 * 0.003)
        .collect();
    let json = QuantStateJson {
        quant_type: QuantType::Nf4,
        blocksize: 64,
        dtype: FloatDtype::F32,
        shape: vec![rows, cols],
        nested: None,
    };
    (
        QuantState {
            json,
            code: QuantType::Nf4.code_table(),
            absmax,
        },
        packed,
    )
}

fn bench(c: &mut Criterion) {
    let (state, packed) = weight();
    let mut out = vec![0f32; state.numel()];
    let mut g = c.benchmark_group("nf4_dequant_4096x4096");
    g.throughput(Throughput::Bytes((out.len() * 4) as u64));
    g.sample_size(10);
    g.bench_function("scalar_reference", |b| {
        b.iter(|| state.dequantize_ref(&packed, &mut out).expect("deq"))
    });
    g.bench_function("optimized", |b| {
        b.iter(|| state.dequantize(&packed, &mut out).expect("deq"))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
