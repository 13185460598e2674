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
use crate::models::llama::LlamaConfig;
use crate::models::nn::Attention;
use crate::models::{require_block, reshape, swap01, W};

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
pub(super) struct Layer {
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

/// The decoder's weights, declared in `g` (one group per layer, the embedding and the head).
pub(super) struct Weights {
    pub(super) table: ValueId,
    pub(super) layers: Vec<Layer>,
    pub(super) norm_f: ValueId,
    pub(super) head: W,
    pub(super) tied: bool,
}

pub(super) fn weights(g: &mut Graph, model: &ModelIndex, cfg: &LlamaConfig) -> Result<Weights> {
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
    let mut layers = Vec::new();
    for l in 0..cfg.layers {
        let p = format!("model.layers.{l}");
        require_block(model, &p, "num_hidden_layers", cfg.layers)?;
        let grp = g.group(&p);
        let a = format!("{p}.self_attn");
        let m = format!("{p}.mlp");
        layers.push(Layer {
            n1: g.dense_weight(grp, &format!("{p}.input_layernorm.weight"), &[h]),
            q: weight(g, grp, &format!("{a}.q_proj.weight"), nh * hd, h)?,
            k: weight(g, grp, &format!("{a}.k_proj.weight"), nkv * hd, h)?,
            v: weight(g, grp, &format!("{a}.v_proj.weight"), nkv * hd, h)?,
            o: weight(g, grp, &format!("{a}.o_proj.weight"), h, nh * hd)?,
            n2: g.dense_weight(grp, &format!("{p}.post_attention_layernorm.weight"), &[h]),
            gate: weight(
                g,
                grp,
                &format!("{m}.gate_proj.weight"),
                cfg.intermediate,
                h,
            )?,
            up: weight(g, grp, &format!("{m}.up_proj.weight"), cfg.intermediate, h)?,
            down: weight(
                g,
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
        W::dense(g.dense_weight(head_group, "model.embed_tokens.weight", &[cfg.vocab, h]))
    } else {
        weight(g, head_group, "lm_head.weight", cfg.vocab, h)?
    };
    Ok(Weights {
        table,
        layers,
        norm_f,
        head,
        tied,
    })
}

/// The attention inputs of layer `lw` for `x [t, hidden]`: q `[t, heads, head_dim]`, k and v
/// `[t, kv_heads, head_dim]`, q and k rotated by `cos`/`sin` `[t, head_dim/2]`.
pub(super) fn qkv(
    g: &mut Graph,
    cfg: &LlamaConfig,
    lw: &Layer,
    x: ValueId,
    t: usize,
    cos: ValueId,
    sin: ValueId,
) -> Result<(ValueId, ValueId, ValueId)> {
    let (hd, nh, nkv) = (cfg.head_dim, cfg.heads, cfg.kv_heads);
    let hn = g.op(OpKind::RmsNorm { eps: cfg.rms_eps }, &[x, lw.n1], None)?;
    let q = lw.q.apply(g, hn)?;
    let k = lw.k.apply(g, hn)?;
    let v = lw.v.apply(g, hn)?;
    let q = reshape(g, q, &[t, nh, hd])?;
    let k = reshape(g, k, &[t, nkv, hd])?;
    let v = reshape(g, v, &[t, nkv, hd])?;
    let rope = OpKind::Rope {
        mode: RopeMode::RotateHalf,
    };
    let q = g.op(rope.clone(), &[q, cos, sin], None)?;
    let k = g.op(rope, &[k, cos, sin], None)?;
    Ok((q, k, v))
}

/// The rest of layer `lw` after attention (`a [t, heads * head_dim]`): o projection, residual,
/// RMSNorm, SwiGLU MLP, residual.
pub(super) fn finish_layer(
    g: &mut Graph,
    cfg: &LlamaConfig,
    lw: &Layer,
    x: ValueId,
    a: ValueId,
) -> Result<ValueId> {
    let o = lw.o.apply(g, a)?;
    let x = g.op(OpKind::Add, &[x, o], None)?;
    let hn = g.op(OpKind::RmsNorm { eps: cfg.rms_eps }, &[x, lw.n2], None)?;
    let gate = lw.gate.apply(g, hn)?;
    let up = lw.up.apply(g, hn)?;
    let gate = g.op(OpKind::Silu, &[gate], None)?;
    let m = g.op(OpKind::Mul, &[gate, up], None)?;
    let down = lw.down.apply(g, m)?;
    g.op(OpKind::Add, &[x, down], None)
}

/// Builds the decoder against `model`'s weights.
pub fn build(model: &ModelIndex, shape: LlamaShape) -> Result<LlamaGraph> {
    let cfg = LlamaConfig::of(model)?;
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
    let (hd, nh, nkv) = (cfg.head_dim, cfg.heads, cfg.kv_heads);
    let Weights {
        table,
        layers,
        norm_f,
        head,
        tied,
    } = weights(&mut g, model, &cfg)?;
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
            let (q, k, v) = qkv(&mut g, &cfg, lw, x, t, cos, sin)?;
            let q = swap01(&mut g, q)?;
            let k = swap01(&mut g, k)?;
            let v = swap01(&mut g, v)?;
            let scale = 1.0 / (hd as f32).sqrt();
            let a = if let Some(mask) = mask {
                let (kc, vc) = caches[l];
                let kc = g.op(OpKind::CacheWrite, &[kc, k, pos], None)?;
                let vc = g.op(OpKind::CacheWrite, &[vc, v, pos], None)?;
                Attention::with_scale(scale)
                    .masked(mask)
                    .apply(&mut g, q, kc, vc)?
            } else {
                if with_cache {
                    let (kc, vc) = caches[l];
                    g.op(OpKind::CacheWrite, &[kc, k, pos], None)?;
                    g.op(OpKind::CacheWrite, &[vc, v, pos], None)?;
                }
                Attention::with_scale(scale)
                    .causal()
                    .apply(&mut g, q, k, v)?
            };
            let a = swap01(&mut g, a)?;
            let a = reshape(&mut g, a, &[t, nh * hd])?;
            x = finish_layer(&mut g, &cfg, lw, x, a)?;
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
pub(super) fn refuse_unread_tensors(model: &ModelIndex, g: &Graph, tied: bool) -> Result<()> {
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
