//! Attention on the CPU as a blocked kernel (flash-attention's shape): each task takes blocks of
//! [`QB`] query rows of one head; for each block of [`KB`] keys it computes the scores with the
//! GEMM's register-tiled micro-kernel ([`gemm::micro`]: the block's queries packed once, the
//! keys packed transposed into slivers), updates each row's running maximum and sum (online
//! softmax), and accumulates the weighted values with the same micro-kernel (the weights packed,
//! the value rows read in place). No score matrix larger than `QB x KB` exists, and keys and
//! values are read once per block of queries instead of once per query row. Causal limits, key
//! masks and grouped-query heads are as the reference's; a row whose keys are all masked is
//! zeros, a row with a score that is not finite is NaN (visibly garbage, as in every backend).
//! As in the GEMM, every sum is a fused multiply-add chain in a fixed order, so the instruction
//! set does not change the bits. A few query rows per head (decode) take [`few_rows`] instead:
//! each row's scores as dot products with the key rows in place (packing a key head for one row
//! would move the keys twice more than using them).

use super::gemm::{self, micro, pack_tile};
use super::{dot, exp_shifted, split, Out, ThreadPool};

/// Query rows per block (four tiles of 12 rows, eight of 6, share each key block).
const QB: usize = 48;
/// Keys per block: `KB x d` floats of keys and of values stay in cache while the block's
/// queries use them.
const KB: usize = 64;

/// `out = softmax(scale * q k^T (+ causal / key mask)) v` for `q` `[hq, tq, d]`, `k` and `v`
/// `[hkv, tk, d]` (each group of `hq / hkv` query heads shares one key head).
/// The micro-kernel is `isa`'s (which must be present).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    isa: gemm::Isa,
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
    if d == 0 || hq * tq == 0 {
        return;
    }
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
    if tq <= FEW_ROWS {
        return few_rows(
            pool,
            q,
            k,
            v,
            mask,
            (hq, tq, d),
            (tk, group),
            &limit,
            scale,
            o,
        );
    }
    pool.run(tasks, &|t| {
        let (b0, b1) = split(blocks, tasks, t, 1);
        let (mr, nr) = (isa.mr(), isa.nr());
        let tiles = QB.div_ceil(mr);
        let mut s = vec![0f32; QB * KB];
        let mut acc = vec![0f32; QB * d];
        let mut qpack = vec![0f32; tiles * mr * d];
        // The current key head, transposed into slivers of `nr` keys (zeros past the last).
        let mut kpack: Vec<f32> = Vec::new();
        let mut packed = usize::MAX;
        let mut ppack = vec![0f32; tiles * mr * KB];
        for b in b0..b1 {
            let (h, i0) = (b / per_head, (b % per_head) * QB);
            let rows = QB.min(tq - i0);
            let kh = h / group;
            let (qbase, kvbase) = ((h * tq + i0) * d, kh * tk * d);
            let mut m = [f32::NEG_INFINITY; QB];
            let mut l = [0f32; QB];
            let mut bad = [false; QB];
            acc[..rows * d].iter_mut().for_each(|a| *a = 0.0);
            if packed != kh {
                pack_keys(&k[kvbase..kvbase + tk * d], d, nr, &mut kpack);
                packed = kh;
            }
            for (t, r0) in (0..rows).step_by(mr).enumerate() {
                let n = mr.min(rows - r0);
                pack_tile(&q[qbase + r0 * d..], d, n, d, mr, &mut qpack[t * mr * d..]);
            }
            let last = limit(i0 + rows - 1);
            let mut j0 = 0;
            while j0 < last {
                let kn = KB.min(last - j0);
                let slivers = kn.div_ceil(nr);
                // Scores of the block, tile by sliver.
                for sl in 0..slivers {
                    let cols = nr.min(kn - sl * nr);
                    for (t, r0) in (0..rows).step_by(mr).enumerate() {
                        // SAFETY: a packed tile of d x mr, a sliver of d x nr, and a tile of
                        // `s` (rows KB apart) inside the block.
                        unsafe {
                            micro(
                                isa,
                                mr.min(rows - r0),
                                qpack[t * mr * d..].as_ptr(),
                                kpack[(j0 / nr + sl) * d * nr..].as_ptr(),
                                nr,
                                false,
                                d,
                                s[r0 * KB + sl * nr..].as_mut_ptr(),
                                KB,
                                false,
                                cols,
                            )
                        };
                    }
                }
                // Each row: its masks and scale, then the online softmax update; `s` becomes
                // the block's weights (0 where masked).
                for r in 0..rows {
                    let lim = limit(i0 + r);
                    let row = &mut s[r * KB..r * KB + kn];
                    let mut bm = f32::NEG_INFINITY;
                    if mask.is_none() && j0 + kn <= lim {
                        // Every key of the block visible: a loop without branches.
                        row.iter_mut().for_each(|x| *x *= scale);
                        let (most, finite) = max_finite(row);
                        bm = most;
                        bad[r] |= !finite;
                    } else {
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
                // The weighted values: acc += weights x values, the value rows read in place.
                for (t, r0) in (0..rows).step_by(mr).enumerate() {
                    let n = mr.min(rows - r0);
                    pack_tile(&s[r0 * KB..], KB, n, kn, mr, &mut ppack[t * mr * KB..]);
                }
                let vblock = &v[kvbase + j0 * d..kvbase + (j0 + kn) * d];
                for c0 in (0..d).step_by(nr) {
                    let cols = nr.min(d - c0);
                    for (t, r0) in (0..rows).step_by(mr).enumerate() {
                        // SAFETY: a packed tile of kn x mr; kn value rows d apart, of which
                        // `cols` from c0 are read (masked when fewer than nr); a tile of `acc`.
                        unsafe {
                            micro(
                                isa,
                                mr.min(rows - r0),
                                ppack[t * mr * KB..].as_ptr(),
                                vblock[c0..].as_ptr(),
                                d,
                                cols < nr,
                                kn,
                                acc[r0 * d + c0..].as_mut_ptr(),
                                d,
                                true,
                                cols,
                            )
                        };
                    }
                }
                j0 += kn;
            }
            for r in 0..rows {
                // SAFETY: the block's output rows belong to this task only.
                let orow = unsafe { o.range((h * tq + i0 + r) * d, d) };
                finish_row(orow, &acc[r * d..(r + 1) * d], l[r], m[r], bad[r]);
            }
        }
    });
}

/// Query rows per head up to which attention reads the keys in place, row by row (decode): packing
/// a whole key head for a row or two would move the keys twice more than using them.
const FEW_ROWS: usize = 4;

/// Attention for a few query rows per head: per row, its scores as dot products with the key rows
/// in place, the softmax, and the weighted value rows; rows across the pool.
#[allow(clippy::too_many_arguments)]
fn few_rows(
    pool: &ThreadPool,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[f32]>,
    (hq, tq, d): (usize, usize, usize),
    (tk, group): (usize, usize),
    limit: &(dyn Fn(usize) -> usize + Sync),
    scale: f32,
    o: Out,
) {
    let rows = hq * tq;
    let tasks = rows.min(pool.threads() * 4).max(1);
    pool.run(tasks, &|t| {
        let (r0, r1) = split(rows, tasks, t, 1);
        let mut s = vec![0f32; tk];
        let mut acc = vec![0f32; d];
        for r in r0..r1 {
            let (h, i) = (r / tq, r % tq);
            let kbase = (h / group) * tk * d;
            let qrow = &q[r * d..(r + 1) * d];
            let lim = limit(i);
            let (mut m, mut bad) = (f32::NEG_INFINITY, false);
            for (j, x) in s[..lim].iter_mut().enumerate() {
                if mask.is_some_and(|mk| mk[j] == 0.0) {
                    *x = f32::NEG_INFINITY;
                    continue;
                }
                let sc = dot(qrow, &k[kbase + j * d..kbase + (j + 1) * d]) * scale;
                bad |= !sc.is_finite();
                *x = sc;
                m = m.max(sc);
            }
            // SAFETY: row r of the output belongs to this task only.
            let orow = unsafe { o.range(r * d, d) };
            let mut l = 0.0;
            if !bad && m != f32::NEG_INFINITY {
                l = exp_shifted(&mut s[..lim], m);
                acc.iter_mut().for_each(|a| *a = 0.0);
                for (j, &p) in s[..lim].iter().enumerate() {
                    if p != 0.0 {
                        let vrow = &v[kbase + j * d..kbase + (j + 1) * d];
                        for (a, &x) in acc.iter_mut().zip(vrow) {
                            *a += p * x;
                        }
                    }
                }
            }
            finish_row(orow, &acc, l, m, bad);
        }
    });
}

/// One output row: NaN when a score was not finite (visibly garbage, as on every backend),
/// zeros when every key was masked (`most` is -inf), else the weighted values over their sum.
fn finish_row(orow: &mut [f32], acc: &[f32], sum: f32, most: f32, bad: bool) {
    if bad {
        orow.iter_mut().for_each(|x| *x = f32::NAN);
    } else if most == f32::NEG_INFINITY {
        orow.iter_mut().for_each(|x| *x = 0.0);
    } else {
        let inv = 1.0 / sum;
        for (ov, a) in orow.iter_mut().zip(acc) {
            *ov = a * inv;
        }
    }
}

/// Bytes one task keeps for `tk` keys of `d` values: the packed key head and the block's
/// scores, accumulators and packed tiles (at the widest sliver and tile).
pub(super) fn workspace_bytes(tk: usize, d: usize) -> u64 {
    let floats = tk.div_ceil(32) * 32 * d + QB * KB + QB * d + QB.div_ceil(12) * 12 * (d + KB);
    floats as u64 * 4
}

/// Every key row of `k` (`d` values each) transposed into slivers of `nr` keys:
/// `out[(j / nr) * d * nr + dd * nr + j % nr] = k[j * d + dd]`, zeros past the last key.
fn pack_keys(k: &[f32], d: usize, nr: usize, out: &mut Vec<f32>) {
    let tk = k.len() / d.max(1);
    // Every key's values are written below: only the padding past the last key is zeroed.
    out.resize(tk.div_ceil(nr) * nr * d, 0.0);
    for (j, row) in k.chunks_exact(d).enumerate() {
        let base = (j / nr) * d * nr + j % nr;
        for (dd, &x) in row.iter().enumerate() {
            out[base + dd * nr] = x;
        }
    }
    for j in tk..tk.div_ceil(nr) * nr {
        let base = (j / nr) * d * nr + j % nr;
        (0..d).for_each(|dd| out[base + dd * nr] = 0.0);
    }
}

/// The largest of `row` and whether every value is finite, in eight independent lanes (a loop
/// the compiler vectorizes; `f32::max`'s NaN rule keeps it scalar).
fn max_finite(row: &[f32]) -> (f32, bool) {
    let mut m = [f32::NEG_INFINITY; 8];
    let mut odd = [false; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for ch in chunks {
        for i in 0..8 {
            m[i] = if ch[i] > m[i] { ch[i] } else { m[i] };
            odd[i] |= (ch[i].to_bits() & 0x7f80_0000) == 0x7f80_0000;
        }
    }
    let mut most = f32::NEG_INFINITY;
    let mut finite = true;
    for i in 0..8 {
        most = if m[i] > most { m[i] } else { most };
        finite &= !odd[i];
    }
    for &x in tail {
        most = if x > most { x } else { most };
        finite &= x.is_finite();
    }
    (most, finite)
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
            // Several query blocks, key blocks and slivers; a head of 64.
            (2, 1, 100, 200, 64),
            // Few query rows (decode): the keys read in place.
            (4, 2, 1, 150, 24),
            (2, 1, 3, 70, 40),
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
                    // Every instruction set the CPU has gives the same bits.
                    let mut outs = crate::backend::cpu::gemm::Isa::all_present()
                        .into_iter()
                        .map(|isa| {
                            let mut out = vec![0f32; hq * tq * d];
                            attention(
                                isa,
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
                            out
                        })
                        .collect::<Vec<_>>();
                    let out = outs.remove(0);
                    for other in &outs {
                        let same = out
                            .iter()
                            .zip(other)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{hq} {tq} {tk} {d}: instruction sets differ");
                    }
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
