//! `nibble run` on a diffusers Flux pipeline folder, end to end against the tiny-flux-pipeline
//! fixture (diffusers' `FluxPipeline` in float32 on the dequantized weights): from the prompt
//! text and the seed to the PNG, with every intermediate tensor diffusers names checked, on
//! cpu_ref, cpu and wgpu, resident and with every component streamed.

use std::path::{Path, PathBuf};
use std::process::Command;

use nibble_core::io::model::ModelIndex;

fn fixture() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/tiny-flux-pipeline");
    assert!(
        p.join("manifest.json").is_file(),
        "fixture missing at {}",
        p.display()
    );
    p
}

fn f32s(m: &ModelIndex, name: &str) -> Vec<f32> {
    m.read_f32(m.require(name).unwrap_or_else(|e| panic!("{name}: {e}")))
        .expect("read")
}

fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let m = want.iter().fold(0f32, |a, b| a.max(b.abs())) as f64;
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() as f64)
        .fold(0.0, f64::max)
        / m.max(1e-30)
}

fn run_case(backend: &str, stream_all: bool, p: usize) {
    run_case_with(backend, stream_all, p, &[]);
}

fn run_case_with(
    backend: &str,
    stream_all: bool,
    p: usize,
    extra: &[&str],
) -> (ModelIndex, tempfile::TempDir) {
    let dir = fixture();
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).expect("manifest"))
            .expect("json");
    let run = &manifest["run"];
    let prompt = &manifest["prompts"][p];
    let tmp = tempfile::tempdir().expect("tmp");
    let (png, inter) = (
        tmp.path().join("out.png"),
        tmp.path().join("inter.safetensors"),
    );
    let num = |k: &str| run[k].as_u64().expect(k).to_string();
    let mut args = vec![
        "run".to_string(),
        "--model".into(),
        dir.join("pipeline").display().to_string(),
        "--prompt".into(),
        prompt["text"].as_str().expect("text").into(),
        "--height".into(),
        num("height"),
        "--width".into(),
        num("width"),
        "--steps".into(),
        num("num_inference_steps"),
        "--guidance".into(),
        run["guidance_scale"]
            .as_f64()
            .expect("guidance")
            .to_string(),
        "--max-sequence-length".into(),
        num("max_sequence_length"),
        "--seed".into(),
        prompt["generator_seed"].as_u64().expect("seed").to_string(),
        "--backend".into(),
        backend.into(),
        "--out".into(),
        png.display().to_string(),
        "--intermediates".into(),
        inter.display().to_string(),
        "--json".into(),
    ];
    if stream_all {
        args.extend(["--stream-all", "--slots", "2", "--slot-size", "64KiB"].map(String::from));
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let tiled = !extra.is_empty();
    let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(&args)
        .output()
        .expect("run nibble");
    let what = format!("{backend} stream_all={stream_all} p{p}");
    assert!(
        o.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).expect("--json");
    assert_eq!(
        report["phases"].as_array().expect("phases").len(),
        4,
        "{what}"
    );
    assert_eq!(
        report["steps"].as_array().expect("steps").len() as u64,
        run["num_inference_steps"].as_u64().expect("steps")
    );
    if stream_all {
        for ph in report["phases"].as_array().expect("phases") {
            assert!(
                ph["bytes_streamed"].as_u64().expect("bytes") > 0,
                "{what}: {ph}"
            );
        }
    }
    // Memory: the run's peak RSS is within the largest phase's plan (host and device: on the
    // CPU backends both are this process's memory) above the baseline, plus 16 MiB.
    if backend != "wgpu" {
        let u = |v: &serde_json::Value| v.as_u64().expect("a byte count");
        let largest = report["plans"]
            .as_array()
            .expect("plans")
            .iter()
            .map(|p| u(&p["peak_host_bytes"]) + u(&p["peak_device_bytes"]))
            .max()
            .expect("plans");
        let (base, peak) = (
            u(&report["baseline_rss_bytes"]),
            u(&report["peak_rss_bytes"]),
        );
        println!("{what}: peak RSS {peak}, baseline {base}, largest plan {largest}");
        assert!(
            peak <= base + largest + (16 << 20),
            "{what}: peak RSS {peak} over baseline {base} + largest plan {largest} + 16 MiB"
        );
    }

    let got = ModelIndex::open(&inter).expect("intermediates");
    let want = ModelIndex::open(&dir.join("expected.safetensors")).expect("expected");
    let ids = |m: &ModelIndex, n: &str| -> Vec<f32> {
        let e = m.require(n).expect(n);
        if e.dtype == nibble_core::format::dtype::Dtype::I64 {
            m.read_bytes(e)
                .expect("read")
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as f32)
                .collect()
        } else {
            f32s(m, n)
        }
    };
    for n in ["clip_input_ids", "t5_input_ids"] {
        assert_eq!(
            ids(&got, n),
            ids(&want, &format!("p{p}.{n}")),
            "{what}: {n}"
        );
    }
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(f32s(&got, "initial_latents")),
        bits(f32s(&want, &format!("p{p}.initial_latents"))),
        "{what}: initial latents bit for bit"
    );
    let s = f32s(&got, "sigmas");
    let sw = f32s(&want, &format!("p{p}.sigmas"));
    assert!(
        s.iter().zip(&sw).all(|(a, b)| (a - b).abs() <= 1e-7),
        "{what}: {s:?} vs {sw:?}"
    );
    for (n, tol) in [
        ("pooled_prompt_embeds", 1e-5),
        ("prompt_embeds", 1e-5),
        ("final_latents_packed", 1e-4),
        ("vae_input", 1e-4),
        ("image_f32", 1e-4),
    ] {
        if tiled && n == "image_f32" {
            continue;
        }
        let e = rel(&f32s(&got, n), &f32s(&want, &format!("p{p}.{n}")));
        assert!(e <= tol, "{what}: {n} error {e:e} x max");
    }

    if tiled {
        return (got, tmp);
    }
    // The PNG against diffusers' 8-bit image.
    let dec = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(&png).expect("png"),
    ));
    let mut reader = dec.read_info().expect("png header");
    let mut buf = vec![0u8; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("png data");
    let pixels = &buf[..info.buffer_size()];
    let u8_want = want
        .read_bytes(want.require(&format!("p{p}.image_u8")).expect("image_u8"))
        .expect("read");
    assert_eq!(pixels.len(), u8_want.len(), "{what}: image size");
    let far = pixels
        .iter()
        .zip(&u8_want)
        .filter(|(a, b)| a.abs_diff(**b) > 1)
        .count();
    let off = pixels.iter().zip(&u8_want).filter(|(a, b)| a != b).count();
    assert_eq!(far, 0, "{what}: pixels more than 1 away");
    assert!(
        off * 100 <= pixels.len(),
        "{what}: {off} of {} differ",
        pixels.len()
    );
    (got, tmp)
}

/// `--vae-tiling on` with the fixture's tile size: the image equals diffusers' tiled decode.
#[test]
fn tiled_vae_decoding_through_the_cli() {
    let dir = fixture();
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("vae_tiled.json")).expect("json"))
            .expect("json");
    let tile = json["tile_latent_min_size"]
        .as_u64()
        .expect("tile")
        .to_string();
    let want = ModelIndex::open(&dir.join("vae_tiled.safetensors")).expect("tiled");
    for p in 0..2 {
        let (got, _tmp) = run_case_with(
            "cpu",
            false,
            p,
            &["--vae-tiling", "on", "--vae-tile-size", &tile],
        );
        let e = rel(
            &f32s(&got, "image_f32"),
            &f32s(&want, &format!("p{p}.image_f32_tiled")),
        );
        assert!(e <= 1e-4, "p{p}: tiled image error {e:e} x max");
    }
}

#[test]
fn prompt_to_png_on_cpu_ref() {
    for p in 0..2 {
        run_case("cpu-ref", false, p);
    }
    run_case("cpu-ref", true, 1);
}

#[test]
fn prompt_to_png_on_cpu() {
    for p in 0..2 {
        run_case("cpu", false, p);
        run_case("cpu", true, p);
    }
}

#[test]
fn prompt_to_png_on_wgpu() {
    if std::env::var("NIBBLE_REQUIRE_WGPU").ok().as_deref() != Some("1")
        && nibble_wgpu::WgpuBackend::new().is_err()
    {
        println!("wgpu absent: not run");
        return;
    }
    run_case("wgpu", false, 0);
    run_case("wgpu", true, 1);
}

/// `--embed-cache`: the second image from the same prompt skips both encoders, reads none of
/// their weight bytes (counted by the server), and is the same picture.
#[test]
fn a_cached_prompt_reads_no_encoder_weights() {
    use nibble_tests::http_server::{Fault, TestServer};
    let dir = fixture().join("pipeline");
    let files = nibble_tests::http_server::files_under(&dir, "pipeline");
    let srv = TestServer::start(files, Fault::None);
    let cache = tempfile::tempdir().expect("tmp");
    let out = tempfile::tempdir().expect("tmp");
    let encoders = [
        "pipeline/text_encoder/model.safetensors",
        "pipeline/text_encoder_2/model.safetensors",
    ];
    let bytes = |srv: &TestServer| -> Vec<u64> {
        let s = srv.stats();
        encoders
            .iter()
            .map(|p| s.bytes_by_path.get(*p).copied().unwrap_or(0))
            .collect()
    };
    let run = |png: &Path| -> serde_json::Value {
        let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
            .args([
                "run",
                "--model",
                &format!("{}/pipeline", srv.base),
                "--prompt",
                "a lighthouse in a storm",
                "--height",
                "32",
                "--width",
                "32",
                "--steps",
                "2",
                "--max-sequence-length",
                "32",
                "--backend",
                "cpu",
                "--embed-cache",
                cache.path().to_str().expect("utf8"),
                "--out",
                png.to_str().expect("utf8"),
                "--json",
            ])
            .output()
            .expect("run");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).expect("json")
    };
    let (a, b) = (out.path().join("a.png"), out.path().join("b.png"));
    let before = bytes(&srv);
    let first = run(&a);
    let mid = bytes(&srv);
    let second = run(&b);
    let after = bytes(&srv);
    assert_eq!(first["embed_cache"], "miss");
    assert_eq!(second["embed_cache"], "hit");
    let cached: Vec<_> = second["phases"]
        .as_array()
        .expect("phases")
        .iter()
        .filter(|p| p["cached"] == true)
        .map(|p| p["phase"].as_str().expect("phase").to_string())
        .collect();
    assert_eq!(cached, ["CLIP", "T5"]);
    for (i, name) in encoders.iter().enumerate() {
        let m = ModelIndex::open(&dir.join(name.trim_start_matches("pipeline/")))
            .expect("encoder file");
        let header = 8 + m.shards[0].header.header_len;
        let weights = m.shards[0].header.file_len - header;
        assert!(
            mid[i] - before[i] >= weights,
            "{name}: the first run read its weights"
        );
        assert!(
            after[i] - mid[i] <= header + 8,
            "{name}: the cached run read {} bytes (header {header})",
            after[i] - mid[i]
        );
    }
    assert_eq!(
        std::fs::read(&a).expect("a"),
        std::fs::read(&b).expect("b"),
        "the same picture"
    );
}

/// One device budget serves every phase: a budget too small for any of them is refused before
/// a weight byte is read, naming the smallest budget that runs all four, and that budget runs.
#[test]
fn an_impossible_budget_names_the_smallest_that_runs_every_phase() {
    let dir = fixture().join("pipeline");
    let tmp = tempfile::tempdir().expect("tmp");
    let run = |budget: &str| {
        Command::new(env!("CARGO_BIN_EXE_nibble"))
            .args(["run", "--model"])
            .arg(&dir)
            .args([
                "--prompt",
                "a red fox",
                "--height",
                "32",
                "--width",
                "32",
                "--steps",
                "1",
                "--max-sequence-length",
                "64",
                "--backend",
                "cpu",
                "--device-budget",
                budget,
                "--out",
            ])
            .arg(tmp.path().join("fox.png"))
            .output()
            .expect("run nibble")
    };
    let o = run("1KiB");
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "1 KiB ran");
    let at = err
        .find("smallest that runs all four is")
        .unwrap_or_else(|| panic!("no smallest budget named: {err}"));
    let need = err[at..]
        .split("use --device-budget ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no budget to use: {err}"))
        .to_string();
    let o = run(&need);
    assert!(
        o.status.success(),
        "the budget named ({need}) does not run: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(tmp.path().join("fox.png").is_file());
}

/// #32 faults 12-13: cache entries are trusted by content. An entry whose values changed, one
/// copied from another prompt under this prompt's name, and one of the wrong size are each
/// encoded again (with a warning) and give the uncached picture; a cache path that cannot be a
/// folder is refused before any phase runs.
#[test]
fn cache_entries_are_trusted_by_content() {
    let dir = fixture().join("pipeline");
    let cache = tempfile::tempdir().expect("tmp");
    let out = tempfile::tempdir().expect("tmp");
    let run = |prompt: &str, cache: &Path, png: &str| {
        Command::new(env!("CARGO_BIN_EXE_nibble"))
            .args(["run", "--model"])
            .arg(&dir)
            .args([
                "--prompt", prompt, "--height", "32", "--width", "32", "--steps", "1",
            ])
            .args([
                "--max-sequence-length",
                "32",
                "--backend",
                "cpu",
                "--json",
                "--embed-cache",
            ])
            .arg(cache)
            .arg("--out")
            .arg(out.path().join(png))
            .output()
            .expect("run")
    };
    let ok = |o: std::process::Output| -> (serde_json::Value, String) {
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{err}");
        (serde_json::from_slice(&o.stdout).expect("json"), err)
    };
    let (first, _) = ok(run("a lighthouse", cache.path(), "a.png"));
    assert_eq!(first["embed_cache"], "miss");
    let want = std::fs::read(out.path().join("a.png")).expect("a.png");
    let entries = |c: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(c)
            .expect("cache")
            .flatten()
            .map(|e| e.path())
            .collect();
        v.sort();
        v
    };
    let entry = entries(cache.path()).remove(0);
    let good = std::fs::read(&entry).expect("entry");
    let again = |what: &str, says: &str| {
        let (v, err) = ok(run("a lighthouse", cache.path(), "b.png"));
        assert_eq!(v["embed_cache"], "miss", "{what}: recomputed");
        assert!(err.contains(says), "{what}: {err}");
        let got = std::fs::read(out.path().join("b.png")).expect("b.png");
        assert!(got == want, "{what}: the same picture as without the cache");
    };
    // One value changed (the last bytes of the file are prompt_embeds data).
    let mut bad = good.clone();
    let n = bad.len();
    bad[n - 2] ^= 0x40;
    std::fs::write(&entry, &bad).expect("write");
    again("a changed value", "checksum");
    // Another prompt's entry under this prompt's name.
    let other = tempfile::tempdir().expect("tmp");
    ok(run("a red fox", other.path(), "c.png"));
    std::fs::copy(entries(other.path()).remove(0), &entry).expect("copy");
    again("another prompt's entry", "another prompt or model");
    // The right key, the wrong size.
    let m = ModelIndex::open(&entry).expect("entry");
    let meta = m.shards[0].header.metadata.clone();
    let pooled = f32s(&m, "pooled_prompt_embeds");
    let ctx = f32s(&m, "prompt_embeds");
    drop(m);
    let half = &ctx[..ctx.len() / 2];
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    nibble_core::format::writer::write_safetensors(
        &entry,
        &[
            (
                "pooled_prompt_embeds".into(),
                nibble_core::format::dtype::Dtype::F32,
                vec![1, pooled.len() as u64],
                bytes(&pooled),
            ),
            (
                "prompt_embeds".into(),
                nibble_core::format::dtype::Dtype::F32,
                vec![1, half.len() as u64],
                bytes(half),
            ),
        ],
        &meta,
    )
    .expect("write");
    again("a wrong-sized entry", "the model takes");
    // A cache path that is a file: refused at once.
    let file = out.path().join("not-a-folder");
    std::fs::write(&file, b"x").expect("write");
    let o = run("a lighthouse", &file, "d.png");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--embed-cache") && !err.contains("phase"),
        "{err}"
    );
    assert!(!out.path().join("d.png").exists());
}
