//! `nibble bench kernels`: each kernel at realistic shapes on one backend, device-resident
//! operands, time per call, GB/s moved and GFLOP/s.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use nibble_core::backend::{layout_op, ArenaSlice, Backend, CpuRefBackend};
use nibble_core::graph::{OpKind, ValueInfo};
use serde_json::json;

struct Bench {
    name: String,
    op: OpKind,
    inputs: Vec<Vec<usize>>,
    q4: Option<(usize, usize)>,
    out: Vec<usize>,
    flops: f64,
    bytes: f64,
}

fn benches(quick: bool) -> Vec<Bench> {
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
    vec![
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
    ]
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
    let (ins, out, q4) = (lay.inputs, lay.out, lay.q4);
    backend.allocate(lay.arena_words, lay.pool_bytes)?;
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
        let code: Vec<u8> = nibble_core::bnb::QuantType::Nf4
            .code_table()
            .iter()
            .flat_map(|c| c.to_le_bytes())
            .collect();
        drop(backend.upload(v.code.offset, &code)?);
    }
    // Warm-up (pipeline compilation), then as many calls as fit in about a second.
    backend.run(&b.op, &ins, q4.as_ref(), &out)?;
    backend.read_arena(ArenaSlice {
        offset: out.slice.offset,
        len: 1,
    })?;
    let mut calls = 0u32;
    let start = Instant::now();
    while calls == 0 || (start.elapsed() < Duration::from_millis(800) && calls < 50) {
        backend.run(&b.op, &ins, q4.as_ref(), &out)?;
        backend.read_arena(ArenaSlice {
            offset: out.slice.offset,
            len: 1,
        })?;
        calls += 1;
    }
    Ok((start.elapsed() / calls, calls))
}

/// Runs every kernel benchmark on `backend_name` and prints a table or JSON.
pub fn run(backend_name: &str, as_json: bool, quick: bool) -> Result<()> {
    match backend_name {
        "cpu" => report(
            "cpu_ref (scalar reference; the optimized CPU path comes with the Llama work)".into(),
            as_json,
            quick,
            || Ok(CpuRefBackend::new()),
        ),
        "wgpu" => {
            let probe = nibble_wgpu::WgpuBackend::new()?;
            let label = format!("wgpu: {}", probe.describe());
            let mut first = Some(probe);
            report(label, as_json, quick, move || match first.take() {
                Some(b) => Ok(b),
                None => Ok(nibble_wgpu::WgpuBackend::new()?),
            })
        }
        "cuda" => {
            bail!("the CUDA backend is not part of this build yet; use --backend wgpu or cpu")
        }
        other => bail!("--backend '{other}': expected cpu, wgpu or cuda"),
    }
}

/// One fresh backend per kernel (each allocates its own arena and pool once).
fn report<B: Backend>(
    label: String,
    as_json: bool,
    quick: bool,
    mut make: impl FnMut() -> Result<B>,
) -> Result<()> {
    if !as_json {
        eprintln!(
            "backend {label}{}",
            if quick { " (--quick shapes)" } else { "" }
        );
        eprintln!(
            "{:<44} {:>12} {:>6} {:>10} {:>10}",
            "kernel", "ms/call", "calls", "GB/s", "GFLOP/s"
        );
    }
    let mut rows = Vec::new();
    for b in &benches(quick) {
        let (t, calls) = run_one(&mut make()?, b)?;
        let s = t.as_secs_f64();
        if !as_json {
            eprintln!(
                "{:<44} {:>12.3} {:>6} {:>10.2} {:>10.2}",
                b.name,
                s * 1e3,
                calls,
                b.bytes / s / 1e9,
                b.flops / s / 1e9
            );
        }
        rows.push(json!({
            "kernel": b.name, "ms_per_call": s * 1e3, "calls": calls,
            "gb_s": b.bytes / s / 1e9, "gflop_s": b.flops / s / 1e9,
        }));
    }
    if as_json {
        crate::write_stdout(&format!(
            "{}\n",
            serde_json::to_string_pretty(&json!({"backend": label, "kernels": rows}))?
        ))?;
    }
    Ok(())
}
