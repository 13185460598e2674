//! safetensors headers and model folders as an index: tensor name -> dtype, shape, file and
//! absolute byte range. Every range is validated against the file length before anything reads
//! it (DESIGN.md invariant 3).

use std::collections::HashMap;
#[cfg(feature = "native")]
use std::fs::File;
#[cfg(feature = "native")]
use std::io::Read;
#[cfg(feature = "native")]
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};
use crate::format::bnb::{
    find_4bit_weights, Bnb4bitKeys, QuantState, QuantStateJson, QuantStateParts, RawTensor,
};
use crate::format::dtype::dtype_name;
use crate::format::safetensors::{SafetensorsHeader, TensorEntry};
use crate::io::source::RangeSource;

/// Opens a local file and parses its safetensors header (reads only the first 8 + N bytes).
#[cfg(feature = "native")]
pub fn read_header(path: &Path) -> Result<SafetensorsHeader> {
    let name = path.display().to_string();
    let mut f = File::open(path).map_err(|e| Error::io(&name, e))?;
    let file_len = f.metadata().map_err(|e| Error::io(&name, e))?.len();
    let mut first8 = [0u8; 8];
    let got = read_up_to(&mut f, &mut first8).map_err(|e| Error::io(&name, e))?;
    let header_len = SafetensorsHeader::parse_header_len(&name, &first8[..got], file_len)?;
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).map_err(|e| Error::io(&name, e))?;
    SafetensorsHeader::parse(&name, &header, file_len)
}

#[cfg(feature = "native")]
fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
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
/// shards. Reads go through the model's [`RangeSource`].
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
/// Single-file names nibble recognises in a model folder.
pub const SINGLE_FILE_NAMES: [&str; 2] =
    ["model.safetensors", "diffusion_pytorch_model.safetensors"];

/// The shard files named by an index JSON's `weight_map`, sorted; checks every entry names a
/// plain file of the folder.
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
        if f.contains('/') || f.contains('\\') || f.starts_with('.') || f.is_empty() {
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

    /// A small file beside the weights (`tokenizer.json`, `generation_config.json`, ...), read
    /// from the model's folder or fetched from its URL; `Ok(None)` when there is none.
    #[cfg(feature = "native")]
    pub fn side_file(&self, name: &str) -> Result<Option<Vec<u8>>> {
        const LIMIT: u64 = 64 << 20;
        let root = self.root.trim_end_matches('/');
        if root.starts_with("http://") || root.starts_with("https://") {
            let dir = if root.ends_with(".safetensors") {
                root.rsplit_once('/').map(|(d, _)| d).unwrap_or(root)
            } else {
                root
            };
            let http = crate::io::http::HttpSource::new(Default::default());
            return http.get_small(&format!("{dir}/{name}"), LIMIT);
        }
        let p = Path::new(root);
        let dir = if p.is_dir() {
            p
        } else {
            p.parent().unwrap_or(Path::new("."))
        };
        let path = dir.join(name);
        match std::fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(path.display().to_string(), e)),
        }
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
        let disp = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(&disp, e))?;
        let single = |p: PathBuf, config| -> Result<Self> {
            let header = read_header(&p)?;
            let name = p
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("")
                .to_string();
            let source = crate::io::file::FileSource::open(&[p], mode)?;
            Self::from_parts(
                disp.clone(),
                vec![Shard { name, header }],
                config,
                Arc::new(source),
                None,
            )
        };
        if meta.is_file() {
            return single(path.to_path_buf(), None);
        }
        let config = read_json_if_exists(&path.join("config.json"))?;
        for idx_name in SHARD_INDEX_NAMES {
            let idx_path = path.join(idx_name);
            if let Some(index_json) = read_json_if_exists(&idx_path)? {
                let idx_disp = idx_path.display().to_string();
                let files = shard_files_of_index(&idx_disp, &index_json)?;
                let mut shards = Vec::with_capacity(files.len());
                let mut paths = Vec::with_capacity(files.len());
                for f in files {
                    let p = path.join(&f);
                    shards.push(Shard {
                        name: f,
                        header: read_header(&p)?,
                    });
                    paths.push(p);
                }
                let source = crate::io::file::FileSource::open(&paths, mode)?;
                return Self::from_parts(
                    disp,
                    shards,
                    config,
                    Arc::new(source),
                    Some((&idx_disp, &index_json)),
                );
            }
        }
        for name in SINGLE_FILE_NAMES {
            let p = path.join(name);
            if p.is_file() {
                return single(p, config);
            }
        }
        let mut found: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| Error::io(&disp, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        found.sort();
        if found.len() == 1 {
            return single(found.remove(0), config);
        }
        Err(Error::Model {
            file: disp,
            msg: format!(
                "no model found: expected one of {}, {} or a single *.safetensors file ({} found)",
                SHARD_INDEX_NAMES.join(", "),
                SINGLE_FILE_NAMES.join(", "),
                found.len()
            ),
        })
    }

    /// Opens a model over HTTP(S): a `.safetensors` URL, or a folder URL holding `config.json`
    /// and `model.safetensors` / `diffusion_pytorch_model.safetensors` or shards with their
    /// index. Fetches only `config.json`, the index JSON and each file's 8 + N header bytes.
    #[cfg(feature = "native")]
    pub fn open_url(url: &str, opts: crate::io::http::HttpOptions) -> Result<Self> {
        use crate::io::http::HttpSource;
        const SMALL: u64 = 64 << 20;
        let mut http = HttpSource::new(opts);
        let url = url.trim_end_matches('/');
        let single = |mut http: HttpSource, file_url: &str, config| -> Result<Self> {
            let (_, header) = http.open_file(file_url)?;
            let name = file_url.rsplit('/').next().unwrap_or("").to_string();
            Self::from_parts(
                url.to_string(),
                vec![Shard { name, header }],
                config,
                Arc::new(http),
                None,
            )
        };
        if url.ends_with(".safetensors") {
            return single(http, url, None);
        }
        let json = side_json;
        let config_url = format!("{url}/config.json");
        let config = json(http.get_small(&config_url, SMALL)?, &config_url)?;
        for idx_name in SHARD_INDEX_NAMES {
            let idx_url = format!("{url}/{idx_name}");
            if let Some(index_json) = json(http.get_small(&idx_url, SMALL)?, &idx_url)? {
                let files = shard_files_of_index(&idx_url, &index_json)?;
                let mut shards = Vec::with_capacity(files.len());
                for f in files {
                    let (_, header) = http.open_file(&format!("{url}/{f}"))?;
                    shards.push(Shard { name: f, header });
                }
                return Self::from_parts(
                    url.to_string(),
                    shards,
                    config,
                    Arc::new(http),
                    Some((&idx_url, &index_json)),
                );
            }
        }
        let mut last_err = None;
        for name in SINGLE_FILE_NAMES {
            match http.open_file(&format!("{url}/{name}")) {
                Ok((_, header)) => {
                    let shard = Shard {
                        name: name.to_string(),
                        header,
                    };
                    return Self::from_parts(
                        url.to_string(),
                        vec![shard],
                        config,
                        Arc::new(http),
                        None,
                    );
                }
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| Error::Model {
            file: url.to_string(),
            msg: "no model found".into(),
        }))
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

    /// The quant state JSON of a 4-bit weight, checked against its key and against the header
    /// entries of its components (dtypes, element counts, packed bytes), without reading them.
    pub fn quant_state_json(&self, keys: &Bnb4bitKeys) -> Result<QuantStateJson> {
        let e = self.require(&keys.quant_state)?;
        let bytes = self.read_bytes(e)?;
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
        let read = |name: &str| -> Result<(Vec<u8>, &TensorEntry)> {
            let e = self.require(name)?;
            Ok((self.read_bytes(e)?, e))
        };
        let json = read(&keys.quant_state)?;
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

#[cfg(feature = "native")]
fn read_json_if_exists(path: &Path) -> Result<Option<serde_json::Value>> {
    let disp = path.display().to_string();
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::Model {
                file: disp,
                msg: format!("invalid JSON: {e}"),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(disp, e)),
    }
}

fn raw<'a>((bytes, e): &'a (Vec<u8>, &TensorEntry)) -> RawTensor<'a> {
    RawTensor {
        dtype: e.dtype,
        numel: e.numel(),
        bytes,
    }
}
