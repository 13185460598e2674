//! The CPU backend's blocked GEMM: `out[i][j] = sum_k a[i][k] * w[j][k] (+ bias[j])` for many
//! activation rows (prefill, DiT tokens), with the weight given as rows that are dequantized (4-bit)
//! into packed panels once per block and reused across every activation row.
//!
//! Blocking (per task, a range of columns or of rows): columns in blocks of [`NC`], the reduction
//! in blocks of [`KC`]; each `NC x KC` weight block is packed into slivers of `nr` columns
//! (`kc x nr`, column-contiguous per k, zero past the last column) that stay in L2; then each
//! tile of `mr` activation rows is packed (`kc x mr`, in L1) and the register-tiled micro-kernel
//! runs it against every sliver in turn. (The other order, a sliver in L1 against tiles from L2,
//! ran at ~0.45 of the FMA peak against ~0.65-0.7 for this one on a 2-core Sapphire Rapids.)
//!
//! Determinism: every output element is, per reduction block of [`KC`], one chain of fused
//! multiply-adds from +0 in one fixed order, and the blocks' sums are added in order
//! (`((b0 + b1) + b2) ...`). The vector width only decides how many columns are computed side by
//! side, so AVX-512, AVX2 + FMA and the portable path (`f32::mul_add`) give the same bits on
//! every CPU; the split across threads, row blocks and tiles does not change any sum either.
//! (Adding a block's sum at its end, not carrying the chain through `out`, lets the kernel
//! prefetch the output tile while it computes.)

use super::{split, Out, ThreadPool};

/// The most activation rows per micro-kernel tile (AVX-512's; AVX2's is 6: [`Isa::mr`]).
pub const MR: usize = 12;
/// Reduction elements per packed block: a tile of `KC x MR` stays in L1 (18 KiB), the block's
/// `NC x KC` weights in L2 (1.1 MiB), and the output is read and written once per `KC` of the
/// reduction. Part of the numerics (the chains are `KC` long): changing it changes results.
pub const KC: usize = 384;
/// Weight rows per packed block.
pub const NC: usize = 768;
/// Slivers between the one being packed and the one whose source bytes are asked for.
const PACK_AHEAD: usize = 2;

/// The instruction set the GEMM's micro-kernel uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// `f32::mul_add` loops: any CPU.
    Portable,
    /// 256-bit FMA: 16 columns per sliver.
    Avx2,
    /// 512-bit FMA: 32 columns per sliver.
    Avx512,
}

impl Isa {
    /// Its name in `describe` and the benches.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx512 => "avx512f",
        }
    }

    /// Columns per sliver.
    pub fn nr(self) -> usize {
        match self {
            Isa::Avx512 => 32,
            _ => 16,
        }
    }

    /// Activation rows per tile: 2 x `mr` accumulators plus the two weight vectors and a
    /// broadcast fill the register file (32 zmm, 16 ymm).
    pub fn mr(self) -> usize {
        match self {
            Isa::Avx512 => 12,
            _ => 6,
        }
    }

    /// Whether this CPU can run it.
    pub fn present(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every instruction set this CPU can run, widest first.
    pub fn all_present() -> Vec<Isa> {
        [Isa::Avx512, Isa::Avx2, Isa::Portable]
            .into_iter()
            .filter(|i| i.present())
            .collect()
    }

    /// Parses `avx512` (or `avx512f`), `avx2` or `portable`.
    pub fn parse(s: &str) -> Option<Isa> {
        match s.trim().to_ascii_lowercase().as_str() {
            "avx512" | "avx512f" | "avx-512" => Some(Isa::Avx512),
            "avx2" | "avx2+fma" => Some(Isa::Avx2),
            "portable" | "scalar" => Some(Isa::Portable),
            _ => None,
        }
    }
}

/// `NIBBLE_CPU_ISA` as this process was started with it, read once.
fn asked_isa() -> Option<&'static str> {
    use std::sync::OnceLock;
    static ASKED: OnceLock<Option<String>> = OnceLock::new();
    ASKED
        .get_or_init(|| std::env::var("NIBBLE_CPU_ISA").ok())
        .as_deref()
}

/// The GEMM's instruction set in this process: the widest the CPU has, or the one named by
/// `NIBBLE_CPU_ISA` (`avx512`, `avx512f`, `avx2`, `portable`) when the CPU has it, to test or
/// time a fallback. The results are the same bits either way.
pub fn isa() -> Isa {
    use std::sync::OnceLock;
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let best = Isa::all_present()[0];
        match asked_isa().map(Isa::parse) {
            Some(Some(asked)) if asked.present() => asked,
            Some(_) => {
                eprintln!(
                    "warning: NIBBLE_CPU_ISA is not one this CPU runs (avx512, avx512f, avx2, \
                     portable where present); using {}",
                    best.name()
                );
                best
            }
            None => best,
        }
    })
}

/// Bytes of packed operands one task keeps: `NC x KC` weights at the widest sliver and
/// one packed tile of `MR x KC` activations.
pub fn panel_bytes(k: usize) -> usize {
    (NC.div_ceil(32) * 32 + MR) * k.min(KC) * 4
}

// The weight sources: 4-bit and dense rows and how each is packed.
#[path = "gemm_weights.rs"]
mod weights;
pub use weights::{Bf16Rows, DenseRows, F32Rows, Nf4Rows, Weights, Widen};

thread_local! {
    static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out (m x n) = a (m x k) · wᵀ (+ bias)` on `pool`'s threads with the micro-kernel of `isa`
/// (which must be present). `a` and `out` are row-major and dense.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    pool: &ThreadPool,
    isa: Isa,
    a: &[f32],
    m: usize,
    k: usize,
    w: &dyn Weights,
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    assert!(
        isa.present(),
        "the GEMM's {} kernel needs a CPU that has it",
        isa.name()
    );
    assert!(a.len() >= m * k && out.len() >= m * n && k.is_multiple_of(w.k_step()));
    assert!(!w.paired() || w.k_step().is_multiple_of(16));
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // An empty sum: zeros, plus the bias.
        for row in out[..m * n].chunks_exact_mut(n) {
            match bias {
                Some(b) => row.copy_from_slice(&b[..n]),
                None => row.fill(0.0),
            }
        }
        return;
    }
    let nr = isa.nr();
    let threads = pool.threads();
    let tasks = if m * n * k < 1 << 18 { 1 } else { threads };
    // Columns across tasks when there are enough of them (each task packs only its own), else
    // rows (each task packs every column).
    let by_cols = n >= 2 * nr * tasks || m < isa.mr() * tasks;
    let o = Out(out.as_mut_ptr());
    pool.run(tasks, &|t| {
        let ((m0, m1), (n0, n1)) = if by_cols {
            ((0, m), split(n, tasks, t, nr))
        } else {
            (split(m, tasks, t, isa.mr()), (0, n))
        };
        if m0 >= m1 || n0 >= n1 {
            return;
        }
        PANEL.with(|p| {
            let mut panel = p.borrow_mut();
            let need = panel_bytes(k) / 4;
            if panel.len() < need {
                panel.resize(need, 0.0);
            }
            // SAFETY: rows m0..m1 x columns n0..n1 of `out` belong to this task only.
            unsafe { block(isa, a, k, w, (m0, m1), (n0, n1), o, n, &mut panel) };
        });
        if let Some(b) = bias {
            for i in m0..m1 {
                // SAFETY: as above.
                let row = unsafe { o.range(i * n + n0, n1 - n0) };
                for (v, &b) in row.iter_mut().zip(&b[n0..n1]) {
                    *v += b;
                }
            }
        }
    });
}

// `block`, `micro` and `portable` are pointer kernels whose callers own the bounds (each says
// what it needs); an `unsafe` block around every pointer step would add nothing.

/// Where paired position `p` takes its element from ([`super::kernels::pair_order`]): in each
/// 16, the 8 even positions, then the 8 odd ones.
#[inline(always)]
pub fn paired_source(p: usize) -> usize {
    let i = p & 15;
    (p & !15) + if i < 8 { 2 * i } else { 2 * (i - 8) + 1 }
}

/// Packs `rows` rows of `src` (stride `ld`), `kc` values each, as a micro-kernel tile:
/// `dst[kk * mr + r] = src[r * ld + kk]`.
pub(super) fn pack_tile(
    src: &[f32],
    ld: usize,
    rows: usize,
    kc: usize,
    mr: usize,
    dst: &mut [f32],
) {
    pack_tile_in(src, ld, rows, kc, mr, dst, false)
}

/// [`pack_tile`], reading each row in [`super::kernels::pair_order`] when `paired` (`kc` a
/// multiple of 16): `dst[kk * mr + r] = src[r * ld + pair(kk)]`. Written in `dst`'s order (one
/// contiguous run of `rows` per step, the rows read as `rows` streams): writing a row at a time
/// stores every `mr`-th value, and those partial-line writes cost a fifth of a whole GEMM.
fn pack_tile_in(
    src: &[f32],
    ld: usize,
    rows: usize,
    kc: usize,
    mr: usize,
    dst: &mut [f32],
    paired: bool,
) {
    if rows == 0 || kc == 0 {
        return;
    }
    assert!(rows <= mr && src.len() >= (rows - 1) * ld + kc && dst.len() >= (kc - 1) * mr + rows);
    assert!(!paired || kc.is_multiple_of(16));
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    let done = match isa() {
        Isa::Avx512 if mr <= 16 => {
            let done = kc / 16 * 16;
            // SAFETY: AVX-512F is present; rows <= mr <= 16 and the lengths are asserted above.
            unsafe { x86::pack_tile_512(s, ld, rows, done, mr, d, paired) };
            done
        }
        Isa::Avx2 if mr <= 8 => {
            let done = kc / 16 * 16;
            // SAFETY: AVX2 is present; rows <= mr <= 8 and the lengths are asserted above.
            unsafe { x86::pack_tile_256(s, ld, rows, done, mr, d, paired) };
            done
        }
        _ => 0,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for kk in done..kc {
        let from = if paired { paired_source(kk) } else { kk };
        for r in 0..rows {
            // SAFETY: r < rows and from < kc, within the lengths asserted above.
            unsafe { *d.add(kk * mr + r) = *s.add(r * ld + from) };
        }
    }
}

/// One task's rows and columns.
///
/// # Safety
/// `out` (row stride `ldc`) covers rows `m0..m1` by columns `n0..n1`, which no other task touches.
#[allow(clippy::too_many_arguments)]
#[allow(unsafe_op_in_unsafe_fn)]
unsafe fn block(
    isa: Isa,
    a: &[f32],
    k: usize,
    w: &dyn Weights,
    (m0, m1): (usize, usize),
    (n0, n1): (usize, usize),
    out: Out,
    ldc: usize,
    panel: &mut [f32],
) {
    let (nr, mr_max) = (isa.nr(), isa.mr());
    let (panel, apanel) = panel.split_at_mut(NC.div_ceil(nr) * nr * k.min(KC));
    for jc in (n0..n1).step_by(NC) {
        let nc = (n1 - jc).min(NC);
        let slivers = nc.div_ceil(nr);
        // Sliver `s < slivers`: its first column and its width.
        let sliver = |s: usize| (jc + s * nr, (nc - s * nr).min(nr));
        for pc in (0..k).step_by(KC) {
            let kc = (k - pc).min(KC);
            // The source of the sliver two ahead is asked for while this one is packed.
            for s in 0..PACK_AHEAD.min(slivers) {
                let (j, cols) = sliver(s);
                w.prefetch(j, cols, pc, kc);
            }
            for s in 0..slivers {
                if s + PACK_AHEAD < slivers {
                    let (j, cols) = sliver(s + PACK_AHEAD);
                    w.prefetch(j, cols, pc, kc);
                }
                let (j, cols) = sliver(s);
                w.pack(
                    j,
                    cols,
                    pc,
                    kc,
                    nr,
                    &mut panel[s * kc * nr..(s + 1) * kc * nr],
                );
            }
            // Row tile after row tile: its `kc x mr` activations packed into L1 (rows side by
            // side, as the micro-kernel reads them) and multiplied by every sliver of the
            // block, which streams from L2 (the next sliver's start is prefetched by the last
            // steps of the one before, since slivers lie end to end).
            for i in (m0..m1).step_by(mr_max) {
                let mr = (m1 - i).min(mr_max);
                pack_tile_in(&a[i * k + pc..], k, mr, kc, mr_max, apanel, w.paired());
                let ap = apanel.as_ptr();
                for s in 0..slivers {
                    let (j, cols) = sliver(s);
                    let b = panel[s * kc * nr..].as_ptr();
                    let cp = out.0.add(i * ldc + j);
                    // SAFETY: the packed tile holds kc x mr_max values, the sliver kc x nr;
                    // the output tile lies in this task's part of `out`.
                    micro(isa, mr, ap, b, nr, false, kc, cp, ldc, pc > 0, cols);
                }
            }
        }
    }
}

/// One `mr x cols` tile: `c = (load ? c + s : s)` where `s = a · b` is a chain of fused
/// multiply-adds from +0 in k order. Attention calls it too ([`super::attention`]).
///
/// # Safety
/// `isa` is present; `a` is a packed tile of `kc x isa.mr()` (row r of step kk at
/// `kk * isa.mr() + r`); `b` holds `kc` rows `ldb` apart, each of `nr` readable values, or of
/// `cols` when `bmask` (then only those are read); `c` has `mr` rows (stride `ldc`) of `cols`.
#[allow(unsafe_op_in_unsafe_fn)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn micro(
    isa: Isa,
    mr: usize,
    a: *const f32,
    b: *const f32,
    ldb: usize,
    bmask: bool,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    load: bool,
    cols: usize,
) {
    let lda = isa.mr();
    #[cfg(target_arch = "x86_64")]
    macro_rules! by_rows {
        ($f:ident) => {
            match mr {
                1 => x86::$f::<1>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
                2 => x86::$f::<2>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
                3 => x86::$f::<3>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
                4 => x86::$f::<4>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
                5 => x86::$f::<5>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
                6 => x86::$f::<6>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
                7 => x86::$f::<7>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
                8 => x86::$f::<8>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
                9 => x86::$f::<9>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
                10 => x86::$f::<10>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
                11 => x86::$f::<11>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
                _ => x86::$f::<12>(a, lda, b, ldb, bmask, kc, c, ldc, load, cols),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => by_rows!(micro512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if mr <= 6 => by_rows!(micro256),
        _ => {
            // The portable loop reads only the `cols` values of each row: no mask needed.
            let _ = bmask;
            portable(mr, a, lda, b, ldb, kc, c, ldc, load, cols)
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[allow(unsafe_op_in_unsafe_fn)]
/// # Safety
/// As [`micro`].
unsafe fn portable(
    mr: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    load: bool,
    cols: usize,
) {
    let mut acc = [0f32; 32];
    for r in 0..mr {
        let acc = &mut acc[..cols];
        acc.fill(0.0);
        for kk in 0..kc {
            let x = *a.add(kk * lda + r);
            let row = std::slice::from_raw_parts(b.add(kk * ldb), cols);
            for (v, &w) in acc.iter_mut().zip(row) {
                *v = x.mul_add(w, *v);
            }
        }
        for (j, &v) in acc.iter().enumerate() {
            let o = c.add(r * ldc + j);
            *o = if load { *o + v } else { v };
        }
    }
}

// Intrinsics kernels whose callers check the instruction set and the bounds.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn, clippy::too_many_arguments)]
#[path = "gemm_x86.rs"]
mod x86;

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Deterministic test values in [-0.5, 0.5) (a linear congruential sequence from `seed`).
    pub(crate) fn vals(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// The element formula: per block of KC, one fused multiply-add chain from +0 in k order;
    /// the blocks' sums added in order.
    fn chain(a: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut total = 0f32;
                for k0 in (0..k).step_by(KC) {
                    let mut s = 0f32;
                    for kk in k0..(k0 + KC).min(k) {
                        s = a[i * k + kk].mul_add(w[j * k + kk], s);
                    }
                    total = if k0 == 0 { s } else { total + s };
                }
                out[i * n + j] = total;
            }
        }
        out
    }

    #[test]
    fn every_instruction_set_gives_the_chain_bit_for_bit() {
        let pool = ThreadPool::global();
        // Edges in every direction: rows not a multiple of MR, columns not a multiple of
        // any sliver or NC, reductions over several KC blocks with a short last one.
        for &(m, n, k) in &[
            (1, 1, 16),
            (7, 33, 48),
            (590, 40, KC + 16),
            (13, NC + 32, 2 * KC + 16),
            (30, 70, 272),
        ] {
            let (a, w) = (vals(m * k, 1), vals(n * k, 2));
            let want = chain(&a, &w, m, n, k);
            for isa in Isa::all_present() {
                let mut out = vec![f32::NAN; m * n];
                gemm(pool, isa, &a, m, k, &F32Rows::new(&w, k), n, None, &mut out);
                let same = out
                    .iter()
                    .zip(&want)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{} differs from the chain at {m}x{n}x{k}", isa.name());
            }
        }
    }

    #[test]
    fn nf4_panels_hold_bitsandbytes_values_in_paired_order() {
        // One reduction block, and three (pairing restarts at each) with rows over a tile.
        for (n, k, m) in [(37, 256, 9), (20, 2 * KC + 64, 30)] {
            nf4_case(n, k, m);
        }
    }

    /// Packed codes, scales and a code table for `n` rows of `k` in blocks of `bs`.
    struct Nf4Data {
        packed: Vec<u8>,
        absmax: Vec<f32>,
        code: [f32; 16],
        bs: usize,
        k: usize,
    }

    impl Nf4Data {
        fn new(n: usize, k: usize, bs: usize, seed: u32) -> Self {
            Nf4Data {
                packed: (0..n * k / 2)
                    .map(|i| (i as u32 * (37 + 114 * seed) + 11 - 4 * seed) as u8)
                    .collect(),
                absmax: vals(n * k / bs, 3 + 5 * seed),
                code: std::array::from_fn(|i| i as f32 / 7.5 - 1.0),
                bs,
                k,
            }
        }
        fn rows(&self) -> Nf4Rows<'_> {
            Nf4Rows {
                packed: &self.packed,
                absmax: &self.absmax,
                bs: self.bs,
                k: self.k,
                code: &self.code,
            }
        }
    }

    fn nf4_case(n: usize, k: usize, m: usize) {
        let bs = 64;
        let data = Nf4Data::new(n, k, bs, 0);
        let (packed, absmax, code, w) = (&data.packed, &data.absmax, &data.code, data.rows());
        // Dequantized rows by the element formula.
        let mut rows = vec![0f32; n * k];
        for e in 0..n * k {
            let byte = packed[e / 2];
            let q = if e % 2 == 0 { byte >> 4 } else { byte & 15 };
            rows[e] = code[q as usize] * absmax[e / bs];
        }
        let pair = |x: &[f32]| {
            let mut p = vec![0f32; x.len()];
            super::super::kernels::pair_order(x, &mut p);
            p
        };
        // The GEMM takes the activations as they are and reads them paired, as the weights.
        let a = vals(m * k, 4);
        let want = chain(&pair(&a), &pair(&rows), m, n, k);
        let bias = vals(n, 5);
        for isa in Isa::all_present() {
            let mut out = vec![0f32; m * n];
            gemm(
                ThreadPool::global(),
                isa,
                &a,
                m,
                k,
                &w,
                n,
                Some(&bias),
                &mut out,
            );
            for i in 0..m * n {
                assert_eq!(
                    out[i].to_bits(),
                    (want[i] + bias[i % n]).to_bits(),
                    "{}",
                    isa.name()
                );
            }
        }
    }

    #[test]
    fn the_vector_nf4_packing_equals_the_scalar_one() {
        // Block sizes of one group, several per block, one per row; slivers full and ragged,
        // at the first column and further in, reductions from the start and from inside.
        for &(n, k, bs) in &[(70, 256, 64), (33, 96, 16), (40, 512, 512), (64, 1024, 128)] {
            let data = Nf4Data::new(n, k, bs, 1);
            let w = data.rows();
            for &(j0, cols) in &[(0, 32), (n - 5, 5), (n - 20, 20), (1, 16)] {
                // AVX-512's 32-column slivers and AVX2's 16 (each where the CPU has it).
                for nr in [32, 16] {
                    let cols = cols.min(nr);
                    for &(k0, kc) in &[(0, k), (16, k - 32), (k - 16, 16)] {
                        let mut want = vec![f32::NAN; kc * nr];
                        w.pack_scalar(j0, cols, k0, kc, nr, &mut want);
                        let mut got = vec![f32::NAN; kc * nr];
                        w.pack(j0, cols, k0, kc, nr, &mut got);
                        let same = want
                            .iter()
                            .zip(&got)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{nr} wide, {n}x{k}/{bs}, columns {j0}+{cols}, reduction {k0}+{kc}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn activation_tiles_hold_each_row_in_the_micro_kernels_order() {
        // Every row count up to the widest tile, paired and plain, reductions of whole groups
        // of 16 and (plain only) ragged ones; lanes past `rows` are +0 or left as they were. The
        // dispatch (this process's instruction set), then each vector kernel the CPU has.
        type Pack<'a> = &'a dyn Fn(&[f32], usize, usize, usize, usize, &mut [f32], bool);
        let ld = 421;
        let src = vals(16 * ld, 9);
        let check = |pack: Pack, mrs: &[usize], whole: bool, what: &str| {
            for &mr in mrs {
                for rows in 1..=mr {
                    for paired in [false, true] {
                        for kc in [16usize, 48, 384, 400, 7, 37] {
                            if (paired || whole) && !kc.is_multiple_of(16) {
                                continue;
                            }
                            // A guard past the tile: nothing may be written there.
                            let mut got = vec![f32::NAN; kc * mr + 16];
                            pack(&src, ld, rows, kc, mr, &mut got[..kc * mr], paired);
                            assert!(
                                got[kc * mr..].iter().all(|v| v.is_nan()),
                                "{what}: past the tile"
                            );
                            for kk in 0..kc {
                                let from = if paired { paired_source(kk) } else { kk };
                                for r in 0..mr {
                                    let v = got[kk * mr + r];
                                    // Lanes past `rows` are never read: +0 or untouched.
                                    let ok = if r < rows {
                                        v.to_bits() == src[r * ld + from].to_bits()
                                    } else {
                                        v.is_nan() || v.to_bits() == 0
                                    };
                                    assert!(ok, "{what}: mr {mr}, rows {rows}, paired {paired}, kc {kc}: [{kk}][{r}]");
                                }
                            }
                        }
                    }
                }
            }
        };
        check(
            &|s, ld, rows, kc, mr, d, p| pack_tile_in(s, ld, rows, kc, mr, d, p),
            &[6, 12, 16],
            false,
            "dispatch",
        );
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::Avx512.present() {
                // SAFETY: AVX-512F is present; the buffers hold rows x ld and kc x mr values.
                let f = |s: &[f32], ld, rows, kc, mr, d: &mut [f32], p| unsafe {
                    x86::pack_tile_512(s.as_ptr(), ld, rows, kc, mr, d.as_mut_ptr(), p)
                };
                check(&f, &[6, 12, 16], true, "avx512");
            }
            if Isa::Avx2.present() {
                // SAFETY: as above, with AVX2.
                let f = |s: &[f32], ld, rows, kc, mr, d: &mut [f32], p| unsafe {
                    x86::pack_tile_256(s.as_ptr(), ld, rows, kc, mr, d.as_mut_ptr(), p)
                };
                check(&f, &[6, 8], true, "avx2");
            }
        }
    }

    #[test]
    fn dense_slivers_hold_each_weight_widened_exactly() {
        // f32 and bf16 rows; 32-column slivers (AVX-512's vector packing where the CPU has it)
        // and 16; full and ragged columns; reductions of whole groups of 16 and ragged ones,
        // from the start and from inside a row.
        let (n, k) = (45, 203);
        let w = vals(n * k, 11);
        let w16: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let check = |rows: &dyn Weights, widen: &dyn Fn(usize) -> f32, what: &str| {
            for nr in [32, 16] {
                for &(j0, cols) in &[(0, nr), (n - 13, 13), (7, nr.min(20))] {
                    for &(k0, kc) in &[(0, 192), (5, 37), (16, 187), (200, 3)] {
                        let mut got = vec![f32::NAN; kc * nr];
                        rows.pack(j0, cols, k0, kc, nr, &mut got);
                        for kk in 0..kc {
                            for c in 0..nr {
                                let want = if c < cols {
                                    widen((j0 + c) * k + k0 + kk)
                                } else {
                                    0.0
                                };
                                assert_eq!(
                                    got[kk * nr + c].to_bits(),
                                    want.to_bits(),
                                    "{what}, {nr} wide, columns {j0}+{cols}, reduction {k0}+{kc}: [{kk}][{c}]"
                                );
                            }
                        }
                    }
                }
            }
        };
        check(&F32Rows::new(&w, k), &|i| w[i], "f32");
        check(
            &Bf16Rows::new(&w16, k),
            &|i| f32::from_bits((w16[i] as u32) << 16),
            "bf16",
        );
    }

    #[test]
    fn bf16_rows_are_widened_exactly() {
        let (m, n, k) = (8, 40, 64);
        let w = vals(n * k, 6);
        let w16: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let wide: Vec<f32> = w16
            .iter()
            .map(|&b| f32::from_bits((b as u32) << 16))
            .collect();
        let a = vals(m * k, 7);
        let want = chain(&a, &wide, m, n, k);
        let mut out = vec![0f32; m * n];
        let rows = Bf16Rows::new(&w16, k);
        gemm(
            ThreadPool::global(),
            isa(),
            &a,
            m,
            k,
            &rows,
            n,
            None,
            &mut out,
        );
        assert!(out
            .iter()
            .zip(&want)
            .all(|(x, y)| x.to_bits() == y.to_bits()));
    }
}
