//! A GGUF file's metadata takes about the memory its bytes take (fault class 10): an 8 MB
//! `uint8` array used to become 32 bytes of RAM per byte. One test in this binary, so that the
//! process's peak resident memory is this conversion's.

use nibble_core::format::gguf_convert::{convert, ConvertOptions};
use nibble_core::io::machine::{peak_rss_bytes, reset_peak_rss};
use nibble_tests::gguf::{tiny_llama_gguf, write_gguf, Meta};

#[test]
fn a_large_metadata_array_costs_its_size_not_a_multiple() {
    const N: usize = 8 << 20;
    let dir = tempfile::tempdir().expect("tmp");
    let (mut meta, tensors) = tiny_llama_gguf();
    meta.push(("general.padding_blob", Meta::U8s(N)));
    // 1M ids of token types would be 8 MiB as u64s; keep a real one of the vocabulary's length.
    meta.push(("tokenizer.ggml.token_type", Meta::I32s(vec![1; 260])));
    let path = dir.path().join("m.gguf");
    write_gguf(&path, &meta, &tensors);
    let file_bytes = std::fs::metadata(&path).expect("size").len();
    assert!(file_bytes > N as u64);
    assert!(reset_peak_rss(), "this test needs /proc/self/clear_refs");
    let before = peak_rss_bytes().expect("VmHWM");
    convert(
        &path,
        &dir.path().join("out"),
        ConvertOptions::default(),
        |_, _, _| {},
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let grew = peak_rss_bytes().expect("VmHWM").saturating_sub(before);
    // The array itself (8 MiB), the tiny model's tensors and the writer's buffers: well under
    // 3 bytes of RAM per byte of file (it was 32).
    assert!(
        grew > N as u64 / 2,
        "peak RSS rose by {grew} bytes: the measurement does not see the 8 MiB array"
    );
    assert!(
        grew < 3 * file_bytes,
        "converting a {file_bytes}-byte GGUF raised peak RSS by {grew} bytes"
    );
}
