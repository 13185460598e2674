//! The house rules, checked on the source: every layer folder of `core/src` says in its module
//! doc what it owns and what it may import, and imports nothing else (so the layers cannot form
//! a circle); product code does not import `tooling`; in `core/src`, `native-cli/src` and
//! `web/src` no two modules of a folder import each other in a circle, every folder's module
//! doc says what it owns, and no file is over 900 lines.

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

/// The source folders of the product crates: core, the CLI, the browser engine.
fn product_srcs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    ["core/src", "native-cli/src", "web/src"]
        .iter()
        .map(|d| root.join(d))
        .collect()
}

#[test]
fn no_product_file_is_over_900_lines() {
    for src in product_srcs() {
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        assert!(!files.is_empty(), "no sources under {}", src.display());
        for f in files {
            let n = std::fs::read_to_string(&f).expect("read").lines().count();
            assert!(n <= 900, "{}: {n} lines", f.display());
        }
    }
}

/// A file's module path under its crate root (`backend/cpu/ops.rs` is `[backend, cpu, ops]`;
/// `mod.rs`, `lib.rs` and `main.rs` are their folder's module).
fn module_path(src: &Path, f: &Path) -> Vec<String> {
    let rel = f.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_str().expect("utf8").to_string())
        .collect();
    let last = parts.pop().expect("a file");
    let stem = last.trim_end_matches(".rs");
    if !["mod", "lib", "main"].contains(&stem) {
        parts.push(stem.to_string());
    }
    parts
}

/// The modules a file's code names (`crate::a::b`, `super::x`), as paths from the crate root.
/// Comments are left out (a doc link imports nothing), and so are the file's unit tests (from
/// `#[cfg(test)]` on: their `super` is the file).
fn named_modules(path: &[String], text: &str) -> Vec<Vec<String>> {
    let code: String = text
        .split("#[cfg(test)]")
        .next()
        .unwrap_or("")
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let text = code.as_str();
    let ident = |s: &str| -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = s;
        loop {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name.is_empty() || !name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                break;
            }
            rest = &rest[name.len()..];
            out.push(name);
            match rest.strip_prefix("::") {
                Some(r) => rest = r,
                None => break,
            }
        }
        out
    };
    // `base` and the path after it, or each path of a `{a::x, b}` group after it.
    let paths = |base: &[String], rest: &str, found: &mut Vec<Vec<String>>| {
        let mut p = base.to_vec();
        p.extend(ident(rest));
        found.push(p);
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let end = group
                .char_indices()
                .find(|&(_, c)| {
                    depth += match c {
                        '{' => 1,
                        '}' => -1,
                        _ => 0,
                    };
                    depth < 0
                })
                .map_or(group.len(), |(i, _)| i);
            for item in group[..end].split(',') {
                let mut p = base.to_vec();
                p.extend(ident(item.trim()));
                found.push(p);
            }
        }
    };
    let mut found = Vec::new();
    for (i, _) in text.match_indices("crate::") {
        if i > 0 && text[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        paths(&[], &text[i + 7..], &mut found);
    }
    for (i, _) in text.match_indices("super::") {
        if i > 0 && text[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        {
            continue;
        }
        // A module's `super` is its path less its last name (for `a/mod.rs`, module `a`, and
        // for `a/b.rs`, module `a::b`, alike).
        let mut base: Vec<String> = path.to_vec();
        let mut rest = &text[i..];
        while let Some(r) = rest.strip_prefix("super::") {
            base.pop();
            rest = r;
        }
        paths(&base, rest, &mut found);
    }
    found
}

/// Per folder (a module with sub-modules): edges between its child modules, from every name a
/// module below one child gives of a module below another.
fn sibling_edges(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<(String, String)>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_path(src, f)).collect();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<(String, String)>> = BTreeMap::new();
    for f in &files {
        let from = module_path(src, f);
        let text = std::fs::read_to_string(f).expect("read");
        for mut to in named_modules(&from, &text) {
            // The longest prefix that is a module: `crate::plan::fmt_bytes` names `plan`.
            while !to.is_empty() && !modules.contains(&to) {
                to.pop();
            }
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common < from.len() && common < to.len() {
                edges
                    .entry(from[..common].to_vec())
                    .or_default()
                    .insert((from[common].clone(), to[common].clone()));
            }
        }
    }
    edges
}

/// A circle among `edges`, as the modules on it, if there is one.
fn circle(edges: &BTreeSet<(String, String)>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        edges: &BTreeSet<(String, String)>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = stack.iter().position(|s| s == n) {
            let mut c = stack[i..].to_vec();
            c.push(n.to_string());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        stack.push(n.to_string());
        for (a, b) in edges {
            if a == n {
                if let Some(c) = visit(b, edges, stack, done) {
                    return Some(c);
                }
            }
        }
        stack.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for (a, _) in edges {
        if let Some(c) = visit(a, edges, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

#[test]
fn no_two_modules_of_a_folder_import_each_other_in_a_circle() {
    for src in product_srcs() {
        let edges = sibling_edges(&src);
        // The check sees edges: core's layers name each other (plan -> backend, exec -> plan).
        assert!(
            !edges.is_empty(),
            "no module of {} names another",
            src.display()
        );
        let circles: Vec<String> = edges
            .iter()
            .filter_map(|(folder, e)| {
                circle(e).map(|c| format!("'{}': {}", folder.join("/"), c.join(" -> ")))
            })
            .collect();
        assert!(
            circles.is_empty(),
            "{}: modules of a folder import each other in a circle:\n{}",
            src.display(),
            circles.join("\n")
        );
    }
}

#[test]
fn the_circle_check_finds_a_circle() {
    let e: BTreeSet<(String, String)> = [("image", "ops"), ("ops", "image"), ("ops", "kernels")]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert!(circle(&e).is_some_and(|c| c.len() == 3));
    let path = ["backend", "cpu", "ops"].map(String::from);
    let named = named_modules(&path, "use super::image::conv2d;");
    assert_eq!(
        named,
        vec![["backend", "cpu", "image", "conv2d"]
            .map(String::from)
            .to_vec()]
    );
    let named = named_modules(&path, "use super::{dense::x, Out};");
    assert!(named.contains(&["backend", "cpu", "dense", "x"].map(String::from).to_vec()));
    let named = named_modules(&path[..2], "use super::kernels::x; crate::plan::y");
    assert_eq!(
        named,
        vec![
            vec!["plan".to_string(), "y".to_string()],
            ["backend", "kernels", "x"].map(String::from).to_vec()
        ]
    );
}

#[test]
fn every_folder_says_what_it_owns() {
    for src in product_srcs() {
        let mut dirs = vec![src.clone()];
        while let Some(d) = dirs.pop() {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(&d)
                .expect("read dir")
                .map(|e| e.expect("entry").path())
                .collect();
            entries.sort();
            let module = ["mod.rs", "lib.rs", "main.rs"]
                .iter()
                .map(|f| d.join(f))
                .find(|p| p.exists())
                .unwrap_or_else(|| panic!("{}: no mod.rs", d.display()));
            let text = std::fs::read_to_string(&module).expect("read");
            let doc: Vec<&str> = text.lines().take_while(|l| l.starts_with("//!")).collect();
            let words: usize = doc.iter().map(|l| l.split_whitespace().count() - 1).sum();
            assert!(
                words >= 8,
                "{}: the module doc says what the folder owns (a sentence or more)",
                module.display()
            );
            dirs.extend(entries.into_iter().filter(|p| p.is_dir()));
        }
    }
}

/// The README is the entry, under 400 lines; the reference lives in `docs/`: every page there is
/// linked from the README, and every `docs/` page the README links exists.
#[test]
fn the_readme_is_an_entry_and_links_every_doc() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let n = readme.lines().count();
    assert!(
        n < 400,
        "README.md has {n} lines: move reference material to docs/"
    );
    let mut pages: Vec<String> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".md"))
        .collect();
    pages.sort();
    assert!(!pages.is_empty(), "docs/ has no pages");
    for p in &pages {
        assert!(
            readme.contains(&format!("(docs/{p}")),
            "docs/{p} is not linked from README.md"
        );
    }
    for (i, _) in readme.match_indices("(docs/") {
        let target: String = readme[i + 1..]
            .chars()
            .take_while(|c| *c != ')' && *c != '#')
            .collect();
        assert!(
            root.join(&target).is_file(),
            "README.md links {target}, which does not exist"
        );
    }
}
