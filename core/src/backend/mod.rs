//! The backend layer: the interface a device implements, small on purpose (ggml's
//! `graph_compute` + `supports_op`, not a 40-method storage trait), with one optional capability
//! ([`HostMemory`]) for backends whose memory is the host's. A backend owns one activation arena
//! and one weight pool, both allocated once; the planner places every value and weight in them
//! before the first step. Here too: the kernel-call table the GPU backends share
//! ([`kernel_calls`]), the scalar reference backend ([`cpu_ref`], the oracle) and the optimized
//! CPU backend ([`cpu`]).
//!
//! Owns: running ops on a device's memory.
//! May import: `graph`, `stream` (fences, slot memory), `format` (quant states), `error`.

use crate::error::Result;
use crate::graph::{OpKind, ValueInfo};
use crate::stream::ring::{Fence, SlotAllocator};

pub mod cpu;
pub mod cpu_ref;
mod device;
pub mod kernel_calls;
mod single_op;

pub use device::{graph_ops, op_shapes, DeviceInfo, DeviceKind, OpShapes, Workspace};

pub use single_op::{host_words, layout_op, run_op, OpLayout};

/// A region of the activation arena, in 4-byte words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaSlice {
    /// First word.
    pub offset: usize,
    /// Words.
    pub len: usize,
}

/// A region of the weight pool, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolRegion {
    /// First byte.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A 4-bit weight in the pool: packed codes, f32 absmax (double quantization already undone
/// bit-exactly by the executor) and the 16-entry code table.
#[derive(Debug, Clone, PartialEq)]
pub struct Q4View {
    /// Packed codes.
    pub packed: PoolRegion,
    /// One f32 per block.
    pub absmax: PoolRegion,
    /// 16 f32.
    pub code: PoolRegion,
    /// Logical shape.
    pub shape: Vec<usize>,
    /// Elements per block.
    pub blocksize: usize,
}

/// An operand of an op: where it lives and what it is.
#[derive(Debug, Clone, PartialEq)]
pub struct Operand {
    /// Its arena words.
    pub slice: ArenaSlice,
    /// Shape and type.
    pub info: ValueInfo,
}

/// A fence that has already signalled (the host has finished with the slot).
#[derive(Debug, Clone, Copy, Default)]
pub struct Signalled;

impl Fence for Signalled {
    fn is_signalled(&self) -> bool {
        true
    }
    fn wait(&self) {}
}

/// Alignment a backend needs for the addresses the planner hands it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alignment {
    /// Every arena slice starts at a multiple of this many 4-byte words (binding offset rules).
    pub arena_words: usize,
    /// Every pool region starts at a multiple of this many bytes.
    pub pool_bytes: u64,
}

impl Default for Alignment {
    fn default() -> Self {
        Alignment {
            arena_words: 1,
            pool_bytes: 4,
        }
    }
}

/// What the executor needs from a device: allocate once, write and read the arena, upload weight
/// bytes into the pool with a fence, say which ops run, run them. What only some backends do is
/// an optional capability ([`Backend::host_memory`]).
pub trait Backend {
    /// Name for tables and messages.
    fn name(&self) -> String;
    /// Whether the op runs here on operands of these shapes; `Err` says why not (no kernel, a
    /// head size over the kernel's, an element count past 32 bits, an operand over a binding
    /// limit). The planner refuses a graph with such an op, naming it and the limit, before any
    /// weight byte is read.
    fn supports(&self, op: &OpShapes<'_>) -> std::result::Result<(), String>;
    /// What planning reads of the device ([`DeviceInfo`]); by default a CPU's.
    fn device_info(&self) -> DeviceInfo {
        DeviceInfo::default()
    }
    /// The host and device workspace the backend's kernels need to run `ops` (a graph's, or
    /// one op's) beyond the arena and the pool: the plan counts both, and the device part is
    /// allocated with them, once ([`Backend::allocate`]).
    fn workspace(&self, _ops: &[OpShapes<'_>]) -> Workspace {
        Workspace::default()
    }
    /// Allocates the activation arena (`arena_words` 4-byte words), the weight pool and the
    /// kernels' device workspace ([`Workspace::device_bytes`]), once.
    fn allocate(&mut self, arena_words: usize, pool_bytes: u64, workspace_bytes: u64)
        -> Result<()>;
    /// Frees the arena and the pool (the end of a pipeline phase); `allocate` may follow.
    fn release(&mut self);
    /// Writes host words into the arena.
    fn write_arena(&mut self, dst: ArenaSlice, words: &[u32]) -> Result<()>;
    /// Reads arena words back.
    fn read_arena(&mut self, src: ArenaSlice) -> Result<Vec<u32>>;
    /// Copies bytes (usually from a ring slot) into the weight pool at `offset`. The returned
    /// fence signals when the source bytes may be overwritten.
    fn upload(&mut self, offset: u64, bytes: &[u8]) -> Result<Box<dyn Fence>>;
    /// Runs `op` on arena operands (and a pool weight) into `out`.
    fn run(
        &mut self,
        op: &OpKind,
        inputs: &[Operand],
        q4: Option<&Q4View>,
        out: &Operand,
    ) -> Result<()>;

    /// [`Backend::read_arena`] for an event loop (the browser), where waiting for the device
    /// would block the loop that delivers its answer. The default reads synchronously.
    fn read_arena_async(
        &mut self,
        src: ArenaSlice,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<u32>>> + '_>> {
        let r = self.read_arena(src);
        Box::pin(std::future::ready(r))
    }
    /// Starts a device-side measure of the calls that follow ([`Backend::end_timing`] ends it):
    /// a GPU backend records a clock event on its queue. The default does nothing.
    fn begin_timing(&mut self) -> Result<()> {
        Ok(())
    }
    /// The device time from [`Backend::begin_timing`] to the end of the calls queued since,
    /// waiting for them; `None` where the backend has no device clock (the caller times on the
    /// host).
    fn end_timing(&mut self) -> Result<Option<std::time::Duration>> {
        Ok(None)
    }
    /// A weight group is about to be uploaded (the executor calls this before each group's
    /// first chunk): a streamed group into pool slot `slot` (0 or 1, see
    /// the plan layout's `stream_slot`), a resident one (`None`) into its own regions.
    /// Asynchronous backends make the uploads that follow wait for the kernels that read the
    /// slot's previous group, which [`Backend::group_used`] marked.
    fn begin_group_load(&mut self, _slot: Option<usize>) {}
    /// The last op that reads the streamed group in pool slot `slot` has been queued (the
    /// executor calls this after that op, before the slot's next group begins to load).
    fn group_used(&mut self, _slot: usize) {}
    /// Memory for the staging ring's slots and the host tier (pinned host memory for CUDA, so
    /// that uploads from them are DMA); `None`: plain host memory.
    fn slot_allocator(&self) -> Option<Box<dyn SlotAllocator>> {
        None
    }
    /// The host-memory capability, where the arena and the pool are host memory (the optimized
    /// CPU backend); `None` for device backends. Queried once when a run is planned.
    fn host_memory(&mut self) -> Option<&mut dyn HostMemory> {
        None
    }
    /// Makes ready what running `graph` needs besides its memory (a GPU backend compiles its
    /// kernels' pipelines), so that a run measures the process's memory, driver state included,
    /// after it: the plan's prediction of the peak RSS starts from that measure.
    fn prepare(&mut self, _graph: &crate::graph::Graph) -> crate::Result<()> {
        Ok(())
    }
}

/// The share of a device's allocation limit that `--device-budget auto` takes where the device
/// tells limits but not free memory (numerator, denominator): three quarters, leaving room for
/// the activation arena, the staging buffers and the other users of the device.
pub const AUTO_LIMIT_FRACTION: (u64, u64) = (3, 4);

/// What a backend whose arena and pool are plain host memory does besides [`Backend`]: read
/// dense weights in their stored form (bf16 kept as bf16, widened in the kernels), let the
/// loader write straight into the pool, and read streamed weights in place from ring slots
/// instead of from a copy.
pub trait HostMemory {
    /// The arena's f32 words at `dst`, writable: dense weights are widened straight into them.
    fn arena_f32_mut(&mut self, dst: ArenaSlice) -> Result<&mut [f32]>;
    /// Writes bf16 bytes (as the model stores them) into a [`crate::graph::ElemType::BF16`]
    /// value at `dst`, starting at its element `first` (two elements per arena word, so `first`
    /// may fall in the middle of a word).
    fn write_bf16(&mut self, dst: ArenaSlice, first: usize, bytes: &[u8]) -> Result<()>;
    /// The bytes of pool region `r`, writable (a streamed weight's absmax is decoded straight
    /// into them).
    fn pool_mut(&mut self, r: PoolRegion) -> Result<&mut [u8]>;
    /// From now on, ops read the pool bytes at `offset` (a packed weight's region,
    /// `bytes.len()` long) from `bytes` itself, a filled ring slot, until
    /// [`HostMemory::end_lend`].
    ///
    /// # Safety
    /// `bytes` must stay valid and unchanged until `end_lend(offset)` or `release`.
    unsafe fn lend(&mut self, offset: u64, bytes: &[u8]);
    /// Ends a [`HostMemory::lend`]: ops read the pool again.
    fn end_lend(&mut self, offset: u64);
    /// Regions lent and not yet ended.
    fn lent(&self) -> usize;
    /// The executor is about to block on the weight stream: worker threads may sleep so that
    /// the readers get the cores.
    fn idle(&mut self);
}
