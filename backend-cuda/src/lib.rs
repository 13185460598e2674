//! nibble's CUDA backend. cudarc loads the driver, NVRTC and cuBLAS at run time, so this crate
//! builds and its tests pass on machines without CUDA; there [`CudaBackend::new`] answers
//! [`CudaError::NoDriver`] (checked before any CUDA call: cudarc panics when a library is
//! missing). Every op is a CUDA C kernel in `kernels/<op>.cu`, embedded with `include_str!` and
//! compiled by NVRTC for the device's architecture at first use, cached per module in memory and
//! on disk by source hash. Weights arrive through pinned ring slots, are copied on a copy stream
//! and the compute stream waits on the copy's event; the ring reuses a slot only after that event.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use nibble_core::backend::kernel_calls::{operands, Slot};
use nibble_core::backend::{
    ArenaSlice, Backend, DeviceInfo, DeviceKind, OpShapes, Operand, Q4View, Workspace,
};
use nibble_core::graph::OpKind;
use nibble_core::io::source::{SlotBuffer, SlotMemory};
use nibble_core::stream::ring::{Fence, SlotAllocator};

mod toolchain;
pub use toolchain::{bf16_bits, cublas_present, driver_present, missing_libraries, nvrtc_present};
use toolchain::{driver_version, nvrtc_version};

/// Every kernel: (file and entry-point name, CUDA C source).
pub const KERNELS: [(&str, &str); 30] = [
    (
        "adaln_modulate",
        include_str!("../kernels/adaln_modulate.cu"),
    ),
    ("add", include_str!("../kernels/add.cu")),
    ("attention", include_str!("../kernels/attention.cu")),
    (
        "attention_rows",
        include_str!("../kernels/attention_rows.cu"),
    ),
    ("cache_write", include_str!("../kernels/cache_write.cu")),
    ("concat", include_str!("../kernels/concat.cu")),
    ("conv2d", include_str!("../kernels/conv2d.cu")),
    ("dequant4", include_str!("../kernels/dequant4.cu")),
    ("dequant_bf16", include_str!("../kernels/dequant_bf16.cu")),
    ("embedding", include_str!("../kernels/embedding.cu")),
    ("gelu", include_str!("../kernels/gelu.cu")),
    ("gelu_tanh", include_str!("../kernels/gelu_tanh.cu")),
    ("group_norm", include_str!("../kernels/group_norm.cu")),
    ("layer_norm", include_str!("../kernels/layer_norm.cu")),
    ("linear", include_str!("../kernels/linear.cu")),
    ("linear_q4", include_str!("../kernels/linear_q4.cu")),
    ("matmul", include_str!("../kernels/matmul.cu")),
    ("mul", include_str!("../kernels/mul.cu")),
    ("permute", include_str!("../kernels/permute.cu")),
    ("quick_gelu", include_str!("../kernels/quick_gelu.cu")),
    ("reshape", include_str!("../kernels/reshape.cu")),
    ("rms_norm", include_str!("../kernels/rms_norm.cu")),
    ("rope", include_str!("../kernels/rope.cu")),
    ("scale", include_str!("../kernels/scale.cu")),
    ("silu", include_str!("../kernels/silu.cu")),
    ("slice", include_str!("../kernels/slice.cu")),
    ("softmax", include_str!("../kernels/softmax.cu")),
    (
        "timestep_embedding",
        include_str!("../kernels/timestep_embedding.cu"),
    ),
    ("to_bf16", include_str!("../kernels/to_bf16.cu")),
    ("upsample2x", include_str!("../kernels/upsample2x.cu")),
];

/// Rows up to which the 4-bit linear runs as the fused GEMV; above, it dequantizes to bf16 and
/// calls cuBLAS.
pub const GEMV_MAX_ROWS: usize = 8;

/// cuBLAS' workspace, given to it from the planned allocation: 32 MiB, what NVIDIA's cuBLAS
/// documentation recommends for Hopper (4 MiB suffice before it).
pub const CUBLAS_WORKSPACE_BYTES: u64 = 32 << 20;

/// What can go wrong in this backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable driver, NVRTC or device.
    #[error("no CUDA driver found: {0}")]
    NoDriver(String),
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A kernel did not compile.
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    /// cuBLAS failed.
    #[error("cuBLAS: {0}")]
    Blas(String),
}

impl From<CudaError> for nibble_core::Error {
    fn from(e: CudaError) -> Self {
        nibble_core::Error::Invalid(e.to_string())
    }
}

/// An event with timing recorded on `stream` now.
fn timing_event(stream: &CudaStream) -> Result<cudarc::driver::CudaEvent, CudaError> {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    stream.record_event(flags).map_err(drv)
}

/// Seconds of device time from `start` to the end of what `stream` has queued (waits for it).
fn seconds_since(start: &cudarc::driver::CudaEvent, stream: &CudaStream) -> Result<f64, CudaError> {
    let end = timing_event(stream)?;
    end.synchronize().map_err(drv)?;
    Ok(start.elapsed_ms(&end).map_err(drv)? as f64 / 1e3)
}

fn drv(e: impl std::fmt::Debug) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

/// Signals when a recorded CUDA event (an upload's copy) has completed.
struct EventFence(cudarc::driver::CudaEvent);

impl Fence for EventFence {
    fn is_signalled(&self) -> bool {
        self.0.is_complete()
    }
    fn wait(&self) {
        // An error here means the context is gone; the next CUDA call reports it.
        let _ = self.0.synchronize();
    }
}

/// A ring slot in page-locked host memory (so that copies run asynchronously at full speed).
struct PinnedSlot(cudarc::driver::PinnedHostSlice<u8>);

impl SlotMemory for PinnedSlot {
    fn bytes(&self) -> &[u8] {
        self.0.as_slice().unwrap_or(&[])
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.as_mut_slice().unwrap_or(&mut [])
    }
}

/// Allocates staging-ring slots in pinned host memory.
#[derive(Clone)]
pub struct PinnedAllocator(Arc<CudaContext>);

impl SlotAllocator for PinnedAllocator {
    fn allocate(&self, bytes: usize) -> nibble_core::Result<SlotBuffer> {
        // Cached (not write-combined) page-locked memory: the executor also reads slots on the
        // host (absmax, dense tensors), and reads of write-combined memory are uncached.
        // SAFETY: the memory is written by readers before anything reads it.
        let slice = unsafe { self.0.alloc_pinned_with_flags::<u8>(bytes, 0) }.map_err(drv)?;
        Ok(Box::new(PinnedSlot(slice)))
    }
}

/// The allocations (owned here so that they live as long as the backend) and their addresses.
struct Device {
    _arena: CudaSlice<u8>,
    _pool: CudaSlice<u8>,
    _dummy: CudaSlice<u8>,
    arena_ptr: u64,
    pool_ptr: u64,
    dummy_ptr: u64,
}

/// A CUDA device with its kernels, streams and memory.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    arch: String,
    name: String,
    /// NVRTC's and the driver's versions, for the log and the kernel cache key.
    nvrtc: (i32, i32),
    driver: (i32, i32),
    /// How the kernels were loaded so far: "CUBIN", or "PTX" when NVRTC could not make one.
    loaded_as: &'static str,
    functions: HashMap<&'static str, CudaFunction>,
    device: Option<Device>,
    blas: Option<cudarc::cublas::CudaBlas>,
    scratch: Option<(CudaSlice<u8>, u64)>,
    /// Per pool slot: the compute-stream event recorded after the last kernel that reads the
    /// slot's current group ([`Backend::group_used`]); the next group's uploads into the slot
    /// wait for it, and for nothing else, so they overlap the other slot's kernels.
    slot_free: [Option<cudarc::driver::CudaEvent>; 2],
    /// The slot the group being loaded goes into (`None`: a resident group's own regions).
    loading: Option<usize>,
    /// Per pool slot: a group was loaded into it and not yet marked used (a step that failed
    /// midway leaves it so).
    open: [bool; 2],
    /// The compute-stream event [`Backend::begin_timing`] recorded.
    timing: Option<cudarc::driver::CudaEvent>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBackend({}, {})", self.name, self.arch)
    }
}

impl CudaBackend {
    /// Opens device 0, or says why it cannot.
    pub fn new() -> Result<Self, CudaError> {
        let missing = missing_libraries();
        if !missing.is_empty() {
            return Err(CudaError::NoDriver(missing.join("; ")));
        }
        let nvrtc = nvrtc_version()?;
        let n = CudaContext::device_count().map_err(|e| CudaError::NoDriver(format!("{e:?}")))?;
        if n < 1 {
            return Err(CudaError::NoDriver(
                "the driver reports no CUDA device".into(),
            ));
        }
        let ctx = CudaContext::new(0).map_err(drv)?;
        let driver = driver_version()?;
        let (major, minor) = ctx.compute_capability().map_err(drv)?;
        let name = ctx.name().map_err(drv)?;
        let compute = ctx.default_stream();
        let copy = ctx.new_stream().map_err(drv)?;
        Ok(CudaBackend {
            ctx,
            compute,
            copy,
            arch: format!("sm_{major}{minor}"),
            name,
            nvrtc,
            driver,
            loaded_as: "CUBIN",
            functions: HashMap::new(),
            device: None,
            blas: None,
            scratch: None,
            slot_free: [None, None],
            loading: None,
            open: [false, false],
            timing: None,
        })
    }

    /// "name (sm_XY, driver CUDA a.b, NVRTC c.d, kernels as CUBIN)".
    pub fn describe(&self) -> String {
        format!(
            "{} ({}, driver CUDA {}.{}, NVRTC {}.{}, kernels as {})",
            self.name,
            self.arch,
            self.driver.0,
            self.driver.1,
            self.nvrtc.0,
            self.nvrtc.1,
            self.loaded_as
        )
    }

    /// Reference copy bandwidths on this device, for comparing kernels and the ring against:
    /// host-to-device from pinned memory (`bytes` per copy) and device-to-device (counted as
    /// bytes read plus bytes written, as NVIDIA's bandwidthTest does).
    pub fn bench_copies(&mut self, bytes: usize, iters: usize) -> Result<CopyBench, CudaError> {
        // SAFETY: the pinned buffer is written before any read of it matters (timing only).
        let host = unsafe { self.ctx.alloc_pinned::<u8>(bytes) }.map_err(drv)?;
        let a = self.copy.alloc_zeros::<u8>(bytes).map_err(drv)?;
        let b = self.copy.alloc_zeros::<u8>(bytes).map_err(drv)?;
        let (pa, _) = a.device_ptr(&self.copy);
        let (pb, _) = b.device_ptr(&self.copy);
        let host_slice = host
            .as_slice()
            .map_err(|e| CudaError::Driver(format!("{e:?}")))?;
        let time = |f: &mut dyn FnMut() -> Result<(), CudaError>| -> Result<f64, CudaError> {
            f()?; // warm-up
            let start = timing_event(&self.copy)?;
            for _ in 0..iters {
                f()?;
            }
            seconds_since(&start, &self.copy)
        };
        let stream = self.copy.cu_stream();
        // SAFETY: pointers and lengths are those of the buffers allocated above.
        let h2d = time(&mut || unsafe {
            cudarc::driver::result::memcpy_htod_async(pa, host_slice, stream).map_err(drv)
        })?;
        let d2d = time(&mut || unsafe {
            cudarc::driver::result::memcpy_dtod_async(pb, pa, bytes, stream).map_err(drv)
        })?;
        Ok(CopyBench {
            h2d_pinned_gb_s: (bytes * iters) as f64 / h2d / 1e9,
            d2d_gb_s: (2 * bytes * iters) as f64 / d2d / 1e9,
        })
    }

    /// cuBLAS bf16 x bf16 GEMM with f32 accumulation and f32 output, `Y[m, n] = X[m, k] W[n,
    /// k]^T` (the shape the 4-bit linear's many-row path hands to cuBLAS): TFLOP/s.
    pub fn bench_cublas_bf16(
        &mut self,
        m: usize,
        n: usize,
        k: usize,
        iters: usize,
    ) -> Result<f64, CudaError> {
        let x = self.compute.alloc_zeros::<u8>(m * k * 2).map_err(drv)?;
        let w = self.compute.alloc_zeros::<u8>(n * k * 2).map_err(drv)?;
        let y = self.compute.alloc_zeros::<u8>(m * n * 4).map_err(drv)?;
        let (px, _) = x.device_ptr(&self.compute);
        let (pw, _) = w.device_ptr(&self.compute);
        let (py, _) = y.device_ptr(&self.compute);
        self.gemm_bf16(pw, px, py, (m, n, k), None)?;
        let start = timing_event(&self.compute)?;
        for _ in 0..iters {
            self.gemm_bf16(pw, px, py, (m, n, k), None)?;
        }
        let s = seconds_since(&start, &self.compute)?;
        Ok(2.0 * (m * n * k * iters) as f64 / s / 1e12)
    }

    /// Allocator of pinned ring slots on this device's context.
    pub fn pinned_allocator(&self) -> PinnedAllocator {
        PinnedAllocator(self.ctx.clone())
    }

    fn function(&mut self, name: &'static str) -> Result<CudaFunction, CudaError> {
        if let Some(f) = self.functions.get(name) {
            return Ok(f.clone());
        }
        let src = KERNELS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, s)| *s)
            .ok_or_else(|| CudaError::Nvrtc(format!("no kernel named {name}")))?;
        let (image, kind) = toolchain::kernel_image(name, src, &self.arch, self.nvrtc)?;
        if kind == "PTX" {
            self.loaded_as = "PTX";
        }
        let module = self.ctx.load_module(image).map_err(drv)?;
        let f = module.load_function(name).map_err(drv)?;
        self.functions.insert(name, f.clone());
        Ok(f)
    }

    /// Makes this backend's context current on the calling thread: the raw driver and cuBLAS
    /// calls below (copies, GEMMs) act on the current context, and a backend may be driven from
    /// another thread than the one that made it (a server's model thread, a test's).
    fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(drv)
    }

    fn dev(&self) -> Result<&Device, CudaError> {
        self.device
            .as_ref()
            .ok_or_else(|| CudaError::Driver("allocate() was not called".into()))
    }

    fn launch(
        &mut self,
        name: &'static str,
        ptrs: &[u64],
        params: &[u32],
        cfg: LaunchConfig,
    ) -> Result<(), CudaError> {
        let f = self.function(name)?;
        let mut b = self.compute.launch_builder(&f);
        for p in ptrs {
            b.arg(p);
        }
        for p in params {
            b.arg(p);
        }
        // SAFETY: pointer arguments point into the arena / pool inside their allocations (the
        // executor placed every operand), and the argument lists follow the kernels' signatures
        // (nibble_core::backend::kernel_calls).
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    /// The planned GEMM workspace (allocated with the arena, [`CudaBackend::gemm_workspace`]):
    /// its first `bytes` for the GEMM's bf16 operands and cuBLAS' workspace at its end. It
    /// never grows: a GEMM the plan did not count is an error.
    fn scratch(&mut self, bytes: u64) -> Result<(u64, (u64, usize)), CudaError> {
        let Some((s, len)) = self.scratch.as_ref() else {
            return Err(CudaError::Driver(format!(
                "a GEMM needs {bytes} bytes of workspace, and the plan allocated none"
            )));
        };
        if bytes + CUBLAS_WORKSPACE_BYTES > *len {
            return Err(CudaError::Driver(format!(
                "a GEMM needs {} bytes of workspace, over the {len} the plan allocated",
                bytes + CUBLAS_WORKSPACE_BYTES
            )));
        }
        let (ptr, _sync) = s.device_ptr(&self.compute);
        let blas = ptr + len - CUBLAS_WORKSPACE_BYTES;
        Ok((ptr, (blas, CUBLAS_WORKSPACE_BYTES as usize)))
    }

    /// Device bytes a 4-bit linear over `rows` rows of a `[n, k]` weight takes beyond the arena
    /// and the pool: none on the GEMV path; the bf16 weight and activations and cuBLAS'
    /// workspace on the GEMM path.
    pub fn gemm_workspace(rows: usize, n: usize, k: usize) -> u64 {
        if rows <= GEMV_MAX_ROWS {
            return 0;
        }
        ((n * k + rows * k) * 2) as u64 + CUBLAS_WORKSPACE_BYTES
    }

    /// Many rows: dequantize W to bf16, convert x to bf16, cuBLAS GEMM with f32 accumulation
    /// into the f32 output, then the bias.
    fn linear_q4_gemm(
        &mut self,
        x: u64,
        rows: usize,
        v: &Q4View,
        bias: Option<u64>,
        out: u64,
    ) -> Result<(), CudaError> {
        let (n, k) = (v.shape[0], v.shape[1]);
        let pool = self.dev()?.pool_ptr;
        let w_bytes = (n * k * 2) as u64;
        let x_bytes = (rows * k * 2) as u64;
        let (scratch, blas_ws) = self.scratch(w_bytes + x_bytes)?;
        let (wb, xb) = (scratch, scratch + w_bytes);
        let grid = |items: usize| LaunchConfig {
            grid_dim: (items.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let total = (n * k) as u32;
        self.launch(
            "dequant_bf16",
            &[
                pool + v.packed.offset,
                pool + v.absmax.offset,
                pool + v.code.offset,
                wb,
            ],
            &[0, 0, total, v.blocksize as u32],
            grid(n * k),
        )?;
        self.launch("to_bf16", &[x, xb], &[(rows * k) as u32], grid(rows * k))?;
        self.gemm_bf16(wb, xb, out, (rows, n, k), Some(blas_ws))?;
        if let Some(b) = bias {
            self.launch(
                "add",
                &[out, b, out],
                &[(rows * n) as u32, n as u32],
                grid(rows * n),
            )?;
        }
        Ok(())
    }
}

impl CudaBackend {
    /// `out[rows, n] (f32) = x[rows, k] (bf16) * w[n, k]^T (bf16)` through cuBLAS, f32
    /// accumulation; cuBLAS works in `workspace` (pointer, bytes) where given (the plan's), so
    /// that it allocates nothing of its own per call.
    fn gemm_bf16(
        &mut self,
        w: u64,
        x: u64,
        out: u64,
        (rows, n, k): (usize, usize, usize),
        workspace: Option<(u64, usize)>,
    ) -> Result<(), CudaError> {
        if self.blas.is_none() {
            self.blas = Some(
                cudarc::cublas::CudaBlas::new(self.compute.clone())
                    .map_err(|e| CudaError::Blas(format!("{e:?}")))?,
            );
        }
        let blas = self
            .blas
            .as_ref()
            .ok_or_else(|| CudaError::Blas("no handle".into()))?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        use cudarc::cublas::sys;
        if let Some((ptr, len)) = workspace {
            // SAFETY: the workspace lies inside the planned allocation, which outlives the
            // handle's use of it (released only after the stream is synchronized).
            let status = unsafe { sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, len) };
            if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(CudaError::Blas(format!("cublasSetWorkspace: {status:?}")));
            }
        }
        // Row-major Y[rows, n] = X[rows, k] W[n, k]^T is column-major Y^T = W X^T.
        // SAFETY: the pointers address device memory of the sizes given.
        let status = unsafe {
            sys::cublasGemmEx(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                rows as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                x as *const _,
                sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const _,
                out as *mut _,
                sys::cudaDataType::CUDA_R_32F,
                n as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(CudaError::Blas(format!("{status:?}")));
        }
        Ok(())
    }
}

/// Reference copy bandwidths of a device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CopyBench {
    /// Host-to-device from page-locked memory, GB/s.
    pub h2d_pinned_gb_s: f64,
    /// Device-to-device, bytes read + written per second / 1e9.
    pub d2d_gb_s: f64,
}

/// Output columns one block of `linear_q4` computes: `LQ4_COLS_PER_BLOCK` in kernels/linear_q4.cu
/// (8 warps of 256 threads, 4 columns each); the grid is one block per that many columns.
pub const LINEAR_Q4_COLS_PER_BLOCK: usize = 32;
/// Threads per block of `linear_q4`: its `LQ4_THREADS` (a test reads both from the source).
pub const LINEAR_Q4_THREADS: u32 = 256;

fn launch_config(
    name: &str,
    op: &OpKind,
    shapes: &[Vec<usize>],
    out: &[usize],
    items: usize,
) -> LaunchConfig {
    let one_d = |items: usize, block: u32| LaunchConfig {
        grid_dim: (items.div_ceil(block as usize).max(1) as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    match (name, op) {
        // Blocks of 256 threads, each LINEAR_Q4_COLS_PER_BLOCK output columns for all rows
        // (out: [rows, n]).
        ("linear_q4", _) => LaunchConfig {
            grid_dim: (
                out[1].div_ceil(LINEAR_Q4_COLS_PER_BLOCK).max(1) as u32,
                1,
                1,
            ),
            block_dim: (LINEAR_Q4_THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
        // One warp per output.
        ("linear", _) => one_d(items * 32, 256),
        ("rms_norm" | "layer_norm" | "softmax", _) => LaunchConfig {
            grid_dim: (items.max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        },
        // `items` counts 64 lanes per group; one block of 256 per group.
        ("group_norm", _) => LaunchConfig {
            grid_dim: (items.div_ceil(64).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        },
        ("matmul", _) => LaunchConfig {
            grid_dim: (
                out[2].div_ceil(16) as u32,
                out[1].div_ceil(16) as u32,
                out[0] as u32,
            ),
            block_dim: (16, 16, 1),
            shared_mem_bytes: 0,
        },
        ("attention", _) => LaunchConfig {
            grid_dim: (shapes[0][1].div_ceil(64) as u32, shapes[0][0] as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        },
        ("attention_rows", _) => LaunchConfig {
            grid_dim: (shapes[0][1].div_ceil(4) as u32, shapes[0][0] as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        },
        _ => one_d(items, 256),
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda: {}", self.describe())
    }

    /// A discrete GPU whose driver tells its free memory; 256-byte alignment keeps 16-byte
    /// vector loads aligned.
    fn device_info(&self) -> DeviceInfo {
        DeviceInfo {
            kind: DeviceKind::DiscreteGpu,
            memory: self
                .ctx
                .mem_get_info()
                .ok()
                .map(|(free, total)| (free as u64, total as u64)),
            allocation_limit: None,
            max_binding: None,
            alignment: nibble_core::backend::Alignment {
                arena_words: 64,
                pool_bytes: 256,
            },
        }
    }

    /// A kernel for the op, sizes within the kernels' 32-bit parameters, and attention heads of
    /// at most 128 (the kernel's per-thread accumulator).
    fn supports(&self, o: &OpShapes<'_>) -> std::result::Result<(), String> {
        let kernel = match o.op {
            OpKind::Attention { .. } => true,
            op => KERNELS.iter().any(|(n, _)| *n == op.name()),
        };
        if !kernel {
            return Err("no CUDA kernel".into());
        }
        if let (OpKind::Attention { .. }, Some(q)) = (o.op, o.inputs.first()) {
            if q.shape.get(2).is_some_and(|&d| d > 128) {
                return Err(format!("head size {} is over the kernel's 128", q.shape[2]));
            }
        }
        let shapes: Vec<Vec<usize>> = o.inputs.iter().map(|i| i.shape.clone()).collect();
        nibble_core::backend::kernel_calls::fits_u32(&shapes, &o.out.shape)
    }

    /// The largest 4-bit linear on the GEMM path: its bf16 operands and cuBLAS' workspace.
    fn workspace(&self, ops: &[OpShapes<'_>]) -> Workspace {
        let device_bytes = ops
            .iter()
            .filter(|o| matches!(o.op, OpKind::LinearQ4 { .. }))
            .map(|o| {
                let x = &o.inputs[0].shape;
                let rows = x.first().copied().unwrap_or(0);
                let k = x.last().copied().unwrap_or(0);
                let n = o.out.shape.last().copied().unwrap_or(0);
                Self::gemm_workspace(rows, n, k)
            })
            .max()
            .unwrap_or(0);
        Workspace {
            host_bytes: 0,
            device_bytes,
        }
    }

    fn allocate(
        &mut self,
        arena_words: usize,
        pool_bytes: u64,
        workspace_bytes: u64,
    ) -> nibble_core::Result<()> {
        let arena = self
            .compute
            .alloc_zeros::<u8>(arena_words.max(1) * 4)
            .map_err(drv)?;
        let pool = self
            .compute
            .alloc_zeros::<u8>(pool_bytes.max(4) as usize)
            .map_err(drv)?;
        let dummy = self.compute.alloc_zeros::<u8>(256).map_err(drv)?;
        self.scratch = None;
        if workspace_bytes > 0 {
            let w = self
                .compute
                .alloc_zeros::<u8>(workspace_bytes as usize)
                .map_err(drv)?;
            self.scratch = Some((w, workspace_bytes));
        }
        // The zeroing was queued on the compute stream; uploads run on the copy stream, so they
        // wait for it (an upload racing the memset would be zeroed).
        let zeroed = self.compute.record_event(None).map_err(drv)?;
        self.copy.wait(&zeroed).map_err(drv)?;
        let arena_ptr = arena.device_ptr(&self.compute).0;
        let pool_ptr = pool.device_ptr(&self.compute).0;
        let dummy_ptr = dummy.device_ptr(&self.compute).0;
        self.device = Some(Device {
            _arena: arena,
            _pool: pool,
            _dummy: dummy,
            arena_ptr,
            pool_ptr,
            dummy_ptr,
        });
        Ok(())
    }

    fn begin_timing(&mut self) -> nibble_core::Result<()> {
        self.bind()?;
        self.timing = Some(timing_event(&self.compute)?);
        Ok(())
    }

    fn end_timing(&mut self) -> nibble_core::Result<Option<std::time::Duration>> {
        let Some(start) = self.timing.take() else {
            return Ok(None);
        };
        self.bind()?;
        let s = seconds_since(&start, &self.compute)?;
        Ok(Some(std::time::Duration::from_secs_f64(s)))
    }

    fn begin_group_load(&mut self, slot: Option<usize>) {
        self.loading = slot;
        if let Some(s) = slot.filter(|&s| s < 2) {
            if self.open[s] {
                // The slot's previous group was never marked used (its step failed midway):
                // wait for everything queued so far instead.
                self.group_used(s);
            }
            self.open[s] = true;
        }
    }

    fn group_used(&mut self, slot: usize) {
        if let Some(o) = self.open.get_mut(slot) {
            *o = false;
        }
        let _ = self.bind();
        // Without an event the next uploads into the slot would wait on nothing: failing to
        // record one takes the conservative order instead (everything queued so far done).
        let event = match self.compute.record_event(None) {
            Ok(e) => Some(e),
            Err(_) => {
                let _ = self.compute.synchronize();
                None
            }
        };
        if let Some(s) = self.slot_free.get_mut(slot) {
            *s = event;
        }
    }

    fn release(&mut self) {
        let _ = self.compute.synchronize();
        self.slot_free = [None, None];
        self.loading = None;
        self.open = [false, false];
        self.device = None;
        self.scratch = None;
    }

    fn slot_allocator(&self) -> Option<Box<dyn SlotAllocator>> {
        // Ring slots in page-locked memory: copies from them run asynchronously at full speed.
        Some(Box::new(self.pinned_allocator()))
    }

    fn write_arena(&mut self, dst: ArenaSlice, words: &[u32]) -> nibble_core::Result<()> {
        self.bind()?;
        let base = self.dev()?.arena_ptr;
        // SAFETY: dst lies inside the arena (placed by the executor).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                base + dst.offset as u64 * 4,
                words,
                self.compute.cu_stream(),
            )
        }
        .map_err(drv)?;
        // No synchronization: a copy from pageable memory returns once the source has been
        // staged (the caller may reuse `words`), and the kernels that read it are queued after
        // it on the same stream.
        Ok(())
    }

    fn read_arena(&mut self, src: ArenaSlice) -> nibble_core::Result<Vec<u32>> {
        self.bind()?;
        let base = self.dev()?.arena_ptr;
        let mut out = vec![0u32; src.len];
        // SAFETY: src lies inside the arena.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut out,
                base + src.offset as u64 * 4,
                self.compute.cu_stream(),
            )
        }
        .map_err(drv)?;
        self.compute.synchronize().map_err(drv)?;
        Ok(out)
    }

    fn upload(&mut self, offset: u64, bytes: &[u8]) -> nibble_core::Result<Box<dyn Fence>> {
        self.bind()?;
        let base = self.dev()?.pool_ptr;
        // The copy runs on the copy stream; the compute stream waits for it, and the ring waits
        // for the same event before it refills the slot.
        // A streamed group's slot may still be read by kernels queued on the compute stream for
        // the slot's previous group: the copy waits for the event after the last of them only,
        // so it overlaps the other slot's kernels.
        if let Some(e) = self.loading.and_then(|s| self.slot_free.get(s)?.as_ref()) {
            self.copy.wait(e).map_err(drv)?;
        }
        // SAFETY: the destination lies inside the pool; the source slot stays untouched until
        // the returned fence has signalled.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(base + offset, bytes, self.copy.cu_stream())
        }
        .map_err(drv)?;
        let event = self.copy.record_event(None).map_err(drv)?;
        self.compute.wait(&event).map_err(drv)?;
        Ok(Box::new(EventFence(event)))
    }

    fn run(
        &mut self,
        op: &OpKind,
        inputs: &[Operand],
        q4: Option<&Q4View>,
        out: &Operand,
    ) -> nibble_core::Result<()> {
        self.bind()?;
        let dev = self.dev()?;
        let (arena, pool, dummy) = (dev.arena_ptr, dev.pool_ptr, dev.dummy_ptr);
        let at = |o: &Operand| arena + o.slice.offset as u64 * 4;
        let shapes: Vec<Vec<usize>> = inputs.iter().map(|o| o.info.shape.clone()).collect();
        if let OpKind::Attention { .. } = op {
            if shapes[0][2] > 128 {
                return Err(nibble_core::Error::Invalid(format!(
                    "cuda attention: head dim {} is over 128",
                    shapes[0][2]
                )));
            }
        }
        if let (OpKind::LinearQ4 { bias }, Some(v)) = (op, q4) {
            if shapes[0][0] > GEMV_MAX_ROWS {
                let b = bias.then(|| at(&inputs[1]));
                return Ok(self.linear_q4_gemm(at(&inputs[0]), shapes[0][0], v, b, at(out))?);
            }
        }
        let bn = inputs.get(1).map(|o| o.info.numel()).unwrap_or(1);
        let (name, params, items) = nibble_core::backend::kernel_calls::call(
            op,
            &shapes,
            &out.info.shape,
            q4.map(|v| v.blocksize as u32).unwrap_or(0),
            bn,
        )
        .map_err(|e| nibble_core::Error::Invalid(format!("cuda {}: {e}", op.name())))?;
        let mut ptrs: Vec<u64> = operands(op, inputs.len())
            .into_iter()
            .map(|s| match (s, q4) {
                (Slot::Input(i), _) => at(&inputs[i]),
                (Slot::Packed, Some(v)) => pool + v.packed.offset,
                (Slot::Absmax, Some(v)) => pool + v.absmax.offset,
                (Slot::Code, Some(v)) => pool + v.code.offset,
                _ => dummy,
            })
            .collect();
        ptrs.push(at(out));
        let cfg = launch_config(name, op, &shapes, &out.info.shape, items);
        Ok(self.launch(name, &ptrs, &params, cfg)?)
    }
}
