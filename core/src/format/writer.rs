//! Writing safetensors files tensor by tensor (the header first, then each tensor's bytes as it
//! is produced), atomically: a temporary file in the same folder is renamed into place.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::format::dtype::{dtype_bits, dtype_name};

/// One tensor's entry in the header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
}

impl TensorSpec {
    /// Bytes the tensor occupies.
    pub fn byte_len(&self) -> Result<u64> {
        self.shape
            .iter()
            .try_fold(dtype_bits(self.dtype), |a, &d| a.checked_mul(d))
            .map(|bits| bits.div_ceil(8))
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "tensor '{}': shape {:?} overflows",
                    self.name, self.shape
                ))
            })
    }
}

/// Streams tensors into a new safetensors file in the order of the specs it was created with.
#[derive(Debug)]
pub struct SafetensorsWriter {
    out: BufWriter<File>,
    tmp: PathBuf,
    dest: PathBuf,
    specs: Vec<(TensorSpec, u64)>,
    next: usize,
}

impl SafetensorsWriter {
    /// Writes the header for `specs` (in this order) and `metadata` and prepares to receive data.
    pub fn create(
        dest: &Path,
        specs: Vec<TensorSpec>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self> {
        let mut header = serde_json::Map::new();
        if !metadata.is_empty() {
            header.insert(
                "__metadata__".into(),
                serde_json::to_value(metadata).map_err(|e| Error::Invalid(e.to_string()))?,
            );
        }
        let mut offset = 0u64;
        let mut sized = Vec::with_capacity(specs.len());
        for s in specs {
            if header.contains_key(&s.name) {
                return Err(Error::Invalid(format!("tensor '{}' written twice", s.name)));
            }
            let len = s.byte_len()?;
            header.insert(
                s.name.clone(),
                serde_json::json!({
                    "dtype": dtype_name(s.dtype),
                    "shape": s.shape,
                    "data_offsets": [offset, offset + len],
                }),
            );
            offset += len;
            sized.push((s, len));
        }
        let mut json = serde_json::to_vec(&serde_json::Value::Object(header))
            .map_err(|e| Error::Invalid(e.to_string()))?;
        while json.len() % 8 != 0 {
            json.push(b' ');
        }
        let dest_s = dest.display().to_string();
        let tmp = dest.with_file_name(format!(
            ".{}.tmp-{}",
            dest.file_name().and_then(|n| n.to_str()).unwrap_or("out"),
            std::process::id()
        ));
        let f = File::create(&tmp).map_err(|e| Error::io(tmp.display().to_string(), e))?;
        let mut out = BufWriter::with_capacity(1 << 20, f);
        let io = |e| Error::io(&dest_s, e);
        out.write_all(&(json.len() as u64).to_le_bytes())
            .map_err(io)?;
        out.write_all(&json).map_err(io)?;
        Ok(SafetensorsWriter {
            out,
            tmp,
            dest: dest.to_path_buf(),
            specs: sized,
            next: 0,
        })
    }

    /// Appends the next tensor's bytes (possibly in several calls for one tensor is not
    /// supported: one call per tensor, in spec order).
    pub fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let Some((spec, len)) = self.specs.get(self.next) else {
            return Err(Error::Invalid(format!("tensor '{name}' was not declared")));
        };
        if spec.name != name || *len != bytes.len() as u64 {
            return Err(Error::Invalid(format!(
                "expected tensor '{}' of {} bytes next, got '{name}' of {} bytes",
                spec.name,
                len,
                bytes.len()
            )));
        }
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io(self.dest.display().to_string(), e))?;
        self.next += 1;
        Ok(())
    }

    /// Flushes, syncs and renames the file into place; fails if a declared tensor is missing.
    pub fn finish(mut self) -> Result<()> {
        if self.next != self.specs.len() {
            return Err(Error::Invalid(format!(
                "{}: {} of {} tensors written",
                self.dest.display(),
                self.next,
                self.specs.len()
            )));
        }
        let d = self.dest.display().to_string();
        self.out.flush().map_err(|e| Error::io(&d, e))?;
        self.out
            .get_ref()
            .sync_all()
            .map_err(|e| Error::io(&d, e))?;
        std::fs::rename(&self.tmp, &self.dest).map_err(|e| Error::io(&d, e))?;
        Ok(())
    }
}

impl Drop for SafetensorsWriter {
    fn drop(&mut self) {
        // A writer dropped before `finish` leaves no half-written file behind.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

/// Writes whole in-memory tensors to a file (for small outputs and tests).
pub fn write_safetensors(
    dest: &Path,
    tensors: &[(String, Dtype, Vec<u64>, Vec<u8>)],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let specs = tensors
        .iter()
        .map(|(n, d, s, _)| TensorSpec {
            name: n.clone(),
            dtype: *d,
            shape: s.clone(),
        })
        .collect();
    let mut w = SafetensorsWriter::create(dest, specs, metadata)?;
    for (n, _, _, b) in tensors {
        w.write_tensor(n, b)?;
    }
    w.finish()
}
