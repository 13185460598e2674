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
use crate::graph::{ElemType, OpKind, ValueInfo};
use crate::graph::{Graph, ValueId};
use crate::io::model::ModelIndex;
use crate::models::bert::BertConfig;
use crate::models::nn::{merge_heads, split_heads, Attention};
use crate::models::{require_block, W};

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
    let cfg = BertConfig::of(model)?;
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
        require_block(model, &lp, "num_hidden_layers", cfg.layers)?;
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
            split_heads(g, y, t, nh, hd)
        };
        let (q, k, v) = (heads(&mut g, q)?, heads(&mut g, k)?, heads(&mut g, v)?);
        let a = Attention::scaled(hd).masked(mask).apply(&mut g, q, k, v)?;
        let a = merge_heads(&mut g, a, t, h)?;
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
