//! BERT encoders (transformers' `BertModel`, e.g. sentence-transformers' all-MiniLM-L6-v2) on
//! the core graph: word + position + token-type embeddings and LayerNorm, then per layer
//! bidirectional multi-head attention over the unpadded keys (`key_mask`), the output projection,
//! residual and LayerNorm, the GELU MLP, residual and LayerNorm (post-norm, as BERT does). The
//! output is the last hidden state of every position; [`Pooling`] turns it into a sentence
//! embedding the way sentence-transformers' `Pooling` and `Normalize` modules do.
//!
//! One graph serves one sequence length; a shorter text is padded with id 0 and masked, exactly
//! as transformers pads a batch (masked keys get no attention weight; padded positions still
//! produce outputs, which pooling ignores).

use crate::error::{Error, Result};
use crate::exec::{ExecStats, Executor};
use crate::graph::{ElemType, HostTensor, OpKind, ValueInfo};
use crate::graph::{Graph, ValueId};
use crate::io::model::ModelIndex;
use crate::models::{reshape, swap01, W};

/// The encoder's hyper-parameters, from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden width.
    pub hidden: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Position embeddings (the longest sequence).
    pub max_positions: usize,
    /// Token types.
    pub type_vocab: usize,
    /// LayerNorm epsilon.
    pub eps: f32,
    /// The MLP's activation: exact erf GELU (`gelu`) or the tanh approximation (`gelu_new`,
    /// `gelu_pytorch_tanh`).
    pub gelu_tanh: bool,
}

impl BertConfig {
    /// Reads a transformers `config.json` of a BERT model.
    pub fn from_json(c: &serde_json::Value) -> Result<Self> {
        let bad = |msg: String| Error::Model {
            file: "config.json".into(),
            msg,
        };
        let u = |k: &str| c.get(k).and_then(|v| v.as_u64()).map(|v| v as usize);
        let need = |k: &str| u(k).ok_or_else(|| bad(format!("missing '{k}'")));
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        if heads == 0 || hidden % heads != 0 {
            return Err(bad(format!(
                "hidden_size {hidden} does not split over {heads} attention heads"
            )));
        }
        let gelu_tanh = match c
            .get("hidden_act")
            .and_then(|v| v.as_str())
            .unwrap_or("gelu")
        {
            "gelu" => false,
            "gelu_new" | "gelu_pytorch_tanh" => true,
            other => {
                return Err(bad(format!(
                    "hidden_act '{other}' is not supported (gelu, gelu_new, gelu_pytorch_tanh)"
                )))
            }
        };
        match c.get("position_embedding_type").and_then(|v| v.as_str()) {
            None | Some("absolute") => {}
            Some(other) => {
                return Err(bad(format!(
                    "position_embedding_type '{other}' is not supported (absolute)"
                )))
            }
        }
        if c.get("is_decoder").and_then(|v| v.as_bool()) == Some(true) {
            return Err(bad(
                "a BERT decoder (is_decoder: true) is not supported".into()
            ));
        }
        Ok(BertConfig {
            vocab: need("vocab_size")?,
            hidden,
            layers: need("num_hidden_layers")?,
            heads,
            intermediate: need("intermediate_size")?,
            max_positions: u("max_position_embeddings").unwrap_or(512),
            type_vocab: u("type_vocab_size").unwrap_or(2),
            eps: c
                .get("layer_norm_eps")
                .and_then(|v| v.as_f64())
                .unwrap_or(1e-12) as f32,
            gelu_tanh,
        })
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// Reads the encoder's configuration from a model's `config.json`.
pub fn config(model: &ModelIndex) -> Result<BertConfig> {
    BertConfig::from_json(model.config.as_ref().ok_or_else(|| Error::Model {
        file: model.root.clone(),
        msg: "no config.json".into(),
    })?)
}

/// The prefix of the encoder's tensor names: none for a saved `BertModel`, `bert.` for a model
/// with a head (`BertForMaskedLM`, ...).
fn prefix(model: &ModelIndex) -> Result<&'static str> {
    ["", "bert."]
        .into_iter()
        .find(|p| {
            model
                .get(&format!("{p}embeddings.word_embeddings.weight"))
                .is_some()
        })
        .ok_or_else(|| Error::Model {
            file: model.root.clone(),
            msg: "no embeddings.word_embeddings.weight: not a BERT checkpoint".into(),
        })
}

/// An encoder graph and what it was built for.
#[derive(Debug)]
pub struct BertGraph {
    /// The graph: inputs `ids [T]`, `token_type_ids [T]`, `positions [T]` (u32) and
    /// `mask [T]` (f32, 1 for a token, 0 for padding); output the last hidden state `[T, hidden]`.
    pub graph: Graph,
    /// The configuration.
    pub config: BertConfig,
    /// T.
    pub seq_len: usize,
}

/// Builds the encoder for sequences of `seq_len` tokens against `model`'s weights.
pub fn build(model: &ModelIndex, seq_len: usize) -> Result<BertGraph> {
    let cfg = config(model)?;
    if seq_len == 0 || seq_len > cfg.max_positions {
        return Err(Error::Invalid(format!(
            "BERT graph: {seq_len} tokens (the model has 1 to {} positions)",
            cfg.max_positions
        )));
    }
    let p = prefix(model)?;
    let (h, t, nh, hd) = (cfg.hidden, seq_len, cfg.heads, cfg.head_dim());
    let mut g = Graph::new();
    let emb = g.group(&format!("{p}embeddings"));
    let e = |n: &str| format!("{p}embeddings.{n}");
    let words = g.dense_weight(emb, &e("word_embeddings.weight"), &[cfg.vocab, h]);
    let positions = g.dense_weight(
        emb,
        &e("position_embeddings.weight"),
        &[cfg.max_positions, h],
    );
    let types = g.dense_weight(
        emb,
        &e("token_type_embeddings.weight"),
        &[cfg.type_vocab, h],
    );
    let ln_w = g.dense_weight(emb, &e("LayerNorm.weight"), &[h]);
    let ln_b = g.dense_weight(emb, &e("LayerNorm.bias"), &[h]);
    let u32v = ValueInfo {
        shape: vec![t],
        elem: ElemType::U32,
    };
    let ids = g.input(u32v.clone());
    let type_ids = g.input(u32v.clone());
    let pos = g.input(u32v);
    let mask = g.input(ValueInfo::f32(&[t]));
    let ln = OpKind::LayerNorm {
        eps: cfg.eps,
        affine: true,
    };
    let x = g.op(OpKind::Embedding, &[ids, words], None)?;
    let xp = g.op(OpKind::Embedding, &[pos, positions], None)?;
    let xt = g.op(OpKind::Embedding, &[type_ids, types], None)?;
    let x = g.op(OpKind::Add, &[x, xp], None)?;
    let x = g.op(OpKind::Add, &[x, xt], None)?;
    let mut x = g.op(ln.clone(), &[x, ln_w, ln_b], None)?;
    for l in 0..cfg.layers {
        let lp = format!("{p}encoder.layer.{l}");
        let grp = g.group(&lp);
        let mut w = |name: &str, out: usize, inp: usize| {
            W::load(&mut g, model, grp, &format!("{lp}.{name}"), out, inp)
        };
        let q = w("attention.self.query.weight", h, h)?;
        let k = w("attention.self.key.weight", h, h)?;
        let v = w("attention.self.value.weight", h, h)?;
        let o = w("attention.output.dense.weight", h, h)?;
        let up = w("intermediate.dense.weight", cfg.intermediate, h)?;
        let down = w("output.dense.weight", h, cfg.intermediate)?;
        let norm = |g: &mut Graph, name: &str| -> (ValueId, ValueId) {
            (
                g.dense_weight(grp, &format!("{lp}.{name}.weight"), &[h]),
                g.dense_weight(grp, &format!("{lp}.{name}.bias"), &[h]),
            )
        };
        let (n1w, n1b) = norm(&mut g, "attention.output.LayerNorm");
        let (n2w, n2b) = norm(&mut g, "output.LayerNorm");
        let heads = |g: &mut Graph, w: W| -> Result<ValueId> {
            let y = w.apply(g, x)?;
            let y = reshape(g, y, &[t, nh, hd])?;
            swap01(g, y)
        };
        let (q, k, v) = (heads(&mut g, q)?, heads(&mut g, k)?, heads(&mut g, v)?);
        let a = g.op(
            OpKind::Attention {
                causal: false,
                scale: 1.0 / (hd as f32).sqrt(),
                key_mask: true,
            },
            &[q, k, v, mask],
            None,
        )?;
        let a = swap01(&mut g, a)?;
        let a = reshape(&mut g, a, &[t, h])?;
        let a = o.apply(&mut g, a)?;
        let a = g.op(OpKind::Add, &[a, x], None)?;
        x = g.op(ln.clone(), &[a, n1w, n1b], None)?;
        let m = up.apply(&mut g, x)?;
        let act = if cfg.gelu_tanh {
            OpKind::GeluTanh
        } else {
            OpKind::Gelu
        };
        let m = g.op(act, &[m], None)?;
        let m = down.apply(&mut g, m)?;
        let m = g.op(OpKind::Add, &[m, x], None)?;
        x = g.op(ln.clone(), &[m, n2w, n2b], None)?;
    }
    g.output(x);
    Ok(BertGraph {
        graph: g,
        config: cfg,
        seq_len,
    })
}

/// How sentence-transformers turns token states into one vector (`modules.json`, then
/// `1_Pooling/config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolingMode {
    /// Mean over the unmasked tokens.
    Mean,
    /// The first token's state.
    Cls,
    /// Element-wise maximum over the unmasked tokens.
    Max,
    /// Sum over the unmasked tokens divided by the square root of their count.
    MeanSqrtLen,
}

/// Pooling and optional L2 normalization, as sentence-transformers' `Pooling` and `Normalize`
/// modules compute them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pooling {
    /// The pooling.
    pub mode: PoolingMode,
    /// Whether the pooled vector is divided by its L2 norm (`max(norm, 1e-12)`).
    pub normalize: bool,
}

impl Default for Pooling {
    /// Mean pooling without normalization: what sentence-transformers uses for a plain
    /// transformers model.
    fn default() -> Self {
        Pooling {
            mode: PoolingMode::Mean,
            normalize: false,
        }
    }
}

impl Pooling {
    /// From the sentence-transformers files of a model folder or URL (`modules.json` and its
    /// `Pooling` module's `config.json`); [`Pooling::default`] where there are none.
    #[cfg(feature = "native")]
    pub fn for_model(model: &ModelIndex) -> Result<Self> {
        let bad = |file: &str, msg: String| Error::Model {
            file: format!("{}/{file}", model.root.trim_end_matches('/')),
            msg,
        };
        let Some(modules) = model.side_file("modules.json")? else {
            return Ok(Pooling::default());
        };
        let modules: serde_json::Value =
            serde_json::from_slice(&modules).map_err(|e| bad("modules.json", e.to_string()))?;
        let list = modules
            .as_array()
            .ok_or_else(|| bad("modules.json", "not a list of modules".into()))?;
        let of_type = |suffix: &str| {
            list.iter().find(|m| {
                m.get("type")
                    .and_then(|t| t.as_str())
                    .is_some_and(|t| t.ends_with(suffix))
            })
        };
        let mut p = Pooling {
            mode: PoolingMode::Mean,
            normalize: of_type(".Normalize").is_some(),
        };
        if let Some(m) = of_type(".Pooling") {
            let dir = m
                .get("path")
                .and_then(|v| v.as_str())
                .unwrap_or("1_Pooling");
            let file = format!("{}/config.json", dir.trim_end_matches('/'));
            if let Some(b) = model.side_file(&file)? {
                let c: serde_json::Value =
                    serde_json::from_slice(&b).map_err(|e| bad(&file, e.to_string()))?;
                let on = |k: &str| c.get(k).and_then(|v| v.as_bool()) == Some(true);
                let modes = [
                    ("pooling_mode_cls_token", PoolingMode::Cls),
                    ("pooling_mode_mean_tokens", PoolingMode::Mean),
                    ("pooling_mode_max_tokens", PoolingMode::Max),
                    (
                        "pooling_mode_mean_sqrt_len_tokens",
                        PoolingMode::MeanSqrtLen,
                    ),
                ];
                let chosen: Vec<PoolingMode> = modes
                    .iter()
                    .filter(|(k, _)| on(k))
                    .map(|(_, m)| *m)
                    .collect();
                p.mode = match chosen.as_slice() {
                    [one] => *one,
                    [] => {
                        return Err(bad(&file, "no pooling mode is switched on".into()));
                    }
                    _ => {
                        return Err(bad(
                            &file,
                            format!("several pooling modes at once ({chosen:?}) are not supported"),
                        ))
                    }
                };
            }
        }
        Ok(p)
    }

    /// The sentence vector of token states `tokens [T, hidden]` with `mask [T]` (1 token, 0
    /// padding). Sums run in f64.
    pub fn pool(&self, tokens: &[f32], mask: &[f32], hidden: usize) -> Vec<f32> {
        let rows = || {
            tokens
                .chunks_exact(hidden)
                .zip(mask)
                .filter(|(_, &m)| m != 0.0)
                .map(|(r, _)| r)
        };
        let count = mask.iter().map(|&m| m as f64).sum::<f64>();
        let mut v: Vec<f32> = match self.mode {
            PoolingMode::Cls => tokens[..hidden].to_vec(),
            PoolingMode::Max => (0..hidden)
                .map(|j| rows().map(|r| r[j]).fold(f32::NEG_INFINITY, f32::max))
                .collect(),
            PoolingMode::Mean | PoolingMode::MeanSqrtLen => {
                let div = match self.mode {
                    PoolingMode::Mean => count.max(1e-9),
                    _ => count.max(1e-9).sqrt(),
                };
                (0..hidden)
                    .map(|j| (rows().map(|r| r[j] as f64).sum::<f64>() / div) as f32)
                    .collect()
            }
        };
        if self.normalize {
            let norm = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
            let d = norm.max(1e-12);
            v.iter_mut().for_each(|x| *x = (*x as f64 / d) as f32);
        }
        v
    }
}

/// An encoder bound to a backend: one sequence per step, weights streamed as the plan says.
pub struct Encoder<B: crate::backend::Backend> {
    ex: Executor<B>,
    /// The configuration.
    pub config: BertConfig,
    /// The sequence length the graph was built for (shorter inputs are padded).
    pub seq_len: usize,
}

impl<B: crate::backend::Backend> std::fmt::Debug for Encoder<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("seq_len", &self.seq_len)
            .finish()
    }
}

impl<B: crate::backend::Backend> Encoder<B> {
    /// Builds the graph for `seq_len` tokens, plans memory and loads the resident weights.
    pub fn new(
        model: &ModelIndex,
        backend: B,
        seq_len: usize,
        opts: crate::exec::ExecOptions,
    ) -> Result<Self> {
        Self::from_graph(build(model, seq_len)?, model, backend, opts)
    }

    /// An encoder over an already built graph.
    pub fn from_graph(
        bg: BertGraph,
        model: &ModelIndex,
        backend: B,
        opts: crate::exec::ExecOptions,
    ) -> Result<Self> {
        let ex = Executor::new(bg.graph, model, backend, opts)?;
        Ok(Encoder {
            ex,
            config: bg.config,
            seq_len: bg.seq_len,
        })
    }

    /// The executor (its plan, its backend).
    pub fn executor(&self) -> &Executor<B> {
        &self.ex
    }

    /// The last hidden state `[seq_len, hidden]` of `ids` (at most `seq_len` of them; the rest
    /// is padding), with `type_ids` (zeros when `None`).
    pub fn forward(
        &mut self,
        ids: &[u32],
        type_ids: Option<&[u32]>,
    ) -> Result<(Vec<f32>, Vec<f32>, ExecStats)> {
        let (t, n) = (self.seq_len, ids.len());
        if n == 0 || n > t {
            return Err(Error::Invalid(format!(
                "{n} tokens for an encoder built for 1 to {t}"
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.config.vocab) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab
            )));
        }
        let types = type_ids.map(<[u32]>::to_vec).unwrap_or_else(|| vec![0; n]);
        if types.len() != n || types.iter().any(|&x| x as usize >= self.config.type_vocab) {
            return Err(Error::Invalid(format!(
                "token_type_ids must be {n} values below {}",
                self.config.type_vocab
            )));
        }
        let pad = |mut v: Vec<u32>| {
            v.resize(t, 0);
            v
        };
        let mask: Vec<f32> = (0..t).map(|i| if i < n { 1.0 } else { 0.0 }).collect();
        let inputs = [
            HostTensor::u32(&[t], pad(ids.to_vec()))?,
            HostTensor::u32(&[t], pad(types))?,
            HostTensor::u32(&[t], (0..t as u32).collect())?,
            HostTensor::f32(&[t], mask.clone())?,
        ];
        let (out, stats) = self.ex.step(&inputs)?;
        let states = out
            .into_iter()
            .next()
            .ok_or_else(|| Error::Invalid("the encoder graph has no output".into()))?
            .into_f32();
        Ok((states, mask, stats))
    }

    /// The sentence embedding of `ids` with `pooling`.
    pub fn embed(&mut self, ids: &[u32], pooling: &Pooling) -> Result<(Vec<f32>, ExecStats)> {
        let (states, mask, stats) = self.forward(ids, None)?;
        Ok((pooling.pool(&states, &mask, self.config.hidden), stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_modes_and_normalization() {
        // Two tokens and one padded row of width 2.
        let tokens = [1.0, 2.0, 3.0, -4.0, 100.0, 100.0];
        let mask = [1.0, 1.0, 0.0];
        let p = |mode, normalize| Pooling { mode, normalize }.pool(&tokens, &mask, 2);
        assert_eq!(p(PoolingMode::Mean, false), vec![2.0, -1.0]);
        assert_eq!(p(PoolingMode::Cls, false), vec![1.0, 2.0]);
        assert_eq!(p(PoolingMode::Max, false), vec![3.0, 2.0]);
        let s = 2f32.sqrt();
        assert_eq!(p(PoolingMode::MeanSqrtLen, false), vec![4.0 / s, -2.0 / s]);
        let n = p(PoolingMode::Mean, true);
        let r = 5f32.sqrt();
        assert!(
            (n[0] - 2.0 / r).abs() < 1e-7 && (n[1] + 1.0 / r).abs() < 1e-7,
            "{n:?}"
        );
    }

    #[test]
    fn config_refuses_what_the_graph_does_not_compute() {
        let c = serde_json::json!({
            "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16,
        });
        let ok = BertConfig::from_json(&c).expect("defaults");
        assert_eq!((ok.head_dim(), ok.eps, ok.gelu_tanh), (4, 1e-12, false));
        for (k, v, why) in [
            ("hidden_act", serde_json::json!("relu"), "hidden_act 'relu'"),
            (
                "position_embedding_type",
                serde_json::json!("relative_key"),
                "relative_key",
            ),
            (
                "num_attention_heads",
                serde_json::json!(3),
                "does not split",
            ),
            ("is_decoder", serde_json::json!(true), "decoder"),
        ] {
            let mut bad = c.clone();
            bad[k] = v;
            let e = BertConfig::from_json(&bad).expect_err(k).to_string();
            assert!(e.contains(why), "{k}: {e}");
        }
    }
}
