//! nibble's wgpu backend: every [`OpKind`] as a WGSL compute kernel in `shaders/<op>.wgsl`
//! (entry point named after the file), embedded with `include_str!` and compiled by wgpu at first
//! use. 4-bit weights stay packed on the device; the 4-bit linear dequantizes on the fly. Kernels
//! need neither subgroups nor shader-f16, so that every WebGPU browser can run them. Natively it
//! runs on Vulkan, Metal and DX12 (Mesa's lavapipe on CPU-only Linux); a machine without any
//! adapter gets [`WgpuError::NoAdapter`], never a panic.
//!
//! Device errors are values: the device is opened with an uncaptured-error handler and a
//! device-lost callback that record what went wrong (wgpu's default handler panics), buffers are
//! created inside error scopes, and every submit and read-back returns the recorded errors as an
//! [`nibble_core::Error`] naming what was asked.

mod dispatch;
#[cfg(not(target_arch = "wasm32"))]
mod peaks;
mod readback;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
pub use wgpu;

use nibble_core::backend::cpu_ref::Q4Ref;
use nibble_core::backend::{Backend, DeviceInfo, DeviceKind, OpShapes, Operand, Q4View, Workspace};
use nibble_core::graph::{HostTensor, OpKind};

pub use dispatch::STAGING_BOUND;
use dispatch::{DUMMY_SLOTS, DUMMY_STRIDE, UNIFORM_SLOTS};
#[cfg(not(target_arch = "wasm32"))]
pub use peaks::{DevicePeaks, PEAK_SHADERS};
use readback::words;

/// Every kernel: (op name, WGSL source).
pub const SHADERS: [(&str, &str); 29] = [
    (
        "adaln_modulate",
        include_str!("../shaders/adaln_modulate.wgsl"),
    ),
    ("add", include_str!("../shaders/add.wgsl")),
    ("attention", include_str!("../shaders/attention.wgsl")),
    (
        "attention_rows",
        include_str!("../shaders/attention_rows.wgsl"),
    ),
    ("cache_write", include_str!("../shaders/cache_write.wgsl")),
    ("concat", include_str!("../shaders/concat.wgsl")),
    ("conv2d", include_str!("../shaders/conv2d.wgsl")),
    ("dequant4", include_str!("../shaders/dequant4.wgsl")),
    ("embedding", include_str!("../shaders/embedding.wgsl")),
    ("gelu", include_str!("../shaders/gelu.wgsl")),
    ("gelu_tanh", include_str!("../shaders/gelu_tanh.wgsl")),
    ("group_norm", include_str!("../shaders/group_norm.wgsl")),
    ("layer_norm", include_str!("../shaders/layer_norm.wgsl")),
    ("linear", include_str!("../shaders/linear.wgsl")),
    ("linear_q4", include_str!("../shaders/linear_q4.wgsl")),
    (
        "linear_q4_tiled",
        include_str!("../shaders/linear_q4_tiled.wgsl"),
    ),
    ("matmul", include_str!("../shaders/matmul.wgsl")),
    ("mul", include_str!("../shaders/mul.wgsl")),
    ("permute", include_str!("../shaders/permute.wgsl")),
    ("quick_gelu", include_str!("../shaders/quick_gelu.wgsl")),
    ("reshape", include_str!("../shaders/reshape.wgsl")),
    ("rms_norm", include_str!("../shaders/rms_norm.wgsl")),
    ("rope", include_str!("../shaders/rope.wgsl")),
    ("scale", include_str!("../shaders/scale.wgsl")),
    ("silu", include_str!("../shaders/silu.wgsl")),
    ("slice", include_str!("../shaders/slice.wgsl")),
    ("softmax", include_str!("../shaders/softmax.wgsl")),
    (
        "timestep_embedding",
        include_str!("../shaders/timestep_embedding.wgsl"),
    ),
    ("upsample2x", include_str!("../shaders/upsample2x.wgsl")),
];

/// Helpers prepended to every kernel.
pub const COMMON: &str = include_str!("../shaders/common.wgsl");

/// The WGSL text compiled for `name` (common helpers + kernel), if there is such a kernel.
pub fn shader_source(name: &str) -> Option<String> {
    SHADERS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| format!("{COMMON}\n{s}"))
}

/// Rows up to which the 4-bit linear runs as a GEMV.
pub const GEMV_MAX_ROWS: u32 = 8;

/// What can go wrong in this backend.
#[derive(Debug, thiserror::Error)]
pub enum WgpuError {
    /// No GPU (or software) adapter: no driver installed, or none usable.
    #[error("no wgpu adapter found ({0}); on Linux without a GPU install Mesa's Vulkan driver: apt-get install mesa-vulkan-drivers libvulkan1")]
    NoAdapter(String),
    /// The adapter refused a device.
    #[error("wgpu device request failed: {0}")]
    Device(String),
    /// A GPU-side failure (validation, out of memory, mapping, lost device).
    #[error("wgpu: {0}")]
    Gpu(String),
    /// Shapes, inputs or options that do not fit.
    #[error(transparent)]
    Core(#[from] nibble_core::Error),
}

/// `Result` with [`WgpuError`].
pub type Result<T, E = WgpuError> = std::result::Result<T, E>;

/// Errors the device reported outside an error scope, and whether it was lost.
type ErrorLog = Arc<Mutex<Vec<String>>>;

/// A wgpu device with its kernel pipelines.
pub struct WgpuBackend {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    pipelines: HashMap<&'static str, wgpu::ComputePipeline>,
    resident: Option<Resident>,
    max_binding: u64,
    /// Errors recorded by the uncaptured-error handler and the device-lost callback.
    errors: ErrorLog,
    /// Ops recorded and not yet submitted.
    pending: Option<wgpu::CommandEncoder>,
    /// Uniform-ring slots used by the pending ops.
    pending_ops: u64,
    /// Submits of recorded ops so far.
    submits: u64,
    /// wgpu's host staging of `write_buffer` uploads, bounded ([`WgpuBackend::staging_room`]);
    /// behind a lock because read-backs (through `&self`) submit too.
    staging: std::sync::Mutex<dispatch::Staging>,
}

impl std::fmt::Debug for WgpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WgpuBackend({})", self.describe())
    }
}

/// Device memory of the executor path: one arena, one weight pool, the uniform ring.
#[derive(Debug)]
struct Resident {
    arena: wgpu::Buffer,
    pool: wgpu::Buffer,
    uniform: wgpu::Buffer,
    dummy: wgpu::Buffer,
}

impl WgpuBackend {
    /// Opens the best adapter present (a high-performance GPU if any, else a software one).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new() -> Result<Self> {
        pollster::block_on(Self::new_async())
    }

    /// The adapter [`WgpuBackend::new`] would open, without opening a device (a software
    /// renderer's device costs tens of MiB that stay mapped after it is dropped).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn probe() -> Result<wgpu::AdapterInfo> {
        Ok(pollster::block_on(Self::adapter())?.get_info())
    }

    /// The adapter nibble opens: a high-performance GPU if any, else a software one.
    async fn adapter() -> Result<wgpu::Adapter> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
        instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                force_fallback_adapter: false,
                compatible_surface: None,
                apply_limit_buckets: false,
            })
            .await
            .map_err(|e| WgpuError::NoAdapter(e.to_string()))
    }

    /// Async form of [`WgpuBackend::new`] (the browser cannot block).
    pub async fn new_async() -> Result<Self> {
        let adapter = Self::adapter().await?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("nibble"),
                required_features: wgpu::Features::empty(),
                required_limits: limits.clone(),
                experimental_features: wgpu::ExperimentalFeatures::disabled(),
                // A CPU renderer's memory blocks are this process's RAM, and a block keeps the
                // pages its freed upload staging touched: small blocks (gpu-allocator's 4-32 MiB
                // for host-visible memory instead of 64-128 MiB) keep the staging within what the
                // plan counts for it (SmolLM2 on lavapipe peaked 8 MiB over its plan with large
                // blocks, 12 MiB under with small ones; decode speed within run-to-run noise).
                memory_hints: if info.device_type == wgpu::DeviceType::Cpu {
                    wgpu::MemoryHints::MemoryUsage
                } else {
                    wgpu::MemoryHints::Performance
                },
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|e| WgpuError::Device(e.to_string()))?;
        // wgpu's default handler panics on an error outside an error scope: record it instead,
        // and return it from the next submit or read-back.
        let errors: ErrorLog = Arc::default();
        let log = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut l) = log.lock() {
                l.push(e.to_string());
            }
        }));
        let lost = errors.clone();
        device.set_device_lost_callback(move |reason, msg| {
            if let Ok(mut l) = lost.lock() {
                l.push(format!("the device was lost ({reason:?}): {msg}"));
            }
        });
        let max_binding = limits.max_storage_buffer_binding_size;
        Ok(WgpuBackend {
            device,
            queue,
            info,
            limits,
            pipelines: HashMap::new(),
            resident: None,
            max_binding,
            errors,
            pending: None,
            pending_ops: 0,
            submits: 0,
            staging: Default::default(),
        })
    }

    /// "name (backend, type)" of the adapter.
    pub fn describe(&self) -> String {
        format!(
            "{} ({:?}, {:?})",
            self.info.name, self.info.backend, self.info.device_type
        )
    }

    /// Whether the adapter is a software rasterizer on the CPU (lavapipe, SwiftShader), which
    /// `--backend auto` passes over for nibble's own CPU backend.
    pub fn is_software(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    /// The adapter's own description (vendor, architecture, driver).
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    /// The device limits in force.
    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    /// Submits of recorded ops so far (ops are batched: about one per weight group).
    pub fn submits(&self) -> u64 {
        self.submits
    }

    /// The most bytes one operand of `op` may take (`input`: its index among the op's inputs,
    /// `None`: the output): one storage binding, except a dense weight (an lm_head, an
    /// embedding table), which is bound as row pieces.
    pub(crate) fn operand_limit(&self, op: &OpKind, input: Option<usize>) -> Option<u64> {
        let pieces = matches!(op, OpKind::Linear { .. } | OpKind::Embedding) && input == Some(1);
        (!pieces).then_some(self.max_binding)
    }

    /// Whether this backend has a kernel for `op` (every op today).
    pub fn supports(&self, op: &OpKind) -> bool {
        SHADERS.iter().any(|(n, _)| *n == op.name())
    }

    /// The errors the device reported since the last check, as one error.
    fn check_errors(&self) -> Result<()> {
        let mut l = self
            .errors
            .lock()
            .map_err(|_| WgpuError::Gpu("error log poisoned".into()))?;
        if l.is_empty() {
            return Ok(());
        }
        let all = std::mem::take(&mut *l).join("; ");
        Err(WgpuError::Gpu(all))
    }

    fn check(op: &OpKind, shapes: &[Vec<usize>]) -> nibble_core::Result<()> {
        if let (OpKind::Attention { .. }, Some(q)) = (op, shapes.first()) {
            if q.get(2).copied().unwrap_or(0) > 256 {
                return Err(nibble_core::Error::Invalid(format!(
                    "wgpu attention: head dim {} is over 256",
                    q[2]
                )));
            }
        }
        Ok(())
    }

    fn pipeline(&mut self, name: &'static str) -> Result<wgpu::ComputePipeline> {
        if let Some(p) = self.pipelines.get(name) {
            return Ok(p.clone());
        }
        let src =
            shader_source(name).ok_or_else(|| WgpuError::Gpu(format!("no kernel named {name}")))?;
        let p = self.compile(name, src);
        self.pipelines.insert(name, p.clone());
        Ok(p)
    }

    /// The compute pipeline of WGSL `src` whose entry point is `name`.
    fn compile(&self, name: &str, src: String) -> wgpu::ComputePipeline {
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(name),
                source: wgpu::ShaderSource::Wgsl(src.into()),
            });
        self.device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(name),
                layout: None,
                module: &module,
                entry_point: Some(name),
                compilation_options: Default::default(),
                cache: None,
            })
    }

    /// A buffer of `size` bytes named `what` (in errors): over the adapter's `max_buffer_size` it
    /// is refused before wgpu sees it; natively it is created inside out-of-memory and
    /// validation error scopes, so that a failure is this call's error (in the browser the
    /// uncaptured-error handler records it for the next submit or read-back).
    pub fn create_buffer(
        &self,
        what: &str,
        size: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer> {
        let max = self.limits.max_buffer_size;
        if size > max {
            return Err(WgpuError::Gpu(format!(
                "the {what} needs {size} bytes, over this adapter's max_buffer_size of {max} bytes"
            )));
        }
        let label = format!("{what} ({size} bytes)");
        #[cfg(not(target_arch = "wasm32"))]
        let scopes = (
            self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory),
            self.device.push_error_scope(wgpu::ErrorFilter::Validation),
        );
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(&label),
            size: size.max(4),
            usage,
            mapped_at_creation: false,
        });
        #[cfg(not(target_arch = "wasm32"))]
        {
            let (oom, validation) = scopes;
            let v = pollster::block_on(validation.pop());
            let o = pollster::block_on(oom.pop());
            if let Some(e) = o.or(v) {
                return Err(WgpuError::Gpu(format!("allocating {label}: {e}")));
            }
        }
        Ok(buffer)
    }

    /// Runs one op with host inputs and returns the host output, through the same arena and
    /// pool path the executor uses (temporary buffers; the executor's allocation is kept).
    pub fn run(
        &mut self,
        op: &OpKind,
        inputs: &[&HostTensor],
        q4: Option<Q4Ref<'_>>,
    ) -> Result<HostTensor> {
        if let (OpKind::Embedding, Some(table)) = (op, inputs.get(1)) {
            let vocab = table.info.shape[0];
            if let Some(bad) = inputs[0].as_u32().iter().find(|&&id| id as usize >= vocab) {
                return Err(nibble_core::Error::Invalid(format!(
                    "embedding: token id {bad} is outside the vocabulary of {vocab}"
                ))
                .into());
            }
        }
        self.flush()?;
        let saved = self.resident.take();
        let result = nibble_core::backend::run_op(self, op, inputs, q4);
        let flushed = self.flush();
        self.resident = saved;
        flushed?;
        Ok(result?)
    }

    /// Caps the size of one storage binding below the adapter's limit (a constrained adapter, or
    /// a test of the split path with small weights).
    pub fn with_max_binding(mut self, bytes: u64) -> Self {
        self.max_binding = bytes
            .min(self.limits.max_storage_buffer_binding_size)
            .max(4);
        self
    }

    fn resident(&self) -> nibble_core::Result<&Resident> {
        self.resident
            .as_ref()
            .ok_or_else(|| nibble_core::Error::Invalid("wgpu: allocate() was not called".into()))
    }
}

fn core_err(e: WgpuError) -> nibble_core::Error {
    match e {
        WgpuError::Core(c) => c,
        other => nibble_core::Error::Invalid(other.to_string()),
    }
}

impl Backend for WgpuBackend {
    fn name(&self) -> String {
        format!("wgpu: {}", self.describe())
    }

    /// A kernel for the op, sizes within 32 bits, and every operand within one storage binding
    /// (a dense weight over it, an lm_head or an embedding table, is bound as row pieces).
    fn supports(&self, o: &OpShapes<'_>) -> std::result::Result<(), String> {
        if !WgpuBackend::supports(self, o.op) {
            return Err("no WGSL kernel".into());
        }
        let shapes: Vec<Vec<usize>> = o.inputs.iter().map(|i| i.shape.clone()).collect();
        nibble_core::backend::kernel_calls::fits_u32(&shapes, &o.out.shape)?;
        let operands = o.inputs.iter().map(Some).enumerate();
        for (i, info) in operands.chain(std::iter::once((o.inputs.len(), None))) {
            let at = info.is_some().then_some(i);
            let info = info.unwrap_or(o.out);
            let bytes = info.words() as u64 * 4;
            if let Some(limit) = self.operand_limit(o.op, at).filter(|&l| bytes > l) {
                return Err(format!(
                    "{} of shape {:?} takes {bytes} bytes, over {}'s limit of {limit} bytes for \
                     one operand (a smaller input, a smaller tile, or another backend)",
                    at.map_or("the output".to_string(), |i| format!("input {i}")),
                    info.shape,
                    self.name()
                ));
            }
        }
        Ok(())
    }

    /// wgpu's host staging of uploads, bounded by [`STAGING_BOUND`] (in the browser it is the
    /// browser's memory, not the page's).
    fn workspace(&self, _ops: &[OpShapes<'_>]) -> Workspace {
        Workspace {
            host_bytes: if cfg!(target_arch = "wasm32") {
                0
            } else {
                STAGING_BOUND
            },
            device_bytes: 0,
        }
    }

    /// A CPU renderer (lavapipe, SwiftShader) keeps its buffers in this process's RAM, and an
    /// integrated GPU's memory is the machine's RAM; in the browser they are the browser's,
    /// not the page's. wgpu tells limits, not free memory.
    fn device_info(&self) -> DeviceInfo {
        let a = self.limits.min_storage_buffer_offset_alignment.max(4);
        let kind = match self.info.device_type {
            _ if cfg!(target_arch = "wasm32") => DeviceKind::Other,
            wgpu::DeviceType::Cpu => DeviceKind::CpuRenderer,
            wgpu::DeviceType::IntegratedGpu => DeviceKind::IntegratedGpu,
            wgpu::DeviceType::DiscreteGpu => DeviceKind::DiscreteGpu,
            _ => DeviceKind::Other,
        };
        DeviceInfo {
            kind,
            memory: None,
            allocation_limit: Some((self.limits.max_buffer_size, "max_buffer_size")),
            max_binding: Some(self.max_binding),
            alignment: nibble_core::backend::Alignment {
                arena_words: (a / 4) as usize,
                pool_bytes: a as u64,
            },
        }
    }

    /// Compiles the pipelines of `graph`'s ops (both 4-bit linear kernels: the GEMV for decode
    /// and the tiled one for larger batches) and, natively, launches each once
    /// (`warm_up`): a CPU renderer keeps the compiled code in this process's
    /// memory, some of it made at a kernel's first launch.
    fn prepare(&mut self, graph: &nibble_core::graph::Graph) -> nibble_core::Result<()> {
        let kernels = Self::graph_kernels(graph);
        for (name, _, _) in &kernels {
            self.pipeline(name).map_err(core_err)?;
        }
        #[cfg(not(target_arch = "wasm32"))]
        self.warm_up(&kernels).map_err(core_err)?;
        Ok(())
    }

    fn allocate(
        &mut self,
        arena_words: usize,
        pool_bytes: u64,
        _workspace: u64,
    ) -> nibble_core::Result<()> {
        self.flush().map_err(core_err)?;
        let arena_bytes = (arena_words.max(1) as u64).saturating_mul(4);
        let st = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC;
        let arena = self
            .create_buffer("activation arena", arena_bytes, st)
            .map_err(core_err)?;
        let pool = self
            .create_buffer("weight pool", pool_bytes, st)
            .map_err(core_err)?;
        let uniform = self
            .create_buffer(
                "op parameters",
                UNIFORM_SLOTS * self.uniform_stride(),
                wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            )
            .map_err(core_err)?;
        let dummy = self
            .create_buffer(
                "absent operands",
                DUMMY_SLOTS * DUMMY_STRIDE,
                wgpu::BufferUsages::STORAGE,
            )
            .map_err(core_err)?;
        self.resident = Some(Resident {
            arena,
            pool,
            uniform,
            dummy,
        });
        Ok(())
    }

    fn release(&mut self) {
        // Ops still pending read these buffers: submit them before the memory goes.
        let _ = self.flush();
        if let Some(r) = self.resident.take() {
            r.arena.destroy();
            r.pool.destroy();
        }
    }

    fn write_arena(
        &mut self,
        dst: nibble_core::backend::ArenaSlice,
        words: &[u32],
    ) -> nibble_core::Result<()> {
        // A queued write takes effect before anything recorded and not yet submitted.
        self.flush().map_err(core_err)?;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.staging_room(bytes.len() as u64).map_err(core_err)?;
        let r = self.resident()?;
        self.queue
            .write_buffer(&r.arena, dst.offset as u64 * 4, &bytes);
        Ok(())
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn read_arena(
        &mut self,
        src: nibble_core::backend::ArenaSlice,
    ) -> nibble_core::Result<Vec<u32>> {
        self.flush().map_err(core_err)?;
        let r = self.resident()?;
        let bytes = self
            .read_back(&r.arena, src.offset as u64 * 4, (src.len.max(1) * 4) as u64)
            .map_err(core_err)?;
        self.check_errors().map_err(core_err)?;
        Ok(words(&bytes, src.len))
    }

    /// In the browser a read-back can only be awaited (`read_arena_async`).
    #[cfg(target_arch = "wasm32")]
    fn read_arena(
        &mut self,
        _src: nibble_core::backend::ArenaSlice,
    ) -> nibble_core::Result<Vec<u32>> {
        Err(nibble_core::Error::Invalid(
            "WebGPU cannot read back synchronously: use the async executor path".into(),
        ))
    }

    fn read_arena_async(
        &mut self,
        src: nibble_core::backend::ArenaSlice,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = nibble_core::Result<Vec<u32>>> + '_>>
    {
        let flushed = self.flush().map_err(core_err);
        let fut = flushed.and_then(|()| {
            self.resident().map(|r| {
                self.read_back_async(&r.arena, src.offset as u64 * 4, (src.len.max(1) * 4) as u64)
            })
        });
        Box::pin(async move {
            let bytes = fut?.await.map_err(core_err)?;
            self.check_errors().map_err(core_err)?;
            Ok(words(&bytes, src.len))
        })
    }

    fn upload(
        &mut self,
        offset: u64,
        bytes: &[u8],
    ) -> nibble_core::Result<Box<dyn nibble_core::stream::ring::Fence>> {
        // The region may still be read by recorded ops of the group two back.
        self.flush().map_err(core_err)?;
        self.staging_room(bytes.len().div_ceil(4) as u64 * 4)
            .map_err(core_err)?;
        let r = self.resident()?;
        if bytes.len().is_multiple_of(4) {
            self.queue.write_buffer(&r.pool, offset, bytes);
        } else {
            // Copies must be whole words; the pool region is padded to the next alignment.
            let mut padded = bytes.to_vec();
            padded.resize(bytes.len().div_ceil(4) * 4, 0);
            self.queue.write_buffer(&r.pool, offset, &padded);
        }
        // write_buffer has copied the bytes into wgpu's own staging memory: the slot is free.
        Ok(Box::new(nibble_core::backend::Signalled))
    }

    fn run(
        &mut self,
        op: &OpKind,
        inputs: &[Operand],
        q4: Option<&Q4View>,
        out: &Operand,
    ) -> nibble_core::Result<()> {
        self.run_op(op, inputs, q4, out)
    }
}
