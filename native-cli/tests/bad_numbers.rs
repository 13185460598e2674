//! Numerical health (fault classes 12 and 13): a weight that is NaN or infinite in the file, or
//! finite weights whose results overflow, stop `nibble run` with an error that names the tensor
//! (and the step or position), never with plausible tokens, latents or embeddings and exit 0.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn nibble(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(args)
        .output()
        .expect("run nibble")
}

fn fixture(rel: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures")
        .join(rel);
    assert!(p.is_dir(), "shared fixture missing at {}", p.display());
    p
}

/// A copy of a fixture's model folder with `tensor`'s f32 values replaced by `value`.
fn poked(model: &str, tensor: &str, value: f32) -> tempfile::TempDir {
    poked_all(model, &[tensor], value)
}

/// A copy of a fixture's model folder with each of `tensors`' f32 values replaced by `value`.
fn poked_all(model: &str, tensors: &[&str], value: f32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    for e in std::fs::read_dir(fixture(model)).expect("model folder") {
        let e = e.expect("entry");
        let to = dir.path().join(e.file_name());
        if e.path().is_dir() {
            std::fs::create_dir(&to).expect("mkdir");
            for f in std::fs::read_dir(e.path()).expect("subfolder") {
                let f = f.expect("entry");
                std::fs::copy(f.path(), to.join(f.file_name())).expect("copy");
            }
        } else {
            std::fs::copy(e.path(), &to).expect("copy");
        }
    }
    let file = std::fs::read_dir(dir.path())
        .expect("copy")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .expect("a safetensors file");
    let index = nibble_core::io::model::ModelIndex::open(&file).expect("open copy");
    let mut bytes = std::fs::read(&file).expect("read");
    for tensor in tensors {
        let e = index.require(tensor).expect("tensor").clone();
        assert_eq!(e.dtype, nibble_core::format::dtype::Dtype::F32, "{tensor}");
        for c in bytes[e.offset as usize..(e.offset + e.len) as usize].chunks_exact_mut(4) {
            c.copy_from_slice(&value.to_le_bytes());
        }
    }
    std::fs::write(&file, bytes).expect("write");
    dir
}

/// Runs `nibble run` and asserts a one-line error containing each of `want`.
fn refused(args: &[&str], want: &[&str]) {
    let o = nibble(args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(
        o.status.code(),
        Some(1),
        "{args:?} exited {:?}: {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for w in want {
        assert!(err.contains(w), "{args:?}: no '{w}' in: {err}");
    }
}

fn llm(model: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["run", "--model"].map(String::from).to_vec();
    a.push(model.to_str().expect("utf8").into());
    a.extend(
        ["--prompt-ids", "1,2,3", "--max-tokens", "3"]
            .iter()
            .chain(extra)
            .map(|s| s.to_string()),
    );
    a
}

/// The backends present on this machine, by their `--backend` names: the two CPU backends
/// always, wgpu and CUDA where an adapter or device is found (required where CI says so).
fn present_backends() -> Vec<&'static str> {
    let mut v = vec!["cpu-ref", "cpu"];
    if nibble_tests::wgpu_or_absent("bad numbers").is_some() {
        v.push("wgpu");
    }
    if nibble_tests::cuda_or_absent("bad numbers").is_some() {
        v.push("cuda");
    }
    v
}

/// Streaming every group through a ring of two 64 KiB slots.
const STREAMED: [&str; 5] = ["--stream-all", "--slots", "2", "--slot-size", "64KiB"];

fn run(args: Vec<String>, want: &[&str]) {
    let refs: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    refused(&refs, want);
}

#[test]
fn non_finite_weights_in_the_file_are_named_on_every_backend_and_placement() {
    let cases = [
        // Double quantization: absmax is rebuilt from the nested absmax.
        ("model.layers.1.mlp.up_proj.weight.nested_absmax", f32::NAN),
        (
            "model.layers.0.self_attn.q_proj.weight.quant_map",
            f32::INFINITY,
        ),
        ("model.layers.0.input_layernorm.weight", f32::NEG_INFINITY),
        ("model.embed_tokens.weight", f32::NAN),
        ("lm_head.weight", f32::NAN),
    ];
    let backends = present_backends();
    for (tensor, value) in cases {
        let d = poked("tiny-llama-nf4/model", tensor, value);
        let weight = tensor
            .trim_end_matches(".nested_absmax")
            .trim_end_matches(".quant_map");
        // Every backend present, each both resident and streamed through a small ring.
        for &backend in &backends {
            for streamed in [false, true] {
                let mut extra = vec!["--backend", backend];
                if streamed {
                    extra.extend(STREAMED);
                }
                run(llm(d.path(), &extra), &[weight, "not a finite number"]);
            }
        }
    }
}

#[test]
fn finite_weights_whose_results_overflow_stop_the_run_naming_the_output() {
    // 1e30 in a norm: attention scores overflow to infinity, softmax gives NaN.
    let d = poked(
        "tiny-llama-nf4/model",
        "model.layers.0.input_layernorm.weight",
        1e30,
    );
    let backends = present_backends();
    for &backend in &backends {
        run(
            llm(d.path(), &["--backend", backend]),
            &["logits", "not a finite number"],
        );
    }

    let d = poked_all(
        "tiny-dit-nf4/model",
        &[
            "single_transformer_blocks.0.attn.norm_q.weight",
            "single_transformer_blocks.0.attn.norm_k.weight",
        ],
        1e30,
    );
    let m = d.path().to_str().expect("utf8").to_string();
    for &backend in &backends {
        refused(
            &["run", "--model", &m, "--steps", "2", "--backend", backend],
            &["step 1 of 2", "not a finite number"],
        );
    }

    let d = poked("minilm-nf4/model", "embeddings.LayerNorm.weight", 1e30);
    let m = d.path().to_str().expect("utf8").to_string();
    for &backend in &backends {
        refused(
            &[
                "run",
                "--model",
                &m,
                "--prompt",
                "a sentence",
                "--backend",
                backend,
            ],
            &["not a finite number"],
        );
    }
}
