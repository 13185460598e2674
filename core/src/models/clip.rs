//! CLIP's text model (transformers' `CLIPTextModel`, Flux's `text_encoder/`) on the core graph:
//! token + position embeddings, then per layer pre-norm causal multi-head attention and a
//! `quick_gelu` (or GELU) MLP, each with a residual, and the final LayerNorm. The pooled output
//! is the final hidden state at the end-of-text token, as transformers picks it: the first
//! position holding the highest id when `eos_token_id` is the legacy 2, else the first
//! `eos_token_id`. Every layer is one weight group, so the model streams like any other.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::exec::ExecStats;
use crate::format::json::{positive, positive_f32};
use crate::graph::{ElemType, Graph, HostTensor, OpKind, ValueInfo};
use crate::io::model::ModelIndex;
use crate::models::component::{Component, ComponentKind};
use crate::models::nn::{merge_heads, split_heads, Attention};
use crate::models::{require_block, typed_config, W};

/// What the graph needs of `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipConfig {
    /// `hidden_size`.
    pub hidden: usize,
    /// `intermediate_size`.
    pub intermediate: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `vocab_size`.
    pub vocab: usize,
    /// `max_position_embeddings`.
    pub max_positions: usize,
    /// `layer_norm_eps`.
    pub eps: f32,
    /// `hidden_act` is `quick_gelu` (else `gelu`).
    pub quick_gelu: bool,
    /// `eos_token_id` (2: the legacy rule, the highest id's position).
    pub eos_token_id: u32,
}

#[derive(Deserialize)]
struct File {
    hidden_size: u64,
    intermediate_size: u64,
    num_hidden_layers: u64,
    num_attention_heads: u64,
    vocab_size: u64,
    max_position_embeddings: Option<u64>,
    layer_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    eos_token_id: Option<u32>,
}

impl ClipConfig {
    /// From the model's `config.json` (transformers' defaults where a field is absent).
    pub fn of(model: &ModelIndex) -> Result<Self> {
        let (file, f): (String, File) = typed_config(model, "CLIP's text model")?;
        let c = ClipConfig {
            hidden: positive(&file, "hidden_size", f.hidden_size)?,
            intermediate: positive(&file, "intermediate_size", f.intermediate_size)?,
            layers: positive(&file, "num_hidden_layers", f.num_hidden_layers)?,
            heads: positive(&file, "num_attention_heads", f.num_attention_heads)?,
            vocab: positive(&file, "vocab_size", f.vocab_size)?,
            max_positions: positive(
                &file,
                "max_position_embeddings",
                f.max_position_embeddings.unwrap_or(77),
            )?,
            eps: positive_f32(&file, "layer_norm_eps", f.layer_norm_eps.unwrap_or(1e-5))?,
            quick_gelu: match f.hidden_act.as_deref() {
                Some("quick_gelu") | None => true,
                Some("gelu") => false,
                Some(other) => {
                    return Err(Error::Model {
                        file,
                        msg: format!("hidden_act '{other}' is not supported (quick_gelu, gelu)"),
                    })
                }
            },
            eos_token_id: f.eos_token_id.unwrap_or(2),
        };
        if !c.hidden.is_multiple_of(c.heads) {
            return Err(Error::Model {
                file,
                msg: format!(
                    "num_attention_heads {} does not divide hidden_size {}",
                    c.heads, c.hidden
                ),
            });
        }
        Ok(c)
    }
}

/// The text model's graph for `seq_len` tokens: inputs `ids [T]` and `positions [T]` (u32),
/// output the final hidden state `[T, hidden]`.
pub fn build(model: &ModelIndex, seq_len: usize) -> Result<(Graph, ClipConfig)> {
    let cfg = ClipConfig::of(model)?;
    if seq_len == 0 || seq_len > cfg.max_positions {
        return Err(Error::Invalid(format!(
            "CLIP graph: {seq_len} tokens (the model has 1 to {} positions)",
            cfg.max_positions
        )));
    }
    let (h, t, nh) = (cfg.hidden, seq_len, cfg.heads);
    let hd = h / nh;
    let mut g = Graph::new();
    let emb = g.group("text_model.embeddings");
    let tokens = g.dense_weight(
        emb,
        "text_model.embeddings.token_embedding.weight",
        &[cfg.vocab, h],
    );
    let positions = g.dense_weight(
        emb,
        "text_model.embeddings.position_embedding.weight",
        &[cfg.max_positions, h],
    );
    let u32v = ValueInfo {
        shape: vec![t],
        elem: ElemType::U32,
    };
    let ids = g.input(u32v.clone());
    let pos = g.input(u32v);
    let x = g.op(OpKind::Embedding, &[ids, tokens], None)?;
    let xp = g.op(OpKind::Embedding, &[pos, positions], None)?;
    let mut x = g.op(OpKind::Add, &[x, xp], None)?;
    let ln = OpKind::LayerNorm {
        eps: cfg.eps,
        affine: true,
    };
    for l in 0..cfg.layers {
        let lp = format!("text_model.encoder.layers.{l}");
        require_block(model, &lp, "num_hidden_layers", cfg.layers)?;
        let grp = g.group(&lp);
        let mut w = |name: &str, out: usize, inp: usize| {
            W::load(&mut g, model, grp, &format!("{lp}.{name}"), out, inp)
        };
        let q = w("self_attn.q_proj.weight", h, h)?;
        let k = w("self_attn.k_proj.weight", h, h)?;
        let v = w("self_attn.v_proj.weight", h, h)?;
        let o = w("self_attn.out_proj.weight", h, h)?;
        let fc1 = w("mlp.fc1.weight", cfg.intermediate, h)?;
        let fc2 = w("mlp.fc2.weight", h, cfg.intermediate)?;
        let mut norm = |name: &str| {
            (
                g.dense_weight(grp, &format!("{lp}.{name}.weight"), &[h]),
                g.dense_weight(grp, &format!("{lp}.{name}.bias"), &[h]),
            )
        };
        let (n1w, n1b) = norm("layer_norm1");
        let (n2w, n2b) = norm("layer_norm2");
        let y = g.op(ln.clone(), &[x, n1w, n1b], None)?;
        let mut heads = |w: W| -> Result<_> {
            let z = w.apply(&mut g, y)?;
            split_heads(&mut g, z, t, nh, hd)
        };
        let (q, k, v) = (heads(q)?, heads(k)?, heads(v)?);
        let a = Attention::scaled(hd).causal().apply(&mut g, q, k, v)?;
        let a = merge_heads(&mut g, a, t, h)?;
        let a = o.apply(&mut g, a)?;
        x = g.op(OpKind::Add, &[x, a], None)?;
        let y = g.op(ln.clone(), &[x, n2w, n2b], None)?;
        let m = fc1.apply(&mut g, y)?;
        let act = if cfg.quick_gelu {
            OpKind::QuickGelu
        } else {
            OpKind::Gelu
        };
        let m = g.op(act, &[m], None)?;
        let m = fc2.apply(&mut g, m)?;
        x = g.op(OpKind::Add, &[x, m], None)?;
    }
    let fin = g.group("text_model.final_layer_norm");
    let fw = g.dense_weight(fin, "text_model.final_layer_norm.weight", &[h]);
    let fb = g.dense_weight(fin, "text_model.final_layer_norm.bias", &[h]);
    let x = g.op(ln, &[x, fw, fb], None)?;
    g.output(x);
    Ok((g, cfg))
}

/// CLIP's text model as a pipeline component: built for a token count.
#[derive(Debug)]
pub enum Clip {}

impl ComponentKind for Clip {
    type Shape = usize;
    type Config = ClipConfig;
    const NAME: &'static str = "ClipText";
    fn build(model: &ModelIndex, seq_len: usize) -> Result<(Graph, ClipConfig)> {
        build(model, seq_len)
    }
}

/// A CLIP text model ready to run on a backend.
pub type ClipText<B> = Component<Clip, B>;

impl<B: crate::backend::Backend> Component<Clip, B> {
    /// The final hidden state `[seq_len, hidden]` of `ids` (exactly `seq_len` of them, padded
    /// as the tokenizer pads) and the pooled output `[hidden]`.
    #[cfg(feature = "native")]
    pub fn forward(&mut self, ids: &[u32]) -> Result<(Vec<f32>, Vec<f32>, ExecStats)> {
        crate::io::folder::block_on(self.forward_async(ids))
    }

    /// [`ClipText::forward`], awaiting the results where the runner was opened on an event
    /// loop.
    pub async fn forward_async(&mut self, ids: &[u32]) -> Result<(Vec<f32>, Vec<f32>, ExecStats)> {
        let t = self.shape;
        if ids.len() != t {
            return Err(Error::Invalid(format!(
                "{} token ids for a CLIP graph built for {t}",
                ids.len()
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.config.vocab) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab
            )));
        }
        let inputs = [
            HostTensor::u32(&[t], ids.to_vec())?,
            HostTensor::u32(&[t], (0..t as u32).collect())?,
        ];
        let (states, stats) = self.pass(&inputs, "CLIP's hidden states").await?;
        let at = self.pooled_position(ids);
        let h = self.config.hidden;
        let pooled = states[at * h..(at + 1) * h].to_vec();
        Ok((states, pooled, stats))
    }

    /// Where transformers takes the pooled output.
    fn pooled_position(&self, ids: &[u32]) -> usize {
        let first_max = |v: &[u32]| {
            v.iter()
                .enumerate()
                .fold(
                    (0usize, 0u32),
                    |(bi, bv), (i, &x)| if x > bv { (i, x) } else { (bi, bv) },
                )
                .0
        };
        if self.config.eos_token_id == 2 {
            first_max(ids)
        } else {
            ids.iter()
                .position(|&i| i == self.config.eos_token_id)
                .unwrap_or(0)
        }
    }
}
