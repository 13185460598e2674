//! Opening a model over HTTP in the browser, asynchronously: `config.json`, the shard index if
//! any, then each file's 8 + N header bytes by Range requests, and the small quant-state
//! tensors of every 4-bit weight (the only tensors the planner reads before streaming). No
//! request reads a weight file whole.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use nibble_core::format::safetensors::SafetensorsHeader;
use nibble_core::io::model::{
    shard_files_of_index, side_json as json, ModelIndex, Shard, SHARD_INDEX_NAMES,
    SINGLE_FILE_NAMES,
};
use nibble_core::io::source::{RangeSource, SourceFile};
use nibble_core::{Error, Result};

use crate::fetch::{fetch_range, fetch_small, SharedTraffic};

/// The most one quant-state request reads (adjacent small tensors are read together).
const MAX_RUN: u64 = 16 << 20;

/// Side files larger than this are refused.
const SMALL: u64 = 64 << 20;

/// The byte ranges read before streaming starts, kept in memory: the planner and the graph
/// builders read quant states synchronously, which a browser cannot do over the network.
pub struct PrefetchedRanges {
    files: Vec<SourceFile>,
    ranges: Mutex<HashMap<(usize, u64), Vec<u8>>>,
}

impl RangeSource for PrefetchedRanges {
    fn files(&self) -> &[SourceFile] {
        &self.files
    }

    fn read_exact_at(&self, file: usize, offset: u64, buf: &mut [u8], what: &str) -> Result<()> {
        self.check_range(file, offset, buf.len() as u64, what)?;
        let ranges = self
            .ranges
            .lock()
            .map_err(|_| Error::Invalid("prefetched ranges poisoned".into()))?;
        match ranges.get(&(file, offset)) {
            Some(b) if b.len() == buf.len() => {
                buf.copy_from_slice(b);
                Ok(())
            }
            _ => Err(Error::Model {
                file: self.files[file].name.clone(),
                msg: format!(
                    "tensor '{what}' at offset {offset}: not prefetched (in the browser only quant states are read before streaming)"
                ),
            }),
        }
    }
}

/// Adjacent tensors read by one request: (file, start, end, [(offset, len)]).
type Run = (usize, u64, u64, Vec<(u64, u64)>);

/// A model opened over HTTP.
#[derive(Clone)]
pub struct RemoteModel {
    /// The index (its source serves the prefetched quant states).
    pub index: ModelIndex,
    /// URL of each file, in index order.
    pub urls: Vec<String>,
    /// Files and lengths, in index order.
    pub files: Vec<SourceFile>,
    /// Bytes read to open it: headers (8 + N per file) and quant-state tensors.
    pub open_bytes: u64,
}

async fn open_file(traffic: &SharedTraffic, url: &str) -> Result<SafetensorsHeader> {
    let (first8, total) = fetch_range(traffic, url, 0, 8, "header").await?;
    let header_len = SafetensorsHeader::parse_header_len(url, &first8.to_vec(), total)?;
    if header_len == 0 {
        return SafetensorsHeader::parse(url, b"", total);
    }
    let (json, _) = fetch_range(traffic, url, 8, header_len, "header").await?;
    SafetensorsHeader::parse(url, &json.to_vec(), total)
}

/// Opens the model folder at `url` (holding `config.json` and `model.safetensors`,
/// `diffusion_pytorch_model.safetensors`, or shards with their index).
pub async fn open(traffic: &SharedTraffic, url: &str) -> Result<RemoteModel> {
    let url = url.trim_end_matches('/').to_string();
    let config = json(
        fetch_small(traffic, &format!("{url}/config.json"), SMALL).await?,
        "config.json",
    )?;
    let mut shards = Vec::new();
    let mut index_json = None;
    for idx_name in SHARD_INDEX_NAMES {
        let idx_url = format!("{url}/{idx_name}");
        if let Some(j) = json(fetch_small(traffic, &idx_url, SMALL).await?, &idx_url)? {
            for f in shard_files_of_index(&idx_url, &j)? {
                let header = open_file(traffic, &format!("{url}/{f}")).await?;
                shards.push(Shard { name: f, header });
            }
            index_json = Some((idx_url, j));
            break;
        }
    }
    if shards.is_empty() {
        // diffusers' file name first for diffusers models (config.json has `_class_name`).
        let mut names = SINGLE_FILE_NAMES.to_vec();
        if config
            .as_ref()
            .is_some_and(|c| c.get("_class_name").is_some())
        {
            names.reverse();
        }
        let mut last_err = None;
        for name in names {
            match open_file(traffic, &format!("{url}/{name}")).await {
                Ok(header) => {
                    shards.push(Shard {
                        name: name.to_string(),
                        header,
                    });
                    break;
                }
                Err(e) => last_err = Some(e),
            }
        }
        if shards.is_empty() {
            return Err(last_err.unwrap_or_else(|| Error::Model {
                file: url.clone(),
                msg: "no model found".into(),
            }));
        }
    }
    let files: Vec<SourceFile> = shards
        .iter()
        .map(|s| SourceFile {
            name: format!("{url}/{}", s.name),
            len: s.header.file_len,
        })
        .collect();
    let urls: Vec<String> = files.iter().map(|f| f.name.clone()).collect();
    let prefetched = Arc::new(PrefetchedRanges {
        files: files.clone(),
        ranges: Mutex::new(HashMap::new()),
    });
    let index = ModelIndex::from_parts(
        url.clone(),
        shards,
        config,
        prefetched.clone(),
        index_json.as_ref().map(|(n, j)| (n.as_str(), j)),
    )?;
    // Every quant-state tensor, read in runs of adjacent tensors (one request per run).
    let mut wanted = Vec::new();
    for k in index.q4_weights().map(<[_]>::to_vec)? {
        let names = [
            Some(&k.quant_state),
            Some(&k.absmax),
            Some(&k.quant_map),
            k.nested_absmax.as_ref(),
            k.nested_quant_map.as_ref(),
        ];
        for name in names.into_iter().flatten() {
            let e = index.require(name)?;
            wanted.push((e.shard, e.offset, e.len));
        }
    }
    wanted.sort_unstable();
    wanted.dedup();
    let mut runs: Vec<Run> = Vec::new();
    for (file, offset, len) in wanted {
        match runs.last_mut() {
            Some((f, start, end, parts))
                if *f == file && *end == offset && *end + len - *start <= MAX_RUN =>
            {
                *end += len;
                parts.push((offset, len));
            }
            _ => runs.push((file, offset, offset + len, vec![(offset, len)])),
        }
    }
    let mut open_bytes: u64 = index.shards.iter().map(|s| 8 + s.header.header_len).sum();
    for (file, start, end, parts) in runs {
        let len = end - start;
        let bytes = if len == 0 {
            None
        } else {
            Some(
                fetch_range(traffic, &urls[file], start, len, "quant-state")
                    .await?
                    .0,
            )
        };
        open_bytes += len;
        let mut ranges = prefetched
            .ranges
            .lock()
            .map_err(|_| Error::Invalid("prefetched ranges poisoned".into()))?;
        for (offset, l) in parts {
            let at = (offset - start) as u32;
            let part = match &bytes {
                Some(b) if l > 0 => b.subarray(at, at + l as u32).to_vec(),
                _ => Vec::new(),
            };
            ranges.insert((file, offset), part);
        }
    }
    Ok(RemoteModel {
        index,
        urls,
        files,
        open_bytes,
    })
}
