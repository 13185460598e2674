//! The Wan VAE's spatial tiling, as diffusers' `AutoencoderKLWan.tiled_decode` (0.42.1) does it:
//! the latent video cut into overlapping tiles of `tile / 8` latent positions every
//! `stride / 8`, each tile decoded alone through the causal decoder (its caches cleared, latent
//! frame by latent frame, as the untiled decode), the seams blended linearly over
//! `tile - stride` pixels (with the tile above, then the tile to the left, each already
//! blended), each tile cropped to the stride, the whole clamped to [-1, 1]. Every frame of a
//! tile is blended the same way, so the blend is the image VAE's ([`crate::models::vae`]) over
//! `channels x frames` planes.

use crate::error::{Error, Result};
use crate::exec::ExecOptions;
use crate::io::model::ModelIndex;
use crate::models::vae::{blend_tiles, Tile};
use crate::models::Drive;

use super::vae::{WanVaeConfig, WanVaeDecoder};

/// Tile and stride in sample pixels (height, width), as `AutoencoderKLWan.enable_tiling` takes
/// them (`tile_sample_min_*`, `tile_sample_stride_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WanTiling {
    /// Pixels per tile (height, width).
    pub tile: (usize, usize),
    /// Pixels between tile starts (height, width).
    pub stride: (usize, usize),
}

impl Default for WanTiling {
    /// diffusers' defaults: tiles of 256 x 256 pixels every 192.
    fn default() -> Self {
        WanTiling {
            tile: (256, 256),
            stride: (192, 192),
        }
    }
}

impl WanTiling {
    /// Refuses a tiling whose tiles would not meet: tile and stride must be multiples of the
    /// VAE's `scale` (8) with the stride at most the tile.
    pub fn check(&self, scale: usize) -> Result<()> {
        let ok = |t: usize, s: usize| {
            t > 0 && s > 0 && s <= t && t.is_multiple_of(scale) && s.is_multiple_of(scale)
        };
        if !ok(self.tile.0, self.stride.0) || !ok(self.tile.1, self.stride.1) {
            return Err(Error::Invalid(format!(
                "VAE tiles of {} x {} pixels every {} x {}: tile and stride must be multiples of \
                 {scale} (the VAE's scale) and the stride at most the tile (diffusers' default: \
                 256,256 every 192,192)",
                self.tile.0, self.tile.1, self.stride.0, self.stride.1
            )));
        }
        Ok(())
    }

    /// Latent positions per tile (height, width).
    pub fn latent_tile(&self, scale: usize) -> (usize, usize) {
        (self.tile.0 / scale, self.tile.1 / scale)
    }

    /// Whether an `h x w` latent is larger than a tile (diffusers tiles only then).
    pub fn tiles(&self, (h, w): (usize, usize), scale: usize) -> bool {
        let (th, tw) = self.latent_tile(scale);
        h > th || w > tw
    }

    /// The tiles' latent starts (rows, columns) for an `h x w` latent.
    fn starts(&self, (h, w): (usize, usize), scale: usize) -> (Vec<usize>, Vec<usize>) {
        (
            (0..h).step_by(self.stride.0 / scale).collect(),
            (0..w).step_by(self.stride.1 / scale).collect(),
        )
    }

    /// The tile at latent `(i, j)`'s size.
    fn size_at(
        &self,
        (i, j): (usize, usize),
        (h, w): (usize, usize),
        scale: usize,
    ) -> (usize, usize) {
        let (th, tw) = self.latent_tile(scale);
        ((h - i).min(th), (w - j).min(tw))
    }

    /// The distinct tile sizes (latent positions) an `h x w` latent is cut into, largest first:
    /// one decoder graph each.
    pub fn shapes(&self, dims: (usize, usize), scale: usize) -> Vec<(usize, usize)> {
        let (rows, cols) = self.starts(dims, scale);
        let mut v = Vec::new();
        for &i in &rows {
            for &j in &cols {
                let s = self.size_at((i, j), dims, scale);
                if !v.contains(&s) {
                    v.push(s);
                }
            }
        }
        v
    }
}

/// Decodes the latent video `z` (`[z_dim, f, h, w]`, de-normalized) in spatial tiles on
/// `backend`, one decoder graph per tile size at a time; returns the video
/// `[out_channels, frames, 8h, 8w]` clamped to [-1, 1], the backend and the weight bytes
/// streamed.
pub async fn tiled_decode<B: crate::backend::Backend>(
    model: &ModelIndex,
    mut backend: B,
    z: &[f32],
    (f, h, w): (usize, usize, usize),
    tiling: WanTiling,
    opts: ExecOptions,
    drive: &Drive<'_>,
) -> Result<(Vec<f32>, B, u64)> {
    let cfg = WanVaeConfig::of(model)?;
    let s = cfg.spatial_scale();
    tiling.check(s)?;
    let zc = cfg.z_dim;
    if z.len() != zc * f * h * w {
        return Err(Error::Invalid(format!(
            "{} latent values are not [{zc}, {f}, {h}, {w}]",
            z.len()
        )));
    }
    let (rows, cols) = tiling.starts((h, w), s);
    let frames = cfg.frames(f);
    let planes = cfg.out_channels * frames;
    let mut grid: Vec<Vec<Option<Tile>>> = rows
        .iter()
        .map(|_| cols.iter().map(|_| None).collect())
        .collect();
    let mut streamed = 0;
    for shape in tiling.shapes((h, w), s) {
        let mut dec = WanVaeDecoder::open(model, backend, shape, opts, drive).await?;
        for (a, &i) in rows.iter().enumerate() {
            for (b, &j) in cols.iter().enumerate() {
                if tiling.size_at((i, j), (h, w), s) != shape {
                    continue;
                }
                let (th, tw) = shape;
                let mut tile = Vec::with_capacity(zc * f * th * tw);
                for plane in 0..zc * f {
                    for y in i..i + th {
                        let at = (plane * h + y) * w + j;
                        tile.extend_from_slice(&z[at..at + tw]);
                    }
                }
                let before = dec.bytes_streamed();
                let v = dec.decode_unclamped(&tile).await?;
                streamed += dec.bytes_streamed() - before;
                grid[a][b] = Some(Tile {
                    v,
                    h: th * s,
                    w: tw * s,
                });
            }
        }
        backend = dec.into_backend();
    }
    let tiles: Vec<Vec<Tile>> = grid
        .into_iter()
        .map(|row| row.into_iter().flatten().collect())
        .collect();
    let blend = (
        tiling.tile.0 - tiling.stride.0,
        tiling.tile.1 - tiling.stride.1,
    );
    let mut video = blend_tiles(tiles, planes, blend, tiling.stride, (h * s, w * s))?;
    for v in &mut video {
        *v = v.clamp(-1.0, 1.0);
    }
    Ok((video, backend, streamed))
}
