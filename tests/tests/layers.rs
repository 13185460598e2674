//! The house rules of `core/src`, checked on the source: every layer folder says in its module
//! doc what it owns and what it may import, and imports nothing else (so the layers cannot form
//! a circle); product code does not import `tooling`; no file is over 900 lines.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, bottom first: each may import only layers before it (and `error`).
const LAYERS: [&str; 8] = [
    "format", "io", "stream", "graph", "backend", "plan", "exec", "models",
];

fn core_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../core/src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read core/src") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Per top-level module of core: the top-level modules its files name as `crate::X`.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = core_src();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut map: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&src).expect("under core/src");
        let top = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .expect("name")
            .trim_end_matches(".rs")
            .to_string();
        let text = std::fs::read_to_string(&f).expect("read");
        let deps = map.entry(top.clone()).or_default();
        for (i, _) in text.match_indices("crate::") {
            let name: String = text[i + 7..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name != top && name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                deps.insert(name);
            }
        }
    }
    map
}

/// The backticked layer names on the `May import:` lines of a layer's module doc.
fn may_import(layer: &str) -> BTreeSet<String> {
    let doc = std::fs::read_to_string(core_src().join(layer).join("mod.rs")).expect("mod.rs");
    let doc: Vec<&str> = doc.lines().take_while(|l| l.starts_with("//!")).collect();
    assert!(
        doc.iter().any(|l| l.contains("Owns:")),
        "{layer}/mod.rs: the module doc says what the layer owns (`Owns:`)"
    );
    let start = doc
        .iter()
        .position(|l| l.contains("May import:"))
        .unwrap_or_else(|| panic!("{layer}/mod.rs: the module doc has a `May import:` line"));
    let mut allowed = BTreeSet::new();
    for line in &doc[start..] {
        if line.trim_start_matches("//!").trim().is_empty() {
            break;
        }
        for (k, part) in line.split('`').enumerate() {
            if k % 2 == 1 {
                allowed.insert(part.to_string());
            }
        }
    }
    allowed
}

#[test]
fn layers_import_only_what_their_docs_allow_and_only_downward() {
    let map = imports();
    for (i, layer) in LAYERS.iter().enumerate() {
        let allowed = may_import(layer);
        for name in &allowed {
            assert!(
                name == "error" || LAYERS[..i].contains(&name.as_str()),
                "{layer} may import `{name}`, which is not a layer below it"
            );
        }
        let deps = map.get(*layer).cloned().unwrap_or_default();
        let extra: Vec<&String> = deps.difference(&allowed).collect();
        assert!(
            extra.is_empty(),
            "{layer} imports {extra:?}, which its module doc does not allow"
        );
    }
    for (module, deps) in &map {
        if module != "tooling" {
            assert!(
                !deps.contains("tooling"),
                "{module} imports tooling (product code must not)"
            );
        }
    }
    let tooling = may_import("tooling");
    let extra: Vec<&String> = map["tooling"].difference(&tooling).collect();
    assert!(extra.is_empty(), "tooling imports {extra:?}");
}

#[test]
fn no_core_file_is_over_900_lines() {
    let mut files = Vec::new();
    rust_files(&core_src(), &mut files);
    for f in files {
        let n = std::fs::read_to_string(&f).expect("read").lines().count();
        assert!(n <= 900, "{}: {n} lines", f.display());
    }
}
