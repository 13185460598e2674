//! GGUF files whose metadata and tensors disagree: `convert` refuses them, naming the key or
//! tensor, before it writes anything (fault classes 8 and 9); a well-formed file still converts
//! with its Q rows put back in transformers order.

use nibble_core::error::Error;
use nibble_core::format::gguf_convert::{convert, unpermute_qk, ConvertOptions};
use nibble_core::io::model::ModelIndex;
use nibble_tests::gguf::{tiny_llama_gguf, write_gguf, GgufTensorSpec, Meta};

fn run(
    edit: impl FnOnce(&mut Vec<(&'static str, Meta)>, &mut Vec<GgufTensorSpec>),
) -> (tempfile::TempDir, Result<(), Error>) {
    let dir = tempfile::tempdir().expect("tmp");
    let (mut meta, mut tensors) = tiny_llama_gguf();
    edit(&mut meta, &mut tensors);
    let path = dir.path().join("m.gguf");
    write_gguf(&path, &meta, &tensors);
    let r = convert(
        &path,
        &dir.path().join("out"),
        ConvertOptions::default(),
        |_, _, _| {},
    );
    (dir, r.map(|_| ()))
}

fn refused(
    what: &str,
    edit: impl FnOnce(&mut Vec<(&'static str, Meta)>, &mut Vec<GgufTensorSpec>),
) -> String {
    let (dir, r) = run(edit);
    let e = match r {
        Ok(()) => panic!("{what}: converted without an error"),
        Err(e) => e.to_string(),
    };
    assert!(
        !dir.path().join("out/model.safetensors").exists(),
        "{what}: a refused file still wrote model.safetensors"
    );
    e
}

fn set(meta: &mut [(&'static str, Meta)], key: &str, v: Meta) {
    let slot = meta.iter_mut().find(|(k, _)| *k == key).expect("key");
    slot.1 = v;
}

#[test]
fn a_well_formed_gguf_converts_with_q_rows_in_transformers_order() {
    let (meta, tensors) = tiny_llama_gguf();
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("m.gguf");
    write_gguf(&path, &meta, &tensors);
    let out = dir.path().join("out");
    let report = convert(&path, &out, ConvertOptions::default(), |_, _, _| {})
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.quantized, 7, "every linear layer is 4-bit");
    let model = ModelIndex::open(&out.join("model.safetensors")).expect("open output");
    let keys = model
        .q4_weights()
        .expect("4-bit weights")
        .iter()
        .find(|k| k.base == "model.layers.0.self_attn.q_proj.weight")
        .cloned()
        .expect("q_proj");
    let state = model.quant_state(&keys).expect("state");
    let packed = model
        .read_bytes(model.require(&keys.base).expect("packed"))
        .expect("read");
    let mut got = vec![0f32; state.numel()];
    state.dequantize_ref(&packed, &mut got).expect("dequantize");
    let q = &tensors[4];
    let want = unpermute_qk(&q.values, 64, 64, 4);
    // NF4 rounds to the nearest of 16 levels whose widest gap is 0.30 of the block's absmax
    // (here at most 1), and the rows are un-permuted: far closer to that order than to GGUF's.
    let mean = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() as f64)
            .sum::<f64>()
            / a.len() as f64
    };
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 0.16, "q_proj element {i}: {g} vs {w}");
    }
    let (right, wrong) = (mean(&got, &want), mean(&got, &q.values));
    assert!(
        right < 0.1 && wrong > 4.0 * right,
        "mean error {right} against the un-permuted rows, {wrong} against GGUF's order"
    );
}

#[test]
fn projections_that_are_not_matrices_are_refused_naming_the_tensor() {
    let e = refused("1-D attn_q", |_, t| {
        t[4].shape = vec![64 * 64];
    });
    assert!(e.contains("blk.0.attn_q.weight"), "{e}");
    let e = refused("3-D ffn_up", |_, t| {
        t[9].shape = vec![2, 64, 64];
    });
    assert!(e.contains("blk.0.ffn_up.weight"), "{e}");
}

#[test]
fn head_counts_that_do_not_fit_the_rows_are_refused() {
    // 64 Q rows: 21 heads do not divide them, 0 is no head, 1000 heads need more rows.
    for heads in [21u32, 0, 1000, 3] {
        let e = refused(&format!("{heads} heads"), |m, _| {
            set(m, "llama.attention.head_count", Meta::U32(heads));
        });
        assert!(
            e.contains("head") || e.contains("attn_q"),
            "{heads} heads: {e}"
        );
    }
    for kv in [0u32, 3, 4096] {
        let e = refused(&format!("{kv} kv heads"), |m, _| {
            set(m, "llama.attention.head_count_kv", Meta::U32(kv));
        });
        assert!(
            e.contains("head") || e.contains("attn_k"),
            "{kv} kv heads: {e}"
        );
    }
    let e = refused("key_length 15", |m, _| {
        m.push(("llama.attention.key_length", Meta::U32(15)));
    });
    assert!(e.contains("15"), "{e}");
}

#[test]
fn sizes_and_layers_the_tensors_do_not_back_are_refused() {
    let e = refused("block_count 0", |m, _| {
        set(m, "llama.block_count", Meta::U32(0));
    });
    assert!(e.contains("block_count"), "{e}");
    let e = refused("embedding_length 2^40", |m, _| {
        set(m, "llama.embedding_length", Meta::U64(1 << 40));
    });
    assert!(e.contains("embedding_length"), "{e}");
    let e = refused("a layer past block_count", |_, t| {
        t[3].name = "blk.7.ffn_norm.weight".into();
    });
    assert!(e.contains("blk.7.ffn_norm.weight"), "{e}");
    let e = refused("ffn rows", |m, _| {
        set(m, "llama.feed_forward_length", Meta::U32(96));
    });
    assert!(e.contains("ffn_"), "{e}");
    let e = refused("tokenizer shorter than the embedding", |m, _| {
        set(m, "tokenizer.ggml.tokens", Meta::Strs(vec!["a".into(); 10]));
    });
    assert!(e.contains("tokenizer"), "{e}");
}

/// #32 fault 15: `convert` writes only folders nibble can load. Tokens that are empty or
/// repeated, merges that are not `A B` of the vocabulary, a missing `output_norm.weight` (or
/// any tensor a layer needs), and a `general.alignment` that is not a power of two (llama.cpp
/// refuses it; read anyway, every tensor comes from shifted offsets) are refused before anything
/// is written.
#[test]
fn files_that_would_convert_to_an_unloadable_folder_are_refused() {
    let tokens = |meta: &mut Vec<(&'static str, Meta)>, edit: &dyn Fn(&mut Vec<String>)| {
        let slot = meta
            .iter_mut()
            .find(|(k, _)| *k == "tokenizer.ggml.tokens")
            .expect("tokens");
        if let Meta::Strs(t) = &mut slot.1 {
            edit(t);
        }
    };
    let e = refused("an empty token", |m, _| {
        tokens(m, &|t| t[70] = String::new())
    });
    assert!(e.contains("tokenizer.ggml.tokens[70] is empty"), "{e}");
    let e = refused("a repeated token", |m, _| {
        tokens(m, &|t| t[71] = t[70].clone())
    });
    assert!(
        e.contains("tokenizer.ggml.tokens[71]") && e.contains("repeats token 70"),
        "{e}"
    );
    for bad in ["he", "h  e", "h x\u{1}", "q z", " e"] {
        let e = refused(bad, |m, _| {
            set(
                m,
                "tokenizer.ggml.merges",
                Meta::Strs(vec!["h e".into(), bad.into()]),
            )
        });
        assert!(e.contains("tokenizer.ggml.merges[1]"), "{bad:?}: {e}");
    }
    let e = refused("no output_norm", |_, t| {
        t.retain(|t| t.name != "output_norm.weight")
    });
    assert!(e.contains("output_norm.weight"), "{e}");
    let e = refused("no ffn_up", |_, t| {
        t.retain(|t| t.name != "blk.0.ffn_up.weight")
    });
    assert!(e.contains("blk.0.ffn_up.weight"), "{e}");
    let e = refused("alignment 3", |m, _| {
        m.push(("general.alignment", Meta::U32(3)))
    });
    assert!(
        e.contains("general.alignment") && e.contains("power of two"),
        "{e}"
    );
    let e = refused("alignment 0", |m, _| {
        m.push(("general.alignment", Meta::U32(0)))
    });
    assert!(e.contains("power of two"), "{e}");
    // The well-formed file's folder loads: its tokenizer and every tensor.
    let (dir, r) = run(|_, _| {});
    r.expect("converts");
    let out = dir.path().join("out");
    let json = std::fs::read(out.join("tokenizer.json")).expect("tokenizer.json");
    nibble_core::models::text::TextTokenizer::from_parts(&json, None, None).expect("loads");
    let m = ModelIndex::open(&out.join("model.safetensors")).expect("open");
    assert!(m.require("model.norm.weight").is_ok());
}
