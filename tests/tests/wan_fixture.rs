//! The pieces of diffusers' `WanPipeline` run (tiny-wan-pipeline) that nibble computes so far,
//! against its recorded tensors, for both prompts: the seeded initial latents, UniPC (the
//! schedule from the folder's `scheduler_config.json`, guidance, and every step's data
//! prediction, corrected sample and latents, fed the recorded transformer outputs) and umT5's
//! hidden states and prompt embeddings on every backend present.

use nibble_core::models::scheduler::{guide, FlowSampler, UniPc, UniPcConfig};
use nibble_tests::*;

fn i64s(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

#[test]
fn unipc_reproduces_every_step_of_diffusers_wan_run() {
    let root = fixture("tiny-wan-pipeline");
    let cfg_json = read_json(&root.join("pipeline/scheduler/scheduler_config.json"));
    let cfg = UniPcConfig::from_json("scheduler_config.json", &cfg_json).expect("config");
    let e = Expected::open(&root.join("expected.safetensors"));
    let get = |n: &str| e.f32(n).unwrap_or_else(|| panic!("{n} missing"));
    for p in ["p0", "p1"] {
        let want_t = i64s(&e.bytes(&format!("{p}.timesteps")).expect("timesteps"));
        let steps = want_t.len();
        let mut u = UniPc::new(cfg.clone(), steps).expect("unipc");
        assert_eq!(u.timesteps(), want_t.as_slice(), "{p}: timesteps");
        let want_s = get(&format!("{p}.sigmas"));
        assert_bits_eq(u.sigmas(), &want_s, &format!("{p}: sigmas"));
        let mut x = get(&format!("{p}.initial_latents"));
        let mut worst = 0f64;
        for k in 0..steps {
            let t = i64s(&e.bytes(&format!("{p}.model_timestep_step{k}")).expect("t"));
            assert_eq!(u.timestep(k), t[0] as f32, "{p} step {k}: model timestep");
            let cond = get(&format!("{p}.noise_pred_cond_step{k}"));
            let uncond = get(&format!("{p}.noise_pred_uncond_step{k}"));
            let v = guide(&cond, &uncond, 5.0);
            assert_bits_eq(&v, &get(&format!("{p}.noise_pred_step{k}")), "guidance");
            u.step(k, &mut x, &v).expect("step");
            for (got, name) in [
                (u.last_x0().expect("x0"), "x0_pred"),
                (u.last_corrected().expect("corrected"), "sample_corrected"),
                (x.as_slice(), "latents"),
            ] {
                let want = get(&format!("{p}.{name}_step{k}"));
                let err = max_err_rel_to_max(got, &want);
                worst = worst.max(err);
                assert!(err <= 1e-4, "{p} step {k} {name}: {err:e} x max");
            }
        }
        // The last step (sigma 0) lands on its data prediction, exactly, as diffusers' does.
        let last_x0 = u.last_x0().expect("x0").to_vec();
        assert_bits_eq(&x, &last_x0, "final");
        let final_err = max_err_rel_to_max(&x, &get(&format!("{p}.final_latents")));
        println!("{p}: worst step error {worst:e} x max, final latents {final_err:e} x max");
    }
}

/// `torch.randn(latent shape, generator=torch.Generator("cpu").manual_seed(seed))`, bit for bit.
#[test]
fn seeded_latents_are_torchs() {
    use nibble_core::models::flux::noise::{torch_randn, NoiseMath};
    let root = fixture("tiny-wan-pipeline");
    let manifest = read_json(&root.join("manifest.json"));
    let seeds = manifest["run"]["generator_seeds"]
        .as_array()
        .expect("seeds")
        .iter()
        .map(|s| s.as_u64().expect("seed"))
        .collect::<Vec<_>>();
    let e = Expected::open(&root.join("expected.safetensors"));
    for (p, seed) in seeds.iter().enumerate() {
        let want = e.f32(&format!("p{p}.initial_latents")).expect("latents");
        let got = torch_randn(want.len(), *seed, NoiseMath::AvxMathfun);
        assert_bits_eq(&got, &want, &format!("p{p} seed {seed}"));
    }
}

/// umT5 (`UMT5EncoderModel`, NF4 double quant, a position bias in every layer, the attention
/// mask passed) on the pipeline's ids: the last hidden state and the prompt embeddings (cut to
/// the prompt's tokens, zero-filled back), for the prompt and the negative prompt, resident and
/// streamed through a small ring.
fn umt5_on<B: nibble_core::backend::Backend>(mut make: impl FnMut() -> B, label: &str) {
    use nibble_core::models::t5::{self, UmT5Encoder};
    let root = fixture("tiny-wan-pipeline");
    let m = nibble_core::io::model::ModelIndex::open(&root.join("pipeline/text_encoder"))
        .expect("text encoder");
    let e = Expected::open(&root.join("expected.safetensors"));
    for streamed in [false, true] {
        for p in ["p0", "p1"] {
            for side in ["", "neg_"] {
                let what = format!("{label} streamed={streamed} {p} {side}");
                let ids: Vec<u32> = i64s(&e.bytes(&format!("{p}.{side}input_ids")).expect("ids"))
                    .into_iter()
                    .map(|i| i as u32)
                    .collect();
                let mask = i64s(&e.bytes(&format!("{p}.{side}attention_mask")).expect("mask"));
                let len = mask.iter().filter(|&&v| v == 1).count();
                let mut b = make();
                let (g, cfg) = t5::build_with(&m, ids.len(), true).expect("graph");
                assert!(cfg.per_layer_bias, "umt5 has a bias in every layer");
                let o = run_opts(&g, &m, &mut b, streamed);
                let mut enc = UmT5Encoder::new(&m, b, ids.len(), o).expect("umt5");
                let (states, stats) = enc.forward(&ids, len).expect("forward");
                if streamed {
                    assert!(stats.stream.bytes > 0, "{what}: streamed");
                }
                let want = e
                    .f32(&format!("{p}.{side}text_encoder_last_hidden_state"))
                    .expect("states");
                let err = max_err_rel_to_max(&states, &want);
                assert!(err <= 1e-5, "{what}: hidden states {err:e} x max");
                let embeds = t5::prompt_embeds(states, len, cfg.d_model);
                let name = if side.is_empty() {
                    "prompt_embeds"
                } else {
                    "negative_prompt_embeds"
                };
                let want = e.f32(&format!("{p}.{name}")).expect("embeds");
                let err = max_err_rel_to_max(&embeds, &want);
                assert!(err <= 1e-5, "{what}: {name} {err:e} x max");
                println!("{what}: hidden states and {name} {err:.2e} x max");
            }
        }
    }
}

#[test]
fn umt5_matches_transformers_on_cpu_ref() {
    umt5_on(nibble_core::backend::cpu_ref::CpuRefBackend::new, "cpu_ref");
}

#[test]
fn umt5_matches_transformers_on_cpu() {
    umt5_on(nibble_core::backend::cpu::CpuBackend::new, "cpu");
}

#[test]
fn umt5_matches_transformers_on_wgpu() {
    if wgpu_or_absent("umt5").is_none() {
        return;
    }
    umt5_on(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
}

/// The Wan transformer's rotary tables equal diffusers' (`trace_dit_rope_cos/sin`, whose pairs
/// repeat each value twice).
#[test]
fn wan_rotary_tables_are_diffusers() {
    use nibble_core::models::wan::{patch_grid, rope_tables, WanConfig};
    let root = fixture("tiny-wan-pipeline");
    let m = nibble_core::io::model::ModelIndex::open(&root.join("pipeline/transformer"))
        .expect("transformer");
    let cfg = WanConfig::of(&m).expect("config");
    let e = Expected::open(&root.join("expected.safetensors"));
    let grid = patch_grid(&cfg, (3, 6, 8)).expect("grid");
    let (cos, sin) = rope_tables(&cfg, grid).expect("tables");
    for (got, name) in [(cos, "cos"), (sin, "sin")] {
        let want: Vec<f32> = e
            .f32(&format!("p0.trace_dit_rope_{name}"))
            .expect("trace")
            .into_iter()
            .step_by(2)
            .collect();
        assert_bits_eq(&got, &want, name);
    }
}

/// Wan's whole guided denoise loop against diffusers' run: the transformer (NF4, both guidance
/// sequences in one pass over the weights) in the shared denoise loop with UniPC, from the
/// recorded prompt embeddings and initial latents: every step's two predictions and latents,
/// and a guided step reads each weight byte once.
fn wan_loop_on<B: nibble_core::backend::Backend>(mut make: impl FnMut() -> B, label: &str) {
    use nibble_core::exec::Executor;
    use nibble_core::models::denoise::{DenoiseLoop, DenoiseModel};
    use nibble_core::models::wan::{self, WanTransformer};
    let root = fixture("tiny-wan-pipeline");
    let m = nibble_core::io::model::ModelIndex::open(&root.join("pipeline/transformer"))
        .expect("transformer");
    let sched = UniPcConfig::from_json(
        "scheduler_config.json",
        &read_json(&root.join("pipeline/scheduler/scheduler_config.json")),
    )
    .expect("scheduler");
    let e = Expected::open(&root.join("expected.safetensors"));
    let get = |n: &str| e.f32(n).unwrap_or_else(|| panic!("{n} missing"));
    let dims = (3, 6, 8);
    for streamed in [false, true] {
        for p in ["p0", "p1"] {
            let what = format!("{label} streamed={streamed} {p}");
            let mut text = get(&format!("{p}.prompt_embeds"));
            text.extend(get(&format!("{p}.negative_prompt_embeds")));
            let cfg = wan::WanConfig::of(&m).expect("config");
            let t = text.len() / 2 / cfg.text_dim;
            let (gf, gh, gw) = wan::patch_grid(&cfg, dims).expect("grid");
            let wg = wan::build(&m, gf * gh * gw, t, 2).expect("graph");
            let mut b = make();
            let o = run_opts(&wg.graph, &m, &mut b, streamed);
            let ex = Executor::new(wg.graph, &m, b, o).expect("executor");
            let per_step = ex.plan().streamed_bytes_per_step;
            let model = WanTransformer::new(ex, wg.config, dims, text, Some(5.0)).expect("model");
            let u = UniPc::new(sched.clone(), 4).expect("unipc");
            let mut run = DenoiseLoop::new(model, u, get(&format!("{p}.initial_latents")));
            let mut worst = 0f64;
            for k in 0..4 {
                // The two predictions of this step, from the same pass.
                let x = run.latent().to_vec();
                let ts = run.sampler().timestep(k);
                let inputs = run.model().step_inputs(&x, ts).expect("inputs");
                let (out, _) = run.model_mut().executor_mut().step(&inputs).expect("pass");
                let (cond, uncond) = run.model().predictions(out).expect("predictions");
                for (got, name) in [(cond, "cond"), (uncond.expect("uncond"), "uncond")] {
                    let want = get(&format!("{p}.noise_pred_{name}_step{k}"));
                    let err = max_err_rel_to_max(&got, &want);
                    worst = worst.max(err);
                    assert!(err <= 1e-4, "{what} step {k} {name}: {err:e} x max");
                }
                let s = run.step().expect("step").expect("a step");
                if streamed {
                    assert_eq!(
                        s.stats.stream.bytes, per_step,
                        "{what}: a guided step reads the streamed weights once"
                    );
                }
                let err = max_err_rel_to_max(run.latent(), &get(&format!("{p}.latents_step{k}")));
                worst = worst.max(err);
                assert!(err <= 1e-4, "{what} step {k} latents: {err:e} x max");
            }
            assert!(run.step().expect("done").is_none());
            let err = max_err_rel_to_max(run.latent(), &get(&format!("{p}.final_latents")));
            assert!(err <= 1e-4, "{what}: final latents {err:e} x max");
            println!("{what}: worst {worst:.2e} x max, final latents {err:.2e} x max");
        }
    }
}

#[test]
fn wan_guided_loop_matches_diffusers_on_cpu_ref() {
    wan_loop_on(nibble_core::backend::cpu_ref::CpuRefBackend::new, "cpu_ref");
}

#[test]
fn wan_guided_loop_matches_diffusers_on_cpu() {
    wan_loop_on(nibble_core::backend::cpu::CpuBackend::new, "cpu");
}

#[test]
fn wan_guided_loop_matches_diffusers_on_wgpu() {
    if wgpu_or_absent("wan").is_none() {
        return;
    }
    wan_loop_on(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
}

/// The Wan VAE's decoder, latent frame by latent frame with its caches in the arena, on the
/// pipeline's final latents: `vae_input` from the latents' mean and std, then the video
/// (`video_f32`, clamped) within 1e-4 x max, resident and streamed.
fn wan_vae_on<B: nibble_core::backend::Backend>(mut make: impl FnMut() -> B, label: &str) {
    use nibble_core::models::wan::vae::{self, WanVaeDecoder};
    let root = fixture("tiny-wan-pipeline");
    let m = nibble_core::io::model::ModelIndex::open(&root.join("pipeline/vae")).expect("vae");
    let e = Expected::open(&root.join("expected.safetensors"));
    let get = |n: &str| e.f32(n).unwrap_or_else(|| panic!("{n} missing"));
    for streamed in [false, true] {
        for p in ["p0", "p1"] {
            let what = format!("{label} streamed={streamed} {p}");
            let (g, cfg) = vae::build(&m, 6, 8).expect("graph");
            let z = cfg.decoder_input(&get(&format!("{p}.final_latents")));
            assert_bits_eq(&z, &get(&format!("{p}.vae_input")), "vae_input");
            let mut b = make();
            let o = run_opts(&g, &m, &mut b, streamed);
            let mut dec = WanVaeDecoder::new(&m, b, (6, 8), o).expect("decoder");
            let video = dec.decode(&z).expect("decode");
            let want = get(&format!("{p}.video_f32"));
            let err = max_err_rel_to_max(&video, &want);
            assert!(err <= 1e-4, "{what}: video {err:e} x max");
            let frames = vae::frames_u8(&video, (3, 9, 48, 64)).expect("frames");
            let want_u8 = e.bytes(&format!("{p}.video_u8")).expect("u8");
            let off = frames
                .iter()
                .zip(&want_u8)
                .map(|(a, b)| a.abs_diff(*b))
                .collect::<Vec<_>>();
            let equal = off.iter().filter(|&&d| d == 0).count() as f64 / off.len() as f64;
            assert!(
                off.iter().all(|&d| d <= 1) && equal >= 0.99,
                "{what}: 8-bit frames differ by up to {:?}, {equal} equal",
                off.iter().max()
            );
            println!(
                "{what}: video {err:.2e} x max, 8-bit frames {:.4} equal",
                equal
            );
        }
    }
}

#[test]
fn wan_vae_matches_diffusers_on_cpu_ref() {
    wan_vae_on(nibble_core::backend::cpu_ref::CpuRefBackend::new, "cpu_ref");
}

#[test]
fn wan_vae_matches_diffusers_on_cpu() {
    wan_vae_on(nibble_core::backend::cpu::CpuBackend::new, "cpu");
}

#[test]
fn wan_vae_matches_diffusers_on_wgpu() {
    if wgpu_or_absent("wan vae").is_none() {
        return;
    }
    wan_vae_on(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
}

/// `vae_tiled.safetensors`: a seeded random latent video decoded whole and in diffusers' tiles
/// (32 x 32 pixels every 24, blended over 8), each within 1e-4 x max of `AutoencoderKLWan`'s,
/// resident and streamed; the tiled decode streams the weights once per tile.
fn wan_tiled_vae_on<B: nibble_core::backend::Backend>(mut make: impl FnMut() -> B, label: &str) {
    use nibble_core::models::wan::{tiling, vae, WanTiling};
    let root = fixture("tiny-wan-pipeline");
    let m = nibble_core::io::model::ModelIndex::open(&root.join("pipeline/vae")).expect("vae");
    let e = Expected::open(&root.join("vae_tiled.safetensors"));
    let get = |n: &str| e.f32(n).unwrap_or_else(|| panic!("{n} missing"));
    let z = get("latents");
    let tiles = WanTiling {
        tile: (32, 32),
        stride: (24, 24),
    };
    assert_eq!(tiles.shapes((8, 12), 8), [(4, 4), (4, 3), (2, 4), (2, 3)]);
    for streamed in [false, true] {
        let what = format!("{label} streamed={streamed}");
        // Whole frames.
        let (g, _) = vae::build(&m, 8, 12).expect("graph");
        let mut b = make();
        let o = run_opts(&g, &m, &mut b, streamed);
        let mut dec = vae::WanVaeDecoder::new(&m, b, (8, 12), o).expect("decoder");
        let video = dec.decode(&z).expect("decode");
        let err = max_err_rel_to_max(&video, &get("video_f32_untiled"));
        assert!(err <= 1e-4, "{what}: untiled video {err:e} x max");
        // Tiles: planned for the largest tile.
        let (g, _) = vae::build(&m, 4, 4).expect("graph");
        let mut b = make();
        let o = run_opts(&g, &m, &mut b, streamed);
        let (tiled, _, bytes) = nibble_core::io::folder::block_on(tiling::tiled_decode(
            &m,
            b,
            &z,
            (3, 8, 12),
            tiles,
            o,
            &nibble_core::models::Drive::Blocking,
        ))
        .expect("tiled decode");
        let err_t = max_err_rel_to_max(&tiled, &get("video_f32_tiled"));
        assert!(err_t <= 1e-4, "{what}: tiled video {err_t:e} x max");
        if streamed {
            // 12 tiles of 3 latent frames, each frame one pass over the streamed weights.
            assert!(
                bytes > 0 && bytes % 36 == 0,
                "{what}: {bytes} bytes streamed"
            );
        }
        println!("{what}: untiled {err:.2e} x max, tiled {err_t:.2e} x max");
    }
}

#[test]
fn wan_tiled_vae_matches_diffusers_on_cpu_ref() {
    wan_tiled_vae_on(nibble_core::backend::cpu_ref::CpuRefBackend::new, "cpu_ref");
}

#[test]
fn wan_tiled_vae_matches_diffusers_on_cpu() {
    wan_tiled_vae_on(nibble_core::backend::cpu::CpuBackend::new, "cpu");
}

#[test]
fn wan_tiled_vae_matches_diffusers_on_wgpu() {
    if wgpu_or_absent("wan tiled vae").is_none() {
        return;
    }
    wan_tiled_vae_on(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
}

/// The ids the text encoder gets: the pipeline's prompt cleaning, the umT5 tokenizer, `</s>`
/// kept when truncated, `<pad>` after; and the mask's length. No negative prompt is `""`.
#[test]
fn prompt_ids_are_the_pipelines() {
    use nibble_core::models::flux::tokens::T5Tokenizer;
    use nibble_core::models::wan::text::prompt_ids;
    let root = fixture("tiny-wan-pipeline");
    let tok = T5Tokenizer::from_json(
        &std::fs::read(root.join("pipeline/tokenizer/tokenizer.json")).expect("tokenizer"),
        "tokenizer/tokenizer.json",
    )
    .expect("tokenizer");
    let manifest = read_json(&root.join("manifest.json"));
    let e = Expected::open(&root.join("expected.safetensors"));
    for (i, pr) in manifest["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .enumerate()
    {
        let p = format!("p{i}");
        for (side, text) in [
            ("", pr["text"].as_str().unwrap_or_default()),
            ("neg_", pr["negative_prompt"].as_str().unwrap_or_default()),
        ] {
            let want: Vec<u32> = i64s(&e.bytes(&format!("{p}.{side}input_ids")).expect("ids"))
                .into_iter()
                .map(|v| v as u32)
                .collect();
            let mask = i64s(&e.bytes(&format!("{p}.{side}attention_mask")).expect("mask"));
            let (ids, len) = prompt_ids(&tok, text, want.len()).expect("ids");
            assert_eq!(ids, want, "{p} {side}ids");
            assert_eq!(
                len,
                mask.iter().filter(|&&m| m == 1).count(),
                "{p} {side}length"
            );
        }
    }
}

/// The whole pipeline folder, prompt to frames, as diffusers' `WanPipeline.__call__` with the
/// fixture's call: ids, noise, every step's latents, the video within 1e-4 x max and the 8-bit
/// frames within 1, for both prompts (the second without a negative prompt).
#[test]
fn the_pipeline_folder_makes_diffusers_video() {
    use nibble_core::exec::ExecOptions;
    use nibble_core::models::pipeline::Pipeline;
    use nibble_core::models::wan::pipeline::{WanPipeline, WanRequest};
    use nibble_core::plan::Budgets;
    let root = fixture("tiny-wan-pipeline");
    let pipe = WanPipeline::open(&root.join("pipeline").to_string_lossy(), Default::default())
        .expect("open");
    let manifest = read_json(&root.join("manifest.json"));
    let run = &manifest["run"];
    let e = Expected::open(&root.join("expected.safetensors"));
    let get = |n: &str| e.f32(n).unwrap_or_else(|| panic!("{n} missing"));
    for (i, pr) in manifest["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .enumerate()
    {
        let p = format!("p{i}");
        let req = WanRequest {
            prompt: pr["text"].as_str().expect("text").to_string(),
            negative_prompt: pr["negative_prompt"].as_str().map(str::to_string),
            height: run["height"].as_u64().expect("h") as usize,
            width: run["width"].as_u64().expect("w") as usize,
            frames: run["num_frames"].as_u64().expect("frames") as usize,
            steps: run["num_inference_steps"].as_u64().expect("steps") as usize,
            guidance: run["guidance_scale"].as_f64().expect("g") as f32,
            seed: pr["generator_seed"].as_u64().expect("seed"),
            max_sequence_length: run["max_sequence_length"].as_u64().expect("msl") as usize,
            ..Default::default()
        };
        let mut prepared = pipe.prepare(&req).expect("prepare");
        assert_bits_eq(
            &prepared.latents,
            &get(&format!("{p}.initial_latents")),
            "noise",
        );
        let opts = ExecOptions {
            budgets: Budgets {
                device_bytes: 1 << 30,
                ring_slots: 2,
                slot_bytes: 1 << 20,
                host_tier_bytes: 0,
            },
            readers: 2,
            stream_all: false,
            naive: false,
        };
        let mut b = nibble_core::backend::cpu::CpuBackend::new();
        let plans = pipe.plans(&mut prepared, &mut b, opts).expect("plans");
        assert_eq!(plans.len(), 3, "text encoder, transformer, VAE");
        let mut phases = Vec::new();
        let out = pipe
            .run(&prepared, b, opts, |ev| {
                if let nibble_core::models::pipeline::Event::PhaseDone { phase, .. } = ev {
                    phases.push(phase)
                }
            })
            .expect("run");
        assert_eq!(phases, ["text encoder", "transformer", "VAE"]);
        for name in ["prompt_embeds", "final_latents", "vae_input", "video_f32"] {
            let (_, got) = &out.tensors[name];
            let err = max_err_rel_to_max(got, &get(&format!("{p}.{name}")));
            assert!(err <= 1e-4, "{p} {name}: {err:e} x max");
        }
        let want_u8 = e.bytes(&format!("{p}.video_u8")).expect("u8");
        assert_eq!(out.rgb.len(), want_u8.len());
        let worst = out
            .rgb
            .iter()
            .zip(&want_u8)
            .map(|(a, b)| a.abs_diff(*b))
            .max();
        assert!(worst <= Some(1), "{p}: 8-bit frames differ by {worst:?}");
        assert_eq!((out.frames, out.height, out.width), (9, 48, 64));
    }
}

/// Sizes and frame counts the model cannot take are refused, saying what would work.
#[test]
fn bad_sizes_and_frame_counts_say_what_works() {
    use nibble_core::models::pipeline::Pipeline;
    use nibble_core::models::wan::pipeline::{WanPipeline, WanRequest};
    let root = fixture("tiny-wan-pipeline");
    let pipe = WanPipeline::open(&root.join("pipeline").to_string_lossy(), Default::default())
        .expect("open");
    let base = WanRequest {
        prompt: "a fox".into(),
        height: 48,
        width: 64,
        frames: 9,
        steps: 2,
        max_sequence_length: 16,
        ..Default::default()
    };
    for (req, want) in [
        (
            WanRequest {
                frames: 8,
                ..base.clone()
            },
            "4k + 1 frames (for example 5 or 9)",
        ),
        (
            WanRequest {
                height: 40,
                ..base.clone()
            },
            "multiple of 16",
        ),
        (
            WanRequest {
                steps: 0,
                ..base.clone()
            },
            "denoising steps",
        ),
        (
            WanRequest {
                vae_tile: Some(nibble_core::models::wan::WanTiling {
                    tile: (32, 30),
                    stride: (24, 24),
                }),
                ..base.clone()
            },
            "multiples of 8",
        ),
    ] {
        let e = pipe.prepare(&req).expect_err(want).to_string();
        assert!(e.contains(want), "{e}");
    }
}
