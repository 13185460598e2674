//! `nibble run` on a diffusers `WanPipeline` folder: the prompt (and negative prompt) to video
//! frames through core's [`WanPipeline`], each phase's plan printed before any weight byte is
//! read, progress per step with RSS; the frames as PNGs (`--frames-dir`), the intermediate
//! tensors under diffusers' names (`--intermediates`), one JSON object (`--json`).

use anyhow::{bail, Context, Result};
use nibble_core::backend::Backend;
use nibble_core::models::pipeline::Pipeline;
use nibble_core::models::wan::pipeline::{WanPipeline, WanRequest};
use serde_json::json;

use super::options::RunArgs;

/// Wan 2.1's frame rate (its `sample_fps`; diffusers' examples write `export_to_video(output,
/// fps=16)`).
const WAN_FPS: f64 = 16.0;

/// Opens the folder and runs it on the chosen backend.
pub fn run(o: &RunArgs) -> Result<()> {
    let pipe = WanPipeline::open(&o.model, o.file_mode.into())
        .with_context(|| format!("opening the Wan pipeline {}", o.model))?;
    if !o.text.prompt_ids.is_empty() || o.text.chat {
        bail!("a Wan folder takes --prompt TEXT (tokenized by its umT5 tokenizer)");
    }
    let Some(prompt) = o.text.prompt.clone() else {
        bail!("a Wan folder needs --prompt TEXT");
    };
    let d = &o.dit;
    if d.inputs.is_some()
        || d.checkpoint.is_some()
        || d.resume.is_some()
        || d.preview.is_some()
        || d.dynamic_shift
        || d.latents.is_some()
        || d.embed_cache.is_some()
        || d.vae_tile_size.is_some()
    {
        bail!(
            "--inputs, --checkpoint, --resume, --preview, --dynamic-shift, --latents, \
             --embed-cache and --vae-tile-size are not taken by a Wan folder"
        );
    }
    if d.out.is_none() && d.frames_dir.is_none() && d.intermediates.is_none() && !o.plan_only {
        bail!(
            "a Wan run needs somewhere to put the video: --out video.mp4 and/or --frames-dir DIR \
             (or --intermediates FILE)"
        );
    }
    if let Some(fps) = d.fps {
        crate::output::mp4::check_fps(fps)?;
    }
    let req = WanRequest {
        prompt,
        negative_prompt: d.negative_prompt.clone(),
        height: d.height.unwrap_or(480),
        width: d.width.unwrap_or(832),
        frames: d.frames.unwrap_or(81),
        steps: d.steps.unwrap_or(50),
        guidance: d.guidance.unwrap_or(5.0),
        seed: o.seed,
        max_sequence_length: d.max_sequence_length,
    };
    crate::backends::select(o.backend)?.run(Run { o, pipe, req })
}

struct Run<'a> {
    o: &'a RunArgs,
    pipe: WanPipeline,
    req: WanRequest,
}

impl crate::backends::WithBackend for Run<'_> {
    type Output = ();
    fn call<B: Backend + 'static>(self, mut backend: B, label: &str) -> Result<()> {
        let Run { o, pipe, req } = self;
        let quiet = o.json;
        let mut prepared = pipe.prepare(&req)?;
        if o.plan_only {
            let phases = pipe.budget_graphs(&prepared)?;
            let graphs: Vec<_> = phases.iter().map(|(_, g, m)| (g, *m)).collect();
            let d = super::options::decide(&o.memory, &mut backend, &graphs)?;
            let named: Vec<_> = phases.iter().map(|(n, ..)| *n).zip(d.phases).collect();
            return super::plan::print(o, label, &d.note, &named);
        }
        let opts = super::flux::pipeline_options(&o.memory, &pipe, &prepared, &mut backend, quiet)?;
        let plans = pipe.plans(&mut prepared, &mut backend, opts)?;
        let (f, h, w) = prepared.dims;
        if !quiet {
            eprintln!("backend {label}");
            eprintln!(
                "{} x {} x {} frames, {} steps, guidance {}, latent {f} x {h} x {w}, {} tokens",
                req.width,
                req.height,
                req.frames,
                req.steps,
                req.guidance,
                prepared.ids.0.len()
            );
            for (i, (phase, plan)) in plans.iter().enumerate() {
                eprintln!("phase {} of {}, {phase}:", i + 1, plans.len());
                eprint!("{}", plan.explain());
            }
        }
        let mut progress = super::progress::Progress::start(quiet);
        let out = pipe.run(&prepared, backend, opts, |e| progress.on(e))?;
        let mut written = Vec::new();
        let mut written_video = None;
        if let Some(dir) = &o.dit.frames_dir {
            std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
            let per = out.height * out.width * 3;
            for (k, rgb) in out.rgb.chunks_exact(per).enumerate() {
                let path = dir.join(format!("frame_{k:04}.png"));
                super::flux::write_png(&path, rgb, out.width, out.height)?;
                written.push(path.display().to_string());
            }
            if !quiet {
                eprintln!(
                    "wrote {} frames ({} x {}) into {}",
                    out.frames,
                    out.width,
                    out.height,
                    dir.display()
                );
            }
        }
        if let Some(path) = &o.dit.out {
            let fps = o.dit.fps.unwrap_or(WAN_FPS);
            let mp4 = crate::output::mp4::write_mp4(
                path,
                &out.rgb,
                out.frames,
                (out.height, out.width),
                fps,
            )
            .with_context(|| format!("writing the video {}", path.display()))?;
            if !quiet {
                eprintln!(
                    "wrote {} ({} frames at {fps} fps, H.264, {:.1} KiB)",
                    path.display(),
                    mp4.frames,
                    mp4.bytes as f64 / 1024.0
                );
            }
            written_video = Some(path.display().to_string());
        }
        if let Some(path) = &o.dit.intermediates {
            crate::output::write_f32_tensors(path, &out.tensors)?;
        }
        if quiet {
            crate::output::write_stdout(
                &(json!({
                    "backend": label,
                    "frames": out.frames, "width": out.width, "height": out.height,
                    "plans": super::flux::plans_json(&plans),
                    "phases": progress.phases, "steps": progress.steps,
                    "baseline_rss_bytes": progress.baseline, "peak_rss_bytes": progress.peak,
                    "frame_files": written,
                    "video": written_video,
                    "intermediates": o.dit.intermediates.as_ref().map(|p| p.display().to_string()),
                })
                .to_string()
                    + "\n"),
            )?;
        }
        Ok(())
    }
}
