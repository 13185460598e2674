//! A small GGUF v3 writer for tests: metadata of any type and F32 tensors, laid out as llama.cpp
//! writes them (ggml dimension order, 32-byte aligned data), so that bad-input tests can build
//! the malformed files they need.

use std::path::Path;

/// A metadata value to write.
#[derive(Debug, Clone)]
pub enum Meta {
    /// uint32 (type 4).
    U32(u32),
    /// uint64 (type 10).
    U64(u64),
    /// float32 (type 6).
    F32(f32),
    /// string (type 8).
    Str(String),
    /// An array of strings.
    Strs(Vec<String>),
    /// An array of int32 (type 5).
    I32s(Vec<i32>),
    /// An array of uint8 (type 0) of this many zero bytes.
    U8s(usize),
}

/// A tensor in transformers order (`shape` = `[rows, cols]`), f32 values.
#[derive(Debug, Clone)]
pub struct GgufTensorSpec {
    /// GGUF name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Shape, outermost first (written reversed, as ggml does).
    pub shape: Vec<u64>,
    /// Row-major values.
    pub values: Vec<f32>,
}

fn string(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// The bytes of a GGUF v3 file.
pub fn gguf_bytes(meta: &[(&str, Meta)], tensors: &[GgufTensorSpec]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        string(&mut b, k);
        match v {
            Meta::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Meta::U64(x) => {
                b.extend(10u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Meta::F32(x) => {
                b.extend(6u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Meta::Str(s) => {
                b.extend(8u32.to_le_bytes());
                string(&mut b, s);
            }
            Meta::Strs(v) => {
                b.extend(9u32.to_le_bytes());
                b.extend(8u32.to_le_bytes());
                b.extend((v.len() as u64).to_le_bytes());
                for s in v {
                    string(&mut b, s);
                }
            }
            Meta::I32s(v) => {
                b.extend(9u32.to_le_bytes());
                b.extend(5u32.to_le_bytes());
                b.extend((v.len() as u64).to_le_bytes());
                for x in v {
                    b.extend(x.to_le_bytes());
                }
            }
            Meta::U8s(n) => {
                b.extend(9u32.to_le_bytes());
                b.extend(0u32.to_le_bytes());
                b.extend((*n as u64).to_le_bytes());
                b.resize(b.len() + n, 0);
            }
        }
    }
    let mut offset = 0u64;
    for t in tensors {
        string(&mut b, &t.name);
        b.extend((t.shape.len() as u32).to_le_bytes());
        for d in t.shape.iter().rev() {
            b.extend(d.to_le_bytes());
        }
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(offset.to_le_bytes());
        offset += (t.values.len() as u64 * 4).div_ceil(32) * 32;
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    for t in tensors {
        let start = b.len();
        b.extend(t.values.iter().flat_map(|v| v.to_le_bytes()));
        b.resize(start + (b.len() - start).div_ceil(32) * 32, 0);
    }
    b
}

/// Writes `gguf_bytes(meta, tensors)` to `path`.
pub fn write_gguf(path: &Path, meta: &[(&str, Meta)], tensors: &[GgufTensorSpec]) {
    std::fs::write(path, gguf_bytes(meta, tensors)).expect("write gguf");
}

/// A one-layer llama in GGUF: hidden 64, 4 heads over 2 key/value heads of width 16, ffn 128, a
/// 260-token byte-level vocabulary (256 bytes and 4 merges). Values are deterministic and
/// non-zero. Tests edit the returned metadata and tensors before writing.
pub fn tiny_llama_gguf() -> (Vec<(&'static str, Meta)>, Vec<GgufTensorSpec>) {
    let (h, heads, kv, hd, ffn) = (64u64, 4u64, 2u64, 16u64, 128u64);
    // GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to U+0100.. .
    let mut tokens = Vec::new();
    let mut extra = 0u32;
    for byte in 0u32..256 {
        let printable = (33..=126).contains(&byte)
            || (161..=172).contains(&byte)
            || (174..=255).contains(&byte);
        let c = if printable {
            char::from_u32(byte).expect("char")
        } else {
            extra += 1;
            char::from_u32(255 + extra).expect("char")
        };
        tokens.push(c.to_string());
    }
    let merges = ["h e", "l l", "he ll", "hell o"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let vocab = tokens.len() as u64;
    let meta = vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("llama.embedding_length", Meta::U32(h as u32)),
        ("llama.attention.head_count", Meta::U32(heads as u32)),
        ("llama.attention.head_count_kv", Meta::U32(kv as u32)),
        ("llama.feed_forward_length", Meta::U32(ffn as u32)),
        ("llama.block_count", Meta::U32(1)),
        ("llama.context_length", Meta::U32(256)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("llama.rope.freq_base", Meta::F32(10000.0)),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
        (
            "tokenizer.ggml.merges",
            Meta::Strs(merges.iter().map(|s| s.to_string()).collect()),
        ),
        ("tokenizer.ggml.eos_token_id", Meta::U32(0)),
    ];
    let mut seed = 1u64;
    let mut t = |name: &str, shape: &[u64]| {
        let n = shape.iter().product::<u64>() as usize;
        seed += 1;
        GgufTensorSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            values: crate::build::random_values(n, seed)
                .into_iter()
                .map(|v| if v == 0.0 { 0.5 } else { v })
                .collect(),
        }
    };
    let tensors = vec![
        t("token_embd.weight", &[vocab, h]),
        t("output_norm.weight", &[h]),
        t("blk.0.attn_norm.weight", &[h]),
        t("blk.0.ffn_norm.weight", &[h]),
        t("blk.0.attn_q.weight", &[heads * hd, h]),
        t("blk.0.attn_k.weight", &[kv * hd, h]),
        t("blk.0.attn_v.weight", &[kv * hd, h]),
        t("blk.0.attn_output.weight", &[h, heads * hd]),
        t("blk.0.ffn_gate.weight", &[ffn, h]),
        t("blk.0.ffn_up.weight", &[ffn, h]),
        t("blk.0.ffn_down.weight", &[h, ffn]),
    ];
    (meta, tensors)
}
