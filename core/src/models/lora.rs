//! LoRA adapters for a run: `--lora FILE_OR_FOLDER[:SCALE]` opened (peft folders, diffusers and
//! kohya files, locally or by URL) and bound to the model they adapt, each module's pair checked
//! against the model's weight before any byte is read. The graphs then compute
//! `y = W·x + Σ scale_i · B_i(A_i·x)` beside every adapted linear ([`super::nn::W`]), the base
//! weights streamed as without adapters and the adapters' own tensors resident, one pinned group
//! per adapter.
//!
//! Scaling follows peft's `LoraLayer` (see [`crate::format::lora`]); a module a family fuses in
//! kohya's naming (Flux's `qkv`, `linear1`) gives each part the shared down projection and its
//! own rows of the up projection, which covers sd-scripts' block-diagonal `split_qkv` form too
//! (its off-diagonal blocks are zeros).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::dtype::dtype_bits;
use crate::format::lora::{pairs, LoraConfig, Naming, Pair};
use crate::format::safetensors::TensorEntry;
use crate::io::folder::{ModelFolder, SIDE_FILE_LIMIT};
use crate::io::model::{open_first, open_model, Adapters, AddedFile, LowRank, ModelIndex};

/// The file names an adapter folder is looked up by, in order (peft's, then diffusers').
pub const ADAPTER_FILES: [&str; 2] = [
    "adapter_model.safetensors",
    "pytorch_lora_weights.safetensors",
];

/// One `--lora` argument: where the adapter is, its scale and its name.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterArg {
    /// A file or folder path, or an http(s) URL.
    pub source: String,
    /// The adapter's own scale (1 by default), multiplying peft's scaling.
    pub scale: f32,
    /// Its name in plans and messages (the server's per-request name).
    pub name: String,
}

impl AdapterArg {
    /// Parses `[NAME=]FILE_OR_FOLDER[:SCALE]`. The scale is a finite number after the last `:`
    /// (a path that exists as written keeps its colons); the name is the file's stem or the
    /// folder's name unless given.
    pub fn parse(arg: &str) -> Result<Self> {
        let bad = |msg: String| Error::Invalid(format!("--lora {arg}: {msg}"));
        let (name, rest) = match arg.split_once('=') {
            Some((n, r))
                if !n.is_empty()
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) =>
            {
                (Some(n.to_string()), r)
            }
            _ => (None, arg),
        };
        let exists = {
            #[cfg(feature = "native")]
            {
                std::path::Path::new(rest).exists()
            }
            #[cfg(not(feature = "native"))]
            {
                false
            }
        };
        let (source, scale) = match rest.rsplit_once(':') {
            // Not the port of a URL without a path (`http://host:8000`).
            Some((p, s))
                if !exists
                    && !s.contains('/')
                    && !p.ends_with("://")
                    && p.split_once("://")
                        .is_none_or(|(_, host)| host.contains(['/', ':'])) =>
            {
                if p.is_empty() {
                    return Err(bad("no file or folder given before the scale".into()));
                }
                let scale: f32 = s
                    .parse()
                    .ok()
                    .filter(|x: &f32| x.is_finite())
                    .ok_or_else(|| bad(format!("scale '{s}' is not a finite number")))?;
                (p.to_string(), scale)
            }
            _ => (rest.to_string(), 1.0),
        };
        if source.is_empty() {
            return Err(bad("no file or folder given".into()));
        }
        let name = name.unwrap_or_else(|| {
            let t = source.trim_end_matches('/');
            let leaf = t.rsplit('/').next().unwrap_or(t);
            leaf.strip_suffix(".safetensors")
                .unwrap_or(leaf)
                .to_string()
        });
        Ok(AdapterArg {
            source,
            scale,
            name,
        })
    }
}

/// An adapter file, opened: its tensors' index, the config beside it and its `--lora` argument.
#[derive(Debug, Clone)]
pub struct AdapterFile {
    /// The argument it was opened from (its name unique among the run's adapters).
    pub arg: AdapterArg,
    /// The adapter's safetensors file.
    pub index: ModelIndex,
    /// `adapter_config.json` beside it (peft), parsed.
    pub peft_config: Option<serde_json::Value>,
    /// kohya's scalar `.alpha` tensors, read when the file was opened.
    pub alphas: BTreeMap<String, Vec<f32>>,
}

/// Opens the adapter in `folder`: the file `file` where named, else the folder's peft or
/// diffusers file ([`ADAPTER_FILES`]) or its only `*.safetensors`; `adapter_config.json` beside
/// it where there is one. The one routine for local paths, URLs and the browser's fetch.
pub async fn open_in(
    arg: AdapterArg,
    folder: Arc<dyn ModelFolder>,
    file: Option<&str>,
) -> Result<AdapterFile> {
    let found = match file {
        Some(f) => Some(open_model(folder.clone(), Some(f)).await?),
        None => match open_first(folder.clone(), &ADAPTER_FILES).await? {
            Some(m) => Some(m),
            None => match folder.list_safetensors()? {
                Some(l) if l.len() == 1 => Some(open_model(folder.clone(), Some(&l[0])).await?),
                _ => None,
            },
        },
    };
    let Some(mut index) = found else {
        return Err(Error::Model {
            file: folder.root().to_string(),
            msg: format!(
                "no LoRA adapter found: expected {} or a single *.safetensors file",
                ADAPTER_FILES.join(" or ")
            ),
        });
    };
    let peft_config = match folder
        .read_small("adapter_config.json", SIDE_FILE_LIMIT)
        .await?
    {
        Some(b) => Some(serde_json::from_slice(&b).map_err(|e| Error::Model {
            file: folder.locate("adapter_config.json"),
            msg: format!("invalid JSON: {e}"),
        })?),
        None => None,
    };
    index.root = arg.source.clone();
    let mut alphas = BTreeMap::new();
    for t in index.tensors().filter(|t| t.name.ends_with(".alpha")) {
        if t.len > 64 {
            return Err(Error::Model {
                file: index.root.clone(),
                msg: format!("'{}' is {:?}, not a scalar", t.name, t.shape),
            });
        }
        let bytes = folder.read_at(t.shard, t.offset, t.len, &t.name).await?;
        let v =
            crate::format::dtype::bytes_to_f32(&bytes, t.dtype).ok_or_else(|| Error::Model {
                file: index.root.clone(),
                msg: format!("'{}' is not a float tensor", t.name),
            })?;
        alphas.insert(t.name.clone(), v);
    }
    Ok(AdapterFile {
        arg,
        index,
        peft_config,
        alphas,
    })
}

/// Where an adapter argument's files are: its folder, and the file in it where the argument
/// names one.
pub type AdapterFolder = (Arc<dyn ModelFolder>, Option<String>);

/// Opens every adapter argument through `folder_of` (local paths, URLs, the browser's fetch):
/// each file or folder once, the names made unique.
pub async fn open_args(
    args: &[AdapterArg],
    folder_of: &dyn Fn(&str) -> Result<AdapterFolder>,
) -> Result<Vec<AdapterFile>> {
    let mut out: Vec<AdapterFile> = Vec::new();
    for a in args {
        let mut a = a.clone();
        // A name an earlier adapter has gets the first `-2`, `-3`, ... suffix that no adapter
        // has or is given.
        if out.iter().any(|o| o.arg.name == a.name) {
            let base = a.name.clone();
            let taken =
                |n: &str| out.iter().any(|o| o.arg.name == n) || args.iter().any(|o| o.name == n);
            let mut k = 2;
            while taken(&format!("{base}-{k}")) {
                k += 1;
            }
            a.name = format!("{base}-{k}");
        }
        let (folder, file) = folder_of(a.source.trim_end_matches('/'))?;
        out.push(open_in(a, folder, file.as_deref()).await?);
    }
    Ok(out)
}

/// The folder of an adapter at a URL: a `.safetensors` URL is that file in its folder.
pub fn url_parts(url: &str) -> (&str, Option<&str>) {
    match url.rsplit_once('/') {
        Some((dir, f)) if f.ends_with(".safetensors") => (dir, Some(f)),
        _ => (url, None),
    }
}

/// Opens every `--lora` argument (a local file or folder, or an http(s) URL); names made unique.
#[cfg(feature = "native")]
pub fn open_all(
    args: &[AdapterArg],
    mode: crate::io::file::FileReadMode,
) -> Result<Vec<AdapterFile>> {
    use crate::io::file::LocalFolder;
    use crate::io::http::HttpFolder;
    let folder_of = |s: &str| -> Result<AdapterFolder> {
        if s.starts_with("http://") || s.starts_with("https://") {
            let (dir, file) = url_parts(s);
            return Ok((
                Arc::new(HttpFolder::new(dir, Default::default())),
                file.map(str::to_string),
            ));
        }
        let p = std::path::Path::new(s);
        let meta = std::fs::metadata(p).map_err(|e| Error::io(s, e))?;
        Ok(if meta.is_dir() {
            (Arc::new(LocalFolder::new(p, mode)?), None)
        } else {
            let (f, name) = LocalFolder::of_file(p, mode)?;
            (Arc::new(f), Some(name))
        })
    };
    crate::io::folder::block_on(open_args(args, &folder_of))
}

/// Module names of a file's own naming to the linears they cover, in row order.
pub type KohyaMap = dyn Fn(&str) -> Option<Vec<String>>;

/// Which keys of an adapter file are a model's, and how its family names fused modules.
#[derive(Clone, Copy)]
pub struct Target<'a> {
    /// The pipeline component the model is (`"transformer"`), whose prefix diffusers' keys
    /// carry; `None` for a model on its own.
    pub component: Option<&'a str>,
    /// The other components' prefixes: their keys are for another model of the pipeline.
    pub others: &'a [&'a str],
    /// kohya's prefixes of this model (`lora_unet_` for a diffusion transformer, `lora_te1_`
    /// for CLIP) and its module names (prefix stripped) to the family's linears they cover, in
    /// the order their rows are stacked.
    pub kohya: Option<(&'a [&'a str], &'a KohyaMap)>,
    /// The family's original module names under a prefix (`diffusion_model.` for the Wan
    /// trainers' files) to its linears.
    pub original: Option<(&'a str, &'a KohyaMap)>,
    /// Whether keys without a component prefix are this model's (a pipeline's transformer, a
    /// model on its own), not its text encoders'.
    pub unprefixed: bool,
}

impl Target<'static> {
    /// A model on its own (a language model's peft adapter): keys name its modules, with or
    /// without peft's `base_model.model.` prefix.
    pub fn model() -> Self {
        Target {
            component: None,
            others: &[],
            kohya: None,
            original: None,
            unprefixed: true,
        }
    }
}

impl std::fmt::Debug for Target<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("component", &self.component)
            .finish()
    }
}

/// What binding found, per adapter: modules adapted, bytes resident, keys left unmatched.
#[derive(Debug, Clone, PartialEq)]
pub struct Bound {
    /// The adapter's name.
    pub name: String,
    /// Linears it adapts in this model.
    pub modules: usize,
    /// Bytes of its tensors this model reads (resident).
    pub bytes: u64,
    /// Its pairs that are not this model's (other components' keys), when allowed.
    pub unmatched: usize,
    /// Deltas of norm layers it carries, dropped (as diffusers drops them).
    pub dropped: usize,
}

/// Binds `adapters` to `model`: every pair is checked against the weight it adapts (rank,
/// shapes), its scaling taken from the adapter's config, and the model's index returned with the
/// adapters' tensors and paths ([`ModelIndex::with_adapters`]). A pair that is not the model's
/// is an error naming its key, or, with `ignore_unmatched`, counted in [`Bound`].
pub fn bind(
    model: &ModelIndex,
    adapters: &[AdapterFile],
    target: Target<'_>,
    ignore_unmatched: bool,
) -> Result<(ModelIndex, Vec<Bound>)> {
    let (mut models, report) = bind_pipeline(&[(model, target)], adapters, ignore_unmatched)?;
    Ok((models.remove(0), report))
}

/// [`bind`] over the models of a pipeline (the transformer and the text encoders), each with its
/// target: every module of every adapter file must be one model's (else an error naming its key,
/// or with `ignore_unmatched` a count); a model no adapter reaches is returned as it was.
pub fn bind_pipeline(
    components: &[(&ModelIndex, Target<'_>)],
    adapters: &[AdapterFile],
    ignore_unmatched: bool,
) -> Result<(Vec<ModelIndex>, Vec<Bound>)> {
    let mut report: Vec<Bound> = adapters
        .iter()
        .map(|a| Bound {
            name: a.arg.name.clone(),
            modules: 0,
            bytes: 0,
            unmatched: 0,
            dropped: 0,
        })
        .collect();
    let found = adapters
        .iter()
        .map(|a| {
            pairs(a.index.tensors().map(|t| t.name.as_str())).map_err(|msg| Error::Model {
                file: a.index.root.clone(),
                msg,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // Per adapter and module of its file: the first reason a model gave for not taking it,
    // while no model has taken it.
    let mut untaken: Vec<Vec<Option<String>>> =
        found.iter().map(|f| vec![None; f.modules.len()]).collect();
    let mut taken: Vec<Vec<bool>> = found.iter().map(|f| vec![false; f.modules.len()]).collect();
    let mut out = Vec::with_capacity(components.len());
    for &(model, target) in components {
        let mut paths: BTreeMap<String, Vec<LowRank>> = BTreeMap::new();
        let mut added = Vec::new();
        for (ai, a) in adapters.iter().enumerate() {
            let bad = |msg: String| Error::Model {
                file: a.index.root.clone(),
                msg,
            };
            let config = config_of(a, target)?;
            let mut b = Binder {
                a,
                ai,
                model,
                tensors: Vec::new(),
                bound: report[ai].clone(),
                seen: Default::default(),
            };
            for (pi, p) in found[ai].modules.iter().enumerate() {
                let modules = match modules_of(p, found[ai].naming, target) {
                    Ok(m) => m,
                    Err(why) if why.other_component => {
                        untaken[ai][pi].get_or_insert(why.msg);
                        continue;
                    }
                    Err(why) => return Err(bad(format!("'{}': {}", p.key(), why.msg))),
                };
                taken[ai][pi] = true;
                for (m, path) in b.module(p, &modules, &config).map_err(bad)? {
                    paths.entry(m).or_default().push(path);
                }
            }
            report[ai] = b.bound;
            added.push(AddedFile {
                file: a.index.clone(),
                tensors: b.tensors,
            });
        }
        out.push(if paths.is_empty() {
            model.clone()
        } else {
            let names = adapters.iter().map(|a| a.arg.name.clone()).collect();
            model.with_adapters(Adapters { names, paths }, added)?
        });
    }
    for (ai, a) in adapters.iter().enumerate() {
        let bad = |msg: String| Error::Model {
            file: a.index.root.clone(),
            msg,
        };
        for (pi, p) in found[ai].modules.iter().enumerate() {
            if taken[ai][pi] {
                continue;
            }
            if !ignore_unmatched {
                return Err(bad(format!(
                    "'{}': {} (--lora-ignore-unmatched skips such keys)",
                    p.key(),
                    untaken[ai][pi]
                        .as_deref()
                        .unwrap_or("no model of the run takes it")
                )));
            }
            report[ai].unmatched += 1;
        }
        report[ai].dropped = found[ai].dropped.len();
        if report[ai].modules == 0 {
            let roots: Vec<&str> = components.iter().map(|(m, _)| m.root.as_str()).collect();
            return Err(bad(format!(
                "none of its {} modules is a linear of {}",
                found[ai].modules.len(),
                roots.join(", ")
            )));
        }
    }
    Ok((out, report))
}

/// One adapter's tensors being bound to a model.
struct Binder<'a> {
    a: &'a AdapterFile,
    ai: usize,
    model: &'a ModelIndex,
    /// The adapter's tensors the index will hold, renamed (rows cut for fused modules).
    tensors: Vec<TensorEntry>,
    bound: Bound,
    seen: std::collections::BTreeSet<String>,
}

impl Binder<'_> {
    /// The paths of one module of the file over the model's linears `modules` (several where
    /// the file fuses them: each gets the shared down projection and its rows of the up
    /// projection and of the bias delta).
    fn module(
        &mut self,
        p: &Pair,
        modules: &[String],
        config: &LoraConfig,
    ) -> std::result::Result<Vec<(String, LowRank)>, String> {
        let (ai, idx) = (self.ai, &self.a.index);
        let entry = |name: &str| idx.get(name).cloned().ok_or_else(|| format!("no '{name}'"));
        // Shapes as a linear sees them: [rows, the product of the rest] (a Conv3d patch
        // embedding's [out, c, t, h, w] included).
        let flat = |e: &TensorEntry| -> (usize, usize) {
            let rest: u64 = e.shape.iter().skip(1).product();
            (
                e.shape.first().copied().unwrap_or(0) as usize,
                rest as usize,
            )
        };
        let halves = match &p.halves {
            Some((d, u)) => {
                let (down, up) = (entry(d)?, entry(u)?);
                let (rank, inp) = flat(&down);
                let up_rank: u64 = up.shape.iter().skip(1).product();
                if rank == 0 || down.shape.len() < 2 || up.shape.len() < 2 || up_rank != rank as u64
                {
                    return Err(format!(
                        "'{d}' {:?} and '{u}' {:?} are not [rank, in] and [out, rank]",
                        down.shape, up.shape
                    ));
                }
                Some((down, up, rank, inp))
            }
            None => None,
        };
        let bias = match &p.bias {
            Some(name) => {
                let e = entry(name)?;
                if e.shape.len() != 1 {
                    return Err(format!("'{name}' is {:?}, not a bias [out]", e.shape));
                }
                Some(e)
            }
            None => None,
        };
        let full = match &p.full {
            Some(name) => {
                let e = entry(name)?;
                if e.shape.len() < 2 {
                    return Err(format!("'{name}' is {:?}, not a weight [out, in]", e.shape));
                }
                Some(e)
            }
            None => None,
        };
        let out_total = match (&halves, &bias, &full) {
            (Some((_, up, _, _)), ..) => up.shape[0] as usize,
            (None, Some(b), _) => b.shape[0] as usize,
            (None, None, Some(f)) => f.shape[0] as usize,
            (None, None, None) => return Err(format!("'{}' has no pair and no delta", p.key())),
        };
        if let Some(f) = full.as_ref().filter(|f| f.shape[0] as usize != out_total) {
            return Err(format!(
                "'{}' has {} rows, not {out_total}",
                f.name, f.shape[0]
            ));
        }
        if let (Some(b), true) = (&bias, halves.is_some()) {
            if b.shape[0] as usize != out_total {
                return Err(format!(
                    "'{}' has {} values for {out_total} rows",
                    b.name, b.shape[0]
                ));
            }
        }
        let rank = halves.as_ref().map_or(0, |h| h.2);
        let adapter_scale = self.a.arg.scale as f64;
        // kohya and the Wan trainers scale by their `.alpha`, which diffusers folds into the
        // halves (the bias delta keeps the adapter's scale alone); peft by its config, bias
        // included.
        let (scaling, bias_scaling) = match &p.alpha {
            Some(al) => {
                let v = self.a.alphas.get(al).map(Vec::as_slice).unwrap_or(&[]);
                match *v {
                    [x] if x.is_finite() && x > 0.0 && rank > 0 => (x as f64 / rank as f64, 1.0),
                    [_] if rank == 0 => (1.0, 1.0),
                    _ => return Err(format!("'{al}' is {v:?}, not one positive number")),
                }
            }
            None if rank > 0 => {
                let s = config.scaling(&modules[0], rank);
                (s, s)
            }
            None => (1.0, 1.0),
        };
        let down_name = halves.as_ref().map(|(down, ..)| {
            let name = format!("lora{ai}/{}", down.name);
            self.tensors.push(TensorEntry {
                name: name.clone(),
                ..down.clone()
            });
            self.bound.bytes += down.len;
            name
        });
        let mut out = Vec::new();
        let mut row = 0usize;
        for (part, m) in modules.iter().enumerate() {
            if !self.seen.insert(m.clone()) {
                return Err(format!("'{}': a second pair for {m}", p.key()));
            }
            let (rows, w_in) = weight_shape(self.model, m)
                .map_err(|e| format!("'{}' adapts {m}, but {e}", p.key()))?;
            let fits = halves.as_ref().is_none_or(|h| h.3 == w_in)
                && full.as_ref().is_none_or(|f| flat(f).1 == w_in);
            if !fits || row + rows > out_total {
                return Err(format!(
                    "'{}' ({} rows{}) does not fit {m} ([{rows}, {w_in}]{})",
                    p.key(),
                    out_total,
                    halves
                        .as_ref()
                        .map(|h| format!(", rank {}, {} inputs", h.2, h.3))
                        .unwrap_or_default(),
                    if modules.len() > 1 {
                        format!(", part {} of {}", part + 1, modules.len())
                    } else {
                        String::new()
                    }
                ));
            }
            let mut cut = |e: &TensorEntry, per_row: u64| -> String {
                let elem = dtype_bits(e.dtype) / 8;
                let name = if modules.len() == 1 {
                    format!("lora{ai}/{}", e.name)
                } else {
                    format!("lora{ai}/{}[{row}..{}]", e.name, row + rows)
                };
                let len = rows as u64 * per_row * elem;
                let mut shape = vec![rows as u64];
                if per_row > 1 || e.shape.len() > 1 {
                    shape.push(per_row);
                }
                self.tensors.push(TensorEntry {
                    name: name.clone(),
                    shape,
                    offset: e.offset + row as u64 * per_row * elem,
                    len,
                    ..e.clone()
                });
                self.bound.bytes += len;
                name
            };
            let up_name = halves
                .as_ref()
                .map(|(_, up, rank, _)| cut(up, *rank as u64));
            let bias_name = bias.as_ref().map(|b| cut(b, 1));
            let full_name = full.as_ref().map(|f| cut(f, flat(f).1 as u64));
            self.bound.modules += 1;
            out.push((
                m.clone(),
                LowRank {
                    adapter: ai,
                    halves: down_name.clone().zip(up_name),
                    rank,
                    scale: (scaling * adapter_scale) as f32,
                    bias: bias_name.map(|n| (n, (bias_scaling * adapter_scale) as f32)),
                    // ComfyUI's `W + strength · diff`.
                    full: full_name.map(|n| (n, adapter_scale as f32)),
                },
            ));
            row += rows;
        }
        if row != out_total {
            return Err(format!(
                "'{}' has {out_total} rows, the {} it adapts have {row} together",
                p.key(),
                modules.join(", ")
            ));
        }
        Ok(out)
    }
}

/// The scaling settings of an adapter for `target`: peft's `adapter_config.json`, diffusers'
/// `lora_adapter_metadata` (keys prefixed by the component), or none (alpha = rank).
fn config_of(a: &AdapterFile, target: Target<'_>) -> Result<LoraConfig> {
    let bad = |file: String, msg: String| Error::Model { file, msg };
    if let Some(j) = &a.peft_config {
        return LoraConfig::of_json(j, "")
            .map_err(|m| bad(format!("{}/adapter_config.json", a.index.root), m));
    }
    let meta = a
        .index
        .shards
        .first()
        .and_then(|s| s.header.metadata.get("lora_adapter_metadata"));
    match meta {
        Some(text) => {
            let j: serde_json::Value = serde_json::from_str(text).map_err(|e| {
                bad(
                    a.index.root.clone(),
                    format!("lora_adapter_metadata is not JSON: {e}"),
                )
            })?;
            let prefix = target
                .component
                .map(|c| format!("{c}."))
                .unwrap_or_default();
            LoraConfig::of_json(&j, &prefix).map_err(|m| bad(a.index.root.clone(), m))
        }
        None => Ok(LoraConfig::default()),
    }
}

struct Unmatched {
    msg: String,
    other_component: bool,
}

/// The model's linears a module of the file adapts (several where the file fuses them).
fn modules_of(p: &Pair, naming: Naming, target: Target<'_>) -> Result<Vec<String>, Unmatched> {
    let other = |msg: String| Unmatched {
        msg,
        other_component: true,
    };
    let no = |msg: String| Unmatched {
        msg,
        other_component: false,
    };
    let m = p
        .module
        .strip_prefix("base_model.model.")
        .unwrap_or(&p.module);
    if let Some(rest) = target
        .component
        .and_then(|c| m.strip_prefix(&format!("{c}.")))
    {
        return Ok(vec![rest.to_string()]);
    }
    if let Some((prefix, map)) = target.original {
        if let Some(rest) = m.strip_prefix(prefix) {
            return map(rest).ok_or_else(|| {
                no(format!(
                    "'{rest}' (under {prefix}) names no linear of this model"
                ))
            });
        }
    }
    if let Some((prefixes, map)) = target.kohya {
        if let Some(rest) = prefixes.iter().find_map(|p| m.strip_prefix(p)) {
            return map(rest)
                .ok_or_else(|| no(format!("kohya module '{m}' names no linear of this model")));
        }
    }
    if m.starts_with("lora_unet_") || m.starts_with("lora_te") {
        if target.kohya.is_none() && target.component.is_none() {
            return Err(no(
                "kohya's naming, which this model kind does not use".into()
            ));
        }
        return Err(other(format!(
            "kohya module '{m}' is another model's of the pipeline"
        )));
    }
    if let Some(o) = target
        .others
        .iter()
        .find(|o| m.starts_with(&format!("{o}.")))
    {
        return Err(other(format!(
            "a key of the pipeline's {o}, which adapters do not reach"
        )));
    }
    match naming {
        Naming::Peft if target.unprefixed => Ok(vec![m.to_string()]),
        Naming::Peft => Err(other(format!(
            "'{m}' names no component of the pipeline, and is left to its transformer"
        ))),
        Naming::Kohya => Err(no(format!(
            "kohya module '{m}' has no lora_unet_ / lora_te prefix"
        ))),
    }
}

/// `[out, in]` of linear `module`'s weight (4-bit or dense).
fn weight_shape(model: &ModelIndex, module: &str) -> std::result::Result<(usize, usize), String> {
    let name = format!("{module}.weight");
    let shape: Vec<u64> = if let Some(k) = model.q4_key(&name).map_err(|e| e.to_string())? {
        model
            .quant_state_json(k)
            .map_err(|e| e.to_string())?
            .shape
            .to_vec()
    } else {
        match model.get(&name) {
            Some(e) => e.shape.clone(),
            None => return Err(format!("the model has no {name}")),
        }
    };
    // A weight the model computes as a linear over flattened inputs (Wan's Conv3d patch
    // embedding, [out, c, t, h, w]) counts as [out, c * t * h * w].
    match shape[..] {
        [o, ref rest @ ..] if !rest.is_empty() => {
            Ok((o as usize, rest.iter().product::<u64>() as usize))
        }
        _ => Err(format!("{name} is {shape:?}, not a linear's [out, in]")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_carry_a_name_a_path_and_a_scale() {
        let a = AdapterArg::parse("some/dir/style.safetensors:0.6").expect("parse");
        assert_eq!(
            (a.source.as_str(), a.scale, a.name.as_str()),
            ("some/dir/style.safetensors", 0.6, "style")
        );
        let a = AdapterArg::parse("pet=https://host:8080/loras/pet/").expect("url");
        assert_eq!(
            (a.source.as_str(), a.scale, a.name.as_str()),
            ("https://host:8080/loras/pet/", 1.0, "pet")
        );
        let a = AdapterArg::parse("https://host:8080/a.safetensors:-1.5").expect("url scale");
        assert_eq!(
            (a.source.as_str(), a.scale),
            ("https://host:8080/a.safetensors", -1.5)
        );
        let a = AdapterArg::parse("http://host:8000").expect("a port, no path");
        assert_eq!((a.source.as_str(), a.scale), ("http://host:8000", 1.0));
        let a = AdapterArg::parse("http://host:8000:0.5").expect("a port and a scale");
        assert_eq!((a.source.as_str(), a.scale), ("http://host:8000", 0.5));
        for bad in ["x:abc", "x:inf", ":0.5", ""] {
            assert!(AdapterArg::parse(bad).is_err(), "{bad}");
        }
    }
}
