//! Pipelines of phases, the shape every diffusion family plugs into: a request is prepared (token
//! ids, schedule, initial latents: everything before any model), every phase's graph (encode
//! text -> denoise -> decode) is planned before any weight byte is read, and the phases run one
//! after another on one backend, each releasing its device memory before the next allocates,
//! reporting [`Event`]s. The CLI, the demo and the browser drive a [`Pipeline`] and keep only
//! their transport.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::exec::ExecOptions;
use crate::graph::Graph;
use crate::io::folder::ModelFolder;
use crate::io::model::ModelIndex;
use crate::models::denoise::DenoiseStep;
use crate::models::Drive;
use crate::plan::{fmt_bytes, MemoryPlan};

/// A phase's name, its graph and its model.
pub type PhaseGraph<'a> = (&'static str, Graph, &'a ModelIndex);

/// Progress of a run.
#[derive(Debug)]
pub enum Event<'a> {
    /// A phase begins (its model is about to be loaded).
    PhaseStart {
        /// Its name (CLIP, T5, transformer, VAE, ...).
        phase: &'static str,
    },
    /// One denoising step is done.
    Step {
        /// From 1.
        step: usize,
        /// Of this many.
        steps: usize,
        /// Its figures.
        info: &'a DenoiseStep,
    },
    /// A phase was skipped: its outputs came from a cache.
    Cached {
        /// Its name.
        phase: &'static str,
    },
    /// Video frames are decoded (as they come, before the phase ends).
    Frames {
        /// The first one's index.
        first: usize,
        /// Frames in the whole video.
        total: usize,
        /// Pixels wide.
        width: usize,
        /// Pixels high.
        height: usize,
        /// 8-bit RGB `[n, height, width, 3]`.
        rgb: &'a [u8],
    },
    /// A phase is done and its device memory released.
    PhaseDone {
        /// Its name.
        phase: &'static str,
        /// Wall time.
        ms: f64,
        /// Weight bytes streamed.
        bytes_streamed: u64,
    },
}

/// Whether `graph` on `model` can be planned within `opts`' device budget (and the backend's
/// limits): what a VAE's `auto` tiling asks of the whole image's or frame's decoder.
pub(crate) fn fits_device<B: Backend>(
    graph: &Graph,
    model: &ModelIndex,
    backend: &mut B,
    opts: ExecOptions,
) -> bool {
    crate::plan::plan_graph(graph, model, backend, opts.budgets, opts.stream_all)
        .is_ok_and(|plan| plan.peak_device_bytes <= opts.budgets.device_bytes)
}

/// Whether a pipeline's VAE decodes in spatial tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VaeTiling {
    /// Never.
    Off,
    /// Always (when the latent is larger than one tile).
    On,
    /// When the whole image's (or frame's) decoder does not fit the device budget.
    #[default]
    Auto,
}

/// A pipeline of phases over one backend.
pub trait Pipeline {
    /// What a user asks for (prompt, size, steps, seed, ...).
    type Request;
    /// Everything computed before any model runs.
    type Prepared;
    /// What the run gives.
    type Output;

    /// Prepares a request: what needs no model (token ids, the schedule, the initial latents).
    fn prepare(&self, req: &Self::Request) -> Result<Self::Prepared>;

    /// The phases' graphs as they will run, in order.
    fn graphs(&self, p: &Self::Prepared) -> Result<Vec<PhaseGraph<'_>>>;

    /// The graphs to size budgets from before [`Pipeline::settle`] decides what the budgets
    /// decide (by default the graphs that will run).
    fn budget_graphs(&self, p: &Self::Prepared) -> Result<Vec<PhaseGraph<'_>>> {
        self.graphs(p)
    }

    /// Decides what depends on the budgets (a VAE's tiling); by default nothing.
    fn settle<B: Backend>(
        &self,
        _p: &mut Self::Prepared,
        _backend: &mut B,
        _opts: ExecOptions,
    ) -> Result<()> {
        Ok(())
    }

    /// Settles `p` and returns every phase's plan for `opts`, made before anything is allocated
    /// or read; an impossible budget is an error naming the phase ([`plan_phases`]).
    fn plans<B: Backend>(
        &self,
        p: &mut Self::Prepared,
        backend: &mut B,
        opts: ExecOptions,
    ) -> Result<Vec<(&'static str, MemoryPlan)>> {
        self.settle(p, backend, opts)?;
        plan_phases(&self.graphs(p)?, backend, opts)
    }

    /// Runs every phase on `backend`, each reading as `drive` says (the browser awaits),
    /// reporting each phase and step to `on`; the backend comes back with the output, its
    /// device memory released.
    #[allow(async_fn_in_trait)]
    async fn run_with<B: Backend, F: FnMut(Event<'_>)>(
        &self,
        p: &Self::Prepared,
        backend: B,
        opts: ExecOptions,
        drive: &Drive<'_>,
        on: F,
    ) -> Result<(Self::Output, B)>;

    /// [`Pipeline::run_with`], blocking.
    #[cfg(feature = "native")]
    fn run<B: Backend, F: FnMut(Event<'_>)>(
        &self,
        p: &Self::Prepared,
        backend: B,
        opts: ExecOptions,
        on: F,
    ) -> Result<Self::Output> {
        crate::io::folder::block_on(self.run_with(p, backend, opts, &Drive::Blocking, on))
            .map(|(out, _)| out)
    }
}

/// A count as a word where it is small ("all four").
fn count_word(n: usize) -> String {
    match n {
        2 => "both".into(),
        3 => "all three".into(),
        4 => "all four".into(),
        5 => "all five".into(),
        n => format!("all {n}"),
    }
}

/// Every phase's plan for `opts`. One budget serves every phase, so a phase refused for it gets
/// the smallest budget that runs them all (every group streamed), rounded up so that the size
/// given runs.
pub fn plan_phases<B: Backend>(
    graphs: &[PhaseGraph<'_>],
    backend: &mut B,
    opts: ExecOptions,
) -> Result<Vec<(&'static str, MemoryPlan)>> {
    let mut out = Vec::new();
    for (phase, g, m) in graphs {
        match crate::plan::plan_graph(g, m, backend, opts.budgets, opts.stream_all) {
            Ok(plan) => out.push((*phase, plan)),
            Err(e) => {
                let e = e.to_string();
                // Only a phase refused for its budget gets a budget to use.
                let own = crate::plan::min_device_bytes(g, m, backend);
                if !own.is_ok_and(|b| b > opts.budgets.device_bytes) {
                    return Err(Error::Invalid(format!("{phase} phase: {e}")));
                }
                let mut need = Vec::new();
                for (ph, g, m) in graphs {
                    if let Ok(b) = crate::plan::min_device_bytes(g, m, backend) {
                        need.push((b, *ph));
                    }
                }
                let Some(&(most, which)) = need.iter().max() else {
                    return Err(Error::Invalid(format!("{phase} phase: {e}")));
                };
                if most <= opts.budgets.device_bytes {
                    return Err(Error::Invalid(format!("{phase} phase: {e}")));
                }
                let use_mib = (most as f64 / 1048576.0 * 100.0).ceil() / 100.0;
                return Err(Error::Invalid(format!(
                    "device budget {} cannot hold the {phase} phase; every phase runs with the \
                     same budget, and the smallest that runs {} is {} (the {which} phase's, \
                     every group streamed): use --device-budget {} or more",
                    fmt_bytes(opts.budgets.device_bytes),
                    count_word(graphs.len()),
                    fmt_bytes(most),
                    format_args!("{use_mib:.2}MiB")
                )));
            }
        }
    }
    Ok(out)
}

/// Small files (configs, tokenizers) are read whole up to this size.
pub(crate) const SMALL: u64 = 64 << 20;

/// The bytes of `name` in `folder` (a small file), or the error naming it.
pub(crate) async fn read(folder: &dyn ModelFolder, name: &str) -> Result<Vec<u8>> {
    folder
        .read_small(name, SMALL)
        .await?
        .ok_or_else(|| folder.missing(name))
}

/// `name` in `folder` as JSON.
pub(crate) async fn read_json(folder: &dyn ModelFolder, name: &str) -> Result<serde_json::Value> {
    let bytes = read(folder, name).await?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Model {
        file: folder.locate(name),
        msg: e.to_string(),
    })
}

/// Opens component `name` of the pipeline at `root` through `folder` (its index: headers only).
pub(crate) async fn open_component(
    folder: &dyn Fn(&str) -> Result<std::sync::Arc<dyn ModelFolder>>,
    root: &str,
    name: &str,
) -> Result<ModelIndex> {
    let mut m = crate::io::model::open_model(folder(name)?, None).await?;
    m.root = format!("{}/{name}", root.trim_end_matches('/'));
    Ok(m)
}

/// Checks `model_index.json`: a `class` pipeline with exactly the `components` (name and the
/// classes nibble computes for it); any other component must be absent (null).
pub fn check_components(
    file: &str,
    json: &serde_json::Value,
    class: &str,
    components: &[(&str, &[&str])],
) -> Result<()> {
    let bad = |msg: String| Error::Model {
        file: file.to_string(),
        msg,
    };
    let obj = json
        .as_object()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    match obj.get("_class_name").and_then(|v| v.as_str()) {
        Some(c) if c == class => {}
        other => return Err(bad(format!("_class_name {other:?}: not a {class} folder"))),
    }
    for (name, classes) in components {
        let found = obj
            .get(*name)
            .and_then(|v| v.as_array())
            .and_then(|a| a.get(1))
            .and_then(|v| v.as_str());
        match found {
            Some(c) if classes.contains(&c) => {}
            Some(c) => return Err(bad(format!("{name} is a {c}: not supported ({classes:?})"))),
            None => return Err(bad(format!("no {name} component"))),
        }
    }
    for (name, v) in obj {
        let known = name.starts_with('_') || components.iter().any(|(n, _)| n == name);
        let null = v.is_null() || v.as_array().is_some_and(|a| a.iter().all(|x| x.is_null()));
        let setting = !v.is_array();
        if !known && !null && !setting {
            return Err(bad(format!("component {name} ({v}) is not supported")));
        }
    }
    Ok(())
}

/// The pipeline class a folder's `model_index.json` names: `None` where the folder (or URL)
/// has no such file, or is not a folder; an error naming the file where it could not be read
/// (HTTP 401/403/5xx, over the size limit) or is not JSON, so that a pipeline the server
/// refused is not reported as "no model found".
#[cfg(feature = "native")]
pub fn pipeline_class(root: &str) -> Result<Option<String>> {
    let (_, folder) = folders(root, Default::default());
    let Ok(top) = folder("") else {
        return Ok(None);
    };
    let Some(bytes) = crate::io::folder::block_on(top.read_small("model_index.json", SMALL))?
    else {
        return Ok(None);
    };
    let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| Error::Model {
        file: top.locate("model_index.json"),
        msg: format!("not JSON: {e}"),
    })?;
    Ok(json
        .get("_class_name")
        .and_then(|c| c.as_str())
        .map(str::to_string))
}

/// A pipeline folder's root (without a trailing `/`) and the folders of its components (`""`:
/// the root), local or by URL.
#[cfg(feature = "native")]
#[allow(clippy::type_complexity)]
pub fn folders(
    root: &str,
    mode: crate::io::file::FileReadMode,
) -> (
    String,
    impl Fn(&str) -> Result<std::sync::Arc<dyn ModelFolder>>,
) {
    let url = root.starts_with("http://") || root.starts_with("https://");
    let root = root.trim_end_matches('/').to_string();
    let base = root.clone();
    let folder = move |sub: &str| -> Result<std::sync::Arc<dyn ModelFolder>> {
        let at = if sub.is_empty() {
            base.clone()
        } else {
            format!("{base}/{sub}")
        };
        Ok(if url {
            std::sync::Arc::new(crate::io::http::HttpFolder::new(&at, Default::default()))
        } else {
            std::sync::Arc::new(crate::io::file::LocalFolder::new(
                std::path::Path::new(&at),
                mode,
            )?)
        })
    };
    (root, folder)
}
