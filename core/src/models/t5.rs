//! T5's encoder (transformers' `T5EncoderModel`, Flux's `text_encoder_2/`, 4-bit or dense) on the
//! core graph: the shared token embedding, then per block a pre-norm (RMS-style T5 LayerNorm)
//! self-attention without score scaling, whose scores get the bucketed relative position bias
//! of the first block (bidirectional buckets: half for each direction, exact below
//! `num_buckets / 4`, logarithmic up to `max_distance`), and a pre-norm gated-GELU feed-forward
//! (`gelu_new(wi_0 x) * wi_1 x`, then `wo`), each with a residual; the final norm. No attention
//! mask: `FluxPipeline` encodes the padded ids without one, so padding is attended to as it is
//! there. The bias is an embedding lookup of bucket ids computed on the host.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::exec::ExecStats;
use crate::format::json::{positive, positive_f32};
use crate::graph::{ElemType, Graph, HostTensor, OpKind, ValueInfo};
use crate::io::model::ModelIndex;
use crate::models::component::{Component, ComponentKind};
use crate::models::nn::{merge_heads, split_heads, Attention};
use crate::models::{require_block, reshape, typed_config, W};

/// What the graph needs of `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct T5Config {
    /// `d_model`.
    pub d_model: usize,
    /// `d_kv` (width of one head).
    pub d_kv: usize,
    /// `d_ff`.
    pub d_ff: usize,
    /// `num_layers`.
    pub layers: usize,
    /// `num_heads`.
    pub heads: usize,
    /// `vocab_size`.
    pub vocab: usize,
    /// `relative_attention_num_buckets`.
    pub buckets: usize,
    /// `relative_attention_max_distance`.
    pub max_distance: usize,
    /// `layer_norm_epsilon`.
    pub eps: f32,
    /// umT5 (`model_type` umt5): every layer has its own relative position bias, where T5's
    /// first layer's serves them all.
    pub per_layer_bias: bool,
}

#[derive(Deserialize)]
struct File {
    d_model: u64,
    d_kv: u64,
    d_ff: u64,
    num_layers: u64,
    num_heads: u64,
    vocab_size: u64,
    relative_attention_num_buckets: Option<u64>,
    relative_attention_max_distance: Option<u64>,
    layer_norm_epsilon: Option<f64>,
    feed_forward_proj: Option<String>,
    is_decoder: Option<bool>,
    model_type: Option<String>,
}

impl T5Config {
    /// From the model's `config.json`. Only the gated-GELU feed-forward (T5 v1.1, as Flux
    /// uses) of an encoder is computed; anything else is refused naming the field.
    pub fn of(model: &ModelIndex) -> Result<Self> {
        let (file, f): (String, File) = typed_config(model, "T5's encoder")?;
        let bad = |msg: String| Error::Model {
            file: file.clone(),
            msg,
        };
        match f.feed_forward_proj.as_deref() {
            Some("gated-gelu") => {}
            other => {
                return Err(bad(format!(
                    "feed_forward_proj {other:?} is not supported (gated-gelu)"
                )))
            }
        }
        if f.is_decoder == Some(true) {
            return Err(bad("is_decoder: only T5's encoder is computed".into()));
        }
        let c = T5Config {
            d_model: positive(&file, "d_model", f.d_model)?,
            d_kv: positive(&file, "d_kv", f.d_kv)?,
            d_ff: positive(&file, "d_ff", f.d_ff)?,
            layers: positive(&file, "num_layers", f.num_layers)?,
            heads: positive(&file, "num_heads", f.num_heads)?,
            vocab: positive(&file, "vocab_size", f.vocab_size)?,
            buckets: positive(
                &file,
                "relative_attention_num_buckets",
                f.relative_attention_num_buckets.unwrap_or(32),
            )?,
            max_distance: positive(
                &file,
                "relative_attention_max_distance",
                f.relative_attention_max_distance.unwrap_or(128),
            )?,
            eps: positive_f32(
                &file,
                "layer_norm_epsilon",
                f.layer_norm_epsilon.unwrap_or(1e-6),
            )?,
            per_layer_bias: f.model_type.as_deref() == Some("umt5"),
        };
        // Each direction's buckets: half exact (at least one), half logarithmic up to
        // max_distance.
        if c.buckets < 4 || c.max_distance <= c.buckets / 4 {
            return Err(bad(format!(
                "relative_attention_num_buckets {} and relative_attention_max_distance {}: \
                 need at least 4 buckets and a distance above a quarter of them",
                c.buckets, c.max_distance
            )));
        }
        Ok(c)
    }
}

/// transformers' `T5Attention._relative_position_bucket` (bidirectional) of `key - query`.
pub fn relative_bucket(relative: i64, buckets: usize, max_distance: usize) -> u32 {
    let half = (buckets / 2) as i64;
    let mut bucket = if relative > 0 { half } else { 0 };
    let n = relative.abs();
    let max_exact = half / 2;
    if n < max_exact {
        bucket += n;
    } else {
        // As torch computes it: log(n / max_exact) in float32, divided by the Python double
        // log(max_distance / max_exact) (taken as float32), times (half - max_exact),
        // truncated, capped at half - 1.
        let denom = (max_distance as f64 / max_exact as f64).ln() as f32;
        let r = (n as f32 / max_exact as f32).ln() / denom * (half - max_exact) as f32;
        let large = (max_exact + r as i64).min(half - 1);
        bucket += large;
    }
    bucket as u32
}

/// The bucket of every (query, key) pair of `t` tokens, row-major `[t, t]`.
pub fn bucket_ids(t: usize, buckets: usize, max_distance: usize) -> Vec<u32> {
    let mut ids = Vec::with_capacity(t * t);
    for i in 0..t {
        for j in 0..t {
            ids.push(relative_bucket(j as i64 - i as i64, buckets, max_distance));
        }
    }
    ids
}

/// The encoder's graph for `seq_len` tokens: inputs `ids [T]` and `buckets [T*T]` (u32, see
/// [`bucket_ids`]), output the final hidden state `[T, d_model]`; no attention mask (as Flux
/// calls T5).
pub fn build(model: &ModelIndex, seq_len: usize) -> Result<(Graph, T5Config)> {
    build_with(model, seq_len, false)
}

/// [`build`], with `masked` a third input `mask [T]` (f32: 0 for a token, `f32::MIN` for
/// padding) added to every layer's position bias, as transformers adds the attention mask
/// (`(1 − mask) · finfo.min`): padded keys get no weight (Wan calls umT5 so).
pub fn build_with(model: &ModelIndex, seq_len: usize, masked: bool) -> Result<(Graph, T5Config)> {
    let cfg = T5Config::of(model)?;
    if seq_len == 0 || seq_len > 1 << 16 {
        return Err(Error::Invalid(format!("T5 graph: {seq_len} tokens")));
    }
    let (d, t, nh, hd) = (cfg.d_model, seq_len, cfg.heads, cfg.d_kv);
    let inner = nh * hd;
    let table = ["shared.weight", "encoder.embed_tokens.weight"]
        .into_iter()
        .find(|n| model.get(n).is_some())
        .ok_or_else(|| Error::Model {
            file: model.root.clone(),
            msg: "no shared.weight: not a T5 checkpoint".into(),
        })?;
    let mut g = Graph::new();
    let emb = g.group("shared");
    let table = g.dense_weight(emb, table, &[cfg.vocab, d]);
    let ids = g.input(ValueInfo {
        shape: vec![t],
        elem: ElemType::U32,
    });
    let bucket_in = g.input(ValueInfo {
        shape: vec![t * t],
        elem: ElemType::U32,
    });
    let mask = masked.then(|| g.input(ValueInfo::f32(&[t])));
    let mut x = g.op(OpKind::Embedding, &[ids, table], None)?;
    let rms = OpKind::RmsNorm { eps: cfg.eps };
    let mut bias = None;
    for l in 0..cfg.layers {
        let lp = format!("encoder.block.{l}");
        require_block(model, &lp, "num_layers", cfg.layers)?;
        let grp = g.group(&lp);
        let mut w = |name: &str, out: usize, inp: usize| {
            W::load(&mut g, model, grp, &format!("{lp}.{name}"), out, inp)
        };
        let q = w("layer.0.SelfAttention.q.weight", inner, d)?;
        let k = w("layer.0.SelfAttention.k.weight", inner, d)?;
        let v = w("layer.0.SelfAttention.v.weight", inner, d)?;
        let o = w("layer.0.SelfAttention.o.weight", d, inner)?;
        let wi0 = w("layer.1.DenseReluDense.wi_0.weight", cfg.d_ff, d)?;
        let wi1 = w("layer.1.DenseReluDense.wi_1.weight", cfg.d_ff, d)?;
        let wo = w("layer.1.DenseReluDense.wo.weight", d, cfg.d_ff)?;
        let n0 = g.dense_weight(grp, &format!("{lp}.layer.0.layer_norm.weight"), &[d]);
        let n1 = g.dense_weight(grp, &format!("{lp}.layer.1.layer_norm.weight"), &[d]);
        if bias.is_none() || cfg.per_layer_bias {
            // T5: the first block owns the relative position bias and later blocks reuse its
            // value; umT5: every block has its own.
            let name = format!("{lp}.layer.0.SelfAttention.relative_attention_bias.weight");
            let rel = g.dense_weight(grp, &name, &[cfg.buckets, nh]);
            let b = g.op(OpKind::Embedding, &[bucket_in, rel], None)?; // [t*t, nh]
            let b = reshape(&mut g, b, &[t, t, nh])?;
            let b = g.op(
                OpKind::Permute {
                    perm: vec![2, 0, 1],
                },
                &[b],
                None,
            )?; // [nh, t, t]
            let b = match mask {
                Some(m) => g.op(OpKind::Add, &[b, m], None)?,
                None => b,
            };
            bias = Some(b);
        }
        let bias = bias.ok_or_else(|| Error::Invalid("no position bias".into()))?;
        let y = g.op(rms.clone(), &[x, n0], None)?;
        let mut heads = |w: W| -> Result<_> {
            let z = w.apply(&mut g, y)?;
            split_heads(&mut g, z, t, nh, hd)
        };
        let (q, k, v) = (heads(q)?, heads(k)?, heads(v)?);
        // scores = q kᵀ + bias (T5 does not scale), softmax, times v.
        let a = Attention {
            bias: Some(bias),
            ..Attention::with_scale(1.0)
        }
        .apply(&mut g, q, k, v)?;
        let a = merge_heads(&mut g, a, t, inner)?;
        let a = o.apply(&mut g, a)?;
        x = g.op(OpKind::Add, &[x, a], None)?;
        let y = g.op(rms.clone(), &[x, n1], None)?;
        let gate = wi0.apply(&mut g, y)?;
        let gate = g.op(OpKind::GeluTanh, &[gate], None)?;
        let lin = wi1.apply(&mut g, y)?;
        let m = g.op(OpKind::Mul, &[gate, lin], None)?;
        let m = wo.apply(&mut g, m)?;
        x = g.op(OpKind::Add, &[x, m], None)?;
    }
    let fin = g.group("encoder.final_layer_norm");
    let fw = g.dense_weight(fin, "encoder.final_layer_norm.weight", &[d]);
    let x = g.op(rms, &[x, fw], None)?;
    g.output(x);
    Ok((g, cfg))
}

/// T5's encoder as a pipeline component: built for a token count.
#[derive(Debug)]
pub enum T5 {}

impl ComponentKind for T5 {
    type Shape = usize;
    type Config = T5Config;
    const NAME: &'static str = "T5Encoder";
    fn build(model: &ModelIndex, seq_len: usize) -> Result<(Graph, T5Config)> {
        build(model, seq_len)
    }
}

/// A T5 encoder ready to run on a backend.
pub type T5Encoder<B> = Component<T5, B>;

impl<B: crate::backend::Backend> Component<T5, B> {
    /// The final hidden state `[seq_len, d_model]` of `ids` (exactly `seq_len`, padded).
    #[cfg(feature = "native")]
    pub fn forward(&mut self, ids: &[u32]) -> Result<(Vec<f32>, ExecStats)> {
        crate::io::folder::block_on(self.forward_async(ids))
    }

    /// [`T5Encoder::forward`], awaiting the results where the runner was opened on an event
    /// loop.
    pub async fn forward_async(&mut self, ids: &[u32]) -> Result<(Vec<f32>, ExecStats)> {
        let t = self.shape;
        check_ids(ids, t, self.config.vocab)?;
        let inputs = [
            HostTensor::u32(&[t], ids.to_vec())?,
            HostTensor::u32(
                &[t * t],
                bucket_ids(t, self.config.buckets, self.config.max_distance),
            )?,
        ];
        let (states, stats) = self.pass(&inputs, "T5's hidden states").await?;
        Ok((states, stats))
    }
}

/// umT5's encoder (Wan's text encoder) as a pipeline component: built for a token count, with
/// the attention mask.
#[derive(Debug)]
pub enum UmT5 {}

impl ComponentKind for UmT5 {
    type Shape = usize;
    type Config = T5Config;
    const NAME: &'static str = "UmT5Encoder";
    fn build(model: &ModelIndex, seq_len: usize) -> Result<(Graph, T5Config)> {
        build_with(model, seq_len, true)
    }
}

/// A umT5 encoder ready to run on a backend.
pub type UmT5Encoder<B> = Component<UmT5, B>;

impl<B: crate::backend::Backend> Component<UmT5, B> {
    /// The final hidden state `[seq_len, d_model]` of `ids` (exactly `seq_len`: the prompt's
    /// `len` tokens, then padding, which no token attends to).
    #[cfg(feature = "native")]
    pub fn forward(&mut self, ids: &[u32], len: usize) -> Result<(Vec<f32>, ExecStats)> {
        crate::io::folder::block_on(self.forward_async(ids, len))
    }

    /// [`UmT5Encoder::forward`], awaiting the results where the runner was opened on an event
    /// loop.
    pub async fn forward_async(
        &mut self,
        ids: &[u32],
        len: usize,
    ) -> Result<(Vec<f32>, ExecStats)> {
        let t = self.shape;
        check_ids(ids, t, self.config.vocab)?;
        if len == 0 || len > t {
            return Err(Error::Invalid(format!(
                "a prompt of {len} tokens in a umT5 graph built for {t}"
            )));
        }
        let mask: Vec<f32> = (0..t)
            .map(|i| if i < len { 0.0 } else { f32::MIN })
            .collect();
        let inputs = [
            HostTensor::u32(&[t], ids.to_vec())?,
            HostTensor::u32(
                &[t * t],
                bucket_ids(t, self.config.buckets, self.config.max_distance),
            )?,
            HostTensor::f32(&[t], mask)?,
        ];
        self.pass(&inputs, "umT5's hidden states").await
    }
}

/// `ids` are `t` ids inside a vocabulary of `vocab`.
fn check_ids(ids: &[u32], t: usize, vocab: usize) -> Result<()> {
    if ids.len() != t {
        return Err(Error::Invalid(format!(
            "{} token ids for a T5 graph built for {t}",
            ids.len()
        )));
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(Error::Invalid(format!(
            "token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    Ok(())
}

/// What a Wan pipeline gives its transformer: the encoder's states `[t, d]` cut to the prompt's
/// `len` tokens and zero-filled back to `t` rows.
pub fn prompt_embeds(mut states: Vec<f32>, len: usize, d: usize) -> Vec<f32> {
    let keep = (len * d).min(states.len());
    states[keep..].iter_mut().for_each(|v| *v = 0.0);
    states
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_transformers() {
        // num_buckets 32, max_distance 128: 0 -> 0; -1 -> 1; +1 -> 17; -7 -> 7; -8 -> 8 (log
        // part starts at max_exact 8); far keys cap at 15 / 31.
        assert_eq!(relative_bucket(0, 32, 128), 0);
        assert_eq!(relative_bucket(-1, 32, 128), 1);
        assert_eq!(relative_bucket(1, 32, 128), 17);
        assert_eq!(relative_bucket(-7, 32, 128), 7);
        assert_eq!(relative_bucket(-8, 32, 128), 8);
        assert_eq!(relative_bucket(-1000, 32, 128), 15);
        assert_eq!(relative_bucket(1000, 32, 128), 31);
        // log(16/8)/log(16) * 8 = 2: 8 + 2 = 10.
        assert_eq!(relative_bucket(-16, 32, 128), 10);
    }
}
