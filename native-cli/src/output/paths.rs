//! Output paths checked against what a command reads (fault class 18): an output that resolves
//! (through `..`, symbolic links or a hard link) to an input file, or into the model folder
//! being read, is refused before anything is opened for writing.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// What a command reads: the model (a path or a URL) and other input files.
pub struct Reads<'a> {
    /// `--model` / the input argument: a local file or folder, or a URL (nothing local to guard);
    /// empty when the command reads no model (only `files`).
    pub model: &'a str,
    /// Other files read (`--inputs`, `--resume`, a GGUF).
    pub files: Vec<&'a Path>,
}

/// `p` made absolute with symbolic links and `..` resolved as the kernel would: component by
/// component, each existing prefix canonicalized (so a link is followed before a `..` after it
/// applies), the missing rest appended.
fn resolve(p: &Path) -> PathBuf {
    use std::path::Component;
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(p)
    };
    let mut out = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::Prefix(_) | Component::RootDir => out.push(c),
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => {
                out.push(n);
                if let Ok(canon) = std::fs::canonicalize(&out) {
                    out = canon;
                }
            }
        }
    }
    out
}

/// Whether two existing paths are one file (the same inode: a hard link counts).
fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
    }
    resolve(a) == resolve(b)
}

/// Refuses `out` (given as `flag`) when writing it would overwrite or change what `reads` names.
pub fn check_output(out: &Path, flag: &str, reads: &Reads<'_>) -> Result<()> {
    let target = resolve(out);
    let is_url = reads.model.starts_with("http://") || reads.model.starts_with("https://");
    if !is_url && !reads.model.is_empty() {
        let model = Path::new(reads.model);
        let m = resolve(model);
        if m.is_dir() && target.starts_with(&m) {
            bail!(
                "{flag} {}: that is inside the model folder {} being read; write it elsewhere",
                out.display(),
                model.display()
            );
        }
        if m.is_file() && (target == m || same_file(out, model)) {
            bail!(
                "{flag} {}: that is the model file being read; write it elsewhere",
                out.display()
            );
        }
    }
    for f in &reads.files {
        if resolve(f) == target || same_file(out, f) {
            bail!(
                "{flag} {}: that is the input file {} being read; write it elsewhere",
                out.display(),
                f.display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_resolving_to_inputs_are_refused() {
        let d = tempfile::tempdir().expect("tmp");
        let model = d.path().join("m");
        std::fs::create_dir(&model).expect("mkdir");
        std::fs::write(model.join("model.safetensors"), b"x").expect("write");
        let input = d.path().join("in.safetensors");
        std::fs::write(&input, b"y").expect("write");
        let m = model.to_str().expect("utf8");
        let reads = Reads {
            model: m,
            files: vec![&input],
        };
        let bad = [
            model.join("model.safetensors"),
            model.join("new.safetensors"),
            d.path().join("m/../m/x"),
            d.path().join("in.safetensors"),
            d.path().join("m/../in.safetensors"),
            d.path().join("m/new/deeper/x.safetensors"),
            d.path().join("gone/../m/x"),
        ];
        for b in &bad {
            assert!(check_output(b, "-o", &reads).is_err(), "{}", b.display());
        }
        #[cfg(unix)]
        {
            let link = d.path().join("link");
            std::os::unix::fs::symlink(model.join("model.safetensors"), &link).expect("symlink");
            assert!(check_output(&link, "-o", &reads).is_err());
            let hard = d.path().join("hard");
            std::fs::hard_link(&input, &hard).expect("hard link");
            assert!(check_output(&hard, "-o", &reads).is_err());
        }
        assert!(check_output(&d.path().join("out.safetensors"), "-o", &reads).is_ok());
        let file_model = model.join("model.safetensors");
        let reads = Reads {
            model: file_model.to_str().expect("utf8"),
            files: vec![],
        };
        assert!(check_output(&model.join("logits.safetensors"), "-o", &reads).is_ok());
        assert!(check_output(&file_model, "-o", &reads).is_err());
        // Reading only files (convert's GGUF): writing beside them, in a new folder, is fine.
        let reads = Reads {
            model: "",
            files: vec![&input],
        };
        assert!(check_output(&d.path().join("out/model.safetensors"), "-o", &reads).is_ok());
        assert!(check_output(Path::new("relative/out.safetensors"), "-o", &reads).is_ok());
        assert!(check_output(&input, "-o", &reads).is_err());
    }
}
