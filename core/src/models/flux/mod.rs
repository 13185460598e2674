//! Text to image with a diffusers Flux pipeline folder, the pieces `FluxPipeline` computes
//! around its models (the scheduler is the flow-matching family's, [`crate::models::scheduler`]):
//! torch-compatible initial noise
//! ([`noise`]), the prompt's CLIP and T5 token ids (`tokens`, with the `text` feature), the
//! 2x2 packing of latents into tokens and the tokens' position ids; and the whole text-to-image
//! run of a pipeline folder (`pipeline`, with the `text` feature).

pub mod lora;
pub mod noise;
#[cfg(feature = "text")]
pub mod pipeline;
#[cfg(feature = "text")]
pub mod tokens;

use crate::error::{Error, Result};

/// The latent grid of a `height x width` image: `2 * (size / (vae_scale_factor * 2))` per side,
/// as `FluxPipeline.prepare_latents` rounds it (so that it packs into 2x2 patches).
pub fn latent_grid(height: usize, width: usize, vae_scale_factor: usize) -> Result<(usize, usize)> {
    let f = vae_scale_factor
        .checked_mul(2)
        .filter(|&f| f > 0)
        .ok_or_else(|| Error::Invalid(format!("VAE scale factor {vae_scale_factor}")))?;
    let (h, w) = (2 * (height / f), 2 * (width / f));
    if h == 0 || w == 0 {
        return Err(Error::Invalid(format!(
            "a {height} x {width} image is smaller than one latent patch ({f} x {f} pixels)"
        )));
    }
    Ok((h, w))
}

/// Calls `f(token_index, image_index)` for every value of a `[c, h, w]` latent and its place
/// among the packed tokens: token `(i, j)` holds the 2x2 patch at rows `2i..2i+2`, columns
/// `2j..2j+2` of every channel (channel-major, then row, then column).
fn for_each_patch_value(c: usize, h: usize, w: usize, mut f: impl FnMut(usize, usize)) {
    let (hh, wh) = (h / 2, w / 2);
    for i in 0..hh {
        for j in 0..wh {
            let tok = i * wh + j;
            for ch in 0..c {
                for a in 0..2 {
                    for b in 0..2 {
                        f(
                            tok * 4 * c + ch * 4 + a * 2 + b,
                            ch * h * w + (2 * i + a) * w + 2 * j + b,
                        );
                    }
                }
            }
        }
    }
}

/// `FluxPipeline._pack_latents`: `[c, h, w]` (one image) to `[(h/2)(w/2), 4c]` tokens.
pub fn pack_latents(x: &[f32], c: usize, h: usize, w: usize) -> Vec<f32> {
    let mut out = vec![0f32; c * h * w];
    for_each_patch_value(c, h, w, |t, i| out[t] = x[i]);
    out
}

/// `FluxPipeline._unpack_latents`: the inverse of [`pack_latents`].
pub fn unpack_latents(tokens: &[f32], c: usize, h: usize, w: usize) -> Vec<f32> {
    let mut out = vec![0f32; c * h * w];
    for_each_patch_value(c, h, w, |t, i| out[i] = tokens[t]);
    out
}

/// `FluxPipeline._prepare_latent_image_ids` for a packed grid of `hh x wh` tokens: `[hh*wh, 3]`
/// rows `(0, row, column)`.
pub fn latent_image_ids(hh: usize, wh: usize) -> Vec<f32> {
    let mut ids = Vec::with_capacity(hh * wh * 3);
    for i in 0..hh {
        for j in 0..wh {
            ids.extend([0.0, i as f32, j as f32]);
        }
    }
    ids
}

/// The initial packed latents of a `height x width` image from `seed`, as diffusers draws them
/// with `torch.Generator("cpu").manual_seed(seed)`: `[c, h, w]` noise, packed.
pub fn initial_latents(
    seed: u64,
    channels: usize,
    grid: (usize, usize),
    math: noise::NoiseMath,
) -> Vec<f32> {
    let (h, w) = grid;
    let x = noise::torch_randn(channels * h * w, seed, math);
    pack_latents(&x, channels, h, w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips_and_groups_2x2_patches() {
        let (c, h, w) = (3, 4, 6);
        let x: Vec<f32> = (0..c * h * w).map(|i| i as f32).collect();
        let p = pack_latents(&x, c, h, w);
        // Token 0 channel 0: rows 0-1, columns 0-1.
        assert_eq!(&p[..4], &[0.0, 1.0, 6.0, 7.0]);
        // Token 0 channel 1 starts the next 4.
        assert_eq!(p[4], 24.0);
        assert_eq!(unpack_latents(&p, c, h, w), x);
        assert_eq!(latent_grid(32, 32, 2).expect("grid"), (16, 16));
        assert_eq!(latent_grid(1024, 768, 8).expect("grid"), (128, 96));
        assert!(latent_grid(8, 32, 8).is_err());
        assert_eq!(&latent_image_ids(2, 3)[9..12], &[0.0, 1.0, 0.0]);
    }
}
