//! `nibble run` for Flux-style DiTs: flow-matching Euler denoising, one streaming pass over the
//! blocks per step, per-step wall time / bytes / stall / RSS, atomic checkpoints after every step
//! and resume from the last one.

use anyhow::{bail, Context, Result};
use nibble_core::backend::Backend;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::dit::DitConfig;
use nibble_core::models::dit::{schedule, Checkpoint, DenoiseStep, Denoiser, DitInputs};
use nibble_core::plan::fmt_bytes;
use serde_json::json;

use super::options::RunArgs;

/// Reads inputs named like the fixture's (`hidden_states`, `encoder_hidden_states`, ...).
pub fn read_inputs(path: &std::path::Path, cfg: &DitConfig) -> Result<DitInputs> {
    let f = ModelIndex::open(path)?;
    let get = |n: &str| -> Result<Vec<f32>> {
        Ok(f.read_f32(
            f.require(n)
                .with_context(|| format!("{}: no tensor '{n}'", path.display()))?,
        )?)
    };
    DitInputs::from_named(cfg, get)
}

/// Writes the first three channels of a latent `[h * w, c]` as an RGB PNG (each normalized),
/// each token `scale` pixels wide.
pub fn write_preview(
    path: &std::path::Path,
    latent: &[f32],
    h: usize,
    w: usize,
    c: usize,
    scale: usize,
) -> Result<()> {
    let s = scale.max(1);
    let (ph, pw) = (h * s, w * s);
    let mut rgb = vec![0u8; ph * pw * 3];
    for ch in 0..3.min(c) {
        let vals: Vec<f32> = (0..h * w).map(|i| latent[i * c + ch]).collect();
        let (lo, hi) = vals
            .iter()
            .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        for y in 0..ph {
            for x in 0..pw {
                let v = vals[(y / s) * w + x / s];
                rgb[(y * pw + x) * 3 + ch] =
                    (((v - lo) / (hi - lo).max(1e-12)) * 255.0).round() as u8;
            }
        }
    }
    crate::output::write_png(path, &rgb, pw, ph)
}

/// Writes a latent `[1, n, c]` as `latent` (float32).
pub fn write_latent(path: &std::path::Path, x: &[f32], n: usize, c: usize) -> Result<()> {
    nibble_core::format::writer::write_safetensors(
        path,
        &[(
            "latent".into(),
            nibble_core::format::dtype::Dtype::F32,
            vec![1, n as u64, c as u64],
            nibble_core::format::dtype::f32_to_bytes(x),
        )],
        &Default::default(),
    )?;
    Ok(())
}

/// One step's line and JSON row.
pub fn step_row(s: &DenoiseStep) -> serde_json::Value {
    json!({"step": s.step, "wall_ms": s.wall.as_secs_f64() * 1e3,
           "bytes_streamed": s.stats.stream.bytes,
           "bytes_source": s.stats.source_bytes,
           "bytes_host": s.stats.host_bytes,
           "stall_ms": s.stats.stream.stall.as_secs_f64() * 1e3,
           "read_ms": s.stats.stream.read_busy.as_secs_f64() * 1e3,
           "rss_bytes": s.rss_bytes})
}

/// Runs the denoising loop on `backend`.
pub(super) fn run<B: Backend>(
    o: &RunArgs,
    model: &ModelIndex,
    mut backend: B,
    label: &str,
) -> Result<()> {
    let d = &o.dit;
    let cfg = DitConfig::of(model)?;
    let resumed = match &d.resume {
        Some(dir) => Some(Checkpoint::load(dir)?.with_context(|| {
            format!(
                "--resume {}: no {} there",
                dir.display(),
                nibble_core::models::dit::CHECKPOINT_FILE
            )
        })?),
        None => None,
    };
    if o.plan_only && resumed.is_none() && d.inputs.is_none() {
        // Planning needs the token counts, not the inputs: nothing is drawn (a --text-len of
        // 2e7 would draw gigabytes to print the plan of a small model).
        let (h, w) = (d.height.unwrap_or(4), d.width.unwrap_or(4));
        let image = h
            .checked_mul(w)
            .filter(|&n| n > 0 && n <= nibble_core::graph::MAX_ELEMENTS)
            .with_context(|| format!("a latent of {h} x {w} tokens"))?;
        if d.text_len == 0 {
            bail!("--text-len must be at least 1");
        }
        let graph = Denoiser::<B>::graph_for_tokens(model, image, d.text_len)?;
        super::plan::prelude(o, &mut backend, label, "transformer", &graph, model)?;
        return Ok(());
    }
    let inputs = match (&resumed, &d.inputs) {
        (Some(c), _) => c.inputs.clone(),
        (None, Some(p)) => read_inputs(p, &cfg)?,
        (None, None) => DitInputs::random(
            &cfg,
            d.height.unwrap_or(4),
            d.width.unwrap_or(4),
            d.text_len,
            d.guidance.unwrap_or(3.5),
            o.seed,
        )?,
    };
    let sigmas = match &resumed {
        Some(c) => c.sigmas.clone(),
        None => schedule(
            d.steps.unwrap_or(28),
            d.shift,
            d.dynamic_shift,
            inputs.image_tokens(),
        )?,
    };
    if resumed.is_none() && d.steps == Some(0) {
        bail!("--steps must be at least 1");
    }
    let graph = Denoiser::<B>::graph_for(model, &inputs)?;
    let Some((opts, budget_note)) =
        super::plan::prelude(o, &mut backend, label, "transformer", &graph, model)?
    else {
        return Ok(());
    };
    drop(graph);
    let mut den = Denoiser::new(model, backend, inputs, sigmas, opts)?;
    if let Some(c) = &resumed {
        den.restore(c)?;
    }
    super::plan::announce(o, label, &budget_note, den.executor().plan());
    if !o.json {
        if let Some(c) = &resumed {
            eprintln!("resuming after step {} of {}", c.done, den.steps());
        }
    }
    let mut rows = Vec::with_capacity(den.steps());
    let t_all = std::time::Instant::now();
    let n_steps = den.steps();
    while let Some(s) = den.step()? {
        if let Some(dir) = &d.checkpoint {
            den.checkpoint().save(dir)?;
        }
        if !o.json {
            eprintln!(
                "step {:>3}/{}  {:>9.1} ms  {:>10}  stall {:>7.1} ms  RSS {}",
                s.step,
                n_steps,
                s.wall.as_secs_f64() * 1e3,
                fmt_bytes(s.stats.stream.bytes),
                s.stats.stream.stall.as_secs_f64() * 1e3,
                fmt_bytes(s.rss_bytes)
            );
        }
        rows.push(step_row(&s));
    }
    let (n, c) = (den.inputs().image_tokens(), cfg.in_channels);
    if let Some(p) = &d.out {
        write_latent(p, den.latent(), n, c)?;
    }
    if let Some(p) = &d.preview {
        let (h, w) = den.inputs().grid();
        write_preview(p, den.latent(), h, w, c, 1)?;
    }
    let total = t_all.elapsed().as_secs_f64();
    let ran = rows.len().max(1) as f64;
    if o.json {
        let v = json!({"steps": rows, "summary": {"total_ms": total * 1e3, "ms_per_step": total * 1e3 / ran,
            "rss_max_bytes": nibble_core::io::machine::peak_rss_bytes(),
            "budget": budget_note.json(),
            "bytes_source_per_step": rows.iter().map(|r| r["bytes_source"].clone()).collect::<Vec<_>>(),
            "bytes_host_per_step": rows.iter().map(|r| r["bytes_host"].clone()).collect::<Vec<_>>(),
            "plan": den.executor().plan().to_json()}});
        crate::output::write_stdout(&format!("{v}\n"))?;
    } else {
        eprintln!(
            "{} steps in {:.1} s ({:.1} ms/step)",
            rows.len(),
            total,
            total * 1e3 / ran
        );
    }
    Ok(())
}
