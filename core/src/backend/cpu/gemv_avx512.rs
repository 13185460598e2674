//! The AVX-512 GEMVs: the 4-bit one ([`super::q4_row_dots_avx512`]: one kernel body, two
//! decodes of 32 codes, AVX-512F's permutes and VBMI's `multishift`) and the dense f32 / bf16
//! dot tiles ([`super::dot_tile_rows`]), each with the AVX2 kernel's sums in the same lanes and
//! order.

#![allow(unsafe_op_in_unsafe_fn)]

use super::LANE_ORDER;
use std::arch::x86_64::*;

/// For lane-order positions 0..15 and 16..31 of a chunk: where its element's code sits in
/// `permutex2var(high nibbles, sel, low nibbles)` (byte e / 2; the high nibble for even e,
/// as bitsandbytes packs them).
const SELECTORS: [[i32; 16]; 2] = {
    let mut s = [[0i32; 16]; 2];
    let mut p = 0;
    while p < 32 {
        let e = LANE_ORDER[p];
        s[p / 16][p % 16] = (e / 2) as i32 + if e % 2 == 1 { 16 } else { 0 };
        p += 1;
    }
    s
};

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

/// For VBMI's `multishift`: per 32-bit lane of `w01` (0) and `w23` (1), the bit offset of its
/// element's nibble inside the 64-bit lane it sits in, where [`vbmi_bytes`] put the code
/// bytes: byte `e / 2` of the chunk at byte `(e / 2) % 8` of the qword (qwords 0, 1, 4, 5
/// hold bytes 0-7, the others 8-15), the high nibble for even `e`.
const SHIFTS: [[u8; 64]; 2] = {
    let mut s = [[0u8; 64]; 2];
    let mut p = 0;
    while p < 32 {
        let e = LANE_ORDER[p];
        s[p / 16][4 * (p % 16)] = (8 * ((e / 2) % 8) + if e % 2 == 1 { 0 } else { 4 }) as u8;
        p += 1;
    }
    s
};

/// The 16 code bytes at `ptr` as qwords [A, A, B, B, A, A, B, B] (A bytes 0-7, B 8-15):
/// a broadcast load and a masked broadcast load, no shuffle-port work. (Written out, because
/// LLVM folds two broadcasts and a blend into a two-source permute, a shuffle that costs a
/// fifth of the GEMV's time on AMD Zen 4.)
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn vbmi_bytes(ptr: *const u8) -> __m512i {
    let r: __m512i;
    std::arch::asm!(
        "vpbroadcastq {r}, qword ptr [{p}]",
        "vpbroadcastq {r} {{{k}}}, qword ptr [{p} + 8]",
        r = out(zmm_reg) r,
        k = in(kreg) 0b1100_1100u8,
        p = in(reg) ptr,
        options(pure, readonly, nostack, preserves_flags),
    );
    r
}

/// The AVX-512 GEMV over one decode of 32 codes at a time: `$decode` turns `$ptr` (the
/// chunk's 16 code bytes) into the lane-ordered weights `(w01, w23)`, from what `$setup`
/// prepared (with `$table`, the code table in a register).
macro_rules! row_dots {
    ($(#[$meta:meta])* $name:ident, $table:ident, [$($setup:tt)*], |$ptr:ident| $decode:expr) => {
        $(#[$meta])*
        pub unsafe fn $name<const M: usize>(
            packed: &[u8],
            absmax: &[f32],
            bs: usize,
            code: &[f32; 16],
            xp: &[&[f32]],
            out: &mut [f32],
        ) {
            let xs: [*const f32; M] = super::gemv_rows(packed, absmax, bs, xp, out);
            let $table = _mm512_loadu_ps(code.as_ptr());
            $($setup)*
            let p = packed.as_ptr();
            // The AVX2 kernel's chains: four 8-lane ones for one row (here two 16-lane:
            // [0|1], [2|3]), two for two rows (one 16-lane: [0|1]), one for more (8 lanes,
            // as there).
            let mut acc = [_mm256_setzero_ps(); M];
            // One and two rows: the AVX2 kernel's two scaled accumulators side by side.
            let mut accz = [_mm512_setzero_ps(); M];
            for b in 0..absmax.len() {
                // The scale is read where it is used, so that it reaches the FMA as an
                // embedded broadcast rather than through a shuffle.
                let a = absmax.as_ptr().add(b);
                // The codes and scales ahead (see GEMV_PREFETCH).
                super::prefetch_ahead(p, absmax, b, bs);
                let mut z = [[_mm512_setzero_ps(); 2]; M];
                let mut y = [_mm256_setzero_ps(); M];
                for c in 0..bs / 32 {
                    let off = b * bs + c * 32;
                    let $ptr = p.add(off / 2);
                    let (w01, w23): (__m512, __m512) = $decode;
                    for m in 0..M {
                        let x = xs[m].add(off);
                        match M {
                            1 => {
                                z[m][0] = _mm512_fmadd_ps(w01, _mm512_loadu_ps(x), z[m][0]);
                                z[m][1] =
                                    _mm512_fmadd_ps(w23, _mm512_loadu_ps(x.add(16)), z[m][1]);
                            }
                            2 => {
                                z[m][0] = _mm512_fmadd_ps(w01, _mm512_loadu_ps(x), z[m][0]);
                                z[m][0] =
                                    _mm512_fmadd_ps(w23, _mm512_loadu_ps(x.add(16)), z[m][0]);
                            }
                            _ => {
                                let (w0, w1) = halves(w01);
                                let (w2, w3) = halves(w23);
                                for (j, w) in [w0, w1, w2, w3].into_iter().enumerate() {
                                    y[m] = _mm256_fmadd_ps(
                                        w,
                                        _mm256_loadu_ps(x.add(8 * j)),
                                        y[m],
                                    );
                                }
                            }
                        }
                    }
                }
                for m in 0..M {
                    match M {
                        1 => {
                            let t = _mm512_add_ps(z[m][0], z[m][1]);
                            accz[m] = _mm512_fmadd_ps(t, _mm512_set1_ps(*a), accz[m]);
                        }
                        2 => accz[m] = _mm512_fmadd_ps(z[m][0], _mm512_set1_ps(*a), accz[m]),
                        _ => acc[m] = _mm256_fmadd_ps(y[m], _mm256_set1_ps(*a), acc[m]),
                    }
                }
            }
            for m in 0..M {
                out[m] = if M <= 2 {
                    hsum_halves(accz[m])
                } else {
                    super::avx2::hsum(acc[m])
                };
            }
        }
    };
}

row_dots!(
    /// AVX-512F: the bytes widened to 32-bit lanes, the nibbles split and interleaved into
    /// lane order by two two-source permutes, then two table lookups.
    #[target_feature(enable = "avx512f,avx2,fma")]
    q4_row_dots,
    table,
    [
        let sel0 = _mm512_loadu_si512(SELECTORS[0].as_ptr() as *const _);
        let sel1 = _mm512_loadu_si512(SELECTORS[1].as_ptr() as *const _);
        let m4 = _mm512_set1_epi32(15);
    ],
    |ptr| {
        let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(ptr as *const __m128i));
        let hi = _mm512_srli_epi32::<4>(bytes);
        let lo = _mm512_and_si512(bytes, m4);
        (
            _mm512_permutexvar_ps(_mm512_permutex2var_epi32(hi, sel0, lo), table),
            _mm512_permutexvar_ps(_mm512_permutex2var_epi32(hi, sel1, lo), table),
        )
    }
);

row_dots!(
    /// AVX-512 VBMI: each lane's nibble moved into its low bits by one `multishift` per 16
    /// codes (from the broadcast bytes of [`vbmi_bytes`]; the lookup reads only bits 0-3),
    /// then the table lookups: four shuffle-port operations per 32 codes instead of five.
    #[target_feature(enable = "avx512f,avx512vbmi,avx2,fma")]
    q4_row_dots_vbmi,
    table,
    [
        let shift0 = _mm512_loadu_si512(SHIFTS[0].as_ptr() as *const _);
        let shift1 = _mm512_loadu_si512(SHIFTS[1].as_ptr() as *const _);
    ],
    |ptr| {
        let bytes = vbmi_bytes(ptr);
        (
            _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(shift0, bytes), table),
            _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(shift1, bytes), table),
        )
    }
);

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
