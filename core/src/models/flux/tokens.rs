//! The two prompt tokenizers of a Flux pipeline, as `FluxPipeline` calls them. CLIP
//! (`tokenizer/`): the byte-level BPE of `vocab.json` and `merges.txt` with `</w>` word ends,
//! lower-cased text with runs of whitespace made one space, CLIP's word pattern, then
//! `<|startoftext|>`, at most `max_length - 2` tokens, `<|endoftext|>`, padded to `max_length`
//! (77) with the pad token. T5 (`tokenizer_2/`): `tokenizer.json` through the `tokenizers` crate
//! with its `</s>`, truncated and padded to `max_sequence_length`.

use crate::error::{Error, Result};
use crate::models::text::guarded;

fn err(file: &str, e: impl std::fmt::Display) -> Error {
    Error::Model {
        file: file.to_string(),
        msg: e.to_string(),
    }
}

/// CLIP's split of lower-cased text into words (transformers' `CLIPTokenizer.pat`).
const CLIP_PATTERN: &str =
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";

/// A special token as a tokenizer config writes it: a string or `{"content": ...}`.
fn special(cfg: &serde_json::Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        v => v.get("content")?.as_str().map(String::from),
    }
}

/// CLIP's tokenizer.
pub struct ClipTokenizer {
    tok: tokenizers::Tokenizer,
    bos: u32,
    eos: u32,
    pad: u32,
    max_length: usize,
}

impl std::fmt::Debug for ClipTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClipTokenizer")
            .field("max_length", &self.max_length)
            .finish()
    }
}

impl ClipTokenizer {
    /// From the bytes of `vocab.json`, `merges.txt` and `tokenizer_config.json` (its special
    /// tokens and `model_max_length`; `special_tokens_map.json`'s may be merged in by the
    /// caller). The special tokens must be in the vocabulary.
    pub fn from_files(vocab: &[u8], merges: &[u8], config: &serde_json::Value) -> Result<Self> {
        let vocab: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(vocab).map_err(|e| err("tokenizer/vocab.json", e))?;
        let merges_text =
            std::str::from_utf8(merges).map_err(|e| err("tokenizer/merges.txt", e))?;
        let merges: Vec<&str> = merges_text
            .lines()
            .filter(|l| !l.starts_with("#version") && !l.trim().is_empty())
            .collect();
        for (i, m) in merges.iter().enumerate() {
            if m.split(' ').count() != 2 {
                return Err(err(
                    "tokenizer/merges.txt",
                    format!("line {}: '{m}' is not two symbols", i + 1),
                ));
            }
        }
        let id = |key: &str, default: &str| -> Result<u32> {
            let t = special(config, key).unwrap_or_else(|| default.to_string());
            vocab
                .get(&t)
                .and_then(|v| v.as_u64())
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| {
                    err(
                        "tokenizer/vocab.json",
                        format!("the {key} '{t}' is not in the vocabulary"),
                    )
                })
        };
        let bos = id("bos_token", "<|startoftext|>")?;
        let eos = id("eos_token", "<|endoftext|>")?;
        let pad = id("pad_token", "<|endoftext|>")?;
        let max_length = config
            .get("model_max_length")
            .and_then(|v| v.as_u64())
            .filter(|&n| (3..=4096).contains(&n))
            .unwrap_or(77) as usize;
        let unk = special(config, "unk_token").unwrap_or_else(|| "<|endoftext|>".into());
        // transformers' CLIPTokenizerFast pipeline, written as a tokenizer.json.
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "NFC"},
                {"type": "Replace", "pattern": {"Regex": r"\s+"}, "content": " "},
                {"type": "Lowercase"}
            ]},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": CLIP_PATTERN}, "behavior": "Removed",
                 "invert": true},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                 "use_regex": false}
            ]},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                        "use_regex": false},
            "model": {"type": "BPE", "dropout": null, "unk_token": unk,
                      "continuing_subword_prefix": "", "end_of_word_suffix": "</w>",
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges}
        });
        let tok = crate::models::text::parse_tokenizer(json.to_string().as_bytes(), "tokenizer/")?;
        Ok(ClipTokenizer {
            tok,
            bos,
            eos,
            pad,
            max_length,
        })
    }

    /// The padded ids of `text` (`max_length` of them) and how many tokens the text had before
    /// truncation.
    pub fn encode(&self, text: &str) -> Result<(Vec<u32>, usize)> {
        let e = guarded("tokenizer/", || self.tok.encode(text.trim(), false))?;
        let words = e.get_ids();
        let keep = words.len().min(self.max_length - 2);
        let mut ids = Vec::with_capacity(self.max_length);
        ids.push(self.bos);
        ids.extend_from_slice(&words[..keep]);
        ids.push(self.eos);
        ids.resize(self.max_length, self.pad);
        Ok((ids, words.len()))
    }

    /// The id of `<|endoftext|>` (the pooled output is taken at its first position).
    pub fn eos(&self) -> u32 {
        self.eos
    }
}

/// T5's tokenizer, truncating and padding to a fixed length.
pub struct T5Tokenizer {
    tok: tokenizers::Tokenizer,
    /// The file it came from, named in errors.
    file: String,
}

impl std::fmt::Debug for T5Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("T5Tokenizer").finish()
    }
}

impl T5Tokenizer {
    /// From the bytes of `tokenizer.json` and the pad id (`tokenizer_config.json`'s pad token,
    /// 0 for T5).
    pub fn from_json(tokenizer_json: &[u8], file: &str) -> Result<Self> {
        let tok = crate::models::text::parse_tokenizer(tokenizer_json, file)?;
        Ok(T5Tokenizer {
            tok,
            file: file.to_string(),
        })
    }

    /// The ids of `text` with `</s>`, truncated to `max_len` (the `</s>` kept) and padded with
    /// `<pad>` to `max_len`; and the untruncated length (with `</s>`).
    pub fn encode(&self, text: &str, max_len: usize) -> Result<(Vec<u32>, usize)> {
        if max_len == 0 {
            return Err(Error::Invalid(
                "max_sequence_length must be at least 1".into(),
            ));
        }
        let mut tok = self.tok.clone();
        tok.with_truncation(None).map_err(|e| err(&self.file, e))?;
        tok.with_padding(None);
        let full = guarded(&self.file, || tok.encode(text, true))?;
        let n = full.get_ids().len();
        tok.with_truncation(Some(tokenizers::TruncationParams {
            max_length: max_len,
            ..Default::default()
        }))
        .map_err(|e| err(&self.file, e))?;
        let pad_id = tok.token_to_id("<pad>").unwrap_or(0);
        tok.with_padding(Some(tokenizers::PaddingParams {
            strategy: tokenizers::PaddingStrategy::Fixed(max_len),
            pad_id,
            pad_token: "<pad>".into(),
            ..Default::default()
        }));
        let e = guarded(&self.file, || tok.encode(text, true))?;
        Ok((e.get_ids().to_vec(), n))
    }
}
