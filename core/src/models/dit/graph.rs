//! Flux-style diffusion transformers (diffusers `FluxTransformer2DModel`) as a [`Graph`]:
//! x / context embedders, timestep + guidance + pooled-text embedding, double-stream blocks
//! (adaLN-Zero modulation, joint attention over text and image tokens with RMS qk-norm and 3-axis
//! RoPE), single-stream blocks (parallel attention and MLP), adaptive final norm and projection.
//! Batch size 1. Every block is one weight group.

use crate::error::Result;
use crate::graph::{Graph, ValueId};
use crate::graph::{OpKind, RopeMode, ValueInfo};
use crate::io::model::ModelIndex;
use crate::models::dit::DitConfig;
use crate::models::nn::{linear, merge_heads, modulate, Attention};
use crate::models::require_block;

/// Inputs in order: latent tokens `[N, in]`, text tokens `[T, joint]`, pooled `[pooled]`,
/// timestep `[1]` (already x1000), guidance `[1]` (already x1000; only when the model has a
/// guidance embedder), rope cos and sin `[T + N, head_dim / 2]`. Output: `[N, out]`.
#[derive(Debug)]
pub struct DitGraph {
    /// The graph.
    pub graph: Graph,
    /// The configuration.
    pub config: DitConfig,
}

struct Builder<'a> {
    g: Graph,
    model: &'a ModelIndex,
}

impl Builder<'_> {
    fn op(&mut self, op: OpKind, inputs: &[ValueId]) -> Result<ValueId> {
        self.g.op(op, inputs, None)
    }

    /// `nn.Linear` with bias, 4-bit or dense.
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

    /// Chunk `i` of `n` of a `[1, n*d]` modulation vector, as `[d]`.
    fn chunk(&mut self, v: ValueId, i: usize, d: usize) -> Result<ValueId> {
        let s = self.op(
            OpKind::Slice {
                axis: 1,
                start: i * d,
                len: d,
            },
            &[v],
        )?;
        self.op(OpKind::Reshape { shape: vec![d] }, &[s])
    }

    /// `LayerNorm(x) * (1 + scale) + shift` (no affine, eps 1e-6).
    fn modulate(&mut self, x: ValueId, shift: ValueId, scale: ValueId) -> Result<ValueId> {
        let n = self.op(
            OpKind::LayerNorm {
                eps: 1e-6,
                affine: false,
            },
            &[x],
        )?;
        modulate(&mut self.g, n, shift, scale)
    }

    /// q, k or v: projection, split into heads, RMS qk-norm when a norm weight is given.
    fn head_proj(
        &mut self,
        grp: usize,
        proj: &str,
        norm: Option<&str>,
        x: ValueId,
        s: usize,
        cfg: &DitConfig,
    ) -> Result<ValueId> {
        let d = cfg.dim();
        let y = self.linear(grp, proj, x, d, d)?;
        let mut y = self.op(
            OpKind::Reshape {
                shape: vec![s, cfg.heads, cfg.head_dim],
            },
            &[y],
        )?;
        if let Some(n) = norm {
            let w = self
                .g
                .dense_weight(grp, &format!("{n}.weight"), &[cfg.head_dim]);
            y = self.op(OpKind::RmsNorm { eps: 1e-6 }, &[y, w])?;
        }
        Ok(y)
    }

    /// [a, b, c] -> [b, a, c]: tokens-major to heads-major and back.
    fn swap01(&mut self, v: ValueId) -> Result<ValueId> {
        self.op(
            OpKind::Permute {
                perm: vec![1, 0, 2],
            },
            &[v],
        )
    }

    /// RoPE on q and k, then attention over all `s` tokens, back to `[s, dim]`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &mut self,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        cos: ValueId,
        sin: ValueId,
        cfg: &DitConfig,
        s: usize,
    ) -> Result<ValueId> {
        let q = self.op(
            OpKind::Rope {
                mode: RopeMode::Interleaved,
            },
            &[q, cos, sin],
        )?;
        let k = self.op(
            OpKind::Rope {
                mode: RopeMode::Interleaved,
            },
            &[k, cos, sin],
        )?;
        let q = self.swap01(q)?;
        let k = self.swap01(k)?;
        let v = self.swap01(v)?;
        let a = Attention::scaled(cfg.head_dim).apply(&mut self.g, q, k, v)?;
        merge_heads(&mut self.g, a, s, cfg.dim())
    }
}

/// Builds the transformer for `n` latent tokens and `t` text tokens against `model`'s weights.
pub fn build(model: &ModelIndex, n: usize, t: usize) -> Result<DitGraph> {
    let cfg = DitConfig::of(model)?;
    let mut b = Builder {
        g: Graph::new(),
        model,
    };
    let d = cfg.dim();
    let s = t + n;
    let x_in = b.g.input(ValueInfo::f32(&[n, cfg.in_channels]));
    let ctx_in = b.g.input(ValueInfo::f32(&[t, cfg.joint_dim]));
    let pooled = b.g.input(ValueInfo::f32(&[1, cfg.pooled_dim]));
    let timestep = b.g.input(ValueInfo::f32(&[1]));
    let guidance = if cfg.guidance {
        Some(b.g.input(ValueInfo::f32(&[1])))
    } else {
        None
    };
    let cos = b.g.input(ValueInfo::f32(&[s, cfg.head_dim / 2]));
    let sin = b.g.input(ValueInfo::f32(&[s, cfg.head_dim / 2]));

    let emb = b.g.group("embedders");
    let mut x = b.linear(emb, "x_embedder", x_in, d, cfg.in_channels)?;
    let mut ctx = b.linear(emb, "context_embedder", ctx_in, d, cfg.joint_dim)?;
    let temb_op = OpKind::TimestepEmbedding {
        dim: 256,
        flip_sin_to_cos: true,
        downscale_freq_shift: 0.0,
        scale: 1.0,
        max_period: 10000.0,
    };
    let embed_scalar = |b: &mut Builder, name: &str, v: ValueId| -> Result<ValueId> {
        let p = b.op(temb_op.clone(), &[v])?;
        let h = b.linear(emb, &format!("time_text_embed.{name}.linear_1"), p, d, 256)?;
        let h = b.op(OpKind::Silu, &[h])?;
        b.linear(emb, &format!("time_text_embed.{name}.linear_2"), h, d, d)
    };
    let mut temb = embed_scalar(&mut b, "timestep_embedder", timestep)?;
    if let Some(gv) = guidance {
        let ge = embed_scalar(&mut b, "guidance_embedder", gv)?;
        temb = b.op(OpKind::Add, &[temb, ge])?;
    }
    let p = b.linear(
        emb,
        "time_text_embed.text_embedder.linear_1",
        pooled,
        d,
        cfg.pooled_dim,
    )?;
    let p = b.op(OpKind::Silu, &[p])?;
    let p = b.linear(emb, "time_text_embed.text_embedder.linear_2", p, d, d)?;
    let temb = b.op(OpKind::Add, &[temb, p])?;
    let temb_act = b.op(OpKind::Silu, &[temb])?;

    for i in 0..cfg.double_blocks {
        let pre = format!("transformer_blocks.{i}");
        require_block(model, &pre, "num_layers", cfg.double_blocks)?;
        let grp = b.g.group(&pre);
        let m = b.linear(grp, &format!("{pre}.norm1.linear"), temb_act, 6 * d, d)?;
        let mc = b.linear(
            grp,
            &format!("{pre}.norm1_context.linear"),
            temb_act,
            6 * d,
            d,
        )?;
        let ch: Vec<ValueId> = (0..6).map(|j| b.chunk(m, j, d)).collect::<Result<_>>()?;
        let cc: Vec<ValueId> = (0..6).map(|j| b.chunk(mc, j, d)).collect::<Result<_>>()?;
        let xn = b.modulate(x, ch[0], ch[1])?;
        let cn = b.modulate(ctx, cc[0], cc[1])?;
        let q = b.head_proj(
            grp,
            &format!("{pre}.attn.to_q"),
            Some(&format!("{pre}.attn.norm_q")),
            xn,
            n,
            &cfg,
        )?;
        let k = b.head_proj(
            grp,
            &format!("{pre}.attn.to_k"),
            Some(&format!("{pre}.attn.norm_k")),
            xn,
            n,
            &cfg,
        )?;
        let v = b.head_proj(grp, &format!("{pre}.attn.to_v"), None, xn, n, &cfg)?;
        let cq = b.head_proj(
            grp,
            &format!("{pre}.attn.add_q_proj"),
            Some(&format!("{pre}.attn.norm_added_q")),
            cn,
            t,
            &cfg,
        )?;
        let ck = b.head_proj(
            grp,
            &format!("{pre}.attn.add_k_proj"),
            Some(&format!("{pre}.attn.norm_added_k")),
            cn,
            t,
            &cfg,
        )?;
        let cv = b.head_proj(grp, &format!("{pre}.attn.add_v_proj"), None, cn, t, &cfg)?;
        let q = b.op(OpKind::Concat { axis: 0 }, &[cq, q])?;
        let k = b.op(OpKind::Concat { axis: 0 }, &[ck, k])?;
        let v = b.op(OpKind::Concat { axis: 0 }, &[cv, v])?;
        let a = b.attention(q, k, v, cos, sin, &cfg, s)?;
        let ca = b.op(
            OpKind::Slice {
                axis: 0,
                start: 0,
                len: t,
            },
            &[a],
        )?;
        let xa = b.op(
            OpKind::Slice {
                axis: 0,
                start: t,
                len: n,
            },
            &[a],
        )?;
        let xa = b.linear(grp, &format!("{pre}.attn.to_out.0"), xa, d, d)?;
        let ca = b.linear(grp, &format!("{pre}.attn.to_add_out"), ca, d, d)?;
        let xa = b.op(OpKind::Mul, &[xa, ch[2]])?;
        x = b.op(OpKind::Add, &[x, xa])?;
        let xn = b.modulate(x, ch[3], ch[4])?;
        let h = b.linear(grp, &format!("{pre}.ff.net.0.proj"), xn, 4 * d, d)?;
        let h = b.op(OpKind::GeluTanh, &[h])?;
        let h = b.linear(grp, &format!("{pre}.ff.net.2"), h, d, 4 * d)?;
        let h = b.op(OpKind::Mul, &[h, ch[5]])?;
        x = b.op(OpKind::Add, &[x, h])?;
        let ca = b.op(OpKind::Mul, &[ca, cc[2]])?;
        ctx = b.op(OpKind::Add, &[ctx, ca])?;
        let cn = b.modulate(ctx, cc[3], cc[4])?;
        let h = b.linear(grp, &format!("{pre}.ff_context.net.0.proj"), cn, 4 * d, d)?;
        let h = b.op(OpKind::GeluTanh, &[h])?;
        let h = b.linear(grp, &format!("{pre}.ff_context.net.2"), h, d, 4 * d)?;
        let h = b.op(OpKind::Mul, &[h, cc[5]])?;
        ctx = b.op(OpKind::Add, &[ctx, h])?;
    }
    let mut hs = b.op(OpKind::Concat { axis: 0 }, &[ctx, x])?;
    for i in 0..cfg.single_blocks {
        let pre = format!("single_transformer_blocks.{i}");
        require_block(model, &pre, "num_single_layers", cfg.single_blocks)?;
        let grp = b.g.group(&pre);
        let m = b.linear(grp, &format!("{pre}.norm.linear"), temb_act, 3 * d, d)?;
        let ch: Vec<ValueId> = (0..3).map(|j| b.chunk(m, j, d)).collect::<Result<_>>()?;
        let xn = b.modulate(hs, ch[0], ch[1])?;
        let mlp = b.linear(grp, &format!("{pre}.proj_mlp"), xn, 4 * d, d)?;
        let mlp = b.op(OpKind::GeluTanh, &[mlp])?;
        let q = b.head_proj(
            grp,
            &format!("{pre}.attn.to_q"),
            Some(&format!("{pre}.attn.norm_q")),
            xn,
            s,
            &cfg,
        )?;
        let k = b.head_proj(
            grp,
            &format!("{pre}.attn.to_k"),
            Some(&format!("{pre}.attn.norm_k")),
            xn,
            s,
            &cfg,
        )?;
        let v = b.head_proj(grp, &format!("{pre}.attn.to_v"), None, xn, s, &cfg)?;
        let a = b.attention(q, k, v, cos, sin, &cfg, s)?;
        let cat = b.op(OpKind::Concat { axis: 1 }, &[a, mlp])?;
        let o = b.linear(grp, &format!("{pre}.proj_out"), cat, d, 5 * d)?;
        let o = b.op(OpKind::Mul, &[o, ch[2]])?;
        hs = b.op(OpKind::Add, &[hs, o])?;
    }
    let x = b.op(
        OpKind::Slice {
            axis: 0,
            start: t,
            len: n,
        },
        &[hs],
    )?;
    let out_grp = b.g.group("norm_out");
    let m = b.linear(out_grp, "norm_out.linear", temb_act, 2 * d, d)?;
    // AdaLayerNormContinuous: scale first, then shift.
    let scale = b.chunk(m, 0, d)?;
    let shift = b.chunk(m, 1, d)?;
    let xn = b.modulate(x, shift, scale)?;
    let out = b.linear(out_grp, "proj_out", xn, cfg.out_channels, d)?;
    b.g.output(out);
    Ok(DitGraph {
        graph: b.g,
        config: cfg,
    })
}
