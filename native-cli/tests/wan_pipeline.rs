//! `nibble run` on the tiny-wan-pipeline folder (written by diffusers itself) with the recorded
//! call: the PNG frames against diffusers' 8-bit frames, the intermediates against its tensors,
//! the JSON report, resident and with every group streamed through a small ring; and what a Wan
//! folder refuses.

use std::path::{Path, PathBuf};
use std::process::Command;

use nibble_core::io::model::ModelIndex;

fn root() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/tiny-wan-pipeline");
    assert!(p.is_dir(), "shared fixture missing at {}", p.display());
    p
}

fn manifest() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(root().join("manifest.json")).expect("manifest"))
        .expect("json")
}

/// Runs the recorded call for prompt `i` on the folder `model` (a path or URL) with `extra`
/// flags; returns the JSON report.
fn run(model: &str, i: usize, dir: &Path, extra: &[&str]) -> serde_json::Value {
    let m = manifest();
    let pr = &m["prompts"][i];
    let r = &m["run"];
    let s = |v: &serde_json::Value| v.to_string();
    let mut args: Vec<String> = vec![
        "run".into(),
        "--model".into(),
        model.to_string(),
        "--prompt".into(),
        pr["text"].as_str().expect("text").into(),
        "--height".into(),
        s(&r["height"]),
        "--width".into(),
        s(&r["width"]),
        "--frames".into(),
        s(&r["num_frames"]),
        "--steps".into(),
        s(&r["num_inference_steps"]),
        "--guidance".into(),
        s(&r["guidance_scale"]),
        "--max-sequence-length".into(),
        s(&r["max_sequence_length"]),
        "--seed".into(),
        s(&pr["generator_seed"]),
        "--frames-dir".into(),
        dir.join("frames").display().to_string(),
        "--out".into(),
        dir.join("video.mp4").display().to_string(),
        "--intermediates".into(),
        dir.join("i.safetensors").display().to_string(),
        "--json".into(),
    ];
    if let Some(neg) = pr["negative_prompt"].as_str() {
        args.extend(["--negative-prompt".to_string(), neg.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(&args)
        .output()
        .expect("run nibble");
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("one JSON object")
}

fn check(i: usize, extra: &[&str]) -> serde_json::Value {
    check_on(&root().join("pipeline").display().to_string(), i, extra)
}

/// [`check`] on the folder `model` (a path or URL).
fn check_on(model: &str, i: usize, extra: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("tmp");
    let v = run(model, i, dir.path(), extra);
    let e = ModelIndex::open(&root().join("expected.safetensors")).expect("expected");
    let want = e
        .read_bytes(e.require(&format!("p{i}.video_u8")).expect("u8"))
        .expect("bytes");
    assert_eq!(
        (v["frames"].as_u64(), v["width"].as_u64()),
        (Some(9), Some(64))
    );
    let mut got = Vec::new();
    for k in 0..9 {
        let f = std::fs::File::open(dir.path().join(format!("frames/frame_{k:04}.png")))
            .expect("frame");
        let mut r = png::Decoder::new(std::io::BufReader::new(f))
            .read_info()
            .expect("png");
        let mut buf = vec![0u8; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).expect("frame");
        assert_eq!((info.width, info.height), (64, 48));
        got.extend_from_slice(&buf[..info.buffer_size()]);
    }
    assert_eq!(got.len(), want.len());
    check_mp4(&dir.path().join("video.mp4"), &got, &v);
    let worst = got.iter().zip(&want).map(|(a, b)| a.abs_diff(*b)).max();
    let equal = got.iter().zip(&want).filter(|(a, b)| a == b).count() as f64 / got.len() as f64;
    assert!(
        worst <= Some(1) && equal >= 0.99,
        "p{i}: frames off by up to {worst:?}, {equal} equal"
    );
    let inter = ModelIndex::open(&dir.path().join("i.safetensors")).expect("intermediates");
    for name in ["final_latents", "video_f32"] {
        let got = inter
            .read_f32(inter.require(name).expect(name))
            .expect("f32");
        let want = e
            .read_f32(e.require(&format!("p{i}.{name}")).expect(name))
            .expect("f32");
        let max = want.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs() as f64))
            / max;
        assert!(err <= 1e-4, "p{i} {name}: {err:e} x max");
    }
    let phases: Vec<&str> = v["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .map(|p| p["phase"].as_str().expect("name"))
        .collect();
    assert_eq!(phases, ["text encoder", "transformer", "VAE"]);
    assert_eq!(v["steps"].as_array().map(Vec::len), Some(4));
    v
}

/// The least PSNR (dB) of each decoded plane (Y, Cb, Cr) of an MP4 frame against the BT.709
/// 4:2:0 planes of its PNG frame: the H.264 encoder's loss at its constant QP 26 (35.0 dB or
/// more measured here on these noise-like frames).
const MP4_MIN_PLANE_PSNR_DB: f64 = 33.0;

/// How far (dB) a decoded MP4 frame's RGB PSNR against its PNG frame may fall below what 4:2:0
/// chroma subsampling alone keeps of it. These random-weight frames are colour noise, which the
/// subsampling alone takes to 21 to 33 dB (any yuv420p video would); the encoder costs up to
/// 3.2 dB more here.
const MP4_MAX_RGB_LOSS_DB: f64 = 6.0;

/// The MP4 holds every frame at Wan's 16 fps as H.264 (`avc1`); decoded by OpenH264's decoder,
/// each frame is within the PSNRs above of the PNG frames (`png`: the frames, back to back).
fn check_mp4(path: &Path, png: &[u8], v: &serde_json::Value) {
    use nibble_tests::video::{decode_mp4, planes_to_rgb, psnr, rgb_to_planes};
    assert_eq!(v["video"].as_str(), Some(path.to_str().expect("utf-8")));
    let d = decode_mp4(path);
    assert_eq!((d.codec.as_str(), d.width, d.height), ("avc1", 64, 48));
    assert!((d.fps - 16.0).abs() < 1e-6, "{} fps", d.fps);
    assert_eq!(d.frames.len(), 9, "frames in the MP4");
    let (mut least_plane, mut least_rgb) = (f64::INFINITY, f64::INFINITY);
    for (k, want) in png.chunks_exact(64 * 48 * 3).enumerate() {
        let planes = rgb_to_planes(want, 64, 48);
        for (p, (got, want)) in d.planes[k].iter().zip(&planes).enumerate() {
            let db = psnr(got, want);
            least_plane = least_plane.min(db);
            assert!(
                db >= MP4_MIN_PLANE_PSNR_DB,
                "frame {k} plane {p}: {db:.2} dB"
            );
        }
        let db = psnr(&d.frames[k], want);
        let bound = psnr(&planes_to_rgb(&planes, 64, 48), want);
        least_rgb = least_rgb.min(db - bound);
        assert!(
            db >= bound - MP4_MAX_RGB_LOSS_DB,
            "frame {k}: RGB {db:.2} dB, 4:2:0 alone {bound:.2} dB"
        );
    }
    println!(
        "MP4: least plane PSNR {least_plane:.2} dB; RGB at most {:.2} dB below 4:2:0 alone",
        -least_rgb
    );
}

#[test]
fn prompt_to_frames_equals_diffusers_resident() {
    for i in 0..2 {
        check(i, &["--backend", "cpu"]);
    }
}

/// Streamed through a ring of two 64 KiB slots: the same frames, and every denoising step (a
/// guided one: both sequences) reads the transformer's streamed weights once.
#[test]
fn prompt_to_frames_equals_diffusers_streamed() {
    let v = check(
        0,
        &[
            "--backend",
            "cpu",
            "--stream-all",
            "--slots",
            "2",
            "--slot-size",
            "64KiB",
        ],
    );
    let plan = v["plans"]
        .as_array()
        .expect("plans")
        .iter()
        .find(|p| p["phase"] == "transformer")
        .expect("transformer plan");
    let per = plan["streamed_bytes_per_step"].as_u64().expect("bytes");
    assert!(per > 0, "the transformer streams");
    for s in v["steps"].as_array().expect("steps") {
        assert_eq!(s["bytes_streamed"].as_u64(), Some(per), "{s}");
    }
}

/// Over HTTP (Range requests to a server holding the folder), streamed: the same frames.
#[test]
fn prompt_to_frames_equals_diffusers_over_http() {
    use nibble_tests::http_server::{files_under, Fault, TestServer};
    let srv = TestServer::start(
        files_under(&root().join("pipeline"), "pipeline"),
        Fault::None,
    );
    let url = format!("{}/pipeline", srv.base);
    check_on(
        &url,
        1,
        &[
            "--backend",
            "cpu",
            "--stream-all",
            "--slots",
            "2",
            "--slot-size",
            "64KiB",
        ],
    );
    let s = srv.stats();
    let weights: u64 = s
        .bytes_by_path
        .iter()
        .filter(|(p, _)| p.ends_with(".safetensors"))
        .map(|(_, b)| *b)
        .sum();
    assert!(weights > 1 << 20, "{weights} weight bytes fetched");
}

/// `--vae-decode`: the fixture's seeded latent video through the VAE alone, whole
/// (`--vae-tiling off`) and in diffusers' tiles given in pixels (`--vae-tile-size 32
/// --vae-tile-stride 24,24`): `video_f32` within 1e-4 x max of `AutoencoderKLWan.decode`'s
/// untiled and tiled videos, the MP4 holding all nine frames.
#[test]
fn vae_decode_of_given_latents_equals_diffusers_tiled_and_whole() {
    let fx = root();
    let e = ModelIndex::open(&fx.join("vae_tiled.safetensors")).expect("vae_tiled");
    for (flags, want) in [
        (vec!["--vae-tiling", "off"], "video_f32_untiled"),
        (
            vec![
                "--vae-tiling",
                "on",
                "--vae-tile-size",
                "32",
                "--vae-tile-stride",
                "24,24",
            ],
            "video_f32_tiled",
        ),
    ] {
        let dir = tempfile::tempdir().expect("tmp");
        let inter = dir.path().join("i.safetensors");
        let mp4 = dir.path().join("v.mp4");
        let model = fx.join("pipeline").display().to_string();
        let latents = fx.join("vae_tiled.safetensors").display().to_string();
        let mut args = vec![
            "run",
            "--model",
            &model,
            "--vae-decode",
            &latents,
            "--backend",
            "cpu",
            "--json",
            "--intermediates",
            inter.to_str().expect("utf-8"),
            "--out",
            mp4.to_str().expect("utf-8"),
        ];
        args.extend(flags.iter().copied());
        let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
            .args(&args)
            .output()
            .expect("run");
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        assert_eq!(
            (
                v["frames"].as_u64(),
                v["width"].as_u64(),
                v["height"].as_u64()
            ),
            (Some(9), Some(96), Some(64))
        );
        assert_eq!(
            v["vae_tiling"].is_null(),
            want == "video_f32_untiled",
            "{v}"
        );
        let i = ModelIndex::open(&inter).expect("intermediates");
        let got = i
            .read_f32(i.require("video_f32").expect("video"))
            .expect("f32");
        let want_v = e.read_f32(e.require(want).expect(want)).expect("f32");
        let max = want_v.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        let err = got
            .iter()
            .zip(&want_v)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs() as f64))
            / max;
        assert!(err <= 1e-4, "{want}: {err:e} x max");
        let d = nibble_tests::video::decode_mp4(&mp4);
        assert_eq!((d.frames.len(), d.width, d.height), (9, 96, 64));
    }
}

/// A Wan folder whose scheduler is `FlowMatchEulerDiscreteScheduler` (shift 3): the run samples
/// with Euler over the scheduler's own `set_timesteps` sigmas (worked through from diffusers'
/// source in the scheduler's unit test) and decodes a video.
#[test]
fn a_wan_folder_with_the_flow_match_euler_scheduler_runs_euler() {
    let dir = tempfile::tempdir().expect("tmp");
    let folder = dir.path().join("wan-euler");
    std::fs::create_dir_all(folder.join("scheduler")).expect("mkdir");
    // Copies (2.3 MB): a model folder's files may not lead outside it.
    for c in ["text_encoder", "tokenizer", "transformer", "vae"] {
        std::fs::create_dir_all(folder.join(c)).expect("mkdir");
        for f in std::fs::read_dir(root().join("pipeline").join(c)).expect("component") {
            let f = f.expect("entry").path();
            let name = f.file_name().expect("name");
            std::fs::copy(&f, folder.join(c).join(name)).expect("copy");
        }
    }
    let index = std::fs::read_to_string(root().join("pipeline/model_index.json")).expect("index");
    let index = index.replace("UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler");
    std::fs::write(folder.join("model_index.json"), index).expect("write");
    std::fs::write(
        folder.join("scheduler/scheduler_config.json"),
        r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
            "shift": 3.0, "use_dynamic_shifting": false}"#,
    )
    .expect("write");
    let inter = dir.path().join("i.safetensors");
    let args = [
        "run",
        "--model",
        folder.to_str().expect("utf-8"),
        "--prompt",
        "a fox",
        "--height",
        "48",
        "--width",
        "64",
        "--frames",
        "5",
        "--steps",
        "4",
        "--max-sequence-length",
        "16",
        "--backend",
        "cpu",
        "--intermediates",
        inter.to_str().expect("utf-8"),
    ];
    let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(args)
        .output()
        .expect("run");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let i = ModelIndex::open(&inter).expect("intermediates");
    let sigmas = i
        .read_f32(i.require("sigmas").expect("sigmas"))
        .expect("f32");
    assert_eq!(sigmas, [1.0, 0.857_692_3, 0.602_150_56, 0.008_928_572, 0.0]);
    let video = i
        .read_f32(i.require("video_f32").expect("video"))
        .expect("f32");
    assert_eq!(video.len(), 3 * 5 * 48 * 64);
    assert!(video.iter().all(|v| v.is_finite() && v.abs() <= 1.0));
}

/// What a Wan folder refuses, each with a clear one-line error.
#[test]
fn a_wan_folder_refuses_what_it_cannot_do() {
    let model = root().join("pipeline").display().to_string();
    for (extra, want) in [
        (
            vec!["--frames", "8", "--frames-dir", "/tmp/x"],
            "4k + 1 frames",
        ),
        (vec![], "--out video.mp4"),
        (vec!["--out", "/tmp/v.mp4", "--fps", "0"], "--fps 0"),
        (
            vec!["--out", "/tmp/v.mp4", "--prompt-ids", "1,2"],
            "--prompt TEXT",
        ),
        (
            vec!["--out", "/tmp/v.mp4", "--vae-tile-size", "30,32"],
            "multiples of 8",
        ),
        (
            vec![
                "--out",
                "/tmp/v.mp4",
                "--vae-decode",
                "/nonexistent.safetensors",
            ],
            "do not apply",
        ),
    ] {
        let mut args = vec!["run", "--model", &model];
        if !extra.contains(&"--prompt-ids") {
            args.extend(["--prompt", "a fox"]);
        }
        args.extend(extra.iter().copied());
        let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
            .args(&args)
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains(want) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}
