//! The memory plan is the layout: for any budget between the smallest and the all-resident one,
//! what the plan reports is what the executor allocates, and it stays within the budget. Built
//! on tiny-llama's decoder (prefill + decode programs, KV cache, tied embeddings); every figure
//! comes from the planner, not from constants.

use nibble_core::backend::cpu::CpuBackend;
use nibble_core::backend::cpu_ref::CpuRefBackend;
use nibble_core::backend::Backend;
use nibble_core::exec::{ExecOptions, Executor};
use nibble_core::io::model::ModelIndex;
use nibble_core::models::llama::{self, LlamaShape};
use nibble_core::plan::{Budgets, Planner, Rules};
use nibble_tests::fixture;

fn model() -> ModelIndex {
    ModelIndex::open(&fixture("tiny-llama-nf4/model")).expect("tiny-llama")
}

fn opts(device_bytes: u64, slots: u64, slot_bytes: u64) -> ExecOptions {
    ExecOptions {
        budgets: Budgets {
            device_bytes,
            ring_slots: slots,
            slot_bytes,
            host_tier_bytes: 0,
        },
        readers: 1,
        stream_all: false,
        naive: false,
    }
}

fn sweep<B: Backend>(mut make: impl FnMut() -> B) {
    let m = model();
    let shape = LlamaShape::generate(5, 7);
    let graph = llama::build(&m, shape).expect("graph").graph;
    let planner = Planner::new(graph.clone(), &m, Rules::of(&mut make(), &graph)).expect("planner");
    let min = planner.min_device_bytes().expect("min");
    let max = planner.resident_device_bytes().expect("resident");
    assert!(
        min < max,
        "streaming needs less than keeping everything ({min} vs {max})"
    );
    let groups = graph.groups().len();
    let mut seen_resident = Vec::new();
    for i in 0..=12u64 {
        let budget = min + (max - min) * i / 12;
        let ex = Executor::new(graph.clone(), &m, make(), opts(budget, 2, 64 << 10))
            .unwrap_or_else(|e| panic!("budget {budget}: {e}"));
        let plan = ex.plan();
        let (arena_words, pool_bytes) = ex.device_allocation();
        assert_eq!(
            plan.peak_device_bytes,
            arena_words as u64 * 4 + pool_bytes,
            "budget {budget}: the plan's device figure is the allocation"
        );
        assert_eq!(plan.pool_bytes, pool_bytes);
        assert_eq!(plan.arena_bytes, arena_words as u64 * 4);
        assert!(plan.peak_device_bytes <= budget, "{}", plan.explain());
        let (r, s) = plan.counts();
        assert_eq!(r + s, groups);
        seen_resident.push(r);
    }
    assert_eq!(
        seen_resident[0], 0,
        "the smallest budget streams every group"
    );
    assert_eq!(
        seen_resident[12], groups,
        "the resident budget keeps every group"
    );
    assert!(
        seen_resident.windows(2).any(|w| w[0] < w[1] && w[0] > 0),
        "budgets in between keep some groups resident: {seen_resident:?}"
    );
}

#[test]
fn plan_figures_are_the_allocation_at_every_budget_cpu_ref() {
    sweep(CpuRefBackend::new);
}

#[test]
fn plan_figures_are_the_allocation_at_every_budget_cpu() {
    sweep(CpuBackend::new);
}

#[test]
fn everything_resident_streams_nothing() {
    let m = model();
    let graph = llama::build(&m, LlamaShape::generate(4, 4))
        .expect("graph")
        .graph;
    let resident = nibble_core::plan::resident_device_bytes(&graph, &m, &mut CpuRefBackend::new())
        .expect("resident");
    let ex = Executor::new(graph, &m, CpuRefBackend::new(), opts(resident, 4, 1 << 20))
        .expect("executor");
    assert_eq!(ex.plan().streamed_bytes_per_step, 0);
    assert_eq!(ex.plan().counts().1, 0);
    assert!(ex.plan().explain().contains("prefetch depth 4"));
}

#[test]
fn a_ring_without_room_is_refused() {
    let m = model();
    let graph = llama::build(&m, LlamaShape::generate(4, 4))
        .expect("graph")
        .graph;
    for (slots, slot) in [(0u64, 1u64 << 20), (2, 0), (2, 4095)] {
        let e = Executor::new(
            graph.clone(),
            &m,
            CpuRefBackend::new(),
            opts(1 << 30, slots, slot),
        )
        .expect_err("no ring");
        assert!(e.to_string().contains("staging ring"), "{e}");
    }
}
