//! The AVX2 + FMA kernels of [`super`] (the GEMV's decode, the dot tiles, the softmax's
//! exponential): intrinsics whose callers check AVX2/FMA and the bounds; an `unsafe` block
//! around each intrinsic call would add nothing.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

/// avx_mathfun's `exp256_ps` on 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::excessive_precision)]
unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(x, _mm256_set1_ps(88.376_262_664_794_9));
    let x = _mm256_max_ps(x, _mm256_set1_ps(-88.376_262_664_794_9));
    let fx = _mm256_fmadd_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    );
    let fx = _mm256_floor_ps(fx);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_375), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
    let z = _mm256_mul_ps(x, x);
    let mut y = _mm256_set1_ps(1.987_569_15e-4);
    for c in [
        1.398_199_950_7e-3,
        8.333_451_907_3e-3,
        4.166_579_589_4e-2,
        1.666_666_545_9e-1,
        5.000_000_120_1e-1,
    ] {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    }
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0));
    let n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
    _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)))
}

/// See [`super::exp_shifted`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_shifted(x: &mut [f32], m: f32) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let (vm, ninf) = (_mm256_set1_ps(m), _mm256_set1_ps(f32::NEG_INFINITY));
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_loadu_ps(p.add(i));
        let e = exp8(_mm256_sub_ps(v, vm));
        let e = _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), e);
        _mm256_storeu_ps(p.add(i), e);
        acc = _mm256_add_ps(acc, e);
        i += 8;
    }
    let mut sum = hsum(acc);
    if i < n {
        // The tail through the same lanes (padded with -inf, which give 0).
        let mut t = [f32::NEG_INFINITY; 8];
        t[..n - i].copy_from_slice(&x[i..]);
        let v = _mm256_loadu_ps(t.as_ptr());
        let e = exp8(_mm256_sub_ps(v, vm));
        let e = _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), e);
        _mm256_storeu_ps(t.as_mut_ptr(), e);
        x[i..].copy_from_slice(&t[..n - i]);
        sum += t[..n - i].iter().sum::<f32>();
    }
    sum
}

/// See [`super::sigmoid_gate`] (`x` and `out` of one length).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn sigmoid_gate(x: &[f32], s: f32, out: &mut [f32]) {
    let gate = |v: __m256| {
        let e = exp8(_mm256_sub_ps(
            _mm256_setzero_ps(),
            _mm256_mul_ps(_mm256_set1_ps(s), v),
        ));
        _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0), e))
    };
    let n = x.len();
    assert!(out.len() == n);
    let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(op.add(i), gate(_mm256_loadu_ps(xp.add(i))));
        i += 8;
    }
    if i < n {
        // The tail through the same lanes.
        let mut t = [0f32; 8];
        t[..n - i].copy_from_slice(&x[i..]);
        _mm256_storeu_ps(t.as_mut_ptr(), gate(_mm256_loadu_ps(t.as_ptr())));
        out[i..].copy_from_slice(&t[..n - i]);
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// The 8 code values of nibble `n` (0..8) of each 32-bit word of `v`: the word shifted so that
/// the nibble is in bits 0-3, looked up in the low and the high half of the table by its low 3
/// bits, the half chosen by its bit 3 (moved to the sign bit).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn nibble_values(v: __m256i, n: u32, lo: __m256, hi: __m256) -> __m256 {
    let idx = _mm256_srlv_epi32(v, _mm256_set1_epi32(4 * n as i32));
    let sel = _mm256_sllv_epi32(v, _mm256_set1_epi32(28 - 4 * n as i32));
    _mm256_blendv_ps(
        _mm256_permutevar8x32_ps(lo, idx),
        _mm256_permutevar8x32_ps(hi, idx),
        _mm256_castsi256_ps(sel),
    )
}

/// The absmax of each lane of chunk `c` (blocks of `bs`: a multiple of 64, or 32).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn chunk_scales(absmax: &[f32], c: usize, bs: usize) -> __m256 {
    if bs == 32 {
        _mm256_set_m128(_mm_set1_ps(absmax[2 * c + 1]), _mm_set1_ps(absmax[2 * c]))
    } else {
        _mm256_set1_ps(absmax[64 * c / bs])
    }
}

/// See [`super::q4_row_dots`] (activations unpaired).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn q4_row_dots<const M: usize>(row: &super::Q4Row, xp: &[&[f32]], out: &mut [f32]) {
    let xs: [*const f32; M] = super::gemv_rows(row, xp, out);
    let super::Q4Row {
        packed,
        absmax,
        bs,
        code,
    } = *row;
    let (lo, hi) = (
        _mm256_loadu_ps(code.as_ptr()),
        _mm256_loadu_ps(code.as_ptr().add(8)),
    );
    let p = packed.as_ptr();
    let k = absmax.len() * bs;
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    for c in 0..k / 64 {
        super::prefetch_ahead(p, 32 * c, absmax, 64 * c / bs);
        let v = _mm256_loadu_si256(p.add(32 * c) as *const __m256i);
        let mut chain = [[_mm256_setzero_ps(); 2]; M];
        for n in 0..8 {
            let w = nibble_values(v, n as u32, lo, hi);
            for m in 0..M {
                let x = _mm256_loadu_ps(xs[m].add(64 * c + 8 * n));
                chain[m][n % 2] = _mm256_fmadd_ps(w, x, chain[m][n % 2]);
            }
        }
        let scale = chunk_scales(absmax, c, bs);
        for m in 0..M {
            let s = _mm256_add_ps(chain[m][0], chain[m][1]);
            acc[m][c % 2] = _mm256_fmadd_ps(s, scale, acc[m][c % 2]);
        }
    }
    for m in 0..M {
        out[m] = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));
    }
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, slot) in acc.iter_mut().enumerate() {
            *slot = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 8 * j)),
                _mm256_loadu_ps(pb.add(i + 8 * j)),
                *slot,
            );
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i)),
            _mm256_loadu_ps(pb.add(i)),
            acc[0],
        );
        i += 8;
    }
    let mut s = hsum(_mm256_add_ps(
        _mm256_add_ps(acc[0], acc[1]),
        _mm256_add_ps(acc[2], acc[3]),
    ));
    while i < n {
        s += *pa.add(i) * *pb.add(i);
        i += 1;
    }
    s
}

/// 8 bf16 values at `p`, widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_bf16(p: *const u16) -> __m256 {
    let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
    _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
}

/// 8 weights from element `i` of f32 rows at `w`, or of bf16 ones with `BF16` (widened).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn load_row8<const BF16: bool>(w: *const u8, i: usize) -> __m256 {
    if BF16 {
        load_bf16((w as *const u16).add(i))
    } else {
        _mm256_loadu_ps((w as *const f32).add(i))
    }
}

/// Weight rows are f32 at `w`, or bf16 with `BF16` (widened as loaded).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_tile<const MR: usize, const NR: usize, const BF16: bool>(
    x: *const f32,
    xs: usize,
    w: *const u8,
    ws: usize,
    k: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let get = |i: usize| super::weight_at::<BF16>(w, i);
    // Two chains per output: groups of 8 at even multiples of 8 into the first, odd into
    // the second (the AVX-512 kernel's two halves), added before the horizontal sum.
    let mut acc = [[[_mm256_setzero_ps(); 2]; NR]; MR];
    // The group of 8 at `kk` into chain `c`.
    let group = |acc: &mut [[[__m256; 2]; NR]; MR], kk: usize, c: usize| {
        let wv: [__m256; NR] = std::array::from_fn(|j| load_row8::<BF16>(w, j * ws + kk));
        for (i, row) in acc.iter_mut().enumerate() {
            let xv = _mm256_loadu_ps(x.add(i * xs + kk));
            for j in 0..NR {
                row[j][c] = _mm256_fmadd_ps(xv, wv[j], row[j][c]);
            }
        }
    };
    let (k16, k8) = (k / 16 * 16, k / 8 * 8);
    let mut kk = 0;
    while kk < k16 {
        super::prefetch_rows::<BF16>(w, ws, NR, kk);
        group(&mut acc, kk, 0);
        group(&mut acc, kk + 8, 1);
        kk += 16;
    }
    if k8 > k16 {
        group(&mut acc, kk, 0);
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, a) in row.iter().enumerate() {
            let mut s = hsum(_mm256_add_ps(a[0], a[1]));
            for t in k8..k {
                s += *x.add(i * xs + t) * get(j * ws + t);
            }
            *out.add(i * out_stride + j) = s;
        }
    }
}
