//! nibble's wgpu backend: every [`OpKind`] as a WGSL compute kernel in `shaders/<op>.wgsl`
//! (entry point named after the file), embedded with `include_str!` and compiled by wgpu at first
//! use. 4-bit weights stay packed on the device; the 4-bit linear dequantizes on the fly. Kernels
//! need neither subgroups nor shader-f16, so that every WebGPU browser can run them. Natively it
//! runs on Vulkan, Metal and DX12 (Mesa's lavapipe on CPU-only Linux); a machine without any
//! adapter gets [`WgpuError::NoAdapter`], never a panic.

use std::collections::HashMap;
pub use wgpu;

use nibble_core::backend::cpu_ref::Q4Ref;
use nibble_core::backend::{Backend, Operand, Q4View};
use nibble_core::graph::{HostTensor, OpKind};

/// Every kernel: (op name, WGSL source).
pub const SHADERS: [(&str, &str); 24] = [
    (
        "adaln_modulate",
        include_str!("../shaders/adaln_modulate.wgsl"),
    ),
    ("add", include_str!("../shaders/add.wgsl")),
    ("attention", include_str!("../shaders/attention.wgsl")),
    ("cache_write", include_str!("../shaders/cache_write.wgsl")),
    ("concat", include_str!("../shaders/concat.wgsl")),
    ("dequant4", include_str!("../shaders/dequant4.wgsl")),
    ("embedding", include_str!("../shaders/embedding.wgsl")),
    ("gelu", include_str!("../shaders/gelu.wgsl")),
    ("gelu_tanh", include_str!("../shaders/gelu_tanh.wgsl")),
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

/// How a kernel is launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dispatch {
    /// One invocation per item, 64 per workgroup.
    Threads(usize),
    /// Explicit workgroup counts.
    Groups(u32, u32),
}

/// What can go wrong in this backend.
#[derive(Debug, thiserror::Error)]
pub enum WgpuError {
    /// No GPU (or software) adapter: no driver installed, or none usable.
    #[error("no wgpu adapter found ({0}); on Linux without a GPU install Mesa's Vulkan driver: apt-get install mesa-vulkan-drivers libvulkan1")]
    NoAdapter(String),
    /// The adapter refused a device.
    #[error("wgpu device request failed: {0}")]
    Device(String),
    /// A GPU-side failure (validation, mapping, lost device).
    #[error("wgpu: {0}")]
    Gpu(String),
    /// Shapes, inputs or options that do not fit.
    #[error(transparent)]
    Core(#[from] nibble_core::Error),
}

/// `Result` with [`WgpuError`].
pub type Result<T, E = WgpuError> = std::result::Result<T, E>;

/// A wgpu device with its kernel pipelines.
pub struct WgpuBackend {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    pipelines: HashMap<&'static str, wgpu::ComputePipeline>,
    resident: Option<Resident>,
    max_binding: u64,
}

impl std::fmt::Debug for WgpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WgpuBackend({})", self.describe())
    }
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
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|e| WgpuError::Device(e.to_string()))?;
        let max_binding = limits.max_storage_buffer_binding_size;
        Ok(WgpuBackend {
            device,
            queue,
            info,
            limits,
            pipelines: HashMap::new(),
            resident: None,
            max_binding,
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

    /// Whether this backend runs `op` (every op today).
    pub fn supports(&self, op: &OpKind) -> bool {
        SHADERS.iter().any(|(n, _)| *n == op.name())
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
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(name),
                source: wgpu::ShaderSource::Wgsl(src.into()),
            });
        let p = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(name),
                layout: None,
                module: &module,
                entry_point: Some(name),
                compilation_options: Default::default(),
                cache: None,
            });
        self.pipelines.insert(name, p.clone());
        Ok(p)
    }

    /// Kernel, uniform words and dispatch size of `op` for these operand shapes.
    fn kernel(
        op: &OpKind,
        shapes: &[Vec<usize>],
        out: &[usize],
        q4_blocksize: u32,
        bn: usize,
    ) -> (&'static str, Vec<u32>, Dispatch) {
        let (name, params, threads) =
            nibble_core::backend::kernel_calls::call(op, shapes, out, q4_blocksize, bn);
        if let OpKind::LinearQ4 { .. } = op {
            let (rows, n) = (out[0] as u32, out[1] as u32);
            // A GEMV (one workgroup per output) for decode-sized batches, 16 x 16 tiles above.
            if rows > GEMV_MAX_ROWS {
                return (
                    "linear_q4_tiled",
                    params,
                    Dispatch::Groups(n.div_ceil(16), rows.div_ceil(16)),
                );
            }
            return (name, params, Dispatch::Groups(rows * n, 1));
        }
        (name, params, Dispatch::Threads(threads))
    }

    /// Storage bindings of `op` in its kernel's order: operands, the 4-bit weight's three
    /// buffers, and a dummy for each absent optional operand. Every binding is a writable
    /// storage binding (the arena holds inputs and outputs), and WebGPU refuses two
    /// overlapping writable bindings: each dummy gets its own range of the dummy buffer.
    fn bind_order<'a>(
        op: &OpKind,
        ins: &[wgpu::BindingResource<'a>],
        q4: Option<[wgpu::BindingResource<'a>; 3]>,
        dummy: &'a wgpu::Buffer,
    ) -> Vec<wgpu::BindingResource<'a>> {
        use nibble_core::backend::kernel_calls::Slot;
        let mut dummies = 0u64;
        nibble_core::backend::kernel_calls::operands(op, ins.len())
            .into_iter()
            .map(|s| match (s, &q4) {
                (Slot::Input(i), _) => ins[i].clone(),
                (Slot::Packed, Some(q)) => q[0].clone(),
                (Slot::Absmax, Some(q)) => q[1].clone(),
                (Slot::Code, Some(q)) => q[2].clone(),
                _ => {
                    let at = dummies * DUMMY_STRIDE;
                    dummies = (dummies + 1) % DUMMY_SLOTS;
                    wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: dummy,
                        offset: at,
                        size: std::num::NonZeroU64::new(4),
                    })
                }
            })
            .collect()
    }

    fn encode(
        &mut self,
        name: &'static str,
        params: &[u32],
        binds: Vec<wgpu::BindingResource<'_>>,
        out: wgpu::BindingResource<'_>,
        dispatch: Dispatch,
        uniform: &wgpu::Buffer,
    ) -> Result<wgpu::CommandEncoder> {
        let pipeline = self.pipeline(name)?;
        let mut words = params.to_vec();
        words.resize(16, 0);
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.queue.write_buffer(uniform, 0, &bytes);
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: uniform.as_entire_binding(),
        }];
        let nb = binds.len() as u32;
        for (k, b) in binds.into_iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: k as u32 + 1,
                resource: b,
            });
        }
        entries.push(wgpu::BindGroupEntry {
            binding: nb + 1,
            resource: out,
        });
        let layout = pipeline.get_bind_group_layout(0);
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        });
        let max = self.limits.max_compute_workgroups_per_dimension.max(1);
        let (gx, gy) = match dispatch {
            Dispatch::Threads(threads) => {
                let groups = threads.div_ceil(64).max(1) as u32;
                if groups <= max {
                    (groups, 1)
                } else {
                    (max, groups.div_ceil(max))
                }
            }
            // A 1-D count of workgroups folded into x and y (kernels use x + y * num_workgroups.x).
            Dispatch::Groups(x, 1) if x > max => (max, x.div_ceil(max)),
            Dispatch::Groups(x, y) => (x.max(1), y.max(1)),
        };
        if gx > max || gy > max {
            return Err(WgpuError::Gpu(format!(
                "{name}: dispatch of {gx} x {gy} workgroups exceeds the limit {max}"
            )));
        }
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(name) });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(name),
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(gx, gy, 1);
        }
        Ok(enc)
    }

    /// Copies `bytes` of `src` into a mappable buffer and asks for its mapping; the returned
    /// future resolves once the device has finished (on an event loop: when the loop runs).
    fn read_back_async(
        &self,
        src: &wgpu::Buffer,
        offset: u64,
        bytes: u64,
    ) -> impl std::future::Future<Output = Result<Vec<u8>>> {
        type Mapped = (
            Option<std::result::Result<(), wgpu::BufferAsyncError>>,
            Option<std::task::Waker>,
        );
        let readback = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: bytes.max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("read"),
            });
        enc.copy_buffer_to_buffer(src, offset, &readback, 0, bytes);
        self.queue.submit([enc.finish()]);
        let state: std::sync::Arc<std::sync::Mutex<Mapped>> = Default::default();
        let cb = state.clone();
        readback.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            if let Ok(mut g) = cb.lock() {
                g.0 = Some(r);
                if let Some(w) = g.1.take() {
                    w.wake();
                }
            }
        });
        // Natively nothing delivers the mapping unless the device is polled.
        #[cfg(not(target_arch = "wasm32"))]
        let polled = self
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| WgpuError::Gpu(e.to_string()));
        #[cfg(target_arch = "wasm32")]
        let polled: Result<()> = Ok(());
        async move {
            polled?;
            std::future::poll_fn(|cx| match state.lock() {
                Ok(mut g) => match g.0.take() {
                    Some(r) => std::task::Poll::Ready(r.map_err(|e| WgpuError::Gpu(e.to_string()))),
                    None => {
                        g.1 = Some(cx.waker().clone());
                        std::task::Poll::Pending
                    }
                },
                Err(_) => {
                    std::task::Poll::Ready(Err(WgpuError::Gpu("read-back state poisoned".into())))
                }
            })
            .await?;
            let slice = readback.slice(..);
            let view = slice
                .get_mapped_range()
                .map_err(|e| WgpuError::Gpu(e.to_string()))?;
            let v = view[..bytes as usize].to_vec();
            drop(view);
            readback.unmap();
            Ok(v)
        }
    }

    /// Natively the read-back's future is ready once the device has been polled to idle.
    #[cfg(not(target_arch = "wasm32"))]
    fn read_back(&self, src: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>> {
        pollster::block_on(self.read_back_async(src, offset, bytes))
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
        let saved = self.resident.take();
        let result = nibble_core::backend::run_op(self, op, inputs, q4);
        self.resident = saved;
        Ok(result?)
    }
}

/// Rows per piece must keep every piece's packed and absmax bindings at aligned offsets: the
/// smallest row count s with s*k a multiple of the blocksize and of 2, and s*k/2 and
/// s*k/blocksize*4 multiples of the offset alignment.
fn piece_step(k: u64, blocksize: u64, align: u64) -> Option<u64> {
    (1..=1u64 << 20).find(|&s| {
        let e = s * k;
        e % blocksize == 0 && e % 2 == 0 && (e / 2) % align == 0 && (e / blocksize * 4) % align == 0
    })
}

/// Device memory of the executor path: one arena, one weight pool, one uniform buffer.
#[derive(Debug)]
struct Resident {
    arena: wgpu::Buffer,
    pool: wgpu::Buffer,
    uniform: wgpu::Buffer,
    dummy: wgpu::Buffer,
}

impl WgpuBackend {
    fn resident(&self) -> nibble_core::Result<&Resident> {
        self.resident
            .as_ref()
            .ok_or_else(|| nibble_core::Error::Invalid("wgpu: allocate() was not called".into()))
    }
}

impl WgpuBackend {
    /// A dense weight (`Linear`'s w, `Embedding`'s table) over the binding limit, as row pieces.
    #[allow(clippy::too_many_arguments)]
    fn dense_row_pieces(
        &mut self,
        op: &OpKind,
        params: &[u32],
        inputs: &[Operand],
        ins: &[wgpu::BindingResource<'_>],
        out: wgpu::BindingResource<'_>,
        arena: &wgpu::Buffer,
        dummy: &wgpu::Buffer,
        uniform: &wgpu::Buffer,
    ) -> nibble_core::Result<()> {
        let w = &inputs[1];
        let (rows, k) = (w.info.shape[0] as u64, w.info.shape[1] as u64);
        let align = Backend::alignment(self).pool_bytes;
        let step = (1..=1u64 << 20)
            .find(|s| (s * k * 4) % align == 0)
            .ok_or_else(|| nibble_core::Error::Invalid("wgpu: no aligned split".into()))?;
        let per = self.max_binding / (k * 4).max(1) / step * step;
        if per == 0 {
            return Err(nibble_core::Error::Invalid(format!(
                "wgpu {}: {step} rows of {k} values exceed the binding limit of {} bytes",
                op.name(),
                self.max_binding
            )));
        }
        let mut r0 = 0u64;
        while r0 < rows {
            let r1 = (r0 + per).min(rows);
            let piece = wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: arena,
                offset: (w.slice.offset as u64 + r0 * k) * 4,
                size: std::num::NonZeroU64::new(((r1 - r0) * k * 4).max(4)),
            });
            let mut p = params.to_vec();
            let (name, binds, threads) = match op {
                OpKind::Linear { bias } => {
                    p[1] = (r1 - r0) as u32;
                    p[5] = r0 as u32;
                    let b = if *bias {
                        ins[2].clone()
                    } else {
                        dummy.as_entire_binding()
                    };
                    (
                        "linear",
                        vec![ins[0].clone(), piece, b],
                        p[0] as usize * (r1 - r0) as usize,
                    )
                }
                _ => {
                    p[2] = r0 as u32;
                    p[3] = (r1 - r0) as u32;
                    (
                        "embedding",
                        vec![ins[0].clone(), piece],
                        (p[0] * p[1]) as usize,
                    )
                }
            };
            let enc = self
                .encode(
                    name,
                    &p,
                    binds,
                    out.clone(),
                    Dispatch::Threads(threads),
                    uniform,
                )
                .map_err(core_err)?;
            self.queue.submit([enc.finish()]);
            r0 = r1;
        }
        Ok(())
    }

    /// Caps the size of one storage binding below the adapter's limit (a constrained adapter, or
    /// a test of the split path with small weights).
    pub fn with_max_binding(mut self, bytes: u64) -> Self {
        self.max_binding = bytes
            .min(self.limits.max_storage_buffer_binding_size)
            .max(4);
        self
    }

    /// A 4-bit linear whose weight is over the binding limit, as row pieces of W, each writing
    /// its columns of the output.
    #[allow(clippy::too_many_arguments)]
    fn linear_q4_pieces(
        &mut self,
        params: &[u32],
        ins: &[wgpu::BindingResource<'_>],
        v: &Q4View,
        out: wgpu::BindingResource<'_>,
        pool: &wgpu::Buffer,
        dummy: &wgpu::Buffer,
        uniform: &wgpu::Buffer,
    ) -> nibble_core::Result<()> {
        let (n, k, bs) = (v.shape[0] as u64, v.shape[1] as u64, v.blocksize as u64);
        let align = Backend::alignment(self).pool_bytes;
        let step = piece_step(k, bs, align).ok_or_else(|| {
            nibble_core::Error::Invalid(format!("wgpu: no aligned split of a [{n}, {k}] weight"))
        })?;
        let rows_fit = (self.max_binding * 2 / k.max(1)).min(self.max_binding / 4 * bs / k.max(1));
        let per = rows_fit / step * step;
        if per == 0 {
            return Err(nibble_core::Error::Invalid(format!(
                "wgpu: one aligned piece of {step} rows of the [{n}, {k}] weight exceeds the binding limit of {} bytes",
                self.max_binding
            )));
        }
        let rows = params[0];
        let mut r0 = 0u64;
        while r0 < n {
            let r1 = (r0 + per).min(n);
            let pn = (r1 - r0) as u32;
            let region = |offset: u64, len: u64| {
                wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: pool,
                    offset,
                    size: std::num::NonZeroU64::new(len.div_ceil(4).max(1) * 4),
                })
            };
            let packed = region(v.packed.offset + r0 * k / 2, ((r1 - r0) * k).div_ceil(2));
            let absmax = region(
                v.absmax.offset + r0 * k / bs * 4,
                ((r1 - r0) * k).div_ceil(bs) * 4,
            );
            let code = region(v.code.offset, 64);
            let mut p = params.to_vec();
            p[1] = pn;
            p[6] = r0 as u32;
            let (name, dispatch) = if rows > GEMV_MAX_ROWS {
                (
                    "linear_q4_tiled",
                    Dispatch::Groups(pn.div_ceil(16), rows.div_ceil(16)),
                )
            } else {
                ("linear_q4", Dispatch::Groups(rows * pn, 1))
            };
            let bias = ins
                .get(1)
                .cloned()
                .unwrap_or_else(|| dummy.as_entire_binding());
            let binds = vec![ins[0].clone(), packed, absmax, code, bias];
            let enc = self
                .encode(name, &p, binds, out.clone(), dispatch, uniform)
                .map_err(core_err)?;
            self.queue.submit([enc.finish()]);
            r0 = r1;
        }
        Ok(())
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

    fn supports(&self, op: &OpKind) -> bool {
        WgpuBackend::supports(self, op)
    }

    fn allocate(&mut self, arena_words: usize, pool_bytes: u64) -> nibble_core::Result<()> {
        let max = self.limits.max_buffer_size;
        let arena_bytes = (arena_words.max(1) * 4) as u64;
        for (what, b) in [
            ("activation arena", arena_bytes),
            ("weight pool", pool_bytes),
        ] {
            if b > max {
                return Err(nibble_core::Error::Invalid(format!(
                    "wgpu: the {what} needs {b} bytes, over this adapter's max_buffer_size {max}"
                )));
            }
        }
        let make = |label, size: u64, usage| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: size.max(4),
                usage,
                mapped_at_creation: false,
            })
        };
        let st = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC;
        self.resident = Some(Resident {
            arena: make("arena", arena_bytes, st),
            pool: make("weight pool", pool_bytes, st),
            uniform: make(
                "params",
                64,
                wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            ),
            dummy: make(
                "dummy",
                DUMMY_SLOTS * DUMMY_STRIDE,
                wgpu::BufferUsages::STORAGE,
            ),
        });
        Ok(())
    }

    fn release(&mut self) {
        if let Some(r) = self.resident.take() {
            r.arena.destroy();
            r.pool.destroy();
        }
    }

    fn alignment(&self) -> nibble_core::backend::Alignment {
        let a = self.limits.min_storage_buffer_offset_alignment.max(4);
        nibble_core::backend::Alignment {
            arena_words: (a / 4) as usize,
            pool_bytes: a as u64,
        }
    }

    fn write_arena(
        &mut self,
        dst: nibble_core::backend::ArenaSlice,
        words: &[u32],
    ) -> nibble_core::Result<()> {
        let r = self.resident()?;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.queue
            .write_buffer(&r.arena, dst.offset as u64 * 4, &bytes);
        Ok(())
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn read_arena(
        &mut self,
        src: nibble_core::backend::ArenaSlice,
    ) -> nibble_core::Result<Vec<u32>> {
        let r = self.resident()?;
        let bytes = self
            .read_back(&r.arena, src.offset as u64 * 4, (src.len.max(1) * 4) as u64)
            .map_err(core_err)?;
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
        let fut = self.resident().map(|r| {
            self.read_back_async(&r.arena, src.offset as u64 * 4, (src.len.max(1) * 4) as u64)
        });
        Box::pin(async move {
            let bytes = fut?.await.map_err(core_err)?;
            Ok(words(&bytes, src.len))
        })
    }

    fn upload(
        &mut self,
        offset: u64,
        bytes: &[u8],
    ) -> nibble_core::Result<Box<dyn nibble_core::stream::ring::Fence>> {
        let r = self.resident()?;
        if bytes.len() % 4 == 0 {
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
        let r = self.resident()?;
        let (arena, pool, uniform, dummy) = (
            r.arena.clone(),
            r.pool.clone(),
            r.uniform.clone(),
            r.dummy.clone(),
        );
        let slice = |s: &nibble_core::backend::ArenaSlice| {
            wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &arena,
                offset: s.offset as u64 * 4,
                size: std::num::NonZeroU64::new((s.len.max(1) * 4) as u64),
            })
        };
        let region = |p: &nibble_core::backend::PoolRegion| {
            wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &pool,
                offset: p.offset,
                size: std::num::NonZeroU64::new(p.len.div_ceil(4).max(1) * 4),
            })
        };
        let ins: Vec<wgpu::BindingResource<'_>> = inputs.iter().map(|o| slice(&o.slice)).collect();
        let q4b = q4.map(|v| [region(&v.packed), region(&v.absmax), region(&v.code)]);
        let shapes: Vec<Vec<usize>> = inputs.iter().map(|o| o.info.shape.clone()).collect();
        Self::check(op, &shapes)?;
        let bn = inputs.get(1).map(|o| o.info.numel()).unwrap_or(1);
        let (name, params, dispatch) = Self::kernel(
            op,
            &shapes,
            &out.info.shape,
            q4.map(|v| v.blocksize as u32).unwrap_or(0),
            bn,
        );
        // A dense weight over the binding limit (an lm_head, an embedding table) is bound as row
        // pieces; any other operand that large is refused.
        let splittable = matches!(op, OpKind::Linear { .. } | OpKind::Embedding);
        for (i, o) in inputs.iter().chain(std::iter::once(out)).enumerate() {
            let bytes = o.slice.len as u64 * 4;
            if bytes > self.max_binding && !(splittable && i == 1) {
                return Err(nibble_core::Error::Invalid(format!(
                    "wgpu {}: an operand of shape {:?} ({bytes} bytes) exceeds the adapter's storage binding limit of {} bytes",
                    op.name(),
                    o.info.shape,
                    self.max_binding
                )));
            }
        }
        if splittable && inputs[1].slice.len as u64 * 4 > self.max_binding {
            return self.dense_row_pieces(
                op,
                &params,
                inputs,
                &ins,
                slice(&out.slice),
                &arena,
                &dummy,
                &uniform,
            );
        }
        if let (OpKind::LinearQ4 { .. }, Some(v)) = (op, q4) {
            if v.packed.len > self.max_binding || v.absmax.len > self.max_binding {
                return self.linear_q4_pieces(
                    &params,
                    &ins,
                    v,
                    slice(&out.slice),
                    &pool,
                    &dummy,
                    &uniform,
                );
            }
        }
        let binds = Self::bind_order(op, &ins, q4b, &dummy);
        let enc = self
            .encode(name, &params, binds, slice(&out.slice), dispatch, &uniform)
            .map_err(core_err)?;
        self.queue.submit([enc.finish()]);
        Ok(())
    }
}

/// Distinct ranges of the dummy buffer for absent operands (256: the largest storage-offset
/// alignment an adapter may ask for).
const DUMMY_STRIDE: u64 = 256;
/// More than any kernel has optional operands.
const DUMMY_SLOTS: u64 = 4;

/// Little-endian words from read-back bytes.
fn words(bytes: &[u8], n: usize) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .take(n)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
