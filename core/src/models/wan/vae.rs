//! The decoder of diffusers' `AutoencoderKLWan` (Wan 2.1: causal 3D convolutions), decoded
//! latent frame by latent frame as diffusers' `_decode` does: the first latent frame gives one
//! video frame, every later one four. Each causal 3x3x3 (and 3x1x1) convolution keeps the last
//! two input frames it saw as planned state in the arena (zero before the first frame, like a KV
//! cache), so decoding memory does not grow with the video's length.
//!
//! Two programs share the weights and the state: `first` (latent frame 0: the temporal
//! upsamplers are skipped, one frame stays one frame) and `next` (every later latent frame).
//! Inputs: the latent frame `[z, h, w]` (already de-normalized: `latents / (1/std) + mean`) and
//! the cache position `[1]` (u32, 0). Output: the frames `[t, 3, 8h, 8w]`, not yet clamped.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::graph::{ElemType, Graph, OpKind, ValueId, ValueInfo};
use crate::io::model::ModelIndex;
use crate::models::component::Runner;
use crate::models::nn::{Attention, Names};
use crate::models::{reshape, typed_config};

/// The decoder's sizes, from `vae/config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct WanVaeConfig {
    /// Channels of the first level (`decoder_base_dim`, else `base_dim`).
    pub base_dim: usize,
    /// Latent channels (`z_dim`).
    pub z_dim: usize,
    /// `dim_mult`.
    pub dim_mult: Vec<usize>,
    /// `num_res_blocks`.
    pub num_res_blocks: usize,
    /// Per up block, whether it upsamples in time (`temperal_downsample` reversed).
    pub temporal_upsample: Vec<bool>,
    /// Output channels.
    pub out_channels: usize,
    /// `latents_mean`.
    pub latents_mean: Vec<f32>,
    /// `latents_std`.
    pub latents_std: Vec<f32>,
}

#[derive(Deserialize)]
struct File {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    base_dim: u64,
    decoder_base_dim: Option<u64>,
    z_dim: u64,
    dim_mult: Vec<u64>,
    num_res_blocks: u64,
    temperal_downsample: Vec<bool>,
    out_channels: Option<u64>,
    is_residual: Option<bool>,
    patch_size: Option<serde_json::Value>,
    latents_mean: Vec<f32>,
    latents_std: Vec<f32>,
}

impl WanVaeConfig {
    /// From the VAE's `config.json`; Wan 2.2's residual VAE and patchified latents are refused.
    pub fn of(model: &ModelIndex) -> Result<Self> {
        let (file, f): (String, File) = typed_config(model, "the Wan VAE")?;
        let bad = |msg: String| Error::Model {
            file: file.clone(),
            msg,
        };
        if let Some(c) = f.class_name.as_deref().filter(|c| *c != "AutoencoderKLWan") {
            return Err(bad(format!("_class_name {c} is not AutoencoderKLWan")));
        }
        if f.is_residual == Some(true) || f.patch_size.as_ref().is_some_and(|p| !p.is_null()) {
            return Err(bad(
                "is_residual / patch_size: Wan 2.2's VAE is not supported (Wan 2.1's is)".into(),
            ));
        }
        let pos = |field: &str, v: u64| crate::format::json::positive(&file, field, v);
        let z_dim = pos("z_dim", f.z_dim)?;
        if f.dim_mult.is_empty() || f.temperal_downsample.len() + 1 != f.dim_mult.len() {
            return Err(bad(format!(
                "dim_mult {:?} and temperal_downsample {:?}: one more multiplier than downsamples",
                f.dim_mult, f.temperal_downsample
            )));
        }
        if f.latents_mean.len() != z_dim || f.latents_std.len() != z_dim {
            return Err(bad(format!(
                "latents_mean / latents_std: {z_dim} values each"
            )));
        }
        if f.latents_std.iter().any(|s| !(s.is_finite() && *s != 0.0)) {
            return Err(bad("latents_std: finite, non-zero values".into()));
        }
        Ok(WanVaeConfig {
            base_dim: pos("base_dim", f.decoder_base_dim.unwrap_or(f.base_dim))?,
            z_dim,
            dim_mult: f
                .dim_mult
                .iter()
                .map(|&m| pos("dim_mult", m))
                .collect::<Result<_>>()?,
            num_res_blocks: pos("num_res_blocks", f.num_res_blocks)?,
            temporal_upsample: f.temperal_downsample.iter().rev().copied().collect(),
            out_channels: pos("out_channels", f.out_channels.unwrap_or(3))?,
            latents_mean: f.latents_mean,
            latents_std: f.latents_std,
        })
    }

    /// The spatial upsampling (2 per upsampling block).
    pub fn spatial_scale(&self) -> usize {
        1 << (self.dim_mult.len() - 1)
    }

    /// Video frames of `latent_frames` latent frames: 1, then 2^(temporal upsamplers) each.
    pub fn frames(&self, latent_frames: usize) -> usize {
        let per = 1usize << self.temporal_upsample.iter().filter(|&&t| t).count();
        if latent_frames == 0 {
            0
        } else {
            1 + per * (latent_frames - 1)
        }
    }

    /// The decoder's input from the pipeline's latents `[z, ...]`: `latents / (1/std) + mean`
    /// per channel, in float32, as `WanPipeline` computes it.
    pub fn decoder_input(&self, latents: &[f32]) -> Vec<f32> {
        let per = latents.len() / self.z_dim.max(1);
        latents
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let c = i / per.max(1);
                v / (1.0 / self.latents_std[c]) + self.latents_mean[c]
            })
            .collect()
    }
}

/// A chunk's frames, each `[c, h, w]`, at one size.
#[derive(Clone)]
struct Frames {
    f: Vec<ValueId>,
    c: usize,
    h: usize,
    w: usize,
}

struct Builder<'a> {
    g: Graph,
    model: &'a ModelIndex,
    /// The cache position input (0).
    pos: ValueId,
    /// The per-conv caches, in declaration order (shared by both programs).
    caches: Vec<ValueId>,
    /// The next cache a causal conv takes, in this program.
    next_cache: usize,
    /// Per conv name: its weight's temporal taps in the current program.
    taps: std::collections::HashMap<String, (Vec<ValueId>, Option<ValueId>)>,
    /// Per tensor: its dense weight value, declared once for both programs (a group loads a
    /// tensor into one value).
    dense: std::collections::HashMap<String, ValueId>,
}

impl Builder<'_> {
    fn op(&mut self, op: OpKind, inputs: &[ValueId]) -> Result<ValueId> {
        self.g.op(op, inputs, None)
    }

    /// The dense weight `name` of group `grp`, declared once.
    fn dense(&mut self, grp: usize, name: &str, shape: &[usize]) -> ValueId {
        if let Some(&v) = self.dense.get(name) {
            return v;
        }
        let v = self.g.dense_weight(grp, name, shape);
        self.dense.insert(name.to_string(), v);
        v
    }

    /// The temporal taps `[out, in, k, k]` of conv `name` (weight `[out, in, kt, k, k]` or
    /// `[out, in, k, k]`) and its bias.
    fn taps(
        &mut self,
        grp: usize,
        name: &str,
        (cout, cin, kt, k): (usize, usize, usize, usize),
    ) -> Result<(Vec<ValueId>, Option<ValueId>)> {
        if let Some(t) = self.taps.get(name) {
            return Ok(t.clone());
        }
        let w = self.dense(grp, &format!("{name}.weight"), &[cout, cin, kt, k * k]);
        let bias = format!("{name}.bias");
        let b = self
            .model
            .get(&bias)
            .is_some()
            .then(|| self.dense(grp, &bias, &[cout]));
        let mut taps = Vec::with_capacity(kt);
        for dt in 0..kt {
            let s = if kt == 1 {
                w
            } else {
                self.op(
                    OpKind::Slice {
                        axis: 2,
                        start: dt,
                        len: 1,
                    },
                    &[w],
                )?
            };
            taps.push(reshape(&mut self.g, s, &[cout, cin, k, k])?);
        }
        self.taps.insert(name.to_string(), (taps.clone(), b));
        Ok((taps, b))
    }

    /// `Conv2d` of one frame (zero padding `(k - 1) / 2`), with the bias where given.
    fn conv2d(&mut self, x: ValueId, w: ValueId, b: Option<ValueId>, k: usize) -> Result<ValueId> {
        let mut ins = vec![x, w];
        ins.extend(b);
        self.op(
            OpKind::Conv2d {
                kernel: k,
                pad: (k - 1) / 2,
                bias: b.is_some(),
            },
            &ins,
        )
    }

    /// A causal convolution (`WanCausalConv3d`) of the chunk: kernel `kt` in time (1 or 3),
    /// `k` in space. With `kt` 3 each output frame sums the taps over the two frames before it
    /// and itself, the two before the chunk coming from the conv's cache, which then keeps the
    /// last two frames of (cache, chunk).
    fn causal_conv(
        &mut self,
        grp: usize,
        name: &str,
        x: &Frames,
        cout: usize,
        (kt, k): (usize, usize),
    ) -> Result<Frames> {
        let (taps, b) = self.taps(grp, name, (cout, x.c, kt, k))?;
        if kt == 1 {
            let f =
                x.f.iter()
                    .map(|&fr| self.conv2d(fr, taps[0], b, k))
                    .collect::<Result<_>>()?;
            return Ok(Frames { f, c: cout, ..*x });
        }
        let plane = x.c * x.h * x.w;
        let cache = match self.caches.get(self.next_cache) {
            Some(&c) => c,
            None => {
                let c = self.g.state(ValueInfo::f32(&[1, 2, plane]));
                self.caches.push(c);
                c
            }
        };
        if self.g.info(cache).shape != [1, 2, plane] {
            return Err(Error::Invalid(format!(
                "{name}: the first and later frames' graphs disagree on the cache size"
            )));
        }
        self.next_cache += 1;
        let mut p = Vec::with_capacity(x.f.len() + 2);
        for r in 0..2 {
            let s = self.op(
                OpKind::Slice {
                    axis: 1,
                    start: r,
                    len: 1,
                },
                &[cache],
            )?;
            p.push(reshape(&mut self.g, s, &[x.c, x.h, x.w])?);
        }
        p.extend(x.f.iter().copied());
        let mut out = Vec::with_capacity(x.f.len());
        for t in 0..x.f.len() {
            let mut acc = self.conv2d(p[t], taps[0], b, k)?;
            for dt in 1..kt {
                let y = self.conv2d(p[t + dt], taps[dt], None, k)?;
                acc = self.op(OpKind::Add, &[acc, y])?;
            }
            out.push(acc);
        }
        let n = p.len();
        let a = reshape(&mut self.g, p[n - 2], &[1, plane])?;
        let c = reshape(&mut self.g, p[n - 1], &[1, plane])?;
        let last = self.op(OpKind::Concat { axis: 0 }, &[a, c])?;
        let last = reshape(&mut self.g, last, &[1, 2, plane])?;
        self.op(OpKind::CacheWrite, &[cache, last, self.pos])?;
        Ok(Frames {
            f: out,
            c: cout,
            ..*x
        })
    }

    /// `WanRMS_norm` over the channels at every position: `x / ‖x‖ · sqrt(C) · gamma`.
    fn rms(&mut self, grp: usize, name: &str, x: &Frames) -> Result<Frames> {
        let gamma = self.dense(grp, &format!("{name}.gamma"), &[x.c]);
        let hw = x.h * x.w;
        // F.normalize clamps the norm at 1e-12: the mean of squares at 1e-24 / C.
        let eps = 1e-24 / x.c as f32;
        let mut f = Vec::with_capacity(x.f.len());
        for &fr in &x.f {
            let y = reshape(&mut self.g, fr, &[x.c, hw])?;
            let y = self.op(OpKind::Permute { perm: vec![1, 0] }, &[y])?;
            let y = self.op(OpKind::RmsNorm { eps }, &[y, gamma])?;
            let y = self.op(OpKind::Permute { perm: vec![1, 0] }, &[y])?;
            f.push(reshape(&mut self.g, y, &[x.c, x.h, x.w])?);
        }
        Ok(Frames { f, ..x.clone() })
    }

    fn each(&mut self, x: &Frames, op: OpKind) -> Result<Frames> {
        let f =
            x.f.iter()
                .map(|&fr| self.op(op.clone(), &[fr]))
                .collect::<Result<_>>()?;
        Ok(Frames { f, ..x.clone() })
    }

    fn add(&mut self, a: &Frames, b: &Frames) -> Result<Frames> {
        let f =
            a.f.iter()
                .zip(&b.f)
                .map(|(&x, &y)| self.op(OpKind::Add, &[x, y]))
                .collect::<Result<_>>()?;
        Ok(Frames { f, ..a.clone() })
    }

    /// `WanResidualBlock`: norm, SiLU, causal conv, norm, SiLU, causal conv, plus the input (a
    /// 1x1x1 conv of it where the width changes).
    fn resnet(&mut self, grp: usize, name: &Names, x: &Frames, cout: usize) -> Result<Frames> {
        let h = if x.c != cout {
            self.causal_conv(grp, &name.name("conv_shortcut"), x, cout, (1, 1))?
        } else {
            x.clone()
        };
        let y = self.rms(grp, &name.name("norm1"), x)?;
        let y = self.each(&y, OpKind::Silu)?;
        let y = self.causal_conv(grp, &name.name("conv1"), &y, cout, (3, 3))?;
        let y = self.rms(grp, &name.name("norm2"), &y)?;
        let y = self.each(&y, OpKind::Silu)?;
        let y = self.causal_conv(grp, &name.name("conv2"), &y, cout, (3, 3))?;
        self.add(&y, &h)
    }

    /// `WanAttentionBlock`: single-head attention within each frame over its positions.
    fn attention(&mut self, grp: usize, name: &Names, x: &Frames) -> Result<Frames> {
        let (c, hw) = (x.c, x.h * x.w);
        let n = self.rms(grp, &name.name("norm"), x)?;
        let (qkv, qkv_b) = self.taps(grp, &name.name("to_qkv"), (3 * c, c, 1, 1))?;
        let (proj, proj_b) = self.taps(grp, &name.name("proj"), (c, c, 1, 1))?;
        let mut f = Vec::with_capacity(x.f.len());
        for (&fr, &id) in n.f.iter().zip(&x.f) {
            let y = self.conv2d(fr, qkv[0], qkv_b, 1)?;
            let y = reshape(&mut self.g, y, &[3 * c, hw])?;
            let y = self.op(OpKind::Permute { perm: vec![1, 0] }, &[y])?; // [hw, 3c]
            let part = |i: usize, b: &mut Self| -> Result<ValueId> {
                let s = b.op(
                    OpKind::Slice {
                        axis: 1,
                        start: i * c,
                        len: c,
                    },
                    &[y],
                )?;
                reshape(&mut b.g, s, &[1, hw, c])
            };
            let (q, k, v) = (part(0, self)?, part(1, self)?, part(2, self)?);
            let a = Attention {
                unfused: true,
                ..Attention::scaled(c)
            }
            .apply(&mut self.g, q, k, v)?;
            let a = reshape(&mut self.g, a, &[hw, c])?;
            let a = self.op(OpKind::Permute { perm: vec![1, 0] }, &[a])?;
            let a = reshape(&mut self.g, a, &[c, x.h, x.w])?;
            let a = self.conv2d(a, proj[0], proj_b, 1)?;
            f.push(self.op(OpKind::Add, &[a, id])?);
        }
        Ok(Frames { f, ..x.clone() })
    }

    /// `WanResample` upsampling: in 3D (`time`), the causal time conv doubles the frames (its
    /// output's two channel halves are consecutive frames; skipped in the first program), then
    /// every frame is upsampled 2x (nearest) and convolved 3x3 to half the channels.
    fn upsample(
        &mut self,
        grp: usize,
        name: &Names,
        x: &Frames,
        time: bool,
        first: bool,
    ) -> Result<Frames> {
        let mut x = x.clone();
        if time {
            let tc = name.name("time_conv");
            if first {
                // The first latent frame does not reach the time conv; it still owns a cache.
                self.reserve_cache(x.c * x.h * x.w);
            } else {
                let y = self.causal_conv(grp, &tc, &x, 2 * x.c, (3, 1))?;
                let mut f = Vec::with_capacity(2 * y.f.len());
                for &fr in &y.f {
                    for half in 0..2 {
                        f.push(self.op(
                            OpKind::Slice {
                                axis: 0,
                                start: half * x.c,
                                len: x.c,
                            },
                            &[fr],
                        )?);
                    }
                }
                x = Frames { f, ..x };
            }
        }
        let cout = x.c / 2;
        let (w, b) = self.taps(grp, &name.name("resample.1"), (cout, x.c, 1, 3))?;
        let mut f = Vec::with_capacity(x.f.len());
        for &fr in &x.f {
            let u = self.op(OpKind::Upsample2x, &[fr])?;
            f.push(self.conv2d(u, w[0], b, 3)?);
        }
        Ok(Frames {
            f,
            c: cout,
            h: 2 * x.h,
            w: 2 * x.w,
        })
    }

    /// Takes the next cache without using it (the first program's skipped time conv), so that
    /// both programs number their caches alike.
    fn reserve_cache(&mut self, plane: usize) {
        if self.caches.len() <= self.next_cache {
            let c = self.g.state(ValueInfo::f32(&[1, 2, plane]));
            self.caches.push(c);
        }
        self.next_cache += 1;
    }
}

/// The decoder's graph for latent frames of `h x w` (both programs).
pub fn build(model: &ModelIndex, h: usize, w: usize) -> Result<(Graph, WanVaeConfig)> {
    let cfg = WanVaeConfig::of(model)?;
    if h == 0 || w == 0 || h > 1 << 14 || w > 1 << 14 {
        return Err(Error::Invalid(format!(
            "a Wan VAE graph for {h} x {w} latents"
        )));
    }
    let mut b = Builder {
        g: Graph::new(),
        model,
        pos: ValueId(0),
        caches: Vec::new(),
        next_cache: 0,
        taps: Default::default(),
        dense: Default::default(),
    };
    let top = b.g.group("vae.decoder.conv_in");
    let mid = b.g.group("vae.decoder.mid_block");
    let ups: Vec<usize> = (0..cfg.dim_mult.len())
        .map(|i| b.g.group(&format!("vae.decoder.up_blocks.{i}")))
        .collect();
    let head = b.g.group("vae.decoder.head");
    let dims: Vec<usize> = std::iter::once(cfg.dim_mult[cfg.dim_mult.len() - 1])
        .chain(cfg.dim_mult.iter().rev().copied())
        .map(|m| cfg.base_dim * m)
        .collect();
    for (p, first) in [("first", true), ("next", false)] {
        b.g.program(p);
        b.next_cache = 0;
        // A program computes its own values: the weights' taps are sliced again.
        b.taps.clear();
        let z = b.g.input(ValueInfo::f32(&[cfg.z_dim, h, w]));
        b.pos = b.g.input(ValueInfo {
            shape: vec![1],
            elem: ElemType::U32,
        });
        let x = Frames {
            f: vec![z],
            c: cfg.z_dim,
            h,
            w,
        };
        let x = b.causal_conv(top, "post_quant_conv", &x, cfg.z_dim, (1, 1))?;
        let dec = Names::new("decoder");
        let mut x = b.causal_conv(top, &dec.name("conv_in"), &x, dims[0], (3, 3))?;
        let m = dec.pp("mid_block");
        x = b.resnet(mid, &m.pp("resnets.0"), &x, dims[0])?;
        x = b.attention(mid, &m.pp("attentions.0"), &x)?;
        x = b.resnet(mid, &m.pp("resnets.1"), &x, dims[0])?;
        let levels = cfg.dim_mult.len();
        for i in 0..levels {
            let (mut cin, cout) = (dims[i], dims[i + 1]);
            if i > 0 {
                cin /= 2;
            }
            if x.c != cin {
                return Err(Error::Invalid(format!(
                    "Wan VAE up block {i}: {} channels in, {cin} expected",
                    x.c
                )));
            }
            let u = dec.pp(format!("up_blocks.{i}"));
            for r in 0..=cfg.num_res_blocks {
                x = b.resnet(ups[i], &u.pp(format!("resnets.{r}")), &x, cout)?;
            }
            if i + 1 != levels {
                let time = cfg.temporal_upsample.get(i).copied().unwrap_or(false);
                x = b.upsample(ups[i], &u.pp("upsamplers.0"), &x, time, first)?;
            }
        }
        let y = b.rms(head, &dec.name("norm_out"), &x)?;
        let y = b.each(&y, OpKind::Silu)?;
        let y = b.causal_conv(head, &dec.name("conv_out"), &y, cfg.out_channels, (3, 3))?;
        // The frames stacked: [t, out, H, W].
        let mut stacked = None;
        for &fr in &y.f {
            let one = reshape(&mut b.g, fr, &[1, y.c, y.h, y.w])?;
            stacked = Some(match stacked {
                None => one,
                Some(s) => b.op(OpKind::Concat { axis: 0 }, &[s, one])?,
            });
        }
        let out = stacked.ok_or_else(|| Error::Invalid("the VAE decoded no frame".into()))?;
        b.g.output(out);
    }
    Ok((b.g, cfg))
}

/// The Wan VAE's decoder bound to a backend, for latent frames of one size: latent frames go in
/// one at a time, in order; the caches carry what the next one needs.
pub struct WanVaeDecoder<B: crate::backend::Backend> {
    run: Runner<B>,
    cfg: WanVaeConfig,
    dims: (usize, usize),
    next_frame: usize,
    streamed: u64,
}

impl<B: crate::backend::Backend> std::fmt::Debug for WanVaeDecoder<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WanVaeDecoder")
            .field("latent", &self.dims)
            .field("next_frame", &self.next_frame)
            .finish()
    }
}

impl<B: crate::backend::Backend> WanVaeDecoder<B> {
    /// Plans and allocates the decoder for `h x w` latent frames and loads its resident weights.
    #[cfg(feature = "native")]
    pub fn new(
        model: &ModelIndex,
        backend: B,
        dims: (usize, usize),
        opts: crate::exec::ExecOptions,
    ) -> Result<Self> {
        crate::io::folder::block_on(Self::open(
            model,
            backend,
            dims,
            opts,
            &crate::models::Drive::Blocking,
        ))
    }

    /// [`WanVaeDecoder::new`], reading as `drive` says (the browser awaits).
    pub async fn open(
        model: &ModelIndex,
        backend: B,
        (h, w): (usize, usize),
        opts: crate::exec::ExecOptions,
        drive: &crate::models::Drive<'_>,
    ) -> Result<Self> {
        let (graph, cfg) = build(model, h, w)?;
        Ok(WanVaeDecoder {
            run: Runner::open(graph, model, backend, opts, drive).await?,
            cfg,
            dims: (h, w),
            next_frame: 0,
            streamed: 0,
        })
    }

    /// Weight bytes streamed so far.
    pub fn bytes_streamed(&self) -> u64 {
        self.streamed
    }

    /// The backend back, its device memory released.
    pub fn into_backend(self) -> B {
        self.run.into_backend()
    }

    /// The executor (plan, backend).
    pub fn executor(&self) -> &crate::exec::Executor<B> {
        &self.run.ex
    }

    /// The configuration.
    pub fn config(&self) -> &WanVaeConfig {
        &self.cfg
    }

    /// Decodes the next latent frame `[z, h, w]` (de-normalized): its video frames
    /// `[t, out, 8h, 8w]` (1 for the first latent frame, 4 after), not clamped.
    #[cfg(feature = "native")]
    pub fn decode_frame(&mut self, z: &[f32]) -> Result<(Vec<f32>, crate::exec::ExecStats)> {
        crate::io::folder::block_on(self.decode_frame_async(z))
    }

    /// [`WanVaeDecoder::decode_frame`], awaiting the result on an event loop.
    pub async fn decode_frame_async(
        &mut self,
        z: &[f32],
    ) -> Result<(Vec<f32>, crate::exec::ExecStats)> {
        let (h, w) = self.dims;
        let p = if self.next_frame == 0 {
            "first"
        } else {
            "next"
        };
        let prog = self
            .run
            .ex
            .graph()
            .program_index(p)
            .ok_or_else(|| Error::Invalid(format!("the Wan VAE graph has no program {p}")))?;
        let inputs = [
            crate::graph::HostTensor::f32(&[self.cfg.z_dim, h, w], z.to_vec())?,
            crate::graph::HostTensor::u32(&[1], vec![0])?,
        ];
        let what = format!("the VAE's frames of latent frame {}", self.next_frame);
        let (v, stats) = self.run.run_program(prog, &inputs, &what).await?;
        self.streamed += stats.stream.bytes;
        self.next_frame += 1;
        Ok((v, stats))
    }

    /// Decodes a whole latent video `[z, f, h, w]` (de-normalized) frame by frame into the
    /// video `[out, frames, 8h, 8w]`, clamped to [-1, 1] as diffusers' `decode` returns it; the
    /// caches start from zero.
    #[cfg(feature = "native")]
    pub fn decode(&mut self, z: &[f32]) -> Result<Vec<f32>> {
        crate::io::folder::block_on(self.decode_async(z))
    }

    /// [`WanVaeDecoder::decode`], awaiting the frames on an event loop.
    pub async fn decode_async(&mut self, z: &[f32]) -> Result<Vec<f32>> {
        let mut video = self.decode_unclamped(z).await?;
        for v in &mut video {
            *v = v.clamp(-1.0, 1.0);
        }
        Ok(video)
    }

    /// [`WanVaeDecoder::decode_async`] without the clamp (a tiled decode blends the tiles first).
    pub async fn decode_unclamped(&mut self, z: &[f32]) -> Result<Vec<f32>> {
        let video = self.decode_each(z, true, &mut |_, _| {}).await?;
        Ok(video.unwrap_or_default())
    }

    /// [`WanVaeDecoder::decode_unclamped`], handing each latent frame's video frames to `on`
    /// as they are decoded (the first one's index and `[t, out, 8h, 8w]`, not clamped); the
    /// whole video is kept and returned only with `keep` (without it, memory does not grow with
    /// the video's length).
    pub async fn decode_each(
        &mut self,
        z: &[f32],
        keep: bool,
        on: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<Option<Vec<f32>>> {
        let (h, w) = self.dims;
        let plane = h * w;
        let zc = self.cfg.z_dim;
        if z.is_empty() || !z.len().is_multiple_of(zc * plane) {
            return Err(Error::Invalid(format!(
                "{} latent values are not frames of {zc} x {h} x {w}",
                z.len()
            )));
        }
        let frames = z.len() / (zc * plane);
        self.run.ex.reset_state()?;
        self.next_frame = 0;
        // No read runs ahead into a frame that will not come.
        self.run.ex.limit_stream_passes(frames as u64);
        let s = self.cfg.spatial_scale();
        let (oh, ow, oc) = (h * s, w * s, self.cfg.out_channels);
        let total = self.cfg.frames(frames);
        let mut video = keep.then(|| vec![0f32; oc * total * oh * ow]);
        let mut at = 0;
        for f in 0..frames {
            let frame: Vec<f32> = (0..zc)
                .flat_map(|c| {
                    let start = (c * frames + f) * plane;
                    z[start..start + plane].iter().copied()
                })
                .collect();
            let (out, _) = self.decode_frame_async(&frame).await?;
            let t = out.len() / (oc * oh * ow);
            on(at, &out);
            if let Some(video) = &mut video {
                for k in 0..t {
                    for c in 0..oc {
                        let src = &out[(k * oc + c) * oh * ow..(k * oc + c + 1) * oh * ow];
                        let dst = (c * total + at + k) * oh * ow;
                        video[dst..dst + oh * ow].copy_from_slice(src);
                    }
                }
            }
            at += t;
        }
        Ok(video)
    }
}

/// The 8-bit frames `[t, h, w, c]` of a decoded video `[c, t, h, w]` (in [-1, 1]): as
/// `WanPipeline`'s `frames[0]` (`clamp(v · 0.5 + 0.5, 0, 1)`, channels last) rounded half to
/// even after `· 255`, as `output_type='pil'` and `encode_video` do it.
pub fn frames_u8(video: &[f32], (c, t, h, w): (usize, usize, usize, usize)) -> Result<Vec<u8>> {
    if video.len() != c * t * h * w {
        return Err(Error::Invalid(format!(
            "{} video values for {c} x {t} x {h} x {w}",
            video.len()
        )));
    }
    let mut out = vec![0u8; video.len()];
    for ch in 0..c {
        for f in 0..t {
            for i in 0..h * w {
                out[(f * h * w + i) * c + ch] = pixel_u8(video[(ch * t + f) * h * w + i]);
            }
        }
    }
    Ok(out)
}

/// One decoded value (clamped to [-1, 1] first, as `decode` returns it) as an 8-bit pixel:
/// `clamp(v · 0.5 + 0.5, 0, 1) · 255` rounded half to even.
fn pixel_u8(v: f32) -> u8 {
    let v = (v.clamp(-1.0, 1.0) * 0.5 + 0.5).clamp(0.0, 1.0);
    (v * 255.0).round_ties_even() as u8
}

/// The 8-bit frames `[t, h, w, c]` of decoded frames as the decoder gives them (`[t, c, h, w]`,
/// not clamped): [`frames_u8`] of the clamped video, without a float copy.
pub fn chunk_u8(chunk: &[f32], (t, c, h, w): (usize, usize, usize, usize)) -> Result<Vec<u8>> {
    if chunk.len() != t * c * h * w {
        return Err(Error::Invalid(format!(
            "{} frame values for {t} x {c} x {h} x {w}",
            chunk.len()
        )));
    }
    let mut out = vec![0u8; chunk.len()];
    for f in 0..t {
        for ch in 0..c {
            for i in 0..h * w {
                out[(f * h * w + i) * c + ch] = pixel_u8(chunk[(f * c + ch) * h * w + i]);
            }
        }
    }
    Ok(out)
}
