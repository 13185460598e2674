//! The graph of diffusers' `WanTransformer3DModel` (Wan 2.1 text to video) for a latent of
//! `n` patches and `t` text tokens, over `b` sequences at once: with classifier-free guidance
//! the prompt's and the negative prompt's sequences go through every weight group together, so
//! a guided step reads each weight byte once.
//!
//! Inputs in order: the latent's patches `[n, C·pt·ph·pw]` (the same for every sequence), the
//! text states `[b·t, text_dim]` (sequence after sequence), the timestep `[1]` (the scheduler's
//! integer timestep), the rotary tables cos and sin `[n, head_dim / 2]`. Output: the prediction
//! of each sequence, `[b·n, C·pt·ph·pw]` (rows of sequence 0 first; per token in the order
//! (pt, ph, pw, C), as the model's output head lays them out).

use crate::error::{Error, Result};
use crate::graph::{Graph, OpKind, RopeMode, ValueId, ValueInfo};
use crate::io::model::ModelIndex;
use crate::models::nn::{linear, merge_heads, modulate, Attention, Names};
use crate::models::{require_block, reshape, swap01};

use super::WanConfig;

/// The graph and the configuration it was built from.
#[derive(Debug)]
pub struct WanGraph {
    /// The graph.
    pub graph: Graph,
    /// The configuration.
    pub config: WanConfig,
}

struct Builder<'a> {
    g: Graph,
    model: &'a ModelIndex,
    cfg: WanConfig,
}

impl Builder<'_> {
    fn op(&mut self, op: OpKind, inputs: &[ValueId]) -> Result<ValueId> {
        self.g.op(op, inputs, None)
    }

    /// `name` (`.weight`, with its `.bias` where the file has one) applied to `x`.
    fn linear(
        &mut self,
        grp: usize,
        name: &str,
        x: ValueId,
        out: usize,
        inp: usize,
    ) -> Result<ValueId> {
        linear(&mut self.g, self.model, grp, name, x, (out, inp))
    }

    /// LayerNorm over the last dim, without weights.
    fn norm(&mut self, x: ValueId) -> Result<ValueId> {
        let eps = self.cfg.eps;
        self.op(OpKind::LayerNorm { eps, affine: false }, &[x])
    }

    /// Row `i` of a `[rows, d]` value, as `[d]`.
    fn row(&mut self, v: ValueId, i: usize, d: usize) -> Result<ValueId> {
        let s = self.op(
            OpKind::Slice {
                axis: 0,
                start: i,
                len: 1,
            },
            &[v],
        )?;
        reshape(&mut self.g, s, &[d])
    }

    /// Rows `s·len .. (s+1)·len` of a stacked value.
    fn rows(&mut self, v: ValueId, s: usize, len: usize) -> Result<ValueId> {
        self.op(
            OpKind::Slice {
                axis: 0,
                start: s * len,
                len,
            },
            &[v],
        )
    }

    /// `[len, dim]` to head-major `[heads, len, head_dim]`, rotated where `rope` is given.
    fn heads(
        &mut self,
        x: ValueId,
        len: usize,
        rope: Option<(ValueId, ValueId)>,
    ) -> Result<ValueId> {
        let (h, hd) = (self.cfg.heads, self.cfg.head_dim);
        let x = reshape(&mut self.g, x, &[len, h, hd])?;
        let x = match rope {
            Some((cos, sin)) => self.op(
                OpKind::Rope {
                    mode: RopeMode::Interleaved,
                },
                &[x, cos, sin],
            )?,
            None => x,
        };
        swap01(&mut self.g, x)
    }

    /// Stacks the per-sequence values along rows.
    fn stack(&mut self, parts: Vec<ValueId>) -> Result<ValueId> {
        let mut it = parts.into_iter();
        let mut acc = it
            .next()
            .ok_or_else(|| Error::Invalid("no sequence".into()))?;
        for p in it {
            acc = self.op(OpKind::Concat { axis: 0 }, &[acc, p])?;
        }
        Ok(acc)
    }

    /// Attention of `name` (`attn1`: self-attention with the rotary tables; `attn2`: cross-
    /// attention to `ctx`) over `b` stacked sequences of `n` queries and `kv_len` keys:
    /// q/k/v projections, the RMS q/k norms across heads before the head split, per-sequence
    /// attention, the output projection.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &mut self,
        grp: usize,
        name: &Names,
        x: ValueId,
        ctx: ValueId,
        (b, n, kv_len): (usize, usize, usize),
        rope: Option<(ValueId, ValueId)>,
    ) -> Result<ValueId> {
        let d = self.cfg.dim();
        let rms = OpKind::RmsNorm { eps: self.cfg.eps };
        let q = self.linear(grp, &name.name("to_q"), x, d, d)?;
        let k = self.linear(grp, &name.name("to_k"), ctx, d, d)?;
        let v = self.linear(grp, &name.name("to_v"), ctx, d, d)?;
        let nq = self.g.dense_weight(grp, &name.name("norm_q.weight"), &[d]);
        let nk = self.g.dense_weight(grp, &name.name("norm_k.weight"), &[d]);
        let q = self.op(rms.clone(), &[q, nq])?;
        let k = self.op(rms, &[k, nk])?;
        let mut outs = Vec::with_capacity(b);
        for s in 0..b {
            let qs = self.rows(q, s, n)?;
            let ks = self.rows(k, s, kv_len)?;
            let vs = self.rows(v, s, kv_len)?;
            let qs = self.heads(qs, n, rope)?;
            let ks = self.heads(ks, kv_len, rope)?;
            let vs = self.heads(vs, kv_len, None)?;
            let a = Attention::scaled(self.cfg.head_dim).apply(&mut self.g, qs, ks, vs)?;
            outs.push(merge_heads(&mut self.g, a, n, d)?);
        }
        let a = self.stack(outs)?;
        self.linear(grp, &name.name("to_out.0"), a, d, d)
    }
}

/// Builds the transformer for a latent of `n` patches, `t` text tokens and `b` sequences (2
/// with guidance) against `model`'s weights.
pub fn build(model: &ModelIndex, n: usize, t: usize, b: usize) -> Result<WanGraph> {
    let cfg = WanConfig::of(model)?;
    if n == 0 || t == 0 || !(1..=2).contains(&b) {
        return Err(Error::Invalid(format!(
            "Wan graph: {n} latent patches, {t} text tokens, {b} sequences (1 or 2)"
        )));
    }
    let d = cfg.dim();
    let half = cfg.head_dim / 2;
    let mut bl = Builder {
        g: Graph::new(),
        model,
        cfg: cfg.clone(),
    };
    let patches = bl.g.input(ValueInfo::f32(&[n, cfg.patch_values()]));
    let text = bl.g.input(ValueInfo::f32(&[b * t, cfg.text_dim]));
    let timestep = bl.g.input(ValueInfo::f32(&[1]));
    let cos = bl.g.input(ValueInfo::f32(&[n, half]));
    let sin = bl.g.input(ValueInfo::f32(&[n, half]));
    let rope = Some((cos, sin));

    let emb = bl.g.group("embedders");
    // The Conv3d patch embedding is a linear map of each patch (its weight [dim, C, pt, ph, pw]
    // read as [dim, C·pt·ph·pw]).
    let h = bl.linear(emb, "patch_embedding", patches, d, cfg.patch_values())?;
    let mut x = h;
    for _ in 1..b {
        x = bl.op(OpKind::Concat { axis: 0 }, &[x, h])?;
    }
    let ce = Names::new("condition_embedder");
    let sinusoid = bl.op(
        OpKind::TimestepEmbedding {
            dim: cfg.freq_dim,
            flip_sin_to_cos: true,
            downscale_freq_shift: 0.0,
            scale: 1.0,
            max_period: 10000.0,
        },
        &[timestep],
    )?;
    let te = ce.pp("time_embedder");
    let temb = bl.linear(emb, &te.name("linear_1"), sinusoid, d, cfg.freq_dim)?;
    let temb = bl.op(OpKind::Silu, &[temb])?;
    let temb = bl.linear(emb, &te.name("linear_2"), temb, d, d)?; // [1, d]
    let act = bl.op(OpKind::Silu, &[temb])?;
    let tproj = bl.linear(emb, &ce.name("time_proj"), act, 6 * d, d)?;
    let tproj = reshape(&mut bl.g, tproj, &[6, d])?;
    let tx = ce.pp("text_embedder");
    let ctx = bl.linear(emb, &tx.name("linear_1"), text, d, cfg.text_dim)?;
    let ctx = bl.op(OpKind::GeluTanh, &[ctx])?;
    let ctx = bl.linear(emb, &tx.name("linear_2"), ctx, d, d)?;

    for i in 0..cfg.layers {
        let blk = Names::new(format!("blocks.{i}"));
        require_block(model, blk.prefix(), "num_layers", cfg.layers)?;
        let grp = bl.g.group(blk.prefix());
        let table =
            bl.g.dense_weight(grp, &blk.name("scale_shift_table"), &[6, d]);
        let m = bl.op(OpKind::Add, &[table, tproj])?;
        let mods: Vec<ValueId> = (0..6).map(|j| bl.row(m, j, d)).collect::<Result<_>>()?;
        // Self-attention on the modulated norm, gated.
        let y = bl.norm(x)?;
        let y = modulate(&mut bl.g, y, mods[0], mods[1])?;
        let a = bl.attention(grp, &blk.pp("attn1"), y, y, (b, n, n), rope)?;
        let a = bl.op(OpKind::Mul, &[a, mods[2]])?;
        x = bl.op(OpKind::Add, &[x, a])?;
        // Cross-attention to the text, on the (affine) norm, ungated.
        let y = if cfg.cross_attn_norm {
            let w = bl.g.dense_weight(grp, &blk.name("norm2.weight"), &[d]);
            let bb = bl.g.dense_weight(grp, &blk.name("norm2.bias"), &[d]);
            let eps = cfg.eps;
            bl.op(OpKind::LayerNorm { eps, affine: true }, &[x, w, bb])?
        } else {
            x
        };
        let a = bl.attention(grp, &blk.pp("attn2"), y, ctx, (b, n, t), None)?;
        x = bl.op(OpKind::Add, &[x, a])?;
        // The feed-forward on the modulated norm, gated.
        let y = bl.norm(x)?;
        let y = modulate(&mut bl.g, y, mods[3], mods[4])?;
        let f = blk.pp("ffn.net");
        let y = bl.linear(grp, &f.name("0.proj"), y, cfg.ffn_dim, d)?;
        let y = bl.op(OpKind::GeluTanh, &[y])?;
        let y = bl.linear(grp, &f.name("2"), y, d, cfg.ffn_dim)?;
        let y = bl.op(OpKind::Mul, &[y, mods[5]])?;
        x = bl.op(OpKind::Add, &[x, y])?;
    }

    // The output head: shift and scale from its table and the time embedding (not the
    // per-block projection).
    let head = bl.g.group("head");
    let table = bl.g.dense_weight(head, "scale_shift_table", &[2, d]);
    let temb_row = reshape(&mut bl.g, temb, &[d])?;
    let m = bl.op(OpKind::Add, &[table, temb_row])?;
    let shift = bl.row(m, 0, d)?;
    let scale = bl.row(m, 1, d)?;
    let y = bl.norm(x)?;
    let y = modulate(&mut bl.g, y, shift, scale)?;
    let out = bl.linear(head, "proj_out", y, cfg.out_values(), d)?;
    bl.g.output(out);
    Ok(WanGraph {
        graph: bl.g,
        config: cfg,
    })
}
