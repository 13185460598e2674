//! The tiny Flux-style DiT that diffusers saved in NF4 (../shared/fixtures/tiny-dit-nf4): one
//! forward within 1e-5 x max|out| on cpu_ref, cpu, wgpu and CUDA (where present), resident and with every block streamed.

use nibble_core::backend::cpu_ref::CpuRefBackend;
use nibble_core::backend::Backend;
use nibble_core::exec::{ExecOptions, Executor};
use nibble_core::graph::HostTensor;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::dit;
use nibble_core::plan::Budgets;
use nibble_tests::*;

fn forward<B: Backend>(mut backend: B, streamed: bool) -> (Vec<f32>, (usize, usize)) {
    let m = ModelIndex::open(&fixture("tiny-dit-nf4/model")).expect("tiny-dit");
    let e = Expected::open(&fixture("tiny-dit-nf4/expected.safetensors"));
    let x = e.f32("hidden_states").expect("x");
    let ctx = e.f32("encoder_hidden_states").expect("ctx");
    let pooled = e.f32("pooled_projections").expect("pooled");
    let t = e.f32("timestep").expect("t")[0];
    let img_ids = e.f32("img_ids").expect("img");
    let txt_ids = e.f32("txt_ids").expect("txt");
    let dg = dit::build(&m, img_ids.len() / 3, txt_ids.len() / 3).expect("graph");
    let cfg = dg.config.clone();
    let ids: Vec<f32> = txt_ids.iter().chain(&img_ids).copied().collect();
    let (cos, sin) = cfg.rope_tables(&ids, 10000.0);
    let (n, tt, half) = (img_ids.len() / 3, txt_ids.len() / 3, cfg.head_dim / 2);
    let mut budgets = Budgets {
        device_bytes: 1 << 30,
        ring_slots: 2,
        slot_bytes: 64 << 10,
        host_tier_bytes: 0,
    };
    if streamed {
        budgets.device_bytes =
            nibble_core::plan::min_device_bytes(&dg.graph, &m, &mut backend).expect("min budget");
    }
    let mut ex = Executor::new(
        dg.graph,
        &m,
        backend,
        ExecOptions {
            budgets,
            readers: 2,
            stream_all: streamed,
            naive: false,
        },
    )
    .expect("executor");
    let counts = ex.plan().counts();
    let mut inputs = vec![
        HostTensor::f32(&[n, cfg.in_channels], x).expect("x"),
        HostTensor::f32(&[tt, cfg.joint_dim], ctx).expect("ctx"),
        HostTensor::f32(&[1, cfg.pooled_dim], pooled).expect("pooled"),
        HostTensor::f32(&[1], vec![t * 1000.0]).expect("t"),
    ];
    if cfg.guidance {
        let gd = e.f32("guidance").expect("guidance (the model embeds it)")[0];
        inputs.push(HostTensor::f32(&[1], vec![gd * 1000.0]).expect("g"));
    }
    inputs.push(HostTensor::f32(&[tt + n, half], cos).expect("cos"));
    inputs.push(HostTensor::f32(&[tt + n, half], sin).expect("sin"));
    let (out, _) = ex.step(&inputs).expect("step");
    (out[0].as_f32().to_vec(), counts)
}

/// Output tolerance (x max|out|) of the f32 backends.
const OUT_F32: f64 = 1e-5;
/// CUDA runs 4-bit linears over more than 8 tokens as bf16 cuBLAS GEMM (f32 accumulation).
const OUT_BF16_GEMM: f64 = 2e-2;

fn check<B: Backend>(make: impl FnMut() -> B, label: &str) {
    check_within(make, label, OUT_F32)
}

fn check_within<B: Backend>(mut make: impl FnMut() -> B, label: &str, tol: f64) {
    let e = Expected::open(&fixture("tiny-dit-nf4/expected.safetensors"));
    let want = e.f32("output_deq").expect("output");
    for streamed in [false, true] {
        let (got, counts) = forward(make(), streamed);
        let err = max_err_rel_to_max(&got, &want);
        assert!(
            err <= tol,
            "{label} streamed={streamed}: error {err:e} x max"
        );
        if streamed {
            assert_eq!(counts.0, 0, "{label}: every group streamed {counts:?}");
        }
    }
}

#[test]
fn tiny_dit_forward_on_cpu_ref() {
    check(CpuRefBackend::new, "cpu_ref");
}

#[test]
fn tiny_dit_forward_on_cpu() {
    check(nibble_core::backend::cpu::CpuBackend::new, "cpu");
}

#[test]
fn tiny_dit_forward_on_cuda() {
    if cuda_or_absent("tiny-dit").is_some() {
        check_within(
            || nibble_cuda::CudaBackend::new().expect("cuda"),
            "cuda",
            OUT_BF16_GEMM,
        );
    }
}

#[test]
fn tiny_dit_forward_on_wgpu() {
    if wgpu_or_absent("tiny-dit").is_none() {
        return;
    }
    check(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"), "wgpu");
}

/// The fixture's flow-matching Euler loop (x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v_i, as many
/// steps as `euler_sigmas` has intervals), one executor, every block streamed each step, final
/// latent within 2e-5 x max.
#[test]
fn tiny_dit_euler_loop_streamed() {
    let m = ModelIndex::open(&fixture("tiny-dit-nf4/model")).expect("tiny-dit");
    let e = Expected::open(&fixture("tiny-dit-nf4/expected.safetensors"));
    let mut x = e.f32("euler_x0").expect("x0");
    let sigmas = e.f32("euler_sigmas").expect("sigmas");
    let steps = sigmas.len() - 1;
    assert!(steps > 0, "euler_sigmas has at least two values");
    assert_eq!(
        nibble_core::models::scheduler::SchedulerConfig::default().default_sigmas(steps, 0.0),
        sigmas,
        "diffusers' schedule, bit for bit"
    );
    let ts = e.f32("euler_model_timesteps").expect("timesteps");
    let (img_ids, txt_ids) = (
        e.f32("img_ids").expect("img"),
        e.f32("txt_ids").expect("txt"),
    );
    let (n, tt) = (img_ids.len() / 3, txt_ids.len() / 3);
    let dg = dit::build(&m, n, tt).expect("graph");
    let cfg = dg.config.clone();
    let ids: Vec<f32> = txt_ids.iter().chain(&img_ids).copied().collect();
    let (cos, sin) = cfg.rope_tables(&ids, 10000.0);
    let budgets = Budgets {
        device_bytes: nibble_core::plan::min_device_bytes(&dg.graph, &m, &mut CpuRefBackend::new())
            .expect("min budget"),
        ring_slots: 2,
        slot_bytes: 64 << 10,
        host_tier_bytes: 0,
    };
    let mut ex = Executor::new(
        dg.graph,
        &m,
        CpuRefBackend::new(),
        ExecOptions {
            budgets,
            readers: 2,
            stream_all: true,
            naive: false,
        },
    )
    .expect("executor");
    let half = cfg.head_dim / 2;
    let fixed = [
        HostTensor::f32(
            &[tt, cfg.joint_dim],
            e.f32("encoder_hidden_states").expect("ctx"),
        )
        .expect("ctx"),
        HostTensor::f32(
            &[1, cfg.pooled_dim],
            e.f32("pooled_projections").expect("p"),
        )
        .expect("p"),
    ];
    let g = cfg
        .guidance
        .then(|| e.f32("guidance").expect("guidance (the model embeds it)")[0]);
    for i in 0..steps {
        let mut inputs = vec![HostTensor::f32(&[n, cfg.in_channels], x.clone()).expect("x")];
        inputs.extend(fixed.iter().cloned());
        inputs.push(HostTensor::f32(&[1], vec![ts[i] * 1000.0]).expect("t"));
        if let Some(g) = g {
            inputs.push(HostTensor::f32(&[1], vec![g * 1000.0]).expect("g"));
        }
        inputs.push(HostTensor::f32(&[tt + n, half], cos.clone()).expect("cos"));
        inputs.push(HostTensor::f32(&[tt + n, half], sin.clone()).expect("sin"));
        let (out, stats) = ex.step(&inputs).expect("step");
        assert!(stats.stream.bytes > 0, "weights streamed in step {i}");
        let dt = sigmas[i + 1] - sigmas[i];
        x = x
            .iter()
            .zip(out[0].as_f32())
            .map(|(a, v)| a + dt * v)
            .collect();
    }
    let err = max_err_rel_to_max(&x, &e.f32("euler_final").expect("final"));
    assert!(err <= 2e-5, "Euler final error {err:e} x max");
}
