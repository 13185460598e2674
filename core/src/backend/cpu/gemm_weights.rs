//! What the GEMM packs ([`super`]'s weight sources): the [`Weights`] trait and its two kinds,
//! 4-bit rows in bitsandbytes' layout ([`Nf4Rows`]) and dense f32 or bf16 rows ([`DenseRows`]),
//! each packed into slivers of `nr` columns with exactly the values the element formula gives.

#[cfg(target_arch = "x86_64")]
use super::{x86, Isa};

/// Weight rows the GEMM packs: `pack` writes columns `j0 .. j0 + cols` (`cols <= nr`) at
/// reduction positions `k0 .. k0 + kc` to `out[kk * nr + c]`, zeros in columns `cols .. nr`.
pub trait Weights: Sync {
    /// Packs one sliver.
    fn pack(&self, j0: usize, cols: usize, k0: usize, kc: usize, nr: usize, out: &mut [f32]);
    /// Asks the cache for the source bytes a later [`Weights::pack`] of the same arguments
    /// reads (a hint; nothing by default).
    fn prefetch(&self, _j0: usize, _cols: usize, _k0: usize, _kc: usize) {}
    /// The reduction length's granularity: block boundaries fall on multiples of it.
    fn k_step(&self) -> usize {
        1
    }
    /// Whether the packed reduction runs in [`super::super::kernels::pair_order`] (then the GEMM
    /// reads the activations in that order as it packs them: the caller passes them as they
    /// are; [`Weights::k_step`] must then be a multiple of 16).
    fn paired(&self) -> bool {
        false
    }
}

/// 4-bit rows in the paired order of [`super::super::kernels::pair_order`] (the GEMM reads the
/// activations the same way): for every 8 packed bytes, the 8 high nibbles then the 8 low nibbles; each value
/// `code[q] * absmax[block]` exactly as bitsandbytes dequantizes it.
pub struct Nf4Rows<'a> {
    /// `n * k / 2` packed bytes.
    pub packed: &'a [u8],
    /// One scale per `bs` elements.
    pub absmax: &'a [f32],
    /// Block size (a multiple of 16 that divides `k`).
    pub bs: usize,
    /// Row length.
    pub k: usize,
    /// The 16-entry code table.
    pub code: &'a [f32; 16],
}

impl Weights for Nf4Rows<'_> {
    fn pack(&self, j0: usize, cols: usize, k0: usize, kc: usize, nr: usize, out: &mut [f32]) {
        debug_assert!(k0.is_multiple_of(16) && kc.is_multiple_of(16) && cols <= nr);
        // 32-column slivers are AVX-512's, 16-column ones AVX2's (or the portable kernel's).
        // (The gathers' byte offsets, up to nr / 2 rows, are 32-bit.)
        #[cfg(target_arch = "x86_64")]
        if self.k.is_multiple_of(self.bs)
            && nr / 2 * self.k < 1 << 31
            && ((nr == 32 && Isa::Avx512.present()) || (nr == 16 && Isa::Avx2.present()))
        {
            assert!(
                (j0 + cols) * self.k <= 2 * self.packed.len()
                    && (j0 + cols) * (self.k / self.bs) <= self.absmax.len()
                    && k0 + kc <= self.k
                    && out.len() >= kc * nr
            );
            // SAFETY: the instruction set is present; the rows, scales and output are in
            // bounds (above).
            unsafe {
                if nr == 32 {
                    x86::pack_nf4_512(self, j0, cols, k0, kc, out)
                } else {
                    x86::pack_nf4_256(self, j0, cols, k0, kc, out)
                }
            };
            return;
        }
        self.pack_scalar(j0, cols, k0, kc, nr, out);
    }
    fn prefetch(&self, j0: usize, cols: usize, k0: usize, kc: usize) {
        // A layer's 4-bit rows are read once a pass, so they come cold from memory; packing
        // a sliver gathers 8 bytes from each of its rows at a time and would wait on every
        // line (measured: the gathers were 70% of the packing time before this hint).
        #[cfg(target_arch = "x86_64")]
        if kc > 0 {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            let hint = |p: *const u8| {
                // SAFETY: a prefetch is a hint that never faults (the callers' addresses are
                // in bounds anyway).
                unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
            };
            let (bytes, len) = (self.packed.as_ptr(), self.packed.len());
            for r in j0..j0 + cols {
                let (first, last) = ((r * self.k + k0) / 2, (r * self.k + k0 + kc - 1) / 2);
                if last >= len {
                    break;
                }
                for at in (first..=last).step_by(64).chain([last]) {
                    hint(bytes.wrapping_add(at));
                }
            }
            // The rows' scales for this reduction range lie in one run (rows are whole blocks).
            let per_row = self.k / self.bs;
            let first = j0 * per_row + k0 / self.bs;
            let last = ((j0 + cols) * per_row).min(self.absmax.len());
            let scales = self.absmax.as_ptr() as *const u8;
            for at in (first * 4..last * 4).step_by(64) {
                hint(scales.wrapping_add(at));
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (j0, cols, k0, kc);
    }
    fn k_step(&self) -> usize {
        16
    }
    fn paired(&self) -> bool {
        true
    }
}

impl Nf4Rows<'_> {
    /// [`Weights::pack`] one value at a time (any CPU, any sliver width).
    pub(super) fn pack_scalar(
        &self,
        j0: usize,
        cols: usize,
        k0: usize,
        kc: usize,
        nr: usize,
        out: &mut [f32],
    ) {
        for c in 0..cols {
            let base = (j0 + c) * self.k + k0;
            let mut block = usize::MAX;
            let mut scaled = [0f32; 16];
            for g in 0..kc / 16 {
                let e = base + 16 * g;
                if e / self.bs != block {
                    block = e / self.bs;
                    let a = self.absmax[block];
                    scaled = std::array::from_fn(|q| self.code[q] * a);
                }
                let bytes = &self.packed[e / 2..e / 2 + 8];
                let o = &mut out[16 * g * nr + c..];
                for (i, &byte) in bytes.iter().enumerate() {
                    o[i * nr] = scaled[(byte >> 4) as usize];
                    o[(8 + i) * nr] = scaled[(byte & 15) as usize];
                }
            }
        }
        zero_tail(cols, 0, kc, nr, out);
    }
}

/// Dense weight rows (stride `k`) in their own order, each element widened to f32 exactly as it
/// is read: f32 rows as they are ([`F32Rows`]), bf16 rows as a model stores them ([`Bf16Rows`]).
pub struct DenseRows<'a, T> {
    /// `n * k` values.
    pub w: &'a [T],
    /// Row length.
    pub k: usize,
}

/// An element type of dense weight rows, widened to f32 exactly (inlined in the packing loop).
pub trait Widen: Copy + Sync {
    /// Whether the elements are bf16 bits (else f32): the vector packing's choice.
    const BF16: bool;
    /// The value as f32.
    fn widen(self) -> f32;
}

impl Widen for f32 {
    const BF16: bool = false;
    fn widen(self) -> f32 {
        self
    }
}

/// bf16 bits (little-endian), as a model stores them.
impl Widen for u16 {
    const BF16: bool = true;
    fn widen(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
}

/// f32 weight rows.
pub type F32Rows<'a> = DenseRows<'a, f32>;
/// bf16 weight rows (the bits, little-endian).
pub type Bf16Rows<'a> = DenseRows<'a, u16>;

impl<'a, T> DenseRows<'a, T> {
    /// Rows of length `k`.
    pub fn new(w: &'a [T], k: usize) -> Self {
        DenseRows { w, k }
    }
}

impl<T: Widen> Weights for DenseRows<'_, T> {
    fn pack(&self, j0: usize, cols: usize, k0: usize, kc: usize, nr: usize, out: &mut [f32]) {
        // AVX-512's 32-column slivers 16 steps at a time, AVX2's 16-column ones 8 at a time;
        // the rest one value at a time.
        #[cfg(target_arch = "x86_64")]
        let done = {
            let wide = nr == 32 && Isa::Avx512.present();
            if (wide || nr == 16 && Isa::Avx2.present()) && cols <= nr {
                assert!((j0 + cols) * self.k <= self.w.len() && k0 + kc <= self.k);
                assert!(out.len() >= kc * nr);
                let done = if wide { kc / 16 * 16 } else { kc / 8 * 8 };
                let (w, o) = (self.w.as_ptr() as *const u8, out.as_mut_ptr());
                // SAFETY: the instruction set is present; rows j0..j0+cols, elements
                // k0..k0+done of each, and done x nr outputs are in bounds (above).
                unsafe {
                    match (wide, T::BF16) {
                        (true, true) => {
                            x86::pack_dense_512::<true>(w, self.k, j0, cols, k0, done, o)
                        }
                        (true, false) => {
                            x86::pack_dense_512::<false>(w, self.k, j0, cols, k0, done, o)
                        }
                        (false, true) => {
                            x86::pack_dense_256::<true>(w, self.k, j0, cols, k0, done, o)
                        }
                        (false, false) => {
                            x86::pack_dense_256::<false>(w, self.k, j0, cols, k0, done, o)
                        }
                    }
                }
                done
            } else {
                0
            }
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        for c in 0..cols {
            let row = &self.w[(j0 + c) * self.k + k0..][..kc];
            for (kk, &v) in row.iter().enumerate().skip(done) {
                out[kk * nr + c] = v.widen();
            }
        }
        zero_tail(cols, done, kc, nr, out);
    }
}

/// Zeros columns `cols..nr` of reduction steps `from..kc`.
fn zero_tail(cols: usize, from: usize, kc: usize, nr: usize, out: &mut [f32]) {
    if cols < nr {
        for kk in from..kc {
            out[kk * nr + cols..(kk + 1) * nr].fill(0.0);
        }
    }
}
