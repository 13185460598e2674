//! `nibble synth`: deterministic synthetic 4-bit models in the real on-disk layouts, for
//! benchmarks, tests and the demo. Weights are valid bitsandbytes NF4 with double quantization
//! (random codes, plausible scales); shapes follow real architectures, scaled to the asked size.
//!
//! - `llama`: transformers `LlamaForCausalLM` bnb-4bit layout (`model.layers.N.*`), dense
//!   embeddings, norms and `lm_head` in bfloat16 as transformers keeps them.
//! - `dit`: diffusers `FluxTransformer2DModel` bnb-4bit layout (double-stream
//!   `transformer_blocks.N.*`, single-stream `single_transformer_blocks.N.*`, embedders,
//!   `norm_out`, `proj_out`), every Linear quantized as diffusers does, biases and qk-norms dense.
//!
//! Files of at most [`MAX_SHARD_BYTES`] each; more than one gets `*.safetensors.index.json`.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::Dtype;
use serde_json::json;

use crate::error::{Error, Result};
use crate::format::bnb::{
    table_from_bits, FloatDtype, NestedState, QuantStateJson, QuantType, DYNAMIC_MAP_BITS,
};
use crate::format::quantize::{state_tensor_specs, NESTED_BLOCKSIZE};
use crate::format::writer::{SafetensorsWriter, TensorSpec};

/// Largest shard written.
pub const MAX_SHARD_BYTES: u64 = 512 << 20;
const BLOCKSIZE: u64 = 64;
const NESTED_OFFSET: f32 = 0.03125;

/// Which layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// transformers Llama decoder.
    Llama,
    /// diffusers Flux-style DiT.
    Dit,
}

#[derive(Debug, Clone)]
pub(crate) enum Kind {
    /// A Linear weight stored as NF4 double-quant, logical shape.
    Quant(Vec<u64>),
    /// A dense bfloat16 tensor; `center` is the mean value (1 for norm weights).
    Dense(Vec<u64>, f32),
    /// A dense bfloat16 tensor of mean 0 and this standard deviation.
    Normal(Vec<u64>, f32),
}

/// What will be written.
#[derive(Debug, Clone)]
pub struct SynthModel {
    /// config.json.
    pub config: serde_json::Value,
    tensors: Vec<(String, Kind)>,
    single_file: &'static str,
    index_file: &'static str,
    seed: u64,
}

fn quant_json(shape: &[u64]) -> QuantStateJson {
    QuantStateJson {
        quant_type: QuantType::Nf4,
        blocksize: BLOCKSIZE,
        dtype: FloatDtype::BF16,
        shape: shape.to_vec(),
        nested: Some(NestedState {
            blocksize: NESTED_BLOCKSIZE,
            dtype: "float32".into(),
            offset: NESTED_OFFSET as f64,
        }),
    }
}

fn specs_of(name: &str, kind: &Kind) -> Vec<TensorSpec> {
    match kind {
        Kind::Quant(shape) => state_tensor_specs(name, &quant_json(shape)),
        Kind::Dense(shape, _) | Kind::Normal(shape, _) => vec![TensorSpec {
            name: name.to_string(),
            dtype: Dtype::BF16,
            shape: shape.clone(),
        }],
    }
}

fn bytes_of(name: &str, kind: &Kind) -> u64 {
    specs_of(name, kind)
        .iter()
        .map(|s| s.byte_len().unwrap_or(0))
        .sum()
}

pub(crate) fn quantization_config() -> serde_json::Value {
    json!({
        "_load_in_4bit": true, "_load_in_8bit": false, "bnb_4bit_compute_dtype": "bfloat16",
        "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": true, "llm_int8_enable_fp32_cpu_offload": false,
        "llm_int8_has_fp16_weight": false, "llm_int8_skip_modules": null,
        "llm_int8_threshold": 6.0, "load_in_4bit": true, "load_in_8bit": false,
        "quant_method": "bitsandbytes"
    })
}

struct Rng(u64);
impl Rng {
    fn new(seed: u64, name: &str) -> Self {
        let mut h = seed ^ 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        Rng(h | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn fill(&mut self, out: &mut [u8]) {
        for c in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    /// Roughly normal (sum of 4 uniforms), mean 0, sd ~1.
    fn normal(&mut self) -> f32 {
        let v = self.next();
        let u = |s: u32| ((v >> s) & 0xffff) as f32 / 65535.0;
        (u(0) + u(16) + u(32) + u(48) - 2.0) * 1.732
    }
}

fn llama(size: u64, seed: u64) -> SynthModel {
    // (hidden, intermediate, heads, kv heads, vocab): SmolLM2 / TinyLlama / Llama-7B-like shapes.
    let shapes: [(u64, u64, u64, u64, u64); 5] = [
        (4096, 11008, 32, 32, 32000),
        (2048, 5632, 32, 4, 32000),
        (960, 2560, 15, 5, 49152),
        (576, 1536, 9, 3, 49152),
        (256, 768, 8, 4, 4096),
    ];
    let mut chosen = shapes[shapes.len() - 1];
    for s in shapes {
        let (h, i, heads, kv, vocab) = s;
        let kvd = h / heads * kv;
        let layer = (2 * h * h + 2 * h * kvd + 3 * h * i) * 9 / 16;
        if 2 * vocab * h * 2 + 4 * layer <= size {
            chosen = s;
            break;
        }
    }
    let (h, i, heads, kv, vocab) = chosen;
    let shape = LlamaSynthShape {
        hidden: h,
        intermediate: i,
        heads,
        kv_heads: kv,
        vocab,
        layers: 0,
        tied: false,
    };
    // Exact bytes of one layer and of the rest, from the tensors themselves.
    let with =
        |layers| llama_shaped(LlamaSynthShape { layers, ..shape }, seed, json!({})).tensor_bytes();
    let per_layer = with(2) - with(1);
    let fixed_bytes = with(1) - per_layer;
    let layers = (size.saturating_sub(fixed_bytes) / per_layer.max(1)).max(1);
    llama_shaped(
        LlamaSynthShape { layers, ..shape },
        seed,
        json!({"seed": seed, "requested_bytes": size}),
    )
}

/// The shape of a synthetic Llama-style decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaSynthShape {
    /// Model width.
    pub hidden: u64,
    /// MLP width.
    pub intermediate: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Vocabulary.
    pub vocab: u64,
    /// Decoder layers.
    pub layers: u64,
    /// lm_head tied to the embedding table (no `lm_head.weight`).
    pub tied: bool,
}

impl LlamaSynthShape {
    /// Bytes one layer's NF4 weights take on disk (roughly, absmax included).
    pub fn layer_bytes(&self) -> u64 {
        let kvd = self.hidden / self.heads * self.kv_heads;
        (2 * self.hidden * self.hidden
            + 2 * self.hidden * kvd
            + 3 * self.hidden * self.intermediate)
            * 9
            / 16
    }
}

fn llama_shaped(shape: LlamaSynthShape, seed: u64, note: serde_json::Value) -> SynthModel {
    let LlamaSynthShape {
        hidden: h,
        intermediate: i,
        heads,
        kv_heads: kv,
        vocab,
        layers,
        tied,
    } = shape;
    let hd = h / heads;
    let kvd = hd * kv;
    let mut m = SynthModel {
        config: json!({}),
        tensors: Vec::new(),
        single_file: "model.safetensors",
        index_file: "model.safetensors.index.json",
        seed,
    };
    let mut fixed = vec![
        (
            "model.embed_tokens.weight".to_string(),
            Kind::Dense(vec![vocab, h], 0.0),
        ),
        ("model.norm.weight".to_string(), Kind::Dense(vec![h], 1.0)),
    ];
    if !tied {
        fixed.push((
            "lm_head.weight".to_string(),
            Kind::Dense(vec![vocab, h], 0.0),
        ));
    }
    let layer = |l: u64| -> Vec<(String, Kind)> {
        let p = format!("model.layers.{l}");
        vec![
            (
                format!("{p}.input_layernorm.weight"),
                Kind::Dense(vec![h], 1.0),
            ),
            (
                format!("{p}.self_attn.q_proj.weight"),
                Kind::Quant(vec![h, h]),
            ),
            (
                format!("{p}.self_attn.k_proj.weight"),
                Kind::Quant(vec![kvd, h]),
            ),
            (
                format!("{p}.self_attn.v_proj.weight"),
                Kind::Quant(vec![kvd, h]),
            ),
            (
                format!("{p}.self_attn.o_proj.weight"),
                Kind::Quant(vec![h, h]),
            ),
            (
                format!("{p}.post_attention_layernorm.weight"),
                Kind::Dense(vec![h], 1.0),
            ),
            (format!("{p}.mlp.gate_proj.weight"), Kind::Quant(vec![i, h])),
            (format!("{p}.mlp.up_proj.weight"), Kind::Quant(vec![i, h])),
            (format!("{p}.mlp.down_proj.weight"), Kind::Quant(vec![h, i])),
        ]
    };
    m.tensors.push(fixed[0].clone());
    for l in 0..layers {
        m.tensors.extend(layer(l));
    }
    m.tensors.extend(fixed[1..].iter().cloned());
    m.config = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": i, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": tied,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        "attention_bias": false, "mlp_bias": false,
        "nibble_synthetic": note,
        "quantization_config": quantization_config(),
    });
    m
}

fn dit(size: u64, seed: u64) -> SynthModel {
    // (inner dim, heads): Flux is 3072 = 24 x 128; smaller sizes scale the width down.
    let widths: [(u64, u64); 5] = [(3072, 24), (1536, 12), (768, 6), (384, 3), (128, 2)];
    let (in_ch, joint, pooled, rope_axes) = (64u64, 4096u64, 768u64, [16u64, 56, 56]);
    // A linear's 4-bit weight and bias.
    let lin = |t: &mut Vec<(String, Kind)>, name: &str, out: u64, inp: u64| {
        t.push((format!("{name}.weight"), Kind::Quant(vec![out, inp])));
        t.push((format!("{name}.bias"), Kind::Dense(vec![out], 0.0)));
    };
    // The tensors of a double block and of a single block named `p`, width `d`, head dim `hd`.
    let double_block = |t: &mut Vec<(String, Kind)>, p: &str, d: u64, hd: u64| {
        lin(t, &format!("{p}.norm1.linear"), 6 * d, d);
        lin(t, &format!("{p}.norm1_context.linear"), 6 * d, d);
        for q in [
            "to_q",
            "to_k",
            "to_v",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_out.0",
            "to_add_out",
        ] {
            lin(t, &format!("{p}.attn.{q}"), d, d);
        }
        for n in ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] {
            t.push((format!("{p}.attn.{n}.weight"), Kind::Dense(vec![hd], 1.0)));
        }
        for ff in ["ff", "ff_context"] {
            lin(t, &format!("{p}.{ff}.net.0.proj"), 4 * d, d);
            lin(t, &format!("{p}.{ff}.net.2"), d, 4 * d);
        }
    };
    let single_block = |t: &mut Vec<(String, Kind)>, p: &str, d: u64, hd: u64| {
        lin(t, &format!("{p}.norm.linear"), 3 * d, d);
        for q in ["to_q", "to_k", "to_v"] {
            lin(t, &format!("{p}.attn.{q}"), d, d);
        }
        for n in ["norm_q", "norm_k"] {
            t.push((format!("{p}.attn.{n}.weight"), Kind::Dense(vec![hd], 1.0)));
        }
        lin(t, &format!("{p}.proj_mlp"), 4 * d, d);
        lin(t, &format!("{p}.proj_out"), d, 5 * d);
    };
    // The bytes one double block and two single blocks (Flux's 19 : 38) take stored.
    let unit = |d: u64, heads: u64| {
        let mut t = Vec::new();
        double_block(&mut t, "u", d, d / heads);
        single_block(&mut t, "u", d, d / heads);
        single_block(&mut t, "u", d, d / heads);
        t.iter().map(|(n, k)| bytes_of(n, k)).sum::<u64>()
    };
    let (d, heads) = widths
        .iter()
        .copied()
        .find(|&(d, heads)| 2 * unit(d, heads) <= size)
        .unwrap_or(widths[4]);
    let hd = d / heads;
    let mut m = SynthModel {
        config: json!({}),
        tensors: Vec::new(),
        single_file: "diffusion_pytorch_model.safetensors",
        index_file: "diffusion_pytorch_model.safetensors.index.json",
        seed,
    };
    let (joint, pooled) = (joint.min(d * 4), pooled.min(d * 2));
    lin(&mut m.tensors, "x_embedder", d, in_ch);
    lin(&mut m.tensors, "context_embedder", d, joint);
    for e in ["timestep_embedder", "guidance_embedder"] {
        lin(
            &mut m.tensors,
            &format!("time_text_embed.{e}.linear_1"),
            d,
            256,
        );
        lin(
            &mut m.tensors,
            &format!("time_text_embed.{e}.linear_2"),
            d,
            d,
        );
    }
    lin(
        &mut m.tensors,
        "time_text_embed.text_embedder.linear_1",
        d,
        pooled,
    );
    lin(
        &mut m.tensors,
        "time_text_embed.text_embedder.linear_2",
        d,
        d,
    );
    let head_bytes: u64 =
        m.tensors.iter().map(|(n, k)| bytes_of(n, k)).sum::<u64>() + 3 * d * d * 9 / 16;
    let units = (size.saturating_sub(head_bytes) / unit(d, heads)).max(1);
    let (n_double, n_single) = (units, 2 * units);
    for b in 0..n_double {
        double_block(&mut m.tensors, &format!("transformer_blocks.{b}"), d, hd);
    }
    for b in 0..n_single {
        single_block(
            &mut m.tensors,
            &format!("single_transformer_blocks.{b}"),
            d,
            hd,
        );
    }
    lin(&mut m.tensors, "norm_out.linear", 2 * d, d);
    lin(&mut m.tensors, "proj_out", in_ch, d);
    let axes = if hd == 128 {
        rope_axes.to_vec()
    } else {
        vec![hd / 4, hd * 3 / 8, hd * 3 / 8]
    };
    m.config = json!({
        "_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.42.1",
        "patch_size": 1, "in_channels": in_ch, "out_channels": null,
        "num_layers": n_double, "num_single_layers": n_single,
        "attention_head_dim": hd, "num_attention_heads": heads,
        "joint_attention_dim": joint, "pooled_projection_dim": pooled,
        "guidance_embeds": true, "axes_dims_rope": axes,
        "nibble_synthetic": {"seed": seed, "requested_bytes": size},
        "quantization_config": quantization_config(),
    });
    m
}

impl SynthModel {
    /// A model of these tensors (in this order) and this config, written as `single_file` (or
    /// shards of it with `index_file`).
    pub(crate) fn from_parts(
        config: serde_json::Value,
        tensors: Vec<(String, Kind)>,
        single_file: &'static str,
        index_file: &'static str,
        seed: u64,
    ) -> Self {
        SynthModel {
            config,
            tensors,
            single_file,
            index_file,
            seed,
        }
    }

    /// A synthetic Llama-style decoder of exactly this shape (a text encoder for the demo).
    pub fn llama_with(shape: LlamaSynthShape, seed: u64) -> Self {
        llama_shaped(shape, seed, json!({"seed": seed, "shape": "explicit"}))
    }

    /// The model a `synth` of this architecture and size writes.
    pub fn new(arch: Arch, size: u64, seed: u64) -> Self {
        match arch {
            Arch::Llama => llama(size, seed),
            Arch::Dit => dit(size, seed),
        }
    }

    /// Bytes of tensor data that will be written.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|(n, k)| bytes_of(n, k)).sum()
    }

    fn data(&self, name: &str, spec: &TensorSpec, kind: &Kind) -> Result<Vec<u8>> {
        let len = usize::try_from(spec.byte_len().unwrap_or(0))
            .map_err(|_| Error::Invalid(format!("{name}: too large for this machine")))?;
        let mut rng = Rng::new(self.seed, &spec.name);
        let mut out: Vec<u8> = crate::error::zeroed(len, &format!("synth's buffer for {name}"))?;
        match kind {
            Kind::Dense(_, center) => {
                let scale = if *center == 0.0 { 0.02 } else { 0.05 };
                for c in out.chunks_mut(2) {
                    let v = center + scale * rng.normal();
                    c.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
                }
            }
            Kind::Normal(_, sd) => {
                for c in out.chunks_mut(2) {
                    let v = sd * rng.normal();
                    c.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
                }
            }
            Kind::Quant(shape) => {
                let suffix = &spec.name[name.len()..];
                match suffix {
                    "" => rng.fill(&mut out),
                    ".absmax" => out
                        .iter_mut()
                        .for_each(|b| *b = 96 + (rng.next() % 64) as u8),
                    ".nested_absmax" => {
                        let v: Vec<f32> = (0..len / 4)
                            .map(|_| 0.02 + 0.01 * (rng.next() % 100) as f32 / 100.0)
                            .collect();
                        out = crate::format::dtype::f32_to_bytes(&v);
                    }
                    ".nested_quant_map" => {
                        out =
                            crate::format::dtype::f32_to_bytes(&table_from_bits(&DYNAMIC_MAP_BITS))
                    }
                    ".quant_map" => {
                        out = crate::format::dtype::f32_to_bytes(&QuantType::Nf4.code_table())
                    }
                    _ => out = quant_json(shape).to_json_bytes(),
                }
            }
        }
        Ok(out)
    }

    /// Writes config.json and the shards into `dir`, calling `progress(bytes_done, total)`.
    pub fn write(&self, dir: &Path, mut progress: impl FnMut(u64, u64)) -> Result<Vec<String>> {
        let d = dir.display().to_string();
        std::fs::create_dir_all(dir).map_err(|e| Error::io(&d, e))?;
        // Shards: whole tensors (with their quant-state components), at most MAX_SHARD_BYTES.
        let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
        let mut cur = 0u64;
        for (i, (n, k)) in self.tensors.iter().enumerate() {
            let b = bytes_of(n, k);
            if cur + b > MAX_SHARD_BYTES && cur > 0 {
                shards.push(Vec::new());
                cur = 0;
            }
            cur += b;
            shards.last_mut().expect("non-empty").push(i);
        }
        let n = shards.len();
        let names: Vec<String> = if n == 1 {
            vec![self.single_file.to_string()]
        } else {
            let stem = self.single_file.trim_end_matches(".safetensors");
            (1..=n)
                .map(|i| format!("{stem}-{i:05}-of-{n:05}.safetensors"))
                .collect()
        };
        let total = self.tensor_bytes();
        let mut done = 0u64;
        let mut weight_map = serde_json::Map::new();
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        for (shard, file) in shards.iter().zip(&names) {
            let specs: Vec<(usize, TensorSpec)> = shard
                .iter()
                .flat_map(|&i| {
                    specs_of(&self.tensors[i].0, &self.tensors[i].1)
                        .into_iter()
                        .map(move |s| (i, s))
                })
                .collect();
            for (_, s) in &specs {
                weight_map.insert(s.name.clone(), json!(file));
            }
            let mut w = SafetensorsWriter::create(
                &dir.join(file),
                specs.iter().map(|(_, s)| s.clone()).collect(),
                &meta,
            )?;
            for (i, s) in &specs {
                let (name, kind) = &self.tensors[*i];
                let bytes = self.data(name, s, kind)?;
                w.write_tensor(&s.name, &bytes)?;
                done += bytes.len() as u64;
                progress(done, total);
            }
            w.finish()?;
        }
        if n > 1 {
            let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
            let p = dir.join(self.index_file);
            std::fs::write(&p, serde_json::to_vec_pretty(&index).unwrap_or_default())
                .map_err(|e| Error::io(p.display().to_string(), e))?;
        }
        let p = dir.join("config.json");
        std::fs::write(
            &p,
            serde_json::to_vec_pretty(&self.config).unwrap_or_default(),
        )
        .map_err(|e| Error::io(p.display().to_string(), e))?;
        Ok(names)
    }
}
