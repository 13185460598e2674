//! `nibble demo --video`: text to video on a built-in default. A synthetic diffusers Wan 2.1
//! folder (real file formats and configs, random weights: the 1.3B transformer's shape in NF4,
//! a two-layer umT5 of real width, the real video VAE; written once into the cache folder)
//! through the whole `WanPipeline`: umT5 encodes the prompt and the negative prompt, the
//! transformer denoises both sequences in one pass over its weights per step (streamed through
//! the ring where the device budget is below its size), the causal VAE decodes latent frame by
//! latent frame. The same code as `nibble run --model WAN_FOLDER` ([`crate::cmd::run::wan`]);
//! at the end a summary, the MP4, the frames and the chart of RSS and step time.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use nibble_core::backend::Backend;
use nibble_core::models::pipeline::VaeTiling;
use nibble_core::models::wan::pipeline::{WanPipeline, WanRequest};
use nibble_core::plan::fmt_bytes;
use nibble_core::tooling::synth_wan::{write_pipeline, WanSynthShape};
use serde_json::json;

use super::{cache_root, ensure_folder, write_report, DemoArgs, StepFigures};
use crate::cmd::run::flux::plans_json;
use crate::cmd::run::wan::generate;
use crate::output::frames::FrameSink;

/// Runs the video demo: the synthetic folder in `root`, then the pipeline.
pub fn run(o: &DemoArgs, root: &Path) -> Result<()> {
    debug_assert_eq!(cache_root(o), root);
    let shape = WanSynthShape {
        text_layers: o.t5_layers.max(1),
        ..match o.dit_size {
            Some(bytes) => WanSynthShape::scaled(bytes),
            None => WanSynthShape {
                text_vocab: None,
                ..WanSynthShape::real_1_3b()
            },
        }
    };
    let dir = root.join(format!(
        "wan-d{}x{}-t5x{}-seed{}-v1",
        shape.dim, shape.layers, shape.text_layers, o.seed
    ));
    ensure_folder(&dir, "Wan 2.1 folder", o.json, |d, p| {
        write_pipeline(d, shape, o.seed, p)
    })?;
    let pipe = WanPipeline::open(&dir.to_string_lossy(), Default::default())
        .with_context(|| format!("opening the demo folder {}", dir.display()))?;
    let req = WanRequest {
        prompt: o.prompt.clone(),
        negative_prompt: None,
        height: o.height,
        width: o.width,
        frames: o.frames,
        steps: o.steps.unwrap_or(8),
        guidance: o.guidance.unwrap_or(5.0),
        seed: o.seed,
        max_sequence_length: o.max_sequence_length,
        vae_tiling: VaeTiling::Auto,
        vae_tile: None,
        // Frames go to the MP4 and the PNGs as they are decoded.
        keep_video: false,
        checkpoint: None,
        resume: None,
    };
    crate::backends::select(o.backend)?.run(Demo { o, pipe, req })
}

struct Demo<'a> {
    o: &'a DemoArgs,
    pipe: WanPipeline,
    req: WanRequest,
}

impl crate::backends::WithBackend for Demo<'_> {
    type Output = ();
    fn call<B: Backend + 'static>(self, backend: B, label: &str) -> Result<()> {
        let Demo { o, pipe, req } = self;
        std::fs::create_dir_all(&o.out_dir)
            .with_context(|| format!("creating {}", o.out_dir.display()))?;
        let video = o.out_dir.join("video.mp4");
        let frames_dir = o.out_dir.join("frames");
        let mut sink = FrameSink::new(Some(&video), 16.0, Some(&frames_dir));
        let t0 = Instant::now();
        let g = generate(&pipe, &req, backend, label, o.json, &o.memory(), &mut sink)?;
        let written = sink.finish()?;
        let total_secs = t0.elapsed().as_secs_f64();
        let (out, p) = (&g.out, &g.progress);
        let mp4 = written
            .mp4
            .map(|(_, m)| m)
            .context("the demo wrote its MP4")?;
        let (_, plan) = g
            .plans
            .iter()
            .find(|(n, _)| *n == "transformer")
            .context("the pipeline has a transformer phase")?;
        let f = StepFigures::chart(
            &p.steps,
            &o.out_dir,
            &format!(
                "nibble demo --video: {} NF4 Wan transformer, device budget {}, ring {} x {}",
                fmt_bytes(pipe.transformer.file_bytes()),
                fmt_bytes(g.opts.budgets.device_bytes),
                g.opts.budgets.ring_slots,
                fmt_bytes(g.opts.budgets.slot_bytes)
            ),
            format!("transformer ({label})"),
            p.baseline + plan.peak_host_bytes + plan.peak_device_bytes,
        )?;
        let (rss_b, growth, mean_ms, svg, png) = (&f.rss, f.growth, f.mean_ms, &f.svg, &f.png);
        let bytes: Vec<u64> = p
            .steps
            .iter()
            .filter_map(|r| r["bytes_streamed"].as_u64())
            .collect();
        let phase = |name: &str| p.phases.iter().find(|x| x["phase"] == name);
        let largest_plan = g
            .plans
            .iter()
            .map(|(_, p)| p.peak_host_bytes + p.peak_device_bytes)
            .max()
            .unwrap_or(0);
        let vae_plan = g.plans.iter().find(|(n, _)| *n == "VAE").map(|(_, p)| p);
        let summary = json!({
            "backend": label,
            "pipeline": pipe.root,
            "prompt": req.prompt,
            "frames": out.frames, "width": out.width, "height": out.height,
            "transformer_bytes_on_disk": pipe.transformer.file_bytes(),
            "text_encoder_bytes_on_disk": pipe.text_encoder.file_bytes(),
            "steps": p.steps.len(),
            "ms_per_step_after_first": mean_ms,
            "seconds_total": total_secs,
            "bytes_streamed_per_step": plan.streamed_bytes_per_step,
            "bytes_streamed_each_step": bytes,
            "rss_step2_bytes": rss_b.get(1),
            "rss_last_bytes": rss_b.last(),
            "rss_growth_from_step2_bytes": growth,
            "baseline_rss_bytes": p.baseline,
            "peak_rss_bytes": p.peak,
            "largest_phase_plan_bytes": largest_plan,
            "vae_ms": phase("VAE").and_then(|x| x["ms"].as_f64()),
            "vae_peak_rss_bytes": phase("VAE").and_then(|x| x["peak_rss_bytes"].as_u64()),
            "vae_plan_bytes": vae_plan.map(|p| p.peak_host_bytes + p.peak_device_bytes),
            "phases": p.phases,
            "plans": plans_json(&g.plans),
            "video": video, "video_bytes": mp4.bytes, "frames_dir": frames_dir,
            "chart_svg": svg, "chart_png": png,
            "note": "random weights give a noise video; a real Wan folder gives a real one",
        });
        if !write_report(o, &p.steps, &summary)? {
            eprintln!(
                "done: {} frames of {} x {} in {:.1} s; {} guided steps, {:.0} ms/step after the \
                 first, {} streamed per step (one pass for both sequences); RSS {} at step 2, {} \
                 at the end ({:+} bytes); peak RSS {} (baseline {} + largest phase plan {} = {})",
                out.frames,
                out.width,
                out.height,
                total_secs,
                p.steps.len(),
                mean_ms,
                fmt_bytes(plan.streamed_bytes_per_step),
                fmt_bytes(rss_b.get(1).copied().unwrap_or(0)),
                fmt_bytes(rss_b.last().copied().unwrap_or(0)),
                growth,
                fmt_bytes(p.peak),
                fmt_bytes(p.baseline),
                fmt_bytes(largest_plan),
                fmt_bytes(p.baseline + largest_plan)
            );
            eprintln!(
                "video: {} ({} frames at 16 fps, H.264) and its frames in {} (random weights: \
                 noise; `nibble run --model WAN_FOLDER --prompt ... --out video.mp4` on a real \
                 Wan folder gives a real video)",
                video.display(),
                out.frames,
                frames_dir.display()
            );
            eprintln!("chart: {} and {}", svg.display(), png.display());
        }
        Ok(())
    }
}
