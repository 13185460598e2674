//! The bitsandbytes format against files written by bitsandbytes, transformers and diffusers:
//! dequantization bit-exact, the reference linear, and the quantizer bit for bit.

use nibble_core::backend::cpu_ref;
use nibble_core::format::bnb::FloatDtype;
use nibble_core::format::quantize::{quantize_4bit, QuantizeOptions, QuantizedAbsmax};
use nibble_core::io::model::ModelIndex;
use nibble_tests::*;

fn layer_manifest() -> Vec<serde_json::Value> {
    let m = read_json(&fixture("linear4bit/manifest.json"));
    m["layers"].as_array().expect("layers").clone()
}

#[test]
fn linear4bit_layers_dequantize_bit_exact() {
    let model = ModelIndex::open(&fixture("linear4bit/layers.safetensors")).expect("open");
    let expected = Expected::open(&fixture("linear4bit/expected.safetensors"));
    let weights = model.q4_weights().map(<[_]>::to_vec).expect("find");
    let layers = layer_manifest();
    assert_eq!(
        weights.len(),
        layers.len(),
        "every layer is found as a 4-bit weight"
    );
    for layer in &layers {
        let name = layer["name"].as_str().expect("name");
        let base = format!("{name}.weight");
        let keys = weights
            .iter()
            .find(|k| k.base == base)
            .expect("weight found");
        let state = model.quant_state(keys).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            state.json.blocksize,
            layer["blocksize"].as_u64().expect("bs")
        );
        assert_eq!(
            state.json.nested.is_some(),
            layer["double_quant"].as_bool().expect("dq")
        );
        let packed = model
            .read_bytes(model.require(&base).expect("packed"))
            .expect("read");

        let want_absmax = expected
            .f32(&format!("{name}.absmax_f32"))
            .expect("absmax_f32");
        assert_bits_eq(&state.absmax, &want_absmax, &format!("{name} absmax"));

        let mut r = vec![0f32; state.numel()];
        state.dequantize_ref(&packed, &mut r).expect("deq");
        let want = expected.f32(&format!("{name}.deq_f32")).expect("deq_f32");
        assert_bits_eq(&r, &want, &format!("{name} deq_f32 (reference)"));

        let mut fast = vec![f32::NAN; state.numel()];
        state.dequantize(&packed, &mut fast).expect("deq fast");
        let same = r.iter().zip(&fast).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{name}: fast path differs from the reference in some bit"
        );

        if let Some(native) = expected.f32(&format!("{name}.deq_native")) {
            let mut nat = vec![0f32; state.numel()];
            state.dequantize_native(&packed, &mut nat).expect("native");
            assert_ne!(state.json.dtype, FloatDtype::F32);
            assert_bits_eq(&nat, &native, &format!("{name} deq_native"));
        }
    }
}

#[test]
fn linear4bit_reference_linear_matches_y() {
    let model = ModelIndex::open(&fixture("linear4bit/layers.safetensors")).expect("open");
    let expected = Expected::open(&fixture("linear4bit/expected.safetensors"));
    let weights = model.q4_weights().map(<[_]>::to_vec).expect("find");
    for layer in layer_manifest() {
        let name = layer["name"].as_str().expect("name");
        let keys = weights
            .iter()
            .find(|k| k.base == format!("{name}.weight"))
            .expect("w");
        let state = model.quant_state(keys).expect("state");
        let packed = model
            .read_bytes(model.require(&keys.base).expect("p"))
            .expect("read");
        let bias = model
            .get(&format!("{name}.bias"))
            .map(|e| model.read_f32(e).expect("bias"));
        assert_eq!(bias.is_some(), layer["bias"].as_bool().expect("bias flag"));
        let x = expected.f32(&format!("{name}.x")).expect("x");
        let in_f = state.json.shape[1] as usize;
        let rows = x.len() / in_f;
        let y = cpu_ref::linear_4bit(&x, rows, &state, &packed, bias.as_deref()).expect("linear");
        let want = expected.f32(&format!("{name}.y")).expect("y");
        let err = max_err_rel_to_max(&y, &want);
        assert!(err <= 1e-5, "{name}: linear error {err:e} > 1e-5 x max|y|");
    }
}

#[test]
fn quantizer_reproduces_bitsandbytes_bit_for_bit() {
    let model = ModelIndex::open(&fixture("linear4bit/layers.safetensors")).expect("open");
    let expected = Expected::open(&fixture("linear4bit/expected.safetensors"));
    let mut checked = 0;
    for layer in layer_manifest() {
        let name = layer["name"].as_str().expect("name");
        let Some(w) = expected.f32(&format!("{name}.w_orig_f32")) else {
            continue;
        };
        let base = format!("{name}.weight");
        let dtype = FloatDtype::parse(layer["dtype"].as_str().expect("dtype")).expect("dtype");
        let opts = QuantizeOptions {
            quant_type: nibble_core::format::bnb::QuantType::parse(
                layer["quant_type"].as_str().expect("qt"),
            )
            .expect("qt"),
            blocksize: layer["blocksize"].as_u64().expect("bs"),
            double_quant: layer["double_quant"].as_bool().expect("dq"),
        };
        let shape = [
            layer["out"].as_u64().expect("out"),
            layer["in"].as_u64().expect("in"),
        ];
        let q = quantize_4bit(&w, &shape, dtype, opts).expect("quantize");
        for (tname, dt, tshape, bytes) in q.tensors(&base) {
            let e = model
                .require(&tname)
                .unwrap_or_else(|_| panic!("{name}: file lacks {tname}"));
            assert_eq!(e.dtype, dt, "{tname} dtype");
            assert_eq!(e.shape, tshape, "{tname} shape");
            let want = model.read_bytes(e).expect("read");
            if want != bytes {
                let i = want
                    .iter()
                    .zip(&bytes)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                panic!(
                    "{tname}: quantizer output differs from bitsandbytes at byte {i} \
                     (got {:?}, want {:?}){}",
                    bytes.get(i),
                    want.get(i),
                    if tname.contains("quant_state") {
                        format!(
                            "\n got  {}\n want {}",
                            String::from_utf8_lossy(&bytes),
                            String::from_utf8_lossy(&want)
                        )
                    } else {
                        String::new()
                    }
                );
            }
        }
        if let QuantizedAbsmax::Nested { .. } = q.absmax {
            assert!(q.json.nested.is_some());
        }
        checked += 1;
    }
    assert!(checked > 0, "no layer of the fixture has w_orig_f32");
}

fn check_model_folder(rel: &str) -> usize {
    let dir = fixture(rel);
    let model = ModelIndex::open(&dir.join("model")).unwrap_or_else(|e| panic!("{e}"));
    let manifest = read_json(&dir.join("manifest.json"));
    let expected = Expected::open(&dir.join("expected.safetensors"));
    let deq = manifest["dequantized_weights"]
        .as_object()
        .expect("dequantized_weights");
    let weights = model.q4_weights().map(<[_]>::to_vec).expect("find");
    let listed: Vec<&str> = manifest["quantized_linears"]
        .as_array()
        .expect("quantized_linears")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    let mut found: Vec<&str> = weights.iter().map(|k| k.base.as_str()).collect();
    found.sort();
    let mut listed_sorted = listed.clone();
    listed_sorted.sort();
    assert_eq!(
        found, listed_sorted,
        "{rel}: the 4-bit weights found are the quantized linears"
    );
    for keys in &weights {
        let state = model.quant_state(keys).unwrap_or_else(|e| panic!("{e}"));
        let packed = model
            .read_bytes(model.require(&keys.base).expect("p"))
            .expect("read");
        let mut w = vec![0f32; state.numel()];
        state.dequantize_ref(&packed, &mut w).expect("deq");
        let mut fast = vec![0f32; state.numel()];
        state.dequantize(&packed, &mut fast).expect("deq");
        assert_bits_eq(&fast, &w, &format!("{rel} {} fast vs ref", keys.base));
        if let Some(want) = expected.f32(&format!("deq.{}", keys.base)) {
            assert_bits_eq(&w, &want, &format!("{rel} {}", keys.base));
        }
        let entry = &deq[&keys.base];
        let sha = entry["deq_f32_sha256"].as_str().expect("sha");
        assert_eq!(
            sha256_canon_f32(&w),
            sha,
            "{rel} {}: sha256 of dequantized weight",
            keys.base
        );
        let qs = &entry["quant_state"];
        assert_eq!(
            state.json.nested.as_ref().map(|n| n.offset),
            qs["nested_offset"].as_f64(),
            "{rel} {} nested_offset",
            keys.base
        );
    }
    weights.len()
}

#[test]
fn tiny_llama_weights_dequantize_bit_exact() {
    assert!(check_model_folder("tiny-llama-nf4") > 0);
}

#[test]
fn minilm_weights_dequantize_bit_exact() {
    assert!(check_model_folder("minilm-nf4") > 0);
}

#[test]
fn tiny_dit_weights_dequantize_bit_exact() {
    assert!(check_model_folder("tiny-dit-nf4") > 0);
}

/// The quantizer on real transformers weights: re-quantizing the dequantized weights is a fixed
/// point of bitsandbytes' NF4 (code * absmax / absmax returns the code), so the packed bytes must
/// come back identical.
#[test]
fn requantizing_dequantized_weights_is_a_fixed_point() {
    let dir = fixture("tiny-llama-nf4/model");
    let model = ModelIndex::open(&dir).expect("open");
    for keys in model.q4_weights().map(<[_]>::to_vec).expect("find") {
        let state = model.quant_state(&keys).expect("state");
        let packed = model
            .read_bytes(model.require(&keys.base).expect("p"))
            .expect("read");
        let mut w = vec![0f32; state.numel()];
        state.dequantize_ref(&packed, &mut w).expect("deq");
        let opts = QuantizeOptions {
            quant_type: keys.quant_type,
            blocksize: 64,
            double_quant: false,
        };
        let q = quantize_4bit(&w, &state.json.shape, FloatDtype::F32, opts).expect("q");
        assert_eq!(
            q.packed, packed,
            "{}: codes differ after a round trip",
            keys.base
        );
    }
}

/// bitsandbytes' `bnb_4bit_quant_storage` other than uint8 (FSDP QLoRA stores the packed bytes
/// as bf16 or f32): the same bytes under another element type load and dequantize bit for bit
/// like the U8 original; an element type that cannot hold them (bool) is refused.
#[test]
fn packed_weights_in_other_quant_storage_dtypes_load_the_same() {
    use nibble_core::format::dtype::Dtype;
    let dir = fixture("tiny-llama-nf4/model");
    let m = ModelIndex::open(&dir).expect("fixture");
    let keys = m.q4_weights().map(<[_]>::to_vec).expect("find");
    let k = &keys[0];
    let want = {
        let s = m.quant_state(k).expect("state");
        let packed = m.read_bytes(m.require(&k.base).expect("p")).expect("read");
        let mut w = vec![0f32; s.numel()];
        s.dequantize_ref(&packed, &mut w).expect("deq");
        w
    };
    for (dtype, width) in [(Dtype::BF16, 2u64), (Dtype::F32, 4), (Dtype::BOOL, 1)] {
        let tmp = tempfile::tempdir().expect("tmp");
        let tensors: Vec<_> = m
            .tensors()
            .map(|t| {
                let bytes = m.read_bytes(t).expect("read");
                if t.name == k.base {
                    (t.name.clone(), dtype, vec![t.len / width, 1], bytes)
                } else {
                    (t.name.clone(), t.dtype, t.shape.clone(), bytes)
                }
            })
            .collect();
        nibble_core::format::writer::write_safetensors(
            &tmp.path().join("model.safetensors"),
            &tensors,
            &Default::default(),
        )
        .expect("write");
        std::fs::copy(dir.join("config.json"), tmp.path().join("config.json")).expect("config");
        let m2 = ModelIndex::open(tmp.path()).expect("open");
        let r = m2.quant_state(k);
        if dtype == Dtype::BOOL {
            let e = r.expect_err("bool storage").to_string();
            assert!(e.contains("packed weight"), "{e}");
            continue;
        }
        let s = r.unwrap_or_else(|e| panic!("{dtype:?} storage: {e}"));
        let packed = m2
            .read_bytes(m2.require(&k.base).expect("p"))
            .expect("read");
        let mut w = vec![0f32; s.numel()];
        s.dequantize_ref(&packed, &mut w).expect("deq");
        assert_bits_eq(&w, &want, &format!("{dtype:?} quant storage"));
    }
}
