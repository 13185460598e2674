//! The machine's own peaks, for the roofline `bench kernels` prints (on wgpu the device's, from
//! [`nibble_wgpu::WgpuBackend::measure_peaks`]). On the CPU backend: an
//! FMA-bound loop for each vector width the CPU has (AVX2 + FMA, AVX-512F), on every core at
//! once, and a memory-bound stream (a sum over 256 MiB on every core). Each kernel is then bound
//! by compute or by memory according to its arithmetic intensity against the ridge point, and
//! reported as the fraction of that peak it reaches. The blocked GEMM (a linear of more than a
//! few rows) and attention run the GEMM's micro-kernel on the widest instruction set present
//! ([`nibble_core::backend::cpu::gemm::isa`]), so that width's peak is their compute roof; the
//! other kernels use AVX2 + FMA.

use std::time::Instant;

/// Measured peaks.
#[derive(Debug, Clone)]
pub struct Peaks {
    /// GFLOP/s of the FMA loop per vector width present (name, figure).
    pub fma_gflop_s: Vec<(&'static str, f64)>,
    /// Read bandwidth of the stream, GB/s.
    pub stream_gb_s: f64,
    /// The width the CPU backend's kernels use, and its peak (the compute roof).
    pub used: (&'static str, f64),
    /// The width the blocked GEMM uses, and its peak (the GEMM's compute roof).
    pub gemm: (&'static str, f64),
}

impl Peaks {
    /// What bounds a kernel of `flops` and `bytes` and the fraction of that roof a measured
    /// `gflop_s` / `gb_s` reaches; `gemm` for a kernel that runs on the blocked GEMM.
    pub fn place(
        &self,
        gemm: bool,
        flops: f64,
        bytes: f64,
        gflop_s: f64,
        gb_s: f64,
    ) -> (&'static str, f64) {
        let roof = if gemm { self.gemm.1 } else { self.used.1 };
        let ridge = roof / self.stream_gb_s.max(1e-9);
        if flops / bytes.max(1.0) < ridge {
            ("memory", gb_s / self.stream_gb_s.max(1e-9))
        } else {
            ("compute", gflop_s / roof.max(1e-9))
        }
    }

    /// As JSON.
    pub fn json(&self) -> serde_json::Value {
        let fma: serde_json::Map<String, serde_json::Value> = self
            .fma_gflop_s
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
            .collect();
        serde_json::json!({"fma_gflop_s": fma, "stream_gb_s": self.stream_gb_s,
            "compute_roof": {"width": self.used.0, "gflop_s": self.used.1},
            "gemm_roof": {"width": self.gemm.0, "gflop_s": self.gemm.1}})
    }
}

impl Peaks {
    /// A wgpu device's peaks: one f32 FMA roof for every kernel, the read stream's bandwidth.
    pub fn device(p: nibble_wgpu::DevicePeaks) -> Self {
        Peaks {
            fma_gflop_s: vec![("f32 vec4", p.fma_gflop_s)],
            stream_gb_s: p.read_gb_s,
            used: ("f32 vec4", p.fma_gflop_s),
            gemm: ("f32 vec4", p.fma_gflop_s),
        }
    }
}

/// Runs `f(iters)` on `threads` threads at once; returns the total work units per second
/// (`units_per_iter` per iteration per thread), best of three.
fn on_all_cores(threads: usize, iters: u64, units_per_iter: f64, f: fn(u64) -> f32) -> f64 {
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let sink: f32 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads).map(|_| s.spawn(move || f(iters))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
        });
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(sink);
        best = best.max(threads as f64 * iters as f64 * units_per_iter / secs);
    }
    best
}

/// Measures the peaks with `threads` threads (the CPU backend's pool size).
pub fn measure_cpu(threads: usize) -> Peaks {
    let mut fma = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // 10 chains x 8 lanes x 2 flops per iteration.
            // SAFETY: AVX2 and FMA were detected.
            let g = on_all_cores(threads, 20_000_000, 160.0, |n| unsafe { x86::fma_avx2(n) });
            fma.push(("avx2+fma", g / 1e9));
        }
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected.
            let g = on_all_cores(threads, 20_000_000, 320.0, |n| unsafe {
                x86::fma_avx512(n)
            });
            fma.push(("avx512f", g / 1e9));
        }
    }
    // A portable loop (what a CPU without those gets): 8 independent chains, 2 flops each.
    let g = on_all_cores(threads, 10_000_000, 16.0, portable_fma);
    fma.push(("portable", g / 1e9));
    let used = fma
        .iter()
        .find(|(k, _)| *k == "avx2+fma")
        .or_else(|| fma.iter().find(|(k, _)| *k == "portable"))
        .copied()
        .unwrap_or(("portable", 1.0));
    let isa = nibble_core::backend::cpu::gemm::isa().name();
    let gemm = fma.iter().find(|(k, _)| *k == isa).copied().unwrap_or(used);
    Peaks {
        fma_gflop_s: fma,
        stream_gb_s: stream_gb_s(threads),
        used,
        gemm,
    }
}

fn portable_fma(n: u64) -> f32 {
    let mut a = [1.0f32, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7];
    let (m, c) = (
        std::hint::black_box(0.999_999f32),
        std::hint::black_box(1e-7f32),
    );
    for _ in 0..n {
        for x in a.iter_mut() {
            *x = *x * m + c;
        }
    }
    a.iter().sum()
}

/// Read bandwidth: every thread sums its share of 256 MiB of f32 (best of three passes).
fn stream_gb_s(threads: usize) -> f64 {
    let n = 64 << 20;
    let data = vec![1.0f32; n];
    let per = n / threads.max(1);
    let mut best = 0f64;
    for _ in 0..4 {
        let t = Instant::now();
        let sink: f32 = std::thread::scope(|s| {
            let hs: Vec<_> = data.chunks(per).map(|c| s.spawn(move || sum(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
        });
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(sink);
        best = best.max((n * 4) as f64 / secs / 1e9);
    }
    best
}

fn sum(c: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        return unsafe { x86::sum_avx2(c) };
    }
    let mut acc = [0f32; 16];
    for ch in c.chunks_exact(16) {
        for (a, x) in acc.iter_mut().zip(ch) {
            *a += x;
        }
    }
    acc.iter().sum()
}

// Intrinsics loops whose callers check the CPU features.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn)]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_avx2(n: u64) -> f32 {
        let mut a = [_mm256_set1_ps(1.0); 10];
        let m = _mm256_set1_ps(std::hint::black_box(0.999_999));
        let c = _mm256_set1_ps(std::hint::black_box(1e-7));
        for _ in 0..n {
            for x in a.iter_mut() {
                *x = _mm256_fmadd_ps(*x, m, c);
            }
        }
        let mut s = _mm256_setzero_ps();
        for x in a {
            s = _mm256_add_ps(s, x);
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum()
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_avx512(n: u64) -> f32 {
        let mut a = [_mm512_set1_ps(1.0); 10];
        let m = _mm512_set1_ps(std::hint::black_box(0.999_999));
        let c = _mm512_set1_ps(std::hint::black_box(1e-7));
        for _ in 0..n {
            for x in a.iter_mut() {
                *x = _mm512_fmadd_ps(*x, m, c);
            }
        }
        let mut s = _mm512_setzero_ps();
        for x in a {
            s = _mm512_add_ps(s, x);
        }
        _mm512_reduce_add_ps(s)
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn sum_avx2(c: &[f32]) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let p = c.as_ptr();
        let mut i = 0;
        while i + 32 <= c.len() {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_ps(*a, _mm256_loadu_ps(p.add(i + 8 * j)));
            }
            i += 32;
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(
            out.as_mut_ptr(),
            _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])),
        );
        out.iter().sum::<f32>() + c[i..].iter().sum::<f32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_is_placed_under_the_roof_it_is_bound_by() {
        let p = Peaks {
            fma_gflop_s: vec![("avx2+fma", 100.0), ("avx512f", 200.0)],
            stream_gb_s: 10.0,
            used: ("avx2+fma", 100.0),
            gemm: ("avx512f", 200.0),
        };
        // Ridge at 10 flop/byte: a GEMV (0.5 flop/byte) is memory-bound, a GEMM compute-bound.
        assert_eq!(p.place(false, 1e6, 2e6, 4.0, 8.0), ("memory", 0.8));
        assert_eq!(p.place(false, 1e9, 1e6, 70.0, 0.07), ("compute", 0.7));
        // The GEMM under its own width's roof.
        assert_eq!(p.place(true, 1e9, 1e6, 70.0, 0.07), ("compute", 0.35));
    }
}
