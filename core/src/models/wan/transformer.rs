//! Wan's transformer as a model of the shared denoise loop: the latent `[C, F, H, W]` cut into
//! patches in (frame, row, column) order, the 3D rotary tables, both guidance sequences through
//! one pass over the weights, the output head's patches put back, and the guided prediction.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::exec::Executor;
use crate::graph::HostTensor;
use crate::models::denoise::DenoiseModel;
use crate::models::scheduler::guide;

use super::WanConfig;

/// The patch grid of a latent `[C, F, H, W]`: (frames, rows, columns) of patches.
pub fn patch_grid(
    cfg: &WanConfig,
    (f, h, w): (usize, usize, usize),
) -> Result<(usize, usize, usize)> {
    let (pt, ph, pw) = cfg.patch;
    if f % pt != 0 || h % ph != 0 || w % pw != 0 || f == 0 || h == 0 || w == 0 {
        return Err(Error::Invalid(format!(
            "a latent of {f} x {h} x {w} (frames x height x width) is not a whole number of \
             {pt} x {ph} x {pw} patches"
        )));
    }
    Ok((f / pt, h / ph, w / pw))
}

/// The patches of `latent` (`[C, F, H, W]` of `dims`), one row per patch in (frame, row,
/// column) order, each in the Conv3d weight's order (C, pt, ph, pw).
pub fn patchify(cfg: &WanConfig, latent: &[f32], dims: (usize, usize, usize)) -> Result<Vec<f32>> {
    let (gf, gh, gw) = patch_grid(cfg, dims)?;
    let (f, h, w) = dims;
    let (pt, ph, pw) = cfg.patch;
    let c = cfg.in_channels;
    if latent.len() != c * f * h * w {
        return Err(Error::Invalid(format!(
            "{} latent values for {c} x {f} x {h} x {w}",
            latent.len()
        )));
    }
    let mut out = Vec::with_capacity(latent.len());
    for tf in 0..gf {
        for th in 0..gh {
            for tw in 0..gw {
                for ch in 0..c {
                    for kt in 0..pt {
                        for kh in 0..ph {
                            for kw in 0..pw {
                                let (fi, hi, wi) = (tf * pt + kt, th * ph + kh, tw * pw + kw);
                                out.push(latent[((ch * f + fi) * h + hi) * w + wi]);
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The latent `[C, F, H, W]` of the output head's rows (one per patch, each in the order
/// (pt, ph, pw, C)).
pub fn unpatchify(cfg: &WanConfig, rows: &[f32], dims: (usize, usize, usize)) -> Result<Vec<f32>> {
    let (gf, gh, gw) = patch_grid(cfg, dims)?;
    let (f, h, w) = dims;
    let (pt, ph, pw) = cfg.patch;
    let c = cfg.out_channels;
    if rows.len() != c * f * h * w {
        return Err(Error::Invalid(format!(
            "{} predicted values for {c} x {f} x {h} x {w}",
            rows.len()
        )));
    }
    let mut out = vec![0f32; rows.len()];
    let mut i = 0;
    for tf in 0..gf {
        for th in 0..gh {
            for tw in 0..gw {
                for kt in 0..pt {
                    for kh in 0..ph {
                        for kw in 0..pw {
                            for ch in 0..c {
                                let (fi, hi, wi) = (tf * pt + kt, th * ph + kh, tw * pw + kw);
                                out[((ch * f + fi) * h + hi) * w + wi] = rows[i];
                                i += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The rotary tables `[N, head_dim / 2]` (cos, sin) of the patch grid: per head, the first
/// pairs rotate by the frame, then by the row, then by the column, at `pos / 10000^(2i / d)`
/// of each part's width `d` (diffusers' `WanRotaryPosEmbed`: float64, then float32).
pub fn rope_tables(
    cfg: &WanConfig,
    (gf, gh, gw): (usize, usize, usize),
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (dt, dh, dw) = cfg.rope_dims();
    let max = cfg.rope_max_seq_len;
    if gf > max || gh > max || gw > max {
        return Err(Error::Invalid(format!(
            "a patch grid of {gf} x {gh} x {gw} is past the rotary tables' {max} positions \
             (rope_max_seq_len)"
        )));
    }
    let freqs = |d: usize| -> Vec<f64> {
        (0..d / 2)
            .map(|i| 1.0 / 10000f64.powf((2 * i) as f64 / d as f64))
            .collect()
    };
    let (ft, fh, fw) = (freqs(dt), freqs(dh), freqs(dw));
    let half = cfg.head_dim / 2;
    let n = gf * gh * gw;
    let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
    for f in 0..gf {
        for h in 0..gh {
            for w in 0..gw {
                for (pos, fr) in [(f, &ft), (h, &fh), (w, &fw)] {
                    for &q in fr.iter() {
                        let a = pos as f64 * q;
                        cos.push(a.cos() as f32);
                        sin.push(a.sin() as f32);
                    }
                }
            }
        }
    }
    Ok((cos, sin))
}

/// Wan's transformer bound to its executor, for one latent size and one text: with guidance,
/// the prompt's and the negative prompt's sequences run together in one pass over the weights.
pub struct WanTransformer<B: Backend> {
    ex: Executor<B>,
    cfg: WanConfig,
    dims: (usize, usize, usize),
    text: HostTensor,
    cos: HostTensor,
    sin: HostTensor,
    /// The guidance scale, where the negative prompt's sequence runs too.
    guidance: Option<f32>,
}

impl<B: Backend> WanTransformer<B> {
    /// Over `ex` (the graph of [`super::build`] for these sizes) for a latent of `dims` (frames,
    /// height, width) and text states `[b·t, text_dim]` (the prompt's, then with `guidance` the
    /// negative prompt's).
    pub fn new(
        ex: Executor<B>,
        cfg: WanConfig,
        dims: (usize, usize, usize),
        text: Vec<f32>,
        guidance: Option<f32>,
    ) -> Result<Self> {
        let grid = patch_grid(&cfg, dims)?;
        let b = if guidance.is_some() { 2 } else { 1 };
        if text.is_empty() || !text.len().is_multiple_of(b * cfg.text_dim) {
            return Err(Error::Invalid(format!(
                "{} text values are not {b} sequences of {}-wide states",
                text.len(),
                cfg.text_dim
            )));
        }
        let (cos, sin) = rope_tables(&cfg, grid)?;
        let n = grid.0 * grid.1 * grid.2;
        let half = cfg.head_dim / 2;
        Ok(WanTransformer {
            text: HostTensor::f32(&[text.len() / cfg.text_dim, cfg.text_dim], text)?,
            cos: HostTensor::f32(&[n, half], cos)?,
            sin: HostTensor::f32(&[n, half], sin)?,
            ex,
            cfg,
            dims,
            guidance,
        })
    }

    /// The executor's outputs as latents: the prompt's prediction, and the negative prompt's
    /// where guided.
    pub fn predictions(&self, out: Vec<HostTensor>) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        let rows = out
            .into_iter()
            .next()
            .ok_or_else(|| Error::Invalid("the Wan graph has no output".into()))?
            .into_f32();
        let each = rows.len() / if self.guidance.is_some() { 2 } else { 1 };
        let cond = unpatchify(&self.cfg, &rows[..each], self.dims)?;
        let uncond = match self.guidance {
            Some(_) => Some(unpatchify(&self.cfg, &rows[each..], self.dims)?),
            None => None,
        };
        Ok((cond, uncond))
    }
}

impl<B: Backend> DenoiseModel for WanTransformer<B> {
    type Backend = B;

    fn executor(&self) -> &Executor<B> {
        &self.ex
    }

    fn executor_mut(&mut self) -> &mut Executor<B> {
        &mut self.ex
    }

    fn into_executor(self) -> Executor<B> {
        self.ex
    }

    fn step_inputs(&self, x: &[f32], timestep: f32) -> Result<Vec<HostTensor>> {
        let patches = patchify(&self.cfg, x, self.dims)?;
        let n = patches.len() / self.cfg.patch_values();
        Ok(vec![
            HostTensor::f32(&[n, self.cfg.patch_values()], patches)?,
            self.text.clone(),
            HostTensor::f32(&[1], vec![timestep])?,
            self.cos.clone(),
            self.sin.clone(),
        ])
    }

    /// The prompt's prediction, or with guidance `uncond + scale · (cond − uncond)`.
    fn prediction(&self, out: Vec<HostTensor>) -> Result<Vec<f32>> {
        let (cond, uncond) = self.predictions(out)?;
        Ok(match (uncond, self.guidance) {
            (Some(u), Some(s)) => guide(&cond, &u, s),
            _ => cond,
        })
    }
}
