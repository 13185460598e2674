//! Writing outputs: [`OutputFile`], the one way nibble writes a file it was asked to write, and
//! safetensors files tensor by tensor (the header first, then each tensor's bytes as it is
//! produced) through it.

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

/// An output file. A regular file (or a new one) is written to a temporary file beside it,
/// synced and renamed into place by [`OutputFile::finish`], so that a failed run leaves the old
/// file or none; a symbolic link is followed and its target replaced, not the link. A character
/// device or a FIFO (`-o /dev/null`, `-o >(consumer)`) is written through, never replaced:
/// renaming a file over `/dev/null` as root would break the machine. A folder, a block device or
/// a socket is refused. Every write, flush, sync and close error is returned.
#[derive(Debug)]
pub struct OutputFile {
    out: BufWriter<File>,
    /// The temporary file renamed into place at the end (a regular target).
    tmp: Option<PathBuf>,
    dest: PathBuf,
}

impl OutputFile {
    /// Opens `dest` for writing as described on [`OutputFile`].
    pub fn create(dest: &Path) -> Result<Self> {
        let d = dest.display().to_string();
        let not_regular = |what: &str| {
            Err(Error::Invalid(format!(
                "{d} is {what}: nibble writes outputs to files (or through character devices \
                 and FIFOs)"
            )))
        };
        match std::fs::metadata(dest) {
            Ok(m) if m.is_dir() => return not_regular("a folder"),
            Ok(m) if !m.is_file() => {
                #[cfg(unix)]
                {
                    use std::os::unix::fs::FileTypeExt;
                    let t = m.file_type();
                    if t.is_block_device() {
                        return not_regular("a block device");
                    }
                    if t.is_socket() {
                        return not_regular("a socket");
                    }
                }
                // Written through: opened as it is, neither created, truncated nor replaced.
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(dest)
                    .map_err(|e| Error::io(&d, e))?;
                // What was opened is checked again: the path may have been swapped for a
                // regular file (which would be written over in place) since it was looked at.
                let opened = f.metadata().map_err(|e| Error::io(&d, e))?;
                if opened.is_file() || opened.is_dir() {
                    return Err(Error::Invalid(format!(
                        "{d} changed while it was opened; write the output again"
                    )));
                }
                return Ok(OutputFile {
                    out: BufWriter::with_capacity(1 << 20, f),
                    tmp: None,
                    dest: dest.to_path_buf(),
                });
            }
            _ => {}
        }
        // A link's target is what gets replaced.
        let real = match std::fs::symlink_metadata(dest) {
            Ok(m) if m.file_type().is_symlink() => {
                std::fs::canonicalize(dest).map_err(|e| Error::io(&d, e))?
            }
            _ => dest.to_path_buf(),
        };
        // The temporary file is created new (O_EXCL: never a file or link that is already
        // there, which another user could have planted at a name they can guess), under a
        // name with the process id and the clock, another one if that exists.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |t| t.subsec_nanos());
        let name = real.file_name().and_then(|n| n.to_str()).unwrap_or("out");
        let mut last = None;
        for k in 0..16u32 {
            let tmp = real.with_file_name(format!(
                ".{name}.tmp-{}-{:08x}",
                std::process::id(),
                nanos.wrapping_add(k.wrapping_mul(0x9e37_79b9))
            ));
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
            {
                Ok(f) => {
                    return Ok(OutputFile {
                        out: BufWriter::with_capacity(1 << 20, f),
                        tmp: Some(tmp),
                        dest: real,
                    })
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(tmp),
                Err(e) => return Err(Error::io(tmp.display().to_string(), e)),
            }
        }
        Err(Error::Invalid(format!(
            "no new temporary file beside {d} could be made (the last tried, {}, exists)",
            last.map(|p| p.display().to_string()).unwrap_or_default()
        )))
    }

    /// Flushes, syncs and renames a regular file into place; flushes a device or FIFO.
    pub fn finish(mut self) -> Result<()> {
        let d = self.dest.display().to_string();
        self.out.flush().map_err(|e| Error::io(&d, e))?;
        if let Some(tmp) = self.tmp.take() {
            let r = self
                .out
                .get_ref()
                .sync_all()
                .and_then(|()| std::fs::rename(&tmp, &self.dest));
            if let Err(e) = r {
                let _ = std::fs::remove_file(&tmp);
                return Err(Error::io(&d, e));
            }
        }
        Ok(())
    }
}

impl Write for OutputFile {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.out.write(b)
    }
    fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.out.write_all(b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

impl std::io::Seek for OutputFile {
    fn seek(&mut self, pos: std::io::SeekFrom) -> std::io::Result<u64> {
        self.out.seek(pos)
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        // An output dropped before `finish` leaves no half-written file behind.
        if let Some(tmp) = &self.tmp {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// Streams tensors into a new safetensors file in the order of the specs it was created with.
#[derive(Debug)]
pub struct SafetensorsWriter {
    out: OutputFile,
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
        let mut out = OutputFile::create(dest)?;
        let io = |e| Error::io(&dest_s, e);
        out.write_all(&(json.len() as u64).to_le_bytes())
            .map_err(io)?;
        out.write_all(&json).map_err(io)?;
        Ok(SafetensorsWriter {
            out,
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

    /// Finishes the file ([`OutputFile::finish`]); fails if a declared tensor is missing.
    pub fn finish(self) -> Result<()> {
        if self.next != self.specs.len() {
            return Err(Error::Invalid(format!(
                "{}: {} of {} tensors written",
                self.dest.display(),
                self.next,
                self.specs.len()
            )));
        }
        self.out.finish()
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
