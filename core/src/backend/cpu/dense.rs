//! The dense linear `x · w^T (+ b)` in f32 FMA tiles: used by the op dispatch (`ops`) and by the
//! convolution's im2col GEMM (`image`), which import it from here so that neither imports the
//! other.

use super::gemm::{self, Bf16Rows, F32Rows};
use super::{dot_tile_rows, split, Out, Rows, ThreadPool};

/// Rows of x up to which a dense linear runs dot-product tiles instead of the GEMM: each tile of
/// 3 weight rows is read from memory once and stays in L1 while every row of x uses it, where the
/// GEMM would widen and pack every weight for a few rows (SmolLM2's bf16 output head for a batch
/// of 8 sequences: 15.8 ms a pass in the GEMM).
pub const DOT_MAX_ROWS: usize = 16;

/// `out[M,N] = x[M,K] · w[N,K]^T (+ b)`: the blocked GEMM ([`gemm`]) for more than
/// [`DOT_MAX_ROWS`] rows, f32 dot-product tiles with columns split across threads for fewer.
#[allow(clippy::too_many_arguments)]
pub(super) fn dense_linear(
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    w: Rows<'_>,
    n: usize,
    k: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    if m > DOT_MAX_ROWS {
        let isa = gemm::isa();
        match w {
            Rows::F32(w) => gemm::gemm(pool, isa, x, m, k, &F32Rows::new(w, k), n, bias, out),
            Rows::Bf16(w) => gemm::gemm(pool, isa, x, m, k, &Bf16Rows::new(w, k), n, bias, out),
        }
        return;
    }
    let o = Out(out.as_mut_ptr());
    let tasks = if (m * n * k) < 1 << 16 {
        1
    } else {
        pool.threads() * 2
    };
    pool.run(tasks, &|t| {
        let (n0, n1) = split(n, tasks, t, 3);
        let mut tile = [0f32; 12];
        let mut j = n0;
        while j < n1 {
            let nr = (n1 - j).min(3);
            let mut i = 0;
            while i < m {
                let mr = (m - i).min(4);
                dot_tile_rows(&x[i * k..], k, mr, w.from(j * k), k, nr, k, &mut tile, 3);
                for a in 0..mr {
                    for bcol in 0..nr {
                        let mut v = tile[a * 3 + bcol];
                        if let Some(b) = bias {
                            v += b[j + bcol];
                        }
                        // SAFETY: column j + bcol belongs to this task only.
                        unsafe { o.range((i + a) * n + j + bcol, 1)[0] = v };
                    }
                }
                i += mr;
            }
            j += nr;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::super::gemm::tests::vals;
    use super::*;

    #[test]
    fn a_dense_row_is_the_same_alone_and_in_a_batch_of_up_to_the_dot_tile_limit() {
        // f32 and bf16 weights, with a bias: each row of a batch of 2..=DOT_MAX_ROWS gives the
        // bits it gives alone (the server decodes sequences together), and a batch past the
        // limit (the GEMM) agrees within the linears' conformance tolerance.
        let (n, k) = (37, 203);
        let w = vals(n * k, 3);
        let w16: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let bias = vals(n, 4);
        let x = vals((DOT_MAX_ROWS + 3) * k, 5);
        let pool = ThreadPool::new(3);
        for rows in [Rows::F32(&w), Rows::Bf16(&w16)] {
            let run = |m: usize| {
                let mut out = vec![0f32; m * n];
                dense_linear(&pool, &x, m, rows, n, k, Some(&bias), &mut out);
                out
            };
            let alone: Vec<Vec<f32>> = (0..DOT_MAX_ROWS + 3)
                .map(|i| {
                    let mut out = vec![0f32; n];
                    let xi = &x[i * k..(i + 1) * k];
                    dense_linear(&pool, xi, 1, rows, n, k, Some(&bias), &mut out);
                    out
                })
                .collect();
            for m in 2..=DOT_MAX_ROWS {
                let batch = run(m);
                for (i, row) in batch.chunks(n).enumerate() {
                    let same = row
                        .iter()
                        .zip(&alone[i])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "row {i} of a batch of {m}");
                }
            }
            let m = DOT_MAX_ROWS + 3;
            let batch = run(m);
            let most = batch.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (i, row) in batch.chunks(n).enumerate() {
                for (a, b) in row.iter().zip(&alone[i]) {
                    assert!(
                        (a - b).abs() <= 2e-5 * most,
                        "row {i} of the GEMM's batch of {m}"
                    );
                }
            }
        }
    }
}
