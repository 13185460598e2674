//! The GEMM's x86 kernels (AVX-512 and AVX2 + FMA micro-kernels and 4-bit weight packing),
//! a part of [`super`]: their callers check the instruction set and the bounds.

use std::arch::x86_64::*;

/// [`super::Nf4Rows::pack`] for 32-column slivers, 16 columns at a time: each column's 8
/// bytes of a 16-value group gathered as two dwords, each nibble looked up in the code
/// table (`vpermps`) and multiplied by the column's scale, the same `code[q] * absmax`
/// product as the scalar loop; columns past `cols` are +0.
#[target_feature(enable = "avx512f")]
pub unsafe fn pack_nf4_512(
    w: &super::Nf4Rows,
    j0: usize,
    cols: usize,
    k0: usize,
    kc: usize,
    out: &mut [f32],
) {
    let table = _mm512_loadu_ps(w.code.as_ptr());
    let (k, per_row) = (w.k, w.k / w.bs);
    let nib = _mm512_set1_epi32(15);
    let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let o = out.as_mut_ptr();
    for h in 0..2 {
        let c0 = 16 * h;
        let valid = cols.saturating_sub(c0).min(16);
        let mask: __mmask16 = ((1u32 << valid) - 1) as __mmask16;
        // Byte offsets of the 16 rows from the first one's, and their first scale's index.
        let rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32((k / 2) as i32));
        let first = _mm512_mullo_epi32(lane, _mm512_set1_epi32(per_row as i32));
        let row0 = (j0 + c0) * k;
        let bytes = w.packed.as_ptr().wrapping_add((row0 + k0) / 2);
        let scales = w.absmax.as_ptr().wrapping_add((j0 + c0) * per_row);
        let mut block = usize::MAX;
        let mut scale = _mm512_setzero_ps();
        for g in 0..kc / 16 {
            let b = (k0 + 16 * g) / w.bs;
            if b != block {
                block = b;
                let idx = _mm512_add_epi32(first, _mm512_set1_epi32(b as i32));
                scale = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, idx, scales);
            }
            let at = bytes.wrapping_add(8 * g) as *const i32;
            let lo4 = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, rows, at);
            let hi4 = _mm512_mask_i32gather_epi32::<1>(
                _mm512_setzero_si512(),
                mask,
                rows,
                at.wrapping_byte_add(4),
            );
            let dst = o.add(16 * g * 32 + c0);
            for i in 0..8 {
                let word = if i < 4 { lo4 } else { hi4 };
                let byte = match i % 4 {
                    0 => word,
                    1 => _mm512_srli_epi32::<8>(word),
                    2 => _mm512_srli_epi32::<16>(word),
                    _ => _mm512_srli_epi32::<24>(word),
                };
                let hi = _mm512_and_si512(_mm512_srli_epi32::<4>(byte), nib);
                let lo = _mm512_and_si512(byte, nib);
                let vh = _mm512_maskz_mul_ps(mask, _mm512_permutexvar_ps(hi, table), scale);
                let vl = _mm512_maskz_mul_ps(mask, _mm512_permutexvar_ps(lo, table), scale);
                _mm512_storeu_ps(dst.add(i * 32), vh);
                _mm512_storeu_ps(dst.add((8 + i) * 32), vl);
            }
        }
    }
}

/// [`super::Nf4Rows::pack`] for 16-column slivers with AVX2, 8 columns at a time: as
/// [`pack_nf4_512`], the 16-entry lookup being two `vpermps` on the table's halves and a blend
/// on the code's bit 3; the same `code[q] * absmax` product, columns past `cols` +0.
#[target_feature(enable = "avx2")]
pub unsafe fn pack_nf4_256(
    w: &super::Nf4Rows,
    j0: usize,
    cols: usize,
    k0: usize,
    kc: usize,
    out: &mut [f32],
) {
    let (t0, t1) = (
        _mm256_loadu_ps(w.code.as_ptr()),
        _mm256_loadu_ps(w.code.as_ptr().add(8)),
    );
    let (k, per_row) = (w.k, w.k / w.bs);
    let nib = _mm256_set1_epi32(15);
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let o = out.as_mut_ptr();
    for h in 0..2 {
        let c0 = 8 * h;
        let valid = cols.saturating_sub(c0).min(8);
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid as i32), lane);
        let rows = _mm256_mullo_epi32(lane, _mm256_set1_epi32((k / 2) as i32));
        let first = _mm256_mullo_epi32(lane, _mm256_set1_epi32(per_row as i32));
        let bytes = w.packed.as_ptr().wrapping_add(((j0 + c0) * k + k0) / 2);
        let scales = w.absmax.as_ptr().wrapping_add((j0 + c0) * per_row);
        let mut block = usize::MAX;
        let mut scale = _mm256_setzero_ps();
        for g in 0..kc / 16 {
            let b = (k0 + 16 * g) / w.bs;
            if b != block {
                block = b;
                let idx = _mm256_add_epi32(first, _mm256_set1_epi32(b as i32));
                scale = _mm256_mask_i32gather_ps::<4>(
                    _mm256_setzero_ps(),
                    scales,
                    idx,
                    _mm256_castsi256_ps(mask),
                );
            }
            let at = bytes.wrapping_add(8 * g) as *const i32;
            let zero = _mm256_setzero_si256();
            let lo4 = _mm256_mask_i32gather_epi32::<1>(zero, at, rows, mask);
            let hi4 = _mm256_mask_i32gather_epi32::<1>(zero, at.wrapping_byte_add(4), rows, mask);
            let dst = o.add(16 * g * 16 + c0);
            let look = |q: __m256i| {
                let pick = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(q));
                let v = _mm256_blendv_ps(
                    _mm256_permutevar8x32_ps(t0, q),
                    _mm256_permutevar8x32_ps(t1, q),
                    pick,
                );
                _mm256_and_ps(_mm256_mul_ps(v, scale), _mm256_castsi256_ps(mask))
            };
            for i in 0..8 {
                let word = if i < 4 { lo4 } else { hi4 };
                let byte = match i % 4 {
                    0 => word,
                    1 => _mm256_srli_epi32::<8>(word),
                    2 => _mm256_srli_epi32::<16>(word),
                    _ => _mm256_srli_epi32::<24>(word),
                };
                let hi = _mm256_and_si256(_mm256_srli_epi32::<4>(byte), nib);
                let lo = _mm256_and_si256(byte, nib);
                _mm256_storeu_ps(dst.add(i * 16), look(hi));
                _mm256_storeu_ps(dst.add((8 + i) * 16), look(lo));
            }
        }
    }
}

/// [`super::pack_tile_in`] for AVX-512, `kc` a multiple of 16 and `rows <= mr <= 16`: 16 values
/// of each row at a time (in paired order when `paired`), transposed in registers, each step's
/// `rows` values stored as one masked run. Moves values only: the same tile as the scalar loop.
#[target_feature(enable = "avx512f")]
pub unsafe fn pack_tile_512(
    src: *const f32,
    ld: usize,
    rows: usize,
    kc: usize,
    mr: usize,
    dst: *mut f32,
    paired: bool,
) {
    debug_assert!(rows <= mr && mr <= 16 && kc.is_multiple_of(16));
    let order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    let keep = ((1u32 << rows) - 1) as __mmask16;
    for g in 0..kc / 16 {
        let r: [__m512; 16] = std::array::from_fn(|i| {
            if i < rows {
                let v = _mm512_loadu_ps(src.add(i * ld + 16 * g));
                if paired {
                    _mm512_permutexvar_ps(order, v)
                } else {
                    v
                }
            } else {
                _mm512_setzero_ps()
            }
        });
        for (kk, col) in transpose16(&r).iter().enumerate() {
            _mm512_mask_storeu_ps(dst.add((16 * g + kk) * mr), keep, *col);
        }
    }
}

/// [`super::DenseRows::pack`] for 32-column slivers, `kc` a multiple of 16: 16 values of each
/// of 16 rows at a time (bf16 widened exactly), transposed into the sliver's rows; columns past
/// `cols` are +0. `w` points at the rows (stride `k` elements).
#[target_feature(enable = "avx512f")]
pub unsafe fn pack_dense_512<const BF16: bool>(
    w: *const u8,
    k: usize,
    j0: usize,
    cols: usize,
    k0: usize,
    kc: usize,
    out: *mut f32,
) {
    debug_assert!(cols <= 32 && kc.is_multiple_of(16));
    for h in 0..2 {
        let c0 = 16 * h;
        let valid = cols.saturating_sub(c0).min(16);
        for g in 0..kc / 16 {
            let r: [__m512; 16] = std::array::from_fn(|i| {
                if i >= valid {
                    return _mm512_setzero_ps();
                }
                let at = (j0 + c0 + i) * k + k0 + 16 * g;
                if BF16 {
                    let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                        (w as *const u16).add(at) as *const __m256i
                    ));
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
                } else {
                    _mm512_loadu_ps((w as *const f32).add(at))
                }
            });
            let dst = out.add(16 * g * 32 + c0);
            for (kk, col) in transpose16(&r).iter().enumerate() {
                _mm512_storeu_ps(dst.add(kk * 32), *col);
            }
        }
    }
}

/// The 16 x 16 transpose: lane `j` of `r[i]` becomes lane `i` of the result's `j`. Pairs of rows
/// interleaved, then quads (`u[4q + c]` holds, in 128-bit lane L, rows 4q..4q+3 of column
/// 4L + c), then the 128-bit lanes gathered.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(r: &[__m512; 16]) -> [__m512; 16] {
    let t: [__m512; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    let u: [__m512; 16] = std::array::from_fn(|i| {
        let (q, c) = (i / 4, i % 4);
        let (a, b) = (
            _mm512_castps_pd(t[4 * q + c / 2]),
            _mm512_castps_pd(t[4 * q + c / 2 + 2]),
        );
        _mm512_castpd_ps(if c % 2 == 0 {
            _mm512_unpacklo_pd(a, b)
        } else {
            _mm512_unpackhi_pd(a, b)
        })
    });
    let mut out = [_mm512_setzero_ps(); 16];
    for c in 0..4 {
        let v0 = _mm512_shuffle_f32x4::<0x44>(u[c], u[4 + c]);
        let v1 = _mm512_shuffle_f32x4::<0xee>(u[c], u[4 + c]);
        let w0 = _mm512_shuffle_f32x4::<0x44>(u[8 + c], u[12 + c]);
        let w1 = _mm512_shuffle_f32x4::<0xee>(u[8 + c], u[12 + c]);
        out[c] = _mm512_shuffle_f32x4::<0x88>(v0, w0);
        out[4 + c] = _mm512_shuffle_f32x4::<0xdd>(v0, w0);
        out[8 + c] = _mm512_shuffle_f32x4::<0x88>(v1, w1);
        out[12 + c] = _mm512_shuffle_f32x4::<0xdd>(v1, w1);
    }
    out
}

/// [`super::pack_tile_in`] for AVX2, `kc` a multiple of 16 and `rows <= mr <= 8`: 16 values of
/// each row at a time (its evens then its odds when `paired`), transposed 8 x 8 in registers,
/// each step stored as one run of 8 (lanes past `rows` are left +0 or as they were; the
/// micro-kernel reads only `rows`). Moves values only.
#[target_feature(enable = "avx2")]
pub unsafe fn pack_tile_256(
    src: *const f32,
    ld: usize,
    rows: usize,
    kc: usize,
    mr: usize,
    dst: *mut f32,
    paired: bool,
) {
    debug_assert!(rows <= mr && mr <= 8 && kc.is_multiple_of(16));
    let keep = _mm256_cmpgt_epi32(
        _mm256_set1_epi32(rows as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    );
    for g in 0..kc / 16 {
        // The two halves of the group (positions 0-7 and 8-15) for every row.
        let mut lo = [_mm256_setzero_ps(); 8];
        let mut hi = [_mm256_setzero_ps(); 8];
        for i in 0..rows {
            let p = src.add(i * ld + 16 * g);
            let (a, b) = (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
            (lo[i], hi[i]) = if paired {
                // Evens then odds: [x0 x2 x8 x10 | x4 x6 x12 x14] put in order by qwords.
                let order = |v: __m256| {
                    _mm256_castpd_ps(_mm256_permute4x64_pd::<0xd8>(_mm256_castps_pd(v)))
                };
                (
                    order(_mm256_shuffle_ps::<0x88>(a, b)),
                    order(_mm256_shuffle_ps::<0xdd>(a, b)),
                )
            } else {
                (a, b)
            };
        }
        for (half, v) in [lo, hi].iter().enumerate() {
            for (kk, col) in transpose8(v).iter().enumerate() {
                let at = 16 * g + 8 * half + kk;
                if at * mr + 8 <= (kc - 1) * mr + rows {
                    // A whole store (masked ones are slow on some CPUs) where it stays inside
                    // the tile: lanes past `mr` fall on the next steps', written after it.
                    _mm256_storeu_ps(dst.add(at * mr), *col);
                } else {
                    _mm256_maskstore_ps(dst.add(at * mr), keep, *col);
                }
            }
        }
    }
}

/// [`super::DenseRows::pack`] for AVX2's 16-column slivers, `kc` a multiple of 8: 8 values of
/// each of 8 rows at a time (bf16 widened exactly), transposed into the sliver's rows; columns
/// past `cols` are +0. `w` points at the rows (stride `k` elements).
#[target_feature(enable = "avx2")]
pub unsafe fn pack_dense_256<const BF16: bool>(
    w: *const u8,
    k: usize,
    j0: usize,
    cols: usize,
    k0: usize,
    kc: usize,
    out: *mut f32,
) {
    debug_assert!(cols <= 16 && kc.is_multiple_of(8));
    for h in 0..2 {
        let c0 = 8 * h;
        let valid = cols.saturating_sub(c0).min(8);
        for g in 0..kc / 8 {
            let r: [__m256; 8] = std::array::from_fn(|i| {
                if i >= valid {
                    return _mm256_setzero_ps();
                }
                let at = (j0 + c0 + i) * k + k0 + 8 * g;
                if BF16 {
                    let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(
                        (w as *const u16).add(at) as *const __m128i
                    ));
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
                } else {
                    _mm256_loadu_ps((w as *const f32).add(at))
                }
            });
            let dst = out.add(8 * g * 16 + c0);
            for (kk, col) in transpose8(&r).iter().enumerate() {
                _mm256_storeu_ps(dst.add(kk * 16), *col);
            }
        }
    }
}

/// The 8 x 8 transpose: lane `j` of `r[i]` becomes lane `i` of the result's `j` (pairs of rows
/// interleaved, then quads, then the 128-bit halves gathered).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn transpose8(r: &[__m256; 8]) -> [__m256; 8] {
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // u[4q + c] holds, in 128-bit half L, rows 4q..4q+3 of column 4L + c.
    let u: [__m256; 8] = std::array::from_fn(|i| {
        let (q, c) = (i / 4, i % 4);
        let (a, b) = (t[4 * q + c / 2], t[4 * q + c / 2 + 2]);
        if c % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xee>(a, b)
        }
    });
    std::array::from_fn(|j| {
        let c = j % 4;
        if j < 4 {
            _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c])
        } else {
            _mm256_permute2f128_ps::<0x31>(u[c], u[4 + c])
        }
    })
}

/// `R x 32` tile, two zmm accumulators per row; `a` packed with rows `lda` apart per step.
/// The high halves' addresses are formed with `wrapping_add`: with 16 columns or fewer
/// every lane there is masked off and the address may lie past the allocation.
#[target_feature(enable = "avx512f")]
pub unsafe fn micro512<const R: usize>(
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    bmask: bool,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    load: bool,
    cols: usize,
) {
    let mask = if cols >= 32 {
        u32::MAX
    } else {
        (1u32 << cols) - 1
    };
    let (m0, m1) = (mask as __mmask16, (mask >> 16) as __mmask16);
    let mut lo = [_mm512_setzero_ps(); R];
    let mut hi = [_mm512_setzero_ps(); R];
    if load {
        for r in 0..R {
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(c.wrapping_add(r * ldc + 16) as *const i8);
        }
    }
    for kk in 0..kc {
        // The sliver and the tile a few steps ahead, from L2 into L1.
        _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add((kk + 10) * ldb) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add((kk + 10) * ldb + 16) as *const i8);
        let (b0, b1) = if bmask {
            (
                _mm512_maskz_loadu_ps(m0, b.add(kk * ldb)),
                _mm512_maskz_loadu_ps(m1, b.wrapping_add(kk * ldb + 16)),
            )
        } else {
            (
                _mm512_loadu_ps(b.add(kk * ldb)),
                _mm512_loadu_ps(b.wrapping_add(kk * ldb + 16)),
            )
        };
        for r in 0..R {
            let x = _mm512_set1_ps(*a.add(kk * lda + r));
            lo[r] = _mm512_fmadd_ps(x, b0, lo[r]);
            hi[r] = _mm512_fmadd_ps(x, b1, hi[r]);
        }
    }
    if load {
        for r in 0..R {
            lo[r] = _mm512_add_ps(lo[r], _mm512_maskz_loadu_ps(m0, c.add(r * ldc)));
            hi[r] = _mm512_add_ps(
                hi[r],
                _mm512_maskz_loadu_ps(m1, c.wrapping_add(r * ldc + 16)),
            );
        }
    }
    for r in 0..R {
        _mm512_mask_storeu_ps(c.add(r * ldc), m0, lo[r]);
        _mm512_mask_storeu_ps(c.wrapping_add(r * ldc + 16), m1, hi[r]);
    }
}

/// `R x 16` tile, two ymm accumulators per row.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn micro256<const R: usize>(
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    bmask: bool,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    load: bool,
    cols: usize,
) {
    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols.min(8) as i32), idx);
    let m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols.saturating_sub(8) as i32), idx);
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    if load {
        for r in 0..R {
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(c.wrapping_add(r * ldc + 8) as *const i8);
        }
    }
    for kk in 0..kc {
        let (b0, b1) = if bmask {
            (
                _mm256_maskload_ps(b.add(kk * ldb), m0),
                _mm256_maskload_ps(b.wrapping_add(kk * ldb + 8), m1),
            )
        } else {
            (
                _mm256_loadu_ps(b.add(kk * ldb)),
                _mm256_loadu_ps(b.wrapping_add(kk * ldb + 8)),
            )
        };
        for r in 0..R {
            let x = _mm256_broadcast_ss(&*a.add(kk * lda + r));
            lo[r] = _mm256_fmadd_ps(x, b0, lo[r]);
            hi[r] = _mm256_fmadd_ps(x, b1, hi[r]);
        }
    }
    if load {
        for r in 0..R {
            lo[r] = _mm256_add_ps(lo[r], _mm256_maskload_ps(c.add(r * ldc), m0));
            hi[r] = _mm256_add_ps(hi[r], _mm256_maskload_ps(c.wrapping_add(r * ldc + 8), m1));
        }
    }
    for r in 0..R {
        _mm256_maskstore_ps(c.add(r * ldc), m0, lo[r]);
        _mm256_maskstore_ps(c.wrapping_add(r * ldc + 8), m1, hi[r]);
    }
}
