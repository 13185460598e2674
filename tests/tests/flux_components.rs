//! The Flux pipeline's components against the tiny-flux-pipeline fixture (what diffusers'
//! `FluxPipeline` computed in float32 on the dequantized weights): CLIP's pooled output and T5's
//! prompt embeddings from the fixture's token ids (within 1e-5 x max), the VAE decoder's image
//! from the fixture's decoder input (within 1e-4 x max, 8-bit pixels within 1), on cpu_ref, cpu
//! and wgpu, with every weight resident and with every group streamed through a small ring.

use nibble_core::backend::cpu_ref::CpuRefBackend;
use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::clip::{self, ClipText};
use nibble_core::models::t5::{self, T5Encoder};
use nibble_tests::*;

const TOL: f64 = 1e-5;

fn component(name: &str) -> ModelIndex {
    ModelIndex::open(&fixture(&format!("tiny-flux-pipeline/pipeline/{name}")))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn expected() -> Expected {
    Expected::open(&fixture("tiny-flux-pipeline/expected.safetensors"))
}

fn ids(e: &Expected, name: &str) -> Vec<u32> {
    e.bytes(name)
        .unwrap_or_else(|| panic!("{name}"))
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as u32)
        .collect()
}

fn check<B: Backend>(mut make: impl FnMut() -> B, label: &str) {
    let e = expected();
    let (clip_m, t5_m) = (component("text_encoder"), component("text_encoder_2"));
    for streamed in [false, true] {
        for p in 0..2 {
            let what = format!("{label} streamed={streamed} p{p}");
            let clip_ids = ids(&e, &format!("p{p}.clip_input_ids"));
            let mut b = make();
            let (g, _) = clip::build(&clip_m, clip_ids.len()).expect("clip graph");
            let o = run_opts(&g, &clip_m, &mut b, streamed);
            let mut enc = ClipText::new(&clip_m, b, clip_ids.len(), o).expect("clip");
            let (states, pooled, stats) = enc.forward(&clip_ids).expect("clip forward");
            if streamed {
                assert!(stats.stream.bytes > 0, "{what}: CLIP streamed");
            }
            let want = e
                .f32(&format!("p{p}.clip_last_hidden_state"))
                .expect("clip");
            let err = max_err_rel_to_max(&states, &want);
            assert!(err <= TOL, "{what}: CLIP hidden states error {err:e} x max");
            println!("{what}: CLIP hidden states {err:.2e} x max");
            let want = e
                .f32(&format!("p{p}.pooled_prompt_embeds"))
                .expect("pooled");
            let err = max_err_rel_to_max(&pooled, &want);
            assert!(
                err <= TOL,
                "{what}: pooled_prompt_embeds error {err:e} x max"
            );
            println!("{what}: pooled_prompt_embeds {err:.2e} x max");

            let t5_ids = ids(&e, &format!("p{p}.t5_input_ids"));
            let mut b = make();
            let (g, _) = t5::build(&t5_m, t5_ids.len()).expect("t5 graph");
            let o = run_opts(&g, &t5_m, &mut b, streamed);
            let mut enc = T5Encoder::new(&t5_m, b, t5_ids.len(), o).expect("t5");
            let (states, stats) = enc.forward(&t5_ids).expect("t5 forward");
            if streamed {
                assert!(stats.stream.bytes > 0, "{what}: T5 streamed");
            }
            let want = e
                .f32(&format!("p{p}.prompt_embeds"))
                .expect("prompt_embeds");
            let err = max_err_rel_to_max(&states, &want);
            assert!(err <= TOL, "{what}: prompt_embeds error {err:e} x max");
            println!("{what}: prompt_embeds {err:.2e} x max");
        }
    }
}

#[test]
fn clip_and_t5_on_cpu_ref() {
    check(CpuRefBackend::new, "cpu_ref");
}

#[test]
fn clip_and_t5_on_cpu() {
    check(nibble_core::backend::cpu::CpuBackend::new, "cpu");
}

#[test]
fn clip_and_t5_on_wgpu() {
    if wgpu_or_absent("flux encoders").is_none() {
        return;
    }
    check(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
}

/// The VAE decoder from the fixture's decoder input: the float image within 1e-4 x max of
/// diffusers', and the 8-bit image every pixel within 1, at least 99% equal.
fn check_vae<B: Backend>(mut make: impl FnMut() -> B, label: &str) {
    use nibble_core::models::vae::{self, VaeDecoder};
    let e = expected();
    let m = component("vae");
    for streamed in [false, true] {
        for p in 0..2 {
            let what = format!("{label} streamed={streamed} p{p}");
            let z = e.f32(&format!("p{p}.vae_input")).expect("vae_input");
            let (c, h, w) = (4, 16, 16);
            assert_eq!(z.len(), c * h * w);
            let mut b = make();
            let (g, cfg) = vae::build(&m, h, w).expect("vae graph");
            let o = run_opts(&g, &m, &mut b, streamed);
            let mut dec = VaeDecoder::new(&m, b, (h, w), o).expect("vae");
            let (img, stats) = dec.decode(&z).expect("decode");
            if streamed {
                assert!(stats.stream.bytes > 0, "{what}: VAE streamed");
            }
            let want = e.f32(&format!("p{p}.image_f32")).expect("image_f32");
            let err = max_err_rel_to_max(&img, &want);
            assert!(err <= 1e-4, "{what}: image error {err:e} x max");
            println!("{what}: VAE image {err:.2e} x max");
            let f = cfg.scale_factor();
            let rgb = vae::to_rgb8(&img, h * f, w * f).expect("rgb");
            let want = e.bytes(&format!("p{p}.image_u8")).expect("image_u8");
            let off = rgb.iter().zip(&want).filter(|(a, b)| a != b).count();
            let far = rgb
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.abs_diff(**b) > 1)
                .count();
            assert_eq!(far, 0, "{what}: pixels more than 1 away");
            assert!(
                off * 100 <= rgb.len(),
                "{what}: {off} of {} values differ",
                rgb.len()
            );
        }
    }
}

#[test]
fn vae_decoder_on_cpu_ref() {
    check_vae(CpuRefBackend::new, "cpu_ref");
}

#[test]
fn vae_decoder_on_cpu() {
    check_vae(nibble_core::backend::cpu::CpuBackend::new, "cpu");
}

#[test]
fn vae_decoder_on_wgpu() {
    if wgpu_or_absent("vae").is_none() {
        return;
    }
    check_vae(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
}

/// The transformer's denoising loop from the fixture's embeddings, initial latents and sigmas:
/// the latents after every step within 1e-4 x max of diffusers'.
fn check_denoise<B: Backend>(mut make: impl FnMut() -> B, label: &str) {
    use nibble_core::models::dit::{self, Denoiser, DitInputs};
    use nibble_core::models::flux::latent_image_ids;
    let e = expected();
    let m = component("transformer");
    for streamed in [false, true] {
        for p in 0..2 {
            let what = format!("{label} streamed={streamed} p{p}");
            let f = |n: &str| e.f32(&format!("p{p}.{n}")).unwrap_or_else(|| panic!("{n}"));
            let inputs = DitInputs {
                x0: f("initial_latents"),
                context: f("prompt_embeds"),
                pooled: f("pooled_prompt_embeds"),
                guidance: f("guidance")[0],
                img_ids: latent_image_ids(8, 8),
                txt_ids: vec![0.0; 32 * 3],
            };
            assert_eq!(inputs.img_ids, f("latent_image_ids"));
            let sigmas = f("sigmas");
            let mut b = make();
            let dg = dit::build(&m, inputs.image_tokens(), inputs.text_tokens()).expect("graph");
            let o = run_opts(&dg.graph, &m, &mut b, streamed);
            let mut d = Denoiser::new(&m, b, inputs, sigmas.clone(), o).expect("denoiser");
            for k in 0..sigmas.len() - 1 {
                let st = d.step().expect("step").expect("a step");
                if streamed {
                    assert!(st.stats.stream.bytes > 0, "{what}: streamed");
                }
                let want = f(&format!("latents_step{k}"));
                let err = max_err_rel_to_max(d.latent(), &want);
                assert!(err <= 1e-4, "{what}: step {k} latents error {err:e} x max");
                println!("{what}: step {k} latents {err:.2e} x max");
            }
            let err = max_err_rel_to_max(d.latent(), &f("final_latents_packed"));
            assert!(err <= 1e-4, "{what}: final latents error {err:e} x max");
        }
    }
}

#[test]
fn denoising_on_cpu_ref() {
    check_denoise(CpuRefBackend::new, "cpu_ref");
}

#[test]
fn denoising_on_cpu() {
    check_denoise(nibble_core::backend::cpu::CpuBackend::new, "cpu");
}

#[test]
fn denoising_on_wgpu() {
    if wgpu_or_absent("denoising").is_none() {
        return;
    }
    check_denoise(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
}

/// Tiled decoding with the fixture's tile size against diffusers' `tiled_decode` (not against
/// the untiled image: with random tiny weights the tiles differ from it a lot).
fn check_tiled<B: Backend>(mut make: impl FnMut() -> B, label: &str) {
    use nibble_core::models::vae::{self, Tiling};
    let e = expected();
    let tiled = Expected::open(&fixture("tiny-flux-pipeline/vae_tiled.safetensors"));
    let json = read_json(&fixture("tiny-flux-pipeline/vae_tiled.json"));
    let tiling = Tiling {
        latent_tile: json["tile_latent_min_size"].as_u64().expect("tile") as usize,
        overlap: json["tile_overlap_factor"].as_f64().expect("overlap") as f32,
    };
    let m = component("vae");
    for p in 0..2 {
        let z = e.f32(&format!("p{p}.vae_input")).expect("vae_input");
        let mut b = make();
        let (g, _) = vae::build(&m, tiling.latent_tile, tiling.latent_tile).expect("graph");
        let o = run_opts(&g, &m, &mut b, true);
        let (img, _, _) = vae::tiled_decode(&m, b, &z, (4, 16, 16), tiling, o).expect("tiled");
        let want = tiled
            .f32(&format!("p{p}.image_f32_tiled"))
            .expect("tiled image");
        let err = max_err_rel_to_max(&img, &want);
        assert!(err <= 1e-4, "{label} p{p}: tiled image error {err:e} x max");
        println!("{label} p{p}: tiled VAE image {err:.2e} x max");
    }
}

#[test]
fn tiled_vae_decoding_on_cpu_ref_cpu_and_wgpu() {
    check_tiled(CpuRefBackend::new, "cpu_ref");
    check_tiled(nibble_core::backend::cpu::CpuBackend::new, "cpu");
    if wgpu_or_absent("tiled vae").is_some() {
        check_tiled(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
    }
}

/// On a WebGPU adapter whose storage bindings cannot hold the whole image's decoder operands,
/// the untiled decoder is refused when it is planned (before a weight byte is read, naming the
/// op), and `--vae-tiling auto` decodes in tiles whose operands fit instead.
#[test]
fn a_binding_limit_is_met_at_plan_time_by_tiling_or_refused() {
    use nibble_core::models::flux::noise::NoiseMath;
    use nibble_core::models::flux::pipeline::{FluxPipeline, FluxRequest, Noise, VaeTiling};
    use nibble_core::models::pipeline::Pipeline;
    use nibble_core::models::vae;
    if wgpu_or_absent("binding limit").is_none() {
        return;
    }
    let m = component("vae");
    let largest = |g: &nibble_core::graph::Graph| {
        g.nodes()
            .iter()
            .flat_map(|n| n.inputs.iter().copied().chain([n.output]))
            .map(|v| g.info(v).words() as u64 * 4)
            .max()
            .unwrap_or(0)
    };
    let (h, w) = (16, 16);
    let tile = 8;
    let (full, _) = vae::build(&m, h, w).expect("graph");
    let (tiled, _) = vae::build(&m, tile, tile).expect("graph");
    let limit = largest(&tiled);
    assert!(
        largest(&full) > limit,
        "the test needs a full decoder larger than a tile's"
    );
    let mut b = nibble_wgpu::WgpuBackend::new()
        .expect("wgpu")
        .with_max_binding(limit);
    let o = ExecOptions {
        budgets: nibble_core::plan::Budgets {
            device_bytes: 1 << 30,
            ring_slots: 2,
            slot_bytes: 1 << 20,
            host_tier_bytes: 0,
        },
        readers: 1,
        stream_all: false,
        naive: false,
    };
    let err = nibble_core::plan::plan_graph(&full, &m, &mut b, o.budgets, o.stream_all)
        .expect_err("an operand over the limit");
    assert!(
        err.to_string().contains("limit of") && err.to_string().contains(&limit.to_string()),
        "{err}"
    );
    nibble_core::plan::plan_graph(&tiled, &m, &mut b, o.budgets, o.stream_all)
        .expect("a tile's decoder fits");
    let root = fixture("tiny-flux-pipeline/pipeline");
    let pipe = FluxPipeline::open(&root.to_string_lossy(), Default::default()).expect("open");
    let req = |vae_tiling| FluxRequest {
        prompt: "a red fox".into(),
        height: h * 2,
        width: w * 2,
        steps: 1,
        guidance: 3.5,
        max_sequence_length: 8,
        noise: Noise::Seed(0, NoiseMath::Libm),
        vae_tiling,
        vae_tile: Some(tile),
    };
    let p = pipe.prepare(&req(VaeTiling::Auto)).expect("prepare");
    assert_eq!((p.grid.0, p.grid.1), (h, w));
    let t = pipe.vae_tiling(&p, &mut b, o).expect("tiling");
    assert_eq!(
        t.map(|t| t.latent_tile),
        Some(tile),
        "auto tiles under the limit"
    );
    // Without that limit the whole image's decoder fits, and auto does not tile.
    let mut unlimited = nibble_wgpu::WgpuBackend::new().expect("wgpu");
    let t = pipe.vae_tiling(&p, &mut unlimited, o).expect("tiling");
    assert_eq!(t, None);
}
