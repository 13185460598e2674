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

/// A backend whose kernels need device workspace (CUDA's GEMM operands and cuBLAS' workspace):
/// cpu_ref's, declaring `device_bytes` of workspace and refusing attention with a head size over
/// `max_head`, recording what it was asked to allocate.
struct Workspaced {
    inner: CpuRefBackend,
    device_bytes: u64,
    max_head: usize,
    allocated: std::rc::Rc<std::cell::Cell<Option<u64>>>,
}

impl Workspaced {
    fn new(device_bytes: u64, max_head: usize) -> Self {
        Workspaced {
            inner: CpuRefBackend::new(),
            device_bytes,
            max_head,
            allocated: Default::default(),
        }
    }
}

impl Backend for Workspaced {
    fn name(&self) -> String {
        "workspaced".into()
    }
    fn supports(&self, o: &nibble_core::backend::OpShapes<'_>) -> Result<(), String> {
        match (o.op, o.inputs.first()) {
            (nibble_core::graph::OpKind::Attention { .. }, Some(q))
                if q.shape[2] > self.max_head =>
            {
                Err(format!(
                    "head size {} is over the kernel's {}",
                    q.shape[2], self.max_head
                ))
            }
            _ => self.inner.supports(o),
        }
    }
    fn workspace(
        &self,
        _ops: &[nibble_core::backend::OpShapes<'_>],
    ) -> nibble_core::backend::Workspace {
        nibble_core::backend::Workspace {
            host_bytes: 0,
            device_bytes: self.device_bytes,
        }
    }
    fn allocate(&mut self, words: usize, pool: u64, workspace: u64) -> nibble_core::Result<()> {
        self.allocated.set(Some(workspace));
        self.inner.allocate(words, pool, workspace)
    }
    nibble_tests::forward_to_inner!(release, write_arena, read_arena, upload, run);
}

/// The kernels' device workspace is part of the plan: counted in the device figure, in the
/// smallest budget that runs, and allocated once with the arena and the pool.
#[test]
fn device_workspace_is_planned_and_allocated_once() {
    let m = model();
    let graph = llama::build(&m, LlamaShape::generate(5, 7))
        .expect("graph")
        .graph;
    let ws = 3 << 20;
    let plain =
        nibble_core::plan::min_device_bytes(&graph, &m, &mut CpuRefBackend::new()).expect("plain");
    let least =
        nibble_core::plan::min_device_bytes(&graph, &m, &mut Workspaced::new(ws, usize::MAX))
            .expect("least");
    assert_eq!(
        least,
        plain + ws,
        "the smallest budget counts the workspace"
    );
    let b = Workspaced::new(ws, usize::MAX);
    let allocated = b.allocated.clone();
    let ex = Executor::new(graph.clone(), &m, b, opts(least, 2, 64 << 10)).expect("runs");
    let (arena_words, pool_bytes) = ex.device_allocation();
    assert_eq!(
        ex.plan().peak_device_bytes,
        arena_words as u64 * 4 + pool_bytes + ws
    );
    assert_eq!(ex.plan().device_workspace_bytes, ws);
    assert_eq!(
        allocated.get(),
        Some(ws),
        "allocated with the arena and the pool"
    );
    assert!(
        ex.plan().explain().contains("kernel workspace 3.00 MiB"),
        "{}",
        ex.plan().explain()
    );
    // One byte less than the least refuses the run before anything is allocated.
    let b = Workspaced::new(ws, usize::MAX);
    let allocated = b.allocated.clone();
    assert!(Executor::new(graph, &m, b, opts(least - 1, 2, 64 << 10)).is_err());
    assert_eq!(allocated.get(), None);
}

/// An op the backend does not run with its operands' shapes (a head size over its kernel's) is
/// refused when the graph is planned, naming the op and the limit.
#[test]
fn an_op_the_backend_refuses_by_shape_is_a_plan_time_error() {
    let m = model();
    let graph = llama::build(&m, LlamaShape::generate(5, 7))
        .expect("graph")
        .graph;
    let cfg = m.config.as_ref().expect("config");
    let head = cfg["hidden_size"].as_u64().expect("hidden")
        / cfg["num_attention_heads"].as_u64().expect("heads");
    assert!(
        head > 8,
        "tiny-llama's heads are wider than the test kernel's 8"
    );
    let e = nibble_core::plan::min_device_bytes(&graph, &m, &mut Workspaced::new(0, 8))
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("attention") && e.contains(&format!("head size {head} is over the kernel's 8")),
        "{e}"
    );
}
