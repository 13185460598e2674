//! A model's folder, wherever it is: a local directory ([`crate::io::file::LocalFolder`]), an
//! HTTP base URL ([`crate::io::http::HttpFolder`]) or the browser's fetch of one (in
//! `nibble-web`). The one routine that opens a model ([`crate::io::model::open_model`]) and the
//! loaders of side files (tokenizers, generation and pooling configs) read through it, so that
//! the three never drift apart.
//!
//! Every name taken from a file (a shard index's `weight_map`, `modules.json`, a pipeline's
//! component folders) goes through [`check_name`] before it is joined to the folder: it must stay
//! inside it, after percent-decoding too.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::io::source::RangeSource;

/// A boxed future: the folder's methods are asynchronous so that the browser's `fetch` can
/// implement them; natively they are ready at once.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// Side files larger than this are refused (a `tokenizer.json` is a few MiB).
pub const SIDE_FILE_LIMIT: u64 = 64 << 20;

/// A weights file the folder has opened: its number among the opened files, its length and its
/// first (up to) 8 bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenedFile {
    /// Index among the files opened so far (the index of the source's file).
    pub index: usize,
    /// Length in bytes.
    pub len: u64,
    /// The first `min(8, len)` bytes.
    pub head: Vec<u8>,
}

/// Where a model's files come from.
pub trait ModelFolder: Send + Sync {
    /// The folder as the user named it (a path or URL).
    fn root(&self) -> &str;
    /// The full path or URL of `name`, for messages.
    fn locate(&self, name: &str) -> String;
    /// A small file of the folder, whole (`name` already checked by [`check_name`]); `None`
    /// when the folder has no such file. A file over `limit` bytes is an error.
    fn read_small<'a>(
        &'a self,
        name: &'a str,
        limit: u64,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>>>;
    /// Opens weights file `name` for reading; `None` when the folder has no such file. Any other
    /// failure (a server that ignores ranges, a file that is not a regular file) is an error.
    fn open_file<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<OpenedFile>>>;
    /// `len` bytes at `offset` of opened file `file`.
    fn read_at<'a>(
        &'a self,
        file: usize,
        offset: u64,
        len: u64,
        what: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u8>>>;
    /// The names of the `*.safetensors` files in the folder where it can be listed (a local
    /// directory); `None` where it cannot (a URL).
    fn list_safetensors(&self) -> Result<Option<Vec<String>>>;
    /// The source that streams the opened files, in the order they were opened.
    fn source(&self) -> Result<Arc<dyn RangeSource>>;
    /// The error for a file the folder does not have.
    fn missing(&self, name: &str) -> Error {
        Error::Model {
            file: self.locate(name),
            msg: "no such file".into(),
        }
    }
}

/// Checks that `name`, taken from a model's files, names something inside the folder: a
/// relative path of plain segments (no empty, `.` or `..` segment, no backslash, drive or scheme,
/// no control character), also after percent-decoding (a URL joined from it must not climb out
/// through `%2e%2e%2f`).
pub fn check_name(name: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::Invalid(format!(
            "'{name}' does not name a file inside the model folder ({why})"
        )))
    };
    // The name as written and as a server may decode it, once or again (`%252e` -> `%2e` -> `.`).
    let mut forms = vec![name.to_string()];
    while forms.len() < 4 {
        let next = percent_decode(forms.last().map(String::as_str).unwrap_or(""));
        if forms.contains(&next) {
            break;
        }
        forms.push(next);
    }
    for form in forms {
        if form.is_empty() {
            return bad("empty");
        }
        if form.starts_with('/') {
            return bad("an absolute path");
        }
        if form.contains('\\') || form.contains(':') {
            return bad("a backslash, drive or scheme");
        }
        if form.chars().any(|c| c.is_control()) {
            return bad("a control character");
        }
        if form
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
        {
            return bad("an empty, '.' or '..' segment");
        }
    }
    Ok(())
}

/// `%XX` sequences decoded (invalid ones left as they are); bytes that do not make UTF-8 are
/// replaced.
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `name`'s segments percent-encoded for a URL path (everything but unreserved characters).
pub fn percent_encode_path(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.bytes() {
        match c {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => {
                out.push(c as char)
            }
            _ => out.push_str(&format!("%{c:02X}")),
        }
    }
    out
}

/// Waits for a folder future natively (local and HTTP folders finish their work before their
/// futures are first polled).
#[cfg(feature = "native")]
pub fn block_on<F: Future>(f: F) -> F::Output {
    pollster::block_on(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_leave_the_folder_are_refused() {
        for ok in [
            "model.safetensors",
            "1_Pooling/config.json",
            "text_encoder_2/model-00001-of-00002.safetensors",
            "a b.json",
        ] {
            check_name(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "",
            "/etc/passwd",
            "../other/model.safetensors",
            "a/../../b",
            "a//b",
            "./a",
            "C:\\x",
            "https://evil/x",
            "%2e%2e%2fother%2fmodel-00002-of-00002.safetensors",
            "%2E%2E/x",
            "a%2f..%2f..%2fb",
            "a\u{0}b",
        ] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn percent_coding_round_trips() {
        assert_eq!(percent_decode("a%20b%2Fc%zz%"), "a b/c%zz%");
        assert_eq!(percent_encode_path("dir/a b+c.json"), "dir/a%20b%2Bc.json");
        assert_eq!(
            percent_decode(&percent_encode_path("x y/ü.json")),
            "x y/ü.json"
        );
    }
}
