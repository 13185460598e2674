//! Shared graph blocks every family builds with: projections ([`W`], 4-bit or dense, with their
//! bias), heads split and merged, attention (built here only: fused with its causal and key
//! masks and grouped-query heads, or by matmul and softmax where an additive bias such as T5's
//! relative positions or a width past the fused kernels asks for it), adaLN modulation, and a
//! name-prefix builder in the spirit of candle's `VarBuilder::pp`.

use crate::error::Result;
use crate::graph::{Graph, LowRankPath, ValueId, WeightId};
use crate::graph::{OpKind, Q4Info};
use crate::io::model::ModelIndex;

/// A projection's weight in a graph: 4-bit where the checkpoint quantized it, dense otherwise;
/// with its bias where the checkpoint has one, and the low-rank paths of the LoRA adapters bound
/// to the model beside it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct W {
    base: Proj,
    /// The graph's set of low-rank paths for this linear ([`Graph::low_rank_set`]).
    low_rank: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
enum Proj {
    Q4(WeightId, Option<ValueId>),
    Dense(ValueId, Option<ValueId>),
}

impl W {
    /// A dense weight (`[out, inp]`) already in the graph, without bias or adapters.
    pub(crate) fn dense(w: ValueId) -> W {
        W {
            base: Proj::Dense(w, None),
            low_rank: None,
        }
    }

    /// The weight `name` (`[out, inp]`) of group `grp`, and `<name without .weight>.bias`; the
    /// adapters' paths for the module come as dense weights of one pinned group per adapter.
    pub(crate) fn load(
        g: &mut Graph,
        model: &ModelIndex,
        grp: usize,
        name: &str,
        out: usize,
        inp: usize,
    ) -> Result<W> {
        let module = name.trim_end_matches(".weight");
        let bias_name = format!("{module}.bias");
        let bias = model
            .get(&bias_name)
            .map(|_| g.dense_weight(grp, &bias_name, &[out]));
        let base = if let Some(k) = model.q4_key(name)? {
            let s = model.quant_state_json(k)?;
            let info = Q4Info {
                shape: vec![out, inp],
                blocksize: s.blocksize as usize,
            };
            Proj::Q4(g.q4_weight(grp, name, info), bias)
        } else {
            Proj::Dense(g.dense_weight(grp, name, &[out, inp]), bias)
        };
        let mut paths = Vec::new();
        for p in model.low_rank(module) {
            let grp = g.pinned_group(&adapter_group(&model.adapters().names[p.adapter]));
            let pair = p.halves.as_ref().map(|(down, up)| {
                (
                    g.dense_weight(grp, down, &[p.rank, inp]),
                    g.dense_weight(grp, up, &[out, p.rank]),
                )
            });
            let bias = p
                .bias
                .as_ref()
                .map(|(b, s)| (g.dense_weight(grp, b, &[out]), *s));
            let full = p
                .full
                .as_ref()
                .map(|(f, s)| (g.dense_weight(grp, f, &[out, inp]), *s));
            paths.push(LowRankPath {
                pair,
                scale: p.scale,
                bias,
                full,
                adapter: p.adapter,
                rank: p.rank,
            });
        }
        let low_rank = (!paths.is_empty()).then(|| g.low_rank_set(paths));
        Ok(W { base, low_rank })
    }

    /// `x · Wᵀ (+ b)`, plus `scale · (x · downᵀ) · upᵀ + bias_scale · bias` per adapter, in
    /// adapter order (peft's `result + lora_B(lora_A(x)) * scaling`); where the program selects
    /// rows per adapter ([`Graph::select_adapter_rows`]), `x · downᵀ` and the bias delta are
    /// multiplied by the adapter's row mask.
    pub(crate) fn apply(self, g: &mut Graph, x: ValueId) -> Result<ValueId> {
        let mut y = match self.base {
            Proj::Q4(w, None) => g.op(OpKind::LinearQ4 { bias: false }, &[x], Some(w))?,
            Proj::Q4(w, Some(b)) => g.op(OpKind::LinearQ4 { bias: true }, &[x, b], Some(w))?,
            Proj::Dense(w, None) => g.op(OpKind::Linear { bias: false }, &[x, w], None)?,
            Proj::Dense(w, Some(b)) => g.op(OpKind::Linear { bias: true }, &[x, w, b], None)?,
        };
        if let Some(set) = self.low_rank {
            for p in g.low_rank_paths(set).to_vec() {
                let rows = g.adapter_rows().and_then(|r| r.get(p.adapter)).copied();
                let cols = |g: &mut Graph, m: ValueId, n: usize| -> Result<ValueId> {
                    if g.info(m).shape.last() == Some(&n) {
                        return Ok(m);
                    }
                    let slice = OpKind::Slice {
                        axis: 1,
                        start: 0,
                        len: n,
                    };
                    g.op(slice, &[m], None)
                };
                if let Some((down, up)) = p.pair {
                    let mut h = g.op(OpKind::Linear { bias: false }, &[x, down], None)?;
                    if let Some(m) = rows {
                        let m = cols(g, m, p.rank)?;
                        h = g.op(OpKind::Mul, &[h, m], None)?;
                    }
                    let d = g.op(OpKind::Linear { bias: false }, &[h, up], None)?;
                    let d = scaled(g, d, p.scale)?;
                    y = g.op(OpKind::Add, &[y, d], None)?;
                }
                if let Some((f, s)) = p.full {
                    if rows.is_some() {
                        return Err(crate::error::Error::Invalid(
                            "a full-weight delta (.diff) cannot be chosen per sequence of a \
                             batch: bind it to the model alone (nibble run)"
                                .into(),
                        ));
                    }
                    let d = g.op(OpKind::Linear { bias: false }, &[x, f], None)?;
                    let d = scaled(g, d, s)?;
                    y = g.op(OpKind::Add, &[y, d], None)?;
                }
                if let Some((b, s)) = p.bias {
                    let b = scaled(g, b, s)?;
                    y = match rows {
                        None => g.op(OpKind::Add, &[y, b], None)?,
                        Some(m) => {
                            // The rows' 0/1 column times the delta: [rows, 1] · [out, 1]ᵀ.
                            let m = cols(g, m, 1)?;
                            let out = g.info(b).shape[0];
                            let b = reshape(g, b, &[out, 1])?;
                            let d = g.op(OpKind::Linear { bias: false }, &[m, b], None)?;
                            g.op(OpKind::Add, &[y, d], None)?
                        }
                    };
                }
            }
        }
        Ok(y)
    }
}

/// `factor · x`; `x` itself for a factor of 1 (the same bits, one op less per adapted linear).
fn scaled(g: &mut Graph, x: ValueId, factor: f32) -> Result<ValueId> {
    if factor == 1.0 {
        return Ok(x);
    }
    g.op(OpKind::Scale { factor }, &[x], None)
}

/// The weight group of an adapter's tensors (one per adapter, pinned resident).
pub fn adapter_group(adapter: &str) -> String {
    format!("lora {adapter}")
}

/// The same data in another shape.
pub(crate) fn reshape(g: &mut Graph, x: ValueId, shape: &[usize]) -> Result<ValueId> {
    g.op(
        OpKind::Reshape {
            shape: shape.to_vec(),
        },
        &[x],
        None,
    )
}

/// `[a, b, c]` to `[b, a, c]` (tokens x heads to heads x tokens and back).
pub(crate) fn swap01(g: &mut Graph, x: ValueId) -> Result<ValueId> {
    g.op(
        OpKind::Permute {
            perm: vec![1, 0, 2],
        },
        &[x],
        None,
    )
}

/// `nn.Linear` `name` of group `grp` (`name.weight`, 4-bit or dense, with `name.bias` where the
/// file has one) applied to `x`.
pub(crate) fn linear(
    g: &mut Graph,
    model: &ModelIndex,
    grp: usize,
    name: &str,
    x: ValueId,
    (out, inp): (usize, usize),
) -> Result<ValueId> {
    W::load(g, model, grp, &format!("{name}.weight"), out, inp)?.apply(g, x)
}

/// Tensor names under a prefix: `Names::new("blocks.3").pp("attn").name("to_q.weight")` is
/// `blocks.3.attn.to_q.weight`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names(String);

impl Names {
    /// Names under `prefix` (empty: none).
    pub fn new(prefix: impl Into<String>) -> Self {
        Names(prefix.into())
    }

    /// The names one level down, under `part`.
    pub fn pp(&self, part: impl std::fmt::Display) -> Self {
        Names(self.name(part))
    }

    /// The full name of `leaf`.
    pub fn name(&self, leaf: impl std::fmt::Display) -> String {
        if self.0.is_empty() {
            leaf.to_string()
        } else {
            format!("{}.{leaf}", self.0)
        }
    }

    /// The prefix itself.
    pub fn prefix(&self) -> &str {
        &self.0
    }
}

/// `[t, heads * head_dim]` to head-major `[heads, t, head_dim]`.
pub(crate) fn split_heads(
    g: &mut Graph,
    x: ValueId,
    t: usize,
    heads: usize,
    head_dim: usize,
) -> Result<ValueId> {
    let x = reshape(g, x, &[t, heads, head_dim])?;
    swap01(g, x)
}

/// Head-major `[heads, t, head_dim]` back to `[t, heads * head_dim]`.
pub(crate) fn merge_heads(g: &mut Graph, a: ValueId, t: usize, width: usize) -> Result<ValueId> {
    let a = swap01(g, a)?;
    reshape(g, a, &[t, width])
}

/// How attention is computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Attention {
    /// Query i sees keys up to i + (Tk - Tq).
    pub causal: bool,
    /// Multiplies the scores (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// A key mask `[Tk]` (1 keep, 0 pad).
    pub key_mask: Option<ValueId>,
    /// An additive bias of the scores `[H, Tq, Tk]` (T5's relative positions): scores by
    /// matmul and softmax.
    pub bias: Option<ValueId>,
    /// Scores by matmul and softmax even without a bias (a width past the fused kernels).
    pub unfused: bool,
}

impl Attention {
    /// Non-causal, unmasked, scaled by `1/sqrt(head_dim)`.
    pub fn scaled(head_dim: usize) -> Self {
        Attention {
            causal: false,
            scale: 1.0 / (head_dim as f32).sqrt(),
            key_mask: None,
            bias: None,
            unfused: false,
        }
    }

    /// Non-causal, unmasked, scaled by `scale`.
    pub fn with_scale(scale: f32) -> Self {
        Attention {
            scale,
            ..Attention::scaled(1)
        }
    }

    /// Causal.
    pub fn causal(self) -> Self {
        Attention {
            causal: true,
            ..self
        }
    }

    /// With a key mask.
    pub fn masked(self, mask: ValueId) -> Self {
        Attention {
            key_mask: Some(mask),
            ..self
        }
    }

    /// Scaled dot-product attention of head-major `q[Hq, Tq, D]` over `k, v[Hkv, Tk, D]`
    /// (grouped-query when `Hkv < Hq`): `[Hq, Tq, D]`. Fused (no score matrix stored) unless a
    /// bias or `unfused` asks for scores: `q kᵀ`, scaled (unless by 1), plus the bias, softmax,
    /// times `v` (one head group per batch; no causal or key mask there).
    pub fn apply(self, g: &mut Graph, q: ValueId, k: ValueId, v: ValueId) -> Result<ValueId> {
        if self.bias.is_none() && !self.unfused {
            let mut inputs = vec![q, k, v];
            inputs.extend(self.key_mask);
            return g.op(
                OpKind::Attention {
                    causal: self.causal,
                    scale: self.scale,
                    key_mask: self.key_mask.is_some(),
                },
                &inputs,
                None,
            );
        }
        if self.causal || self.key_mask.is_some() {
            return Err(crate::Error::Invalid(
                "attention by matmul and softmax takes no causal or key mask".into(),
            ));
        }
        let mut s = g.op(OpKind::MatMul { transpose_b: true }, &[q, k], None)?;
        if self.scale != 1.0 {
            s = g.op(OpKind::Scale { factor: self.scale }, &[s], None)?;
        }
        if let Some(b) = self.bias {
            s = g.op(OpKind::Add, &[s, b], None)?;
        }
        let p = g.op(OpKind::Softmax, &[s], None)?;
        g.op(OpKind::MatMul { transpose_b: false }, &[p, v], None)
    }
}

/// adaLN modulation: `x * (1 + scale) + shift`, scale and shift over the last dim.
pub(crate) fn modulate(
    g: &mut Graph,
    x: ValueId,
    shift: ValueId,
    scale: ValueId,
) -> Result<ValueId> {
    g.op(OpKind::AdaLnModulate, &[x, shift, scale], None)
}

#[cfg(test)]
mod tests {
    use super::Names;

    #[test]
    fn names_nest_with_dots() {
        let n = Names::new("blocks.3");
        assert_eq!(
            n.pp("attn").name("to_q.weight"),
            "blocks.3.attn.to_q.weight"
        );
        assert_eq!(Names::new("").name("x"), "x");
        assert_eq!(n.pp(7).prefix(), "blocks.3.7");
    }
}
