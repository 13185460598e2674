//! The optimized CPU path's inner loops: AVX2 + FMA on x86-64 (detected at run time), portable
//! loops elsewhere. Every decoded 4-bit weight is exactly bitsandbytes' dequantized value
//! (`code[q] * absmax` in f32); only the order of the f32 sums differs from `cpu_ref`.
//!
//! 4-bit rows are handled in a "paired" element order: for every 8 packed bytes (16 elements),
//! the 8 high nibbles (elements 0, 2, .., 14) then the 8 low nibbles (1, 3, .., 15); the GEMM
//! reads activations in that order as it packs them, so a dot product needs no shuffles. (The
//! GEMV decodes 32-bit words of codes by shifts instead and permutes its few activation rows
//! into that order once per call: [`nibble_order`].)

/// Whether the AVX2 + FMA paths can run here.
pub fn have_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAVE: OnceLock<bool> = OnceLock::new();
        *HAVE.get_or_init(|| {
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// How far ahead the 4-bit GEMVs prefetch their packed codes, in bytes (their scales as many
/// blocks ahead as there are bytes / 8): past the end of a row, the next one, which follows it in
/// memory. A row of a small matrix (SmolLM2's 576 x 576 is 288 bytes a row) is too short a
/// stream for the hardware prefetcher to hide memory's latency: with it, SmolLM2 decodes ~15%
/// faster.
pub const GEMV_PREFETCH: usize = 1024;

/// The GEMVs' prefetch at byte `at` of a row's codes (at `p`) and scale block `block`: the
/// codes [`GEMV_PREFETCH`] bytes ahead and the scales as far ahead.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(p: *const u8, at: usize, absmax: &[f32], block: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let codes = p.wrapping_add(at + GEMV_PREFETCH);
    let scales = absmax.as_ptr().wrapping_add(block + GEMV_PREFETCH / 8);
    // SAFETY: a prefetch does not fault, wherever the address points.
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(codes as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(scales as *const i8);
    }
}

/// How far ahead (bytes) the dense dot tiles prefetch each weight row: a decode's bf16 or f32
/// matrix (an LLM's output head) streams from memory, and the hardware prefetchers alone left
/// it at under half the machine's read bandwidth.
pub const DOT_PREFETCH: usize = 4096;

/// The dense dot tiles' prefetch at element `kk` of `rows` weight rows (stride `ws` elements,
/// bf16 or f32 at `w`): [`DOT_PREFETCH`] bytes ahead in each row.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_rows<const BF16: bool>(w: *const u8, ws: usize, rows: usize, kk: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let es = if BF16 { 2 } else { 4 };
    for j in 0..rows {
        let p = w.wrapping_add((j * ws + kk) * es + DOT_PREFETCH);
        // SAFETY: a prefetch does not fault, wherever the address points.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
    }
}

/// Permutes `x[k]` (k a multiple of 16) into paired order: `out[p] = x[paired_source(p)]`
/// ([`super::gemm::paired_source`]).
pub fn pair_order(x: &[f32], out: &mut [f32]) {
    for (p, o) in out[..x.len() / 16 * 16].iter_mut().enumerate() {
        *o = x[super::gemm::paired_source(p)];
    }
}

/// Whether the 4-bit GEMV runs for rows of `k` values in blocks of `bs`: whole chunks of 64
/// codes, each lane of 8 inside one scale block.
pub fn gemv_fits(k: usize, bs: usize) -> bool {
    k.is_multiple_of(64) && (bs.is_multiple_of(64) || bs == 32) && k.is_multiple_of(bs)
}

/// Where the GEMV reads activation `e` of a row (`paired`: the AVX-512 kernel's layout, which
/// reads two chunks at once). The GEMV's order: a chunk of 64 codes is 8 little-endian 32-bit
/// words, word `j` holding elements `8j .. 8j + 8`; shifting the words right by `4n` puts
/// element `8j + (n ^ 1)` (bitsandbytes packs the even element in the high nibble) in the low
/// bits of lane `j`. So activation `(chunk c, lane j, nibble n)` sits at `64c + 8n + j`, or,
/// paired, for the chunks `2p + h` of a full pair at `128p + 16n + 8h + j`.
pub fn nibble_position(e: usize, k: usize, paired: bool) -> usize {
    let (c, j, n) = (e / 64, e % 64 / 8, (e % 8) ^ 1);
    if paired && c / 2 * 2 + 1 < k / 64 {
        128 * (c / 2) + 16 * n + 8 * (c % 2) + j
    } else {
        64 * c + 8 * n + j
    }
}

/// Whether [`q4_row_dots`] reads its activations paired: it runs the AVX-512 kernel.
pub fn gemv_paired() -> bool {
    super::gemm::isa() == super::gemm::Isa::Avx512
}

/// Permutes a row `x[k]` (`k` a multiple of 64) into the GEMV's order
/// ([`nibble_position`]; [`q4_row_dots`] wants `paired` = [`gemv_paired`]), once per call.
pub fn nibble_order(x: &[f32], out: &mut [f32], paired: bool) {
    let k = x.len() / 64 * 64;
    for (e, &v) in x[..k].iter().enumerate() {
        out[nibble_position(e, k, paired)] = v;
    }
}

/// A GEMV kernel `$f::<M>` for the `xp.len()` activation rows (1 to 4; more are the caller's
/// error, taken as 4 and caught by the kernel's bounds asserts).
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($($f:ident)::+, $row:expr, $xp:expr, $out:expr) => {
        match $xp.len() {
            1 => $($f)::+::<1>($row, $xp, $out),
            2 => $($f)::+::<2>($row, $xp, $out),
            3 => $($f)::+::<3>($row, $xp, $out),
            _ => $($f)::+::<4>($row, $xp, $out),
        }
    };
}

/// One 4-bit weight row as the GEMVs read it: its packed codes, its scales (one per `bs`
/// values) and the 16-entry code table.
#[derive(Clone, Copy, Debug)]
pub struct Q4Row<'a> {
    /// The row's codes, two per byte.
    pub packed: &'a [u8],
    /// One scale per block of `bs` values.
    pub absmax: &'a [f32],
    /// Block size.
    pub bs: usize,
    /// The code table.
    pub code: &'a [f32; 16],
}

impl Q4Row<'_> {
    /// The row's length.
    pub fn k(&self) -> usize {
        self.absmax.len() * self.bs
    }
}

/// `out[m] = dot(W_row, x_m)` for one 4-bit row of `k = absmax.len() * bs` elements
/// ([`gemv_fits`]) against up to 4 activation rows, each in the GEMV's order
/// ([`nibble_order`], paired when [`gemv_paired`]): each weight is decoded
/// once. One sum on every instruction set, bit for bit (the portable loop below is its
/// definition): per chunk of 64 codes and lane `j`, the code values times the activations in
/// two fused chains (nibbles 0, 2, 4, 6 and 1, 3, 5, 7) added, then scaled by the lane's absmax
/// into one of two accumulators of 8 lanes (even chunks, odd chunks); at the end the two are
/// added and the 8 lanes summed in the AVX2 horizontal-sum tree.
pub fn q4_row_dots(row: &Q4Row, xp: &[&[f32]], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match super::gemm::isa() {
        // The layout `gemv_paired` names.
        super::gemm::Isa::Avx512 => return q4_row_dots_avx512(row, xp, out),
        super::gemm::Isa::Avx2 => {
            // SAFETY: AVX2 and FMA are present; the kernel asserts every length it reads.
            unsafe { by_rows!(avx2::q4_row_dots, row, xp, out) }
            return;
        }
        super::gemm::Isa::Portable => {}
    }
    q4_row_dots_portable(row, xp, out)
}

/// [`q4_row_dots`] one value at a time (the unpaired order): the definition of its sums.
pub fn q4_row_dots_portable(row: &Q4Row, xp: &[&[f32]], out: &mut [f32]) {
    let Q4Row {
        packed,
        absmax,
        bs,
        code,
    } = *row;
    let k = absmax.len() * bs;
    assert!(gemv_fits(k, bs) && packed.len() >= k / 2 && out.len() >= xp.len());
    for (x, o) in xp.iter().zip(out.iter_mut()) {
        assert!(x.len() >= k);
        let mut acc = [[0f32; 8]; 2];
        for c in 0..k / 64 {
            for (j, a) in acc[c % 2].iter_mut().enumerate() {
                let word = u32::from_le_bytes(
                    packed[32 * c + 4 * j..32 * c + 4 * j + 4]
                        .try_into()
                        .expect("4 bytes"),
                );
                let mut chain = [0f32; 2];
                for n in 0..8 {
                    let w = code[(word >> (4 * n) & 15) as usize];
                    chain[n % 2] = w.mul_add(x[64 * c + 8 * n + j], chain[n % 2]);
                }
                let scale = absmax[(64 * c + 8 * j) / bs];
                *a = (chain[0] + chain[1]).mul_add(scale, *a);
            }
        }
        let t: [f32; 4] =
            std::array::from_fn(|i| (acc[0][i] + acc[1][i]) + (acc[0][i + 4] + acc[1][i + 4]));
        *o = (t[0] + t[2]) + (t[1] + t[3]);
    }
}

/// [`q4_row_dots`] with AVX-512F (activations paired). The caller checks that AVX-512F is
/// present.
#[cfg(target_arch = "x86_64")]
pub fn q4_row_dots_avx512(row: &Q4Row, xp: &[&[f32]], out: &mut [f32]) {
    assert!(super::gemm::Isa::Avx512.present());
    // SAFETY: AVX-512F (and AVX2, FMA with it) present; the kernels assert every length.
    unsafe { by_rows!(avx512::q4_row_dots, row, xp, out) }
}

/// The GEMV kernels' bounds, checked once per row ([`gemv_fits`]; `packed` holds the row's
/// codes, `M` activation rows of `k` values and `M` outputs are there): their pointers.
#[cfg(target_arch = "x86_64")]
fn gemv_rows<const M: usize>(row: &Q4Row, xp: &[&[f32]], out: &[f32]) -> [*const f32; M] {
    let k = row.k();
    assert!(gemv_fits(k, row.bs) && row.packed.len() >= k / 2 && xp.len() >= M && out.len() >= M);
    std::array::from_fn(|m| {
        assert!(xp[m].len() >= k);
        xp[m].as_ptr()
    })
}

/// Plain dot product (f32 accumulation in 8 lanes).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if have_avx2() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { avx2::dot(a, b) };
    }
    let mut acc = [0f32; 8];
    let n8 = a.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        for l in 0..8 {
            acc[l] += a[i + l] * b[i + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `x = exp(x - m)` for every element (`-inf` gives 0), returning their sum: attention's
/// softmax weights. The AVX2 path is avx_mathfun's `exp256_ps` (Cephes' polynomial, within 2 ulp
/// of the true value; the same bits on every x86-64 CPU with AVX2); elsewhere `f32::exp`.
pub fn exp_shifted(x: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if have_avx2() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { avx2::exp_shifted(x, m) };
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = if *v == f32::NEG_INFINITY {
            0.0
        } else {
            (*v - m).exp()
        };
        sum += *v;
    }
    sum
}

/// `out[i] = x[i] / (1 + exp(-s * x[i]))` for `min(x.len(), out.len())` values: SiLU (`s` = 1)
/// and QuickGELU (`s` = 1.702). The AVX2 path takes [`exp_shifted`]'s exponential (within 2 ulp;
/// the same bits on every CPU with AVX2, the tail through the same lanes); elsewhere `f32::exp`.
pub fn sigmoid_gate(x: &[f32], s: f32, out: &mut [f32]) {
    let n = x.len().min(out.len());
    #[cfg(target_arch = "x86_64")]
    if have_avx2() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { avx2::sigmoid_gate(&x[..n], s, &mut out[..n]) };
    }
    for (o, &v) in out[..n].iter_mut().zip(x) {
        *o = v / (1.0 + (-(s * v)).exp());
    }
}

/// Weight rows for [`dot_tile_rows`]: f32, or bf16 as a model stores them, each element widened
/// to f32 exactly as it is read (the same sums in the same order as the widened f32 rows).
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    /// f32 rows.
    F32(&'a [f32]),
    /// bf16 rows (the bits, little-endian).
    Bf16(&'a [u16]),
}

impl<'a> Rows<'a> {
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn len(&self) -> usize {
        match self {
            Rows::F32(w) => w.len(),
            Rows::Bf16(w) => w.len(),
        }
    }
    /// The rows from element `at` on.
    pub fn from(self, at: usize) -> Rows<'a> {
        match self {
            Rows::F32(w) => Rows::F32(&w[at..]),
            Rows::Bf16(w) => Rows::Bf16(&w[at..]),
        }
    }
    /// Elements `at..at + out.len()`, as f32, into `out`.
    pub fn widen_into(&self, at: usize, out: &mut [f32]) {
        match self {
            Rows::F32(w) => out.copy_from_slice(&w[at..at + out.len()]),
            Rows::Bf16(w) => {
                let n = out.len();
                for (o, &h) in out.iter_mut().zip(&w[at..at + n]) {
                    *o = f32::from_bits((h as u32) << 16);
                }
            }
        }
    }
}

/// Element `i` of f32 weight rows at `w`, or of bf16 ones with `BF16` (widened): the dot tiles'
/// scalar tails.
///
/// # Safety
/// `w` holds at least `i + 1` elements of that type.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn weight_at<const BF16: bool>(w: *const u8, i: usize) -> f32 {
    // SAFETY: the caller's bound.
    unsafe {
        if BF16 {
            f32::from_bits((*(w as *const u16).add(i) as u32) << 16)
        } else {
            *(w as *const f32).add(i)
        }
    }
}

/// `out[i * out_stride + j] = dot(x row i, w row j)` for `mr` rows of x (stride `xs`) and `nr`
/// rows of w (stride `ws`), each `k` long; mr <= 4, nr <= 3.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
fn dot_tile(
    x: &[f32],
    xs: usize,
    mr: usize,
    w: &[f32],
    ws: usize,
    nr: usize,
    k: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    dot_tile_rows(x, xs, mr, Rows::F32(w), ws, nr, k, out, out_stride);
}

/// `out[i * out_stride + j] = dot(x row i, w row j)` for `mr` rows of x (stride `xs`) and `nr`
/// f32 or bf16 rows of w (stride `ws`), each `k` long; mr <= 4, nr <= 3.
#[allow(clippy::too_many_arguments)]
pub fn dot_tile_rows(
    x: &[f32],
    xs: usize,
    mr: usize,
    w: Rows<'_>,
    ws: usize,
    nr: usize,
    k: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    debug_assert!(mr <= 4 && nr <= 3);
    #[cfg(target_arch = "x86_64")]
    if have_avx2() {
        // SAFETY: AVX2 and FMA are present (AVX-512F where the GEMM runs it); the asserts below
        // bound every access.
        let wide = super::gemm::isa() == super::gemm::Isa::Avx512;
        assert!(x.len() >= (mr - 1) * xs + k && w.len() >= (nr - 1) * ws + k);
        assert!(out.len() >= (mr - 1) * out_stride + nr);
        let (wp, bf16) = match w {
            Rows::F32(w) => (w.as_ptr() as *const u8, false),
            Rows::Bf16(w) => (w.as_ptr() as *const u8, true),
        };
        unsafe {
            macro_rules! call {
                ($b:literal, $m:literal, $n:literal) => {{
                    let args = (x.as_ptr(), xs, wp, ws, k, out.as_mut_ptr(), out_stride);
                    let f = if wide {
                        avx512::dot_tile::<$m, $n, $b>
                    } else {
                        avx2::dot_tile::<$m, $n, $b>
                    };
                    f(args.0, args.1, args.2, args.3, args.4, args.5, args.6)
                }};
            }
            macro_rules! by_shape {
                ($b:literal) => {
                    match (mr, nr) {
                        (1, 1) => call!($b, 1, 1),
                        (1, 2) => call!($b, 1, 2),
                        (1, 3) => call!($b, 1, 3),
                        (2, 1) => call!($b, 2, 1),
                        (2, 2) => call!($b, 2, 2),
                        (2, 3) => call!($b, 2, 3),
                        (3, 1) => call!($b, 3, 1),
                        (3, 2) => call!($b, 3, 2),
                        (3, 3) => call!($b, 3, 3),
                        (4, 1) => call!($b, 4, 1),
                        (4, 2) => call!($b, 4, 2),
                        _ => call!($b, 4, 3),
                    }
                };
            }
            if bf16 {
                by_shape!(true)
            } else {
                by_shape!(false)
            }
        }
        return;
    }
    // f32 rows are used where they are; bf16 rows are widened into one row buffer.
    let mut widened = Vec::new();
    for j in 0..nr {
        let row: &[f32] = match w {
            Rows::F32(w) => &w[j * ws..j * ws + k],
            Rows::Bf16(_) => {
                widened.resize(k, 0f32);
                w.widen_into(j * ws, &mut widened);
                &widened
            }
        };
        for i in 0..mr {
            out[i * out_stride + j] = dot(&x[i * xs..i * xs + k], row);
        }
    }
}

// The AVX2 kernels: intrinsics whose callers check AVX2/FMA and the bounds.
#[cfg(target_arch = "x86_64")]
#[path = "kernels_avx2.rs"]
mod avx2;

// The AVX-512 GEMV: intrinsics whose caller checks the instruction set and the lengths.
#[cfg(target_arch = "x86_64")]
#[path = "gemv_avx512.rs"]
mod avx512;

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    #[test]
    fn bf16_tiles_equal_f32_tiles_of_the_widened_rows_bit_for_bit() {
        // k = 37: full 8-lane steps and a tail.
        let k = 37;
        let x = vals(4 * 40, 3);
        let w16: Vec<u16> = vals(3 * 41, 4)
            .iter()
            .map(|v| half::bf16::from_f32(*v * 3.0).to_bits())
            .collect();
        let w32: Vec<f32> = w16
            .iter()
            .map(|&h| f32::from_bits((h as u32) << 16))
            .collect();
        for mr in 1..=4 {
            for nr in 1..=3 {
                let mut a = vec![0f32; 4 * 5];
                let mut b = vec![0f32; 4 * 5];
                dot_tile(&x, 40, mr, &w32, 41, nr, k, &mut a, 5);
                dot_tile_rows(&x, 40, mr, Rows::Bf16(&w16), 41, nr, k, &mut b, 5);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{mr}x{nr}");
                assert!(a[..mr * 5].iter().any(|v| *v != 0.0));
            }
        }
    }

    #[test]
    fn the_avx512_dot_tiles_give_the_avx2_ones_bits() {
        if !(have_avx2() && crate::backend::cpu::gemm::Isa::Avx512.present()) {
            return;
        }
        // An even and an odd number of 8-groups, tails, and decode's lm_head width.
        for k in [8usize, 16, 24, 37, 45, 64, 100, 576] {
            let x = vals(4 * (k + 3), k as u32);
            let w32 = vals(3 * (k + 5), k as u32 + 1);
            let w16: Vec<u16> = w32
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            for mr in 1..=4 {
                for nr in 1..=3 {
                    macro_rules! both {
                        ($m:literal, $n:literal, $bf:literal, $w:expr) => {{
                            let (mut a, mut b) = ([0f32; 20], [0f32; 20]);
                            let w = $w as *const u8;
                            // SAFETY: AVX2, FMA and AVX-512F present; x holds 4 rows of
                            // k + 3, w 3 rows of k + 5, out 4 rows of 5.
                            unsafe {
                                avx2::dot_tile::<$m, $n, $bf>(
                                    x.as_ptr(),
                                    k + 3,
                                    w,
                                    k + 5,
                                    k,
                                    a.as_mut_ptr(),
                                    5,
                                );
                                avx512::dot_tile::<$m, $n, $bf>(
                                    x.as_ptr(),
                                    k + 3,
                                    w,
                                    k + 5,
                                    k,
                                    b.as_mut_ptr(),
                                    5,
                                );
                            }
                            let bits =
                                |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(&a), bits(&b), "k {k}, {}x{}, bf16 {}", $m, $n, $bf);
                        }};
                    }
                    match (mr, nr) {
                        (1, 1) => both!(1, 1, false, w32.as_ptr()),
                        (1, 3) => both!(1, 3, false, w32.as_ptr()),
                        (2, 2) => both!(2, 2, false, w32.as_ptr()),
                        (4, 3) => both!(4, 3, false, w32.as_ptr()),
                        (1, 2) => both!(1, 2, true, w16.as_ptr()),
                        (3, 1) => both!(3, 1, true, w16.as_ptr()),
                        (4, 2) => both!(4, 2, true, w16.as_ptr()),
                        _ => both!(1, 3, true, w16.as_ptr()),
                    }
                }
            }
        }
    }

    #[test]
    fn dot_tile_matches_scalar_dots_for_every_tile_shape() {
        let k = 37;
        let x = vals(4 * 40, 1);
        let w = vals(3 * 41, 2);
        for mr in 1..=4 {
            for nr in 1..=3 {
                let mut out = vec![0f32; 4 * 5];
                dot_tile(&x, 40, mr, &w, 41, nr, k, &mut out, 5);
                for i in 0..mr {
                    for j in 0..nr {
                        let want: f64 = (0..k)
                            .map(|t| x[i * 40 + t] as f64 * w[j * 41 + t] as f64)
                            .sum();
                        assert!(
                            (out[i * 5 + j] as f64 - want).abs() < 1e-5,
                            "{mr}x{nr} [{i},{j}]"
                        );
                    }
                }
            }
        }
    }

    /// A row's codes, scales and activation rows for the GEMV tests.
    fn gemv_case(bs: usize, k: usize) -> (Vec<u8>, Vec<f32>, [f32; 16], Vec<Vec<f32>>) {
        let packed: Vec<u8> = (0..k / 2).map(|i| (i * 73 + 5) as u8).collect();
        let absmax: Vec<f32> = (0..k / bs).map(|b| 0.25 + b as f32 * 0.5).collect();
        let code: [f32; 16] = std::array::from_fn(|i| i as f32 / 7.5 - 1.0);
        let xs: Vec<Vec<f32>> = (0..4).map(|s| vals(k, s + 10)).collect();
        (packed, absmax, code, xs)
    }

    fn ordered(xs: &[Vec<f32>], paired: bool) -> Vec<Vec<f32>> {
        xs.iter()
            .map(|x| {
                let mut p = vec![f32::NAN; x.len()];
                nibble_order(x, &mut p, paired);
                p
            })
            .collect()
    }

    #[test]
    fn the_gemv_order_is_a_permutation() {
        for k in [64usize, 128, 192, 576] {
            for paired in [false, true] {
                let mut seen = vec![false; k];
                for e in 0..k {
                    let p = nibble_position(e, k, paired);
                    assert!(p < k && !seen[p], "k {k} paired {paired}: {e} -> {p}");
                    seen[p] = true;
                }
            }
        }
    }

    #[test]
    fn q4_row_dots_match_the_element_formula() {
        // Blocks of 32 (two scales a chunk), 64 and 128; an odd number of chunks.
        for &(bs, k) in &[(32usize, 192usize), (64, 256), (64, 576), (128, 384)] {
            let (packed, absmax, code, xs) = gemv_case(bs, k);
            let row = Q4Row {
                packed: &packed,
                absmax: &absmax,
                bs,
                code: &code,
            };
            let paired = gemv_paired();
            let perm = ordered(&xs, paired);
            for m in 1..=4 {
                let refs: Vec<&[f32]> = perm[..m].iter().map(|v| v.as_slice()).collect();
                let mut out = [0f32; 4];
                q4_row_dots(&row, &refs, &mut out[..m]);
                for (r, x) in xs[..m].iter().enumerate() {
                    let want: f64 = (0..k)
                        .map(|e| {
                            let b = packed[e / 2];
                            let q = if e % 2 == 0 { b >> 4 } else { b & 15 };
                            (code[q as usize] * absmax[e / bs]) as f64 * x[e] as f64
                        })
                        .sum();
                    assert!(
                        (out[r] as f64 - want).abs() < 1e-4 * want.abs().max(1.0),
                        "bs {bs} k {k}, {m} rows, row {r}: {} vs {want}",
                        out[r]
                    );
                }
            }
        }
    }

    /// The AVX2 and AVX-512 GEMVs give the portable definition's bits, for every row count,
    /// block size and an odd number of chunks (the AVX-512 kernel's unpaired last one).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_gemv_gives_the_portable_gemvs_bits() {
        use crate::backend::cpu::gemm::Isa;
        for &(bs, k) in &[
            (32usize, 96 * 2),
            (64, 512),
            (64, 576),
            (128, 1024),
            (4096, 4096),
        ] {
            let (packed, absmax, code, xs) = gemv_case(bs, k);
            let row = Q4Row {
                packed: &packed,
                absmax: &absmax,
                bs,
                code: &code,
            };
            let plain = ordered(&xs, false);
            let pairs = ordered(&xs, true);
            let plain: Vec<&[f32]> = plain.iter().map(|v| v.as_slice()).collect();
            let pairs: Vec<&[f32]> = pairs.iter().map(|v| v.as_slice()).collect();
            for m in 1..=4 {
                let mut want = [0f32; 4];
                q4_row_dots_portable(&row, &plain[..m], &mut want[..m]);
                let mut got = Vec::new();
                if Isa::Avx2.present() {
                    let mut a = [0f32; 4];
                    // SAFETY: AVX2 and FMA are present (checked).
                    unsafe { by_rows!(avx2::q4_row_dots, &row, &plain[..m], &mut a[..m]) };
                    got.push(("avx2", a));
                }
                if Isa::Avx512.present() {
                    let mut b = [0f32; 4];
                    q4_row_dots_avx512(&row, &pairs[..m], &mut b[..m]);
                    got.push(("avx512", b));
                }
                for (isa, g) in got {
                    for r in 0..m {
                        assert_eq!(
                            g[r].to_bits(),
                            want[r].to_bits(),
                            "{isa}: bs {bs} k {k}, {m} rows, row {r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn sigmoid_gate_is_within_a_few_ulp_and_a_value_does_not_depend_on_its_position() {
        // SiLU and QuickGELU against the f64 formula, over the range a model's activations
        // take, with ragged tails (n not a multiple of 8).
        let x: Vec<f32> = (0..1003).map(|i| (i as f32 - 501.0) * 0.0371).collect();
        for s in [1.0f32, 1.702] {
            for n in [1usize, 7, 8, 29, 1003] {
                let mut out = vec![f32::NAN; n + 1];
                sigmoid_gate(&x[..n], s, &mut out);
                assert!(out[n].is_nan(), "wrote past n");
                for (g, &v) in out[..n].iter().zip(&x) {
                    // The exponent's argument rounded to f32 as the kernel rounds it (that
                    // rounding alone moves exp(31) by several ulp).
                    let w = (v as f64 / (1.0 + (-((s * v) as f64)).exp())) as f32;
                    let ulp = (w.abs() * f32::EPSILON).max(f32::MIN_POSITIVE);
                    assert!((g - w).abs() <= 3.0 * ulp, "s {s}, x {v}: {g} vs {w}");
                }
            }
            // A value gives the same bits in a tail as inside a full group of 8.
            let mut whole = vec![0f32; 16];
            sigmoid_gate(&x[..16], s, &mut whole);
            for start in 0..8 {
                let mut tail = vec![0f32; 16 - start - 3];
                sigmoid_gate(&x[start + 3..16], s, &mut tail);
                for (t, w) in tail.iter().zip(&whole[start + 3..]) {
                    assert_eq!(t.to_bits(), w.to_bits());
                }
            }
        }
    }

    #[test]
    fn shifted_exp_is_within_two_ulp_and_masks_to_zero() {
        for n in [1usize, 7, 8, 29, 1000] {
            let mut x: Vec<f32> = (0..n)
                .map(|i| {
                    if i % 11 == 5 {
                        f32::NEG_INFINITY
                    } else {
                        -(i as f32) * 0.0873
                    }
                })
                .collect();
            let want: Vec<f32> = x
                .iter()
                .map(|&v| {
                    if v == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (v - 0.25).exp()
                    }
                })
                .collect();
            let sum = exp_shifted(&mut x, 0.25);
            for (g, w) in x.iter().zip(&want) {
                let ulp = (w.abs() * f32::EPSILON).max(f32::MIN_POSITIVE);
                assert!((g - w).abs() <= 2.0 * ulp, "{g} vs {w}");
            }
            let s: f32 = want.iter().sum();
            assert!((sum - s).abs() <= 1e-5 * s.max(1.0), "{sum} vs {s}");
        }
    }
}
