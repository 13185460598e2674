//! Output folders that hold a whole model (`synth`, `convert`): written only into a folder that
//! is new, empty, or one nibble wrote before. Such a folder carries [`MARKER`], the list of the
//! files nibble wrote; writing again removes those first, so that no file of the old model (a
//! shard index, a shard, a tokenizer) is left beside the new one to be loaded with it. A folder
//! with other files and no marker is refused: it may be a model the user cares about.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The file that says a folder is nibble's own output, and lists what was written.
pub const MARKER: &str = ".nibble-output.json";

/// Files below `dir`, as paths relative to it, the marker left out.
fn files_below(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        let here = dir.join(&rel);
        for e in std::fs::read_dir(&here).with_context(|| here.display().to_string())? {
            let e = e.with_context(|| here.display().to_string())?;
            let r = rel.join(e.file_name());
            if e.file_type()?.is_dir() {
                todo.push(r);
            } else if r != Path::new(MARKER) {
                out.push(r);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Makes `dir` ready for a new model: nothing to do when it is absent or empty; the files of
/// nibble's earlier output removed when it has the marker; an error otherwise.
pub fn prepare(dir: &Path, flag: &str) -> Result<()> {
    let d = dir.display();
    match std::fs::metadata(dir) {
        Err(_) => return Ok(()),
        Ok(m) if !m.is_dir() => bail!("{flag} {d}: not a folder"),
        Ok(_) => {}
    }
    let marker = dir.join(MARKER);
    if marker.is_file() {
        let v: serde_json::Value = serde_json::from_slice(
            &std::fs::read(&marker).with_context(|| marker.display().to_string())?,
        )
        .with_context(|| format!("{}: not nibble's marker", marker.display()))?;
        let listed = v["files"].as_array().cloned().unwrap_or_default();
        let mut parents = std::collections::BTreeSet::new();
        for f in listed.iter().filter_map(|f| f.as_str()) {
            let rel = Path::new(f);
            // Only plain relative names below the folder.
            if rel.is_absolute()
                || rel
                    .components()
                    .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                bail!("{}: lists '{f}', outside the folder", marker.display());
            }
            let p = dir.join(rel);
            if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_file()) {
                std::fs::remove_file(&p).with_context(|| p.display().to_string())?;
            }
            parents.extend(
                rel.ancestors()
                    .skip(1)
                    .filter(|a| !a.as_os_str().is_empty()),
            );
        }
        // The subfolders those files were in, deepest first, where nothing else is left (a
        // pipeline's `transformer/` beside a language model's files would misname the folder).
        let mut parents: Vec<&Path> = parents.into_iter().collect();
        parents.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for rel in parents {
            let _ = std::fs::remove_dir(dir.join(rel));
        }
        std::fs::remove_file(&marker).with_context(|| marker.display().to_string())?;
        return Ok(());
    }
    let there = files_below(dir)?;
    if !there.is_empty() {
        let names: Vec<String> = there
            .iter()
            .take(4)
            .map(|p| p.display().to_string())
            .collect();
        bail!(
            "{flag} {d} already holds {} file(s) ({}{}): nibble writes a model only into a new or \
             empty folder, or one it wrote before; remove them or choose another folder",
            there.len(),
            names.join(", "),
            if there.len() > 4 { ", ..." } else { "" }
        );
    }
    Ok(())
}

/// Marks `dir` as nibble's output of `command`, listing every file in it now.
pub fn seal(dir: &Path, command: &str) -> Result<()> {
    let files: Vec<String> = files_below(dir)?
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let v = serde_json::json!({"written_by": command, "files": files});
    let p = dir.join(MARKER);
    std::fs::write(&p, serde_json::to_vec_pretty(&v)?).with_context(|| p.display().to_string())
}

/// Fails when `bytes` are more than the disk holding `dir` has free.
pub fn check_room(dir: &Path, bytes: u64, flag: &str) -> Result<()> {
    if let Some(free) = nibble_core::io::machine::free_disk_bytes(dir) {
        if bytes > free {
            bail!(
                "{flag} {}: {} to write, but its disk has {} free",
                dir.display(),
                nibble_core::plan::fmt_bytes(bytes),
                nibble_core::plan::fmt_bytes(free)
            );
        }
    }
    Ok(())
}
