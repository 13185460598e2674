//! `nibble bench offload`: the same DiT denoising run three ways, each in its own process so
//! that RSS figures do not mix: all weights resident (when they fit), streamed through nibble's
//! fixed ring, and the naive offloader (every step, every block read synchronously into a buffer
//! allocated for it and dropped). Step time and RSS per step for each, the overlap of the
//! streamed run (step time against max(read time, compute time)), a table and a chart.

use std::process::Command;

use anyhow::{bail, Context, Result};
use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::dit::DitConfig;
use nibble_core::models::dit::{schedule, Denoiser, DitInputs};
use nibble_core::plan::budget::{decide, Budget, BudgetRequest, DeviceBudget, Machine};
use nibble_core::plan::fmt_bytes;
use serde_json::json;

use super::OffloadArgs;
use crate::args::value_name;

struct OneMode<'a> {
    b: &'a OffloadArgs,
    mode: &'a str,
}

impl crate::backends::WithBackend for OneMode<'_> {
    type Output = serde_json::Value;
    fn call<B: Backend + 'static>(self, mut backend: B, label: &str) -> Result<serde_json::Value> {
        let b = self.b;
        let model = open_dit(b)?;
        let cfg = DitConfig::of(&model)?;
        let inputs = DitInputs::random(&cfg, b.height, b.width, b.text_len, 3.5, 0)?;
        let sigmas = schedule(b.steps, 1.0, true, inputs.image_tokens())?;
        let req = BudgetRequest {
            device: match self.mode {
                "resident" => DeviceBudget::Resident,
                _ => b.device_budget.into(),
            },
            host: Budget::Auto,
            slots: b.slots.0,
            slot_size: b.slot_size.0,
            stream_all: false,
        };
        let graph = Denoiser::<B>::graph_for(&model, &inputs)?;
        let d = decide(&req, &Machine::measure(), &mut backend, &[(&graph, &model)])?;
        drop(graph);
        let opts = ExecOptions {
            naive: self.mode == "naive",
            ..ExecOptions::decided(&d, 2)
        };
        let mut den = Denoiser::new(&model, backend, inputs, sigmas, opts)?;
        let plan = den.executor().plan().clone();
        let mut rows = Vec::new();
        while let Some(s) = den.step()? {
            rows.push(crate::cmd::run::step_row(&s));
        }
        Ok(json!({"mode": self.mode, "backend": label, "steps": rows,
                  "plan": {"resident_groups": plan.counts().0, "streamed_groups": plan.counts().1,
                           "peak_device_bytes": plan.peak_device_bytes, "peak_host_bytes": plan.peak_host_bytes,
                           "streamed_bytes_per_step": plan.streamed_bytes_per_step}}))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn col(rows: &serde_json::Value, k: &str) -> Vec<f64> {
    rows.as_array()
        .map(|a| a.iter().filter_map(|r| r[k].as_f64()).collect())
        .unwrap_or_default()
}

/// Runs the benchmark (or, with `mode`, one of its modes).
/// The model of `--model`, which must be a lone Flux-style DiT: a pipeline folder, a language
/// model or an encoder is refused saying what it is.
fn open_dit(b: &OffloadArgs) -> Result<ModelIndex> {
    if let Some(class) = nibble_core::models::pipeline::pipeline_class(&b.model)? {
        bail!(
            "{} is a diffusers pipeline folder ({class}): bench offload measures a lone Flux-style \
             DiT; give its transformer/ folder",
            b.model
        );
    }
    let model = ModelIndex::open_path_or_url(&b.model, b.file_mode.into())?;
    match model
        .config
        .as_ref()
        .and_then(nibble_core::models::ModelKind::of_config)
    {
        Some(nibble_core::models::ModelKind::Dit) => Ok(model),
        Some(k) => bail!(
            "{}: config.json describes {}, not a Flux-style DiT: bench offload measures a DiT",
            b.model,
            match k {
                nibble_core::models::ModelKind::Llm => "a language model",
                _ => "a BERT encoder",
            }
        ),
        None => bail!(
            "{}: config.json is not a Flux-style DiT's: bench offload measures a DiT",
            b.model
        ),
    }
}

pub fn run(b: &OffloadArgs) -> Result<()> {
    let stem = b.chart.clone().unwrap_or_else(|| "nibble-offload".into());
    let reads = crate::output::paths::Reads {
        model: &b.model,
        files: vec![],
    };
    for ext in ["svg", "png"] {
        crate::output::paths::check_output(&stem.with_extension(ext), "--chart", &reads)?;
    }
    if let Some(mode) = &b.mode {
        let v = crate::backends::select(b.backend)?.run(OneMode { b, mode })?;
        return crate::output::write_stdout(&format!("{v}\n"));
    }
    if b.steps < 2 {
        bail!("--steps must be at least 2 (the first step warms up)");
    }
    // Does the model fit resident?
    let model = open_dit(b)?;
    let limit = match b.resident_limit {
        Some(s) => s,
        None => nibble_core::io::machine::available_memory_bytes().unwrap_or(0) * 6 / 10,
    };
    let need = model.file_bytes() * 2;
    let exe = std::env::current_exe().context("locating the nibble binary")?;
    let mut results = Vec::new();
    for mode in ["resident", "streamed", "naive"] {
        if mode == "resident" && need > limit {
            eprintln!(
                "resident: skipped (the model needs about {} of device memory, the limit is {})",
                fmt_bytes(need),
                fmt_bytes(limit)
            );
            continue;
        }
        eprintln!("== {mode}: {} steps", b.steps);
        let mut cmd = Command::new(&exe);
        cmd.args(["bench", "offload", "--model", &b.model, "--mode", mode])
            .args([
                "--steps",
                &b.steps.to_string(),
                "--device-budget",
                &b.device_budget.to_string(),
            ])
            .args([
                "--slots",
                &b.slots.to_string(),
                "--slot-size",
                &b.slot_size.to_string(),
            ])
            .args(["--file-mode", &value_name(b.file_mode)])
            .args([
                "--backend",
                &value_name(b.backend),
                "--height",
                &b.height.to_string(),
            ])
            .args([
                "--width",
                &b.width.to_string(),
                "--text-len",
                &b.text_len.to_string(),
            ]);
        let out = cmd
            .output()
            .with_context(|| format!("running the {mode} mode"))?;
        if !out.status.success() {
            bail!(
                "{mode} mode failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        results.push(serde_json::from_slice::<serde_json::Value>(&out.stdout)?);
    }
    let resident_ms = results
        .iter()
        .find(|r| r["mode"] == "resident")
        .map(|r| median(col(&r["steps"], "wall_ms").into_iter().skip(1).collect()));
    let mut table = String::from(
        "| mode | device plan | streamed per step | ms per step (median, after the first) | RSS step 2 | RSS last | RSS max |\n|---|---|---|---|---|---|---|\n",
    );
    let mut series = Vec::new();
    let mut summary = Vec::new();
    let mut notes = String::new();
    for r in &results {
        let steps = &r["steps"];
        let wall = col(steps, "wall_ms");
        let rss = col(steps, "rss_bytes");
        let med = median(wall.iter().skip(1).copied().collect());
        let rmax = rss.iter().copied().fold(0.0, f64::max);
        let mode = r["mode"].as_str().unwrap_or("");
        table.push_str(&format!(
            "| {mode} | {} | {} | {med:.1} | {} | {} | {} |\n",
            fmt_bytes(r["plan"]["peak_device_bytes"].as_u64().unwrap_or(0)),
            fmt_bytes(col(steps, "bytes_streamed").last().copied().unwrap_or(0.0) as u64),
            fmt_bytes(rss.get(1).copied().unwrap_or(0.0) as u64),
            fmt_bytes(rss.last().copied().unwrap_or(0.0) as u64),
            fmt_bytes(rmax as u64),
        ));
        let mut entry = json!({"mode": mode, "ms_per_step": med, "rss_max_bytes": rmax,
                               "rss_growth_from_step2_bytes": rss.last().unwrap_or(&0.0) - rss.get(1).unwrap_or(&0.0)});
        if mode == "streamed" {
            // Overlap: each step against max(read time, compute time); compute is the resident
            // run's step time when there is one, else the step's time minus its stall.
            let reads = col(steps, "read_ms");
            let stalls = col(steps, "stall_ms");
            let ratios: Vec<f64> = (1..wall.len())
                .map(|i| {
                    let compute = resident_ms.unwrap_or(wall[i] - stalls[i]);
                    wall[i] / reads[i].max(compute).max(1e-9)
                })
                .collect();
            let ratio = median(ratios);
            let read = median(reads.into_iter().skip(1).collect());
            entry["overlap_ratio"] = json!(ratio);
            entry["read_ms"] = json!(read);
            entry["compute_ms"] = json!(resident_ms);
            notes.push_str(&format!(
                "streamed: step {med:.1} ms vs max(read {read:.1} ms, compute {:.1} ms): {ratio:.2}x (target <= 1.15x)\n",
                resident_ms.unwrap_or(med - median(stalls.into_iter().skip(1).collect()))
            ));
        }
        summary.push(entry);
        series.push(crate::output::chart::Series {
            name: mode.to_string(),
            rss_mib: rss
                .iter()
                .enumerate()
                .map(|(i, v)| ((i + 1) as f64, v / (1 << 20) as f64))
                .collect(),
            step_ms: wall
                .iter()
                .enumerate()
                .map(|(i, v)| ((i + 1) as f64, *v))
                .collect(),
        });
    }
    let (svg, png) = crate::output::chart::write(
        &stem,
        &format!(
            "bench offload: {} ({}), {}",
            b.model
                .trim_end_matches('/')
                .rsplit('/')
                .next()
                .unwrap_or(&b.model),
            fmt_bytes(model.file_bytes()),
            results
                .first()
                .and_then(|r| r["backend"].as_str())
                .and_then(|l| l.split(' ').next())
                .unwrap_or("")
        ),
        &series,
        None,
    )?;
    if b.json {
        crate::output::write_stdout(&format!(
            "{}\n",
            json!({"modes": results, "summary": summary, "chart_svg": svg, "chart_png": png})
        ))?;
    } else {
        println!("{table}\n{notes}");
        println!("chart: {} and {}", svg.display(), png.display());
    }
    Ok(())
}
