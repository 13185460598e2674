//! The second hardening round (#32): each test covers one fault class by its mechanism.

use std::process::{Command, Output};

fn nibble(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(args)
        .output()
        .expect("run nibble")
}

use nibble_tests::fixture;

/// The stderr of a run that must be refused with one error (exit 1); `what` names it in a failure.
fn refused(o: &Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(1), "{what}: {err}");
    err
}

/// Fault 17: `--steps` is bounded by one parser (1 to 100,000) for every subcommand that
/// denoises, so a Flux pipeline's `run`, `plan` and `demo` refuse 2^64 - 1 and 2^32 with one
/// line instead of a capacity-overflow panic or an abort; the schedule itself refuses them too.
#[test]
fn denoising_steps_are_bounded_everywhere() {
    let flux = fixture("tiny-flux-pipeline/pipeline");
    let flux = flux.to_str().expect("utf-8");
    for steps in ["18446744073709551615", "4294967296", "0", "100001"] {
        for cmd in ["run", "plan"] {
            let o = nibble(&[
                cmd,
                "--model",
                flux,
                "--prompt",
                "a fox",
                "--height",
                "32",
                "--width",
                "32",
                "--steps",
                steps,
                "--out",
                "/tmp/never-written.png",
            ]);
            let err = refused(&o, &format!("{cmd} --steps {steps}"));
            assert!(
                err.contains("from 1 to 100000") && !err.contains("panicked"),
                "{cmd} --steps {steps}: {err}"
            );
        }
        let o = nibble(&["demo", "--steps", steps, "--cache-dir", "/nonexistent"]);
        let err = refused(&o, &format!("demo --steps {steps}"));
        assert!(
            err.contains("from 1 to 100000"),
            "demo --steps {steps}: {err}"
        );
    }
    let e = nibble_core::models::scheduler::SchedulerConfig::default()
        .pipeline_sigmas(1 << 32, 0.0)
        .expect_err("2^32 steps");
    assert!(e.to_string().contains("between 1 and 100000"), "{e}");
}

/// Fault 16: without XDG_RUNTIME_DIR every run used to leave an empty `nibble-xdg-PID` folder
/// in the temporary directory at a predictable path; the private folder is now new (never
/// reused), 0700, and removed when the run ends.
#[test]
fn no_runtime_folder_is_left_behind() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = fixture("tiny-llama-nf4/model");
    for _ in 0..3 {
        let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
            .args(["inspect", model.to_str().expect("utf-8")])
            .env_remove("XDG_RUNTIME_DIR")
            .env("TMPDIR", tmp.path())
            .output()
            .expect("run nibble");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    // Stopped by a signal: a file server by SIGTERM (it returns from main), a long synth by
    // SIGTERM and by SIGINT (the folder is removed in the handler, the process dies of the
    // signal as before).
    let dir = tmp.path().join("served");
    std::fs::create_dir(&dir).expect("mkdir");
    let out = tmp.path().join("synth-out");
    let (d, o) = (dir.display().to_string(), out.display().to_string());
    let serve = ["serve", &d, "--addr", "127.0.0.1:0"];
    let synth = ["synth", "--arch", "llama", "-o", &o, "--size", "2GiB"];
    let runs: [(&[&str], i32); 3] = [
        (&serve, libc::SIGTERM),
        (&synth, libc::SIGTERM),
        (&synth, libc::SIGINT),
    ];
    for (args, sig) in runs {
        let _ = std::fs::remove_dir_all(&out);
        let mut child = Command::new(env!("CARGO_BIN_EXE_nibble"))
            .args(args)
            .env_remove("XDG_RUNTIME_DIR")
            .env("TMPDIR", tmp.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn nibble");
        // Until its runtime folder exists (made first thing in main), then a little longer.
        let t0 = std::time::Instant::now();
        while !runtime_folders(tmp.path()) && t0.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(
            child.try_wait().expect("wait").is_none(),
            "{args:?} ended before the signal"
        );
        // SAFETY: a plain kill(2) of our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, sig) };
        let status = child.wait().expect("wait");
        assert!(
            !runtime_folders(tmp.path()),
            "{args:?} stopped by signal {sig} ({status:?}) left its runtime folder"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&dir);
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .expect("read")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Whether a `nibble-xdg-*` folder is in `dir`.
fn runtime_folders(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir).expect("read").any(|e| {
        e.expect("entry")
            .file_name()
            .to_string_lossy()
            .starts_with("nibble-xdg-")
    })
}

/// A `Precompiled` normalizer whose charsmap claims a trie larger than its bytes (the
/// tokenizers crate panics parsing it).
fn broken_charsmap() -> serde_json::Value {
    let mut bytes = 1_000_000u32.to_le_bytes().to_vec();
    bytes.extend([0u8; 36]);
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    serde_json::json!({"type": "Precompiled", "precompiled_charsmap": b64})
}

/// Fault 18: a third-party parser's panic (the tokenizers crate on a malformed
/// `precompiled_charsmap`) becomes an error naming the file: `run` and `plan` of an LLM and of a
/// Flux pipeline exit 1 with one message, no panic.
#[test]
fn a_malformed_tokenizer_is_an_error_naming_the_file() {
    let tmp = tempfile::tempdir().expect("tmp");
    // A Llama with a SentencePiece-style tokenizer.json that has the broken normalizer.
    let llm = tmp.path().join("llm");
    nibble_tests::copy_dir(&fixture("tiny-llama-nf4/model"), &llm);
    let mut tok = nibble_tests::text::byte_fallback_tokenizer(300);
    tok["normalizer"] = broken_charsmap();
    std::fs::write(llm.join("tokenizer.json"), tok.to_string()).expect("write");
    // A Flux pipeline whose T5 tokenizer has it.
    let flux = tmp.path().join("flux");
    nibble_tests::copy_dir(&fixture("tiny-flux-pipeline/pipeline"), &flux);
    let p = flux.join("tokenizer_2/tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&p).expect("read")).expect("json");
    tok["normalizer"] = broken_charsmap();
    std::fs::write(&p, tok.to_string()).expect("write");
    let (l, f) = (llm.to_str().expect("utf8"), flux.to_str().expect("utf8"));
    for (args, file) in [
        (
            vec!["run", "--model", l, "--prompt", "hi", "--max-tokens", "1"],
            "tokenizer.json",
        ),
        (
            vec!["plan", "--model", l, "--prompt", "hi"],
            "tokenizer.json",
        ),
        (
            vec!["serve", "--model", l, "--addr", "127.0.0.1:0"],
            "tokenizer.json",
        ),
        (vec!["plan", "--model", f], "tokenizer_2/tokenizer.json"),
        (
            vec![
                "run", "--model", f, "--prompt", "a cat", "--steps", "1", "--out", "x.png",
            ],
            "tokenizer_2/tokenizer.json",
        ),
    ] {
        let out = nibble(&args);
        let err = refused(&out, &format!("{args:?}"));
        assert!(
            err.contains(file) && err.contains("tokenizer"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked at"), "{args:?}: {err}");
    }
}

/// Faults 14 and 22: `synth` writes a model only into a new or empty folder or one nibble wrote
/// before (whose old files it removes first: no stale shard index or config is left beside the
/// new model), refuses a folder holding someone else's files, and refuses a size larger than
/// the disk's free space before listing a tensor.
#[test]
fn model_outputs_own_their_folder_and_fit_the_disk() {
    let tmp = tempfile::tempdir().expect("tmp");
    let out = tmp.path().join("m");
    let o = |args: &[&str]| nibble(&[&["synth", "-o", out.to_str().expect("utf8")], args].concat());
    let r = o(&["--arch", "llama", "--size", "2MiB"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(out.join("model.safetensors").is_file());
    // Again, another model: the llama's files are gone, the Wan folder alone is there.
    let r = o(&["--arch", "wan", "--size", "1MiB", "--vae-base-dim", "8"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(!out.join("model.safetensors").exists() && !out.join("config.json").exists());
    assert!(out.join("model_index.json").is_file());
    // Someone else's folder is refused, untouched.
    let theirs = tmp.path().join("theirs");
    std::fs::create_dir(&theirs).expect("mkdir");
    std::fs::write(theirs.join("model.safetensors"), b"keep").expect("write");
    let r = nibble(&[
        "synth",
        "--arch",
        "llama",
        "--size",
        "2MiB",
        "-o",
        theirs.to_str().expect("utf8"),
    ]);
    let err = refused(&r, "");
    assert!(
        err.contains("already holds") && err.contains("model.safetensors"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(theirs.join("model.safetensors")).expect("read"),
        b"keep"
    );
    // convert follows the same rule: into nibble's own folder (the Wan folder above) it
    // replaces every old file; into someone else's it is refused, their file untouched.
    let gguf = tmp.path().join("m.gguf");
    let (meta, tensors) = nibble_tests::gguf::tiny_llama_gguf();
    nibble_tests::gguf::write_gguf(&gguf, &meta, &tensors);
    let g = gguf.to_str().expect("utf8");
    let r = nibble(&["convert", g, "-o", out.to_str().expect("utf8")]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(out.join("model.safetensors").is_file() && out.join("tokenizer.json").is_file());
    assert!(!out.join("model_index.json").exists() && !out.join("transformer").exists());
    let r = nibble(&["convert", g, "-o", theirs.to_str().expect("utf8")]);
    let err = refused(&r, "");
    assert!(err.contains("already holds"), "{err}");
    assert_eq!(
        std::fs::read(theirs.join("model.safetensors")).expect("read"),
        b"keep"
    );
    // 3 TiB: refused at once for the disk's free space, nothing written; 50 TiB by synth's
    // own bound (whatever the disk says).
    let big = tmp.path().join("big");
    for (size, why) in [("3TiB", "free"), ("50TiB", "at most 4 TiB")] {
        let t0 = std::time::Instant::now();
        let r = nibble(&[
            "synth",
            "--arch",
            "llama",
            "--size",
            size,
            "-o",
            big.to_str().expect("utf8"),
        ]);
        let err = refused(&r, "");
        assert!(err.contains(why), "{size}: {err}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
    }
    assert!(!big.exists());
}

/// Fault 19: ring and reader flags are bounded by the one set of parsers in `args.rs` for every
/// subcommand: `bench stream --slot-size 0` no longer loops on empty chunks, `--readers 100000`
/// no longer panics spawning threads; each is refused with one line naming the range.
#[test]
fn ring_and_reader_flags_are_bounded() {
    let model = fixture("tiny-llama-nf4/model");
    let m = model.to_str().expect("utf8");
    for (flag, value, says) in [
        ("--slot-size", "0", "at least"),
        ("--slot-size", "8GiB", "at most"),
        ("--readers", "0", "1 to 64"),
        ("--readers", "100000", "1 to 64"),
        ("--readers", "4294967296", "1 to 64"),
        ("--slots", "0", "1 to 4096"),
    ] {
        let t0 = std::time::Instant::now();
        let o = nibble(&["bench", "stream", "--model", m, flag, value]);
        let err = refused(&o, &format!("{flag} {value}"));
        assert!(
            err.contains(flag) && err.contains(says),
            "{flag} {value}: {err}"
        );
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
    }
    // The same parsers behind `run`'s memory flags.
    for (flag, value) in [
        ("--slot-size", "0"),
        ("--slot-size", "1TiB"),
        ("--slots", "0"),
    ] {
        let o = nibble(&["run", "--model", m, "--prompt-ids", "1", flag, value]);
        refused(&o, &format!("{flag} {value}"));
    }
    let o = nibble(&[
        "bench",
        "stream",
        "--model",
        m,
        "--readers",
        "64",
        "--steps",
        "1",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `nibble ARGS` under `ulimit -v KB`.
fn nibble_limited(kb: u64, args: &[&str]) -> Output {
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    Command::new("sh")
        .args([
            "-c",
            &format!(
                "ulimit -v {kb} && exec '{}' {}",
                env!("CARGO_BIN_EXE_nibble"),
                quoted.join(" ")
            ),
        ])
        .output()
        .expect("sh")
}

/// Fault 20: the `auto` host budget is capped by the address-space limit (`ulimit -v`), and
/// planned allocations are checked and fallible: under a 3 GB limit a ring of 4 x 1 GiB, a DiT's
/// 1e8 text tokens and `bench stream`'s 2 GiB slots are errors naming what did not fit, never
/// an abort. Fault 21: `plan` of a lone DiT draws no inputs (2e7 text tokens are planned, and
/// refused for the memory the run would need, without allocating them).
#[test]
fn an_address_space_limit_caps_the_budget_and_planning_allocates_nothing() {
    let llm = fixture("tiny-llama-nf4/model");
    let dit = fixture("tiny-dit-nf4/model");
    let (l, d) = (llm.to_str().expect("utf8"), dit.to_str().expect("utf8"));
    let plan = nibble_limited(3_000_000, &["plan", "--model", l]);
    let out =
        String::from_utf8_lossy(&plan.stdout).to_string() + &String::from_utf8_lossy(&plan.stderr);
    assert!(plan.status.success(), "{out}");
    assert!(
        out.contains("RLIMIT_AS"),
        "the budget names the limit: {out}"
    );
    for args in [
        vec![
            "run",
            "--model",
            l,
            "--prompt-ids",
            "1",
            "--max-tokens",
            "1",
            "--slots",
            "4",
            "--slot-size",
            "1GiB",
            "--stream-all",
        ],
        vec![
            "run",
            "--model",
            d,
            "--text-len",
            "100000000",
            "--steps",
            "1",
        ],
        vec![
            "bench",
            "stream",
            "--model",
            l,
            "--slot-size",
            "2GiB",
            "--steps",
            "1",
        ],
    ] {
        let o = nibble_limited(3_000_000, &args);
        let err = refused(&o, &format!("{args:?}"));
        assert!(err.contains("error:"), "{args:?}: {err}");
        assert!(!err.contains("memory allocation of"), "{args:?}: {err}");
    }
    let o = nibble_limited(1_500_000, &["plan", "--model", d, "--text-len", "20000000"]);
    let err = refused(&o, "");
    assert!(
        err.contains("needs at least") && !err.contains("inputs for"),
        "{err}"
    );
}

/// Fault 23: errors say what went wrong. A pipeline URL whose `model_index.json` the server
/// refuses (403) or fails (5xx) names that file and status, not "no model found ... (HTTP 404)";
/// `bench offload` on a language model or a pipeline folder says what it was given.
#[test]
fn errors_name_the_real_cause() {
    use nibble_tests::http_server::{files_under, Fault, TestServer};
    let flux = fixture("tiny-flux-pipeline/pipeline");
    for (fault, says) in [
        (Fault::Status(403), "HTTP 403"),
        (Fault::Status(401), "HTTP 401"),
        (Fault::ServerErrors(usize::MAX), "HTTP 500"),
    ] {
        let srv = TestServer::start(files_under(&flux, "p"), fault);
        let url = format!("{}/p", srv.base);
        let o = nibble(&["plan", "--model", &url]);
        let err = refused(&o, "");
        assert!(
            err.contains("model_index.json") && err.contains(says),
            "{says}: {err}"
        );
        assert!(!err.contains("no model found"), "{err}");
    }
    // A model_index.json that is not JSON, and one over the 64 MiB such a file may be.
    for (body, says) in [
        (b"<html>sign in</html>".to_vec(), "model_index.json"),
        (vec![b' '; 65 << 20], "model_index.json"),
    ] {
        let mut files = files_under(&flux, "p");
        let key = files
            .keys()
            .find(|k| k.ends_with("model_index.json"))
            .cloned()
            .expect("model_index.json");
        files.insert(key, body);
        let srv = TestServer::start(files, Fault::None);
        let o = nibble(&["plan", "--model", &format!("{}/p", srv.base)]);
        let err = refused(&o, "");
        assert!(err.contains(says), "{err}");
        assert!(!err.contains("no model found"), "{err}");
    }
    let llm = fixture("tiny-llama-nf4/model");
    let o = nibble(&[
        "bench",
        "offload",
        "--model",
        llm.to_str().expect("utf8"),
        "--mode",
        "resident",
    ]);
    let err = refused(&o, "");
    assert!(
        err.contains("a language model, not a Flux-style DiT"),
        "{err}"
    );
    let o = nibble(&[
        "bench",
        "offload",
        "--model",
        flux.to_str().expect("utf8"),
        "--mode",
        "resident",
    ]);
    let err = refused(&o, "");
    assert!(err.contains("pipeline folder (FluxPipeline)"), "{err}");
}
