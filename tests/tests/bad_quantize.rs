//! `quantize` never writes a file it cannot read back (fault class 17): a weight with no
//! elements, or one whose double-quantization offset overflows f32, is refused before anything
//! is written; weights near f32's limit quantize without double quantization and load back
//! finite.

use nibble_core::format::bnb::{FloatDtype, QuantType};
use nibble_core::format::quantize::{quant_state_for, quantize_4bit, QuantizeOptions};
use nibble_core::io::model::ModelIndex;

fn opts(double_quant: bool) -> QuantizeOptions {
    QuantizeOptions {
        quant_type: QuantType::Nf4,
        blocksize: 64,
        double_quant,
    }
}

#[test]
fn an_empty_weight_is_refused_not_given_a_nan_offset() {
    for shape in [[0u64, 64], [64, 0]] {
        for dq in [false, true] {
            let e = quantize_4bit(&[], &shape, FloatDtype::F32, opts(dq))
                .expect_err("empty weight")
                .to_string();
            assert!(e.contains("no elements"), "{shape:?}: {e}");
            assert!(quant_state_for(&[], &shape, FloatDtype::F32, opts(dq)).is_err());
        }
    }
}

#[test]
fn weights_near_the_f32_limit_are_refused_for_double_quant_and_round_trip_without_it() {
    let values: Vec<f32> = (0..64 * 64)
        .map(|i| if i % 2 == 0 { 3e38 } else { -2.5e38 })
        .collect();
    let shape = [64u64, 64];
    let e = quantize_4bit(&values, &shape, FloatDtype::F32, opts(true))
        .expect_err("the mean of 64 absmax of 3e38 overflows")
        .to_string();
    assert!(e.contains("double quantization"), "{e}");
    assert!(quant_state_for(&values, &shape, FloatDtype::F32, opts(true)).is_err());

    let q = quantize_4bit(&values, &shape, FloatDtype::F32, opts(false)).expect("quantize");
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("w.safetensors");
    let tensors = q.tensors("w.weight");
    nibble_core::format::writer::write_safetensors(&path, &tensors, &Default::default())
        .expect("write");
    let m = ModelIndex::open(&path).expect("the written file opens");
    let keys = m.q4_weights().expect("4-bit")[0].clone();
    let state = m.quant_state(&keys).expect("its quant state loads");
    let packed = m
        .read_bytes(m.require("w.weight").expect("w"))
        .expect("read");
    let mut out = vec![0f32; state.numel()];
    state.dequantize_ref(&packed, &mut out).expect("dequantize");
    // NF4's widest gap between levels is 0.30 of the block's absmax (3e38 here).
    for (i, (o, v)) in out.iter().zip(&values).enumerate() {
        assert!(
            o.is_finite() && (o - v).abs() <= 0.16 * 3e38,
            "{i}: {o} for {v}"
        );
    }
}
