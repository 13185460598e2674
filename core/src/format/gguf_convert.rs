//! `nibble convert`: a llama.cpp GGUF (architectures `llama` and `qwen2`) to a transformers
//! bitsandbytes-4bit model folder: every tensor dequantized to f32 and rounded to the output
//! dtype (bf16 by default, what SmolLM2 and Llama ship in); llama.cpp's row permutation of the
//! Q and K projections undone (back to the rotate-half layout); the attention and MLP linears
//! quantized to NF4 / FP4 (blocksize 64, optionally double-quantized) with the state-dict keys
//! transformers writes; embeddings, norms and lm_head kept in the output dtype. The GGUF tokenizer
//! metadata becomes `tokenizer.json` (byte-level BPE) and `tokenizer_config.json` (special tokens,
//! chat template); `config.json` carries the hyper-parameters and `quantization_config`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value as Json};

use crate::error::{Error, Result};
use crate::format::bnb::{FloatDtype, QuantType};
use crate::format::gguf::{GgufFile, GgufTensor};
use crate::format::quantize::{
    quant_state_for, quantize_4bit, state_tensor_specs, QuantizeOptions,
};
use crate::format::writer::{SafetensorsWriter, TensorSpec};

/// The files `convert` writes into its output folder.
pub const OUTPUT_FILES: [&str; 5] = [
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
];

/// How to convert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvertOptions {
    /// NF4 or FP4.
    pub quant_type: QuantType,
    /// Quantize absmax too.
    pub double_quant: bool,
    /// Dtype of the unquantized tensors (and the quant state's `dtype`): bf16 or f16.
    pub dtype: FloatDtype,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            quant_type: QuantType::Nf4,
            double_quant: true,
            dtype: FloatDtype::BF16,
        }
    }
}

/// What a GGUF tensor becomes.
#[derive(Debug, Clone)]
struct Plan {
    src: GgufTensor,
    name: String,
    /// Undo llama.cpp's Q/K row permutation with this many heads.
    unpermute_heads: Option<usize>,
    quantize: bool,
}

fn bad(file: &str, msg: impl Into<String>) -> Error {
    Error::Model {
        file: file.into(),
        msg: msg.into(),
    }
}

/// The hyper-parameters read from the GGUF metadata.
#[derive(Debug, Clone)]
struct Hparams {
    arch: String,
    hidden: u64,
    ffn: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    ctx: u64,
    rms_eps: f64,
    rope_theta: f64,
    rope_scaling: Option<Json>,
}

fn hparams(g: &GgufFile, file: &str) -> Result<Hparams> {
    let arch = g
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .ok_or_else(|| bad(file, "no general.architecture"))?
        .to_string();
    if arch != "llama" && arch != "qwen2" {
        return Err(bad(
            file,
            format!("architecture '{arch}' is not supported (llama, qwen2)"),
        ));
    }
    let u = |k: &str| g.get(&format!("{arch}.{k}")).and_then(|v| v.as_u64());
    let need = |k: &str| u(k).ok_or_else(|| bad(file, format!("missing {arch}.{k}")));
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let head_dim = u("attention.key_length").unwrap_or(hidden / heads.max(1));
    let f = |k: &str| g.get(&format!("{arch}.{k}")).and_then(|v| v.as_f64());
    let rope_scaling = match g
        .get(&format!("{arch}.rope.scaling.type"))
        .and_then(|v| v.as_str())
    {
        Some("linear") => Some(json!({
            "rope_type": "linear",
            "factor": f("rope.scaling.factor").unwrap_or(1.0),
        })),
        Some("none") | None => None,
        Some(other) => {
            return Err(bad(
                file,
                format!("rope scaling '{other}' is not supported (linear)"),
            ))
        }
    };
    let kv_heads = u("attention.head_count_kv").unwrap_or(heads);
    let ffn = need("feed_forward_length")?;
    let layers = need("block_count")?;
    let size_ok = |v: u64| (1..=1u64 << 31).contains(&v);
    for (k, v) in [
        ("embedding_length", hidden),
        ("attention.head_count", heads),
        ("attention.head_count_kv", kv_heads),
        ("attention.key_length (the head width)", head_dim),
        ("feed_forward_length", ffn),
        ("block_count", layers),
    ] {
        if !size_ok(v) {
            return Err(bad(
                file,
                format!("{arch}.{k} is {v}: not a size a model has"),
            ));
        }
    }
    if heads % kv_heads != 0 || head_dim % 2 != 0 {
        return Err(bad(
            file,
            format!(
                "{heads} attention heads over {kv_heads} key/value heads of width {head_dim}: \
                 the heads must group and the width be even"
            ),
        ));
    }
    let rms_eps = f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5);
    let rope_theta = f("rope.freq_base").unwrap_or(10000.0);
    for (k, v) in [
        ("attention.layer_norm_rms_epsilon", rms_eps),
        ("rope.freq_base", rope_theta),
    ] {
        if !(v.is_finite() && v > 0.0 && v < f32::MAX as f64) {
            return Err(bad(
                file,
                format!("{arch}.{k} is {v}: not a positive number"),
            ));
        }
    }
    if let Some(r) = &rope_scaling {
        let factor = r["factor"].as_f64().unwrap_or(f64::NAN);
        if !(factor.is_finite() && factor > 0.0) {
            return Err(bad(file, format!("{arch}.rope.scaling.factor is {factor}")));
        }
    }
    let ctx = u("context_length").unwrap_or(2048);
    if !size_ok(ctx) {
        return Err(bad(file, format!("{arch}.context_length is {ctx}")));
    }
    Ok(Hparams {
        hidden,
        ffn,
        layers,
        heads,
        kv_heads,
        head_dim,
        ctx,
        rms_eps,
        rope_theta,
        rope_scaling,
        arch,
    })
}

/// Checks a tensor's shape against the hyper-parameters before anything uses it (the Q/K
/// un-permutation, the quantizer): a 1-D projection, rows that the heads do not divide, a layer
/// past `block_count` are errors naming the tensor.
fn check_shape(file: &str, t: &GgufTensor, hf: &str, hp: &Hparams, g: &GgufFile) -> Result<()> {
    let (h, q, kv, f) = (
        hp.hidden,
        hp.heads * hp.head_dim,
        hp.kv_heads * hp.head_dim,
        hp.ffn,
    );
    let vocab = g
        .tensor("token_embd.weight")
        .map(|e| e.shape().first().copied().unwrap_or(0))
        .unwrap_or(0);
    let module = hf
        .trim_end_matches(".weight")
        .trim_end_matches(".bias")
        .rsplit('.')
        .next()
        .unwrap_or("");
    let bias = hf.ends_with(".bias");
    let want: Vec<u64> = match (module, bias) {
        ("embed_tokens" | "lm_head", _) => vec![vocab.max(1), h],
        ("norm" | "input_layernorm" | "post_attention_layernorm", _) => vec![h],
        ("q_proj", false) => vec![q, h],
        ("k_proj" | "v_proj", false) => vec![kv, h],
        ("q_proj", true) => vec![q],
        ("k_proj" | "v_proj", true) => vec![kv],
        ("o_proj", false) => vec![h, q],
        ("gate_proj" | "up_proj", false) => vec![f, h],
        ("down_proj", false) => vec![h, f],
        _ => t.shape(),
    };
    if t.shape() != want {
        return Err(bad(
            file,
            format!(
                "tensor '{}' has shape {:?}, the hyper-parameters say {want:?}",
                t.name,
                t.shape()
            ),
        ));
    }
    if let Some(layer) = hf
        .strip_prefix("model.layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|l| l.parse::<u64>().ok())
    {
        if layer >= hp.layers {
            return Err(bad(
                file,
                format!("tensor '{}' is in layer {layer} of {}", t.name, hp.layers),
            ));
        }
    }
    Ok(())
}

/// The transformers name of a GGUF tensor, and whether it is a linear layer's weight.
fn hf_name(gguf: &str) -> Option<(String, bool)> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some((n.to_string(), false));
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    let (module, linear) = match part {
        "attn_norm" => ("input_layernorm", false),
        "ffn_norm" => ("post_attention_layernorm", false),
        "attn_q" => ("self_attn.q_proj", true),
        "attn_k" => ("self_attn.k_proj", true),
        "attn_v" => ("self_attn.v_proj", true),
        "attn_output" => ("self_attn.o_proj", true),
        "ffn_gate" => ("mlp.gate_proj", true),
        "ffn_up" => ("mlp.up_proj", true),
        "ffn_down" => ("mlp.down_proj", true),
        _ => return None,
    };
    if kind != "weight" && kind != "bias" {
        return None;
    }
    Some((
        format!("model.layers.{layer}.{module}.{kind}"),
        linear && kind == "weight",
    ))
}

/// Rows of a GGUF Q or K weight (`[n_head * head_dim, in]`, llama.cpp's interleaved pairs) back
/// in the transformers order: GGUF row `h*hd + 2j + s` is HF row `h*hd + s*hd/2 + j`.
pub fn unpermute_qk(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let hd = rows / heads.max(1);
    let half = hd / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for j in 0..half {
            for s in 0..2 {
                let src = h * hd + 2 * j + s;
                let dst = h * hd + s * half + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn round_to(dtype: FloatDtype, v: &mut [f32]) {
    for x in v.iter_mut() {
        *x = dtype.round(*x);
    }
}

fn to_bytes(dtype: FloatDtype, v: &[f32]) -> Vec<u8> {
    match dtype {
        FloatDtype::BF16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
        FloatDtype::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        FloatDtype::F32 => crate::format::dtype::f32_to_bytes(v),
    }
}

/// What a conversion wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvertReport {
    /// Tensors written (4-bit components counted once per weight).
    pub tensors: usize,
    /// Linear weights quantized.
    pub quantized: usize,
    /// Bytes of `model.safetensors`.
    pub bytes: u64,
    /// Files written, relative to the output folder.
    pub files: Vec<String>,
}

/// Converts `gguf` into the folder `out`; `progress(done, total, name)` after each tensor.
pub fn convert(
    gguf: &Path,
    out: &Path,
    opts: ConvertOptions,
    mut progress: impl FnMut(usize, usize, &str),
) -> Result<ConvertReport> {
    let file = gguf.display().to_string();
    let g = GgufFile::open(gguf)?;
    let hp = hparams(&g, &file)?;
    if opts.dtype == FloatDtype::F32 {
        return Err(bad(&file, "the output dtype must be bf16 or f16"));
    }
    let mut plans = Vec::new();
    for t in &g.tensors {
        if t.name == "rope_freqs.weight" {
            return Err(bad(
                &file,
                "rope_freqs.weight (llama3 RoPE factors) is not supported yet",
            ));
        }
        let (name, linear) = hf_name(&t.name).ok_or_else(|| {
            bad(
                &file,
                format!("tensor '{}' has no transformers name", t.name),
            )
        })?;
        check_shape(&file, t, &name, &hp, &g)?;
        let unpermute_heads = if hp.arch == "llama" && t.name.ends_with(".weight") {
            if t.name.ends_with("attn_q.weight") {
                Some(hp.heads as usize)
            } else if t.name.ends_with("attn_k.weight") {
                Some(hp.kv_heads as usize)
            } else {
                None
            }
        } else {
            None
        };
        plans.push(Plan {
            src: t.clone(),
            name,
            unpermute_heads,
            quantize: linear && t.dims.len() == 2,
        });
    }
    plans.sort_by(|a, b| a.name.cmp(&b.name));
    // Every tensor a Llama-family model needs is there: a folder without one would be written
    // and then refused by every command that loads it.
    let have: std::collections::HashSet<&str> = g.tensors.iter().map(|t| t.name.as_str()).collect();
    let mut need = vec![
        "token_embd.weight".to_string(),
        "output_norm.weight".to_string(),
    ];
    for l in 0..hp.layers {
        for part in [
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            need.push(format!("blk.{l}.{part}.weight"));
        }
    }
    if let Some(missing) = need.iter().find(|n| !have.contains(n.as_str())) {
        return Err(bad(
            &file,
            format!(
                "no tensor '{missing}': a {} model of {} layers needs it",
                hp.arch, hp.layers
            ),
        ));
    }
    // Everything that can refuse the file is checked before the first byte is written.
    let tok = tokenizer(&g, &file)?;
    let emb = g
        .tensor("token_embd.weight")
        .ok_or_else(|| bad(&file, "no token_embd.weight"))?;
    if tok.vocab_size as u64 != emb.shape()[0] {
        return Err(bad(
            &file,
            format!(
                "the tokenizer has {} tokens, the embedding table {} rows",
                tok.vocab_size,
                emb.shape()[0]
            ),
        ));
    }
    let tied = g.tensor("output.weight").is_none();
    let qopts = QuantizeOptions {
        quant_type: opts.quant_type,
        blocksize: 64,
        double_quant: opts.double_quant,
    };
    let values = |p: &Plan| -> Result<Vec<f32>> {
        let mut v = g.read_f32(&p.src)?;
        if let Some(heads) = p.unpermute_heads {
            let shape = p.src.shape();
            v = unpermute_qk(&v, shape[0] as usize, shape[1] as usize, heads);
        }
        round_to(opts.dtype, &mut v);
        // A value beyond the output dtype's range would be written as infinity.
        crate::error::check_finite(&v, || {
            format!("{file}: tensor '{}' in {}", p.src.name, opts.dtype.name())
        })?;
        Ok(v)
    };
    // Pass 1: the header (a double-quantized weight's JSON holds a value of its data).
    let mut specs = Vec::new();
    for p in &plans {
        let shape = p.src.shape();
        if p.quantize {
            let v = values(p)?;
            let json = quant_state_for(&v, &shape, opts.dtype, qopts)?;
            specs.extend(state_tensor_specs(&p.name, &json));
        } else {
            specs.push(TensorSpec {
                name: p.name.clone(),
                dtype: opts.dtype.safetensors_dtype(),
                shape,
            });
        }
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out.display().to_string(), e))?;
    let st_path = out.join("model.safetensors");
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let mut w = SafetensorsWriter::create(&st_path, specs, &meta)?;
    let mut quantized = 0;
    for (i, p) in plans.iter().enumerate() {
        let v = values(p)?;
        if p.quantize {
            let q = quantize_4bit(&v, &p.src.shape(), opts.dtype, qopts)?;
            for (name, _, _, bytes) in q.tensors(&p.name) {
                w.write_tensor(&name, &bytes)?;
            }
            quantized += 1;
        } else {
            w.write_tensor(&p.name, &to_bytes(opts.dtype, &v))?;
        }
        progress(i + 1, plans.len(), &p.name);
    }
    w.finish()?;
    let bytes = std::fs::metadata(&st_path)
        .map_err(|e| Error::io(st_path.display().to_string(), e))?
        .len();

    // Configs.
    let write = |name: &str, v: &Json| -> Result<()> {
        let p = out.join(name);
        let text = serde_json::to_string_pretty(v).map_err(|e| Error::Invalid(e.to_string()))?;
        std::fs::write(&p, text + "\n").map_err(|e| Error::io(p.display().to_string(), e))
    };
    let (model_type, archs) = match hp.arch.as_str() {
        "qwen2" => ("qwen2", "Qwen2ForCausalLM"),
        _ => ("llama", "LlamaForCausalLM"),
    };
    let mut config = json!({
        "architectures": [archs],
        "model_type": model_type,
        "hidden_size": hp.hidden,
        "intermediate_size": hp.ffn,
        "num_hidden_layers": hp.layers,
        "num_attention_heads": hp.heads,
        "num_key_value_heads": hp.kv_heads,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": hp.ctx,
        "rms_norm_eps": hp.rms_eps as f32 as f64,
        "rope_theta": hp.rope_theta,
        "tie_word_embeddings": tied,
        "vocab_size": emb.shape()[0],
        "torch_dtype": opts.dtype.name(),
        "quantization_config": {
            "_load_in_4bit": true,
            "_load_in_8bit": false,
            "bnb_4bit_compute_dtype": opts.dtype.name(),
            "bnb_4bit_quant_storage": "uint8",
            "bnb_4bit_quant_type": opts.quant_type.name(),
            "bnb_4bit_use_double_quant": opts.double_quant,
            "llm_int8_enable_fp32_cpu_offload": false,
            "llm_int8_has_fp16_weight": false,
            "llm_int8_skip_modules": null,
            "llm_int8_threshold": 6.0,
            "load_in_4bit": true,
            "load_in_8bit": false,
            "quant_method": "bitsandbytes"
        },
    });
    if let Some(r) = &hp.rope_scaling {
        config["rope_scaling"] = r.clone();
    }
    if let Some(b) = tok.bos {
        config["bos_token_id"] = json!(b);
    }
    if let Some(e) = tok.eos {
        config["eos_token_id"] = json!(e);
    }
    if let Some(p) = tok.pad {
        config["pad_token_id"] = json!(p);
    }
    write("config.json", &config)?;
    let mut gen = json!({});
    if let Some(b) = tok.bos {
        gen["bos_token_id"] = json!(b);
    }
    if let Some(e) = tok.eos {
        gen["eos_token_id"] = json!(e);
    }
    write("generation_config.json", &gen)?;
    write("tokenizer.json", &tok.json)?;
    write("tokenizer_config.json", &tok.config)?;
    Ok(ConvertReport {
        tensors: plans.len(),
        quantized,
        bytes,
        files: OUTPUT_FILES.iter().map(|s| s.to_string()).collect(),
    })
}

struct Tok {
    json: Json,
    config: Json,
    vocab_size: usize,
    bos: Option<u64>,
    eos: Option<u64>,
    pad: Option<u64>,
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The GGUF tokenizer metadata as a `tokenizers` pipeline (`tokenizer.json`) and a
/// transformers `tokenizer_config.json`.
fn tokenizer(g: &GgufFile, file: &str) -> Result<Tok> {
    let s = |k: &str| g.get(k).and_then(|v| v.as_str());
    let model = s("tokenizer.ggml.model").unwrap_or("");
    if model != "gpt2" {
        return Err(bad(
            file,
            format!("tokenizer.ggml.model '{model}' is not supported (gpt2-style byte-level BPE)"),
        ));
    }
    let strs = |k: &str| -> Result<Vec<&str>> {
        g.get(k)
            .and_then(|v| v.as_strs())
            .map(|a| a.iter().map(String::as_str).collect())
            .ok_or_else(|| bad(file, format!("no {k} (an array of strings)")))
    };
    let tokens = strs("tokenizer.ggml.tokens")?;
    let types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
        None => Vec::new(),
        Some(v) => v.as_u64s().ok_or_else(|| {
            bad(
                file,
                "tokenizer.ggml.token_type is not an array of integers",
            )
        })?,
    };
    let merges = strs("tokenizer.ggml.merges")?;
    let id = |k: &str| g.get(k).and_then(|v| v.as_u64());
    let (bos, eos, pad) = (
        id("tokenizer.ggml.bos_token_id"),
        id("tokenizer.ggml.eos_token_id"),
        id("tokenizer.ggml.padding_token_id"),
    );
    let add_bos = g
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    // Token strings are the vocabulary's keys: each must be there once, and not empty.
    let mut vocab = serde_json::Map::new();
    for (i, t) in tokens.iter().enumerate() {
        if t.is_empty() {
            return Err(bad(file, format!("tokenizer.ggml.tokens[{i}] is empty")));
        }
        if let Some(j) = vocab.insert((*t).to_string(), json!(i)) {
            return Err(bad(
                file,
                format!("tokenizer.ggml.tokens[{i}] {t:?} repeats token {j}"),
            ));
        }
    }
    // Each merge is two tokens of the vocabulary separated by one space, whose concatenation
    // is a token too (what a BPE tokenizer loads).
    for (i, m) in merges.iter().enumerate() {
        let ok = m.split_once(' ').filter(|(a, b)| {
            !a.is_empty()
                && !b.is_empty()
                && !b.contains(' ')
                && vocab.contains_key(*a)
                && vocab.contains_key(*b)
                && vocab.contains_key(&format!("{a}{b}"))
        });
        if ok.is_none() {
            return Err(bad(
                file,
                format!(
                    "tokenizer.ggml.merges[{i}] {m:?} is not two tokens of the vocabulary \
                     ('A B') whose concatenation is one too"
                ),
            ));
        }
    }
    // Control (3) and user-defined (4) tokens are matched whole, before the pre-tokenizer.
    let added: Vec<Json> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(types.get(*i), Some(3) | Some(4)))
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": types.get(i) == Some(&3)})
        })
        .collect();
    let pre = s("tokenizer.ggml.pre").unwrap_or("default");
    let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
    let pre_tokenizer = match pre {
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "gpt2" | "default" => byte_level(true),
        "llama-bpe" | "llama3" | "smaug-bpe" => json!({"type": "Sequence", "pretokenizers": [
            split(LLAMA3_SPLIT), byte_level(false)]}),
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [
            split(QWEN2_SPLIT), byte_level(false)]}),
        other => {
            return Err(bad(
                file,
                format!("tokenizer pre-tokenizer '{other}' is not supported (smollm, gpt2, llama-bpe, qwen2)"),
            ))
        }
    };
    let tok_text = |i: Option<u64>| {
        i.and_then(|i| tokens.get(i as usize))
            .map(|t| t.to_string())
    };
    let post = match (add_bos, tok_text(bos)) {
        (true, Some(b)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {b.clone(): {"id": b, "ids": [bos], "tokens": [b]}}
        }),
        _ => {
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})
        }
    };
    let tj = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    // What is written must load: the tokenizer library parses it here (behind nibble's panic
    // boundary) before any file is written.
    #[cfg(feature = "text")]
    crate::error::guarded("tokenizer.json", "the tokenizer library", || {
        tokenizers::Tokenizer::from_bytes(tj.to_string().as_bytes())
    })
    .map_err(|e| {
        bad(
            file,
            format!("the tokenizer.json it describes does not load: {e}"),
        )
    })?;
    let mut cfg = json!({
        "add_bos_token": add_bos,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 1_000_000_000_000_000_000u64,
        "tokenizer_class": "GPT2Tokenizer",
    });
    if let Some(b) = tok_text(bos) {
        cfg["bos_token"] = json!(b);
    }
    if let Some(e) = tok_text(eos) {
        cfg["eos_token"] = json!(e);
    }
    if let Some(p) = tok_text(pad) {
        cfg["pad_token"] = json!(p);
    }
    if let Some(t) = s("tokenizer.chat_template") {
        cfg["chat_template"] = json!(t);
    }
    Ok(Tok {
        json: tj,
        config: cfg,
        vocab_size: tokens.len(),
        bos,
        eos,
        pad,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_maps_interleaved_pairs_back_to_halves() {
        // 2 heads of dim 4, 1 column: GGUF rows per head are [x0, x4', x1, x5'] style pairs.
        let gguf: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let hf = unpermute_qk(&gguf, 8, 1, 2);
        // Head 0: GGUF rows 0,1,2,3 = (j0 s0), (j0 s1), (j1 s0), (j1 s1) -> HF 0, 2, 1, 3.
        assert_eq!(hf, vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
    }

    #[test]
    fn names() {
        assert_eq!(
            hf_name("blk.12.attn_output.weight"),
            Some(("model.layers.12.self_attn.o_proj.weight".into(), true))
        );
        assert_eq!(
            hf_name("blk.0.attn_q.bias"),
            Some(("model.layers.0.self_attn.q_proj.bias".into(), false))
        );
        assert_eq!(
            hf_name("output_norm.weight"),
            Some(("model.norm.weight".into(), false))
        );
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
    }
}
