//! `nibble run`: one model, planned and streamed on one backend. The kind comes from the model's
//! `config.json`: a Llama-family decoder generates text ([`llm`]), a Flux-style DiT denoises
//! ([`dit`]), a BERT encoder embeds the prompt ([`embed`]).

mod dit;
mod embed;
pub mod flux;
mod llm;
mod options;
mod plan;
mod progress;
pub mod wan;

use anyhow::{bail, Result};
use nibble_core::backend::Backend;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::ModelKind;

pub use dit::step_row;
pub(crate) use options::exec_options;
pub use options::RunArgs;

/// Runs generation (LLM), denoising (DiT) or embedding (encoder), by what config.json says.
pub fn run(o: &RunArgs) -> Result<()> {
    check_outputs(o)?;
    match nibble_core::models::pipeline::pipeline_class(&o.model)?.as_deref() {
        Some("WanPipeline") => return wan::run(o),
        Some(_) => return flux::run(o),
        None => {}
    }
    let d = &o.dit;
    options::refuse_wan_flags(d, &o.model)?;
    if d.latents.is_some() || d.embed_cache.is_some() || d.intermediates.is_some() {
        bail!(
            "--latents, --embed-cache and --intermediates are for a Flux pipeline folder \
             (model_index.json); {} is not one",
            o.model
        );
    }
    let model = ModelIndex::open_path_or_url(&o.model, o.file_mode.into())?;
    let Some(k) = model.config.as_ref().and_then(ModelKind::of_config) else {
        bail!(
            "{}: config.json is neither a Llama-family decoder, a Flux-style DiT nor a BERT encoder",
            o.model
        );
    };
    let target = match k {
        ModelKind::Llm => nibble_core::models::lora::Target::model(),
        ModelKind::Dit => nibble_core::models::flux::lora::transformer_target(),
        ModelKind::Encoder if o.lora.lora.is_empty() => nibble_core::models::lora::Target::model(),
        ModelKind::Encoder => bail!("--lora is for language models, Flux and DiTs, not encoders"),
    };
    let model = o.lora.bind(&model, target, o.file_mode.into(), o.json)?;
    if k != ModelKind::Dit
        && !o.plan_only
        && o.text.prompt_ids.is_empty()
        && o.text.prompt.is_none()
    {
        bail!("a language model or an encoder needs --prompt TEXT or --prompt-ids 1,2,3");
    }
    crate::backends::select(o.backend)?.run(Dispatch {
        o,
        model: &model,
        kind: k,
    })
}

/// The model kind's run on one backend.
struct Dispatch<'a> {
    o: &'a RunArgs,
    model: &'a ModelIndex,
    kind: ModelKind,
}

impl crate::backends::WithBackend for Dispatch<'_> {
    type Output = ();
    fn call<B: Backend + 'static>(self, backend: B, label: &str) -> Result<()> {
        match self.kind {
            ModelKind::Llm => llm::run(self.o, self.model, backend, label),
            ModelKind::Encoder => embed::run(self.o, self.model, backend, label),
            ModelKind::Dit => dit::run(self.o, self.model, backend, label),
        }
    }
}

/// Every file `run` writes is checked against what it reads before the model is opened.
fn check_outputs(o: &RunArgs) -> Result<()> {
    use crate::output::paths::{check_output, Reads};
    let inputs: Vec<&std::path::Path> = o
        .dit
        .inputs
        .iter()
        .chain(&o.dit.latents)
        .chain(&o.dit.vae_decode)
        .map(|p| p.as_path())
        .collect();
    let mut with_resume = inputs.clone();
    with_resume.extend(o.dit.resume.as_deref());
    let outputs = [
        ("--logits-out", o.llm.logits_out.as_deref(), &with_resume),
        ("--out", o.dit.out.as_deref(), &with_resume),
        ("--preview", o.dit.preview.as_deref(), &with_resume),
        (
            "--intermediates",
            o.dit.intermediates.as_deref(),
            &with_resume,
        ),
        ("--embed-cache", o.dit.embed_cache.as_deref(), &with_resume),
        ("--frames-dir", o.dit.frames_dir.as_deref(), &with_resume),
        // Checkpointing over the checkpoint resumed from is how a long run is continued.
        ("--checkpoint", o.dit.checkpoint.as_deref(), &inputs),
    ];
    for (flag, out, files) in outputs {
        if let Some(out) = out {
            let reads = Reads {
                model: &o.model,
                files: files.clone(),
            };
            check_output(out, flag, &reads)?;
        }
    }
    Ok(())
}
