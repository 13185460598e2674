//! `nibble demo --video` and `nibble synth --arch wan`: a synthetic Wan folder in diffusers'
//! layout (its tensor names checked against the folder diffusers itself wrote) through the whole
//! pipeline with the transformer streamed: one pass over the weights per guided step, RSS flat
//! from step 2, the peak within the plans, an MP4 of every frame.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use nibble_core::io::model::ModelIndex;

const MIB: i64 = 1 << 20;

fn nibble() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
}

#[test]
fn video_demo_streams_one_pass_per_guided_step_in_flat_memory() {
    let tmp = tempfile::tempdir().expect("tmp");
    let out = nibble()
        .args([
            "demo",
            "--video",
            "--dit-size",
            "384MiB",
            "--t5-layers",
            "1",
            "--steps",
            "20",
            "--frames",
            "9",
            "--height",
            "48",
            "--width",
            "64",
            "--max-sequence-length",
            "16",
            "--device-budget",
            "200MiB",
            "--slots",
            "2",
            "--slot-size",
            "32MiB",
            "--backend",
            "auto",
            "--json",
        ])
        .arg("--cache-dir")
        .arg(tmp.path().join("cache"))
        .arg("--out-dir")
        .arg(tmp.path().join("out"))
        .output()
        .expect("run nibble demo --video");
    assert!(
        out.status.success(),
        "demo --video failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let s = &v["summary"];
    assert_eq!(
        (
            s["frames"].as_u64(),
            s["width"].as_u64(),
            s["height"].as_u64()
        ),
        (Some(9), Some(64), Some(48))
    );
    let phases: Vec<&str> = s["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .map(|p| p["phase"].as_str().expect("name"))
        .collect();
    assert_eq!(phases, ["text encoder", "transformer", "VAE"]);
    // The transformer streams, and each guided step (both sequences) reads it once.
    let per = s["bytes_streamed_per_step"].as_u64().expect("per step");
    assert!(per > 100 << 20, "the transformer streams: {s}");
    let each: Vec<u64> = s["bytes_streamed_each_step"]
        .as_array()
        .expect("each")
        .iter()
        .map(|b| b.as_u64().expect("bytes"))
        .collect();
    assert_eq!(each, vec![per; 20], "bytes streamed per guided step");
    let rss: Vec<i64> = v["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|r| r["rss_bytes"].as_i64().expect("rss"))
        .collect();
    let growth = rss[19] - rss[1];
    let above = rss[1..].iter().max().copied().unwrap_or(0) - rss[1];
    let i = |k: &str| s[k].as_i64().unwrap_or_else(|| panic!("{k} in {s}"));
    let (peak, base, largest) = (
        i("peak_rss_bytes"),
        i("baseline_rss_bytes"),
        i("largest_phase_plan_bytes"),
    );
    println!(
        "RSS step 2 {} B, step 20 {} B (growth {growth} B, max above step 2 {above} B); peak \
         {peak} B, baseline {base} B + largest phase plan {largest} B; VAE peak {} B, plan {} B",
        rss[1], rss[19], s["vae_peak_rss_bytes"], s["vae_plan_bytes"]
    );
    assert!(
        growth <= MIB,
        "RSS grew by {growth} bytes from step 2 to 20"
    );
    assert!(above <= MIB, "RSS rose {above} bytes above step 2's");
    assert!(
        peak <= base + largest + 16 * MIB,
        "peak RSS {peak} over baseline {base} + largest phase plan {largest} + 16 MiB"
    );
    let d = nibble_tests::video::decode_mp4(&tmp.path().join("out/video.mp4"));
    assert_eq!((d.frames.len(), d.width, d.height), (9, 64, 48));
    for f in [
        "chart.svg",
        "chart.png",
        "steps.json",
        "frames/frame_0008.png",
    ] {
        let p = tmp.path().join("out").join(f);
        assert!(
            std::fs::metadata(&p).is_ok_and(|m| m.len() > 100),
            "{} written",
            p.display()
        );
    }
}

/// Tensor names with block and layer numbers folded (`blocks.#.attn1...`).
fn name_patterns(dir: &Path, keep: impl Fn(&str) -> bool) -> BTreeSet<String> {
    let m = ModelIndex::open(dir).expect("model");
    let digits = regex::Regex::new(r"\.\d+\.").expect("regex");
    m.tensors()
        .map(|t| t.name.as_str())
        .filter(|n| keep(n))
        .map(|n| digits.replace_all(n, ".#.").into_owned())
        .collect()
}

/// `nibble synth --arch wan` names every tensor as diffusers and transformers do (checked
/// against the tiny folder they wrote), and its configs open as a Wan pipeline.
#[test]
fn synthetic_wan_folders_have_diffusers_tensor_names() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("wan");
    let o = nibble()
        .args(["synth", "--arch", "wan", "--size", "8MiB", "--out"])
        .arg(&dir)
        .output()
        .expect("synth");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let fx = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures/tiny-wan-pipeline/pipeline");
    assert!(fx.is_dir(), "shared fixture missing at {}", fx.display());
    // The VAE's encoder is left out of the synthetic folder (text to video never runs it).
    let decoder = |n: &str| !n.starts_with("encoder.") && !n.starts_with("quant_conv");
    for (c, keep) in [
        ("transformer", &(|_: &str| true) as &dyn Fn(&str) -> bool),
        ("text_encoder", &|_: &str| true),
        ("vae", &decoder),
    ] {
        let want = name_patterns(&fx.join(c), keep);
        let got = name_patterns(&dir.join(c), keep);
        assert_eq!(
            got.symmetric_difference(&want).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "{c}: names that differ from diffusers'"
        );
    }
    // The folder plans as a pipeline without reading a weight.
    let o = nibble()
        .args(["plan", "--model"])
        .arg(&dir)
        .args([
            "--prompt", "a fox", "--frames", "5", "--height", "48", "--width", "64",
        ])
        .args(["--json"])
        .output()
        .expect("plan");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The steps a Wan checkpoint in `dir` says are done.
fn wan_steps_done(dir: &Path) -> Option<usize> {
    let h = nibble_core::io::model::read_header(&dir.join("wan-checkpoint.safetensors")).ok()?;
    h.metadata.get("steps_done")?.parse().ok()
}

fn final_latents(path: &Path) -> Vec<u8> {
    let m = ModelIndex::open(path).expect("intermediates");
    m.read_bytes(m.require("final_latents").expect("final_latents"))
        .expect("read")
}

/// A guided Wan run killed mid-way and resumed from its checkpoint (the latent and UniPC's
/// history) ends on the uninterrupted run's final latents bit for bit; a checkpoint is refused
/// for another prompt.
#[test]
fn a_killed_wan_run_resumes_to_the_same_latents() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("wan");
    let o = nibble()
        .args(["synth", "--arch", "wan", "--size", "384MiB", "--out"])
        .arg(&dir)
        .output()
        .expect("synth");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run = |prompt: &str, extra: &[&std::ffi::OsStr]| {
        let mut c = nibble();
        c.args(["run", "--model"])
            .arg(&dir)
            .args([
                "--prompt", prompt, "--frames", "5", "--height", "48", "--width", "64",
            ])
            .args([
                "--steps",
                "8",
                "--max-sequence-length",
                "16",
                "--backend",
                "cpu",
            ])
            .args(extra);
        c
    };
    let os = |p: &Path| p.as_os_str().to_owned();
    let (reference, resumed, ck) = (
        tmp.path().join("ref.safetensors"),
        tmp.path().join("res.safetensors"),
        tmp.path().join("ck"),
    );
    let flag = |s: &str| std::ffi::OsString::from(s);
    let o = run("a fox", &[&flag("--intermediates"), &os(&reference)])
        .output()
        .expect("reference run");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let killed_mp4 = os(&tmp.path().join("killed.mp4"));
    let mut child = run(
        "a fox",
        &[&flag("--checkpoint"), &os(&ck), &flag("--out"), &killed_mp4],
    )
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null())
    .spawn()
    .expect("spawn");
    let killed_at = loop {
        if let Some(n) = wan_steps_done(&ck) {
            if n >= 2 {
                child.kill().expect("kill");
                break n;
            }
        }
        if let Some(st) = child.try_wait().expect("wait") {
            panic!("the run ended ({st}) before it could be killed");
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    let _ = child.wait();
    let last = wan_steps_done(&ck).expect("a complete checkpoint survives the kill");
    assert!(
        last >= killed_at && last < 8,
        "killed after {last} of 8 steps"
    );
    let wrong = run(
        "a cat",
        &[
            &flag("--resume"),
            &os(&ck),
            &flag("--out"),
            &os(&tmp.path().join("x.mp4")),
        ],
    )
    .output()
    .expect("wrong resume");
    let err = String::from_utf8_lossy(&wrong.stderr);
    assert!(
        !wrong.status.success() && err.contains("another prompt"),
        "{err}"
    );
    let o = run(
        "a fox",
        &[
            &flag("--resume"),
            &os(&ck),
            &flag("--checkpoint"),
            &os(&ck),
            &flag("--intermediates"),
            &os(&resumed),
        ],
    )
    .output()
    .expect("resumed run");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(wan_steps_done(&ck), Some(8));
    assert!(
        final_latents(&resumed) == final_latents(&reference),
        "resumed after {last} steps: the final latents differ from the uninterrupted run's"
    );
}
