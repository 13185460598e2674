//! The CPU backend's image ops (the VAE decoder's): convolution as im2col over bands of output
//! rows into the FMA tiles of the dense linear (so the column buffer stays small at any image
//! size), group normalization split across the pool by group, and nearest 2x upsampling.

use super::dense::dense_linear;
use super::{Out, Rows, ThreadPool};

/// Bytes of im2col columns built at once (a band of output rows).
const BAND_BYTES: usize = 16 << 20;

/// Output rows of a band: as many as fit [`BAND_BYTES`] of columns, at least one.
fn band_rows(ck: usize, oh: usize, ow: usize) -> usize {
    (BAND_BYTES / 4 / (ck * ow).max(1)).clamp(1, oh.max(1))
}

/// The bytes [`conv2d`] keeps in `cols` and allocates for one band's products.
pub(super) fn conv2d_workspace(
    (c, h, w): (usize, usize, usize),
    o: usize,
    (k, pad): (usize, usize),
) -> (u64, u64) {
    let (oh, ow) = (
        (h + 2 * pad + 1).saturating_sub(k),
        (w + 2 * pad + 1).saturating_sub(k),
    );
    let ck = c * k * k;
    let n = band_rows(ck, oh, ow) * ow;
    ((n * ck * 4) as u64, (o * n * 4) as u64)
}

/// `out[O, OH, OW] = w[O, C, k, k] * x[C, H, W]` (+ `b`), stride 1, zero padding `pad`.
/// `cols` is reused scratch.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv2d(
    pool: &ThreadPool,
    x: &[f32],
    (c, h, w): (usize, usize, usize),
    wt: &[f32],
    o: usize,
    (k, pad): (usize, usize),
    bias: Option<&[f32]>,
    out: &mut [f32],
    cols: &mut Vec<f32>,
) {
    let (oh, ow) = (h + 2 * pad + 1 - k, w + 2 * pad + 1 - k);
    let ck = c * k * k;
    let band = band_rows(ck, oh, ow);
    let mut tmp = Vec::new();
    let mut y0 = 0;
    while y0 < oh {
        let rows = band.min(oh - y0);
        let n = rows * ow;
        // Columns transposed: one row of C*k*k values per output position of the band.
        cols.clear();
        cols.resize(n * ck, 0.0);
        let cp = Out(cols.as_mut_ptr());
        pool.run(rows, &|r| {
            let oy = y0 + r;
            for ox in 0..ow {
                // SAFETY: each task writes the columns of its own output row only.
                let row = unsafe { cp.range((r * ow + ox) * ck, ck) };
                for ic in 0..c {
                    for ky in 0..k {
                        let iy = (oy + ky) as isize - pad as isize;
                        for kx in 0..k {
                            let ix = (ox + kx) as isize - pad as isize;
                            row[(ic * k + ky) * k + kx] =
                                if iy < 0 || iy >= h as isize || ix < 0 || ix >= w as isize {
                                    0.0
                                } else {
                                    x[(ic * h + iy as usize) * w + ix as usize]
                                };
                        }
                    }
                }
            }
        });
        // tmp[O, n] = w[O, ck] . cols[n, ck]^T, then into the band's place in out.
        tmp.clear();
        tmp.resize(o * n, 0.0);
        dense_linear(pool, wt, o, Rows::F32(cols), n, ck, None, &mut tmp);
        for oc in 0..o {
            let b = bias.map_or(0.0, |b| b[oc]);
            let dst = &mut out[(oc * oh + y0) * ow..(oc * oh + y0 + rows) * ow];
            for (d, &v) in dst.iter_mut().zip(&tmp[oc * n..(oc + 1) * n]) {
                *d = v + b;
            }
        }
        y0 += rows;
    }
}

/// Group normalization of `x[C, S]` in `groups` groups, then `* w + b` per channel.
#[allow(clippy::too_many_arguments)]
pub(super) fn group_norm(
    pool: &ThreadPool,
    x: &[f32],
    c: usize,
    groups: usize,
    eps: f32,
    w: &[f32],
    b: &[f32],
    out: &mut [f32],
) {
    let per = x.len() / c.max(1);
    let cg = c / groups.max(1);
    let n = cg * per;
    let op = Out(out.as_mut_ptr());
    pool.run(groups, &|g| {
        let part = &x[g * n..(g + 1) * n];
        let mean = part.iter().map(|&a| a as f64).sum::<f64>() / n as f64;
        let var = part.iter().map(|&a| (a as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        let r = (1.0 / (var + eps as f64).sqrt()) as f32;
        let mean = mean as f32;
        // SAFETY: group g's elements belong to this task only.
        let dst = unsafe { op.range(g * n, n) };
        for j in 0..cg {
            let ch = g * cg + j;
            for i in 0..per {
                dst[j * per + i] = (part[j * per + i] - mean) * r * w[ch] + b[ch];
            }
        }
    });
}

/// `x[C, H, W]` to `[C, 2H, 2W]`, each value repeated in a 2x2 block.
pub(super) fn upsample2x(x: &[f32], (c, h, w): (usize, usize, usize), out: &mut [f32]) {
    for ch in 0..c {
        for y in 0..2 * h {
            let src = &x[(ch * h + y / 2) * w..(ch * h + y / 2 + 1) * w];
            let dst = &mut out[(ch * 2 * h + y) * 2 * w..(ch * 2 * h + y + 1) * 2 * w];
            for (i, d) in dst.iter_mut().enumerate() {
                *d = src[i / 2];
            }
        }
    }
}
