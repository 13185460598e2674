//! Local files as a [`RangeSource`], with the read strategies measured against each other in
//! `nibble bench stream --file-mode` (docs/streaming.md, "Read strategy"):
//!
//! - `pread`: positional reads into the ring slot (page cache kept by the kernel).
//! - `pread-dropcache`: `pread`, then `posix_fadvise(DONTNEED)` on the range, so that streaming a
//!   model larger than free RAM does not fill the page cache without bound.
//! - `direct`: `O_DIRECT` reads (aligned, through a per-thread bounce buffer), no page cache.
//! - `mmap`: one read-only map per file, ranges copied out and `madvise(DONTNEED)` once consumed
//!   (touched pages of a map count in RSS, which is how one Python offloader reached an 11 GB
//!   working set).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::format::positional::pread_full;
use crate::io::folder::{check_name, BoxFuture, ModelFolder, OpenedFile};
use crate::io::source::{RangeSource, SlotMemory, SourceFile};

/// How a [`FileSource`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FileReadMode {
    /// `pread` when the model's files fit in half of the available RAM (later steps then run at
    /// memory speed from the page cache), `pread-dropcache` otherwise (the page cache stays
    /// bounded at about the same disk throughput). Chosen from the measurements in docs/streaming.md.
    #[default]
    Auto,
    /// Positional reads.
    Pread,
    /// Positional reads, then drop the range from the page cache.
    PreadDropCache,
    /// `O_DIRECT` reads.
    Direct,
    /// Memory map, copy, `madvise(DONTNEED)`.
    Mmap,
}

impl FileReadMode {
    /// Parses the CLI spelling.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(FileReadMode::Auto),
            "pread" => Some(FileReadMode::Pread),
            "pread-dropcache" => Some(FileReadMode::PreadDropCache),
            "direct" => Some(FileReadMode::Direct),
            "mmap" => Some(FileReadMode::Mmap),
            _ => None,
        }
    }

    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            FileReadMode::Auto => "auto",
            FileReadMode::Pread => "pread",
            FileReadMode::PreadDropCache => "pread-dropcache",
            FileReadMode::Direct => "direct",
            FileReadMode::Mmap => "mmap",
        }
    }
}

/// A model's local files.
#[derive(Debug)]
pub struct FileSource {
    files: Vec<SourceFile>,
    paths: Vec<PathBuf>,
    handles: Vec<File>,
    direct: Vec<Option<File>>,
    maps: Vec<Option<memmap2::Mmap>>,
    mode: FileReadMode,
}

const DIRECT_ALIGN: u64 = 4096;

thread_local! {
    static BOUNCE: std::cell::RefCell<crate::io::source::HostSlot> =
        std::cell::RefCell::new(crate::io::source::HostSlot::new(0));
}

impl FileSource {
    /// Opens the files for reading with `mode` (`Auto` is resolved here).
    pub fn open(paths: &[PathBuf], mode: FileReadMode) -> Result<Self> {
        let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        Self::open_named(paths, &names, mode)
    }

    /// [`FileSource::open`] with the names messages give the files.
    pub fn open_named(paths: &[PathBuf], names: &[String], mode: FileReadMode) -> Result<Self> {
        let mode = match mode {
            FileReadMode::Auto => {
                let total: u64 = paths
                    .iter()
                    .filter_map(|p| std::fs::metadata(p).ok())
                    .map(|m| m.len())
                    .sum();
                match crate::io::machine::available_memory_bytes() {
                    Some(avail) if total > avail / 2 => FileReadMode::PreadDropCache,
                    _ => FileReadMode::Pread,
                }
            }
            m => m,
        };
        let mut files = Vec::new();
        let mut handles = Vec::new();
        let mut direct = Vec::new();
        let mut maps = Vec::new();
        for (p, name) in paths.iter().zip(names) {
            let name = name.clone();
            let f = File::open(p).map_err(|e| Error::io(&name, e))?;
            let len = f.metadata().map_err(|e| Error::io(&name, e))?.len();
            direct.push(if mode == FileReadMode::Direct {
                Some(open_direct(p)?)
            } else {
                None
            });
            maps.push(if mode == FileReadMode::Mmap && len > 0 {
                // SAFETY: the map is read-only; a file truncated underneath is detected by the
                // length check before each copy (reads past the end are refused, not faulted:
                // see `read_exact_at`).
                Some(unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(&name, e))?)
            } else {
                None
            });
            files.push(SourceFile { name, len });
            handles.push(f);
        }
        Ok(FileSource {
            files,
            paths: paths.to_vec(),
            handles,
            direct,
            maps,
            mode,
        })
    }

    /// The read strategy.
    pub fn mode(&self) -> FileReadMode {
        self.mode
    }

    /// The files' paths.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }
}

#[cfg(target_os = "linux")]
fn open_direct(p: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(p)
        .map_err(|e| Error::io(p.display().to_string(), e))
}

#[cfg(not(target_os = "linux"))]
fn open_direct(p: &Path) -> Result<File> {
    Err(Error::Invalid(format!(
        "{}: O_DIRECT reads are only supported on Linux",
        p.display()
    )))
}

#[cfg(target_os = "linux")]
fn drop_cache(f: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall on an open descriptor; failure only means the cache stays.
    unsafe {
        libc::posix_fadvise(
            f.as_raw_fd(),
            offset as i64,
            len as i64,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn drop_cache(_f: &File, _offset: u64, _len: u64) {}

/// Drops a whole file from the page cache (so that a benchmark baseline reads from disk).
pub fn drop_file_cache(path: &Path) -> Result<()> {
    let f = File::open(path).map_err(|e| Error::io(path.display().to_string(), e))?;
    let len = f
        .metadata()
        .map_err(|e| Error::io(path.display().to_string(), e))?
        .len();
    drop_cache(&f, 0, len);
    Ok(())
}

impl RangeSource for FileSource {
    fn files(&self) -> &[SourceFile] {
        &self.files
    }

    fn version(&self, file: usize) -> Option<String> {
        let m = std::fs::metadata(&self.files.get(file)?.name).ok()?;
        Some(format!("modified {:?} len {}", m.modified().ok()?, m.len()))
    }

    fn read_exact_at(&self, file: usize, offset: u64, buf: &mut [u8], what: &str) -> Result<()> {
        let info = self
            .files
            .get(file)
            .ok_or_else(|| Error::Invalid(format!("no file #{file}")))?;
        let name = &info.name;
        let len = buf.len() as u64;
        let short = |got: usize| Error::ShortRead {
            file: name.clone(),
            tensor: what.to_string(),
            offset,
            wanted: len,
            got: got as u64,
        };
        match self.mode {
            FileReadMode::Auto | FileReadMode::Pread | FileReadMode::PreadDropCache => {
                let f = &self.handles[file];
                let got = pread_full(f, offset, buf).map_err(|e| Error::io(name, e))?;
                if self.mode == FileReadMode::PreadDropCache {
                    drop_cache(f, offset, len);
                }
                if got != buf.len() {
                    return Err(short(got));
                }
            }
            FileReadMode::Direct => {
                let f = self.direct[file]
                    .as_ref()
                    .ok_or_else(|| Error::Invalid("no O_DIRECT handle".into()))?;
                let start = offset / DIRECT_ALIGN * DIRECT_ALIGN;
                let end = (offset + len).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
                let span = (end - start) as usize;
                let got = BOUNCE.with(|b| -> Result<usize> {
                    let mut b = b.borrow_mut();
                    if b.bytes().len() < span {
                        // Grows once per reader thread up to the largest read (one ring slot).
                        *b = crate::io::source::HostSlot::try_new(span).map_err(|e| {
                            Error::Invalid(format!("the O_DIRECT bounce buffer of {name}: {e}"))
                        })?;
                    }
                    let bounce = &mut b.bytes_mut()[..span];
                    let n = pread_full(f, start, bounce).map_err(|e| Error::io(name, e))?;
                    let skip = (offset - start) as usize;
                    let avail = n.saturating_sub(skip).min(buf.len());
                    buf[..avail].copy_from_slice(&bounce[skip..skip + avail]);
                    Ok(avail)
                })?;
                if got != buf.len() {
                    return Err(short(got));
                }
            }
            FileReadMode::Mmap => {
                // The file may have shrunk since it was mapped: touching pages past its end
                // would fault, so compare with the current length first.
                let now = self.handles[file]
                    .metadata()
                    .map_err(|e| Error::io(name, e))?
                    .len();
                let map = self.maps[file].as_ref();
                let avail = now.min(map.map(|m| m.len() as u64).unwrap_or(0));
                if offset + len > avail {
                    return Err(short(avail.saturating_sub(offset) as usize));
                }
                let m = map.ok_or_else(|| short(0))?;
                buf.copy_from_slice(&m[offset as usize..(offset + len) as usize]);
            }
        }
        Ok(())
    }

    #[cfg(not(unix))]
    fn consumed(&self, _file: usize, _offset: u64, _len: u64) {}

    #[cfg(unix)]
    fn consumed(&self, file: usize, offset: u64, len: u64) {
        if self.mode == FileReadMode::Mmap {
            if let Some(m) = self.maps.get(file).and_then(|m| m.as_ref()) {
                let page = 4096u64;
                let start = offset.div_ceil(page) * page;
                let end = ((offset + len) / page * page).min(m.len() as u64);
                if end > start {
                    // SAFETY: DONTNEED on a read-only shared file map only drops resident pages;
                    // later reads fault them back in from the file.
                    unsafe {
                        libc::madvise(
                            m.as_ptr().add(start as usize) as *mut libc::c_void,
                            (end - start) as usize,
                            libc::MADV_DONTNEED,
                        );
                    }
                }
            }
        }
    }

    fn describe(&self) -> String {
        format!(
            "{} ({})",
            self.files.first().map(|f| f.name.as_str()).unwrap_or("?"),
            self.mode.name()
        )
    }
}

/// A model folder on the local disk. Names are resolved (symbolic links followed) and must stay
/// inside the folder, except the file the user named; only regular files are opened (a FIFO or a
/// device would block or never end).
#[derive(Debug)]
pub struct LocalFolder {
    /// The folder as the user gave it (for messages).
    dir: PathBuf,
    display: String,
    /// Its canonical path (for the inside-the-folder check).
    canonical: PathBuf,
    /// A file the user named directly (it may be a link to anywhere).
    named: Option<PathBuf>,
    mode: FileReadMode,
    /// The opened files: (resolved path, the name shown in messages).
    opened: Mutex<Vec<(PathBuf, String)>>,
}

impl LocalFolder {
    /// The folder `dir`, its weights read with `mode`.
    pub fn new(dir: &Path, mode: FileReadMode) -> Result<Self> {
        let display = dir.display().to_string();
        let canonical = dir.canonicalize().map_err(|e| Error::io(&display, e))?;
        Ok(LocalFolder {
            dir: dir.to_path_buf(),
            display,
            canonical,
            named: None,
            mode,
            opened: Mutex::new(Vec::new()),
        })
    }

    /// The folder of the file `path` that the user named; returns the folder and the file's name
    /// in it.
    pub fn of_file(path: &Path, mode: FileReadMode) -> Result<(Self, String)> {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| Error::Invalid(format!("{}: not a file name", path.display())))?
            .to_string();
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let mut f = Self::new(&dir, mode)?;
        f.display = path
            .parent()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        f.named = Some(
            path.canonicalize()
                .map_err(|e| Error::io(path.display().to_string(), e))?,
        );
        Ok((f, name))
    }

    /// The file `name` refers to, `None` when there is none; an error when it leaves the folder
    /// or is not a regular file.
    fn resolve(&self, name: &str) -> Result<Option<PathBuf>> {
        check_name(name)?;
        let shown = self.locate(name);
        let real = match self.canonical.join(name).canonicalize() {
            Ok(p) => p,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(shown, e)),
        };
        if !real.starts_with(&self.canonical) && self.named.as_ref() != Some(&real) {
            return Err(Error::Invalid(format!(
                "{shown} leads outside the model folder (to {})",
                real.display()
            )));
        }
        let meta = std::fs::metadata(&real).map_err(|e| Error::io(&shown, e))?;
        if !meta.is_file() {
            return Err(Error::Invalid(format!("{shown} is not a regular file")));
        }
        Ok(Some(real))
    }
}

impl ModelFolder for LocalFolder {
    fn root(&self) -> &str {
        &self.display
    }

    fn locate(&self, name: &str) -> String {
        if self.display.is_empty() {
            name.to_string()
        } else {
            self.dir.join(name).display().to_string()
        }
    }

    fn read_small<'a>(
        &'a self,
        name: &'a str,
        limit: u64,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>>> {
        Box::pin(async move {
            let Some(path) = self.resolve(name)? else {
                return Ok(None);
            };
            let shown = self.locate(name);
            let f = File::open(&path).map_err(|e| Error::io(&shown, e))?;
            let len = f.metadata().map_err(|e| Error::io(&shown, e))?.len();
            if len > limit {
                return Err(Error::Model {
                    file: shown,
                    msg: format!("{len} bytes, over the {limit}-byte limit for this file"),
                });
            }
            let mut buf = vec![0u8; len as usize];
            let got = pread_full(&f, 0, &mut buf).map_err(|e| Error::io(&shown, e))?;
            buf.truncate(got);
            Ok(Some(buf))
        })
    }

    fn open_file<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<OpenedFile>>> {
        Box::pin(async move {
            let Some(path) = self.resolve(name)? else {
                return Ok(None);
            };
            let shown = self.locate(name);
            let f = File::open(&path).map_err(|e| Error::io(&shown, e))?;
            let len = f.metadata().map_err(|e| Error::io(&shown, e))?.len();
            let mut head = vec![0u8; len.min(8) as usize];
            let got = pread_full(&f, 0, &mut head).map_err(|e| Error::io(&shown, e))?;
            head.truncate(got);
            let mut opened = self
                .opened
                .lock()
                .map_err(|_| Error::Invalid("folder poisoned".into()))?;
            opened.push((path, shown));
            Ok(Some(OpenedFile {
                index: opened.len() - 1,
                len,
                head,
            }))
        })
    }

    fn read_at<'a>(
        &'a self,
        file: usize,
        offset: u64,
        len: u64,
        what: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u8>>> {
        Box::pin(async move {
            let (path, shown) = self
                .opened
                .lock()
                .map_err(|_| Error::Invalid("folder poisoned".into()))?
                .get(file)
                .cloned()
                .ok_or_else(|| Error::Invalid(format!("no opened file #{file}")))?;
            let n =
                usize::try_from(len).map_err(|_| Error::Invalid(format!("{what}: {len} bytes")))?;
            let f = File::open(&path).map_err(|e| Error::io(&shown, e))?;
            let mut buf = vec![0u8; n];
            let got = pread_full(&f, offset, &mut buf).map_err(|e| Error::io(&shown, e))?;
            if got != n {
                return Err(Error::ShortRead {
                    file: shown,
                    tensor: what.to_string(),
                    offset,
                    wanted: len,
                    got: got as u64,
                });
            }
            Ok(buf)
        })
    }

    fn list_safetensors(&self) -> Result<Option<Vec<String>>> {
        let mut names: Vec<String> = std::fs::read_dir(&self.canonical)
            .map_err(|e| Error::io(&self.display, e))?
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| n.ends_with(".safetensors"))
            .collect();
        names.sort();
        Ok(Some(names))
    }

    fn source(&self) -> Result<Arc<dyn RangeSource>> {
        let opened = self
            .opened
            .lock()
            .map_err(|_| Error::Invalid("folder poisoned".into()))?
            .clone();
        let (paths, names): (Vec<PathBuf>, Vec<String>) = opened.into_iter().unzip();
        Ok(Arc::new(FileSource::open_named(&paths, &names, self.mode)?))
    }
}
