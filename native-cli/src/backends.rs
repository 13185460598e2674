//! Choosing a backend by name (`--backend auto|cpu|cpu-ref|wgpu|cuda`) and running generic code
//! on whichever was chosen. `auto` takes CUDA when a driver and device are present, then a wgpu
//! adapter that is a real GPU, then the optimized CPU backend, and says why it passed over each.

use anyhow::{bail, Result};
use nibble_core::backend::{Backend, CpuRefBackend};
use nibble_core::cpu::CpuBackend;

/// One of the backends.
pub enum AnyBackend {
    /// The optimized CPU backend.
    Cpu(CpuBackend),
    /// The scalar reference.
    CpuRef(CpuRefBackend),
    /// wgpu (Vulkan, Metal, DX12; lavapipe on CPU-only Linux).
    Wgpu(Box<nibble_wgpu::WgpuBackend>),
    /// CUDA.
    Cuda(Box<nibble_cuda::CudaBackend>),
}

/// Code generic over the backend type.
pub trait WithBackend {
    /// What it returns.
    type Output;
    /// Runs on `backend`, named `label` in messages.
    fn call<B: Backend + 'static>(self, backend: B, label: &str) -> Result<Self::Output>;
}

impl AnyBackend {
    /// "cpu (2 threads, AVX2+FMA)", "wgpu: llvmpipe ...", "cuda: NVIDIA H200 (sm_90)".
    pub fn label(&self) -> String {
        match self {
            AnyBackend::Cpu(b) => format!("cpu ({})", b.describe()),
            AnyBackend::CpuRef(_) => "cpu-ref (scalar reference)".into(),
            AnyBackend::Wgpu(b) => format!("wgpu: {}", b.describe()),
            AnyBackend::Cuda(b) => format!("cuda: {}", b.describe()),
        }
    }

    /// Runs `w` on the chosen backend.
    pub fn run<W: WithBackend>(self, w: W) -> Result<W::Output> {
        let label = self.label();
        match self {
            AnyBackend::Cpu(b) => w.call(b, &label),
            AnyBackend::CpuRef(b) => w.call(b, &label),
            AnyBackend::Wgpu(b) => w.call(*b, &label),
            AnyBackend::Cuda(b) => w.call(*b, &label),
        }
    }
}

/// The backend named `name`; `auto` picks the best one present.
pub fn select(name: &str) -> Result<AnyBackend> {
    Ok(match name {
        "cpu" => AnyBackend::Cpu(CpuBackend::new()),
        "cpu-ref" | "cpu_ref" => AnyBackend::CpuRef(CpuRefBackend::new()),
        "wgpu" => AnyBackend::Wgpu(Box::new(nibble_wgpu::WgpuBackend::new()?)),
        "cuda" => AnyBackend::Cuda(Box::new(nibble_cuda::CudaBackend::new()?)),
        "auto" => {
            match nibble_cuda::CudaBackend::new() {
                Ok(b) => return Ok(AnyBackend::Cuda(Box::new(b))),
                Err(e) => eprintln!("auto: no CUDA ({e})"),
            }
            match nibble_wgpu::WgpuBackend::new() {
                Ok(b) if !b.is_software() => return Ok(AnyBackend::Wgpu(Box::new(b))),
                Ok(b) => eprintln!(
                    "auto: the wgpu adapter {} is a CPU renderer; nibble's CPU backend is faster",
                    b.describe()
                ),
                Err(e) => eprintln!("auto: no wgpu GPU ({e})"),
            }
            AnyBackend::Cpu(CpuBackend::new())
        }
        other => bail!("--backend '{other}': expected auto, cpu, cpu-ref, wgpu or cuda"),
    })
}
