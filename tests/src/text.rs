//! Tokenizer files for tests of the text path.

use serde_json::{json, Map, Value};

/// Id of the byte-fallback token `<0xNN>` in [`byte_fallback_tokenizer`].
pub fn byte_id(b: u8) -> u32 {
    3 + u32::from(b)
}

/// Ids of `s` spelled as byte-fallback tokens.
pub fn byte_ids(s: &str) -> Vec<u32> {
    s.bytes().map(byte_id).collect()
}

/// Id of `"\u{2581}a"` (" a") in [`byte_fallback_tokenizer`]; `+ 1` is `"b"`, `+ 2` is `"\u{e9}"`.
pub const WORD_A: u32 = 259;

/// A SentencePiece-style `tokenizer.json` of `vocab` tokens (at least 262), as Llama-2, Mistral
/// and TinyLlama ship theirs: BPE with byte fallback and the Replace / ByteFallback / Fuse /
/// Strip decoder. Ids: `<unk>`, `<s>`, `</s>`, the 256 bytes `<0x00>`..`<0xFF>`, `" a"`, `"b"`,
/// `"\u{e9}"`, then words, half of them ASCII and half CJK.
pub fn byte_fallback_tokenizer(vocab: u32) -> Value {
    assert!(vocab >= 262, "a byte-fallback vocabulary of {vocab} tokens");
    let mut words: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    words.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    words.extend(["\u{2581}a", "b", "\u{e9}"].map(String::from));
    for k in 262..vocab {
        words.push(if k % 2 == 0 {
            format!("\u{2581}w{k}")
        } else {
            format!("\u{4e2d}{k}")
        });
    }
    let v: Map<String, Value> = words
        .into_iter()
        .enumerate()
        .map(|(i, w)| (w, i.into()))
        .collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": null,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": v, "merges": []}
    })
}
