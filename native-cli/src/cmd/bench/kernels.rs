//! `nibble bench kernels`: each kernel at realistic shapes on one backend, device-resident
//! operands, time per call, GB/s moved and GFLOP/s; on the CPU backend and on wgpu a roofline:
//! the machine's (or the device's) own peaks measured first ([`super::roofline`]) and each
//! kernel's fraction of the roof it is bound by. On CUDA the references are the device's copy
//! bandwidths and cuBLAS's bf16 GEMM on the tiled linear's shape.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use nibble_core::backend::cpu_ref::CpuRefBackend;
use nibble_core::backend::{layout_op, ArenaSlice, Backend};
use nibble_core::graph::{OpKind, ValueInfo};
use serde_json::json;

use super::KernelsArgs;
use crate::args::BackendArg;

struct Bench {
    name: String,
    op: OpKind,
    inputs: Vec<Vec<usize>>,
    q4: Option<(usize, usize)>,
    out: Vec<usize>,
    flops: f64,
    bytes: f64,
}

impl Bench {
    /// Whether the CPU backend runs it on the GEMM's micro-kernel (a 4-bit linear of more rows
    /// than the GEMV takes, attention).
    fn on_gemm(&self) -> bool {
        match self.op {
            OpKind::LinearQ4 { .. } => self.inputs[0][0] > nibble_core::backend::cpu::GEMV_MAX_ROWS,
            OpKind::Attention { .. } => true,
            _ => false,
        }
    }
}

fn benches(quick: bool, big_gemv: bool) -> Vec<Bench> {
    let t = if quick { 512 } else { 4096 };
    let lin = |m: usize, n: usize, k: usize| Bench {
        name: format!("nf4 linear {m}x{k} by {n}x{k}"),
        op: OpKind::LinearQ4 { bias: false },
        inputs: vec![vec![m, k]],
        q4: Some((n, k)),
        out: vec![m, n],
        flops: 2.0 * (m * n * k) as f64,
        bytes: (m * k * 4 + n * k / 2 + n * k / 64 * 4 + m * n * 4) as f64,
    };
    let (h, d) = (24usize, 128usize);
    let norm = |op: OpKind, name: &str, rows: usize, dim: usize, extra: usize| Bench {
        name: format!("{name} {rows}x{dim}"),
        op,
        inputs: std::iter::once(vec![rows, dim])
            .chain((0..extra).map(|_| vec![dim]))
            .collect(),
        q4: None,
        out: vec![rows, dim],
        flops: 5.0 * (rows * dim) as f64,
        bytes: (2 * rows * dim * 4) as f64,
    };
    let mut v = vec![
        lin(1, 4096, 4096),
        lin(t, 3072, 3072),
        Bench {
            name: format!("attention {t} tokens x {h} heads x {d}"),
            op: OpKind::Attention {
                causal: false,
                scale: 1.0 / (d as f32).sqrt(),
                key_mask: false,
            },
            inputs: vec![vec![h, t, d]; 3],
            q4: None,
            out: vec![h, t, d],
            flops: 4.0 * (h * t * t * d) as f64,
            bytes: (4 * h * t * d * 4) as f64,
        },
        norm(OpKind::RmsNorm { eps: 1e-6 }, "rms_norm", t, 3072, 1),
        norm(
            OpKind::LayerNorm {
                eps: 1e-6,
                affine: true,
            },
            "layer_norm",
            t,
            3072,
            2,
        ),
    ];
    if big_gemv {
        // 117 MB of NF4 codes: more than a GPU's L2, so GB/s is DRAM bandwidth.
        v.insert(1, lin(1, 28672, 8192));
    }
    v
}

fn run_one<B: Backend>(backend: &mut B, b: &Bench) -> Result<(Duration, u32)> {
    let infos: Vec<ValueInfo> = b.inputs.iter().map(|s| ValueInfo::f32(s)).collect();
    let q4_shape = b.q4.map(|(n, k)| vec![n, k]);
    let lay = layout_op(
        backend,
        &infos,
        &ValueInfo::f32(&b.out),
        q4_shape.as_deref().map(|s| (s, 64)),
        b.op.in_place_input(),
    );
    let out_info = ValueInfo::f32(&b.out);
    let ws = backend.workspace(&[nibble_core::backend::OpShapes {
        op: &b.op,
        inputs: &infos,
        out: &out_info,
    }]);
    let (ins, out, q4) = (lay.inputs, lay.out, lay.q4);
    backend.allocate(lay.arena_words, lay.pool_bytes, ws.device_bytes)?;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for o in &ins {
        let words: Vec<u32> = (0..o.slice.len)
            .map(|_| ((rnd() >> 40) as f32 / (1u64 << 24) as f32 - 0.5).to_bits())
            .collect();
        backend.write_arena(o.slice, &words)?;
    }
    if let Some(v) = &q4 {
        let packed: Vec<u8> = (0..v.packed.len).map(|_| rnd() as u8).collect();
        drop(backend.upload(v.packed.offset, &packed)?);
        let absmax: Vec<u8> = (0..v.absmax.len / 4)
            .flat_map(|i| (0.01 + (i % 97) as f32 * 1e-4).to_le_bytes())
            .collect();
        drop(backend.upload(v.absmax.offset, &absmax)?);
        let code: Vec<u8> = nibble_core::format::bnb::QuantType::Nf4
            .code_table()
            .iter()
            .flat_map(|c| c.to_le_bytes())
            .collect();
        drop(backend.upload(v.code.offset, &code)?);
    }
    // Warm-up (pipeline compilation) and one timed call, to size the run: then `calls` launches
    // back to back, timed from before the first to the end of the last (one read waits for
    // them), so that a device's per-call synchronization is not counted in each call.
    let one = Slot1 {
        offset: out.slice.offset,
    };
    backend.run(&b.op, &ins, q4.as_ref(), &out)?;
    one.wait(backend)?;
    let t = Instant::now();
    backend.run(&b.op, &ins, q4.as_ref(), &out)?;
    one.wait(backend)?;
    let first = t.elapsed().max(Duration::from_micros(1));
    let calls =
        (Duration::from_millis(800).as_secs_f64() / first.as_secs_f64()).clamp(1.0, 2000.0) as u32;
    // On a device with a clock (CUDA: two events on the compute stream around the calls) the
    // device's time; elsewhere the host's, to the end of the read that waits for the last call.
    backend.begin_timing()?;
    let start = Instant::now();
    for _ in 0..calls {
        backend.run(&b.op, &ins, q4.as_ref(), &out)?;
    }
    let device = backend.end_timing()?;
    one.wait(backend)?;
    Ok((device.unwrap_or_else(|| start.elapsed()) / calls, calls))
}

/// One word of the output: reading it back waits for every call queued before.
struct Slot1 {
    offset: usize,
}

impl Slot1 {
    fn wait<B: Backend>(&self, backend: &mut B) -> Result<()> {
        backend.read_arena(ArenaSlice {
            offset: self.offset,
            len: 1,
        })?;
        Ok(())
    }
}

/// Host-to-device throughput of the weight path itself: `iters` slot-sized uploads from a
/// [`StagingRing`] whose slots come from the backend's allocator (pinned memory for CUDA) into
/// two alternating pool regions, each slot reused only after its upload's fence, GB/s.
fn ring_upload_gb_s<B: Backend>(
    backend: &mut B,
    slots: usize,
    slot_bytes: usize,
    iters: usize,
) -> Result<f64> {
    use nibble_core::stream::ring::{HostAllocator, StagingRing};
    backend.allocate(1, 2 * slot_bytes as u64, 0)?;
    let ring = match backend.slot_allocator() {
        Some(a) => StagingRing::new(slots, slot_bytes, a.as_ref())?,
        None => StagingRing::new(slots, slot_bytes, &HostAllocator)?,
    };
    let upload = |i: usize, backend: &mut B| -> Result<()> {
        let slot = ring.acquire();
        let guard = ring.filled(slot, slot_bytes);
        let fence = backend.upload((i % 2) as u64 * slot_bytes as u64, guard.bytes())?;
        guard.release_after(fence);
        Ok(())
    };
    upload(0, backend)?; // warm-up
    let t = Instant::now();
    for i in 0..iters {
        upload(i, backend)?;
    }
    // Every slot back in the ring means every fence has signalled.
    let held: Vec<_> = (0..slots).map(|_| ring.acquire()).collect();
    let s = t.elapsed().as_secs_f64();
    for slot in held {
        ring.give_back(slot);
    }
    backend.release();
    Ok((iters * slot_bytes) as f64 / s / 1e9)
}

/// Runs every kernel benchmark on `backend_name` and prints a table or JSON.
pub fn run(a: &KernelsArgs) -> Result<()> {
    let (as_json, quick) = (a.json, a.quick);
    match a.backend {
        BackendArg::Cpu => {
            let label = format!(
                "cpu ({})",
                nibble_core::backend::cpu::CpuBackend::new().describe()
            );
            let threads = nibble_core::backend::cpu::pool::ThreadPool::global().threads();
            if !as_json {
                eprintln!("measuring this machine's peaks on {threads} threads ...");
            }
            let peaks = super::roofline::measure_cpu(threads);
            report(
                label,
                as_json,
                quick,
                false,
                || Ok(nibble_core::backend::cpu::CpuBackend::new()),
                None,
                Some(peaks),
            )
        }
        BackendArg::CpuRef => report(
            "cpu-ref (scalar reference)".into(),
            as_json,
            quick,
            false,
            || Ok(CpuRefBackend::new()),
            None,
            None,
        ),
        BackendArg::Wgpu => {
            let mut probe = nibble_wgpu::WgpuBackend::new()?;
            let label = format!("wgpu: {}", probe.describe());
            if !as_json {
                eprintln!("measuring the device's peaks ...");
            }
            let peaks = super::roofline::Peaks::device(probe.measure_peaks()?);
            let mut first = Some(probe);
            report(
                label,
                as_json,
                quick,
                false,
                move || match first.take() {
                    Some(b) => Ok(b),
                    None => Ok(nibble_wgpu::WgpuBackend::new()?),
                },
                None,
                Some(peaks),
            )
        }
        BackendArg::Cuda => {
            let mut probe = nibble_cuda::CudaBackend::new()?;
            let label = format!("cuda: {}", probe.describe());
            let t = if quick { 512 } else { 4096 };
            // References: pinned host-to-device and device-to-device copies, cuBLAS bf16 GEMM of
            // the tiled linear's shape.
            let copies = probe.bench_copies(256 << 20, 10)?;
            let cublas = probe.bench_cublas_bf16(t, 3072, 3072, 20)?;
            let ring = ring_upload_gb_s(&mut probe, 4, 64 << 20, 40)?;
            let refs = json!({
                "h2d_pinned_gb_s": copies.h2d_pinned_gb_s,
                "ring_h2d_gb_s": ring,
                "ring": "4 x 64 MiB, slots from the backend's allocator",
                "d2d_copy_gb_s": copies.d2d_gb_s,
                "cublas_bf16_tflop_s": cublas,
                "cublas_shape": [t, 3072, 3072],
            });
            let mut first = Some(probe);
            report(
                label,
                as_json,
                quick,
                true,
                move || match first.take() {
                    Some(b) => Ok(b),
                    None => Ok(nibble_cuda::CudaBackend::new()?),
                },
                Some(refs),
                None,
            )
        }
        BackendArg::Auto => {
            bail!("bench kernels measures one backend: --backend cpu, cpu-ref, wgpu or cuda")
        }
    }
}

/// One fresh backend per kernel (each allocates its own arena and pool once).
fn report<B: Backend>(
    label: String,
    as_json: bool,
    quick: bool,
    big_gemv: bool,
    mut make: impl FnMut() -> Result<B>,
    refs: Option<serde_json::Value>,
    peaks: Option<super::roofline::Peaks>,
) -> Result<()> {
    if !as_json {
        eprintln!(
            "backend {label}{}",
            if quick { " (--quick shapes)" } else { "" }
        );
        if let Some(p) = &peaks {
            let fma: Vec<String> = p
                .fma_gflop_s
                .iter()
                .map(|(k, v)| format!("{k} {v:.1} GFLOP/s"))
                .collect();
            eprintln!(
                "peaks: FMA {}; memory stream {:.2} GB/s; roof for the GEMM: {} ({:.1} GFLOP/s), \
                 for the other kernels: {} ({:.1} GFLOP/s), ridge at {:.1} flop/byte",
                fma.join(", "),
                p.stream_gb_s,
                p.gemm.0,
                p.gemm.1,
                p.used.0,
                p.used.1,
                p.used.1 / p.stream_gb_s.max(1e-9)
            );
        }
        eprintln!(
            "{:<44} {:>12} {:>6} {:>10} {:>10}{}",
            "kernel",
            "ms/call",
            "calls",
            "GB/s",
            "GFLOP/s",
            if peaks.is_some() {
                "  bound    of roof"
            } else {
                ""
            }
        );
    }
    let mut rows = Vec::new();
    for b in &benches(quick, big_gemv) {
        let (t, calls) = run_one(&mut make()?, b)?;
        let s = t.as_secs_f64();
        let (gb_s, gflop_s) = (b.bytes / s / 1e9, b.flops / s / 1e9);
        let placed = peaks
            .as_ref()
            .map(|p| p.place(b.on_gemm(), b.flops, b.bytes, gflop_s, gb_s));
        if !as_json {
            eprintln!(
                "{:<44} {:>12.3} {:>6} {:>10.2} {:>10.2}{}",
                b.name,
                s * 1e3,
                calls,
                gb_s,
                gflop_s,
                placed
                    .map(|(bound, f)| format!("  {bound:<8} {:>6.1}%", f * 100.0))
                    .unwrap_or_default()
            );
        }
        let mut row = json!({
            "kernel": b.name, "ms_per_call": s * 1e3, "calls": calls,
            "gb_s": gb_s, "gflop_s": gflop_s,
        });
        if let Some((bound, f)) = placed {
            row["bound"] = json!(bound);
            row["of_roof"] = json!(f);
        }
        rows.push(row);
    }
    // Against the references: the GEMV beyond L2 against the copy bandwidth, the tiled 4-bit
    // linear against cuBLAS bf16 on the same shape.
    let mut ratios = json!({});
    if let Some(r) = &refs {
        let find = |prefix: &str| {
            rows.iter()
                .find(|x| x["kernel"].as_str().is_some_and(|k| k.starts_with(prefix)))
                .cloned()
        };
        if let (Some(ring), Some(peak)) =
            (r["ring_h2d_gb_s"].as_f64(), r["h2d_pinned_gb_s"].as_f64())
        {
            ratios["ring_h2d_over_pinned_peak"] = json!(ring / peak);
        }
        if let (Some(g), Some(d)) = (
            find("nf4 linear 1x8192 by 28672x8192"),
            r["d2d_copy_gb_s"].as_f64(),
        ) {
            ratios["gemv_gb_s_over_d2d_copy"] = json!(g["gb_s"].as_f64().unwrap_or(0.0) / d);
        }
        let tiled = format!("nf4 linear {}x3072", r["cublas_shape"][0]);
        if let (Some(g), Some(c)) = (find(&tiled), r["cublas_bf16_tflop_s"].as_f64()) {
            ratios["gemm_over_cublas_bf16"] = json!(g["gflop_s"].as_f64().unwrap_or(0.0) / 1e3 / c);
        }
        if !as_json {
            eprintln!("references: {r}");
            eprintln!("ratios: {ratios} (targets: ring H2D >= 0.9 x pinned peak, GEMV >= 0.8 x copy bandwidth, GEMM >= 0.7 x cuBLAS bf16)");
        }
    }
    if as_json {
        crate::output::write_stdout(&format!(
            "{}\n",
            serde_json::to_string_pretty(
                &json!({"backend": label, "kernels": rows, "references": refs, "ratios": ratios,
                    "roofline": peaks.as_ref().map(super::roofline::Peaks::json)})
            )?
        ))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_upload_cycles_every_slot_through_fenced_uploads() {
        let mut b = CpuRefBackend::new();
        let gb_s = ring_upload_gb_s(&mut b, 3, 1 << 20, 12).expect("ring upload");
        assert!(gb_s.is_finite() && gb_s > 0.0, "{gb_s}");
        // The backend was released and can be allocated again.
        b.allocate(1, 16, 0).expect("allocate after release");
    }
}
