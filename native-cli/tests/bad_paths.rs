//! Paths from the command line and from model folders (fault classes 15 and 18): an output
//! that resolves to an input or into the model folder is refused before anything is written,
//! and a shard that is not a regular file (a FIFO) is refused instead of blocking forever.

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
    assert!(p.exists(), "shared fixture missing at {}", p.display());
    p
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf8")
}

#[test]
fn outputs_that_resolve_to_inputs_or_into_the_model_folder_are_refused() {
    let tmp = tempfile::tempdir().expect("tmp");
    let m = tmp.path().join("m");
    nibble_tests::copy_dir(&fixture("tiny-llama-nf4/model"), &m);
    let weights = m.join("model.safetensors");
    let before = std::fs::read(&weights).expect("read");
    let link = tmp.path().join("link.safetensors");
    std::os::unix::fs::symlink(&weights, &link).expect("symlink");
    let sneaky = tmp.path().join("x/../m/new.safetensors");
    std::fs::create_dir(tmp.path().join("x")).expect("mkdir");
    let run = |flag: &str, out: &Path| {
        vec![
            "run".to_string(),
            "--model".into(),
            s(&m).into(),
            "--prompt-ids".into(),
            "1,2".into(),
            "--max-tokens".into(),
            "1".into(),
            "--backend".into(),
            "cpu".into(),
            flag.into(),
            s(out).into(),
        ]
    };
    let cases: Vec<Vec<String>> = vec![
        ["dequant", s(&m), "--all", "-o", s(&weights)]
            .map(String::from)
            .to_vec(),
        ["dequant", s(&weights), "--all", "-o", s(&link)]
            .map(String::from)
            .to_vec(),
        ["quantize", s(&m), "-o", s(&sneaky)]
            .map(String::from)
            .to_vec(),
        run("--logits-out", &weights),
        run("--logits-out", &link),
        run("--logits-out", &sneaky),
    ];
    for args in cases {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = nibble(&refs);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("being read"), "{args:?}: {err}");
        assert_eq!(
            std::fs::read(&weights).expect("read"),
            before,
            "{args:?} changed the model"
        );
        assert!(
            !m.join("new.safetensors").exists(),
            "{args:?} wrote into the model folder"
        );
    }

    // The DiT's outputs against its inputs file and its model folder.
    let d = tmp.path().join("dit");
    nibble_tests::copy_dir(&fixture("tiny-dit-nf4/model"), &d);
    let inputs = tmp.path().join("inputs.safetensors");
    std::fs::write(&inputs, b"not read before the check").expect("write");
    for (flag, out) in [
        ("--out", d.join("latent.safetensors")),
        ("--preview", inputs.clone()),
        ("--checkpoint", inputs.clone()),
    ] {
        let o = nibble(&[
            "run",
            "--model",
            s(&d),
            "--inputs",
            s(&inputs),
            "--steps",
            "1",
            flag,
            s(&out),
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{flag}: {err}");
        assert!(err.contains("being read"), "{flag}: {err}");
    }

    // Writing next to the model, outside its folder, still works.
    let out = tmp.path().join("deq.safetensors");
    let o = nibble(&["dequant", s(&m), "--all", "-o", s(&out)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_shard_that_is_a_fifo_is_refused_not_waited_on() {
    let tmp = tempfile::tempdir().expect("tmp");
    let m = tmp.path().join("m");
    nibble_tests::copy_dir(&fixture("tiny-llama-nf4/model"), &m);
    std::fs::remove_file(m.join("model.safetensors")).expect("rm");
    let fifo = m.join("model.safetensors");
    let ok = Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo")
        .success();
    assert!(ok, "mkfifo failed");
    for args in [
        vec!["inspect", s(&m)],
        vec!["inspect", s(&fifo)],
        vec![
            "run",
            "--model",
            s(&m),
            "--prompt-ids",
            "1,2",
            "--backend",
            "cpu",
        ],
    ] {
        let t0 = std::time::Instant::now();
        let mut child = Command::new(env!("CARGO_BIN_EXE_nibble"))
            .args(&args)
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn");
        // A blocked open would never return: give it 20 s, then fail the test.
        let status = loop {
            if let Some(st) = child.try_wait().expect("wait") {
                break st;
            }
            if t0.elapsed().as_secs() > 20 {
                let _ = child.kill();
                panic!("{args:?} blocked on the FIFO");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let mut err = String::new();
        use std::io::Read;
        child
            .stderr
            .take()
            .expect("stderr")
            .read_to_string(&mut err)
            .expect("stderr");
        assert_eq!(status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("regular file"), "{args:?}: {err}");
    }
}

/// Image and video outputs report their write and flush errors (hardening round two, fault
/// 11): onto a full device (`/dev/full`: every write fails with ENOSPC) a PNG, the PNG frames'
/// folder's files and an MP4 fail with the error, never "wrote ..." and exit 0.
#[test]
fn a_full_disk_is_an_error_for_images_and_videos() {
    let flux = fixture("tiny-flux-pipeline/pipeline");
    let o = nibble(&[
        "run",
        "--model",
        s(&flux),
        "--prompt",
        "a fox",
        "--height",
        "32",
        "--width",
        "32",
        "--steps",
        "1",
        "--max-sequence-length",
        "16",
        "--out",
        "/dev/full",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("No space left on device") && !err.contains("wrote /dev/full"),
        "{err}"
    );
    let wan = fixture("tiny-wan-pipeline/pipeline");
    let o = nibble(&[
        "run",
        "--model",
        s(&wan),
        "--prompt",
        "a fox",
        "--height",
        "48",
        "--width",
        "64",
        "--frames",
        "5",
        "--steps",
        "1",
        "--max-sequence-length",
        "16",
        "--out",
        "/dev/full",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("No space left on device") && !err.contains("wrote /dev/full"),
        "{err}"
    );
    // A lone DiT's latent preview PNG and its latent safetensors.
    let dit = fixture("tiny-dit-nf4/model");
    for flag in ["--preview", "--out"] {
        let o = nibble(&[
            "run",
            "--model",
            s(&dit),
            "--steps",
            "1",
            "--backend",
            "cpu",
            flag,
            "/dev/full",
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{flag}: {err}");
        assert!(err.contains("No space left on device"), "{flag}: {err}");
    }
}

/// #32 fault 10: an output that is a FIFO (or a link to one) is written through, never replaced
/// by a renamed regular file (as root, `-o /dev/null` replaced by a file broke the machine); a
/// folder is refused; a regular file is still replaced whole.
#[test]
fn outputs_are_written_through_fifos_never_renamed_over_them() {
    use std::io::Read;
    use std::os::unix::fs::FileTypeExt;
    let model = fixture("tiny-llama-nf4/model");
    let tmp = tempfile::tempdir().expect("tmp");
    let fifo = tmp.path().join("out.fifo");
    let c = std::ffi::CString::new(s(&fifo)).expect("path");
    // SAFETY: mkfifo on a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    let link = tmp.path().join("link.safetensors");
    std::os::unix::fs::symlink(&fifo, &link).expect("symlink");
    for target in [&fifo, &link] {
        let f = fifo.clone();
        let reader = std::thread::spawn(move || {
            let mut b = Vec::new();
            std::fs::File::open(f)
                .expect("open")
                .read_to_end(&mut b)
                .expect("read");
            b
        });
        let o = nibble(&["dequant", s(&model), "--all", "-o", s(target)]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let got = reader.join().expect("reader");
        assert!(
            got.len() > 8 && got[8] == b'{',
            "a safetensors file came through"
        );
        assert!(std::fs::metadata(&fifo)
            .expect("meta")
            .file_type()
            .is_fifo());
        assert!(std::fs::symlink_metadata(&link)
            .expect("meta")
            .file_type()
            .is_symlink());
    }
    let o = nibble(&["dequant", s(&model), "--all", "-o", s(tmp.path())]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("is a folder"));
    let file = tmp.path().join("out.safetensors");
    std::fs::write(&file, b"old").expect("write");
    let o = nibble(&["dequant", s(&model), "--all", "-o", s(&file)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read(&file).expect("read").len() > 8);
    // The temporary file it was written to is gone (renamed into place), and no other file
    // appeared beside it.
    let mut names: Vec<String> = std::fs::read_dir(tmp.path())
        .expect("read")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["link.safetensors", "out.fifo", "out.safetensors"]);
    // A character device is written through by every safetensors output, never replaced:
    // dequant -o, a language model's --logits-out, a DiT's latent --out.
    let dit = fixture("tiny-dit-nf4/model");
    for args in [
        vec!["dequant", s(&model), "--all", "-o", "/dev/null"],
        vec![
            "run",
            "--model",
            s(&model),
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "1",
            "--backend",
            "cpu",
            "--logits-out",
            "/dev/null",
        ],
        vec![
            "run",
            "--model",
            s(&dit),
            "--steps",
            "1",
            "--backend",
            "cpu",
            "--out",
            "/dev/null",
        ],
    ] {
        let o = nibble(&args);
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let m = std::fs::metadata("/dev/null").expect("meta");
        assert!(
            m.file_type().is_char_device(),
            "{args:?} replaced /dev/null"
        );
    }
}
