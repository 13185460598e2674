//! A model's tensors by name, with their files and byte ranges ([`ModelIndex`]), and the one
//! routine that opens a model ([`open_model`]) from any [`ModelFolder`]: a local directory or
//! file, an HTTP base URL or file URL, the browser's fetch. Every range is validated against the
//! file length before anything reads it (DESIGN.md invariant 3); every quant-state JSON is read
//! once, when the model opens.

use std::collections::{BTreeMap, HashMap};
#[cfg(feature = "native")]
use std::fs::File;
#[cfg(feature = "native")]
use std::io::Read;
#[cfg(feature = "native")]
use std::path::Path;
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};
use crate::format::bnb::{
    find_4bit_weights, Bnb4bitKeys, QuantState, QuantStateJson, QuantStateParts, RawTensor,
};
use crate::format::dtype::dtype_name;
use crate::format::safetensors::{SafetensorsHeader, TensorEntry};
use crate::io::folder::{check_name, ModelFolder, OpenedFile, SIDE_FILE_LIMIT};
use crate::io::source::{ChainSource, RangeSource};

/// Opens a local file and parses its safetensors header (reads only the first 8 + N bytes).
#[cfg(feature = "native")]
pub fn read_header(path: &Path) -> Result<SafetensorsHeader> {
    let name = path.display().to_string();
    let mut f = File::open(path).map_err(|e| Error::io(&name, e))?;
    let file_len = f.metadata().map_err(|e| Error::io(&name, e))?.len();
    let mut first8 = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        match f
            .read(&mut first8[got..])
            .map_err(|e| Error::io(&name, e))?
        {
            0 => break,
            k => got += k,
        }
    }
    let header_len = SafetensorsHeader::parse_header_len(&name, &first8[..got], file_len)?;
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).map_err(|e| Error::io(&name, e))?;
    SafetensorsHeader::parse(&name, &header, file_len)
}

/// One file of a model.
#[derive(Debug, Clone)]
pub struct Shard {
    /// File name within the model folder (or the file's own name).
    pub name: String,
    /// Its parsed header.
    pub header: SafetensorsHeader,
}

/// A model: one safetensors file, or a folder (local or URL) with `config.json` and one file or
/// shards. Reads go through the model's [`RangeSource`]; side files through its folder.
#[derive(Clone)]
pub struct ModelIndex {
    /// The path or URL the user gave.
    pub root: String,
    /// The files, in index order (the same order as the source's files).
    pub shards: Vec<Shard>,
    /// `config.json`, when the model is a folder that has one.
    pub config: Option<serde_json::Value>,
    by_name: HashMap<String, (usize, usize)>,
    source: Arc<dyn RangeSource>,
    /// The 4-bit weights' keys and, per base name, the index into them (found once, on first
    /// use: a malformed checkpoint still opens, and says what is wrong when its weights are
    /// asked for).
    q4: OnceLock<(Vec<Bnb4bitKeys>, HashMap<String, usize>)>,
    /// The folder the model was opened from (side files are read through it).
    folder: Option<Arc<dyn ModelFolder>>,
    /// The bytes of every quant-state JSON tensor, read together the first time one is needed
    /// (shared by clones of the index).
    quant_json: Arc<OnceLock<HashMap<String, Vec<u8>>>>,
    /// The LoRA adapters bound to the model ([`ModelIndex::with_adapters`]).
    adapters: Arc<Adapters>,
}

/// LoRA adapters bound to a model: per adapted module, its low-rank paths, whose tensors the
/// model's index holds under names of their own.
#[derive(Debug, Clone, Default)]
pub struct Adapters {
    /// The adapters' labels, in the order given.
    pub names: Vec<String>,
    /// Per module (its weight's name without `.weight`): its paths, in adapter order.
    pub paths: BTreeMap<String, Vec<LowRank>>,
}

impl Adapters {
    /// The largest rank of adapter `a`'s paths (0 where it has none: bias deltas only).
    pub fn max_rank(&self, a: usize) -> usize {
        self.paths
            .values()
            .flatten()
            .filter(|p| p.adapter == a)
            .map(|p| p.rank)
            .max()
            .unwrap_or(0)
    }
}

/// One adapter's path beside a linear:
/// `y += scale * up(down(x)) + bias_scale * bias + full_scale * x · fullᵀ`.
#[derive(Debug, Clone, PartialEq)]
pub struct LowRank {
    /// The adapter, an index into [`Adapters::names`].
    pub adapter: usize,
    /// The down projection `[rank, in]` and the up projection `[out, rank]`, by their names in
    /// the index (`None`: a bias delta only).
    pub halves: Option<(String, String)>,
    /// The rank (0 without halves).
    pub rank: usize,
    /// The scaling of the pair (peft's `scaling` times the adapter's scale).
    pub scale: f32,
    /// A bias delta `[out]` by its name in the index, and its scale.
    pub bias: Option<(String, f32)>,
    /// A full-weight delta `[out, in]` by its name in the index, and its scale.
    pub full: Option<(String, f32)>,
}

/// An adapter file's tensors as a model's index will hold them: `(name in the index, the
/// tensor's bytes in `file`)`, a tensor's rows possibly cut down to a range of them.
#[derive(Debug, Clone)]
pub struct AddedFile {
    /// The adapter file, opened.
    pub file: ModelIndex,
    /// The tensors it lends, renamed (their `shard` counts within `file`).
    pub tensors: Vec<TensorEntry>,
}

impl std::fmt::Debug for ModelIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelIndex")
            .field("root", &self.root)
            .field("shards", &self.shards.len())
            .finish()
    }
}

/// Index files nibble recognises for sharded models, in the order they are tried.
pub const SHARD_INDEX_NAMES: [&str; 2] = [
    "model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors.index.json",
];
/// Single-file names nibble recognises in a model folder, in the order they are tried
/// (diffusers' first when `config.json` names a diffusers class).
pub const SINGLE_FILE_NAMES: [&str; 2] =
    ["model.safetensors", "diffusion_pytorch_model.safetensors"];

/// The largest quant-state JSON nibble reads (one is a few hundred bytes).
const QUANT_STATE_JSON_LIMIT: u64 = 64 << 10;

/// The most one quant-state read fetches (adjacent small tensors are read together).
const MAX_RUN: u64 = 16 << 20;

/// The shard files named by an index JSON's `weight_map`, sorted; checks every entry names a
/// plain file next to the index (after percent-decoding too).
pub fn shard_files_of_index(
    index_name: &str,
    index_json: &serde_json::Value,
) -> Result<Vec<String>> {
    let bad = |msg: String| Error::Model {
        file: index_name.to_string(),
        msg,
    };
    let weight_map = index_json
        .get("weight_map")
        .and_then(|w| w.as_object())
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let mut files: Vec<String> = Vec::new();
    for (tensor, f) in weight_map {
        let f = f
            .as_str()
            .ok_or_else(|| bad(format!("weight_map entry '{tensor}' is not a string")))?;
        if f.contains('/') || f.starts_with('.') || check_name(f).is_err() {
            return Err(bad(format!(
                "weight_map entry '{tensor}' names '{f}', not a file in the folder"
            )));
        }
        if !files.iter().any(|x| x == f) {
            files.push(f.to_string());
        }
    }
    files.sort();
    Ok(files)
}

/// A side file's JSON (`config.json`, a shard index), `None` when the file is absent; invalid
/// JSON is an error naming the file.
pub fn side_json(bytes: Option<Vec<u8>>, name: &str) -> Result<Option<serde_json::Value>> {
    bytes
        .map(|b| serde_json::from_slice(&b))
        .transpose()
        .map_err(|e| Error::Model {
            file: name.to_string(),
            msg: format!("invalid JSON: {e}"),
        })
}

/// Opens the model in `folder`: the file `file` when given (a `.safetensors` the user named),
/// else the folder's `config.json` and its shards (by an index JSON), its single weights file
/// (one of [`SINGLE_FILE_NAMES`]) or, where the folder can be listed, its only `*.safetensors`.
/// Reads `config.json` and the index if any, and 8 + N header bytes per file; no tensor byte
/// (the quant-state JSONs come later, all together: [`ModelIndex::load_quant_states`]).
pub async fn open_model(folder: Arc<dyn ModelFolder>, file: Option<&str>) -> Result<ModelIndex> {
    let root = folder.root().to_string();
    let mut config = None;
    let mut index = None;
    let mut opened: Vec<(String, OpenedFile)> = Vec::new();
    if let Some(name) = file {
        let f = folder
            .open_file(name)
            .await?
            .ok_or_else(|| folder.missing(name))?;
        opened.push((name.to_string(), f));
    } else {
        config = side_json(
            folder.read_small("config.json", SIDE_FILE_LIMIT).await?,
            &folder.locate("config.json"),
        )?;
        for idx in SHARD_INDEX_NAMES {
            let shown = folder.locate(idx);
            if let Some(j) = side_json(folder.read_small(idx, SIDE_FILE_LIMIT).await?, &shown)? {
                for name in shard_files_of_index(&shown, &j)? {
                    let f = folder.open_file(&name).await?.ok_or_else(|| Error::Model {
                        file: shown.clone(),
                        msg: format!("names {name}: {}", folder.missing(&name)),
                    })?;
                    opened.push((name, f));
                }
                index = Some((shown, j));
                break;
            }
        }
        if index.is_none() {
            let mut names = SINGLE_FILE_NAMES.to_vec();
            if config
                .as_ref()
                .is_some_and(|c| c.get("_class_name").is_some())
            {
                names.reverse();
            }
            for name in names {
                // Only absence moves on to the next name: any other failure is the answer.
                if let Some(f) = folder.open_file(name).await? {
                    opened.push((name.to_string(), f));
                    break;
                }
            }
        }
        if opened.is_empty() {
            let listed = folder.list_safetensors()?;
            match listed.as_deref() {
                Some([one]) => {
                    let f = folder.open_file(one).await?.ok_or_else(|| Error::Model {
                        file: folder.locate(one),
                        msg: "vanished while the folder was opened".into(),
                    })?;
                    opened.push((one.clone(), f));
                }
                _ => {
                    return Err(Error::Model {
                        file: root,
                        msg: format!(
                            "no model found: expected one of {}, {} or a single *.safetensors \
                             file{}",
                            SHARD_INDEX_NAMES.join(", "),
                            SINGLE_FILE_NAMES.join(", "),
                            match listed {
                                Some(l) => format!(" ({} found)", l.len()),
                                None => format!(" ({})", folder.missing(SINGLE_FILE_NAMES[0])),
                            }
                        ),
                    })
                }
            }
        }
    }
    index_of(folder, opened, config, index).await
}

/// The first of `names` that `folder` holds, opened as a one-file model (each file is opened
/// once, so the index's files are the source's); `None` where it holds none of them.
pub async fn open_first(
    folder: Arc<dyn ModelFolder>,
    names: &[&str],
) -> Result<Option<ModelIndex>> {
    for name in names {
        if let Some(f) = folder.open_file(name).await? {
            let opened = vec![(name.to_string(), f)];
            return index_of(folder, opened, None, None).await.map(Some);
        }
    }
    Ok(None)
}

/// The index of the files `opened` in `folder` (their headers read now).
async fn index_of(
    folder: Arc<dyn ModelFolder>,
    opened: Vec<(String, OpenedFile)>,
    config: Option<serde_json::Value>,
    index: Option<(String, serde_json::Value)>,
) -> Result<ModelIndex> {
    let root = folder.root().to_string();
    let mut shards = Vec::with_capacity(opened.len());
    for (name, f) in opened {
        let shown = folder.locate(&name);
        let header_len = SafetensorsHeader::parse_header_len(&shown, &f.head, f.len)?;
        let json = folder.read_at(f.index, 8, header_len, "<header>").await?;
        let header = SafetensorsHeader::parse(&shown, &json, f.len)?;
        shards.push(Shard { name, header });
    }
    let source = folder.source()?;
    let mut model = ModelIndex::from_parts(
        root,
        shards,
        config,
        source,
        index.as_ref().map(|(n, j)| (n.as_str(), j)),
    )?;
    model.folder = Some(folder);
    Ok(model)
}

impl ModelIndex {
    /// Builds an index from parsed headers and the source their bytes come from; checks a shard
    /// index's `weight_map` against the shards when given.
    pub fn from_parts(
        root: String,
        shards: Vec<Shard>,
        config: Option<serde_json::Value>,
        source: Arc<dyn RangeSource>,
        index_json: Option<(&str, &serde_json::Value)>,
    ) -> Result<Self> {
        let mut shards = shards;
        let mut by_name = HashMap::new();
        for (si, shard) in shards.iter_mut().enumerate() {
            for (ti, t) in shard.header.tensors.iter_mut().enumerate() {
                t.shard = si;
                if let Some((prev, _)) = by_name.insert(t.name.clone(), (si, ti)) {
                    return Err(Error::Model {
                        file: root.clone(),
                        msg: format!(
                            "tensor '{}' is in both shard #{prev} and {}",
                            t.name, shard.header.file
                        ),
                    });
                }
            }
        }
        let me = ModelIndex {
            root,
            shards,
            config,
            by_name,
            source,
            q4: OnceLock::new(),
            folder: None,
            quant_json: Arc::new(OnceLock::new()),
            adapters: Arc::new(Adapters::default()),
        };
        if let Some((idx_name, json)) = index_json {
            let bad = |msg: String| Error::Model {
                file: idx_name.to_string(),
                msg,
            };
            let wm = json
                .get("weight_map")
                .and_then(|w| w.as_object())
                .ok_or_else(|| bad("no weight_map".into()))?;
            for (tensor, f) in wm {
                let f = f.as_str().unwrap_or("?");
                let Some(&(si, _)) = me.by_name.get(tensor) else {
                    return Err(bad(format!(
                        "weight_map lists '{tensor}' in {f}, but no shard holds it"
                    )));
                };
                if me.shards[si].name != f {
                    return Err(bad(format!(
                        "weight_map puts '{tensor}' in {f}, but it is in {}",
                        me.shards[si].name
                    )));
                }
            }
        }
        Ok(me)
    }

    /// Opens a local `.safetensors` file or model folder and validates every header.
    #[cfg(feature = "native")]
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, Default::default())
    }

    /// [`ModelIndex::open`], reading the files with `mode` (page cache, dropped cache, O_DIRECT,
    /// mmap).
    #[cfg(feature = "native")]
    pub fn open_with(path: &Path, mode: crate::io::file::FileReadMode) -> Result<Self> {
        use crate::io::file::LocalFolder;
        let shown = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(&shown, e))?;
        let (folder, file) = if meta.is_dir() {
            (LocalFolder::new(path, mode)?, None)
        } else {
            let (f, name) = LocalFolder::of_file(path, mode)?;
            (f, Some(name))
        };
        let mut m = crate::io::folder::block_on(open_model(Arc::new(folder), file.as_deref()))?;
        m.root = shown;
        Ok(m)
    }

    /// Opens a model over HTTP(S): a `.safetensors` URL, or a folder URL holding `config.json`
    /// and `model.safetensors` / `diffusion_pytorch_model.safetensors` or shards with their
    /// index.
    #[cfg(feature = "native")]
    pub fn open_url(url: &str, opts: crate::io::http::HttpOptions) -> Result<Self> {
        use crate::io::http::HttpFolder;
        let url = url.trim_end_matches('/');
        let (base, file) = match url.rsplit_once('/') {
            Some((dir, name)) if name.ends_with(".safetensors") => (dir, Some(name)),
            _ => (url, None),
        };
        let folder = Arc::new(HttpFolder::new(base, opts));
        let mut m = crate::io::folder::block_on(open_model(folder, file))?;
        m.root = url.to_string();
        Ok(m)
    }

    /// Opens a model by local path (read with `mode`) or http(s) URL.
    #[cfg(feature = "native")]
    pub fn open_path_or_url(arg: &str, mode: crate::io::file::FileReadMode) -> Result<Self> {
        if arg.starts_with("http://") || arg.starts_with("https://") {
            Self::open_url(arg, Default::default())
        } else {
            Self::open_with(Path::new(arg), mode)
        }
    }

    /// A small file of the model's folder (`tokenizer.json`, `generation_config.json`,
    /// `1_Pooling/config.json`, ...), `None` when there is none. `name` comes from the model's
    /// files and must stay inside its folder.
    pub async fn read_side(&self, name: &str) -> Result<Option<Vec<u8>>> {
        check_name(name)?;
        match &self.folder {
            Some(f) => f.read_small(name, SIDE_FILE_LIMIT).await,
            None => Ok(None),
        }
    }

    /// [`ModelIndex::read_side`], natively.
    #[cfg(feature = "native")]
    pub fn side_file(&self, name: &str) -> Result<Option<Vec<u8>>> {
        crate::io::folder::block_on(self.read_side(name))
    }

    /// The full path or URL of `name` in the model's folder, for messages.
    pub fn locate(&self, name: &str) -> String {
        match &self.folder {
            Some(f) => f.locate(name),
            None => format!("{}/{name}", self.root.trim_end_matches('/')),
        }
    }

    /// Every bitsandbytes 4-bit weight of the model, in file order (found on first use).
    pub fn q4_weights(&self) -> Result<&[Bnb4bitKeys]> {
        if let Some((keys, _)) = self.q4.get() {
            return Ok(keys);
        }
        let tensors: Vec<&TensorEntry> = self.tensors().collect();
        let keys = find_4bit_weights(&tensors, |s| self.shard_name(s).to_string())?;
        let by_base = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.base.clone(), i))
            .collect();
        Ok(&self.q4.get_or_init(|| (keys, by_base)).0)
    }

    /// The keys of `base` (e.g. `model.layers.0.mlp.up_proj.weight`) when it is a 4-bit
    /// weight, `None` when it is not.
    pub fn q4_key(&self, base: &str) -> Result<Option<&Bnb4bitKeys>> {
        self.q4_weights()?;
        let (keys, by_base) = self
            .q4
            .get()
            .ok_or_else(|| Error::Invalid("4-bit keys".into()))?;
        Ok(by_base.get(base).map(|&i| &keys[i]))
    }

    /// The keys of the 4-bit weight `base`; an error naming it when there is none.
    pub fn q4_keys(&self, base: &str) -> Result<&Bnb4bitKeys> {
        self.q4_key(base)?.ok_or_else(|| Error::NoSuchTensor {
            file: self.root.clone(),
            tensor: base.to_string(),
        })
    }

    /// Reads every quant-state JSON of the model's 4-bit weights, once, in runs of adjacent
    /// tensors (one read per run, through the folder: in the browser this is the only way).
    /// Graph builders and the planner use them; natively the first of them loads them itself.
    pub async fn load_quant_states(&self) -> Result<()> {
        if self.quant_json.get().is_some() {
            return Ok(());
        }
        // A model whose 4-bit keys are malformed gets none: its weights say what is wrong when
        // they are used.
        let Ok(keys) = self.q4_weights() else {
            let _ = self.quant_json.set(HashMap::new());
            return Ok(());
        };
        // One that is too large to be a quant-state JSON is left out: reading it alone says so.
        let mut wanted: Vec<&TensorEntry> = keys
            .iter()
            .filter_map(|k| self.get(&k.quant_state))
            .filter(|e| e.len <= QUANT_STATE_JSON_LIMIT)
            .collect();
        wanted.sort_by_key(|e| (e.shard, e.offset));
        let mut runs: Vec<Vec<&TensorEntry>> = Vec::new();
        for e in wanted {
            match runs.last_mut() {
                Some(run)
                    if run[0].shard == e.shard
                        && run.last().is_some_and(|l| l.end() == e.offset)
                        && e.end() - run[0].offset <= MAX_RUN =>
                {
                    run.push(e)
                }
                _ => runs.push(vec![e]),
            }
        }
        let mut out = HashMap::new();
        for run in runs {
            let (start, end) = (run[0].offset, run[run.len() - 1].end());
            let bytes = match &self.folder {
                Some(f) => {
                    f.read_at(run[0].shard, start, end - start, "<quant states>")
                        .await?
                }
                None => {
                    let mut b = vec![0u8; (end - start) as usize];
                    self.source
                        .read_exact_at(run[0].shard, start, &mut b, "<quant states>")?;
                    b
                }
            };
            for e in run {
                let at = (e.offset - start) as usize;
                out.insert(e.name.clone(), bytes[at..at + e.len as usize].to_vec());
            }
        }
        let _ = self.quant_json.set(out);
        Ok(())
    }

    /// The quant-state JSONs, loaded natively on first use; in the browser
    /// [`ModelIndex::load_quant_states`] must have run.
    fn quant_jsons(&self) -> Result<&HashMap<String, Vec<u8>>> {
        #[cfg(feature = "native")]
        if self.quant_json.get().is_none() {
            crate::io::folder::block_on(self.load_quant_states())?;
        }
        self.quant_json.get().ok_or_else(|| {
            Error::Invalid(format!(
                "{}: the quant states were not loaded (ModelIndex::load_quant_states)",
                self.root
            ))
        })
    }

    /// The quant state JSON of a 4-bit weight, checked against its key and against the header
    /// entries of its components (dtypes, element counts, packed bytes), without reading them.
    pub fn quant_state_json(&self, keys: &Bnb4bitKeys) -> Result<QuantStateJson> {
        let e = self.require(&keys.quant_state)?;
        if e.len > QUANT_STATE_JSON_LIMIT {
            return Err(Error::Model {
                file: self.shard_name(e.shard).to_string(),
                msg: format!(
                    "{}: {} bytes, larger than any quant-state JSON ({QUANT_STATE_JSON_LIMIT})",
                    e.name, e.len
                ),
            });
        }
        let bytes = match self.quant_jsons()?.get(&keys.quant_state) {
            Some(b) => b.clone(),
            None => self.read_bytes(e)?,
        };
        let packed = self.require(&keys.base)?;
        let file = self.shard_name(packed.shard).to_string();
        let entry = |n: &Option<String>| n.as_deref().map(|n| self.require(n)).transpose();
        QuantStateJson::check_entries(
            &file,
            &keys.base,
            keys.quant_type,
            &bytes,
            packed,
            self.require(&keys.absmax)?,
            self.require(&keys.quant_map)?,
            entry(&keys.nested_absmax)?,
            entry(&keys.nested_quant_map)?,
        )
    }

    /// Reads and validates the quant state of one weight (the small tensors only; the packed
    /// data is checked against the index, not read).
    pub fn quant_state(&self, keys: &Bnb4bitKeys) -> Result<QuantState> {
        // The components' header entries are checked against the JSON before any is read: a
        // component declared larger than the weight needs is refused, not allocated.
        self.quant_state_json(keys)?;
        let read = |name: &str| -> Result<(Vec<u8>, &TensorEntry)> {
            let e = self.require(name)?;
            Ok((self.read_bytes(e)?, e))
        };
        let json = (
            match self.quant_jsons()?.get(&keys.quant_state) {
                Some(b) => b.clone(),
                None => self.read_bytes(self.require(&keys.quant_state)?)?,
            },
            self.require(&keys.quant_state)?,
        );
        let absmax = read(&keys.absmax)?;
        let qmap = read(&keys.quant_map)?;
        let nested_a = keys.nested_absmax.as_deref().map(read).transpose()?;
        let nested_q = keys.nested_quant_map.as_deref().map(read).transpose()?;
        let packed = self.require(&keys.base)?;
        let file = self.shard_name(packed.shard).to_string();
        let parts = QuantStateParts {
            key_quant_type: keys.quant_type,
            json: &json.0,
            absmax: raw(&absmax),
            quant_map: raw(&qmap),
            nested_absmax: nested_a.as_ref().map(raw),
            nested_quant_map: nested_q.as_ref().map(raw),
        };
        let state = QuantState::from_parts(&file, &keys.base, &parts)?;
        state.check_packed(&file, &keys.base, packed)?;
        Ok(state)
    }

    /// The source this model's bytes are read from.
    pub fn source(&self) -> Arc<dyn RangeSource> {
        self.source.clone()
    }

    /// This model with `adapters` bound to it: the index holds each added file's tensors under
    /// their new names too (read through one source that chains the files), and
    /// [`ModelIndex::low_rank`] gives each adapted module's paths. Binds once: all of a run's
    /// adapters together.
    pub fn with_adapters(&self, adapters: Adapters, added: Vec<AddedFile>) -> Result<ModelIndex> {
        if !self.adapters.names.is_empty() {
            return Err(Error::Invalid(format!(
                "{}: adapters are bound already ({}); bind all of a run's adapters at once",
                self.root,
                self.adapters.names.join(", ")
            )));
        }
        let base = self;
        // The chain numbers files part by part: each part's files must be its shards.
        let files_are_shards = |m: &ModelIndex| -> Result<()> {
            if m.source.files().len() == m.shards.len() {
                return Ok(());
            }
            Err(Error::Invalid(format!(
                "{}: {} files read for {} shards",
                m.root,
                m.source.files().len(),
                m.shards.len()
            )))
        };
        files_are_shards(base)?;
        let mut shards = base.shards.clone();
        let mut sources = vec![base.source.clone()];
        for a in added {
            let first = shards.len();
            files_are_shards(&a.file)?;
            for (si, sh) in a.file.shards.iter().enumerate() {
                let mut header = sh.header.clone();
                header.tensors = a
                    .tensors
                    .iter()
                    .filter(|t| t.shard == si)
                    .map(|t| TensorEntry {
                        shard: first + si,
                        ..t.clone()
                    })
                    .collect();
                shards.push(Shard {
                    name: sh.name.clone(),
                    header,
                });
            }
            sources.push(a.file.source.clone());
        }
        let source: Arc<dyn RangeSource> = Arc::new(ChainSource::new(sources));
        let mut m =
            ModelIndex::from_parts(base.root.clone(), shards, base.config.clone(), source, None)?;
        m.folder = base.folder.clone();
        m.quant_json = base.quant_json.clone();
        m.adapters = Arc::new(adapters);
        Ok(m)
    }

    /// The adapters bound to the model.
    pub fn adapters(&self) -> &Adapters {
        &self.adapters
    }

    /// The low-rank paths beside linear `module` (its weight's name without `.weight`).
    pub fn low_rank(&self, module: &str) -> &[LowRank] {
        self.adapters
            .paths
            .get(module)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// Looks a tensor up by name.
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.by_name
            .get(name)
            .map(|&(s, t)| &self.shards[s].header.tensors[t])
    }

    /// Looks a tensor up by name, or fails naming the model.
    pub fn require(&self, name: &str) -> Result<&TensorEntry> {
        self.get(name).ok_or_else(|| Error::NoSuchTensor {
            file: self.root.clone(),
            tensor: name.to_string(),
        })
    }

    /// All tensors, shard by shard, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorEntry> {
        self.shards.iter().flat_map(|s| s.header.tensors.iter())
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// True when the model holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Total bytes of all shards.
    pub fn file_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.header.file_len).sum()
    }

    /// The file name (path or URL) of a shard, for messages.
    pub fn shard_name(&self, shard: usize) -> &str {
        &self.shards[shard].header.file
    }

    /// Reads a tensor's bytes, checking that the whole range arrived.
    pub fn read_bytes(&self, entry: &TensorEntry) -> Result<Vec<u8>> {
        let len = usize::try_from(entry.len).map_err(|_| Error::ShapeOverflow {
            file: self.shard_name(entry.shard).to_string(),
            tensor: entry.name.clone(),
            shape: entry.shape.clone(),
        })?;
        crate::io::machine::check_alloc(
            entry.len,
            &format!("reading {} of {}", entry.name, self.shard_name(entry.shard)),
        )?;
        let mut buf = vec![0u8; len];
        self.source
            .read_exact_at(entry.shard, entry.offset, &mut buf, &entry.name)?;
        Ok(buf)
    }

    /// Reads a tensor of any float dtype (F32, F16, BF16, F64) and widens it to f32.
    pub fn read_f32(&self, entry: &TensorEntry) -> Result<Vec<f32>> {
        let bytes = self.read_bytes(entry)?;
        crate::format::dtype::bytes_to_f32(&bytes, entry.dtype).ok_or_else(|| Error::WrongDtype {
            file: self.shard_name(entry.shard).to_string(),
            tensor: entry.name.clone(),
            expected: "F32, F16, BF16 or F64".into(),
            actual: dtype_name(entry.dtype),
        })
    }
}

fn raw<'a>((bytes, e): &'a (Vec<u8>, &TensorEntry)) -> RawTensor<'a> {
    RawTensor {
        dtype: e.dtype,
        numel: e.numel(),
        bytes,
    }
}
