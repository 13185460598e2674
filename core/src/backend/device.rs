//! One description of a device, what planning reads of it ([`DeviceInfo`]), and what a graph's
//! ops ask of it besides the arena and the pool ([`Workspace`], per [`OpShapes`]).

use crate::graph::{Graph, OpKind, ValueInfo};

use super::Alignment;

/// What kind of device runs the ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceKind {
    /// The host's cores (the CPU backends): arena and pool are host memory.
    #[default]
    Cpu,
    /// A GPU API implemented on the CPU (lavapipe, SwiftShader): its buffers are RAM.
    CpuRenderer,
    /// A GPU sharing the machine's RAM.
    IntegratedGpu,
    /// A GPU with its own memory.
    DiscreteGpu,
    /// The adapter does not say.
    Other,
}

/// A device as planning sees it: its kind, its memory, its limits and alignment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceInfo {
    /// What kind of device it is.
    pub kind: DeviceKind,
    /// Free and total device memory in bytes, where the driver says (CUDA); `None` where it
    /// does not (wgpu adapters tell limits, not free memory) or where it is host memory.
    /// `--device-budget auto` takes the free memory less a margin.
    pub memory: Option<(u64, u64)>,
    /// Where free memory is not told: a limit that bounds one allocation (a wgpu adapter's
    /// `max_buffer_size`), with its name; `--device-budget auto` takes a stated fraction of
    /// it ([`super::AUTO_LIMIT_FRACTION`]).
    pub allocation_limit: Option<(u64, &'static str)>,
    /// The most bytes one bound operand may take (a WebGPU storage binding), where limited.
    pub max_binding: Option<u64>,
    /// Alignment of arena slices and pool regions.
    pub alignment: Alignment,
}

impl DeviceInfo {
    /// The device's memory is RAM though the backend keeps its own buffers (a CPU renderer,
    /// whose buffers are this process's; an integrated GPU, whose memory is the machine's): the
    /// plan counts the device bytes as host memory too. The CPU backends, whose arena and pool
    /// are host memory ([`super::Backend::host_memory`]), count them so without this.
    pub fn memory_is_host(&self) -> bool {
        matches!(
            self.kind,
            DeviceKind::CpuRenderer | DeviceKind::IntegratedGpu
        )
    }
}

/// Memory a backend's kernels need beyond the arena and the pool: counted by the plan, and the
/// device part allocated with the arena and the pool, once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Workspace {
    /// Host bytes the kernels keep or allocate while running (reordered activations,
    /// dequantized weight tiles, convolution columns, upload staging).
    pub host_bytes: u64,
    /// Device bytes (a GEMM's bf16 operands, the BLAS library's workspace).
    pub device_bytes: u64,
}

/// An op with the shapes of its operands, as planning sees it.
#[derive(Debug, Clone, Copy)]
pub struct OpShapes<'a> {
    /// The op.
    pub op: &'a OpKind,
    /// Its inputs.
    pub inputs: &'a [ValueInfo],
    /// Its output.
    pub out: &'a ValueInfo,
}

/// Each node of `graph` with the shapes of its operands (owned, for [`OpShapes`]).
pub fn graph_ops(graph: &Graph) -> Vec<(OpKind, Vec<ValueInfo>, ValueInfo)> {
    graph
        .nodes()
        .iter()
        .map(|n| {
            (
                n.op.clone(),
                n.inputs.iter().map(|&v| graph.info(v).clone()).collect(),
                graph.info(n.output).clone(),
            )
        })
        .collect()
}

/// Views of [`graph_ops`]' entries.
pub fn op_shapes(ops: &[(OpKind, Vec<ValueInfo>, ValueInfo)]) -> Vec<OpShapes<'_>> {
    ops.iter()
        .map(|(op, inputs, out)| OpShapes { op, inputs, out })
        .collect()
}
