//! The AVX-512 GEMVs: the 4-bit one ([`super::q4_row_dots_avx512`]: two chunks of 64 codes per
//! 512-bit load, each nibble by a shift and one 16-entry table lookup) and the dense f32 / bf16
//! dot tiles ([`super::dot_tile_rows`]), each with the AVX2 kernel's sums in the same lanes and
//! order.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn halves(z: __m512) -> (__m256, __m256) {
    (
        _mm512_castps512_ps256(z),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(z))),
    )
}

/// The AVX2 kernels' final sum of two 8-lane accumulators held as the halves of `z`: the halves
/// added, then the horizontal sum.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn hsum_halves(z: __m512) -> f32 {
    let (lo, hi) = halves(z);
    super::avx2::hsum(_mm256_add_ps(lo, hi))
}

/// The absmax of each lane of chunks `2p` (lanes 0-7) and `2p + 1` (lanes 8-15): the AVX2
/// kernel's per-chunk scales side by side.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn pair_scales(absmax: &[f32], p: usize, bs: usize) -> __m512 {
    let even = _mm512_castps256_ps512(super::avx2::chunk_scales(absmax, 2 * p, bs));
    let odd = super::avx2::chunk_scales(absmax, 2 * p + 1, bs);
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castps_pd(even),
        _mm256_castps_pd(odd),
    ))
}

/// See [`super::q4_row_dots`] (activations paired): the AVX2 kernel's two 8-lane accumulators
/// (even and odd chunks) are the two halves of one register, and a 64-byte load holds the words
/// of an even chunk and the odd one after it; a last unpaired chunk goes through the low half
/// only.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn q4_row_dots<const M: usize>(row: &super::Q4Row, xp: &[&[f32]], out: &mut [f32]) {
    let xs: [*const f32; M] = super::gemv_rows(row, xp, out);
    let super::Q4Row {
        packed,
        absmax,
        bs,
        code,
    } = *row;
    let table = _mm512_loadu_ps(code.as_ptr());
    let p = packed.as_ptr();
    let chunks = absmax.len() * bs / 64;
    let mut acc = [_mm512_setzero_ps(); M];
    // One pair of chunks (`half`: only the even one, at the unpaired position) into the
    // accumulators: each nibble's 16 values by a shift and a lookup (bits 0-3 of each lane).
    let mut pair = |pi: usize, half: bool| {
        let c = 2 * pi;
        super::prefetch_ahead(p, 32 * c, absmax, 64 * c / bs);
        let (v, lanes) = if half {
            let v = _mm256_loadu_si256(p.add(32 * c) as *const __m256i);
            (_mm512_castsi256_si512(v), 0x00ff)
        } else {
            (_mm512_loadu_si512(p.add(32 * c) as *const _), 0xffff)
        };
        let mut chain = [[_mm512_setzero_ps(); 2]; M];
        for n in 0..8 {
            let idx = _mm512_srlv_epi32(v, _mm512_set1_epi32(4 * n as i32));
            let w = _mm512_permutexvar_ps(idx, table);
            for m in 0..M {
                let x = if half {
                    _mm512_maskz_loadu_ps(lanes, xs[m].add(64 * c + 8 * n))
                } else {
                    _mm512_loadu_ps(xs[m].add(128 * pi + 16 * n))
                };
                chain[m][n % 2] = _mm512_fmadd_ps(w, x, chain[m][n % 2]);
            }
        }
        let scale = if half {
            _mm512_castps256_ps512(super::avx2::chunk_scales(absmax, c, bs))
        } else {
            pair_scales(absmax, pi, bs)
        };
        for m in 0..M {
            let s = _mm512_add_ps(chain[m][0], chain[m][1]);
            acc[m] = _mm512_mask3_fmadd_ps(s, scale, acc[m], lanes);
        }
    };
    for pi in 0..chunks / 2 {
        pair(pi, false);
    }
    if chunks % 2 == 1 {
        pair(chunks / 2, true);
    }
    for m in 0..M {
        out[m] = hsum_halves(acc[m]);
    }
}

/// 16 bf16 values at `p`, widened to f32.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn load_bf16x16(p: *const u16) -> __m512 {
    let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
}

/// The AVX2 `dot_tile` with 16 lanes: its two chains per output (groups of 8 at even and odd
/// multiples of 8) are the two halves of one accumulator, so the sums and their order are the
/// AVX2 kernel's, bit for bit.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn dot_tile<const MR: usize, const NR: usize, const BF16: bool>(
    x: *const f32,
    xs: usize,
    w: *const u8,
    ws: usize,
    k: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let load16 = |i: usize| {
        if BF16 {
            load_bf16x16((w as *const u16).add(i))
        } else {
            _mm512_loadu_ps((w as *const f32).add(i))
        }
    };
    let get = |i: usize| super::weight_at::<BF16>(w, i);
    let mut acc = [[_mm512_setzero_ps(); NR]; MR];
    let k16 = k / 16 * 16;
    let k8 = k / 8 * 8;
    let mut kk = 0;
    while kk < k16 {
        super::prefetch_rows::<BF16>(w, ws, NR, kk);
        let wv: [__m512; NR] = std::array::from_fn(|j| load16(j * ws + kk));
        for (i, row) in acc.iter_mut().enumerate() {
            let xv = _mm512_loadu_ps(x.add(i * xs + kk));
            for j in 0..NR {
                row[j] = _mm512_fmadd_ps(xv, wv[j], row[j]);
            }
        }
        kk += 16;
    }
    if k8 > k16 {
        // One more group of 8, at an even multiple of 8: the first chain, the low half.
        for (i, row) in acc.iter_mut().enumerate() {
            let xv = _mm256_loadu_ps(x.add(i * xs + kk));
            for (j, a) in row.iter_mut().enumerate() {
                let w8 = super::avx2::load_row8::<BF16>(w, j * ws + kk);
                let lo = _mm256_fmadd_ps(xv, w8, _mm512_castps512_ps256(*a));
                *a = _mm512_mask_blend_ps(0x00ff, *a, _mm512_castps256_ps512(lo));
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, a) in row.iter().enumerate() {
            let mut s = hsum_halves(*a);
            for t in k8..k {
                s += *x.add(i * xs + t) * get(j * ws + t);
            }
            *out.add(i * out_stride + j) = s;
        }
    }
}
