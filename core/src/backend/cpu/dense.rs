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
