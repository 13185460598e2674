//! A diffusers `WanPipeline` folder (Wan 2.1 text to video) run as `WanPipeline.__call__` runs
//! it (diffusers 0.42): the prompt (and the negative prompt, `""` when none is given) cleaned,
//! tokenized and encoded by umT5, the embeddings cut to each prompt's tokens and zero-filled;
//! torch-compatible initial noise `[z, F', H/8, W/8]`; the guided UniPC denoise loop of the
//! transformer (both sequences through one pass over the weights); the latents de-normalized
//! and decoded by the causal VAE latent frame by latent frame, clamped. Three phases, each
//! planned before any weight byte is read, each releasing its device memory before the next.

use std::collections::BTreeMap;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::exec::ExecOptions;
use crate::io::folder::ModelFolder;
use crate::io::model::ModelIndex;
use crate::models::component::open_executor;
use crate::models::denoise::DenoiseLoop;
use crate::models::flux::noise::{torch_randn, NoiseMath};
use crate::models::flux::tokens::T5Tokenizer;
use crate::models::pipeline::{
    check_components, open_component, read_json, Event, PhaseGraph, Pipeline, VaeTiling, SMALL,
};
use crate::models::scheduler::{Euler, FlowSampler, SchedulerConfig, UniPc, UniPcConfig};
use crate::models::t5::{self, UmT5Encoder};
use crate::models::Drive;

use super::checkpoint::WanCheckpoint;
use super::text::prompt_ids;
use super::tiling::{tiled_decode, WanTiling};
use super::vae::{self, WanVaeConfig, WanVaeDecoder};
use super::{patch_grid, WanConfig, WanTransformer};

/// The components a Wan 2.1 folder lists in `model_index.json`, with the classes nibble
/// computes.
const COMPONENTS: [(&str, &[&str]); 5] = [
    (
        "scheduler",
        &["UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler"],
    ),
    ("text_encoder", &["UMT5EncoderModel"]),
    ("tokenizer", &["T5TokenizerFast", "T5Tokenizer"]),
    ("transformer", &["WanTransformer3DModel"]),
    ("vae", &["AutoencoderKLWan"]),
];

/// The sampler a Wan folder's `scheduler/scheduler_config.json` names.
#[derive(Debug, Clone)]
pub enum WanScheduler {
    /// `UniPCMultistepScheduler` (the Wan 2.1 repos' own).
    UniPc(UniPcConfig),
    /// `FlowMatchEulerDiscreteScheduler`, over the sigmas of its own `set_timesteps(steps)`
    /// (WanPipeline passes no `mu`, so a config that shifts dynamically is refused, as
    /// diffusers raises for it).
    Euler(SchedulerConfig),
}

impl WanScheduler {
    /// Reads the config (`file` names it in errors) by its `_class_name`.
    pub fn from_json(file: &str, json: &serde_json::Value) -> Result<Self> {
        match json.get("_class_name").and_then(|v| v.as_str()) {
            Some("FlowMatchEulerDiscreteScheduler") => {
                let c = SchedulerConfig::from_json(file, json)?;
                if c.use_dynamic_shifting {
                    return Err(Error::Model {
                        file: file.to_string(),
                        msg: "use_dynamic_shifting: WanPipeline passes no mu to set_timesteps \
                              (diffusers refuses this config too)"
                            .into(),
                    });
                }
                Ok(WanScheduler::Euler(c))
            }
            _ => Ok(WanScheduler::UniPc(UniPcConfig::from_json(file, json)?)),
        }
    }

    /// The sampler for `steps` steps.
    pub fn sampler(&self, steps: usize) -> Result<Box<dyn FlowSampler>> {
        Ok(match self {
            WanScheduler::UniPc(c) => Box::new(UniPc::new(c.clone(), steps)?),
            WanScheduler::Euler(c) => Box::new(Euler::new(
                c.default_sigmas(steps, 0.0),
                c.num_train_timesteps,
            )?),
        })
    }
}

/// An opened Wan folder: configs, the tokenizer, the three models' indexes (headers only).
pub struct WanPipeline {
    /// The folder as given.
    pub root: String,
    /// The scheduler's settings.
    pub scheduler: WanScheduler,
    /// The umT5 tokenizer.
    pub tokenizer: T5Tokenizer,
    /// `text_encoder/`.
    pub text_encoder: ModelIndex,
    /// `transformer/`.
    pub transformer: ModelIndex,
    /// `vae/`.
    pub vae: ModelIndex,
    /// The transformer's config.
    pub config: WanConfig,
    /// The VAE's config.
    pub vae_config: WanVaeConfig,
}

impl std::fmt::Debug for WanPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WanPipeline")
            .field("root", &self.root)
            .finish()
    }
}

/// What a run asks for; the defaults are `WanPipeline.__call__`'s (diffusers 0.42).
#[derive(Debug, Clone, PartialEq)]
pub struct WanRequest {
    /// The prompt.
    pub prompt: String,
    /// The negative prompt (`None`: `""`).
    pub negative_prompt: Option<String>,
    /// Pixels high (divisible by 16).
    pub height: usize,
    /// Pixels wide (divisible by 16).
    pub width: usize,
    /// Frames (4k + 1).
    pub frames: usize,
    /// Denoising steps.
    pub steps: usize,
    /// Guidance scale (above 1: guided).
    pub guidance: f32,
    /// Seed of the initial noise (`torch.Generator("cpu").manual_seed`).
    pub seed: u64,
    /// Tokens of each prompt.
    pub max_sequence_length: usize,
    /// Whether the VAE decodes in spatial tiles.
    pub vae_tiling: VaeTiling,
    /// The tiles (diffusers' defaults if none).
    pub vae_tile: Option<WanTiling>,
    /// Keep the whole decoded video in the output (`rgb`, `video_f32`); without it the frames
    /// reach the caller only as [`Event::Frames`] while they are decoded, and memory does not
    /// grow with the video's length.
    pub keep_video: bool,
    /// Write a checkpoint into this folder after every denoising step (native only).
    pub checkpoint: Option<std::path::PathBuf>,
    /// Continue from this checkpoint (made by the same request).
    pub resume: Option<WanCheckpoint>,
}

impl Default for WanRequest {
    fn default() -> Self {
        WanRequest {
            prompt: String::new(),
            negative_prompt: None,
            height: 480,
            width: 832,
            frames: 81,
            steps: 50,
            guidance: 5.0,
            seed: 0,
            max_sequence_length: 512,
            vae_tiling: VaeTiling::Auto,
            vae_tile: None,
            keep_video: true,
            checkpoint: None,
            resume: None,
        }
    }
}

/// A request made concrete: ids, the latent's size, the initial noise.
#[derive(Debug, Clone)]
pub struct WanPrepared {
    /// The prompt's ids and how many are the prompt's.
    pub ids: (Vec<u32>, usize),
    /// The negative prompt's, where guided.
    pub negative: Option<(Vec<u32>, usize)>,
    /// The latent's (frames, height, width).
    pub dims: (usize, usize, usize),
    /// The initial latents `[z, F', H', W']`.
    pub latents: Vec<f32>,
    /// Steps.
    pub steps: usize,
    /// Guidance scale.
    pub guidance: f32,
    /// The tiling asked for.
    pub tiling_choice: VaeTiling,
    /// The tiles asked for (or diffusers' defaults).
    pub tile: WanTiling,
    /// The VAE's tiling, once [`Pipeline::plans`] has settled it.
    pub tiling: Option<WanTiling>,
    /// Whether the output keeps the whole video.
    pub keep_video: bool,
    /// Where checkpoints go.
    pub checkpoint: Option<std::path::PathBuf>,
    /// The checkpoint to continue from.
    pub resume: Option<WanCheckpoint>,
}

/// The video and the tensors diffusers names along the way.
#[derive(Debug, Clone)]
pub struct WanOutput {
    /// Frames.
    pub frames: usize,
    /// Pixels high.
    pub height: usize,
    /// Pixels wide.
    pub width: usize,
    /// 8-bit RGB frames `[frames, height, width, 3]` (empty unless the request kept the video:
    /// then they came as [`Event::Frames`]).
    pub rgb: Vec<u8>,
    /// `input_ids`, `prompt_embeds`, `negative_prompt_embeds`, `initial_latents`, `sigmas`,
    /// `latents_step{k}`, `final_latents`, `vae_input`, `video_f32`: shape and float32 values.
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

impl WanPipeline {
    /// Opens a folder, locally or by URL: configs and the tokenizer read and checked, the
    /// models' headers indexed; what nibble does not compute is refused before a weight byte
    /// is read.
    #[cfg(feature = "native")]
    pub fn open(root: &str, mode: crate::io::file::FileReadMode) -> Result<Self> {
        let (root, folder) = crate::models::pipeline::folders(root, mode);
        crate::io::folder::block_on(Self::open_in(&root, &folder))
    }

    /// [`WanPipeline::open`] over the folders `folder` gives for the root and each component.
    pub async fn open_in(
        root: &str,
        folder: &dyn Fn(&str) -> Result<std::sync::Arc<dyn ModelFolder>>,
    ) -> Result<Self> {
        let top = folder("")?;
        let top = top.as_ref();
        let index = read_json(top, "model_index.json").await?;
        let file = top.locate("model_index.json");
        check_components(&file, &index, "WanPipeline", &COMPONENTS)?;
        let bad = |msg: &str| Error::Model {
            file: file.clone(),
            msg: msg.into(),
        };
        if index.get("expand_timesteps").and_then(|v| v.as_bool()) == Some(true) {
            return Err(bad(
                "expand_timesteps: Wan 2.2's per-token timesteps are not supported",
            ));
        }
        if index.get("boundary_ratio").is_some_and(|v| !v.is_null()) {
            return Err(bad(
                "boundary_ratio: Wan 2.2's two transformers are not supported",
            ));
        }
        let sched = "scheduler/scheduler_config.json";
        let scheduler = WanScheduler::from_json(&top.locate(sched), &read_json(top, sched).await?)?;
        let tokenizer = match top.read_small("tokenizer/tokenizer.json", SMALL).await? {
            Some(b) => T5Tokenizer::from_json(&b, &top.locate("tokenizer/tokenizer.json"))?,
            None => {
                return Err(Error::Model {
                    file: top.locate("tokenizer/tokenizer.json"),
                    msg: "missing: umT5's tokenizer is read from tokenizer.json".into(),
                })
            }
        };
        let open = |c: &'static str| open_component(folder, root, c);
        let transformer = open("transformer").await?;
        let vae = open("vae").await?;
        Ok(WanPipeline {
            scheduler,
            tokenizer,
            text_encoder: open("text_encoder").await?,
            config: WanConfig::of(&transformer)?,
            vae_config: WanVaeConfig::of(&vae)?,
            transformer,
            vae,
            root: root.trim_end_matches('/').to_string(),
        })
    }

    /// The latent's (frames, height, width) for a request's size: the errors say what works.
    pub fn latent_dims(&self, req: &WanRequest) -> Result<(usize, usize, usize)> {
        let s = self.vae_config.spatial_scale();
        let (pt, ph, pw) = self.config.patch;
        let (sh, sw) = (s * ph, s * pw);
        if req.height == 0
            || req.width == 0
            || !req.height.is_multiple_of(sh)
            || !req.width.is_multiple_of(sw)
        {
            return Err(Error::Invalid(format!(
                "{} x {} pixels: height must be a multiple of {sh} and width of {sw} (the VAE's \
                 {s} times the patch); for example {} x {}",
                req.height,
                req.width,
                (req.height / sh).max(1) * sh,
                (req.width / sw).max(1) * sw
            )));
        }
        let per = self.vae_config.frames(2) - 1;
        if req.frames == 0 || !(req.frames - 1).is_multiple_of(per) {
            let k = req.frames.saturating_sub(1) / per;
            return Err(Error::Invalid(format!(
                "{} frames: a Wan video has {per}k + 1 frames (for example {} or {})",
                req.frames,
                per * k + 1,
                per * (k + 1) + 1
            )));
        }
        let f = (req.frames - 1) / per + 1;
        if !f.is_multiple_of(pt) {
            return Err(Error::Invalid(format!(
                "{} latent frames are not a whole number of {pt}-frame patches",
                f
            )));
        }
        Ok((f, req.height / s, req.width / s))
    }
}

impl WanPrepared {
    /// The request's fingerprint a checkpoint must match: the prompts' ids and lengths, the
    /// latent's size and the guidance.
    pub fn key(&self) -> Vec<f32> {
        let mut k: Vec<f32> = self.ids.0.iter().map(|&i| i as f32).collect();
        k.push(self.ids.1 as f32);
        if let Some((ids, len)) = &self.negative {
            k.push(-1.0);
            k.extend(ids.iter().map(|&i| i as f32));
            k.push(*len as f32);
        }
        k.extend([
            self.dims.0 as f32,
            self.dims.1 as f32,
            self.dims.2 as f32,
            self.guidance,
        ]);
        k
    }
}

impl WanPipeline {
    /// The VAE decoder's graph for `h x w` latent frames: the largest tile's when tiled.
    pub fn vae_graph(
        &self,
        (h, w): (usize, usize),
        tiling: Option<WanTiling>,
    ) -> Result<crate::graph::Graph> {
        let (h, w) = match tiling {
            Some(t) => {
                let (th, tw) = t.latent_tile(self.vae_config.spatial_scale());
                (th.min(h), tw.min(w))
            }
            None => (h, w),
        };
        Ok(vae::build(&self.vae, h, w)?.0)
    }

    /// The VAE's tiling for `h x w` latent frames: `Off` none, `On` the tiles when the latent is
    /// larger than one, `Auto` the tiles when it is larger and the whole frame's decoder cannot
    /// be planned within the device budget (or the backend's limit for one operand).
    pub fn vae_tiling<B: Backend>(
        &self,
        dims: (usize, usize),
        choice: VaeTiling,
        tile: WanTiling,
        backend: &mut B,
        opts: ExecOptions,
    ) -> Result<Option<WanTiling>> {
        let s = self.vae_config.spatial_scale();
        tile.check(s)?;
        let larger = tile.tiles(dims, s);
        Ok(match choice {
            VaeTiling::Off => None,
            VaeTiling::On => larger.then_some(tile),
            VaeTiling::Auto => {
                let g = self.vae_graph(dims, None)?;
                let fits = crate::models::pipeline::fits_device(&g, &self.vae, backend, opts);
                (larger && !fits).then_some(tile)
            }
        })
    }

    /// Decodes the latent video `z` (`[z_dim, f, h, w]`, de-normalized: the VAE's own input)
    /// latent frame by latent frame, whole or in `tiling`'s tiles: the video
    /// `[out_channels, frames, 8h, 8w]` clamped to [-1, 1] (with `keep`; a tiled decode always
    /// holds it), the backend (its device memory released) and the weight bytes streamed. `on`
    /// gets the 8-bit frames as they are decoded ([`Event::Frames`]): each latent frame's, or,
    /// tiled, the whole video's at the end.
    #[allow(clippy::too_many_arguments)]
    pub async fn decode_latents<B: Backend>(
        &self,
        z: &[f32],
        (f, h, w): (usize, usize, usize),
        tiling: Option<WanTiling>,
        backend: B,
        opts: ExecOptions,
        drive: &Drive<'_>,
        keep: bool,
        on: &mut dyn FnMut(Event<'_>),
    ) -> Result<(Option<Vec<f32>>, B, u64)> {
        let s = self.vae_config.spatial_scale();
        let (oc, total, oh, ow) = (
            self.vae_config.out_channels,
            self.vae_config.frames(f),
            h * s,
            w * s,
        );
        // `chunk`: [t, oc, oh, ow] as decoded, or the clamped video [oc, t, oh, ow] (`whole`).
        let mut emit = |first: usize, chunk: &[f32], whole: bool| -> Result<()> {
            let t = chunk.len() / (oc * oh * ow);
            let rgb = if whole {
                vae::frames_u8(chunk, (oc, t, oh, ow))?
            } else {
                vae::chunk_u8(chunk, (t, oc, oh, ow))?
            };
            on(Event::Frames {
                first,
                total,
                width: ow,
                height: oh,
                rgb: &rgb,
            });
            Ok(())
        };
        if let Some(t) = tiling {
            let (video, backend, bytes) =
                tiled_decode(&self.vae, backend, z, (f, h, w), t, opts, drive).await?;
            emit(0, &video, true)?;
            return Ok((keep.then_some(video), backend, bytes));
        }
        let mut dec = WanVaeDecoder::open(&self.vae, backend, (h, w), opts, drive).await?;
        let mut failed = None;
        let mut video = dec
            .decode_each(z, keep, &mut |first, chunk| {
                if failed.is_none() {
                    failed = emit(first, chunk, false).err();
                }
            })
            .await?;
        if let Some(e) = failed {
            return Err(e);
        }
        for v in video.iter_mut().flatten() {
            *v = v.clamp(-1.0, 1.0);
        }
        let bytes = dec.bytes_streamed();
        Ok((video, dec.into_backend(), bytes))
    }
}

impl Pipeline for WanPipeline {
    type Request = WanRequest;
    type Prepared = WanPrepared;
    type Output = WanOutput;

    fn prepare(&self, req: &WanRequest) -> Result<WanPrepared> {
        let dims = self.latent_dims(req)?;
        let tile = req.vae_tile.unwrap_or_default();
        tile.check(self.vae_config.spatial_scale())?;
        if req.steps == 0 || req.steps > crate::models::scheduler::MAX_STEPS {
            return Err(Error::Invalid(format!(
                "{} denoising steps: between 1 and {}",
                req.steps,
                crate::models::scheduler::MAX_STEPS
            )));
        }
        if !req.guidance.is_finite() {
            return Err(Error::Invalid(format!(
                "guidance {} is not finite",
                req.guidance
            )));
        }
        let msl = req.max_sequence_length;
        if msl == 0 || msl > 1 << 16 {
            return Err(Error::Invalid(format!(
                "max_sequence_length {msl}: between 1 and 65536"
            )));
        }
        let ids = prompt_ids(&self.tokenizer, &req.prompt, msl)?;
        let negative = (req.guidance > 1.0)
            .then(|| {
                prompt_ids(
                    &self.tokenizer,
                    req.negative_prompt.as_deref().unwrap_or(""),
                    msl,
                )
            })
            .transpose()?;
        let n = self.config.in_channels * dims.0 * dims.1 * dims.2;
        crate::io::machine::check_alloc(n as u64 * 4, "the initial latents")?;
        Ok(WanPrepared {
            ids,
            negative,
            dims,
            latents: torch_randn(n, req.seed, NoiseMath::AvxMathfun),
            steps: req.steps,
            guidance: req.guidance,
            tiling_choice: req.vae_tiling,
            tile,
            tiling: None,
            keep_video: req.keep_video,
            checkpoint: req.checkpoint.clone(),
            resume: req.resume.clone(),
        })
    }

    fn graphs(&self, p: &WanPrepared) -> Result<Vec<PhaseGraph<'_>>> {
        let (gf, gh, gw) = patch_grid(&self.config, p.dims)?;
        let b = if p.negative.is_some() { 2 } else { 1 };
        Ok(vec![
            (
                "text encoder",
                t5::build_with(&self.text_encoder, p.ids.0.len(), true)?.0,
                &self.text_encoder,
            ),
            (
                "transformer",
                super::build(&self.transformer, gf * gh * gw, p.ids.0.len(), b)?.graph,
                &self.transformer,
            ),
            (
                "VAE",
                self.vae_graph((p.dims.1, p.dims.2), p.tiling)?,
                &self.vae,
            ),
        ])
    }

    /// The phases' graphs to size budgets from before the VAE's tiling is settled: the VAE at
    /// its tile size wherever tiling may be chosen, so that a whole-frame decoder that tiling
    /// would avoid does not set the budget.
    fn budget_graphs(&self, p: &WanPrepared) -> Result<Vec<PhaseGraph<'_>>> {
        let s = self.vae_config.spatial_scale();
        if p.tiling.is_none()
            && p.tiling_choice != VaeTiling::Off
            && p.tile.tiles((p.dims.1, p.dims.2), s)
        {
            let mut q = p.clone();
            q.tiling = Some(p.tile);
            return self.graphs(&q);
        }
        self.graphs(p)
    }

    /// Settles the VAE's tiling ([`WanPipeline::vae_tiling`]).
    fn settle<B: Backend>(
        &self,
        p: &mut WanPrepared,
        backend: &mut B,
        opts: ExecOptions,
    ) -> Result<()> {
        p.tiling = self.vae_tiling((p.dims.1, p.dims.2), p.tiling_choice, p.tile, backend, opts)?;
        Ok(())
    }

    async fn run_with<B: Backend, F: FnMut(Event<'_>)>(
        &self,
        p: &WanPrepared,
        backend: B,
        opts: ExecOptions,
        drive: &Drive<'_>,
        mut on: F,
    ) -> Result<(WanOutput, B)> {
        let mut tensors = BTreeMap::new();
        let t = p.ids.0.len();
        let ids_f32 = |v: &[u32]| v.iter().map(|&i| i as f32).collect::<Vec<_>>();
        tensors.insert("input_ids".into(), (vec![1, t], ids_f32(&p.ids.0)));
        let done = |on: &mut F, phase: &'static str, t0: web_time::Instant, bytes: u64| {
            on(Event::PhaseDone {
                phase,
                ms: t0.elapsed().as_secs_f64() * 1e3,
                bytes_streamed: bytes,
            })
        };

        on(Event::PhaseStart {
            phase: "text encoder",
        });
        let t0 = web_time::Instant::now();
        let mut enc = UmT5Encoder::open(&self.text_encoder, backend, t, opts, drive).await?;
        let sides = 1 + usize::from(p.negative.is_some());
        enc.limit_passes(sides as u64);
        let d = enc.config().d_model;
        let (states, st) = enc.forward_async(&p.ids.0, p.ids.1).await?;
        let mut bytes = st.stream.bytes;
        let mut text = t5::prompt_embeds(states, p.ids.1, d);
        tensors.insert("prompt_embeds".into(), (vec![1, t, d], text.clone()));
        if let Some((ids, len)) = &p.negative {
            tensors.insert("neg_input_ids".into(), (vec![1, t], ids_f32(ids)));
            let (states, st) = enc.forward_async(ids, *len).await?;
            bytes += st.stream.bytes;
            let neg = t5::prompt_embeds(states, *len, d);
            tensors.insert(
                "negative_prompt_embeds".into(),
                (vec![1, t, d], neg.clone()),
            );
            text.extend(neg);
        }
        let backend = enc.into_backend();
        done(&mut on, "text encoder", t0, bytes);

        on(Event::PhaseStart {
            phase: "transformer",
        });
        let t0 = web_time::Instant::now();
        let (f, h, w) = p.dims;
        let zc = self.config.in_channels;
        tensors.insert(
            "initial_latents".into(),
            (vec![1, zc, f, h, w], p.latents.clone()),
        );
        let (gf, gh, gw) = patch_grid(&self.config, p.dims)?;
        let wg = super::build(&self.transformer, gf * gh * gw, t, sides)?;
        let mut ex = open_executor(wg.graph, &self.transformer, backend, opts, drive).await?;
        let resumed = p.resume.as_ref().map_or(0, |c| c.done);
        ex.limit_stream_passes(p.steps.saturating_sub(resumed) as u64);
        let guidance = p.negative.as_ref().map(|_| p.guidance);
        let model = WanTransformer::new(ex, wg.config, p.dims, text, guidance)?;
        let sampler = self.scheduler.sampler(p.steps)?;
        tensors.insert(
            "sigmas".into(),
            (
                vec![p.steps + 1],
                crate::models::scheduler::FlowSampler::sigmas(&sampler).to_vec(),
            ),
        );
        let mut run = DenoiseLoop::new(model, sampler, p.latents.clone());
        let key = p.key();
        if let Some(c) = &p.resume {
            c.check(run.sampler().sigmas(), &p.latents, &key)?;
            run.resume(c.done, c.latent.clone(), &c.sampler)?;
        }
        let mut streamed = 0;
        loop {
            let s = match drive {
                Drive::Blocking => run.step()?,
                Drive::EventLoop(_) => run.step_async().await?,
            };
            let Some(s) = s else { break };
            streamed += s.stats.stream.bytes;
            if let Some(dir) = &p.checkpoint {
                let c = WanCheckpoint {
                    done: run.done(),
                    latent: run.latent().to_vec(),
                    sampler: run.sampler().state(),
                    sigmas: run.sampler().sigmas().to_vec(),
                    x0: p.latents.clone(),
                    key: key.clone(),
                };
                #[cfg(feature = "native")]
                c.save(dir)?;
                #[cfg(not(feature = "native"))]
                return Err(Error::Invalid(format!(
                    "checkpoints are written natively only ({}, {} steps done)",
                    dir.display(),
                    c.done
                )));
            }
            tensors.insert(
                format!("latents_step{}", s.step - 1),
                (vec![1, zc, f, h, w], run.latent().to_vec()),
            );
            on(Event::Step {
                step: s.step,
                steps: p.steps,
                info: &s,
            });
        }
        let (model, latents) = run.into_parts();
        let backend = crate::models::denoise::DenoiseModel::into_executor(model)
            .into_parts()
            .0;
        done(&mut on, "transformer", t0, streamed);
        tensors.insert(
            "final_latents".into(),
            (vec![1, zc, f, h, w], latents.clone()),
        );

        on(Event::PhaseStart { phase: "VAE" });
        let t0 = web_time::Instant::now();
        let z = self.vae_config.decoder_input(&latents);
        tensors.insert("vae_input".into(), (vec![1, zc, f, h, w], z.clone()));
        // A kept video's 8-bit frames are the ones handed out as they were decoded.
        let mut rgb = Vec::new();
        let (video, backend, bytes) = self
            .decode_latents(
                &z,
                p.dims,
                p.tiling,
                backend,
                opts,
                drive,
                p.keep_video,
                &mut |e| {
                    if let (true, Event::Frames { rgb: f, .. }) = (p.keep_video, &e) {
                        rgb.extend_from_slice(f);
                    }
                    on(e)
                },
            )
            .await?;
        done(&mut on, "VAE", t0, bytes);
        let s = self.vae_config.spatial_scale();
        let (frames, oh, ow) = (self.vae_config.frames(f), h * s, w * s);
        let oc = self.vae_config.out_channels;
        if let Some(video) = video {
            tensors.insert("video_f32".into(), (vec![1, oc, frames, oh, ow], video));
        }
        Ok((
            WanOutput {
                frames,
                height: oh,
                width: ow,
                rgb,
                tensors,
            },
            backend,
        ))
    }
}
