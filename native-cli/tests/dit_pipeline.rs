//! The diffusion pipelines end to end through the binary, on small synthetic models: `nibble
//! demo` (a synthetic Flux folder) writes its image, its memory stays flat over 50 steps and
//! within baseline + the largest phase's plan (+16 MiB), and a DiT run killed mid-way resumes
//! from its last checkpoint to the same final latent, bit for bit; a folder of `nibble synth
//! --arch flux` runs from a prompt to a PNG of the asked size. Asserts bytes and equality, never
//! time.

use std::path::Path;
use std::process::{Command, Stdio};

const MIB: i64 = 1 << 20;

fn nibble() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
}

#[test]
fn demo_memory_is_flat_and_within_the_plan() {
    let tmp = tempfile::tempdir().expect("tmp");
    let out = nibble()
        .args([
            "demo",
            "--dit-size",
            "384MiB",
            "--t5-layers",
            "1",
            "--steps",
            "50",
            "--height",
            "64",
            "--width",
            "96",
            "--max-sequence-length",
            "16",
            "--device-budget",
            "180MiB",
            "--slots",
            "2",
            "--slot-size",
            "4MiB",
            // The quick start's choice: looking for CUDA and a wgpu GPU must cost the run no
            // memory (lavapipe's driver, probed in this process, left ~50 MiB mapped).
            "--backend",
            "auto",
            "--json",
        ])
        .arg("--cache-dir")
        .arg(tmp.path().join("cache"))
        .arg("--out-dir")
        .arg(tmp.path().join("out"))
        .output()
        .expect("run nibble demo");
    assert!(
        out.status.success(),
        "demo failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let s = &v["summary"];
    assert_eq!(s["steps"], 50);
    assert_eq!(
        (s["width"].as_u64(), s["height"].as_u64()),
        (Some(96), Some(64))
    );
    assert!(
        s["dit_streamed_groups"].as_u64().unwrap_or(0) >= 3,
        "the transformer streams: {s}"
    );
    // Every phase ran, in the pipeline's order, and each was planned.
    let phases: Vec<&str> = s["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .map(|p| p["phase"].as_str().expect("name"))
        .collect();
    assert_eq!(phases, ["CLIP", "T5", "transformer", "VAE"]);
    assert_eq!(s["plans"].as_array().map(|p| p.len()), Some(4));
    let rss: Vec<i64> = v["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|r| r["rss_bytes"].as_i64().expect("rss"))
        .collect();
    let growth = rss[49] - rss[1];
    let above = rss[1..].iter().max().copied().unwrap_or(0) - rss[1];
    let i = |k: &str| s[k].as_i64().unwrap_or_else(|| panic!("{k} in {s}"));
    let (peak, base, largest) = (
        i("peak_rss_bytes"),
        i("baseline_rss_bytes"),
        i("largest_phase_plan_bytes"),
    );
    println!(
        "RSS step 2 {} B, step 50 {} B (growth {growth} B, max above step 2 {above} B); peak {peak} B, baseline {base} B + largest phase plan {largest} B",
        rss[1], rss[49]
    );
    assert!(
        growth <= MIB,
        "RSS grew by {growth} bytes from step 2 to 50"
    );
    assert!(above <= MIB, "RSS rose {above} bytes above step 2's");
    assert!(
        peak <= base + largest + 16 * MIB,
        "peak RSS {peak} over baseline {base} + largest phase plan {largest} + 16 MiB"
    );
    for f in ["chart.svg", "chart.png", "steps.json"] {
        let p = tmp.path().join("out").join(f);
        assert!(
            std::fs::metadata(&p)
                .map(|m| m.len() > 100)
                .unwrap_or(false),
            "{} written",
            p.display()
        );
    }
    // The image: a PNG of the asked size whose pixels are not all one colour.
    let f = std::fs::File::open(tmp.path().join("out/image.png")).expect("image.png");
    let mut r = png::Decoder::new(std::io::BufReader::new(f))
        .read_info()
        .expect("png");
    let mut buf = vec![0; r.output_buffer_size()];
    let info = r.next_frame(&mut buf).expect("frame");
    assert_eq!((info.width, info.height), (96, 64));
    let px = &buf[..info.buffer_size()];
    assert!(
        px.chunks(3).any(|p| p != &px[..3]),
        "the image is one flat colour"
    );
}

fn steps_done(dir: &Path) -> Option<usize> {
    let h = nibble_core::io::model::read_header(&dir.join("checkpoint.safetensors")).ok()?;
    h.metadata.get("steps_done")?.parse().ok()
}

fn latent(path: &Path) -> Vec<u8> {
    let m = nibble_core::io::model::ModelIndex::open(path).expect("latent file");
    m.read_bytes(m.require("latent").expect("latent"))
        .expect("read")
}

#[test]
fn a_killed_run_resumes_to_the_same_latent() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("dit");
    let st = nibble()
        .args([
            "synth", "--arch", "dit", "--size", "64MiB", "--seed", "3", "-o",
        ])
        .arg(&model)
        .stderr(Stdio::null())
        .status()
        .expect("synth");
    assert!(st.success());
    let run = |extra: &[&str]| {
        let mut c = nibble();
        c.args(["run", "--model"]).arg(&model).args([
            "--steps",
            "40",
            "--height",
            "4",
            "--width",
            "4",
            "--text-len",
            "8",
            "--seed",
            "11",
            "--backend",
            "cpu",
            "--device-budget",
            "32MiB",
            "--slots",
            "2",
            "--slot-size",
            "4MiB",
        ]);
        c.args(extra).stdout(Stdio::null()).stderr(Stdio::null());
        c
    };
    let full = tmp.path().join("full.safetensors");
    let st = run(&["--out", full.to_str().expect("path")])
        .status()
        .expect("full run");
    assert!(st.success(), "uninterrupted run");

    // Kill -9 a run once a few steps have been checkpointed.
    let ck = tmp.path().join("ck");
    let ck_s = ck.to_str().expect("path").to_string();
    let mut child = run(&["--checkpoint", &ck_s]).spawn().expect("spawn");
    let killed_at = loop {
        if let Some(n) = steps_done(&ck) {
            if n >= 5 {
                assert!(
                    child.try_wait().expect("wait").is_none(),
                    "the run must still be going"
                );
                child.kill().expect("kill");
                let _ = child.wait();
                break n;
            }
        }
        assert!(
            child.try_wait().expect("wait").is_none(),
            "the run ended before it was killed"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    let last = steps_done(&ck).expect("a complete checkpoint survives the kill");
    assert!(
        last >= killed_at && last < 40,
        "checkpoint after step {last}"
    );
    let resumed = tmp.path().join("resumed.safetensors");
    let st = run(&[
        "--resume",
        &ck_s,
        "--checkpoint",
        &ck_s,
        "--out",
        resumed.to_str().expect("path"),
    ])
    .status()
    .expect("resume");
    assert!(st.success(), "resumed run");
    assert_eq!(steps_done(&ck), Some(40));
    assert!(
        latent(&full) == latent(&resumed),
        "resumed from step {last}: the final latent differs"
    );
    println!("killed after step {killed_at}, resumed from {last}: final latent identical");
}

#[test]
fn a_synthesized_flux_folder_runs_from_prompt_to_png() {
    let tmp = tempfile::tempdir().expect("tmp");
    let model = tmp.path().join("flux");
    let st = nibble()
        .args(["synth", "--arch", "flux", "--size", "8MiB", "-o"])
        .arg(&model)
        .output()
        .expect("synth");
    let err = String::from_utf8_lossy(&st.stderr);
    assert!(!st.status.success() && err.contains("MiB or more"), "{err}");
    let st = nibble()
        .args([
            "synth", "--arch", "flux", "--size", "160MiB", "--seed", "5", "-o",
        ])
        .arg(&model)
        .stderr(Stdio::null())
        .status()
        .expect("synth");
    assert!(st.success());
    for part in ["model_index.json", "scheduler/scheduler_config.json"] {
        assert!(model.join(part).is_file(), "{part} missing");
    }
    for part in ["text_encoder", "text_encoder_2", "transformer", "vae"] {
        assert!(
            model.join(part).join("config.json").is_file(),
            "{part} missing"
        );
    }
    let png = tmp.path().join("out.png");
    let st = nibble()
        .args(["run", "--model"])
        .arg(&model)
        .args([
            "--prompt",
            "a lighthouse",
            "--height",
            "32",
            "--width",
            "48",
            "--steps",
            "2",
            "--max-sequence-length",
            "16",
            "--backend",
            "cpu",
            "--out",
        ])
        .arg(&png)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run");
    assert!(st.success());
    let bytes = std::fs::read(&png).expect("png");
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    // IHDR: width then height, big-endian.
    assert_eq!(&bytes[16..24], &[0, 0, 0, 48, 0, 0, 0, 32]);
}
