//! The executor on a real model's weights: the MLP half of tiny-llama's two decoder layers, run
//! resident and streamed through a tiny ring, on every backend present, against the same ops
//! applied by hand with `cpu_ref`.

use nibble_core::backend::{Backend, CpuRefBackend};
use nibble_core::bnb::{find_4bit_weights, QuantState};
use nibble_core::cpu_ref::{self, Q4Ref};
use nibble_core::executor::{ExecOptions, Executor, Graph};
use nibble_core::graph::{HostTensor, OpKind, Q4Info, ValueInfo};
use nibble_core::index::ModelIndex;
use nibble_core::plan::Budgets;
use nibble_tests::build::random_values;
use nibble_tests::*;

const LAYERS: usize = 2;
const ROWS: usize = 5;

fn model() -> ModelIndex {
    ModelIndex::open(&fixture("tiny-llama-nf4/model")).expect("tiny-llama")
}

fn q4_info(m: &ModelIndex, name: &str) -> Q4Info {
    let k = find_4bit_weights(m)
        .expect("find")
        .into_iter()
        .find(|k| k.base == name)
        .expect("weight");
    let s = QuantState::load(m, &k).expect("state");
    Q4Info {
        shape: s.json.shape.iter().map(|&d| d as usize).collect(),
        blocksize: s.json.blocksize as usize,
    }
}

fn mlp_graph(m: &ModelIndex) -> Graph {
    let mut g = Graph::new();
    let mut x = g.input(ValueInfo::f32(&[ROWS, 64]));
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        // One group per linear, so that a small budget streams most of them.
        let grp = g.group(&format!("{p}.mlp.gate_proj"));
        let norm = g.dense_weight(grp, &format!("{p}.post_attention_layernorm.weight"), &[64]);
        let h = g
            .op(OpKind::RmsNorm { eps: 1e-6 }, &[x, norm], None)
            .expect("norm");
        let lin = |g: &mut Graph, input, name: &str| {
            let grp = g.group(&format!("{p}.mlp.{name}"));
            let w = g.q4_weight(
                grp,
                &format!("{p}.mlp.{name}.weight"),
                q4_info(m, &format!("{p}.mlp.{name}.weight")),
            );
            g.op(OpKind::LinearQ4 { bias: false }, &[input], Some(w))
                .expect("linear")
        };
        let gate = lin(&mut g, h, "gate_proj");
        let up = lin(&mut g, h, "up_proj");
        let a = g.op(OpKind::Silu, &[gate], None).expect("silu");
        let prod = g.op(OpKind::Mul, &[a, up], None).expect("mul");
        let down = lin(&mut g, prod, "down_proj");
        x = g.op(OpKind::Add, &[x, down], None).expect("add");
    }
    g.output(x);
    g
}

/// The same computation written out with cpu_ref ops on fully loaded weights.
fn by_hand(m: &ModelIndex, x0: &HostTensor) -> Vec<f32> {
    let keys = find_4bit_weights(m).expect("find");
    let mut x = x0.clone();
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        let norm = m
            .read_f32(
                m.require(&format!("{p}.post_attention_layernorm.weight"))
                    .expect("n"),
            )
            .expect("read");
        let norm = HostTensor::f32(&[64], norm).expect("t");
        let h = cpu_ref::run(&OpKind::RmsNorm { eps: 1e-6 }, &[&x, &norm], None).expect("norm");
        let lin = |input: &HostTensor, name: &str| {
            let k = keys
                .iter()
                .find(|k| k.base == format!("{p}.mlp.{name}.weight"))
                .expect("k");
            let s = QuantState::load(m, k).expect("s");
            let packed = m.read_bytes(m.require(&k.base).expect("p")).expect("r");
            cpu_ref::run(
                &OpKind::LinearQ4 { bias: false },
                &[input],
                Some(Q4Ref {
                    state: &s,
                    packed: &packed,
                }),
            )
            .expect("lin")
        };
        let gate = lin(&h, "gate_proj");
        let up = lin(&h, "up_proj");
        let a = cpu_ref::run(&OpKind::Silu, &[&gate], None).expect("silu");
        let prod = cpu_ref::run(&OpKind::Mul, &[&a, &up], None).expect("mul");
        let down = lin(&prod, "down_proj");
        x = cpu_ref::run(&OpKind::Add, &[&x, &down], None).expect("add");
    }
    x.as_f32().to_vec()
}

fn opts(device_bytes: u64, slots: u64, slot_bytes: u64) -> ExecOptions {
    ExecOptions {
        budgets: Budgets {
            device_bytes,
            ring_slots: slots,
            slot_bytes,
            host_cache_bytes: 0,
            device_other_bytes: 0,
            host_other_bytes: 0,
        },
        readers: 2,
        stream_all: false,
        naive: false,
    }
}

/// The smallest device budget (in steps of 512 bytes) that the executor accepts on a backend.
fn small_budget<B: Backend>(make: impl Fn() -> B) -> ExecOptions {
    let m = model();
    (1_000..200_000)
        .step_by(512)
        .map(|b| opts(b, 2, 4096))
        .find(|o| Executor::new(mlp_graph(&m), &m, make(), *o).is_ok())
        .expect("some budget fits")
}

fn run_three_steps<B: Backend>(
    backend: B,
    o: ExecOptions,
) -> (Vec<Vec<f32>>, (usize, usize, usize)) {
    let m = model();
    let mut ex = Executor::new(mlp_graph(&m), &m, backend, o).expect("executor");
    let counts = ex.plan().counts();
    let mut outs = Vec::new();
    for seed in [1u64, 2, 3] {
        let x = HostTensor::f32(&[ROWS, 64], random_values(ROWS * 64, seed)).expect("x");
        let (o, _) = ex.step(&[x]).expect("step");
        outs.push(o[0].as_f32().to_vec());
    }
    (outs, counts)
}

fn want() -> Vec<Vec<f32>> {
    let m = model();
    [1u64, 2, 3]
        .iter()
        .map(|&s| {
            by_hand(
                &m,
                &HostTensor::f32(&[ROWS, 64], random_values(ROWS * 64, s)).expect("x"),
            )
        })
        .collect()
}

#[test]
fn cpu_ref_resident_and_streamed_equal_the_ops_by_hand() {
    let want = want();
    let (resident, counts) = run_three_steps(CpuRefBackend::new(), opts(64 << 20, 4, 1 << 20));
    assert_eq!(counts, (6, 0, 0), "every group resident");
    for (g, w) in resident.iter().zip(&want) {
        assert_bits_eq(g, w, "resident");
    }
    // Near the smallest budget that fits, most groups stream every step through 2 slots of
    // 4 KiB, in chunks.
    let (streamed, counts) =
        run_three_steps(CpuRefBackend::new(), small_budget(CpuRefBackend::new));
    assert!(counts.1 >= 4, "groups are streamed: {counts:?}");
    for (g, w) in streamed.iter().zip(&want) {
        assert_bits_eq(g, w, "streamed");
    }
}

#[test]
fn wgpu_resident_and_streamed_match_cpu_ref() {
    let Ok(backend) = nibble_wgpu::WgpuBackend::new() else {
        assert!(
            std::env::var("NIBBLE_REQUIRE_WGPU").ok().as_deref() != Some("1"),
            "wgpu required"
        );
        println!("wgpu absent: skipped");
        return;
    };
    drop(backend);
    let want = want();
    let small = small_budget(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"));
    for o in [opts(64 << 20, 4, 1 << 20), small] {
        let (got, _) = run_three_steps(nibble_wgpu::WgpuBackend::new().expect("wgpu"), o);
        for (g, w) in got.iter().zip(&want) {
            let e = max_err_rel_to_max(g, w);
            assert!(e <= 2e-5, "wgpu executor error {e:e}");
        }
    }
}

#[test]
fn impossible_device_budget_is_refused_with_the_numbers() {
    let m = model();
    let e = Executor::new(mlp_graph(&m), &m, CpuRefBackend::new(), opts(1000, 2, 4096))
        .expect_err("too small");
    assert!(e.to_string().contains("--device-budget"), "{e}");
}
