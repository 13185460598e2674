//! A diffusers Flux pipeline folder run as `FluxPipeline.__call__` runs it: the prompt through
//! CLIP (pooled) and T5 (per token), torch-compatible initial noise packed into 2x2 tokens, the
//! flow-matching Euler loop of the transformer with the dynamic shift `mu`, unpacking, the VAE
//! decoder on `latents / scaling_factor + shift_factor`, and 8-bit RGB. Each phase is planned
//! before any weight byte of the run is read ([`Pipeline::plans`]); phases run one after
//! another on one backend, each releasing its device memory before the next allocates.

use std::collections::BTreeMap;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::exec::ExecOptions;
use crate::io::model::ModelIndex;
use crate::models::clip::{self, ClipText};
use crate::models::dit::{self, Denoiser, DitInputs};
use crate::models::flux::noise::NoiseMath;
use crate::models::flux::tokens::{ClipTokenizer, T5Tokenizer};
use crate::models::flux::{latent_grid, latent_image_ids, unpack_latents};
use crate::models::pipeline::{Event, PhaseGraph, Pipeline};
use crate::models::scheduler::SchedulerConfig;
use crate::models::t5::{self, T5Encoder};
use crate::models::vae::{self, VaeConfig, VaeDecoder};
use crate::models::Drive;

/// The components a Flux pipeline folder must list in `model_index.json`, with the classes
/// nibble computes.
const COMPONENTS: [(&str, &[&str]); 7] = [
    ("scheduler", &["FlowMatchEulerDiscreteScheduler"]),
    ("text_encoder", &["CLIPTextModel"]),
    ("tokenizer", &["CLIPTokenizer", "CLIPTokenizerFast"]),
    ("text_encoder_2", &["T5EncoderModel"]),
    ("tokenizer_2", &["T5TokenizerFast", "T5Tokenizer"]),
    ("transformer", &["FluxTransformer2DModel"]),
    ("vae", &["AutoencoderKL"]),
];

/// An opened pipeline folder: configs, tokenizers and the four models' indexes (headers only;
/// no weight byte is read until a phase runs).
pub struct FluxPipeline {
    /// The folder as given.
    pub root: String,
    /// The scheduler's settings.
    pub scheduler: SchedulerConfig,
    /// CLIP's tokenizer.
    pub clip_tokenizer: ClipTokenizer,
    /// T5's tokenizer.
    pub t5_tokenizer: T5Tokenizer,
    /// `text_encoder/`.
    pub text_encoder: ModelIndex,
    /// `text_encoder_2/`.
    pub text_encoder_2: ModelIndex,
    /// `transformer/`.
    pub transformer: ModelIndex,
    /// `vae/`.
    pub vae: ModelIndex,
}

impl std::fmt::Debug for FluxPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FluxPipeline")
            .field("root", &self.root)
            .finish()
    }
}

/// Checks `model_index.json`: a FluxPipeline with exactly the components nibble computes (the
/// optional image encoder and feature extractor absent).
pub fn check_model_index(file: &str, json: &serde_json::Value) -> Result<()> {
    check_components(file, json, "FluxPipeline", &COMPONENTS)
}

use crate::io::folder::ModelFolder;
use crate::models::pipeline::{check_components, open_component, read, read_json, SMALL};

impl FluxPipeline {
    /// Opens a pipeline folder, locally or by URL: the configs and tokenizers are read and
    /// checked, the models' headers indexed. Anything nibble does not compute is refused here,
    /// before a weight byte is read.
    #[cfg(feature = "native")]
    pub fn open(root: &str, mode: crate::io::file::FileReadMode) -> Result<Self> {
        let (root, folder) = crate::models::pipeline::folders(root, mode);
        crate::io::folder::block_on(Self::open_in(&root, &folder))
    }

    /// [`FluxPipeline::open`] over the folders `folder` gives for the root (`""`) and each
    /// component (`"vae"`, ...): the one routine for local folders, URLs and the browser's
    /// fetch.
    pub async fn open_in(
        root: &str,
        folder: &dyn Fn(&str) -> Result<std::sync::Arc<dyn ModelFolder>>,
    ) -> Result<Self> {
        let top = folder("")?;
        let top = top.as_ref();
        let index = read_json(top, "model_index.json").await?;
        check_model_index(&top.locate("model_index.json"), &index)?;
        let sched_name = "scheduler/scheduler_config.json";
        let scheduler = SchedulerConfig::from_json(
            &top.locate(sched_name),
            &read_json(top, sched_name).await?,
        )?;
        // CLIP's tokenizer config, with special_tokens_map.json's entries where it has none.
        let mut cfg = read_json(top, "tokenizer/tokenizer_config.json").await?;
        if let Some(Ok(map)) = top
            .read_small("tokenizer/special_tokens_map.json", SMALL)
            .await?
            .map(|b| serde_json::from_slice::<serde_json::Value>(&b))
        {
            if let (Some(c), Some(m)) = (cfg.as_object_mut(), map.as_object()) {
                for (k, v) in m {
                    c.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
        }
        let clip_tokenizer = ClipTokenizer::from_files(
            &read(top, "tokenizer/vocab.json").await?,
            &read(top, "tokenizer/merges.txt").await?,
            &cfg,
        )?;
        let t5_tokenizer = match top.read_small("tokenizer_2/tokenizer.json", SMALL).await? {
            Some(b) => T5Tokenizer::from_json(&b, &top.locate("tokenizer_2/tokenizer.json"))?,
            None => {
                return Err(Error::Model {
                    file: top.locate("tokenizer_2/tokenizer.json"),
                    msg: "missing: T5's tokenizer is read from tokenizer.json (a folder with \
                          only spiece.model is not supported)"
                        .into(),
                })
            }
        };
        let open = |c: &'static str| open_component(folder, root, c);
        Ok(FluxPipeline {
            scheduler,
            clip_tokenizer,
            t5_tokenizer,
            text_encoder: open("text_encoder").await?,
            text_encoder_2: open("text_encoder_2").await?,
            transformer: open("transformer").await?,
            vae: open("vae").await?,
            root: root.trim_end_matches('/').to_string(),
        })
    }

    /// The key of the encoders' outputs for `p` in an embedding cache: a SHA-256 over the two
    /// encoders' configs and files (names, lengths, header layouts, local modification times)
    /// and the prompt's CLIP and T5 ids.
    pub fn embed_key(&self, p: &Prepared) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"nibble flux embeds v1\0");
        for m in [&self.text_encoder, &self.text_encoder_2] {
            h.update(m.config.as_ref().map(|c| c.to_string()).unwrap_or_default());
            // LoRA adapters on an encoder change its outputs: their paths and scales count.
            h.update(format!("{:?}\0", m.adapters()));
            let source = m.source();
            for (i, s) in m.shards.iter().enumerate() {
                let hd = &s.header;
                h.update(format!(
                    "{}|{}|{}|{}\0",
                    s.name, hd.file, hd.file_len, hd.header_len
                ));
                // A local file's modification time, an HTTP file's ETag / Last-Modified.
                if let Some(v) = source.version(i) {
                    h.update(v);
                }
                for t in &hd.tensors {
                    h.update(format!("{}:{:?}:{}:{}\0", t.name, t.dtype, t.offset, t.len));
                }
            }
        }
        for ids in [&p.clip_ids, &p.t5_ids] {
            h.update((ids.len() as u64).to_le_bytes());
            for i in ids.iter() {
                h.update(i.to_le_bytes());
            }
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The VAE's tiling for `p` on `backend` with `opts`: `Off` none, `On` tiles when the
    /// latent is larger than a tile, `Auto` tiles when it is larger and the whole image's
    /// decoder cannot be planned within the device budget (or within the backend's limit for
    /// one operand, a WebGPU adapter's storage binding size).
    pub fn vae_tiling<B: Backend>(
        &self,
        p: &Prepared,
        backend: &mut B,
        opts: ExecOptions,
    ) -> Result<Option<vae::Tiling>> {
        let (tiling, larger) = Self::tile_settings(p)?;
        Ok(match p.tiling_choice {
            VaeTiling::Off => None,
            VaeTiling::On => larger.then_some(tiling),
            VaeTiling::Auto => {
                let (g, _) = vae::build(&self.vae, p.grid.0, p.grid.1)?;
                let fits = crate::models::pipeline::fits_device(&g, &self.vae, backend, opts);
                (larger && !fits).then_some(tiling)
            }
        })
    }

    /// The VAE tiling `p` asks for (the VAE's default tile, or `--vae-tile-size`), checked, and
    /// whether the latent is larger than one tile.
    fn tile_settings(p: &Prepared) -> Result<(vae::Tiling, bool)> {
        let mut tiling = p.vae.default_tiling();
        if let Some(t) = p.tile {
            if t == 0 {
                return Err(Error::Invalid("a VAE tile of 0 latent positions".into()));
            }
            tiling.latent_tile = t;
        }
        tiling.check(p.vae.scale_factor())?;
        let larger = p.grid.0 > tiling.latent_tile || p.grid.1 > tiling.latent_tile;
        Ok((tiling, larger))
    }
}

impl Pipeline for FluxPipeline {
    type Request = FluxRequest;
    type Prepared = Prepared;
    type Output = FluxOutput;

    /// Everything the run computes before any model: token ids, the latent grid, `mu`, the
    /// sigmas and the initial packed latents.
    fn prepare(&self, req: &FluxRequest) -> Result<Prepared> {
        let dcfg = dit::DitConfig::of(&self.transformer)?;
        let vcfg = VaeConfig::of(&self.vae)?;
        let channels = dcfg.in_channels / 4;
        if channels == 0 || dcfg.in_channels % 4 != 0 || channels != vcfg.latent_channels {
            return Err(Error::Model {
                file: self.transformer.locate("config.json"),
                msg: format!(
                    "in_channels {} is not 4 x the VAE's latent_channels {}",
                    dcfg.in_channels, vcfg.latent_channels
                ),
            });
        }
        // Sizes checked before anything is tokenized, drawn or allocated: at most 4096 latent
        // positions a side (the VAE graph's limit), and diffusers' 512 T5 tokens.
        let f = vcfg.scale_factor();
        if req.height > 4096 * f || req.width > 4096 * f {
            return Err(Error::Invalid(format!(
                "a {} x {} image: at most {} pixels a side with this VAE",
                req.height,
                req.width,
                4096 * f
            )));
        }
        if !(1..=512).contains(&req.max_sequence_length) {
            return Err(Error::Invalid(format!(
                "max_sequence_length {} (1 to 512, as FluxPipeline allows)",
                req.max_sequence_length
            )));
        }
        let grid = latent_grid(req.height, req.width, f)?;
        let tokens = (grid.0 / 2) * (grid.1 / 2);
        crate::io::machine::check_alloc(
            (channels * grid.0 * grid.1) as u64 * 4,
            &format!(
                "the initial latents of a {} x {} image",
                req.height, req.width
            ),
        )?;
        let (clip_ids, _) = self.clip_tokenizer.encode(&req.prompt)?;
        let (t5_ids, _) = self
            .t5_tokenizer
            .encode(&req.prompt, req.max_sequence_length)?;
        let mu = self.scheduler.mu(tokens);
        let sigmas = self.scheduler.pipeline_sigmas(req.steps, mu)?;
        let n = channels * grid.0 * grid.1;
        let latents = match &req.noise {
            Noise::Seed(seed, math) => {
                crate::models::flux::initial_latents(*seed, channels, grid, *math)
            }
            Noise::Latents(v) if v.len() == n => v.clone(),
            Noise::Latents(v) => {
                return Err(Error::Invalid(format!(
                    "{} initial latents given, a {} x {} image takes {n} ({} tokens of {})",
                    v.len(),
                    req.height,
                    req.width,
                    tokens,
                    channels * 4
                )))
            }
        };
        Ok(Prepared {
            clip_ids,
            t5_ids,
            grid,
            channels,
            mu,
            sigmas,
            latents,
            guidance: req.guidance,
            vae: vcfg,
            tiling_choice: req.vae_tiling,
            tile: req.vae_tile,
            tiling: None,
            embeds: None,
        })
    }

    /// The phases' graphs (CLIP, T5, transformer, VAE; the encoders only when their outputs are
    /// not cached) with their models.
    fn graphs(&self, p: &Prepared) -> Result<Vec<PhaseGraph<'_>>> {
        let mut v = Vec::new();
        if p.embeds.is_none() {
            v.push((
                "CLIP",
                clip::build(&self.text_encoder, p.clip_ids.len())?.0,
                &self.text_encoder,
            ));
            v.push((
                "T5",
                t5::build(&self.text_encoder_2, p.t5_ids.len())?.0,
                &self.text_encoder_2,
            ));
        }
        v.extend([
            (
                "transformer",
                dit::build(&self.transformer, p.tokens(), p.t5_ids.len())?.graph,
                &self.transformer,
            ),
            (
                "VAE",
                match p.tiling {
                    // The largest tile's graph (smaller edge tiles take less).
                    Some(t) => {
                        vae::build(
                            &self.vae,
                            t.latent_tile.min(p.grid.0),
                            t.latent_tile.min(p.grid.1),
                        )?
                        .0
                    }
                    None => vae::build(&self.vae, p.grid.0, p.grid.1)?.0,
                },
                &self.vae,
            ),
        ]);
        Ok(v)
    }

    /// The phases' graphs to size budgets from before the VAE's tiling is decided: the VAE at
    /// its tile size wherever tiling may be chosen (`on` or `auto` with a latent larger than a
    /// tile), so that a whole-image decoder that tiling would avoid does not set the budget.
    fn budget_graphs(&self, p: &Prepared) -> Result<Vec<PhaseGraph<'_>>> {
        let (tiling, larger) = Self::tile_settings(p)?;
        if p.tiling.is_none() && larger && p.tiling_choice != VaeTiling::Off {
            let mut q = p.clone();
            q.tiling = Some(tiling);
            return self.graphs(&q);
        }
        self.graphs(p)
    }

    /// Decides the VAE's tiling (`Auto`: tiles only when the whole image's decoder does not fit
    /// the device budget).
    fn settle<B: Backend>(
        &self,
        p: &mut Prepared,
        backend: &mut B,
        opts: ExecOptions,
    ) -> Result<()> {
        p.tiling = self.vae_tiling(p, backend, opts)?;
        Ok(())
    }

    /// The four phases in order: CLIP and T5 (skipped when their outputs are cached), the
    /// transformer's denoise loop, the VAE (tiled where settled so).
    async fn run_with<B: Backend, F: FnMut(Event<'_>)>(
        &self,
        p: &Prepared,
        backend: B,
        opts: ExecOptions,
        drive: &Drive<'_>,
        mut on: F,
    ) -> Result<(FluxOutput, B)> {
        let mut tensors = BTreeMap::new();
        let ids_f32 = |v: &[u32]| v.iter().map(|&i| i as f32).collect::<Vec<_>>();
        tensors.insert(
            "clip_input_ids".into(),
            (vec![1, p.clip_ids.len()], ids_f32(&p.clip_ids)),
        );
        tensors.insert(
            "t5_input_ids".into(),
            (vec![1, p.t5_ids.len()], ids_f32(&p.t5_ids)),
        );
        let phase = |on: &mut dyn FnMut(Event<'_>),
                     name: &'static str,
                     t0: web_time::Instant,
                     bytes: u64| {
            on(Event::PhaseDone {
                phase: name,
                ms: t0.elapsed().as_secs_f64() * 1e3,
                bytes_streamed: bytes,
            })
        };

        let (pooled, context, backend) = match &p.embeds {
            Some(e) => {
                for phase in ["CLIP", "T5"] {
                    on(Event::Cached { phase });
                }
                (e.pooled.clone(), e.context.clone(), backend)
            }
            None => {
                on(Event::PhaseStart { phase: "CLIP" });
                let t0 = web_time::Instant::now();
                let mut clip =
                    ClipText::open(&self.text_encoder, backend, p.clip_ids.len(), opts, drive)
                        .await?;
                clip.limit_passes(1);
                let (_, pooled, st) = clip.forward_async(&p.clip_ids).await?;
                let backend = clip.into_backend();
                phase(&mut on, "CLIP", t0, st.stream.bytes);

                on(Event::PhaseStart { phase: "T5" });
                let t0 = web_time::Instant::now();
                let mut t5 =
                    T5Encoder::open(&self.text_encoder_2, backend, p.t5_ids.len(), opts, drive)
                        .await?;
                t5.limit_passes(1);
                let (context, st) = t5.forward_async(&p.t5_ids).await?;
                let backend = t5.into_backend();
                phase(&mut on, "T5", t0, st.stream.bytes);
                (pooled, context, backend)
            }
        };
        if context.len() % p.t5_ids.len().max(1) != 0 {
            return Err(Error::Invalid(format!(
                "{} T5 values are not {} tokens' states",
                context.len(),
                p.t5_ids.len()
            )));
        }
        tensors.insert(
            "pooled_prompt_embeds".into(),
            (vec![1, pooled.len()], pooled.clone()),
        );
        let width = context.len() / p.t5_ids.len().max(1);
        tensors.insert(
            "prompt_embeds".into(),
            (vec![1, p.t5_ids.len(), width], context.clone()),
        );
        tensors.insert(
            "initial_latents".into(),
            (vec![1, p.tokens(), p.channels * 4], p.latents.clone()),
        );
        tensors.insert("sigmas".into(), (vec![p.sigmas.len()], p.sigmas.clone()));

        on(Event::PhaseStart {
            phase: "transformer",
        });
        let t0 = web_time::Instant::now();
        let inputs = DitInputs {
            x0: p.latents.clone(),
            context,
            pooled,
            guidance: p.guidance,
            img_ids: latent_image_ids(p.grid.0 / 2, p.grid.1 / 2),
            txt_ids: vec![0.0; p.t5_ids.len() * 3],
        };
        let sigmas = p.sigmas.clone();
        let mut d = match drive {
            Drive::Blocking => Denoiser::new(&self.transformer, backend, inputs, sigmas, opts)?,
            Drive::EventLoop(maker) => {
                let mut make = maker(&self.transformer);
                Denoiser::with_source_async(
                    &self.transformer,
                    backend,
                    inputs,
                    sigmas,
                    opts,
                    &mut make,
                )
                .await?
            }
        };
        let steps = p.sigmas.len() - 1;
        d.executor_mut().limit_stream_passes(steps as u64);
        let mut streamed = 0;
        loop {
            let s = match drive {
                Drive::Blocking => d.step()?,
                Drive::EventLoop(_) => d.step_async().await?,
            };
            let Some(s) = s else { break };
            streamed += s.stats.stream.bytes;
            on(Event::Step {
                step: s.step,
                steps,
                info: &s,
            });
        }
        let packed = d.latent().to_vec();
        let (backend, _) = d.into_parts();
        phase(&mut on, "transformer", t0, streamed);
        tensors.insert(
            "final_latents_packed".into(),
            (vec![1, p.tokens(), p.channels * 4], packed.clone()),
        );

        on(Event::PhaseStart { phase: "VAE" });
        let t0 = web_time::Instant::now();
        let (h, w) = p.grid;
        let z = vae::decoder_input(&unpack_latents(&packed, p.channels, h, w), &p.vae);
        tensors.insert("vae_input".into(), (vec![1, p.channels, h, w], z.clone()));
        let (image, backend, bytes) = match p.tiling {
            Some(t) => {
                let (image, backend, bytes) = vae::tiled_decode_with(
                    &self.vae,
                    backend,
                    &z,
                    (p.channels, h, w),
                    t,
                    opts,
                    drive,
                )
                .await?;
                (image, backend, bytes)
            }
            None => {
                let mut dec = VaeDecoder::open(&self.vae, backend, (h, w), opts, drive).await?;
                dec.limit_passes(1);
                let (image, st) = dec.decode_async(&z).await?;
                (image, dec.into_backend(), st.stream.bytes)
            }
        };
        phase(&mut on, "VAE", t0, bytes);
        let f = p.vae.scale_factor();
        let (ih, iw) = (h * f, w * f);
        let rgb = vae::to_rgb8(&image, ih, iw)?;
        tensors.insert("image_f32".into(), (vec![1, 3, ih, iw], image));
        Ok((
            FluxOutput {
                height: ih,
                width: iw,
                rgb,
                tensors,
            },
            backend,
        ))
    }
}

/// Where the initial latents come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Noise {
    /// `torch.Generator("cpu").manual_seed(seed)`, drawn with torch's transform.
    Seed(u64, NoiseMath),
    /// Given packed latents `[tokens, 4 * channels]`.
    Latents(Vec<f32>),
}

/// What to generate (defaults as `FluxPipeline.__call__`'s are set by the caller).
#[derive(Debug, Clone, PartialEq)]
pub struct FluxRequest {
    /// The prompt (CLIP and T5 both get it).
    pub prompt: String,
    /// Image height in pixels.
    pub height: usize,
    /// Image width in pixels.
    pub width: usize,
    /// Denoising steps.
    pub steps: usize,
    /// Embedded guidance scale.
    pub guidance: f32,
    /// T5 tokens (`max_sequence_length`).
    pub max_sequence_length: usize,
    /// The initial noise.
    pub noise: Noise,
    /// Whether the VAE decodes in tiles.
    pub vae_tiling: VaeTiling,
    /// Latent tile size (diffusers' `tile_latent_min_size`); the VAE config's default if none.
    pub vae_tile: Option<usize>,
}

pub use crate::models::pipeline::VaeTiling;

/// A request made concrete: ids, grid, schedule, initial latents.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// CLIP ids (77).
    pub clip_ids: Vec<u32>,
    /// T5 ids (`max_sequence_length`).
    pub t5_ids: Vec<u32>,
    /// Latent grid (height, width).
    pub grid: (usize, usize),
    /// Latent channels.
    pub channels: usize,
    /// The dynamic shift.
    pub mu: f64,
    /// The sigmas (steps + 1).
    pub sigmas: Vec<f32>,
    /// Packed initial latents.
    pub latents: Vec<f32>,
    /// Guidance.
    pub guidance: f32,
    /// The VAE's config.
    pub vae: VaeConfig,
    /// The tiling asked for.
    pub tiling_choice: VaeTiling,
    /// The tile size asked for.
    pub tile: Option<usize>,
    /// The VAE's tiling, once [`FluxPipeline::plans`] has decided it.
    pub tiling: Option<vae::Tiling>,
    /// The encoders' outputs from a cache: the CLIP and T5 phases are skipped.
    pub embeds: Option<Embeds>,
}

/// The text encoders' outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeds {
    /// CLIP's pooled output `[hidden]`.
    pub pooled: Vec<f32>,
    /// T5's states `[t5 tokens, d_model]`.
    pub context: Vec<f32>,
}

impl Prepared {
    /// Packed image tokens.
    pub fn tokens(&self) -> usize {
        (self.grid.0 / 2) * (self.grid.1 / 2)
    }
}

/// The picture and the tensors diffusers names along the way.
#[derive(Debug, Clone)]
pub struct FluxOutput {
    /// Pixels high.
    pub height: usize,
    /// Pixels wide.
    pub width: usize,
    /// 8-bit RGB, `[height, width, 3]`.
    pub rgb: Vec<u8>,
    /// `clip_input_ids`, `t5_input_ids`, `pooled_prompt_embeds`, `prompt_embeds`,
    /// `initial_latents`, `sigmas`, `final_latents_packed`, `vae_input`, `image_f32`: shape and
    /// float32 values.
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}
