//! The pieces of diffusers' `FluxPipeline` around its models, against the tiny-flux-pipeline
//! fixture (what diffusers computed): torch-compatible noise bit for bit, the packing of latents
//! into tokens and their position ids, `mu`, the sigmas and the timesteps.

use nibble_core::models::flux::noise::NoiseMath;
use nibble_core::models::flux::{initial_latents, latent_grid, latent_image_ids, pack_latents};
use nibble_core::models::scheduler::SchedulerConfig;
use nibble_tests::*;

fn expected() -> Expected {
    Expected::open(&fixture("tiny-flux-pipeline/expected.safetensors"))
}

fn manifest() -> serde_json::Value {
    read_json(&fixture("tiny-flux-pipeline/manifest.json"))
}

fn f64s(e: &Expected, name: &str) -> Vec<f64> {
    e.bytes(name)
        .unwrap_or_else(|| panic!("{name}"))
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8")))
        .collect()
}

/// Which of torch's two transforms the fixture's noise came from (the machine that wrote it
/// decides); the test accepts either, bit for bit, and says which.
fn noise_math(e: &Expected, seed: u64, grid: (usize, usize), c: usize) -> Option<NoiseMath> {
    let want = e.f32("p0.initial_latents").expect("initial_latents");
    [NoiseMath::Libm, NoiseMath::AvxMathfun]
        .into_iter()
        .find(|&m| canon(&initial_latents(seed, c, grid, m)) == canon(&want))
}

fn canon(v: &[f32]) -> Vec<u32> {
    v.iter().map(|&x| canon_bits(x)).collect()
}

#[test]
fn seeded_noise_is_torchs_bit_for_bit() {
    let (e, m) = (expected(), manifest());
    let run = &m["run"];
    let (h, w) = (
        run["height"].as_u64().expect("height") as usize,
        run["width"].as_u64().expect("width") as usize,
    );
    let vsf = run["vae_scale_factor"].as_u64().expect("vae_scale_factor") as usize;
    let c = run["latent_channels"].as_u64().expect("latent_channels") as usize;
    let grid = latent_grid(h, w, vsf).expect("grid");
    let seeds: Vec<u64> = run["generator_seeds"]
        .as_array()
        .expect("seeds")
        .iter()
        .map(|s| s.as_u64().expect("seed"))
        .collect();
    let math = noise_math(&e, seeds[0], grid, c)
        .expect("neither of torch's transforms gives the fixture's initial latents");
    println!("the fixture's noise is torch's {math:?} transform");
    for (i, &seed) in seeds.iter().enumerate() {
        let unpacked = e
            .f32(&format!("p{i}.initial_noise_unpacked"))
            .expect("noise");
        let n = nibble_core::models::flux::noise::torch_randn(c * grid.0 * grid.1, seed, math);
        assert_eq!(canon(&n), canon(&unpacked), "p{i}: noise");
        let packed = e.f32(&format!("p{i}.initial_latents")).expect("latents");
        assert_eq!(
            canon(&pack_latents(&n, c, grid.0, grid.1)),
            canon(&packed),
            "p{i}: packing"
        );
        let ids = e.f32(&format!("p{i}.latent_image_ids")).expect("ids");
        assert_eq!(latent_image_ids(grid.0 / 2, grid.1 / 2), ids, "p{i}: ids");
    }
}

#[test]
fn mu_sigmas_and_timesteps_are_diffusers() {
    let (e, m) = (expected(), manifest());
    let json = read_json(&fixture(
        "tiny-flux-pipeline/pipeline/scheduler/scheduler_config.json",
    ));
    let cfg = SchedulerConfig::from_json("scheduler_config.json", &json).expect("scheduler");
    let run = &m["run"];
    let steps = run["num_inference_steps"].as_u64().expect("steps") as usize;
    let tokens = run["packed_tokens"].as_u64().expect("tokens") as usize;
    for i in 0..2 {
        let mu = cfg.mu(tokens);
        assert_eq!(mu, f64s(&e, &format!("p{i}.mu"))[0], "p{i}: mu");
        let sigmas = cfg.pipeline_sigmas(steps, mu).expect("sigmas");
        let want = e.f32(&format!("p{i}.sigmas")).expect("sigmas");
        assert_eq!(sigmas.len(), want.len());
        for (a, b) in sigmas.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-7, "p{i}: sigmas {sigmas:?} vs {want:?}");
        }
        let t = cfg.timesteps(&sigmas);
        let want_t = e.f32(&format!("p{i}.timesteps")).expect("timesteps");
        for (a, b) in t.iter().zip(&want_t) {
            assert!((a - b).abs() <= 1e-4, "p{i}: timesteps {t:?} vs {want_t:?}");
        }
    }
}

fn i64s(e: &Expected, name: &str) -> Vec<u32> {
    e.bytes(name)
        .unwrap_or_else(|| panic!("{name}"))
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as u32)
        .collect()
}

#[test]
fn both_prompt_tokenizers_give_the_pipelines_ids() {
    use nibble_core::models::flux::tokens::{ClipTokenizer, T5Tokenizer};
    let (e, m) = (expected(), manifest());
    let dir = fixture("tiny-flux-pipeline/pipeline");
    let read = |p: &str| std::fs::read(dir.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    let cfg: serde_json::Value =
        serde_json::from_slice(&read("tokenizer/tokenizer_config.json")).expect("config");
    let clip = ClipTokenizer::from_files(
        &read("tokenizer/vocab.json"),
        &read("tokenizer/merges.txt"),
        &cfg,
    )
    .expect("clip tokenizer");
    let t5 = T5Tokenizer::from_json(
        &read("tokenizer_2/tokenizer.json"),
        "tokenizer_2/tokenizer.json",
    )
    .expect("t5");
    let max_seq = m["run"]["max_sequence_length"].as_u64().expect("msl") as usize;
    for (i, p) in m["prompts"].as_array().expect("prompts").iter().enumerate() {
        let text = p["text"].as_str().expect("text");
        let (ids, n) = clip.encode(text).expect("clip");
        assert_eq!(
            ids,
            i64s(&e, &format!("p{i}.clip_input_ids")),
            "p{i}: CLIP ids"
        );
        assert_eq!(
            n + 2,
            p["clip"]["untruncated_len"].as_u64().expect("len") as usize
        );
        let (ids, n) = t5.encode(text, max_seq).expect("t5");
        assert_eq!(ids, i64s(&e, &format!("p{i}.t5_input_ids")), "p{i}: T5 ids");
        assert_eq!(
            n,
            p["t5"]["untruncated_len_with_eos"].as_u64().expect("len") as usize
        );
    }
}

/// The prompt-embedding cache's key follows the encoders' files: over HTTP their `ETag`
/// (replacing a model under the same URL with a same-shaped one gives another key), locally
/// their modification time; the same files give the same key.
#[test]
fn the_embedding_key_follows_the_encoders_etags_and_modification_times() {
    use nibble_core::models::flux::pipeline::{FluxPipeline, FluxRequest, Noise, VaeTiling};
    use nibble_core::models::pipeline::Pipeline;
    use nibble_tests::http_server::{Fault, TestServer};
    let dir = fixture("tiny-flux-pipeline/pipeline");
    let files = nibble_tests::http_server::files_under(&dir, "pipeline");
    let srv = TestServer::start(files, Fault::None);
    let req = FluxRequest {
        prompt: "a red fox".into(),
        height: 32,
        width: 32,
        steps: 1,
        guidance: 3.5,
        max_sequence_length: 8,
        noise: Noise::Seed(0, NoiseMath::Libm),
        vae_tiling: VaeTiling::Off,
        vae_tile: None,
    };
    let key = |root: &str| {
        let pipe = FluxPipeline::open(root, Default::default()).expect("open");
        let p = pipe.prepare(&req).expect("prepare");
        pipe.embed_key(&p)
    };
    let url = format!("{}/pipeline", srv.base);
    let first = key(&url);
    assert_eq!(key(&url), first, "the same files give the same key");
    srv.set_fault(Fault::EtagChangesAfter(0));
    let changed = key(&url);
    assert_ne!(changed, first, "a new ETag gives a new key");
    srv.set_fault(Fault::None);
    assert_eq!(key(&url), first);
    // Locally: a copy whose T5 weights were rewritten (same bytes, new modification time).
    let tmp = tempfile::tempdir().expect("tmp");
    let copy = tmp.path().join("pipeline");
    let cp = |from: &std::path::Path, to: &std::path::Path| {
        fn rec(a: &std::path::Path, b: &std::path::Path) {
            std::fs::create_dir_all(b).expect("mkdir");
            for e in std::fs::read_dir(a).expect("dir") {
                let p = e.expect("entry").path();
                let t = b.join(p.file_name().expect("name"));
                if p.is_dir() {
                    rec(&p, &t);
                } else {
                    std::fs::copy(&p, &t).expect("copy");
                }
            }
        }
        rec(from, to)
    };
    cp(&dir, &copy);
    let local = copy.to_string_lossy().to_string();
    let before = key(&local);
    assert_eq!(key(&local), before);
    let t5 = copy.join("text_encoder_2/model.safetensors");
    let bytes = std::fs::read(&t5).expect("read");
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&t5, bytes).expect("rewrite");
    assert_ne!(
        key(&local),
        before,
        "a rewritten encoder file gives a new key"
    );
}
