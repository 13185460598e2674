//! The device's own peaks, for the roofline `nibble bench kernels --backend wgpu` prints: an
//! FMA-bound shader (8 independent vec4 FMA chains per invocation) and a read stream (a sum over
//! a buffer of up to 256 MiB), each timed from submit to completion, best of three after a
//! warm-up, with the work doubled until a run takes at least 100 ms.

use std::time::Instant;

use crate::{Result, WgpuBackend, WgpuError};

/// The peak shaders (not graph ops): name and source.
pub const PEAK_SHADERS: [(&str, &str); 2] = [
    ("peak_fma", include_str!("../shaders/peaks/peak_fma.wgsl")),
    (
        "peak_stream",
        include_str!("../shaders/peaks/peak_stream.wgsl"),
    ),
];

/// Measured device peaks.
#[derive(Debug, Clone, Copy)]
pub struct DevicePeaks {
    /// f32 fused multiply-add throughput, GFLOP/s.
    pub fma_gflop_s: f64,
    /// Read bandwidth from a storage buffer, GB/s.
    pub read_gb_s: f64,
}

/// Workgroups per dispatch: within WebGPU's guaranteed 65535 per dimension, so never folded.
const WORKGROUPS: u32 = 4096;

/// One peak shader ready to run: its pipeline and bindings, built once.
struct PeakRun {
    name: &'static str,
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
}

impl WgpuBackend {
    /// Measures [`DevicePeaks`] on this adapter (seconds on a GPU; on a software renderer
    /// longer).
    pub fn measure_peaks(&mut self) -> Result<DevicePeaks> {
        use wgpu::BufferUsages as U;
        let invocations = u64::from(WORKGROUPS) * 64;
        let out = self.create_buffer("peak output", invocations * 4, U::STORAGE)?;
        let params = self.create_buffer("peak parameters", 16, U::UNIFORM | U::COPY_DST)?;
        // FMA: 64 FLOP per round per invocation.
        let fma_run = self.peak_run("peak_fma", &params, &[&out])?;
        let mut iters = 64u32;
        let fma = loop {
            let s = self.time_peak(&fma_run, &params, iters)?;
            if s >= 0.1 || iters >= 1 << 24 {
                let best = (0..2).try_fold(s, |b, _| {
                    self.time_peak(&fma_run, &params, iters).map(|t| b.min(t))
                })?;
                break invocations as f64 * f64::from(iters) * 64.0 / best / 1e9;
            }
            iters *= 2;
        };
        // Read stream: the largest buffer up to 256 MiB the adapter binds, whole vec4 rounds.
        let max = self
            .limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
            .min(256 << 20);
        let per = (max / 16 / invocations).max(1) as u32;
        let bytes = u64::from(per) * invocations * 16;
        let src = self.create_buffer("peak read buffer", bytes, U::STORAGE)?;
        let stream_run = self.peak_run("peak_stream", &params, &[&src, &out])?;
        let mut best = f64::MAX;
        let mut runs = 0;
        // A warm-up, then at least three runs and 100 ms in all.
        self.time_peak(&stream_run, &params, per)?;
        let mut total = 0.0;
        while runs < 3 || (total < 0.1 && runs < 64) {
            let s = self.time_peak(&stream_run, &params, per)?;
            best = best.min(s);
            total += s;
            runs += 1;
        }
        Ok(DevicePeaks {
            fma_gflop_s: fma,
            read_gb_s: bytes as f64 / best / 1e9,
        })
    }

    /// Compiles peak shader `name` and binds `params` and then `buffers` to it.
    fn peak_run(
        &self,
        name: &'static str,
        params: &wgpu::Buffer,
        buffers: &[&wgpu::Buffer],
    ) -> Result<PeakRun> {
        let src = PEAK_SHADERS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, s)| *s)
            .ok_or_else(|| WgpuError::Gpu(format!("no peak shader named {name}")))?;
        let pipeline = self.compile(name, src.to_string());
        let entries: Vec<wgpu::BindGroupEntry> = std::iter::once(params)
            .chain(buffers.iter().copied())
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: b.as_entire_binding(),
            })
            .collect();
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(name),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        Ok(PeakRun {
            name,
            pipeline,
            bind,
        })
    }

    /// Runs `run` once over [`WORKGROUPS`] workgroups with parameter `param` and returns the
    /// seconds from submit to completion.
    fn time_peak(&self, run: &PeakRun, params: &wgpu::Buffer, param: u32) -> Result<f64> {
        self.queue.write_buffer(
            params,
            0,
            &[param.to_le_bytes(), [0; 4], [0; 4], [0; 4]].concat(),
        );
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some(run.name),
            });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(run.name),
                timestamp_writes: None,
            });
            pass.set_pipeline(&run.pipeline);
            pass.set_bind_group(0, &run.bind, &[]);
            pass.dispatch_workgroups(WORKGROUPS, 1, 1);
        }
        let cmd = enc.finish();
        let t = Instant::now();
        let index = self.queue.submit(Some(cmd));
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: None,
            })
            .map_err(|e| WgpuError::Gpu(e.to_string()))?;
        let s = t.elapsed().as_secs_f64();
        self.check_errors()?;
        Ok(s)
    }
}
