//! Denoising with a Flux-style DiT: its inputs, Flux's transformer as a model of the shared
//! denoise loop ([`crate::models::denoise`]) with flow-matching Euler, and checkpoints that a run
//! can resume from bit for bit. `nibble run`, `nibble demo` and the browser build on it.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::exec::{ExecOptions, Executor};
use crate::graph::HostTensor;
use crate::io::model::ModelIndex;
pub use crate::models::denoise::DenoiseStep;
use crate::models::denoise::{DenoiseLoop, DenoiseModel};
use crate::models::dit::{self, DitConfig};
use crate::models::scheduler::{Euler, FlowSampler, SchedulerConfig};

/// The conditioning and the starting latent of a denoising run.
#[derive(Debug, Clone, PartialEq)]
pub struct DitInputs {
    /// Noise latent `[n, in_channels]`.
    pub x0: Vec<f32>,
    /// Text hidden states `[t, joint_dim]`.
    pub context: Vec<f32>,
    /// Pooled text embedding `[pooled_dim]`.
    pub pooled: Vec<f32>,
    /// Guidance scale (ignored by models without a guidance embedding).
    pub guidance: f32,
    /// Image position ids `[n, 3]` = (0, row, col).
    pub img_ids: Vec<f32>,
    /// Text position ids `[t, 3]`.
    pub txt_ids: Vec<f32>,
}

/// Deterministic roughly-normal values (sum of four uniforms, mean 0, sd 1) from a seed.
pub fn gaussian_like(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            let mut acc = 0.0;
            for _ in 0..4 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                acc += (s >> 40) as f32 / (1u64 << 24) as f32;
            }
            (acc - 2.0) * 1.732
        })
        .collect()
}

impl DitInputs {
    /// Random inputs from `seed` for a `height x width` latent grid and `text_len` text tokens
    /// (each at least 1; sizes whose values would not fit in memory are refused before
    /// anything is allocated).
    pub fn random(
        cfg: &DitConfig,
        height: usize,
        width: usize,
        text_len: usize,
        guidance: f32,
        seed: u64,
    ) -> Result<Self> {
        if height == 0 || width == 0 || text_len == 0 {
            return Err(Error::Invalid(format!(
                "a latent of {height} x {width} tokens and {text_len} text tokens: each must be \
                 at least 1"
            )));
        }
        if !guidance.is_finite() {
            return Err(Error::Invalid(format!("guidance {guidance} is not finite")));
        }
        let n = height
            .checked_mul(width)
            .filter(|&n| n <= crate::graph::MAX_ELEMENTS)
            .ok_or_else(|| Error::Invalid(format!("a latent of {height} x {width} tokens")))?;
        let floats = [n * cfg.in_channels, text_len * cfg.joint_dim, n * 3]
            .iter()
            .try_fold(0u64, |a, &b| a.checked_add(b as u64))
            .and_then(|f| f.checked_mul(4));
        crate::io::machine::check_alloc(
            floats.unwrap_or(u64::MAX),
            &format!("inputs for {height} x {width} latent tokens and {text_len} text tokens"),
        )?;
        Ok(DitInputs {
            x0: gaussian_like(n * cfg.in_channels, seed),
            context: gaussian_like(text_len * cfg.joint_dim, seed + 1),
            pooled: gaussian_like(cfg.pooled_dim, seed + 2),
            guidance,
            img_ids: (0..n)
                .flat_map(|i| [0.0, (i / width) as f32, (i % width) as f32])
                .collect(),
            txt_ids: vec![0.0; text_len * 3],
        })
    }

    /// Inputs from tensors named like diffusers' pipeline arguments and the fixtures':
    /// `hidden_states`, `encoder_hidden_states`, `pooled_projections`, `guidance` (read only when
    /// the model has a guidance embedding), `img_ids`, `txt_ids`.
    pub fn from_named<E>(
        cfg: &DitConfig,
        mut get: impl FnMut(&str) -> std::result::Result<Vec<f32>, E>,
    ) -> std::result::Result<Self, E> {
        Ok(DitInputs {
            x0: get("hidden_states")?,
            context: get("encoder_hidden_states")?,
            pooled: get("pooled_projections")?,
            guidance: if cfg.guidance {
                get("guidance")?.first().copied().unwrap_or(0.0)
            } else {
                0.0
            },
            img_ids: get("img_ids")?,
            txt_ids: get("txt_ids")?,
        })
    }

    /// Image tokens.
    pub fn image_tokens(&self) -> usize {
        self.img_ids.len() / 3
    }

    /// Text tokens.
    pub fn text_tokens(&self) -> usize {
        self.txt_ids.len() / 3
    }

    /// Latent grid (height, width) from the image ids.
    pub fn grid(&self) -> (usize, usize) {
        let n = self.image_tokens();
        let h = self
            .img_ids
            .chunks(3)
            .map(|r| r[1] as usize)
            .max()
            .unwrap_or(0)
            + 1;
        (h, n / h.max(1))
    }

    /// Checks the inputs against the model's sizes.
    pub fn check(&self, cfg: &DitConfig) -> Result<()> {
        let (n, t) = (self.image_tokens(), self.text_tokens());
        if n == 0
            || !self.img_ids.len().is_multiple_of(3)
            || !self.txt_ids.len().is_multiple_of(3)
            || self.x0.len() != n * cfg.in_channels
            || self.context.len() != t * cfg.joint_dim
            || self.pooled.len() != cfg.pooled_dim
        {
            return Err(Error::Invalid(format!(
                "DiT inputs do not fit the model: {n} image tokens x {} channels, {t} text tokens x {}, pooled {}",
                cfg.in_channels, cfg.joint_dim, cfg.pooled_dim
            )));
        }
        if cfg.out_channels != cfg.in_channels {
            return Err(Error::Invalid(format!(
                "the model predicts {} values per token for a latent of {} channels (patch_size or \
                 out_channels in config.json): the Euler loop needs one velocity per latent value",
                cfg.out_channels, cfg.in_channels
            )));
        }
        Ok(())
    }
}

/// Flux's transformer as a [`DenoiseModel`]: the executor of its graph and the inputs that stay
/// the same every step (the text states, the pooled embedding, the rotary tables).
pub struct FluxTransformer<B: Backend> {
    ex: Executor<B>,
    config: DitConfig,
    guidance: f32,
    image_tokens: usize,
    fixed: Vec<HostTensor>,
    cos: HostTensor,
    sin: HostTensor,
}

impl<B: Backend> FluxTransformer<B> {
    fn over(ex: Executor<B>, cfg: DitConfig, inputs: &DitInputs) -> Result<Self> {
        let (n, t) = (inputs.image_tokens(), inputs.text_tokens());
        let ids: Vec<f32> = inputs
            .txt_ids
            .iter()
            .chain(&inputs.img_ids)
            .copied()
            .collect();
        let (cos, sin) = cfg.rope_tables(&ids, 10000.0);
        let half = cfg.head_dim / 2;
        let fixed = vec![
            HostTensor::f32(&[t, cfg.joint_dim], inputs.context.clone())?,
            HostTensor::f32(&[1, cfg.pooled_dim], inputs.pooled.clone())?,
        ];
        Ok(FluxTransformer {
            ex,
            guidance: inputs.guidance,
            image_tokens: n,
            cos: HostTensor::f32(&[t + n, half], cos)?,
            sin: HostTensor::f32(&[t + n, half], sin)?,
            config: cfg,
            fixed,
        })
    }
}

impl<B: Backend> DenoiseModel for FluxTransformer<B> {
    type Backend = B;

    fn executor(&self) -> &Executor<B> {
        &self.ex
    }

    fn executor_mut(&mut self) -> &mut Executor<B> {
        &mut self.ex
    }

    fn into_executor(self) -> Executor<B> {
        self.ex
    }

    fn step_inputs(&self, x: &[f32], timestep: f32) -> Result<Vec<HostTensor>> {
        let cfg = &self.config;
        let mut inputs = Vec::with_capacity(7);
        inputs.push(HostTensor::f32(
            &[self.image_tokens, cfg.in_channels],
            x.to_vec(),
        )?);
        inputs.extend(self.fixed.iter().cloned());
        inputs.push(HostTensor::f32(&[1], vec![timestep])?);
        if cfg.guidance {
            inputs.push(HostTensor::f32(&[1], vec![self.guidance * 1000.0])?);
        }
        inputs.push(self.cos.clone());
        inputs.push(self.sin.clone());
        Ok(inputs)
    }
}

/// A DiT denoising run bound to a backend: Flux's transformer in the shared denoise loop with
/// flow-matching Euler, and the inputs a checkpoint records.
pub struct Denoiser<B: Backend> {
    run: DenoiseLoop<FluxTransformer<B>, Euler>,
    /// The model's configuration.
    pub config: DitConfig,
    inputs: DitInputs,
}

impl<B: Backend> std::fmt::Debug for Denoiser<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Denoiser")
            .field("step", &self.run.done())
            .field("steps", &self.run.steps())
            .finish()
    }
}

pub use crate::models::scheduler::MAX_STEPS;

/// The schedule of `steps` steps (1 to [`MAX_STEPS`]): static `shift` (finite, positive), or
/// Flux's resolution-dependent one (the scheduler's own `set_timesteps`, diffusers' defaults).
pub fn schedule(steps: usize, shift: f64, dynamic: bool, image_tokens: usize) -> Result<Vec<f32>> {
    if steps == 0 || steps > MAX_STEPS {
        return Err(Error::Invalid(format!(
            "{steps} denoising steps: between 1 and {MAX_STEPS}"
        )));
    }
    if !(shift.is_finite() && shift > 0.0) {
        return Err(Error::Invalid(format!(
            "schedule shift {shift} is not a finite positive number"
        )));
    }
    let cfg = SchedulerConfig {
        shift,
        use_dynamic_shifting: dynamic,
        ..Default::default()
    };
    Ok(cfg.default_sigmas(steps, cfg.mu(image_tokens)))
}

impl<B: Backend> Denoiser<B> {
    /// Plans and allocates the run: `sigmas` has one more entry than there are steps.
    pub fn new(
        model: &ModelIndex,
        backend: B,
        inputs: DitInputs,
        sigmas: Vec<f32>,
        opts: ExecOptions,
    ) -> Result<Self> {
        Self::with_ring(model, backend, inputs, sigmas, opts, None)
    }

    /// [`Denoiser::new`] streaming through a ring handed over from an earlier phase.
    pub fn with_ring(
        model: &ModelIndex,
        backend: B,
        inputs: DitInputs,
        sigmas: Vec<f32>,
        opts: ExecOptions,
        ring: Option<crate::stream::ring::StagingRing>,
    ) -> Result<Self> {
        let cfg = Self::checked_config(model, &inputs, &sigmas)?;
        let (n, t) = (inputs.image_tokens(), inputs.text_tokens());
        let dg = dit::build(model, n, t)?;
        let ex = Executor::with_ring(dg.graph, model, backend, opts, ring)?;
        Self::over(ex, cfg, inputs, sigmas)
    }

    /// [`Denoiser::new`] for an event loop (the browser): weights come from the sources
    /// `make_source` makes, and resident groups are awaited.
    pub async fn with_source_async(
        model: &ModelIndex,
        backend: B,
        inputs: DitInputs,
        sigmas: Vec<f32>,
        opts: ExecOptions,
        make_source: &mut dyn FnMut() -> Box<dyn crate::io::source::ByteSource>,
    ) -> Result<Self> {
        let cfg = Self::checked_config(model, &inputs, &sigmas)?;
        let dg = dit::build(model, inputs.image_tokens(), inputs.text_tokens())?;
        let ex = Executor::with_source_async(dg.graph, model, backend, opts, make_source).await?;
        Self::over(ex, cfg, inputs, sigmas)
    }

    fn checked_config(model: &ModelIndex, inputs: &DitInputs, sigmas: &[f32]) -> Result<DitConfig> {
        let cfg = DitConfig::of(model)?;
        inputs.check(&cfg)?;
        if sigmas.len() < 2 {
            return Err(Error::Invalid("a schedule needs at least one step".into()));
        }
        Ok(cfg)
    }

    fn over(ex: Executor<B>, cfg: DitConfig, inputs: DitInputs, sigmas: Vec<f32>) -> Result<Self> {
        let model = FluxTransformer::over(ex, cfg.clone(), &inputs)?;
        let sampler = Euler::new(sigmas, 1000)?;
        Ok(Denoiser {
            run: DenoiseLoop::new(model, sampler, inputs.x0.clone()),
            config: cfg,
            inputs,
        })
    }

    /// The executor (plan, backend).
    pub fn executor(&self) -> &Executor<B> {
        self.run.model().executor()
    }

    /// The executor, mutable.
    pub fn executor_mut(&mut self) -> &mut Executor<B> {
        self.run.model_mut().executor_mut()
    }

    /// The graph this run would build for `inputs` (to plan it before allocating).
    pub fn graph_for(model: &ModelIndex, inputs: &DitInputs) -> Result<crate::graph::Graph> {
        Self::graph_for_tokens(model, inputs.image_tokens(), inputs.text_tokens())
    }

    /// The graph for `image` latent tokens and `text` tokens, with no inputs drawn (planning).
    pub fn graph_for_tokens(
        model: &ModelIndex,
        image: usize,
        text: usize,
    ) -> Result<crate::graph::Graph> {
        Ok(dit::build(model, image, text)?.graph)
    }

    /// Ends the run: releases its device memory, gives back the backend and the ring.
    pub fn into_parts(self) -> (B, Option<crate::stream::ring::StagingRing>) {
        self.run.into_parts().0.into_executor().into_parts()
    }

    /// Steps in the schedule.
    pub fn steps(&self) -> usize {
        self.run.steps()
    }

    /// Steps done.
    pub fn done(&self) -> usize {
        self.run.done()
    }

    /// The latent now.
    pub fn latent(&self) -> &[f32] {
        self.run.latent()
    }

    /// The inputs.
    pub fn inputs(&self) -> &DitInputs {
        &self.inputs
    }

    /// The schedule.
    pub fn sigmas(&self) -> &[f32] {
        self.run.sampler().sigmas()
    }

    /// One Euler step: one streaming pass over the blocks. `None` once every step is done.
    pub fn step(&mut self) -> Result<Option<DenoiseStep>> {
        self.run.step()
    }

    /// [`Denoiser::step`] on an event loop (the browser).
    pub async fn step_async(&mut self) -> Result<Option<DenoiseStep>> {
        self.run.step_async().await
    }

    /// Continues a run from a checkpoint: the latent, the step count and the inputs it holds
    /// must fit this run (same schedule, same inputs), else an error says what differs.
    pub fn restore(&mut self, c: &Checkpoint) -> Result<()> {
        if c.sigmas != self.sigmas() {
            return Err(Error::Invalid(format!(
                "the checkpoint's schedule ({} steps) is not this run's ({} steps)",
                c.sigmas.len().saturating_sub(1),
                self.steps()
            )));
        }
        if c.inputs != self.inputs {
            return Err(Error::Invalid(
                "the checkpoint was made with other inputs (seed, size or text)".into(),
            ));
        }
        self.run.resume(c.done, c.latent.clone(), &[])
    }

    /// This run's state as a checkpoint.
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            done: self.run.done(),
            latent: self.run.latent().to_vec(),
            sigmas: self.sigmas().to_vec(),
            inputs: self.inputs.clone(),
        }
    }
}

/// A resumable denoising state: steps done, the latent after them, the schedule and the inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Steps done.
    pub done: usize,
    /// The latent after them.
    pub latent: Vec<f32>,
    /// The schedule.
    pub sigmas: Vec<f32>,
    /// The inputs.
    pub inputs: DitInputs,
}

/// File name of the checkpoint inside a checkpoint folder.
#[cfg(feature = "native")]
pub const CHECKPOINT_FILE: &str = "checkpoint.safetensors";

#[cfg(feature = "native")]
impl Checkpoint {
    /// Writes `dir/checkpoint.safetensors` atomically: a temporary file, fsync, rename, fsync of
    /// the folder; a crash leaves the previous complete checkpoint.
    pub fn save(&self, dir: &std::path::Path) -> Result<()> {
        use crate::format::dtype::f32_to_bytes;
        use crate::format::dtype::Dtype;
        let disp = dir.display().to_string();
        std::fs::create_dir_all(dir).map_err(|e| Error::io(disp.clone(), e))?;
        let t = |name: &str, v: &[f32]| {
            (
                name.to_string(),
                Dtype::F32,
                vec![v.len() as u64],
                f32_to_bytes(v),
            )
        };
        let i = &self.inputs;
        let tensors = vec![
            t("latent", &self.latent),
            t("sigmas", &self.sigmas),
            t("x0", &i.x0),
            t("context", &i.context),
            t("pooled", &i.pooled),
            t("guidance", &[i.guidance]),
            t("img_ids", &i.img_ids),
            t("txt_ids", &i.txt_ids),
        ];
        let mut meta = std::collections::BTreeMap::new();
        meta.insert("steps_done".to_string(), self.done.to_string());
        meta.insert("format".to_string(), "nibble-dit-checkpoint-1".to_string());
        let path = dir.join(CHECKPOINT_FILE);
        // write_safetensors writes a temporary file in the same folder and renames it.
        crate::format::writer::write_safetensors(&path, &tensors, &meta)?;
        if let Ok(f) = std::fs::File::open(dir) {
            let _ = f.sync_all();
        }
        Ok(())
    }

    /// Reads `dir/checkpoint.safetensors`; `Ok(None)` when there is none yet.
    pub fn load(dir: &std::path::Path) -> Result<Option<Self>> {
        let path = dir.join(CHECKPOINT_FILE);
        if !path.is_file() {
            return Ok(None);
        }
        let m = ModelIndex::open(&path)?;
        let get = |n: &str| -> Result<Vec<f32>> { m.read_f32(m.require(n)?) };
        let header = crate::io::model::read_header(&path)?;
        let done = header
            .metadata
            .get("steps_done")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| Error::Model {
                file: path.display().to_string(),
                msg: "not a nibble checkpoint (no steps_done)".into(),
            })?;
        Ok(Some(Checkpoint {
            done,
            latent: get("latent")?,
            sigmas: get("sigmas")?,
            inputs: DitInputs {
                x0: get("x0")?,
                context: get("context")?,
                pooled: get("pooled")?,
                guidance: get("guidance")?.first().copied().unwrap_or(0.0),
                img_ids: get("img_ids")?,
                txt_ids: get("txt_ids")?,
            },
        }))
    }
}
