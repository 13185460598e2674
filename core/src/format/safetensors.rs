//! safetensors files: the 8-byte header length, the JSON header parsed into [`TensorEntry`]s with
//! absolute byte ranges, every range validated against the file length before anything reads it
//! (DESIGN.md invariant 3). Works on bytes only; reading them is `io`'s job.

use std::collections::BTreeMap;

use safetensors::tensor::TensorInfo;

use crate::error::{Error, Result};
use crate::format::dtype::{dtype_bits, dtype_name, Dtype};

/// The largest header nibble accepts (the safetensors reference implementation uses 100 MB).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// One tensor of one safetensors file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorEntry {
    /// Full state-dict name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Logical shape as stored in the header.
    pub shape: Vec<u64>,
    /// Index of the shard (file) in [`ModelIndex::shards`]; 0 for a single file.
    pub shard: usize,
    /// Absolute offset of the first byte in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl TensorEntry {
    /// Number of elements (validated not to overflow when the header was parsed).
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Absolute end offset (exclusive).
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// The parsed and validated header of one safetensors file.
#[derive(Debug, Clone)]
pub struct SafetensorsHeader {
    /// The file's name or URL, as used in error messages.
    pub file: String,
    /// The file's total length in bytes.
    pub file_len: u64,
    /// Length of the JSON header (the u64 at offset 0).
    pub header_len: u64,
    /// `__metadata__`, if present.
    pub metadata: BTreeMap<String, String>,
    /// Tensors in file order (by offset).
    pub tensors: Vec<TensorEntry>,
}

impl SafetensorsHeader {
    /// Absolute offset where the data buffer begins.
    pub fn data_start(&self) -> u64 {
        8 + self.header_len
    }

    /// Reads the 8-byte little-endian header length and checks it against the file length.
    pub fn parse_header_len(file: &str, first8: &[u8], file_len: u64) -> Result<u64> {
        if file_len < 8 || first8.len() < 8 {
            return Err(Error::FileTooShort {
                file: file.to_string(),
                len: file_len,
            });
        }
        let mut b = [0u8; 8];
        b.copy_from_slice(&first8[..8]);
        let header_len = u64::from_le_bytes(b);
        if header_len > MAX_HEADER_LEN {
            return Err(Error::HeaderTooLarge {
                file: file.to_string(),
                header_len,
                limit: MAX_HEADER_LEN,
            });
        }
        if header_len > file_len - 8 {
            return Err(Error::HeaderPastEof {
                file: file.to_string(),
                header_len,
                file_len,
            });
        }
        Ok(header_len)
    }

    /// Parses and validates the JSON header (the `header_len` bytes after offset 8) of a file
    /// that is `file_len` bytes long. Works on a header fetched by itself (HTTP Range).
    pub fn parse(file: &str, header_json: &[u8], file_len: u64) -> Result<Self> {
        let header_len = header_json.len() as u64;
        if file_len < 8 || header_len > file_len - 8 {
            return Err(Error::HeaderPastEof {
                file: file.to_string(),
                header_len,
                file_len,
            });
        }
        let hjson = |msg: String| Error::HeaderJson {
            file: file.to_string(),
            msg,
        };
        let text =
            std::str::from_utf8(header_json).map_err(|e| hjson(format!("not UTF-8 ({e})")))?;
        let value: serde_json::Value =
            serde_json::from_str(text.trim_end_matches(' ')).map_err(|e| hjson(e.to_string()))?;
        let serde_json::Value::Object(map) = value else {
            return Err(hjson("the header is not a JSON object".into()));
        };
        let data_start = 8 + header_len;
        let data_len = file_len - data_start;
        let mut metadata = BTreeMap::new();
        let mut tensors = Vec::with_capacity(map.len());
        for (name, v) in map {
            if name == "__metadata__" {
                let serde_json::Value::Object(m) = v else {
                    return Err(hjson("__metadata__ is not an object".into()));
                };
                for (k, v) in m {
                    let serde_json::Value::String(s) = v else {
                        return Err(hjson(format!(
                            "__metadata__ value of '{k}' is not a string"
                        )));
                    };
                    metadata.insert(k, s);
                }
                continue;
            }
            let bad = |msg: String| Error::BadTensorEntry {
                file: file.to_string(),
                tensor: name.clone(),
                msg,
            };
            let info: TensorInfo = serde_json::from_value(v).map_err(|e| bad(e.to_string()))?;
            let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
            let (s, e) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
            let overflow = || Error::ShapeOverflow {
                file: file.to_string(),
                tensor: name.clone(),
                shape: shape.clone(),
            };
            let numel = shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(overflow)?;
            let bits = numel
                .checked_mul(dtype_bits(info.dtype))
                .ok_or_else(overflow)?;
            if bits % 8 != 0 {
                return Err(bad(format!(
                    "{numel} elements of {} do not fill whole bytes",
                    dtype_name(info.dtype)
                )));
            }
            if e < s {
                return Err(bad(format!(
                    "data_offsets [{s}, {e}] end before they begin"
                )));
            }
            let offset = data_start.checked_add(s).ok_or_else(overflow)?;
            if bits / 8 != e - s {
                return Err(Error::ByteLengthMismatch {
                    file: file.to_string(),
                    tensor: name,
                    offset,
                    expected: bits / 8,
                    actual: e - s,
                });
            }
            if e > data_len {
                return Err(Error::OffsetOutOfRange {
                    file: file.to_string(),
                    tensor: name,
                    offset,
                    end: data_start.saturating_add(e),
                    file_len,
                });
            }
            tensors.push(TensorEntry {
                name,
                dtype: info.dtype,
                shape,
                shard: 0,
                offset,
                len: e - s,
            });
        }
        tensors.sort_by(|a, b| (a.offset, a.end(), &a.name).cmp(&(b.offset, b.end(), &b.name)));
        let mut cursor = data_start;
        let mut prev: Option<&TensorEntry> = None;
        for t in &tensors {
            if t.offset < cursor {
                let p = prev.expect("cursor only advances past a previous tensor");
                return Err(Error::OffsetOverlap {
                    file: file.to_string(),
                    tensor: t.name.clone(),
                    offset: t.offset,
                    other: p.name.clone(),
                    other_end: p.end(),
                });
            }
            if t.offset > cursor {
                return Err(Error::OffsetGap {
                    file: file.to_string(),
                    tensor: t.name.clone(),
                    offset: cursor,
                    len: t.offset - cursor,
                });
            }
            cursor = t.end();
            prev = Some(t);
        }
        if cursor != file_len {
            return Err(Error::OffsetGap {
                file: file.to_string(),
                tensor: "<end of file>".into(),
                offset: cursor,
                len: file_len - cursor,
            });
        }
        Ok(SafetensorsHeader {
            file: file.to_string(),
            file_len,
            header_len,
            metadata,
            tensors,
        })
    }
}
