//! The executor on a real model's weights: the MLP half of every tiny-llama decoder layer, run
//! resident and streamed through a tiny ring, on every backend present, against the same ops
//! applied by hand with `cpu_ref`. Layer count, hidden size and RMSNorm epsilon come from the
//! fixture's config.json.

use nibble_core::backend::cpu_ref::CpuRefBackend;
use nibble_core::backend::cpu_ref::{self, Q4Ref};
use nibble_core::backend::Backend;
use nibble_core::exec::{ExecOptions, Executor};
use nibble_core::graph::Graph;
use nibble_core::graph::{HostTensor, OpKind, Q4Info, ValueInfo};
use nibble_core::io::model::ModelIndex;
use nibble_core::plan::Budgets;
use nibble_tests::build::random_values;
use nibble_tests::*;

const ROWS: usize = 5;
/// Weight groups per layer in `mlp_graph`: gate_proj (with the norm), up_proj, down_proj.
const GROUPS_PER_LAYER: usize = 3;

fn model() -> ModelIndex {
    ModelIndex::open(&fixture("tiny-llama-nf4/model")).expect("tiny-llama")
}

/// The fixture's decoder layers, hidden size and RMSNorm epsilon (config.json).
#[derive(Debug, Clone, Copy)]
struct Dims {
    layers: usize,
    hidden: usize,
    eps: f32,
}

fn dims(m: &ModelIndex) -> Dims {
    let c = m.config.as_ref().expect("tiny-llama has a config.json");
    let u = |k: &str| -> usize {
        let v = c[k].as_u64();
        v.unwrap_or_else(|| panic!("config.json: {k} is not an integer")) as usize
    };
    let d = Dims {
        layers: u("num_hidden_layers"),
        hidden: u("hidden_size"),
        eps: c["rms_norm_eps"]
            .as_f64()
            .expect("config.json: rms_norm_eps") as f32,
    };
    assert!(d.layers > 0 && d.hidden > 0, "config.json: {d:?}");
    d
}

fn q4_info(m: &ModelIndex, name: &str) -> Q4Info {
    let k = m
        .q4_weights()
        .map(<[_]>::to_vec)
        .expect("find")
        .into_iter()
        .find(|k| k.base == name)
        .expect("weight");
    let s = m.quant_state(&k).expect("state");
    Q4Info {
        shape: s.json.shape.iter().map(|&d| d as usize).collect(),
        blocksize: s.json.blocksize as usize,
    }
}

fn mlp_graph(m: &ModelIndex) -> Graph {
    let d = dims(m);
    let mut g = Graph::new();
    let mut x = g.input(ValueInfo::f32(&[ROWS, d.hidden]));
    for l in 0..d.layers {
        let p = format!("model.layers.{l}");
        // One group per linear, so that a small budget streams most of them.
        let grp = g.group(&format!("{p}.mlp.gate_proj"));
        let norm = g.dense_weight(
            grp,
            &format!("{p}.post_attention_layernorm.weight"),
            &[d.hidden],
        );
        let h = g
            .op(OpKind::RmsNorm { eps: d.eps }, &[x, norm], None)
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
    let keys = m.q4_weights().map(<[_]>::to_vec).expect("find");
    let d = dims(m);
    let mut x = x0.clone();
    for l in 0..d.layers {
        let p = format!("model.layers.{l}");
        let norm = m
            .read_f32(
                m.require(&format!("{p}.post_attention_layernorm.weight"))
                    .expect("n"),
            )
            .expect("read");
        let norm = HostTensor::f32(&[d.hidden], norm).expect("t");
        let h = cpu_ref::run(&OpKind::RmsNorm { eps: d.eps }, &[&x, &norm], None).expect("norm");
        let lin = |input: &HostTensor, name: &str| {
            let k = keys
                .iter()
                .find(|k| k.base == format!("{p}.mlp.{name}.weight"))
                .expect("k");
            let s = m.quant_state(k).expect("s");
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
            host_tier_bytes: 0,
        },
        readers: 2,
        stream_all: false,
        naive: false,
    }
}

/// The smallest device budget that the executor accepts on a backend (exact: the planner's).
fn small_budget<B: Backend>(make: impl Fn() -> B) -> ExecOptions {
    let m = model();
    let min = nibble_core::plan::min_device_bytes(&mlp_graph(&m), &m, &mut make()).expect("min");
    opts(min, 2, 4096)
}

/// A device budget that holds every group of `mlp_graph`.
const RESIDENT_BUDGET: u64 = 64 << 20;

fn run_three_steps<B: Backend>(backend: B, o: ExecOptions) -> (Vec<Vec<f32>>, (usize, usize)) {
    let m = model();
    let hidden = dims(&m).hidden;
    let mut ex = Executor::new(mlp_graph(&m), &m, backend, o).expect("executor");
    let counts = ex.plan().counts();
    let mut outs = Vec::new();
    for seed in [1u64, 2, 3] {
        let x = HostTensor::f32(&[ROWS, hidden], random_values(ROWS * hidden, seed)).expect("x");
        let (o, _) = ex.step(&[x]).expect("step");
        outs.push(o[0].as_f32().to_vec());
    }
    (outs, counts)
}

fn want() -> Vec<Vec<f32>> {
    let m = model();
    let hidden = dims(&m).hidden;
    [1u64, 2, 3]
        .iter()
        .map(|&s| {
            by_hand(
                &m,
                &HostTensor::f32(&[ROWS, hidden], random_values(ROWS * hidden, s)).expect("x"),
            )
        })
        .collect()
}

#[test]
fn cpu_ref_resident_and_streamed_equal_the_ops_by_hand() {
    let want = want();
    let groups = GROUPS_PER_LAYER * dims(&model()).layers;
    let (resident, counts) =
        run_three_steps(CpuRefBackend::new(), opts(RESIDENT_BUDGET, 4, 1 << 20));
    assert_eq!(counts, (groups, 0), "every group resident");
    for (g, w) in resident.iter().zip(&want) {
        assert_bits_eq(g, w, "resident");
    }
    // Near the smallest budget that fits, most groups stream every step through 2 slots of
    // 4 KiB, in chunks.
    let (streamed, counts) =
        run_three_steps(CpuRefBackend::new(), small_budget(CpuRefBackend::new));
    assert!(
        counts.1 * 3 >= groups * 2,
        "most of the {groups} groups are streamed: {counts:?}"
    );
    for (g, w) in streamed.iter().zip(&want) {
        assert_bits_eq(g, w, "streamed");
    }
}

/// The scalar reference backend keeps its memory apart from the host's (no host-memory
/// capability), so it gets a host tier like a GPU: with one that holds about half the streamed
/// groups, the steps equal the ops by hand, the first step reads every streamed byte from the
/// source, and every later one reads only the source tier's groups there and uploads the host
/// tier's from host memory, as planned.
#[test]
fn cpu_ref_host_tier_equals_the_ops_by_hand_and_moves_the_planned_bytes() {
    let m = model();
    let want = want();
    let mut o = small_budget(CpuRefBackend::new);
    let probe = Executor::new(mlp_graph(&m), &m, CpuRefBackend::new(), o).expect("plan");
    let streamed: Vec<u64> = probe
        .plan()
        .groups
        .iter()
        .filter(|g| g.placement != nibble_core::plan::Placement::Resident)
        .map(|g| g.bytes)
        .collect();
    drop(probe);
    assert!(streamed.len() >= 4, "groups stream: {streamed:?}");
    o.budgets.host_tier_bytes = streamed.iter().sum::<u64>() / 2;
    let mut ex = Executor::new(mlp_graph(&m), &m, CpuRefBackend::new(), o).expect("executor");
    let plan = ex.plan().clone();
    let tiers = plan.tiers();
    let (host, source) = (tiers[1].bytes, tiers[2].bytes);
    assert!(
        host > 0 && source > 0,
        "both streamed tiers in use: {tiers:?}"
    );
    assert_eq!(plan.host_tier_bytes, host);
    assert_eq!(plan.source_bytes_per_step, source);
    ex.limit_stream_passes(3);
    let hidden = dims(&m).hidden;
    for (i, seed) in [1u64, 2, 3].into_iter().enumerate() {
        let x = HostTensor::f32(&[ROWS, hidden], random_values(ROWS * hidden, seed)).expect("x");
        let (out, stats) = ex.step(&[x]).expect("step");
        assert_bits_eq(out[0].as_f32(), &want[i], "host tier");
        let planned = if i == 0 {
            (host + source, 0)
        } else {
            (source, host)
        };
        assert_eq!((stats.source_bytes, stats.host_bytes), planned, "step {i}");
    }
    // Measured at the source: the host tier's bytes were read from it once.
    assert_eq!(ex.tier_totals(), (host + 3 * source, 2 * host));
}

#[test]
fn wgpu_resident_and_streamed_match_cpu_ref() {
    let Some(backend) = wgpu_or_absent("executor") else {
        return;
    };
    drop(backend);
    let want = want();
    let small = small_budget(|| nibble_wgpu::WgpuBackend::new().expect("wgpu"));
    for o in [opts(RESIDENT_BUDGET, 4, 1 << 20), small] {
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

/// The optimized CPU backend whose n-th upload or op fails, recording how many ring-slot
/// regions it had lent in place when it failed.
struct Failing {
    inner: nibble_core::backend::cpu::CpuBackend,
    calls: usize,
    fail_at: Option<usize>,
    lent_at_failure: Option<usize>,
}

impl Failing {
    fn call(&mut self) -> nibble_core::Result<()> {
        self.calls += 1;
        if Some(self.calls) == self.fail_at {
            self.lent_at_failure = self.inner.host_memory().map(|h| h.lent());
            return Err(nibble_core::Error::Invalid("injected failure".into()));
        }
        Ok(())
    }
}

impl Backend for Failing {
    fn name(&self) -> String {
        "failing".into()
    }
    nibble_tests::forward_to_inner!(
        supports,
        device_info,
        workspace,
        allocate,
        release,
        write_arena,
        read_arena,
        host_memory,
    );
    fn upload(
        &mut self,
        offset: u64,
        bytes: &[u8],
    ) -> nibble_core::Result<Box<dyn nibble_core::stream::ring::Fence>> {
        self.call()?;
        self.inner.upload(offset, bytes)
    }
    fn run(
        &mut self,
        op: &OpKind,
        inputs: &[nibble_core::backend::Operand],
        q4: Option<&nibble_core::backend::Q4View>,
        out: &nibble_core::backend::Operand,
    ) -> nibble_core::Result<()> {
        self.call()?;
        self.inner.run(op, inputs, q4, out)
    }
}

#[test]
fn slots_lent_in_place_go_back_when_a_step_fails_midway() {
    let m = model();
    let hidden = dims(&m).hidden;
    let make = || Failing {
        inner: nibble_core::backend::cpu::CpuBackend::new(),
        calls: 0,
        fail_at: None,
        lent_at_failure: None,
    };
    // Every group streamed through 4 slots of 1 MiB: packed weights arrive whole and are lent.
    let mut o = small_budget(make);
    o.budgets.ring_slots = 4;
    o.budgets.slot_bytes = 1 << 20;
    o.stream_all = true;
    let x = HostTensor::f32(&[ROWS, hidden], random_values(ROWS * hidden, 1)).expect("x");
    // The uploads and ops of one step, counted on a run without failures.
    let per_step = {
        let mut ex = Executor::new(mlp_graph(&m), &m, make(), o).expect("executor");
        let before = ex.backend().calls;
        ex.step(std::slice::from_ref(&x)).expect("step");
        ex.backend().calls - before
    };
    let mut failed_while_lending = 0;
    for k in 1..=per_step {
        let mut ex = Executor::new(mlp_graph(&m), &m, make(), o).expect("executor");
        let before = ex.backend().calls;
        ex.backend_mut().fail_at = Some(before + k);
        let e = ex
            .step(std::slice::from_ref(&x))
            .expect_err("the injected failure");
        assert!(e.to_string().contains("injected failure"), "{e}");
        let lent = ex.backend_mut().host_memory().map(|h| h.lent());
        assert_eq!(lent, Some(0), "failure at call {k}: nothing stays lent");
        if ex.backend().lent_at_failure.is_some_and(|n| n > 0) {
            failed_while_lending += 1;
        }
        let slots = o.budgets.ring_slots as usize;
        let (_, ring) = ex.into_parts();
        assert_eq!(
            ring.expect("ring").free_slots(),
            slots,
            "every slot back in the ring"
        );
    }
    assert!(
        failed_while_lending > 0,
        "some failures hit a group whose packed weights were lent in place"
    );
}

/// What the executor told a backend, in order.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Call {
    /// `begin_group_load(slot)`.
    Begin(Option<usize>),
    /// `group_used(slot)`.
    Used(usize),
    /// An upload of `len` bytes at pool offset `offset`.
    Upload { offset: u64, len: u64 },
    /// An op that reads a 4-bit weight whose packed codes start at this pool offset.
    Reads(u64),
}

/// The reference backend, recording the group-load calls, the uploads and the 4-bit reads.
struct Recording {
    inner: CpuRefBackend,
    calls: Vec<Call>,
}

impl Backend for Recording {
    fn name(&self) -> String {
        "recording".into()
    }
    nibble_tests::forward_to_inner!(
        supports,
        device_info,
        workspace,
        allocate,
        release,
        write_arena,
        read_arena,
    );
    fn upload(
        &mut self,
        offset: u64,
        bytes: &[u8],
    ) -> nibble_core::Result<Box<dyn nibble_core::stream::ring::Fence>> {
        self.calls.push(Call::Upload {
            offset,
            len: bytes.len() as u64,
        });
        self.inner.upload(offset, bytes)
    }
    fn run(
        &mut self,
        op: &OpKind,
        inputs: &[nibble_core::backend::Operand],
        q4: Option<&nibble_core::backend::Q4View>,
        out: &nibble_core::backend::Operand,
    ) -> nibble_core::Result<()> {
        if let Some(v) = q4 {
            self.calls.push(Call::Reads(v.packed.offset));
        }
        self.inner.run(op, inputs, q4, out)
    }
    fn begin_group_load(&mut self, slot: Option<usize>) {
        self.calls.push(Call::Begin(slot));
    }
    fn group_used(&mut self, slot: usize) {
        self.calls.push(Call::Used(slot));
    }
}

/// An asynchronous backend (CUDA) lets a streamed group's uploads wait only for the event it
/// records at `group_used` of the slot's previous group. So: every op that reads a pool slot
/// runs between its group's `begin_group_load` and the `group_used` of that slot, each slot's
/// group is marked used before the slot's next group begins to load, and each slot's uploads
/// land in a region of the pool of their own.
#[test]
fn a_pool_slot_is_marked_used_after_its_last_reader_and_before_it_is_refilled() {
    let m = model();
    let make = || Recording {
        inner: CpuRefBackend::new(),
        calls: Vec::new(),
    };
    let o = small_budget(make);
    let mut ex = Executor::new(mlp_graph(&m), &m, make(), o).expect("executor");
    let streamed = ex.plan().counts().1;
    assert!(streamed >= 4, "several groups streamed: {streamed}");
    let hidden = dims(&m).hidden;
    let steps = 3;
    for seed in 1..=steps {
        let x = HostTensor::f32(&[ROWS, hidden], random_values(ROWS * hidden, seed)).expect("x");
        ex.step(&[x]).expect("step");
    }
    let calls = &ex.backend().calls;
    // Each slot's region: the span of the uploads made while it was the one loading.
    let mut region = [(u64::MAX, 0u64); 2];
    let mut loading = None;
    for c in calls {
        match *c {
            Call::Begin(s) => loading = s,
            Call::Upload { offset, len } => {
                if let Some(s) = loading {
                    region[s] = (region[s].0.min(offset), region[s].1.max(offset + len));
                }
            }
            _ => {}
        }
    }
    assert!(
        region.iter().all(|r| r.0 < r.1)
            && (region[0].1 <= region[1].0 || region[1].1 <= region[0].0),
        "two disjoint slot regions: {region:?}"
    );
    let slot_at = |off: u64| (0..2).find(|&s| region[s].0 <= off && off < region[s].1);
    let mut open = [false; 2];
    let (mut begins, mut used, mut slot_reads) = (0, 0, 0);
    for (i, c) in calls.iter().enumerate() {
        match *c {
            Call::Begin(Some(s)) => {
                assert!(
                    !open[s],
                    "call {i}: slot {s} refilled before its group was marked used"
                );
                open[s] = true;
                begins += 1;
            }
            Call::Used(s) => {
                assert!(
                    open[s],
                    "call {i}: slot {s} marked used with no group loaded in it"
                );
                open[s] = false;
                used += 1;
            }
            Call::Reads(off) => {
                if let Some(s) = slot_at(off) {
                    assert!(
                        open[s],
                        "call {i}: an op reads slot {s} after it was marked used"
                    );
                    slot_reads += 1;
                }
            }
            Call::Begin(None) | Call::Upload { .. } => {}
        }
    }
    assert_eq!(open, [false, false], "every slot's last group marked used");
    assert_eq!(
        begins,
        streamed * steps as usize,
        "a load per streamed group and step"
    );
    assert_eq!(used, begins, "a mark per load");
    assert!(
        slot_reads >= begins,
        "every streamed group's linear read from its slot"
    );
}
