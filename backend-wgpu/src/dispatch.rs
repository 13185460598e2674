//! Launching kernels: which kernel and parameters an op takes, its bindings in the kernel's
//! order, weights over the binding limit in row pieces, and batching. Ops are recorded into one
//! pending command buffer, each with its parameters in its own slot of a uniform ring, and
//! submitted together when the executor writes the arena or the pool, reads back, or the ring
//! is full: about one submit per weight group instead of one per op.

use nibble_core::backend::{Operand, Q4View};
use nibble_core::graph::OpKind;

use crate::{core_err, Result, WgpuBackend, WgpuError, GEMV_MAX_ROWS};

/// How a kernel is launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dispatch {
    /// One invocation per item, 64 per workgroup.
    Threads(usize),
    /// Explicit workgroup counts.
    Groups(u32, u32),
}

/// Distinct ranges of the dummy buffer for absent operands (256: the largest storage-offset
/// alignment an adapter may ask for).
pub(crate) const DUMMY_STRIDE: u64 = 256;
/// More than any kernel has optional operands.
pub(crate) const DUMMY_SLOTS: u64 = 4;
/// Ops recorded between two submits at most (one uniform slot each).
pub(crate) const UNIFORM_SLOTS: u64 = 256;
/// Host bytes of `write_buffer` staging in flight at most (or one larger write), see
/// [`WgpuBackend::staging_room`].
pub const STAGING_BOUND: u64 = 32 << 20;
/// Uploads in wgpu's host staging memory: queued since the last submit, and per submission
/// not yet known to have run (oldest first).
#[derive(Debug, Default)]
pub(crate) struct Staging {
    unsubmitted: u64,
    submitted: std::collections::VecDeque<(wgpu::SubmissionIndex, u64)>,
}

/// Bytes of one op's parameters (16 words).
const PARAM_BYTES: u64 = 64;

impl WgpuBackend {
    /// Kernel, uniform words and dispatch size of `op` for these operand shapes.
    fn kernel(
        op: &OpKind,
        shapes: &[Vec<usize>],
        out: &[usize],
        q4_blocksize: u32,
        bn: usize,
    ) -> nibble_core::Result<(&'static str, Vec<u32>, Dispatch)> {
        let (name, params, threads) =
            nibble_core::backend::kernel_calls::call(op, shapes, out, q4_blocksize, bn)
                .map_err(|e| nibble_core::Error::Invalid(format!("wgpu {}: {e}", op.name())))?;
        if let OpKind::LinearQ4 { .. } = op {
            let (rows, n) = (out[0] as u32, out[1] as u32);
            // A GEMV (one workgroup per output) for decode-sized batches, 16 x 16 tiles above.
            if rows > GEMV_MAX_ROWS {
                return Ok((
                    "linear_q4_tiled",
                    params,
                    Dispatch::Groups(n.div_ceil(16), rows.div_ceil(16)),
                ));
            }
            return Ok((name, params, Dispatch::Groups(rows * n, 1)));
        }
        Ok((name, params, Dispatch::Threads(threads)))
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

    /// Writes an op's parameters (padded to 16 words) at `at` in `uniform` and returns their
    /// binding (binding 0 of every kernel).
    fn params_entry<'a>(
        &self,
        uniform: &'a wgpu::Buffer,
        at: u64,
        params: &[u32],
    ) -> wgpu::BindGroupEntry<'a> {
        let mut words = params.to_vec();
        words.resize((PARAM_BYTES / 4) as usize, 0);
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.queue.write_buffer(uniform, at, &bytes);
        wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: uniform,
                offset: at,
                size: std::num::NonZeroU64::new(PARAM_BYTES),
            }),
        }
    }

    /// Records one dispatch of kernel `name` with `params` into the pending command buffer; its
    /// parameters go into the next slot of the uniform ring (a full ring is submitted first).
    pub(crate) fn record(
        &mut self,
        name: &'static str,
        params: &[u32],
        binds: Vec<wgpu::BindingResource<'_>>,
        out: wgpu::BindingResource<'_>,
        dispatch: Dispatch,
    ) -> Result<()> {
        if self.pending_ops >= UNIFORM_SLOTS {
            self.flush()?;
        }
        let pipeline = self.pipeline(name)?;
        let uniform = self
            .resident
            .as_ref()
            .map(|r| r.uniform.clone())
            .ok_or_else(|| WgpuError::Gpu("allocate() was not called".into()))?;
        let stride = self.uniform_stride();
        let at = self.pending_ops * stride;
        let mut entries = vec![self.params_entry(&uniform, at, params)];
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
        let device = &self.device;
        let enc = self.pending.get_or_insert_with(|| {
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("ops") })
        });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(name),
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(gx, gy, 1);
        }
        self.pending_ops += 1;
        Ok(())
    }

    /// The kernels `graph` runs, once each: name, the parameters of its first op's shapes
    /// (4-bit blocksize 64) and its storage bindings. A 4-bit linear brings both its kernels:
    /// the GEMV for decode and the tiled one for larger batches; attention both of its own (per
    /// query row for few rows, blocked for more).
    pub(crate) fn graph_kernels(
        graph: &nibble_core::graph::Graph,
    ) -> Vec<(&'static str, Vec<u32>, usize)> {
        let mut seen = std::collections::BTreeSet::new();
        let mut kernels = Vec::new();
        for node in graph.nodes() {
            let shapes: Vec<Vec<usize>> = node
                .inputs
                .iter()
                .map(|v| graph.info(*v).shape.clone())
                .collect();
            let out = &graph.info(node.output).shape;
            let bn = shapes.get(1).map(|s| s.iter().product()).unwrap_or(1);
            // Sizes past the kernels' are refused by the plan; nothing to warm up for them.
            let Ok((name, params, _)) =
                nibble_core::backend::kernel_calls::call(&node.op, &shapes, out, 64, bn)
            else {
                continue;
            };
            let mut names = vec![name];
            match node.op {
                OpKind::LinearQ4 { .. } => names.push("linear_q4_tiled"),
                OpKind::Attention { .. } => names.extend(["attention", "attention_rows"]),
                _ => {}
            }
            let slots = nibble_core::backend::kernel_calls::operands(&node.op, shapes.len()).len();
            for name in names {
                if crate::shader_source(name).is_some() && seen.insert(name) {
                    kernels.push((name, params.clone(), slots + 1));
                }
            }
        }
        kernels
    }

    /// Launches one workgroup of each of `kernels` ([`WgpuBackend::graph_kernels`]) on
    /// scratch buffers, and waits for them. A driver may defer work to a kernel's first launch:
    /// lavapipe compiles a compute shader's machine code then (about 6 MiB of this process's
    /// RAM for a Llama's kernels), which would otherwise appear as growth during the first
    /// step, after the process's memory was measured for the plan. The parameters are those of
    /// the graph's own shapes, so every loop is as bounded as in a run; the scratch bindings
    /// are tiny, and WebGPU's bounds checks keep accesses beyond them inside them.
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn warm_up(&mut self, launches: &[(&'static str, Vec<u32>, usize)]) -> Result<()> {
        if launches.is_empty() {
            return Ok(());
        }
        let stride = DUMMY_STRIDE.max(self.limits.min_storage_buffer_offset_alignment as u64);
        let most = launches.iter().map(|l| l.2).max().unwrap_or(1) as u64;
        let scratch = self.create_buffer(
            "kernel warm-up scratch",
            most * stride,
            wgpu::BufferUsages::STORAGE,
        )?;
        let ustride = self.uniform_stride();
        let uniform = self.create_buffer(
            "kernel warm-up parameters",
            launches.len() as u64 * ustride,
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        )?;
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("warm-up"),
            });
        for (i, (name, params, bindings)) in launches.iter().enumerate() {
            let pipeline = self.pipeline(name)?;
            let mut entries = vec![self.params_entry(&uniform, i as u64 * ustride, params)];
            for k in 0..*bindings as u64 {
                entries.push(wgpu::BindGroupEntry {
                    binding: k as u32 + 1,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &scratch,
                        offset: k * stride,
                        size: std::num::NonZeroU64::new(stride),
                    }),
                });
            }
            let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("warm-up"),
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            });
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(name),
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(1, 1, 1);
        }
        let index = self.queue.submit(Some(enc.finish()));
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: None,
            })
            .map_err(|e| WgpuError::Gpu(e.to_string()))?;
        self.check_errors()
    }

    /// Submits the recorded ops. Called before anything that the queue would order before them
    /// (`write_buffer` takes effect at the start of the next submit), before read-backs, and when
    /// the uniform ring is full.
    pub(crate) fn flush(&mut self) -> Result<()> {
        if let Some(enc) = self.pending.take() {
            self.submit(Some(enc.finish()));
            self.submits += 1;
        }
        self.pending_ops = 0;
        self.check_errors()
    }

    /// Submits `cmd` (or only the queued writes), noting the staged bytes it carries.
    pub(crate) fn submit(&self, cmd: Option<wgpu::CommandBuffer>) {
        let mut st = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let index = self.queue.submit(cmd);
        if st.unsubmitted > 0 && cfg!(not(target_arch = "wasm32")) {
            let bytes = st.unsubmitted;
            st.submitted.push_back((index, bytes));
        }
        st.unsubmitted = 0;
    }

    /// Every submission has completed (a read-back waited for the device): no staging is held.
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn device_idle(&self) {
        self.staging
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .submitted
            .clear();
    }

    /// Makes room for a `write_buffer` of `bytes`. wgpu holds each write in host staging
    /// memory until the submission that carries it has run; unbounded, a resident load (many
    /// writes before the first submit) or a CPU running ahead of the device would hold them
    /// all. Where this write would take the staging past [`STAGING_BOUND`], the queued writes
    /// are submitted and the oldest submissions waited for, so that staging stays within the
    /// bound (or one larger write), which the plan counts as host memory. In the browser the
    /// staging is the browser's and cannot be waited for here.
    pub(crate) fn staging_room(&self, bytes: u64) -> Result<()> {
        let held = |s: &Staging| s.unsubmitted + s.submitted.iter().map(|x| x.1).sum::<u64>();
        {
            let mut st = self.staging.lock().unwrap_or_else(|e| e.into_inner());
            if cfg!(target_arch = "wasm32") || held(&st) + bytes <= STAGING_BOUND {
                st.unsubmitted += bytes;
                return Ok(());
            }
        }
        self.submit(None);
        loop {
            let index = {
                let mut st = self.staging.lock().unwrap_or_else(|e| e.into_inner());
                if held(&st) + bytes <= STAGING_BOUND {
                    break;
                }
                match st.submitted.pop_front() {
                    Some((index, _)) => index,
                    None => break,
                }
            };
            self.device
                .poll(wgpu::PollType::Wait {
                    submission_index: Some(index),
                    timeout: None,
                })
                .map_err(|e| WgpuError::Gpu(e.to_string()))?;
        }
        self.staging
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unsubmitted += bytes;
        self.check_errors()
    }

    /// Bytes between two ops' parameters in the uniform ring.
    pub(crate) fn uniform_stride(&self) -> u64 {
        (self.limits.min_uniform_buffer_offset_alignment as u64).max(PARAM_BYTES)
    }

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
    ) -> nibble_core::Result<()> {
        let w = &inputs[1];
        let (rows, k) = (w.info.shape[0] as u64, w.info.shape[1] as u64);
        let align = nibble_core::backend::Backend::device_info(self)
            .alignment
            .pool_bytes;
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
            self.record(name, &p, binds, out.clone(), Dispatch::Threads(threads))
                .map_err(core_err)?;
            r0 = r1;
        }
        Ok(())
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
    ) -> nibble_core::Result<()> {
        let (n, k, bs) = (v.shape[0] as u64, v.shape[1] as u64, v.blocksize as u64);
        let align = nibble_core::backend::Backend::device_info(self)
            .alignment
            .pool_bytes;
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
            self.record(name, &p, binds, out.clone(), dispatch)
                .map_err(core_err)?;
            r0 = r1;
        }
        Ok(())
    }

    /// Records `op` into the pending command buffer (see [`Backend::run`]).
    pub(crate) fn run_op(
        &mut self,
        op: &OpKind,
        inputs: &[Operand],
        q4: Option<&Q4View>,
        out: &Operand,
    ) -> nibble_core::Result<()> {
        let r = self.resident()?;
        let (arena, pool, dummy) = (r.arena.clone(), r.pool.clone(), r.dummy.clone());
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
        )?;
        // A dense weight over the binding limit (an lm_head, an embedding table) is bound as row
        // pieces; any other operand that large is refused.
        let splittable = matches!(op, OpKind::Linear { .. } | OpKind::Embedding);
        for (i, o) in inputs.iter().chain(std::iter::once(out)).enumerate() {
            let bytes = o.slice.len as u64 * 4;
            let at = (i < inputs.len()).then_some(i);
            let limit = self.operand_limit(op, at);
            if limit.is_some_and(|l| bytes > l) {
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
            );
        }
        if let (OpKind::LinearQ4 { .. }, Some(v)) = (op, q4) {
            if v.packed.len > self.max_binding || v.absmax.len > self.max_binding {
                return self.linear_q4_pieces(&params, &ins, v, slice(&out.slice), &pool, &dummy);
            }
        }
        let binds = Self::bind_order(op, &ins, q4b, &dummy);
        self.record(name, &params, binds, slice(&out.slice), dispatch)
            .map_err(core_err)
    }
}

/// Rows per piece must keep every piece's packed and absmax bindings at aligned offsets: the
/// smallest row count s with s*k a multiple of the blocksize and of 2, and s*k/2 and
/// s*k/blocksize*4 multiples of the offset alignment.
fn piece_step(k: u64, blocksize: u64, align: u64) -> Option<u64> {
    (1..=1u64 << 20).find(|&s| {
        let e = s * k;
        e.is_multiple_of(blocksize)
            && e.is_multiple_of(2)
            && (e / 2).is_multiple_of(align)
            && (e / blocksize * 4).is_multiple_of(align)
    })
}
