//! Llama-family decoders (Llama, Mistral, Qwen2, SmolLM) as a [`Graph`]: embedding, per layer
//! RMSNorm, q/k/v projections (with biases when the checkpoint has them, as Qwen2 does),
//! rotate-half RoPE (with llama3 / linear scaling), grouped-query causal attention, o projection,
//! residual, RMSNorm, SwiGLU MLP, residual; final RMSNorm and lm_head. Every layer is one weight
//! group, so the executor streams the model a layer at a time.
//!
//! The graph has two programs over the same weights and one KV cache (`[kv_heads, capacity,
//! head_dim]` per layer and for K and V, a state value sized by the plan): `prefill` runs the
//! whole prompt at positions `0..prompt` and fills the cache; `decode` runs one token at a
//! runtime position, appends its keys and values, and attends over the cache through a key
//! mask. Each decoded token is one pass over the layers, streamed like a denoising step.

use crate::error::{Error, Result};
use crate::graph::{ElemType, OpKind, RopeMode, ValueInfo};
use crate::graph::{Graph, ValueId};
use crate::io::model::ModelIndex;
use crate::models::{reshape, swap01, W};

/// RoPE frequency scaling from `rope_scaling` / `rope_parameters`.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// None.
    Default,
    /// Positions divided by `factor`.
    Linear {
        /// The factor.
        factor: f32,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// Scale of low frequencies.
        factor: f32,
        /// Wavelength bound (as a divisor of the original context) below which frequencies are scaled.
        low_freq_factor: f32,
        /// Wavelength bound above which frequencies are kept.
        high_freq_factor: f32,
        /// The context length the model was trained with.
        original_max_position_embeddings: f32,
    },
}

/// The decoder's hyper-parameters, from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Model width.
    pub hidden: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Whether lm_head reuses the embedding table.
    pub tied: bool,
    /// Beginning-of-sequence token, if the config names one.
    pub bos: Option<u32>,
    /// End-of-sequence tokens (a config may list several).
    pub eos: Vec<u32>,
    /// Longest context the model was trained for.
    pub max_positions: usize,
    /// The attention window where the model uses sliding-window attention (Mistral's
    /// `sliding_window`, Qwen2's with `use_sliding_window`); the graph attends to every earlier
    /// position, so it runs such a model only for sequences that fit the window.
    pub sliding_window: Option<usize>,
    /// With `dynamic` RoPE scaling: the trained length, up to which its frequencies are the
    /// default ones (the graph runs only sequences that fit).
    pub dynamic_rope_limit: Option<usize>,
}

/// The `model_type`s whose decoders this graph computes.
pub const MODEL_TYPES: [&str; 4] = ["llama", "mistral", "qwen2", "smollm"];

fn get_usize(c: &serde_json::Value, k: &str) -> Option<usize> {
    c.get(k).and_then(|v| v.as_u64()).map(|v| v as usize)
}

impl LlamaConfig {
    /// Reads a transformers `config.json`.
    pub fn from_json(c: &serde_json::Value) -> Result<Self> {
        let need = |k: &str| {
            get_usize(c, k).ok_or_else(|| Error::Model {
                file: "config.json".into(),
                msg: format!("missing '{k}'"),
            })
        };
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        let rope = c.get("rope_parameters");
        let rope_theta = c
            .get("rope_theta")
            .or_else(|| rope.and_then(|r| r.get("rope_theta")))
            .and_then(|v| v.as_f64())
            .unwrap_or(10000.0) as f32;
        let scaling = c
            .get("rope_scaling")
            .filter(|v| !v.is_null())
            .or(rope)
            .filter(|v| v.is_object());
        let rope_scaling = match scaling {
            None => RopeScaling::Default,
            Some(r) => {
                let kind = r
                    .get("rope_type")
                    .or_else(|| r.get("type"))
                    .and_then(|v| v.as_str())
                    .unwrap_or("default");
                let f = |k: &str, d: f64| r.get(k).and_then(|v| v.as_f64()).unwrap_or(d) as f32;
                match kind {
                    // Dynamic NTK changes the frequencies only past the trained length; within
                    // it transformers uses the default ones (the graph refuses longer runs).
                    "default" | "dynamic" => RopeScaling::Default,
                    "linear" => RopeScaling::Linear {
                        factor: f("factor", 1.0),
                    },
                    "llama3" => RopeScaling::Llama3 {
                        factor: f("factor", 8.0),
                        low_freq_factor: f("low_freq_factor", 1.0),
                        high_freq_factor: f("high_freq_factor", 4.0),
                        original_max_position_embeddings: f(
                            "original_max_position_embeddings",
                            8192.0,
                        ),
                    },
                    other => {
                        return Err(Error::Model {
                            file: "config.json".into(),
                            msg: format!(
                                "rope scaling '{other}' is not supported (default, linear, llama3, dynamic)"
                            ),
                        })
                    }
                }
            }
        };
        let ids = |k: &str| -> Vec<u32> {
            match c.get(k) {
                Some(serde_json::Value::Number(n)) => {
                    n.as_u64().map(|v| v as u32).into_iter().collect()
                }
                Some(serde_json::Value::Array(a)) => a
                    .iter()
                    .filter_map(|v| v.as_u64().map(|v| v as u32))
                    .collect(),
                _ => Vec::new(),
            }
        };
        let model_type = c.get("model_type").and_then(|v| v.as_str());
        if let Some(t) = model_type.filter(|t| !MODEL_TYPES.contains(t)) {
            return Err(Error::Model {
                file: "config.json".into(),
                msg: format!(
                    "model_type '{t}' is not a decoder nibble computes ({})",
                    MODEL_TYPES.join(", ")
                ),
            });
        }
        let dynamic_rope_limit = scaling
            .filter(|r| {
                r.get("rope_type")
                    .or_else(|| r.get("type"))
                    .and_then(|v| v.as_str())
                    == Some("dynamic")
            })
            .map(|r| {
                r.get("original_max_position_embeddings")
                    .and_then(|v| v.as_u64())
                    .map(|v| v as usize)
                    .or_else(|| get_usize(c, "max_position_embeddings"))
                    .unwrap_or(2048)
            });
        let window = get_usize(c, "sliding_window");
        let sliding_window = match model_type {
            Some("qwen2") => window
                .filter(|_| c.get("use_sliding_window").and_then(|v| v.as_bool()) == Some(true)),
            _ => window,
        };
        let hidden_act = c
            .get("hidden_act")
            .and_then(|v| v.as_str())
            .unwrap_or("silu");
        if hidden_act != "silu" {
            return Err(Error::Model {
                file: "config.json".into(),
                msg: format!("hidden_act '{hidden_act}' is not supported (silu)"),
            });
        }
        Ok(LlamaConfig {
            hidden,
            intermediate: need("intermediate_size")?,
            layers: need("num_hidden_layers")?,
            heads,
            kv_heads: get_usize(c, "num_key_value_heads").unwrap_or(heads),
            head_dim: get_usize(c, "head_dim").unwrap_or(hidden / heads.max(1)),
            vocab: need("vocab_size")?,
            rms_eps: c
                .get("rms_norm_eps")
                .and_then(|v| v.as_f64())
                .unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            tied: c
                .get("tie_word_embeddings")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            bos: ids("bos_token_id").first().copied(),
            eos: ids("eos_token_id"),
            max_positions: get_usize(c, "max_position_embeddings").unwrap_or(1 << 20),
            sliding_window,
            dynamic_rope_limit,
        })
    }

    /// The inverse frequencies, as transformers computes them in f32 (`1 / theta^(2i / d)`,
    /// then the scaling rule).
    pub fn inv_freq(&self) -> Vec<f32> {
        let half = self.head_dim / 2;
        let base: Vec<f32> = (0..half)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f32 / self.head_dim as f32))
            .collect();
        match self.rope_scaling {
            RopeScaling::Default => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wl = old / low_freq_factor;
                let high_wl = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wl = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wl > low_wl { f / factor } else { f };
                        let medium = wl >= high_wl && wl <= low_wl;
                        if medium {
                            let smooth =
                                (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
        }
    }

    /// cos and sin tables `[T, head_dim / 2]` for positions `0..t` (see [`Self::rope_at`]).
    pub fn rope_tables(&self, t: usize) -> (Vec<f32>, Vec<f32>) {
        self.rope_at(0, t)
    }

    /// cos and sin tables `[T, head_dim / 2]` for positions `start..start + t`, in f32 as
    /// transformers computes them (`freqs = pos * inv_freq`).
    pub fn rope_at(&self, start: usize, t: usize) -> (Vec<f32>, Vec<f32>) {
        let inv = self.inv_freq();
        let mut cos = Vec::with_capacity(t * inv.len());
        let mut sin = Vec::with_capacity(t * inv.len());
        for p in start..start + t {
            for f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        (cos, sin)
    }
}

/// What the graph is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaShape {
    /// Tokens of the prefill program.
    pub prompt: usize,
    /// Positions the KV cache holds (prompt + generated tokens); with `capacity == prompt` the
    /// graph has no decode program and no cache.
    pub capacity: usize,
    /// Prefill returns logits for every prompt position (else only the last).
    pub all_logits: bool,
    /// Prefill returns the final-normed hidden states `[prompt, hidden]` instead of logits
    /// (a text encoder), and there is no decode program.
    pub hidden_states: bool,
}

impl LlamaShape {
    /// Generation: a prompt of `prompt` tokens and up to `new_tokens` more.
    pub fn generate(prompt: usize, new_tokens: usize) -> Self {
        LlamaShape {
            prompt,
            capacity: prompt + new_tokens,
            all_logits: false,
            hidden_states: false,
        }
    }
}

/// The decoder graph.
///
/// `prefill` inputs: token ids `u32[T]`, cos and sin `[T, head_dim/2]` for positions `0..T`, the
/// cache position `u32[1]` (0); output: logits `[T or 1, vocab]` (or hidden states).
/// `decode` inputs: one token id `u32[1]`, cos and sin `[1, head_dim/2]` at its position, the
/// position `u32[1]`, the key mask `[capacity]` (1 for positions `0..=pos`); output: logits
/// `[1, vocab]`.
#[derive(Debug)]
pub struct LlamaGraph {
    /// The graph.
    pub graph: Graph,
    /// The configuration it was built from.
    pub config: LlamaConfig,
    /// The shape it was built for.
    pub shape: LlamaShape,
    /// Index of the prefill program.
    pub prefill: usize,
    /// Index of the decode program, if any.
    pub decode: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
struct Layer {
    n1: ValueId,
    q: W,
    k: W,
    v: W,
    o: W,
    n2: ValueId,
    gate: W,
    up: W,
    down: W,
}

/// Reads the decoder's configuration from a model's `config.json`.
pub fn config(model: &ModelIndex) -> Result<LlamaConfig> {
    LlamaConfig::from_json(model.config.as_ref().ok_or_else(|| Error::Model {
        file: model.root.clone(),
        msg: "no config.json".into(),
    })?)
}

/// Builds the decoder against `model`'s weights.
pub fn build(model: &ModelIndex, shape: LlamaShape) -> Result<LlamaGraph> {
    let cfg = config(model)?;
    if shape.prompt == 0 || shape.capacity < shape.prompt {
        return Err(Error::Invalid(format!(
            "llama graph: prompt {} and capacity {} (need 1 <= prompt <= capacity)",
            shape.prompt, shape.capacity
        )));
    }
    if let Some(w) = cfg.sliding_window.filter(|&w| shape.capacity > w) {
        return Err(Error::Invalid(format!(
            "the model attends through a sliding window of {w} positions, which nibble does \
             not compute: prompt + new tokens ({}) must fit in it",
            shape.capacity
        )));
    }
    if let Some(l) = cfg.dynamic_rope_limit.filter(|&l| shape.capacity > l) {
        return Err(Error::Invalid(format!(
            "dynamic RoPE scaling changes the frequencies past {l} positions, which nibble does \
             not compute: prompt + new tokens ({}) must fit in {l}",
            shape.capacity
        )));
    }
    let mut g = Graph::new();
    let (h, hd, nh, nkv) = (cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads);
    if nkv == 0 || nh % nkv != 0 {
        return Err(Error::Model {
            file: "config.json".into(),
            msg: format!("{nh} attention heads do not group over {nkv} key/value heads"),
        });
    }
    let embed_group = g.group("model.embed_tokens");
    let table = g.dense_weight(embed_group, "model.embed_tokens.weight", &[cfg.vocab, h]);
    let weight = |g: &mut Graph, grp: usize, name: &str, out: usize, inp: usize| {
        W::load(g, model, grp, name, out, inp)
    };
    let mut layers = Vec::with_capacity(cfg.layers);
    for l in 0..cfg.layers {
        let p = format!("model.layers.{l}");
        let grp = g.group(&p);
        let a = format!("{p}.self_attn");
        let m = format!("{p}.mlp");
        layers.push(Layer {
            n1: g.dense_weight(grp, &format!("{p}.input_layernorm.weight"), &[h]),
            q: weight(&mut g, grp, &format!("{a}.q_proj.weight"), nh * hd, h)?,
            k: weight(&mut g, grp, &format!("{a}.k_proj.weight"), nkv * hd, h)?,
            v: weight(&mut g, grp, &format!("{a}.v_proj.weight"), nkv * hd, h)?,
            o: weight(&mut g, grp, &format!("{a}.o_proj.weight"), h, nh * hd)?,
            n2: g.dense_weight(grp, &format!("{p}.post_attention_layernorm.weight"), &[h]),
            gate: weight(
                &mut g,
                grp,
                &format!("{m}.gate_proj.weight"),
                cfg.intermediate,
                h,
            )?,
            up: weight(
                &mut g,
                grp,
                &format!("{m}.up_proj.weight"),
                cfg.intermediate,
                h,
            )?,
            down: weight(
                &mut g,
                grp,
                &format!("{m}.down_proj.weight"),
                h,
                cfg.intermediate,
            )?,
        });
    }
    let head_group = g.group("lm_head");
    let norm_f = g.dense_weight(head_group, "model.norm.weight", &[h]);
    let tied = cfg.tied || model.get("lm_head.weight").is_none();
    let head = if tied {
        // Tied: the table is a weight of this last group too, so that a streamed embedding group
        // need not stay on the device from the first op to the last.
        W::Dense(
            g.dense_weight(head_group, "model.embed_tokens.weight", &[cfg.vocab, h]),
            None,
        )
    } else {
        weight(&mut g, head_group, "lm_head.weight", cfg.vocab, h)?
    };
    let with_cache = shape.capacity > shape.prompt && !shape.hidden_states;
    let caches: Vec<(ValueId, ValueId)> = if with_cache {
        (0..cfg.layers)
            .map(|_| {
                let info = ValueInfo::f32(&[nkv, shape.capacity, hd]);
                (g.state(info.clone()), g.state(info))
            })
            .collect()
    } else {
        Vec::new()
    };
    let u32v = |shape: &[usize]| ValueInfo {
        shape: shape.to_vec(),
        elem: ElemType::U32,
    };
    let mut programs = Vec::new();
    for decode in [false, true] {
        if decode && !with_cache {
            break;
        }
        let t = if decode { 1 } else { shape.prompt };
        let prog = g.program(if decode { "decode" } else { "prefill" });
        programs.push(prog);
        let ids = g.input(u32v(&[t]));
        let cos = g.input(ValueInfo::f32(&[t, hd / 2]));
        let sin = g.input(ValueInfo::f32(&[t, hd / 2]));
        let pos = g.input(u32v(&[1]));
        let mask = decode.then(|| g.input(ValueInfo::f32(&[shape.capacity])));
        let mut x = g.op(OpKind::Embedding, &[ids, table], None)?;
        for (l, lw) in layers.iter().enumerate() {
            let hn = g.op(OpKind::RmsNorm { eps: cfg.rms_eps }, &[x, lw.n1], None)?;
            let q = lw.q.apply(&mut g, hn)?;
            let k = lw.k.apply(&mut g, hn)?;
            let v = lw.v.apply(&mut g, hn)?;
            let q = reshape(&mut g, q, &[t, nh, hd])?;
            let k = reshape(&mut g, k, &[t, nkv, hd])?;
            let v = reshape(&mut g, v, &[t, nkv, hd])?;
            let rope = OpKind::Rope {
                mode: RopeMode::RotateHalf,
            };
            let q = g.op(rope.clone(), &[q, cos, sin], None)?;
            let k = g.op(rope, &[k, cos, sin], None)?;
            let q = swap01(&mut g, q)?;
            let k = swap01(&mut g, k)?;
            let v = swap01(&mut g, v)?;
            let scale = 1.0 / (hd as f32).sqrt();
            let a = if let Some(mask) = mask {
                let (kc, vc) = caches[l];
                let kc = g.op(OpKind::CacheWrite, &[kc, k, pos], None)?;
                let vc = g.op(OpKind::CacheWrite, &[vc, v, pos], None)?;
                g.op(
                    OpKind::Attention {
                        causal: false,
                        scale,
                        key_mask: true,
                    },
                    &[q, kc, vc, mask],
                    None,
                )?
            } else {
                if with_cache {
                    let (kc, vc) = caches[l];
                    g.op(OpKind::CacheWrite, &[kc, k, pos], None)?;
                    g.op(OpKind::CacheWrite, &[vc, v, pos], None)?;
                }
                g.op(
                    OpKind::Attention {
                        causal: true,
                        scale,
                        key_mask: false,
                    },
                    &[q, k, v],
                    None,
                )?
            };
            let a = swap01(&mut g, a)?;
            let a = reshape(&mut g, a, &[t, nh * hd])?;
            let o = lw.o.apply(&mut g, a)?;
            x = g.op(OpKind::Add, &[x, o], None)?;
            let hn = g.op(OpKind::RmsNorm { eps: cfg.rms_eps }, &[x, lw.n2], None)?;
            let gate = lw.gate.apply(&mut g, hn)?;
            let up = lw.up.apply(&mut g, hn)?;
            let gate = g.op(OpKind::Silu, &[gate], None)?;
            let m = g.op(OpKind::Mul, &[gate, up], None)?;
            let down = lw.down.apply(&mut g, m)?;
            x = g.op(OpKind::Add, &[x, down], None)?;
        }
        if !decode && !shape.all_logits && !shape.hidden_states && t > 1 {
            x = g.op(
                OpKind::Slice {
                    axis: 0,
                    start: t - 1,
                    len: 1,
                },
                &[x],
                None,
            )?;
        }
        let xn = g.op(OpKind::RmsNorm { eps: cfg.rms_eps }, &[x, norm_f], None)?;
        if shape.hidden_states {
            g.output(xn);
        } else {
            let logits = head.apply(&mut g, xn)?;
            g.output(logits);
        }
    }
    refuse_unread_tensors(model, &g, tied)?;
    Ok(LlamaGraph {
        graph: g,
        config: cfg,
        shape,
        prefill: programs[0],
        decode: programs.get(1).copied(),
    })
}

/// A checkpoint tensor the decoder graph does not read means a model this graph does not
/// compute (Qwen3's q/k norms, another architecture's extra weights): an error, not a silently
/// different result. Not read by design: rotary `inv_freq` buffers and, with tied embeddings,
/// `lm_head`.
fn refuse_unread_tensors(model: &ModelIndex, g: &Graph, tied: bool) -> Result<()> {
    let (dense, q4) = g.weight_names();
    let dense: std::collections::HashSet<&str> = dense.into_iter().collect();
    let read = |n: &str| {
        dense.contains(n)
            || q4
                .iter()
                .any(|b| n == *b || n.strip_prefix(b).is_some_and(|r| r.starts_with('.')))
            || n.ends_with("rotary_emb.inv_freq")
            || (tied && (n == "lm_head.weight" || n.starts_with("lm_head.weight.")))
    };
    let unread: Vec<&str> = model
        .tensors()
        .map(|t| t.name.as_str())
        .filter(|n| !read(n))
        .collect();
    match unread.as_slice() {
        [] => Ok(()),
        [first, ..] => Err(Error::Model {
            file: model.root.clone(),
            msg: format!(
                "{} tensor(s) are not part of a Llama-family decoder (first: {first}): this \
                 model computes something nibble's decoder does not",
                unread.len()
            ),
        }),
    }
}

/// A decoder bound to a backend: prefill once, then one token per step through the KV cache.
pub struct Decoder<B: crate::backend::Backend> {
    ex: crate::exec::Executor<B>,
    /// The configuration.
    pub config: LlamaConfig,
    /// The shape the graph was built for.
    pub shape: LlamaShape,
    prefill: usize,
    decode: Option<usize>,
    pos: usize,
    mask: Vec<f32>,
}

impl<B: crate::backend::Backend> std::fmt::Debug for Decoder<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("shape", &self.shape)
            .field("pos", &self.pos)
            .finish()
    }
}

impl<B: crate::backend::Backend> Decoder<B> {
    /// Builds the graph, plans memory and loads the resident weights.
    pub fn new(
        model: &ModelIndex,
        backend: B,
        shape: LlamaShape,
        opts: crate::exec::ExecOptions,
    ) -> Result<Self> {
        Self::from_graph(build(model, shape)?, model, backend, opts)
    }

    /// A decoder over an already built graph.
    pub fn from_graph(
        lg: LlamaGraph,
        model: &ModelIndex,
        backend: B,
        opts: crate::exec::ExecOptions,
    ) -> Result<Self> {
        Self::with_ring(lg, model, backend, opts, None)
    }

    /// [`Decoder::from_graph`] streaming through a ring handed over from an earlier phase.
    pub fn with_ring(
        lg: LlamaGraph,
        model: &ModelIndex,
        backend: B,
        opts: crate::exec::ExecOptions,
        ring: Option<crate::stream::ring::StagingRing>,
    ) -> Result<Self> {
        let ex = crate::exec::Executor::with_ring(lg.graph, model, backend, opts, ring)?;
        Ok(Self::over(lg.config, lg.shape, lg.prefill, lg.decode, ex))
    }

    /// [`Decoder::from_graph`] for an event loop (the browser): weights come from the sources
    /// `make_source` makes, and resident groups are awaited.
    pub async fn from_graph_async(
        lg: LlamaGraph,
        model: &ModelIndex,
        backend: B,
        opts: crate::exec::ExecOptions,
        make_source: &mut dyn FnMut() -> Box<dyn crate::io::source::ByteSource>,
    ) -> Result<Self> {
        let ex =
            crate::exec::Executor::with_source_async(lg.graph, model, backend, opts, make_source)
                .await?;
        Ok(Self::over(lg.config, lg.shape, lg.prefill, lg.decode, ex))
    }

    fn over(
        config: LlamaConfig,
        shape: LlamaShape,
        prefill: usize,
        decode: Option<usize>,
        ex: crate::exec::Executor<B>,
    ) -> Self {
        Decoder {
            ex,
            config,
            shape,
            prefill,
            decode,
            pos: 0,
            mask: vec![0.0; shape.capacity],
        }
    }

    /// The executor, mutable (profiling, stream limits).
    pub fn executor_mut(&mut self) -> &mut crate::exec::Executor<B> {
        &mut self.ex
    }

    /// Ends the decoder: releases its device memory, gives back the backend and the ring.
    pub fn into_parts(self) -> (B, Option<crate::stream::ring::StagingRing>) {
        self.ex.into_parts()
    }

    /// The executor (plan, backend).
    pub fn executor(&self) -> &crate::exec::Executor<B> {
        &self.ex
    }

    /// Tokens in the cache so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&t| t as usize >= self.config.vocab) {
            Some(bad) => Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab
            ))),
            None => Ok(()),
        }
    }

    /// Runs the prompt (exactly `shape.prompt` tokens) from position 0; returns the logits
    /// (`[prompt, vocab]` with `all_logits`, else the last position's) or the hidden states.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<(Vec<f32>, crate::exec::ExecStats)> {
        let inputs = self.prefill_inputs(ids)?;
        let (out, stats) = self.ex.step_program(self.prefill, &inputs)?;
        self.prefilled();
        Ok((first_f32(out), stats))
    }

    /// [`Decoder::prefill`] on an event loop (the browser).
    pub async fn prefill_async(
        &mut self,
        ids: &[u32],
    ) -> Result<(Vec<f32>, crate::exec::ExecStats)> {
        let inputs = self.prefill_inputs(ids)?;
        let (out, stats) = self.ex.step_program_async(self.prefill, &inputs).await?;
        self.prefilled();
        Ok((first_f32(out), stats))
    }

    fn prefill_inputs(&self, ids: &[u32]) -> Result<[crate::graph::HostTensor; 4]> {
        let t = self.shape.prompt;
        if ids.len() != t {
            return Err(Error::Invalid(format!(
                "the graph was built for a prompt of {t} tokens, {} given",
                ids.len()
            )));
        }
        self.check_ids(ids)?;
        let half = self.config.head_dim / 2;
        let (cos, sin) = self.config.rope_at(0, t);
        let inputs = [
            crate::graph::HostTensor::u32(&[t], ids.to_vec())?,
            crate::graph::HostTensor::f32(&[t, half], cos)?,
            crate::graph::HostTensor::f32(&[t, half], sin)?,
            crate::graph::HostTensor::u32(&[1], vec![0])?,
        ];
        Ok(inputs)
    }

    fn prefilled(&mut self) {
        let t = self.shape.prompt;
        self.pos = t;
        self.mask.iter_mut().for_each(|m| *m = 0.0);
        let valid = t.min(self.mask.len());
        self.mask[..valid].iter_mut().for_each(|m| *m = 1.0);
    }

    /// Appends one token at the next position; returns its logits `[vocab]`.
    pub fn decode(&mut self, id: u32) -> Result<(Vec<f32>, crate::exec::ExecStats)> {
        let (p, inputs) = self.decode_inputs(id)?;
        let (out, stats) = self.ex.step_program(p, &inputs)?;
        self.pos += 1;
        Ok((first_f32(out), stats))
    }

    /// [`Decoder::decode`] on an event loop (the browser).
    pub async fn decode_async(&mut self, id: u32) -> Result<(Vec<f32>, crate::exec::ExecStats)> {
        let (p, inputs) = self.decode_inputs(id)?;
        let (out, stats) = self.ex.step_program_async(p, &inputs).await?;
        self.pos += 1;
        Ok((first_f32(out), stats))
    }

    /// The decode program and its inputs for `id` at the next position (marks the position
    /// valid in the attention mask).
    fn decode_inputs(&mut self, id: u32) -> Result<(usize, [crate::graph::HostTensor; 5])> {
        let p = self.decode.ok_or_else(|| {
            Error::Invalid("this graph has no decode program (capacity == prompt)".into())
        })?;
        if self.pos >= self.shape.capacity {
            return Err(Error::Invalid(format!(
                "the KV cache holds {} positions and is full",
                self.shape.capacity
            )));
        }
        self.check_ids(&[id])?;
        let half = self.config.head_dim / 2;
        let (cos, sin) = self.config.rope_at(self.pos, 1);
        self.mask[self.pos] = 1.0;
        let inputs = [
            crate::graph::HostTensor::u32(&[1], vec![id])?,
            crate::graph::HostTensor::f32(&[1, half], cos)?,
            crate::graph::HostTensor::f32(&[1, half], sin)?,
            crate::graph::HostTensor::u32(&[1], vec![self.pos as u32])?,
            crate::graph::HostTensor::f32(&[self.shape.capacity], self.mask.clone())?,
        ];
        Ok((p, inputs))
    }
}

fn first_f32(out: Vec<crate::graph::HostTensor>) -> Vec<f32> {
    out.into_iter()
        .next()
        .map(|t| t.into_f32())
        .unwrap_or_default()
}
