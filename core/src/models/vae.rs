//! The decoder of diffusers' `AutoencoderKL` (Flux's `vae/`) on the core graph: `conv_in`, the
//! mid block (resnet, single-head spatial self-attention, resnet), the up blocks (each
//! `layers_per_block + 1` resnets, all but the last ending in nearest 2x upsampling and a 3x3
//! convolution), then group norm, SiLU and `conv_out`. Resnets are group norm, SiLU, 3x3
//! convolution, twice, plus the input (through a 1x1 `conv_shortcut` where the channel count
//! changes). Also the pipeline's two ends: latents to the decoder's input
//! (`latents / scaling_factor + shift_factor`) and its output to 8-bit RGB as diffusers'
//! `VaeImageProcessor` makes it.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::exec::{ExecOptions, ExecStats};
use crate::format::json::positive;
use crate::graph::{Graph, HostTensor, OpKind, ValueId, ValueInfo};
use crate::io::model::ModelIndex;
use crate::models::component::{Component, ComponentKind};
use crate::models::nn::Attention;
use crate::models::{reshape, typed_config, Drive, W};

/// What the decoder needs of `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct VaeConfig {
    /// `latent_channels`.
    pub latent_channels: usize,
    /// `out_channels` (3).
    pub out_channels: usize,
    /// `block_out_channels`.
    pub block_out_channels: Vec<usize>,
    /// `layers_per_block`.
    pub layers_per_block: usize,
    /// `norm_num_groups`.
    pub norm_groups: usize,
    /// `scaling_factor`.
    pub scaling_factor: f32,
    /// `shift_factor` (0 when absent).
    pub shift_factor: f32,
    /// `mid_block_add_attention`.
    pub mid_attention: bool,
    /// `sample_size` (pixels; diffusers' default image tile), when given.
    pub sample_size: Option<usize>,
}

#[derive(Deserialize)]
struct File {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    latent_channels: u64,
    out_channels: Option<u64>,
    block_out_channels: Vec<u64>,
    layers_per_block: u64,
    norm_num_groups: Option<u64>,
    scaling_factor: f64,
    shift_factor: Option<f64>,
    use_post_quant_conv: Option<bool>,
    mid_block_add_attention: Option<bool>,
    up_block_types: Option<Vec<String>>,
    act_fn: Option<String>,
    sample_size: Option<serde_json::Value>,
}

impl VaeConfig {
    /// From the VAE's `config.json`; a decoder nibble does not compute (post-quant
    /// convolution, other block types or activations) is refused naming the field.
    pub fn of(model: &ModelIndex) -> Result<Self> {
        let (file, f): (String, File) = typed_config(model, "a VAE")?;
        let bad = |field: &str, msg: String| Error::Model {
            file: file.clone(),
            msg: format!("{field}: {msg}"),
        };
        if let Some(c) = f.class_name.as_deref().filter(|c| *c != "AutoencoderKL") {
            return Err(bad(
                "_class_name",
                format!("{c} is not supported (AutoencoderKL)"),
            ));
        }
        if f.use_post_quant_conv == Some(true) {
            return Err(bad(
                "use_post_quant_conv",
                "true is not supported yet (Flux's VAE has none)".into(),
            ));
        }
        if let Some(t) = f
            .up_block_types
            .iter()
            .flatten()
            .find(|t| *t != "UpDecoderBlock2D")
        {
            return Err(bad("up_block_types", format!("{t} is not supported")));
        }
        if let Some(a) = f.act_fn.as_deref().filter(|a| *a != "silu") {
            return Err(bad("act_fn", format!("{a} is not supported (silu)")));
        }
        let chans = f
            .block_out_channels
            .iter()
            .map(|&c| positive(&file, "block_out_channels", c))
            .collect::<Result<Vec<_>>>()?;
        if chans.is_empty() || chans.len() > 8 {
            return Err(bad("block_out_channels", format!("{} blocks", chans.len())));
        }
        let norm_groups = positive(&file, "norm_num_groups", f.norm_num_groups.unwrap_or(32))?;
        if let Some(c) = chans.iter().find(|&&c| c % norm_groups != 0) {
            return Err(bad(
                "norm_num_groups",
                format!("{norm_groups} groups do not divide {c} channels"),
            ));
        }
        let finite = |field: &str, v: f64| -> Result<f32> {
            if v.is_finite() && v.abs() < 1e6 {
                Ok(v as f32)
            } else {
                Err(bad(field, format!("{v} is not a usable number")))
            }
        };
        let scaling_factor = finite("scaling_factor", f.scaling_factor)?;
        if scaling_factor == 0.0 {
            return Err(bad("scaling_factor", "0 divides by zero".into()));
        }
        Ok(VaeConfig {
            latent_channels: positive(&file, "latent_channels", f.latent_channels)?,
            out_channels: positive(&file, "out_channels", f.out_channels.unwrap_or(3))?,
            layers_per_block: positive(&file, "layers_per_block", f.layers_per_block)?,
            block_out_channels: chans,
            norm_groups,
            scaling_factor,
            shift_factor: finite("shift_factor", f.shift_factor.unwrap_or(0.0))?,
            mid_attention: f.mid_block_add_attention.unwrap_or(true),
            // An int or a [height, width] list (diffusers takes the first).
            sample_size: match &f.sample_size {
                Some(serde_json::Value::Array(a)) => a.first().and_then(|v| v.as_u64()),
                Some(v) => v.as_u64(),
                None => None,
            }
            .filter(|&s| (1..=1 << 16).contains(&s))
            .map(|s| s as usize),
        })
    }

    /// Pixels per latent position along each side: `2^(blocks - 1)`.
    pub fn scale_factor(&self) -> usize {
        1 << (self.block_out_channels.len() - 1)
    }

    /// diffusers' default tiling: latent tiles of `sample_size / f` positions (64 when the
    /// config has no sample size), overlap 0.25.
    pub fn default_tiling(&self) -> Tiling {
        Tiling {
            latent_tile: (self.sample_size.unwrap_or(64 * self.scale_factor())
                / self.scale_factor())
            .max(1),
            overlap: 0.25,
        }
    }
}

/// Builds the graph pieces with the weights of one group.
struct Blocks<'a> {
    g: Graph,
    model: &'a ModelIndex,
    groups: usize,
}

impl Blocks<'_> {
    fn dense(&mut self, grp: usize, name: &str, shape: &[usize]) -> Result<ValueId> {
        let e = self.model.require(name)?;
        let want: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        if e.shape != want {
            return Err(Error::Model {
                file: self.model.root.clone(),
                msg: format!("{name} is {:?}, the config says {shape:?}", e.shape),
            });
        }
        Ok(self.g.dense_weight(grp, name, shape))
    }

    fn conv(
        &mut self,
        grp: usize,
        name: &str,
        x: ValueId,
        cin: usize,
        cout: usize,
        k: usize,
    ) -> Result<ValueId> {
        let w = self.dense(grp, &format!("{name}.weight"), &[cout, cin, k, k])?;
        let b = self.dense(grp, &format!("{name}.bias"), &[cout])?;
        self.g.op(
            OpKind::Conv2d {
                kernel: k,
                pad: k / 2,
                bias: true,
            },
            &[x, w, b],
            None,
        )
    }

    fn norm(&mut self, grp: usize, name: &str, x: ValueId, c: usize) -> Result<ValueId> {
        let w = self.dense(grp, &format!("{name}.weight"), &[c])?;
        let b = self.dense(grp, &format!("{name}.bias"), &[c])?;
        self.g.op(
            OpKind::GroupNorm {
                groups: self.groups,
                eps: 1e-6,
            },
            &[x, w, b],
            None,
        )
    }

    fn resnet(
        &mut self,
        grp: usize,
        p: &str,
        x: ValueId,
        cin: usize,
        cout: usize,
    ) -> Result<ValueId> {
        let h = self.norm(grp, &format!("{p}.norm1"), x, cin)?;
        let h = self.g.op(OpKind::Silu, &[h], None)?;
        let h = self.conv(grp, &format!("{p}.conv1"), h, cin, cout, 3)?;
        let h = self.norm(grp, &format!("{p}.norm2"), h, cout)?;
        let h = self.g.op(OpKind::Silu, &[h], None)?;
        let h = self.conv(grp, &format!("{p}.conv2"), h, cout, cout, 3)?;
        let skip = if cin != cout {
            self.conv(grp, &format!("{p}.conv_shortcut"), x, cin, cout, 1)?
        } else {
            x
        };
        self.g.op(OpKind::Add, &[skip, h], None)
    }

    /// `x · Wᵀ + b` with the `[c, c]` weight `name.weight` and its bias.
    fn linear(&mut self, grp: usize, name: &str, x: ValueId, c: usize) -> Result<ValueId> {
        let w = W::load(
            &mut self.g,
            self.model,
            grp,
            &format!("{name}.weight"),
            c,
            c,
        )?;
        w.apply(&mut self.g, x)
    }

    /// Single-head self-attention over the `h * w` positions, with a residual.
    fn attention(
        &mut self,
        grp: usize,
        p: &str,
        x: ValueId,
        c: usize,
        hw: usize,
    ) -> Result<ValueId> {
        let y = self.norm(grp, &format!("{p}.group_norm"), x, c)?;
        let y = reshape(&mut self.g, y, &[c, hw])?;
        let y = self
            .g
            .op(OpKind::Permute { perm: vec![1, 0] }, &[y], None)?; // [hw, c]
        let q = self.linear(grp, &format!("{p}.to_q"), y, c)?;
        let k = self.linear(grp, &format!("{p}.to_k"), y, c)?;
        let v = self.linear(grp, &format!("{p}.to_v"), y, c)?;
        let (q, k, v) = (
            reshape(&mut self.g, q, &[1, hw, c])?,
            reshape(&mut self.g, k, &[1, hw, c])?,
            reshape(&mut self.g, v, &[1, hw, c])?,
        );
        // Scores through matmul and softmax: the width (the channel count, 512 in Flux's VAE)
        // is more than the fused attention kernels take.
        let a = Attention {
            unfused: true,
            ..Attention::scaled(c)
        }
        .apply(&mut self.g, q, k, v)?;
        let a = reshape(&mut self.g, a, &[hw, c])?;
        let a = self.linear(grp, &format!("{p}.to_out.0"), a, c)?;
        let a = self
            .g
            .op(OpKind::Permute { perm: vec![1, 0] }, &[a], None)?; // [c, hw]
        let a = reshape(&mut self.g, a, &[c, hw])?;
        let xs = reshape(&mut self.g, x, &[c, hw])?;
        self.g.op(OpKind::Add, &[a, xs], None)
    }
}

/// The decoder's graph for a `[latent_channels, h, w]` latent (one image): input that latent
/// (already scaled and shifted), output the image `[out_channels, h * f, w * f]`.
pub fn build(model: &ModelIndex, h: usize, w: usize) -> Result<(Graph, VaeConfig)> {
    let cfg = VaeConfig::of(model)?;
    if h == 0 || w == 0 || h > 1 << 12 || w > 1 << 12 {
        return Err(Error::Invalid(format!("VAE graph: a {h} x {w} latent")));
    }
    let mut b = Blocks {
        g: Graph::new(),
        model,
        groups: cfg.norm_groups,
    };
    let chans: Vec<usize> = cfg.block_out_channels.iter().rev().copied().collect();
    let z = b.g.input(ValueInfo::f32(&[cfg.latent_channels, h, w]));
    let grp = b.g.group("decoder.mid_block");
    let mut x = b.conv(grp, "decoder.conv_in", z, cfg.latent_channels, chans[0], 3)?;
    let c = chans[0];
    x = b.resnet(grp, "decoder.mid_block.resnets.0", x, c, c)?;
    if cfg.mid_attention {
        x = b.attention(grp, "decoder.mid_block.attentions.0", x, c, h * w)?;
        x = reshape(&mut b.g, x, &[c, h, w])?;
    }
    x = b.resnet(grp, "decoder.mid_block.resnets.1", x, c, c)?;
    let (mut cur, mut hh, mut ww) = (c, h, w);
    for (i, &out) in chans.iter().enumerate() {
        let p = format!("decoder.up_blocks.{i}");
        let grp = b.g.group(&p);
        for j in 0..=cfg.layers_per_block {
            x = b.resnet(grp, &format!("{p}.resnets.{j}"), x, cur, out)?;
            cur = out;
        }
        if i + 1 < chans.len() {
            x = b.g.op(OpKind::Upsample2x, &[x], None)?;
            x = b.conv(grp, &format!("{p}.upsamplers.0.conv"), x, cur, cur, 3)?;
            (hh, ww) = (hh * 2, ww * 2);
        }
    }
    let grp = b.g.group("decoder.conv_out");
    x = b.norm(grp, "decoder.conv_norm_out", x, cur)?;
    x = b.g.op(OpKind::Silu, &[x], None)?;
    x = b.conv(grp, "decoder.conv_out", x, cur, cfg.out_channels, 3)?;
    let _ = (hh, ww);
    b.g.output(x);
    Ok((b.g, cfg))
}

/// The pipeline's decoder input from unpacked latents: `latents / scaling_factor +
/// shift_factor` (f32, as diffusers computes it).
pub fn decoder_input(latents: &[f32], cfg: &VaeConfig) -> Vec<f32> {
    latents
        .iter()
        .map(|&v| v / cfg.scaling_factor + cfg.shift_factor)
        .collect()
}

/// An image `[3, H, W]` in [-1, 1] to 8-bit RGB `[H, W, 3]` as `VaeImageProcessor` makes it:
/// `(x / 2 + 0.5).clamp(0, 1)`, times 255, rounded half to even.
pub fn to_rgb8(image: &[f32], h: usize, w: usize) -> Result<Vec<u8>> {
    if image.len() != 3 * h * w {
        return Err(Error::Invalid(format!(
            "{} values are not a 3 x {h} x {w} image",
            image.len()
        )));
    }
    let mut out = vec![0u8; 3 * h * w];
    for c in 0..3 {
        for i in 0..h * w {
            let v = (image[c * h * w + i] / 2.0 + 0.5).clamp(0.0, 1.0);
            out[i * 3 + c] = (v * 255.0).round_ties_even() as u8;
        }
    }
    Ok(out)
}

/// The VAE's decoder as a pipeline component: built for a latent's height and width.
#[derive(Debug)]
pub enum Vae {}

impl ComponentKind for Vae {
    type Shape = (usize, usize);
    type Config = VaeConfig;
    const NAME: &'static str = "VaeDecoder";
    fn build(model: &ModelIndex, (h, w): (usize, usize)) -> Result<(Graph, VaeConfig)> {
        build(model, h, w)
    }
}

/// A VAE decoder ready to run on a backend.
pub type VaeDecoder<B> = Component<Vae, B>;

impl<B: crate::backend::Backend> Component<Vae, B> {
    /// The image `[out_channels, h * f, w * f]` of a decoder input `[latent_channels, h, w]`.
    #[cfg(feature = "native")]
    pub fn decode(&mut self, z: &[f32]) -> Result<(Vec<f32>, ExecStats)> {
        crate::io::folder::block_on(self.decode_async(z))
    }

    /// [`VaeDecoder::decode`], awaiting the result where the runner was opened on an event
    /// loop.
    pub async fn decode_async(&mut self, z: &[f32]) -> Result<(Vec<f32>, ExecStats)> {
        let (h, w) = self.shape;
        let input = HostTensor::f32(&[self.config.latent_channels, h, w], z.to_vec())?;
        let (image, stats) = self.pass(&[input], "the VAE's image").await?;
        Ok((image, stats))
    }
}

/// Tiled decoding as diffusers' `AutoencoderKL.tiled_decode`: latent tiles of `latent_tile`
/// positions every `latent_tile * (1 - overlap)`, each decoded alone, the seams blended linearly
/// over `latent_tile * f * overlap` pixels (the tile above, then the tile to the left, each
/// already blended), each tile cropped to its stride.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tiling {
    /// diffusers' `tile_latent_min_size`.
    pub latent_tile: usize,
    /// diffusers' `tile_overlap_factor` (0.25).
    pub overlap: f32,
}

impl Tiling {
    /// Latent positions between tile starts.
    pub fn stride(&self) -> usize {
        ((self.latent_tile as f64 * (1.0 - self.overlap as f64)) as usize).max(1)
    }

    /// Refuses a tiling whose tiles do not meet edge to edge once cropped (the stride in pixels
    /// must equal the tile less its blended overlap, as diffusers' sizes do).
    pub fn check(&self, scale: usize) -> Result<()> {
        let sample = self.latent_tile * scale;
        let blend = (sample as f64 * self.overlap as f64) as usize;
        if self.latent_tile == 0
            || !(0.0..1.0).contains(&self.overlap)
            || self.stride() * scale != sample - blend
        {
            return Err(Error::Invalid(format!(
                "VAE tiles of {} latent positions with overlap {}: the tiles would not meet \
                 (use a tile size that is a multiple of 4)",
                self.latent_tile, self.overlap
            )));
        }
        Ok(())
    }

    /// The distinct tile shapes a `h x w` latent is cut into (one decoder graph each).
    pub fn shapes(&self, h: usize, w: usize) -> Vec<(usize, usize)> {
        let mut v: Vec<(usize, usize)> = Vec::new();
        for i in (0..h).step_by(self.stride()) {
            for j in (0..w).step_by(self.stride()) {
                let s = ((h - i).min(self.latent_tile), (w - j).min(self.latent_tile));
                if !v.contains(&s) {
                    v.push(s);
                }
            }
        }
        v
    }
}

/// An image tile `[c, h, w]`.
pub(crate) struct Tile {
    pub(crate) v: Vec<f32>,
    pub(crate) h: usize,
    pub(crate) w: usize,
}

/// Decodes `z` (`[c, h, w]`, the decoder's input) in tiles on `backend`, one decoder graph per
/// tile shape at a time; returns the image `[out_channels, h * f, w * f]`, the backend and the
/// weight bytes streamed.
#[cfg(feature = "native")]
pub fn tiled_decode<B: crate::backend::Backend>(
    model: &ModelIndex,
    backend: B,
    z: &[f32],
    shape: (usize, usize, usize),
    tiling: Tiling,
    opts: ExecOptions,
) -> Result<(Vec<f32>, B, u64)> {
    crate::io::folder::block_on(tiled_decode_with(
        model,
        backend,
        z,
        shape,
        tiling,
        opts,
        &Drive::Blocking,
    ))
}

/// [`tiled_decode`], reading as `drive` says.
pub async fn tiled_decode_with<B: crate::backend::Backend>(
    model: &ModelIndex,
    mut backend: B,
    z: &[f32],
    (c, h, w): (usize, usize, usize),
    tiling: Tiling,
    opts: ExecOptions,
    drive: &Drive<'_>,
) -> Result<(Vec<f32>, B, u64)> {
    let cfg = VaeConfig::of(model)?;
    tiling.check(cfg.scale_factor())?;
    let mut streamed = 0;
    if z.len() != c * h * w {
        return Err(Error::Invalid(format!(
            "{} values are not [{c}, {h}, {w}]",
            z.len()
        )));
    }
    let f = cfg.scale_factor();
    let oc = cfg.out_channels;
    let step = tiling.stride();
    let sample = tiling.latent_tile * f;
    let blend = (sample as f64 * tiling.overlap as f64) as usize;
    let limit = sample - blend;
    let starts_h: Vec<usize> = (0..h).step_by(step).collect();
    let starts_w: Vec<usize> = (0..w).step_by(step).collect();
    let mut grid: Vec<Vec<Option<Tile>>> = starts_h
        .iter()
        .map(|_| starts_w.iter().map(|_| None).collect())
        .collect();
    for (th, tw) in tiling.shapes(h, w) {
        let mut dec = VaeDecoder::open(model, backend, (th, tw), opts, drive).await?;
        let uses = starts_h
            .iter()
            .flat_map(|&i| starts_w.iter().map(move |&j| (i, j)))
            .filter(|&(i, j)| {
                (
                    (h - i).min(tiling.latent_tile),
                    (w - j).min(tiling.latent_tile),
                ) == (th, tw)
            })
            .count();
        dec.limit_passes(uses as u64);
        for (a, &i) in starts_h.iter().enumerate() {
            for (b, &j) in starts_w.iter().enumerate() {
                if (
                    (h - i).min(tiling.latent_tile),
                    (w - j).min(tiling.latent_tile),
                ) != (th, tw)
                {
                    continue;
                }
                let mut tile = Vec::with_capacity(c * th * tw);
                for ch in 0..c {
                    for y in i..i + th {
                        tile.extend_from_slice(&z[(ch * h + y) * w + j..(ch * h + y) * w + j + tw]);
                    }
                }
                let (v, st) = dec.decode_async(&tile).await?;
                streamed += st.stream.bytes;
                grid[a][b] = Some(Tile {
                    v,
                    h: th * f,
                    w: tw * f,
                });
            }
        }
        backend = dec.into_backend();
    }
    let tiles: Vec<Vec<Tile>> = grid
        .into_iter()
        .map(|row| row.into_iter().flatten().collect())
        .collect();
    let out = blend_tiles(tiles, oc, (blend, blend), (limit, limit), (h * f, w * f))?;
    crate::error::check_finite(&out, || "the VAE's tiled image".to_string())?;
    Ok((out, backend, streamed))
}

/// Blends decoded tiles (row-major, each `[planes, h, w]`) as diffusers' tiled decodes do it:
/// each tile blended linearly over `blend` pixels (height, width) with the tile above, then with
/// the tile to its left (both already blended themselves), cropped to `limit` pixels (the
/// stride), and placed:
/// the `[planes, ih, iw]` result.
pub(crate) fn blend_tiles(
    mut tiles: Vec<Vec<Tile>>,
    oc: usize,
    (blend_h, blend_w): (usize, usize),
    (limit_h, limit_w): (usize, usize),
    (ih, iw): (usize, usize),
) -> Result<Vec<f32>> {
    // torch's float32 blend: a * (1 - y / e) + b * (y / e), the weights rounded to float.
    let weights = |k: usize, e: usize| {
        let t = k as f64 / e as f64;
        ((1.0 - t) as f32, t as f32)
    };
    for a in 0..tiles.len() {
        for b in 0..tiles[a].len() {
            if a > 0 {
                let (up, cur) = {
                    let (top, rest) = tiles.split_at_mut(a);
                    (&top[a - 1][b], &mut rest[0][b])
                };
                let e = blend_h.min(up.h).min(cur.h);
                for y in 0..e {
                    let (wa, wb) = weights(y, e);
                    for ch in 0..oc {
                        for x in 0..cur.w {
                            let av = up.v[(ch * up.h + up.h - e + y) * up.w + x];
                            let bv = &mut cur.v[(ch * cur.h + y) * cur.w + x];
                            *bv = av * wa + *bv * wb;
                        }
                    }
                }
            }
            if b > 0 {
                let (left, cur) = {
                    let (l, r) = tiles[a].split_at_mut(b);
                    (&l[b - 1], &mut r[0])
                };
                let e = blend_w.min(left.w).min(cur.w);
                for x in 0..e {
                    let (wa, wb) = weights(x, e);
                    for ch in 0..oc {
                        for y in 0..cur.h {
                            let av = left.v[(ch * left.h + y) * left.w + left.w - e + x];
                            let bv = &mut cur.v[(ch * cur.h + y) * cur.w + x];
                            *bv = av * wa + *bv * wb;
                        }
                    }
                }
            }
        }
    }
    let mut out = vec![0f32; oc * ih * iw];
    let mut y0 = 0;
    for row in &tiles {
        let rh = row.first().map_or(0, |t| t.h.min(limit_h));
        let mut x0 = 0;
        for t in row {
            let cw = t.w.min(limit_w);
            for ch in 0..oc {
                for y in 0..rh {
                    let src = &t.v[(ch * t.h + y) * t.w..(ch * t.h + y) * t.w + cw];
                    let at = (ch * ih + y0 + y) * iw + x0;
                    out[at..at + cw].copy_from_slice(src);
                }
            }
            x0 += cw;
        }
        y0 += rh;
    }
    if (
        y0,
        tiles
            .first()
            .map_or(0, |r| r.iter().map(|t| t.w.min(limit_w)).sum()),
    ) != (ih, iw)
    {
        return Err(Error::Invalid(format!(
            "VAE tiles assembled {y0} rows for a {ih} x {iw} image"
        )));
    }
    Ok(out)
}
