//! Choosing a backend by name (`--backend auto|cpu|cpu-ref|wgpu|cuda`) and running generic code
//! on whichever was chosen. `auto` takes CUDA when a driver and device are present, then a wgpu
//! adapter that is a real GPU, then the optimized CPU backend, and says why it passed over each.

use anyhow::{bail, Result};
use nibble_core::backend::cpu::CpuBackend;
use nibble_core::backend::cpu_ref::CpuRefBackend;
use nibble_core::backend::Backend;

use crate::args::BackendArg;

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

/// The backend chosen; `auto` picks the best one present.
pub fn select(choice: BackendArg) -> Result<AnyBackend> {
    Ok(match choice {
        BackendArg::Cpu => AnyBackend::Cpu(CpuBackend::new()),
        BackendArg::CpuRef => AnyBackend::CpuRef(CpuRefBackend::new()),
        BackendArg::Wgpu => AnyBackend::Wgpu(Box::new(nibble_wgpu::WgpuBackend::new()?)),
        BackendArg::Cuda => AnyBackend::Cuda(Box::new(nibble_cuda::CudaBackend::new()?)),
        BackendArg::Auto => {
            match nibble_cuda::CudaBackend::new() {
                Ok(b) => return Ok(AnyBackend::Cuda(Box::new(b))),
                Err(e) => eprintln!("auto: no CUDA ({e})"),
            }
            match probe_wgpu() {
                Ok((name, false)) => match nibble_wgpu::WgpuBackend::new() {
                    Ok(b) => return Ok(AnyBackend::Wgpu(Box::new(b))),
                    Err(e) => eprintln!("auto: the wgpu adapter {name} did not open ({e})"),
                },
                Ok((name, true)) => eprintln!(
                    "auto: the wgpu adapter {name} is a CPU renderer; nibble's CPU backend is faster"
                ),
                Err(e) => eprintln!("auto: no wgpu GPU ({e})"),
            }
            AnyBackend::Cpu(CpuBackend::new())
        }
    })
}

/// The wgpu adapter's name and whether it is a software renderer, asked of a child process
/// (`nibble probe-wgpu`): even without a device, loading a software Vulkan driver leaves tens of
/// MiB mapped in the process that asked, which would count against the run's memory plan.
fn probe_wgpu() -> Result<(String, bool)> {
    let child = std::env::current_exe().ok().and_then(|exe| {
        std::process::Command::new(exe)
            .arg("probe-wgpu")
            .output()
            .ok()
    });
    if let Some(out) = child {
        if !out.status.success() {
            let msg = String::from_utf8_lossy(&out.stderr);
            bail!("{}", msg.trim().trim_start_matches("error: "));
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        return Ok((
            format!(
                "{} ({})",
                v["name"].as_str().unwrap_or("?"),
                v["backend"].as_str().unwrap_or("?")
            ),
            v["software"].as_bool().unwrap_or(true),
        ));
    }
    // No executable to spawn (embedded use): ask in this process.
    let info = nibble_wgpu::WgpuBackend::probe()?;
    Ok((
        format!("{} ({:?})", info.name, info.backend),
        info.device_type == nibble_wgpu::wgpu::DeviceType::Cpu,
    ))
}
