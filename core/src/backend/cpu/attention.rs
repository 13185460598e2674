//! Attention on the CPU as a blocked kernel (flash-attention's shape): each task takes blocks of
//! [`QB`] query rows of one head; for each block of [`KB`] keys it computes the scores with the
//! GEMM micro-kernel ([`dot_tile`], 4 query rows x 3 keys at a time, every key row loaded once
//! for the block's queries), updates each row's running maximum and sum (online softmax), and
//! accumulates the weighted values. No score matrix larger than `QB x KB` exists, and keys and
//! values are read once per block of queries instead of once per query row. Causal limits, key
//! masks and grouped-query heads are as the reference's; a row whose keys are all masked is
//! zeros, a row with a score that is not finite is NaN (visibly garbage, as in every backend).

use super::{axpy, dot_tile, exp_shifted, pv_tile4, split, Out, ThreadPool};

/// Query rows per block (four micro-tiles of 4 share each key block).
const QB: usize = 16;
/// Keys per block: `KB x d` floats of keys and of values stay in cache while the block's
/// queries use them.
const KB: usize = 64;

/// `out = softmax(scale * q k^T (+ causal / key mask)) v` for `q` `[hq, tq, d]`, `k` and `v`
/// `[hkv, tk, d]` (each group of `hq / hkv` query heads shares one key head).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    pool: &ThreadPool,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    qs: &[usize],
    ks: &[usize],
    causal: bool,
    scale: f32,
    out: &mut [f32],
) {
    let (hq, tq, d) = (qs[0], qs[1], qs[2]);
    let (hkv, tk) = (ks[0], ks[1]);
    let group = hq / hkv.max(1);
    let per_head = tq.div_ceil(QB);
    let blocks = hq * per_head;
    let o = Out(out.as_mut_ptr());
    let tasks = blocks.min(pool.threads() * 4).max(1);
    // The keys row `i` (of `tq`, the queries being the last `tq` of `tk` positions) may see.
    let limit = |i: usize| {
        if causal {
            (i + tk + 1).saturating_sub(tq).min(tk)
        } else {
            tk
        }
    };
    pool.run(tasks, &|t| {
        let (b0, b1) = split(blocks, tasks, t, 1);
        let mut s = vec![0f32; QB * KB];
        let mut acc = vec![0f32; QB * d];
        for b in b0..b1 {
            let (h, i0) = (b / per_head, (b % per_head) * QB);
            let rows = QB.min(tq - i0);
            let kh = h / group;
            let (qbase, kvbase) = ((h * tq + i0) * d, kh * tk * d);
            let mut m = [f32::NEG_INFINITY; QB];
            let mut l = [0f32; QB];
            let mut bad = [false; QB];
            acc[..rows * d].iter_mut().for_each(|a| *a = 0.0);
            let last = limit(i0 + rows - 1);
            let mut j0 = 0;
            while j0 < last {
                let kn = KB.min(last - j0);
                // Scores of the block: 4 x 3 tiles of dot products.
                let mut r = 0;
                while r < rows {
                    let mr = 4.min(rows - r);
                    let mut c = 0;
                    while c < kn {
                        let nr = 3.min(kn - c);
                        dot_tile(
                            &q[qbase + r * d..],
                            d,
                            mr,
                            &k[kvbase + (j0 + c) * d..],
                            d,
                            nr,
                            d,
                            &mut s[r * KB + c..],
                            KB,
                        );
                        c += nr;
                    }
                    r += mr;
                }
                // Each row: its masks and scale, then the online softmax update; `s` becomes
                // the block's weights (0 where masked).
                for r in 0..rows {
                    let lim = limit(i0 + r);
                    let row = &mut s[r * KB..r * KB + kn];
                    let mut bm = f32::NEG_INFINITY;
                    for (c, x) in row.iter_mut().enumerate() {
                        let j = j0 + c;
                        if j >= lim || mask.is_some_and(|mk| mk[j] == 0.0) {
                            *x = f32::NEG_INFINITY;
                            continue;
                        }
                        let sc = *x * scale;
                        bad[r] |= !sc.is_finite();
                        *x = sc;
                        bm = bm.max(sc);
                    }
                    if bad[r] || bm == f32::NEG_INFINITY {
                        row.iter_mut().for_each(|x| *x = 0.0);
                        continue;
                    }
                    let mn = m[r].max(bm);
                    let corr = (m[r] - mn).exp();
                    if corr != 1.0 {
                        acc[r * d..(r + 1) * d].iter_mut().for_each(|a| *a *= corr);
                        l[r] *= corr;
                    }
                    l[r] += exp_shifted(row, mn);
                    m[r] = mn;
                }
                // The weighted values: each value row once for four query rows at a time.
                let vblock = &v[kvbase + j0 * d..kvbase + (j0 + kn) * d];
                let mut r = 0;
                while r + 4 <= rows {
                    pv_tile4(&s[r * KB..], KB, vblock, d, kn, &mut acc[r * d..], d);
                    r += 4;
                }
                for r in r..rows {
                    for c in 0..kn {
                        let p = s[r * KB + c];
                        if p != 0.0 {
                            axpy(p, &vblock[c * d..(c + 1) * d], &mut acc[r * d..(r + 1) * d]);
                        }
                    }
                }
                j0 += kn;
            }
            for r in 0..rows {
                // SAFETY: the block's output rows belong to this task only.
                let orow = unsafe { o.range((h * tq + i0 + r) * d, d) };
                if bad[r] {
                    orow.iter_mut().for_each(|x| *x = f32::NAN);
                } else if m[r] == f32::NEG_INFINITY {
                    orow.iter_mut().for_each(|x| *x = 0.0);
                } else {
                    let inv = 1.0 / l[r];
                    for (ov, a) in orow.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
                        *ov = a * inv;
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two-pass softmax attention, one row at a time (the shape of `cpu_ref`'s).
    #[allow(clippy::too_many_arguments)]
    fn naive(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: Option<&[f32]>,
        qs: [usize; 3],
        tk: usize,
        hkv: usize,
        causal: bool,
    ) -> Vec<f32> {
        let (hq, tq, d) = (qs[0], qs[1], qs[2]);
        let mut out = vec![0f32; hq * tq * d];
        for h in 0..hq {
            let kh = h / (hq / hkv);
            for i in 0..tq {
                let lim = if causal {
                    (i + tk + 1 - tq).min(tk)
                } else {
                    tk
                };
                let qr = &q[(h * tq + i) * d..][..d];
                let s: Vec<f32> = (0..tk)
                    .map(|j| {
                        if j >= lim || mask.is_some_and(|m| m[j] == 0.0) {
                            f32::NEG_INFINITY
                        } else {
                            qr.iter()
                                .zip(&k[(kh * tk + j) * d..][..d])
                                .map(|(a, b)| a * b)
                                .sum::<f32>()
                                * 0.3
                        }
                    })
                    .collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let w: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let sum: f32 = w.iter().sum();
                for (j, wj) in w.iter().enumerate() {
                    for c in 0..d {
                        out[(h * tq + i) * d + c] += wj / sum * v[(kh * tk + j) * d + c];
                    }
                }
            }
        }
        out
    }

    /// Head widths that are not a multiple of 16 (the value tiles' portable path), ragged
    /// query and key blocks, a key block wholly masked, GQA, causal.
    #[test]
    fn blocks_agree_with_two_pass_attention() {
        let pool = ThreadPool::new(2);
        for &(hq, hkv, tq, tk, d) in &[
            (4usize, 2usize, 37usize, 150usize, 24usize),
            (2, 1, 17, 70, 40),
            (3, 3, 5, 5, 16),
        ] {
            let gen = |n: usize, s: u32| -> Vec<f32> {
                (0..n)
                    .map(|i| {
                        (((i as u32).wrapping_mul(2654435761) ^ s) % 1000) as f32 / 500.0 - 1.0
                    })
                    .collect()
            };
            let (q, k, v) = (
                gen(hq * tq * d, 1),
                gen(hkv * tk * d, 2),
                gen(hkv * tk * d, 3),
            );
            let mask: Vec<f32> = (0..tk)
                .map(|j| {
                    if (64..128).contains(&j) || j % 5 == 1 {
                        0.0
                    } else {
                        1.0
                    }
                })
                .collect();
            for causal in [false, true] {
                for m in [None, Some(mask.as_slice())] {
                    let mut out = vec![0f32; hq * tq * d];
                    attention(
                        &pool,
                        &q,
                        &k,
                        &v,
                        m,
                        &[hq, tq, d],
                        &[hkv, tk, d],
                        causal,
                        0.3,
                        &mut out,
                    );
                    let want = naive(&q, &k, &v, m, [hq, tq, d], tk, hkv, causal);
                    let err = out
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(
                        err < 1e-5,
                        "{hq} {tq} {tk} {d} causal {causal} masked {}: {err}",
                        m.is_some()
                    );
                }
            }
        }
    }
}
