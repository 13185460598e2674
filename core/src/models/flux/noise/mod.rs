//! Gaussian noise as torch draws it on the CPU, so that `--seed N` gives the latents diffusers
//! gets from `torch.Generator("cpu").manual_seed(N)`: torch's Mersenne Twister (`at::mt19937`),
//! its 24-bit uniform floats, and the Box-Muller transform `torch.randn` applies to float32
//! tensors of 16 or more elements (in blocks of 16: the first 8 uniforms give the radii, the next
//! 8 the angles; a tail that is not a whole block recomputes the last 16 values from fresh
//! uniforms). Tensors of fewer than 16 elements take torch's other path (double-precision
//! Box-Muller, one value at a time), also reproduced here.
//!
//! Two builds of torch differ here: its AVX2 kernel computes the transform with the Cephes-style
//! polynomials of `avx_mathfun.h` and a fused multiply-add, its other kernels with the C
//! library's `logf`, `cosf` and `sinf`. [`NoiseMath`] selects which to reproduce. No step calls
//! the machine's math library or leaves a fused multiply-add to the target (#32 fault 25): the
//! FMA is computed in plain f64 ([`fma_f32`]), glibc's functions are transcribed (`clib`), the
//! small-tensor path uses the pure-Rust `libm` crate; the same seed gives the same bits on every
//! CPU and in the browser.

mod clib;

/// torch's CPU generator (`at::mt19937`, 32-bit outputs).
#[derive(Clone)]
pub struct TorchGenerator {
    state: [u32; 624],
    next: usize,
    /// The second value of the last double-precision Box-Muller pair.
    cached_normal: Option<f64>,
}

impl std::fmt::Debug for TorchGenerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchGenerator")
            .field("next", &self.next)
            .finish()
    }
}

impl TorchGenerator {
    /// As `torch.Generator("cpu").manual_seed(seed)` (the low 32 bits seed the twister).
    pub fn new(seed: u64) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed as u32;
        for j in 1..624 {
            state[j] = 1_812_433_253u32
                .wrapping_mul(state[j - 1] ^ (state[j - 1] >> 30))
                .wrapping_add(j as u32);
        }
        TorchGenerator {
            state,
            next: 624,
            cached_normal: None,
        }
    }

    fn twist(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        for i in 0..624 {
            let y = (self.state[i] & UPPER) | (self.state[(i + 1) % 624] & LOWER);
            let mag = if y & 1 == 1 { 0x9908_b0df } else { 0 };
            self.state[i] = self.state[(i + 397) % 624] ^ (y >> 1) ^ mag;
        }
        self.next = 0;
    }

    /// The next 32-bit output (`generator->random()`).
    pub fn next_u32(&mut self) -> u32 {
        if self.next >= 624 {
            self.twist();
        }
        let mut y = self.state[self.next];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// The next 64-bit output (`generator->random64()`: two 32-bit outputs, high first).
    pub fn next_u64(&mut self) -> u64 {
        let hi = self.next_u32() as u64;
        let lo = self.next_u32() as u64;
        (hi << 32) | lo
    }

    /// A float in [0, 1) with 24 random bits (`uniform_real_distribution<float>(0, 1)`).
    pub fn uniform_f32(&mut self) -> f32 {
        ((self.next_u32() & 0x00ff_ffff) as f64 / (1u64 << 24) as f64) as f32
    }

    /// A double in [0, 1) with 53 random bits (`uniform_real_distribution<double>(0, 1)`).
    pub fn uniform_f64(&mut self) -> f64 {
        (self.next_u64() & ((1u64 << 53) - 1)) as f64 / (1u64 << 53) as f64
    }
}

/// Which torch kernel's arithmetic the transform reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NoiseMath {
    /// torch's AVX2 kernel (x86-64 builds on AVX2 machines, the usual case): `avx_mathfun.h`'s
    /// `log256_ps` and `sincos256_ps`, then an FMA.
    #[default]
    AvxMathfun,
    /// torch's other kernels (ARM, or x86 without AVX2): the C library's `logf`, `cosf`,
    /// `sinf`, as glibc (2.28 on) computes them, transcribed ([`clib`]) so that no machine's
    /// own library decides the bits.
    Libm,
}

/// `torch.randn(n, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)`.
pub fn torch_randn(n: usize, seed: u64, math: NoiseMath) -> Vec<f32> {
    let mut g = TorchGenerator::new(seed);
    if n < 16 {
        return (0..n).map(|_| normal_double(&mut g) as f32).collect();
    }
    let mut data: Vec<f32> = (0..n).map(|_| g.uniform_f32()).collect();
    for block in data.chunks_exact_mut(16) {
        fill_16(block, math);
    }
    if !n.is_multiple_of(16) {
        let tail = &mut data[n - 16..];
        for v in tail.iter_mut() {
            *v = g.uniform_f32();
        }
        fill_16(tail, math);
    }
    data
}

/// torch's `normal_distribution<double>` (mean 0, std 1): Box-Muller on two 53-bit uniforms,
/// the sine half of each pair kept in the generator for the next call.
fn normal_double(g: &mut TorchGenerator) -> f64 {
    if let Some(v) = g.cached_normal.take() {
        return v;
    }
    let u1 = g.uniform_f64();
    let u2 = g.uniform_f64();
    // The `libm` crate (pure Rust, no dispatch on the CPU) rather than the platform's libm,
    // whose variants (glibc picks one by CPU features) differ in the last bit.
    let r = (-2.0 * libm::log1p(-u2)).sqrt();
    let theta = 2.0 * std::f64::consts::PI * u1;
    g.cached_normal = Some(r * libm::sin(theta));
    r * libm::cos(theta)
}

/// `a * b + c` rounded once to f32 in plain f64 arithmetic: the same bits on every machine and
/// target. `f32::mul_add` gives these bits too, but where the target has no FMA instruction
/// (x86-64's baseline, wasm32) by calling the platform's `fmaf`, which is not nibble's to pin.
/// The product of two f32 is exact in f64; TwoSum recovers the sum's rounding error exactly;
/// rounding the sum to odd with it leaves the final f64 -> f32 rounding a single correct one
/// (53 >= 24 + 2 bits).
fn fma_f32(a: f32, b: f32, c: f32) -> f32 {
    let p = a as f64 * b as f64;
    let c = c as f64;
    let s = p + c;
    if !s.is_finite() {
        return s as f32;
    }
    let bp = s - p;
    let err = (p - (s - bp)) + (c - bp);
    if err == 0.0 || s.to_bits() & 1 == 1 {
        return s as f32;
    }
    // s is even and inexact: one f64 ulp toward the exact sum (round to odd); s != 0 here.
    let bits = if (err > 0.0) == (s > 0.0) {
        s.to_bits() + 1
    } else {
        s.to_bits() - 1
    };
    f64::from_bits(bits) as f32
}

/// The Box-Muller transform of 16 uniforms in place, as torch's `normal_fill_16`.
fn fill_16(d: &mut [f32], math: NoiseMath) {
    let (mean, std) = (0.0f32, 1.0f32);
    match math {
        NoiseMath::Libm => {
            for j in 0..8 {
                let u1 = 1.0 - d[j];
                let u2 = d[j + 8];
                let radius = (-2.0 * clib::logf(u1)).sqrt();
                let theta = (2.0f32 as f64 * std::f64::consts::PI * u2 as f64) as f32;
                d[j] = radius * clib::cosf(theta) * std + mean;
                d[j + 8] = radius * clib::sinf(theta) * std + mean;
            }
        }
        NoiseMath::AvxMathfun => {
            let two_pi = (2.0f32 as f64 * std::f64::consts::PI) as f32;
            for j in 0..8 {
                let u1 = 1.0 - d[j];
                let u2 = d[j + 8];
                let radius = (-2.0 * mathfun::log(u1)).sqrt();
                let theta = two_pi * u2;
                let (s, c) = mathfun::sincos(theta);
                d[j] = fma_f32(radius * c, std, mean);
                d[j + 8] = fma_f32(radius * s, std, mean);
            }
        }
    }
}

/// Scalar transcriptions of `avx_mathfun.h` (Julien Pommier's SSE/AVX Cephes ports) for the
/// inputs torch gives them: `log` of (0, 1] and `sincos` of [0, 2 pi). Every operation is the
/// same f32 operation in the same order, each multiply-add fused as torch's compiled kernel
/// fuses it, so each lane's result is the same bits.
#[allow(clippy::excessive_precision, clippy::approx_constant)]
mod mathfun {
    /// `a * b + c` in one rounding, as torch's build compiles each multiply that feeds an add
    /// in this header (GCC contracts them into FMAs under AVX2; the fixture's noise shows it).
    fn ma(a: f32, b: f32, c: f32) -> f32 {
        super::fma_f32(a, b, c)
    }

    // The constants are the header's C double literals, converted to float as C converts them.
    const SQRTHF: f32 = 0.707106781186547524_f64 as f32;
    const LOG_P0: f32 = 7.0376836292E-2_f64 as f32;
    const LOG_P1: f32 = -1.1514610310E-1_f64 as f32;
    const LOG_P2: f32 = 1.1676998740E-1_f64 as f32;
    const LOG_P3: f32 = -1.2420140846E-1_f64 as f32;
    const LOG_P4: f32 = 1.4249322787E-1_f64 as f32;
    const LOG_P5: f32 = -1.6668057665E-1_f64 as f32;
    const LOG_P6: f32 = 2.0000714765E-1_f64 as f32;
    const LOG_P7: f32 = -2.4999993993E-1_f64 as f32;
    const LOG_P8: f32 = 3.3333331174E-1_f64 as f32;
    const LOG_Q1: f32 = -2.12194440e-4_f64 as f32;
    const LOG_Q2: f32 = 0.693359375_f64 as f32;

    /// `log256_ps` for one positive, normal lane.
    pub fn log(x: f32) -> f32 {
        if x <= 0.0 {
            return f32::NAN;
        }
        // Take the exponent, keep the mantissa in [0.5, 1).
        let bits = x.max(f32::MIN_POSITIVE).to_bits();
        let emm0 = (bits >> 23) as i32 - 0x7f;
        let mut x = f32::from_bits((bits & !0x7f80_0000) | 0.5f32.to_bits());
        let mut e = emm0 as f32 + 1.0;
        // x < sqrt(1/2): x = x + x - 1, e -= 1; else x = x - 1.
        let mask = x < SQRTHF;
        let tmp = if mask { x } else { 0.0 };
        x -= 1.0;
        e -= if mask { 1.0 } else { 0.0 };
        x += tmp;
        let z = x * x;
        let mut y = LOG_P0;
        for p in [
            LOG_P1, LOG_P2, LOG_P3, LOG_P4, LOG_P5, LOG_P6, LOG_P7, LOG_P8,
        ] {
            y = ma(y, x, p);
        }
        y *= x;
        y *= z;
        y = ma(e, LOG_Q1, y);
        y = ma(-z, 0.5, y);
        x += y;
        ma(e, LOG_Q2, x)
    }

    const DP1: f32 = -0.78515625_f64 as f32;
    const DP2: f32 = -2.4187564849853515625e-4_f64 as f32;
    const DP3: f32 = -3.77489497744594108e-8_f64 as f32;
    const SINCOF_P0: f32 = -1.9515295891E-4_f64 as f32;
    const SINCOF_P1: f32 = 8.3321608736E-3_f64 as f32;
    const SINCOF_P2: f32 = -1.6666654611E-1_f64 as f32;
    const COSCOF_P0: f32 = 2.443315711809948E-005_f64 as f32;
    const COSCOF_P1: f32 = -1.388731625493765E-003_f64 as f32;
    const COSCOF_P2: f32 = 4.166664568298827E-002_f64 as f32;
    const FOPI: f32 = 1.27323954473516_f64 as f32; // 4 / pi

    /// `sincos256_ps` for one lane: (sin, cos).
    pub fn sincos(x: f32) -> (f32, f32) {
        let sign_bit_sin = x.to_bits() & 0x8000_0000;
        let x = f32::from_bits(x.to_bits() & 0x7fff_ffff);
        let y = x * FOPI;
        // j = (j + 1) & ~1 on the integer part, y = j as float.
        let mut j = y as i32;
        j += 1;
        j &= !1;
        let y = j as f32;
        let imm4 = j;
        let swap_sign_bit_sin = ((imm4 & 4) as u32) << 29;
        let poly_mask = (imm4 & 2) == 0;
        // x = ((x - y * DP1) - y * DP2) - y * DP3 ("extended precision modular arithmetic").
        let mut x = x;
        x = ma(y, DP1, x);
        x = ma(y, DP2, x);
        x = ma(y, DP3, x);
        let swap_sign_bit_cos = (((imm4 - 2) & 4) == 0) as u32 * 0x8000_0000;
        let sign_bit_sin = sign_bit_sin ^ swap_sign_bit_sin;
        let z = x * x;
        let mut yc = ma(COSCOF_P0, z, COSCOF_P1);
        yc = ma(yc, z, COSCOF_P2);
        yc *= z;
        yc *= z;
        yc = ma(-z, 0.5, yc);
        yc += 1.0;
        let mut ys = ma(SINCOF_P0, z, SINCOF_P1);
        ys = ma(ys, z, SINCOF_P2);
        ys *= z;
        ys = ma(ys, x, x);
        // The selection as the header does it, additions of +0.0 included: `ysin2` and
        // `ysin1` are the sine's polynomial, the rest goes to the cosine.
        let (ysin2, ysin1) = if poly_mask { (ys, 0.0) } else { (0.0, yc) };
        let yc = yc - ysin1;
        let ys = ys - ysin2;
        let s = ysin1 + ysin2;
        let c = yc + ys;
        let s = f32::from_bits(s.to_bits() ^ sign_bit_sin);
        let c = f32::from_bits(c.to_bits() ^ swap_sign_bit_cos);
        (s, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_twister_matches_the_reference_sequence() {
        // mt19937 seeded with 5489 (std::mt19937's default): its 10000th output is 4123659995.
        let mut g = TorchGenerator::new(5489);
        let mut last = 0;
        for _ in 0..10000 {
            last = g.next_u32();
        }
        assert_eq!(last, 4_123_659_995);
    }

    #[test]
    fn both_maths_agree_closely_and_tails_recompute() {
        for n in [16usize, 17, 64, 1000] {
            let a = torch_randn(n, 42, NoiseMath::Libm);
            let b = torch_randn(n, 42, NoiseMath::AvxMathfun);
            assert_eq!(a.len(), n);
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "{x} vs {y}");
            }
        }
        let m = torch_randn(4096, 1, NoiseMath::Libm);
        let mean = m.iter().map(|&v| v as f64).sum::<f64>() / 4096.0;
        let var = m.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / 4096.0;
        assert!(
            mean.abs() < 0.05 && (var - 1.0).abs() < 0.08,
            "{mean} {var}"
        );
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn hex(s: &str) -> Vec<u32> {
        s.split_whitespace()
            .map(|h| u32::from_str_radix(h, 16).expect("hex"))
            .collect()
    }

    /// FNV-1a over the bits of each value.
    fn fnv(h: &mut u64, v: f32) {
        *h = (*h ^ v.to_bits() as u64).wrapping_mul(0x100000001b3);
    }

    /// #32 fault 25: the one rounding of a fused multiply-add, in plain f64 arithmetic: these
    /// are cases where adding the exact f64 product and rounding twice is one ulp off.
    #[test]
    fn the_fused_multiply_add_rounds_once_without_the_machine() {
        for (a, b, c, want) in [
            (0x40000040u32, 0x3fffff80u32, 0x4cf04b75u32, 0x4cf04b75u32),
            (0x3f800040, 0x407fff80, 0x4ced9d99, 0x4ced9d99),
            (0x40fffe00, 0x40800100, 0x4e3f91a1, 0x4e3f91a1),
            (0x3e000001, 0x3ffffffe, 0x4ae7544d, 0x4ae7544d),
        ] {
            let f = f32::from_bits;
            assert_eq!(
                fma_f32(f(a), f(b), f(c)).to_bits(),
                want,
                "{a:x} {b:x} {c:x}"
            );
        }
        assert_eq!(fma_f32(0.0, 5.0, -0.0).to_bits(), 0.0f32.to_bits());
        assert!(fma_f32(f32::NAN, 1.0, 1.0).is_nan());
        assert_eq!(fma_f32(f32::MAX, 2.0, 0.0), f32::INFINITY);
    }

    /// The transcribed glibc functions give glibc 2.36's bits for every input torch's scalar
    /// kernel can pass them (all 2^24 uniforms), and avx_mathfun's transcription its bits on a
    /// sample (recorded from a model of torch's AVX2 kernel that is bit-exact on the fixtures).
    #[test]
    fn the_noise_maths_are_pinned_bit_for_bit() {
        let two_pi = (2.0f32 as f64 * std::f64::consts::PI) as f32;
        let mut h = 0xcbf29ce484222325u64;
        for k in 0..1u32 << 24 {
            let u = (k as f64 / (1u64 << 24) as f64) as f32;
            let t = (2.0f32 as f64 * std::f64::consts::PI * u as f64) as f32;
            fnv(&mut h, clib::logf(1.0 - u));
            fnv(&mut h, clib::sinf(t));
            fnv(&mut h, clib::cosf(t));
        }
        assert_eq!(h, 0x3b37c0ee55974d42, "glibc logf/sinf/cosf");
        let mut h = 0xcbf29ce484222325u64;
        for k in (0..1u32 << 24).step_by(257) {
            let u = (k as f64 / (1u64 << 24) as f64) as f32;
            let (s, c) = mathfun::sincos(two_pi * u);
            fnv(&mut h, mathfun::log(1.0 - u));
            fnv(&mut h, s);
            fnv(&mut h, c);
        }
        assert_eq!(h, 0x17aefab903233304, "avx_mathfun log/sincos");
        assert_eq!(
            (clib::logf(1.0), clib::sinf(0.0), clib::cosf(0.0)),
            (0.0, 0.0, 1.0)
        );
    }

    /// Every branch of torch's transform: fewer than 16 values (the double-precision path, its
    /// cached sine half), a tail past a multiple of 16, both kernels.
    #[test]
    fn small_sizes_and_tails_have_torchs_bits() {
        assert_eq!(
            bits(&torch_randn(5, 0, NoiseMath::AvxMathfun)),
            hex("3fc53f5c be963c50 c00b7149 3f1184b6 bf8ad1a1")
        );
        assert_eq!(
            bits(&torch_randn(3, 42, NoiseMath::Libm)),
            hex("3eac62ae 3e03e69d 3e7016e7")
        );
        assert_eq!(
            bits(&torch_randn(24, 0, NoiseMath::AvxMathfun)),
            hex(
                "bf901b85 bf93808a be804bd6 bede255d 3f594515 3f312783 bea1cc6d c0075fc1 \
                 3eefaa55 be217f5f 3fb8c9db 3e8837a1 3e2a7345 3f5fd77d be12eacf bde4936f \
                 3f6e8c30 3fa12737 4000519a 3d5c1b3a 3f1e38f6 bed35ad0 bf575006 c0143a08"
            )
        );
        assert_eq!(
            bits(&torch_randn(24, 0, NoiseMath::Libm)),
            hex(
                "bf901b85 bf93808a be804bd6 bede255e 3f594515 3f312784 bea1cc6d c0075fc2 \
                 3eefaa55 be217f5f 3fb8c9db 3e8837a1 3e2a7344 3f5fd77d be12eae9 bde4936f \
                 3f6e8c31 3fa12737 4000519a 3d5c1b39 3f1e38f6 bed35ad0 bf575004 c0143a08"
            )
        );
        assert_eq!(
            bits(&torch_randn(17, 42, NoiseMath::AvxMathfun)),
            hex(
                "3ff6a529 be236d85 befeaae4 3ee111d8 bf4214e2 3f8a0650 3f4d0144 3fd71e93 \
                 3eb63345 3fa5f12f 3f1c4788 3faad8b0 be6d2eed 3d2b0c00 be80ce7a 3f5c1fb0 \
                 be9e9482"
            )
        );
    }
}
