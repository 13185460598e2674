//! Llama-family decoders (Llama, Mistral, Qwen2, SmolLM) as a [`Graph`]: embedding, per layer
//! RMSNorm, q/k/v projections, rotate-half RoPE, grouped-query causal attention, o projection,
//! residual, RMSNorm, SwiGLU MLP, residual; final RMSNorm and lm_head. Every layer is one weight
//! group, so the executor streams the model a layer at a time.
//!
//! This first form recomputes the whole sequence each step (no KV cache yet).

use crate::bnb::{find_4bit_weights, QuantState};
use crate::error::{Error, Result};
use crate::executor::{Graph, ValueId};
use crate::graph::{OpKind, Q4Info, RopeMode, ValueInfo};
use crate::index::ModelIndex;

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
    /// Whether lm_head reuses the embedding table.
    pub tied: bool,
}

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
        let rope_theta = c
            .get("rope_theta")
            .or_else(|| c.get("rope_parameters").and_then(|r| r.get("rope_theta")))
            .and_then(|v| v.as_f64())
            .unwrap_or(10000.0) as f32;
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
            tied: c
                .get("tie_word_embeddings")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
        })
    }

    /// cos and sin tables `[T, head_dim / 2]` for positions `0..t`, computed in f32 as
    /// transformers does (`inv_freq = 1 / theta^(2i / d)`, `freqs = pos * inv_freq`).
    pub fn rope_tables(&self, t: usize) -> (Vec<f32>, Vec<f32>) {
        let half = self.head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f32 / self.head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(t * half);
        let mut sin = Vec::with_capacity(t * half);
        for p in 0..t {
            for f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        (cos, sin)
    }
}

/// The graph's inputs in order: token ids `[T]`, cos `[T, head_dim/2]`, sin `[T, head_dim/2]`;
/// its output: logits `[T, vocab]`.
#[derive(Debug)]
pub struct LlamaGraph {
    /// The graph.
    pub graph: Graph,
    /// The configuration it was built from.
    pub config: LlamaConfig,
}

/// Builds the decoder for a sequence of `t` tokens against `model`'s weights.
pub fn build(model: &ModelIndex, t: usize) -> Result<LlamaGraph> {
    let cfg = LlamaConfig::from_json(model.config.as_ref().ok_or_else(|| Error::Model {
        file: model.root.clone(),
        msg: "no config.json".into(),
    })?)?;
    let keys = find_4bit_weights(model)?;
    let mut g = Graph::new();
    let (h, hd, nh, nkv) = (cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads);
    let ids = g.input(ValueInfo {
        shape: vec![t],
        elem: crate::graph::ElemType::U32,
    });
    let cos = g.input(ValueInfo::f32(&[t, hd / 2]));
    let sin = g.input(ValueInfo::f32(&[t, hd / 2]));
    let embed_group = g.group("model.embed_tokens");
    let table = g.dense_weight(embed_group, "model.embed_tokens.weight", &[cfg.vocab, h]);
    let mut x = g.op(OpKind::Embedding, &[ids, table], None)?;
    // A projection: 4-bit when the checkpoint quantized it, dense otherwise.
    let proj = |g: &mut Graph,
                grp: usize,
                input: ValueId,
                name: &str,
                out: usize,
                inp: usize|
     -> Result<ValueId> {
        if let Some(k) = keys.iter().find(|k| k.base == name) {
            let s = QuantState::load(model, k)?;
            let info = Q4Info {
                shape: vec![out, inp],
                blocksize: s.json.blocksize as usize,
            };
            let w = g.q4_weight(grp, name, info);
            g.op(OpKind::LinearQ4 { bias: false }, &[input], Some(w))
        } else {
            let w = g.dense_weight(grp, name, &[out, inp]);
            g.op(OpKind::Linear { bias: false }, &[input, w], None)
        }
    };
    for l in 0..cfg.layers {
        let p = format!("model.layers.{l}");
        let grp = g.group(&p);
        let n1 = g.dense_weight(grp, &format!("{p}.input_layernorm.weight"), &[h]);
        let hn = g.op(OpKind::RmsNorm { eps: cfg.rms_eps }, &[x, n1], None)?;
        let q = proj(
            &mut g,
            grp,
            hn,
            &format!("{p}.self_attn.q_proj.weight"),
            nh * hd,
            h,
        )?;
        let k = proj(
            &mut g,
            grp,
            hn,
            &format!("{p}.self_attn.k_proj.weight"),
            nkv * hd,
            h,
        )?;
        let v = proj(
            &mut g,
            grp,
            hn,
            &format!("{p}.self_attn.v_proj.weight"),
            nkv * hd,
            h,
        )?;
        let q = g.op(
            OpKind::Reshape {
                shape: vec![t, nh, hd],
            },
            &[q],
            None,
        )?;
        let k = g.op(
            OpKind::Reshape {
                shape: vec![t, nkv, hd],
            },
            &[k],
            None,
        )?;
        let v = g.op(
            OpKind::Reshape {
                shape: vec![t, nkv, hd],
            },
            &[v],
            None,
        )?;
        let q = g.op(
            OpKind::Rope {
                mode: RopeMode::RotateHalf,
            },
            &[q, cos, sin],
            None,
        )?;
        let k = g.op(
            OpKind::Rope {
                mode: RopeMode::RotateHalf,
            },
            &[k, cos, sin],
            None,
        )?;
        let q = g.op(
            OpKind::Permute {
                perm: vec![1, 0, 2],
            },
            &[q],
            None,
        )?;
        let k = g.op(
            OpKind::Permute {
                perm: vec![1, 0, 2],
            },
            &[k],
            None,
        )?;
        let v = g.op(
            OpKind::Permute {
                perm: vec![1, 0, 2],
            },
            &[v],
            None,
        )?;
        let scale = 1.0 / (hd as f32).sqrt();
        let a = g.op(
            OpKind::Attention {
                causal: true,
                scale,
                key_mask: false,
            },
            &[q, k, v],
            None,
        )?;
        let a = g.op(
            OpKind::Permute {
                perm: vec![1, 0, 2],
            },
            &[a],
            None,
        )?;
        let a = g.op(
            OpKind::Reshape {
                shape: vec![t, nh * hd],
            },
            &[a],
            None,
        )?;
        let o = proj(
            &mut g,
            grp,
            a,
            &format!("{p}.self_attn.o_proj.weight"),
            h,
            nh * hd,
        )?;
        x = g.op(OpKind::Add, &[x, o], None)?;
        let n2 = g.dense_weight(grp, &format!("{p}.post_attention_layernorm.weight"), &[h]);
        let hn = g.op(OpKind::RmsNorm { eps: cfg.rms_eps }, &[x, n2], None)?;
        let gate = proj(
            &mut g,
            grp,
            hn,
            &format!("{p}.mlp.gate_proj.weight"),
            cfg.intermediate,
            h,
        )?;
        let up = proj(
            &mut g,
            grp,
            hn,
            &format!("{p}.mlp.up_proj.weight"),
            cfg.intermediate,
            h,
        )?;
        let gate = g.op(OpKind::Silu, &[gate], None)?;
        let m = g.op(OpKind::Mul, &[gate, up], None)?;
        let down = proj(
            &mut g,
            grp,
            m,
            &format!("{p}.mlp.down_proj.weight"),
            h,
            cfg.intermediate,
        )?;
        x = g.op(OpKind::Add, &[x, down], None)?;
    }
    let head_group = g.group("lm_head");
    let nf = g.dense_weight(head_group, "model.norm.weight", &[h]);
    let xn = g.op(OpKind::RmsNorm { eps: cfg.rms_eps }, &[x, nf], None)?;
    let head_name = if cfg.tied || model.get("lm_head.weight").is_none() {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    let logits = if head_name == "model.embed_tokens.weight" {
        // Tied: the table is a weight of this last group too, so that a streamed embedding group
        // need not stay on the device from the first op to the last.
        let tied = g.dense_weight(head_group, head_name, &[cfg.vocab, h]);
        g.op(OpKind::Linear { bias: false }, &[xn, tied], None)?
    } else {
        proj(&mut g, head_group, xn, head_name, cfg.vocab, h)?
    };
    g.output(logits);
    Ok(LlamaGraph {
        graph: g,
        config: cfg,
    })
}
