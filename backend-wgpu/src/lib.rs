//! nibble's wgpu backend: every [`OpKind`] as a WGSL compute kernel in `shaders/<op>.wgsl`
//! (entry point named after the file), embedded with `include_str!` and compiled by wgpu at first
//! use. 4-bit weights stay packed on the device; the 4-bit linear dequantizes on the fly. Kernels
//! need neither subgroups nor shader-f16, so that every WebGPU browser can run them. Natively it
//! runs on Vulkan, Metal and DX12 (Mesa's lavapipe on CPU-only Linux); a machine without any
//! adapter gets [`WgpuError::NoAdapter`], never a panic.

use std::collections::HashMap;

use nibble_core::cpu_ref::Q4Ref;
use nibble_core::graph::{infer, HostData, HostTensor, OpKind, RopeMode};
use wgpu::util::DeviceExt;

/// Every kernel: (op name, WGSL source).
pub const SHADERS: [(&str, &str); 22] = [
    (
        "adaln_modulate",
        include_str!("../shaders/adaln_modulate.wgsl"),
    ),
    ("add", include_str!("../shaders/add.wgsl")),
    ("attention", include_str!("../shaders/attention.wgsl")),
    ("concat", include_str!("../shaders/concat.wgsl")),
    ("dequant4", include_str!("../shaders/dequant4.wgsl")),
    ("embedding", include_str!("../shaders/embedding.wgsl")),
    ("gelu", include_str!("../shaders/gelu.wgsl")),
    ("gelu_tanh", include_str!("../shaders/gelu_tanh.wgsl")),
    ("layer_norm", include_str!("../shaders/layer_norm.wgsl")),
    ("linear", include_str!("../shaders/linear.wgsl")),
    ("linear_q4", include_str!("../shaders/linear_q4.wgsl")),
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
}

impl std::fmt::Debug for WgpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WgpuBackend({})", self.describe())
    }
}

fn f(v: f32) -> u32 {
    v.to_bits()
}

impl WgpuBackend {
    /// Opens the best adapter present (a high-performance GPU if any, else a software one).
    pub fn new() -> Result<Self> {
        pollster::block_on(Self::new_async())
    }

    /// Async form of [`WgpuBackend::new`] (the browser cannot block).
    pub async fn new_async() -> Result<Self> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                force_fallback_adapter: false,
                compatible_surface: None,
                apply_limit_buckets: false,
            })
            .await
            .map_err(|e| WgpuError::NoAdapter(e.to_string()))?;
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
        Ok(WgpuBackend {
            device,
            queue,
            info,
            limits,
            pipelines: HashMap::new(),
        })
    }

    /// "name (backend, type)" of the adapter.
    pub fn describe(&self) -> String {
        format!(
            "{} ({:?}, {:?})",
            self.info.name, self.info.backend, self.info.device_type
        )
    }

    /// The device limits in force.
    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    /// Whether this backend runs `op` (every op today).
    pub fn supports(&self, op: &OpKind) -> bool {
        SHADERS.iter().any(|(n, _)| *n == op.name())
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

    fn storage(&self, bytes: &[u8]) -> Result<wgpu::Buffer> {
        if bytes.len() as u64 > self.limits.max_storage_buffer_binding_size {
            return Err(WgpuError::Gpu(format!(
                "a {}-byte buffer exceeds this adapter's max_storage_buffer_binding_size ({})",
                bytes.len(),
                self.limits.max_storage_buffer_binding_size
            )));
        }
        // Bindings must not be empty and are read as 4-byte words.
        let mut padded;
        let data = if bytes.is_empty() || bytes.len() % 4 != 0 {
            padded = bytes.to_vec();
            padded.resize(bytes.len().max(4).div_ceil(4) * 4, 0);
            &padded[..]
        } else {
            bytes
        };
        Ok(self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: data,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            }))
    }

    fn f32_buf(&self, v: &[f32]) -> Result<wgpu::Buffer> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.storage(&bytes)
    }

    /// Runs kernel `name` with uniform `params`, storage inputs, and an f32 output of `out_len`
    /// elements, over `threads` invocations; returns the output.
    fn dispatch(
        &mut self,
        name: &'static str,
        params: &[u32],
        inputs: &[&wgpu::Buffer],
        out_len: usize,
        threads: usize,
    ) -> Result<Vec<f32>> {
        let pipeline = self.pipeline(name)?;
        let mut words = params.to_vec();
        words.resize(params.len().div_ceil(4).max(1) * 4, 0);
        let uniform_bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let uniform = self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("params"),
                contents: &uniform_bytes,
                usage: wgpu::BufferUsages::UNIFORM,
            });
        let out_bytes = (out_len.max(1) * 4) as u64;
        if out_bytes > self.limits.max_storage_buffer_binding_size {
            return Err(WgpuError::Gpu(format!(
                "output of {out_bytes} bytes exceeds the binding limit"
            )));
        }
        let out = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("out"),
            size: out_bytes,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: out_bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: uniform.as_entire_binding(),
        }];
        for (i, b) in inputs.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: b.as_entire_binding(),
            });
        }
        entries.push(wgpu::BindGroupEntry {
            binding: inputs.len() as u32 + 1,
            resource: out.as_entire_binding(),
        });
        let layout = pipeline.get_bind_group_layout(0);
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        });
        let groups = threads.div_ceil(64).max(1) as u32;
        let max = self.limits.max_compute_workgroups_per_dimension.max(1);
        let (gx, gy) = if groups <= max {
            (groups, 1)
        } else {
            (max, groups.div_ceil(max))
        };
        if gy > max {
            return Err(WgpuError::Gpu(format!(
                "{threads} invocations exceed the dispatch limit"
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
        enc.copy_buffer_to_buffer(&out, 0, &readback, 0, out_bytes);
        self.queue.submit([enc.finish()]);
        let slice = readback.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| WgpuError::Gpu(e.to_string()))?;
        rx.recv()
            .map_err(|e| WgpuError::Gpu(e.to_string()))?
            .map_err(|e| WgpuError::Gpu(e.to_string()))?;
        let view = slice
            .get_mapped_range()
            .map_err(|e| WgpuError::Gpu(e.to_string()))?;
        let mut v: Vec<f32> = view
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        drop(view);
        readback.unmap();
        v.truncate(out_len);
        Ok(v)
    }

    fn q4_buffers(&self, q: &Q4Ref<'_>) -> Result<[wgpu::Buffer; 3]> {
        Ok([
            self.storage(q.packed)?,
            self.f32_buf(&q.state.absmax)?,
            self.f32_buf(&q.state.code)?,
        ])
    }

    /// Runs one op with host inputs and returns the host output (uploads, dispatch, download).
    pub fn run(
        &mut self,
        op: &OpKind,
        inputs: &[&HostTensor],
        q4: Option<Q4Ref<'_>>,
    ) -> Result<HostTensor> {
        let infos: Vec<_> = inputs.iter().map(|t| &t.info).collect();
        let q4info = q4.map(|q| q.info());
        let out_info = infer(op, &infos, q4info.as_ref())?;
        let n = out_info.numel();
        let shape = |i: usize| inputs[i].info.shape.clone();
        let mut bufs = Vec::with_capacity(inputs.len());
        for t in inputs {
            bufs.push(match &t.data {
                HostData::F32(v) => self.f32_buf(v)?,
                HostData::U32(v) => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    self.storage(&bytes)?
                }
            });
        }
        let dummy = self.storage(&[0u8; 4])?;
        let last = |i: usize| *inputs[i].info.shape.last().unwrap_or(&1) as u32;
        let name = match op {
            OpKind::Dequant4 => "dequant4",
            OpKind::LinearQ4 { .. } => "linear_q4",
            OpKind::Linear { .. } => "linear",
            OpKind::MatMul { .. } => "matmul",
            OpKind::Add => "add",
            OpKind::Mul => "mul",
            OpKind::Scale { .. } => "scale",
            OpKind::RmsNorm { .. } => "rms_norm",
            OpKind::LayerNorm { .. } => "layer_norm",
            OpKind::Silu => "silu",
            OpKind::Gelu => "gelu",
            OpKind::GeluTanh => "gelu_tanh",
            OpKind::Softmax => "softmax",
            OpKind::Rope { .. } => "rope",
            OpKind::Attention { .. } => "attention",
            OpKind::Embedding => "embedding",
            OpKind::Concat { .. } => "concat",
            OpKind::Slice { .. } => "slice",
            OpKind::Permute { .. } => "permute",
            OpKind::Reshape { .. } => "reshape",
            OpKind::AdaLnModulate => "adaln_modulate",
            OpKind::TimestepEmbedding { .. } => "timestep_embedding",
        };
        let out = match op {
            OpKind::Dequant4 => {
                let q = q4.ok_or_else(|| WgpuError::Gpu("dequant4 needs a weight".into()))?;
                let [p, a, c] = self.q4_buffers(&q)?;
                self.dispatch(
                    name,
                    &[n as u32, q.state.json.blocksize as u32],
                    &[&p, &a, &c],
                    n,
                    n,
                )?
            }
            OpKind::LinearQ4 { bias } => {
                let q = q4.ok_or_else(|| WgpuError::Gpu("linear_q4 needs a weight".into()))?;
                let [p, a, c] = self.q4_buffers(&q)?;
                let (rows, k) = (shape(0)[0] as u32, shape(0)[1] as u32);
                let nn = out_info.shape[1] as u32;
                let b = if *bias { &bufs[1] } else { &dummy };
                let params = [rows, nn, k, q.state.json.blocksize as u32, *bias as u32];
                self.dispatch(name, &params, &[&bufs[0], &p, &a, &c, b], n, n)?
            }
            OpKind::Linear { bias } => {
                let (rows, k) = (shape(0)[0] as u32, shape(0)[1] as u32);
                let nn = shape(1)[0] as u32;
                let b = if *bias { &bufs[2] } else { &dummy };
                self.dispatch(
                    name,
                    &[rows, nn, k, *bias as u32],
                    &[&bufs[0], &bufs[1], b],
                    n,
                    n,
                )?
            }
            OpKind::MatMul { transpose_b } => {
                let a = shape(0);
                let params = [
                    a[0] as u32,
                    a[1] as u32,
                    out_info.shape[2] as u32,
                    a[2] as u32,
                    *transpose_b as u32,
                ];
                self.dispatch(name, &params, &[&bufs[0], &bufs[1]], n, n)?
            }
            OpKind::Add | OpKind::Mul => {
                let bn = inputs[1].info.numel() as u32;
                self.dispatch(name, &[n as u32, bn], &[&bufs[0], &bufs[1]], n, n)?
            }
            OpKind::Scale { factor } => {
                self.dispatch(name, &[n as u32, f(*factor)], &[&bufs[0]], n, n)?
            }
            OpKind::Silu | OpKind::Gelu | OpKind::GeluTanh | OpKind::Reshape { .. } => {
                self.dispatch(name, &[n as u32], &[&bufs[0]], n, n)?
            }
            OpKind::RmsNorm { eps } => {
                let d = last(0);
                let rows = n as u32 / d.max(1);
                self.dispatch(
                    name,
                    &[rows, d, f(*eps)],
                    &[&bufs[0], &bufs[1]],
                    n,
                    rows as usize,
                )?
            }
            OpKind::LayerNorm { eps, affine } => {
                let d = last(0);
                let rows = n as u32 / d.max(1);
                let (w, b) = if *affine {
                    (&bufs[1], &bufs[2])
                } else {
                    (&dummy, &dummy)
                };
                self.dispatch(
                    name,
                    &[rows, d, f(*eps), *affine as u32],
                    &[&bufs[0], w, b],
                    n,
                    rows as usize,
                )?
            }
            OpKind::Softmax => {
                let d = last(0);
                let rows = n as u32 / d.max(1);
                self.dispatch(name, &[rows, d], &[&bufs[0]], n, rows as usize)?
            }
            OpKind::Rope { mode } => {
                let s = shape(0);
                let m = match mode {
                    RopeMode::RotateHalf => 0,
                    RopeMode::Interleaved => 1,
                };
                let params = [s[0] as u32, s[1] as u32, s[2] as u32, m];
                self.dispatch(name, &params, &[&bufs[0], &bufs[1], &bufs[2]], n, n / 2)?
            }
            OpKind::Attention {
                causal,
                scale,
                key_mask,
            } => {
                let (q, k) = (shape(0), shape(1));
                let mask = if *key_mask { &bufs[3] } else { &dummy };
                let params = [
                    q[0] as u32,
                    k[0] as u32,
                    q[1] as u32,
                    k[1] as u32,
                    q[2] as u32,
                    *causal as u32,
                    *key_mask as u32,
                    f(*scale),
                ];
                self.dispatch(name, &params, &[&bufs[0], &bufs[1], &bufs[2], mask], n, n)?
            }
            OpKind::Embedding => {
                let vocab = shape(1)[0];
                if let Some(bad) = inputs[0].as_u32().iter().find(|&&id| id as usize >= vocab) {
                    return Err(nibble_core::Error::Invalid(format!(
                        "embedding: token id {bad} is outside the vocabulary of {vocab}"
                    ))
                    .into());
                }
                let params = [shape(0)[0] as u32, shape(1)[1] as u32];
                self.dispatch(name, &params, &[&bufs[0], &bufs[1]], n, n)?
            }
            OpKind::Concat { axis } => {
                let outer: usize = shape(0)[..*axis].iter().product();
                let ia: usize = shape(0)[*axis..].iter().product();
                let ib: usize = shape(1)[*axis..].iter().product();
                self.dispatch(
                    name,
                    &[outer as u32, ia as u32, ib as u32],
                    &[&bufs[0], &bufs[1]],
                    n,
                    n,
                )?
            }
            OpKind::Slice { axis, start, len } => {
                let s = shape(0);
                let outer: usize = s[..*axis].iter().product();
                let inner: usize = s[*axis + 1..].iter().product();
                let params = [
                    outer as u32,
                    s[*axis] as u32,
                    *start as u32,
                    *len as u32,
                    inner as u32,
                ];
                self.dispatch(name, &params, &[&bufs[0]], n, n)?
            }
            OpKind::Permute { perm } => {
                let s = shape(0);
                let rank = s.len();
                let mut strides = vec![1usize; rank];
                for i in (0..rank.saturating_sub(1)).rev() {
                    strides[i] = strides[i + 1] * s[i + 1];
                }
                // Pad to rank 4 with leading size-1 axes.
                let pad = 4 - rank;
                let mut dims = [1u32; 4];
                let mut src = [0u32; 4];
                for (i, &p) in perm.iter().enumerate() {
                    dims[pad + i] = s[p] as u32;
                    src[pad + i] = strides[p] as u32;
                }
                let params = [
                    n as u32, dims[0], dims[1], dims[2], dims[3], src[0], src[1], src[2], src[3],
                ];
                self.dispatch(name, &params, &[&bufs[0]], n, n)?
            }
            OpKind::AdaLnModulate => {
                let d = last(0);
                self.dispatch(name, &[n as u32, d], &[&bufs[0], &bufs[1], &bufs[2]], n, n)?
            }
            OpKind::TimestepEmbedding {
                dim,
                flip_sin_to_cos,
                downscale_freq_shift,
                scale,
                max_period,
            } => {
                let params = [
                    shape(0)[0] as u32,
                    *dim as u32,
                    *flip_sin_to_cos as u32,
                    f(*downscale_freq_shift),
                    f(*scale),
                    f(*max_period),
                ];
                self.dispatch(name, &params, &[&bufs[0]], n, n)?
            }
        };
        Ok(HostTensor::f32(&out_info.shape, out)?)
    }
}
