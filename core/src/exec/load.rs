//! Loading weight groups: each chunk that the prefetcher hands over (one ring slot) is placed
//! where the layout says: packed codes and code tables uploaded into the pool (or, on a backend
//! with host memory, lent to it in place from the slot), absmax and double-quantization parts
//! gathered in the group buffer and decoded into the pool when the group is complete, dense
//! weights written into the arena. A slot lent in place goes back to the ring after its group's
//! last op, and on every error path.

use std::collections::HashMap;

use super::{Executor, Naive};
use crate::backend::{ArenaSlice, Backend};
use crate::error::{Error, Result};
use crate::format::dtype::{widen_into, Dtype};
use crate::graph::{ElemType, ValueId};
use crate::io::source::ByteSource;
use crate::plan::Planner;
use crate::stream::prefetch::{Chunk, ChunkData, ChunkPart, ChunkSpec, Prefetcher, StepStats};
use crate::stream::ring::{Fence, SlotGuard};

/// What a tensor read feeds.
#[derive(Debug, Clone)]
pub(super) enum Role {
    Packed(usize),
    Absmax(usize),
    NestedAbsmax(usize),
    NestedMap(usize),
    QuantMap(usize),
    QuantState,
    Dense(ValueId, Dtype),
}

/// A filled ring slot kept out of the ring while the backend reads weights from it in place
/// ([`crate::backend::HostMemory::lend`]).
pub(super) struct Held {
    group: usize,
    offsets: Vec<u64>,
    slot: SlotGuard,
    fence: Option<Box<dyn Fence>>,
}

/// Per (group, tensor): what its bytes feed. A tensor of two groups (tied embeddings) has a role
/// in each.
pub(super) fn roles(planner: &Planner) -> HashMap<(usize, String), Role> {
    let g = planner.graph();
    let mut roles = HashMap::new();
    for (wi, (d, k)) in g.q4.iter().zip(planner.keys()).enumerate() {
        roles.insert((d.group, k.base.clone()), Role::Packed(wi));
        roles.insert((d.group, k.absmax.clone()), Role::Absmax(wi));
        roles.insert((d.group, k.quant_map.clone()), Role::QuantMap(wi));
        roles.insert((d.group, k.quant_state.clone()), Role::QuantState);
        if let (Some(a), Some(m)) = (&k.nested_absmax, &k.nested_quant_map) {
            roles.insert((d.group, a.clone()), Role::NestedAbsmax(wi));
            roles.insert((d.group, m.clone()), Role::NestedMap(wi));
        }
    }
    for (vi, s) in g.sources.iter().enumerate() {
        if let (crate::graph::Source::Dense { tensor, group }, Some(dtype)) =
            (s, planner.dense_dtypes()[vi])
        {
            roles.insert((*group, tensor.clone()), Role::Dense(ValueId(vi), dtype));
        }
    }
    roles
}

fn element_size(d: Dtype) -> usize {
    (crate::format::dtype::dtype_bits(d) / 8) as usize
}

impl<B: Backend> Executor<B> {
    /// Places one chunk's tensors: uploads (the fences of the uploads are pushed to `fences`,
    /// also those queued before an error), host-side quant-state parts, dense weights. With
    /// `lent`, a packed weight that lies whole in the chunk is lent to a host-memory backend in place (its pool offset is pushed to `lent`;
    /// the caller then keeps `data` unchanged until `end_lend`, and ends the lends itself if
    /// this returns an error).
    fn handle(
        &mut self,
        spec: &ChunkSpec,
        data: &[u8],
        mut lent: Option<&mut Vec<u64>>,
        fences: &mut Vec<Box<dyn Fence>>,
    ) -> Result<()> {
        let verify = !self.finite_seen[spec.group];
        for part in &spec.parts {
            let bytes = data
                .get(part.chunk_offset..part.chunk_offset + part.len)
                .ok_or_else(|| {
                    Error::Invalid(format!("{}: chunk shorter than its parts", part.tensor))
                })?;
            let at = part.tensor_offset as usize;
            let group_buf = &mut self.group_buf;
            let mut put = |r: &std::ops::Range<usize>| -> Result<()> {
                if r.len() as u64 != part.tensor_len || at + bytes.len() > r.len() {
                    return Err(Error::Invalid(format!(
                        "{}: {} bytes in the file, the quant state needs {}",
                        part.tensor,
                        part.tensor_len,
                        r.len()
                    )));
                }
                group_buf[r.start + at..r.start + at + bytes.len()].copy_from_slice(bytes);
                Ok(())
            };
            match self.roles.get(&(spec.group, part.tensor.clone())).cloned() {
                Some(Role::Packed(w)) => {
                    let at = self.lay.views[w].packed.offset;
                    let whole = part.tensor_offset == 0 && part.len as u64 == part.tensor_len;
                    let host = self.backend.host_memory();
                    match (lent.as_deref_mut(), host) {
                        (Some(list), Some(h)) if whole => {
                            // SAFETY: only `take_chunk` passes `lent`; it keeps the slot
                            // holding `data` out of the ring, unchanged, until `end_lend(at)`
                            // (on its error path too).
                            unsafe { h.lend(at, bytes) };
                            list.push(at);
                            self.in_place_bytes += bytes.len() as u64;
                        }
                        _ => fences.push(self.backend.upload(at + part.tensor_offset, bytes)?),
                    }
                }
                Some(Role::QuantMap(w)) => {
                    if verify {
                        finite_f32_bytes(bytes, &part.tensor)?;
                    }
                    fences.push(
                        self.backend
                            .upload(self.lay.views[w].code.offset + part.tensor_offset, bytes)?,
                    )
                }
                Some(Role::Absmax(w)) => put(&self.scratch[w].absmax)?,
                Some(Role::NestedAbsmax(w)) => put(&self.scratch[w].nested_absmax)?,
                Some(Role::NestedMap(w)) => put(&self.scratch[w].nested_map)?,
                Some(Role::QuantState) | None => {}
                Some(Role::Dense(v, dtype)) => {
                    self.write_dense(v, dtype, part, bytes)?;
                    if verify {
                        finite_stored(bytes, dtype, &part.tensor)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes a piece of a dense weight into its arena value: widened to f32 (straight into the
    /// arena on a host-memory backend), or as stored for a bf16 value.
    fn write_dense(
        &mut self,
        v: ValueId,
        dtype: Dtype,
        part: &ChunkPart,
        bytes: &[u8],
    ) -> Result<()> {
        let es = element_size(dtype);
        let at = part.tensor_offset as usize;
        if !at.is_multiple_of(es) || !bytes.len().is_multiple_of(es) {
            return Err(Error::Invalid(format!(
                "{}: a ring slot split an element; use a slot size that is a multiple of 8",
                part.tensor
            )));
        }
        let s = self.lay.slices[v.0].ok_or_else(|| Error::Invalid("unplaced weight".into()))?;
        let piece = ArenaSlice {
            offset: s.offset + at / es,
            len: bytes.len() / es,
        };
        let bf16 = self.graph.values[v.0].elem == ElemType::BF16;
        let not_floats = || {
            Error::Invalid(format!(
                "{}: {} bytes of {dtype:?} do not make {} floats",
                part.tensor,
                bytes.len(),
                piece.len
            ))
        };
        match self.backend.host_memory() {
            // As stored: the bytes go in as they are, at their element.
            Some(h) if bf16 => h.write_bf16(s, at / es, bytes),
            Some(h) => {
                let out = h.arena_f32_mut(piece)?;
                widen_into(bytes, dtype, out)
                    .then_some(())
                    .ok_or_else(not_floats)
            }
            None if bf16 => Err(Error::Invalid(format!(
                "{}: a bf16 value on a backend without host memory",
                part.tensor
            ))),
            None => {
                // In pieces, so that the host copies a dense weight takes on its way to the
                // device (widened floats, their words, the backend's own copy) stay within what
                // the plan counts for them, whatever the slot size.
                let n = crate::plan::DENSE_PIECE_WORDS;
                let mut vals = vec![0f32; piece.len.min(n)];
                for (k, b) in bytes.chunks(n * es).enumerate() {
                    let vals = &mut vals[..b.len() / es];
                    if !widen_into(b, dtype, vals) {
                        return Err(not_floats());
                    }
                    let words: Vec<u32> = vals.iter().map(|v| v.to_bits()).collect();
                    let dst = ArenaSlice {
                        offset: piece.offset + k * n,
                        len: words.len(),
                    };
                    self.backend.write_arena(dst, &words)?;
                }
                Ok(())
            }
        }
    }

    pub(super) fn load_group(
        &mut self,
        pf: &mut Prefetcher<Box<dyn ByteSource>>,
        g: usize,
    ) -> Result<()> {
        self.backend.begin_group_load(self.lay.slot_of(g));
        loop {
            if !pf.next_ready() {
                if let Some(h) = self.backend.host_memory() {
                    h.idle();
                }
            }
            let chunk = pf.next_chunk()?.ok_or_else(|| stream_ended(g))?;
            if self.take_chunk(pf, chunk, g)? {
                break;
            }
        }
        self.finish_group(g)
    }

    /// [`Executor::load_group`] on an event loop: each chunk is awaited, never waited for.
    pub(super) async fn load_group_async(
        &mut self,
        pf: &mut Prefetcher<Box<dyn ByteSource>>,
        g: usize,
    ) -> Result<()> {
        self.backend.begin_group_load(self.lay.slot_of(g));
        loop {
            pf.ready().await?;
            let chunk = pf.next_chunk()?.ok_or_else(|| stream_ended(g))?;
            if self.take_chunk(pf, chunk, g)? {
                break;
            }
        }
        self.finish_group(g)
    }

    /// Uploads one chunk of group `g` and releases its slot after the uploads; true when it
    /// was the group's last chunk.
    fn take_chunk(
        &mut self,
        pf: &Prefetcher<Box<dyn ByteSource>>,
        chunk: Chunk,
        g: usize,
    ) -> Result<bool> {
        let per = pf.chunks_per_step();
        let streamed = self.streamed_group.get(g) == Some(&true);
        if streamed {
            // One count per tier: where the chunk's bytes came from.
            let len = chunk.spec.len as u64;
            if chunk.held() {
                self.step_tier_bytes.1 += len;
            } else {
                self.step_tier_bytes.0 += len;
            }
        }
        if chunk.spec.group != g {
            return Err(Error::Invalid(format!(
                "stream out of order: expected group {g}, got {}",
                chunk.spec.group
            )));
        }
        let idx = (chunk.seq % per as u64) as usize;
        let last_of_group = idx + 1 == per || pf.chunk_spec(idx + 1).map(|c| c.group) != Some(g);
        let slot = match chunk.data {
            // A host-tier chunk is uploaded from the tier's memory: no copy into the slot (which
            // went back to the ring at once), and on CUDA a DMA from pinned memory. Host-tier
            // groups go to device backends only (a host-memory backend's device budget is the
            // host's memory): uploads, never lent.
            ChunkData::Held(held) => {
                let mut fences = Vec::new();
                let placed = self.handle(&chunk.spec, held.bytes(), None, &mut fences);
                // The tier's bytes never change: the fences matter only before its memory is
                // freed, and uploads complete in order, so the last one stands for all (on the
                // error path too: the copies queued before it still read the tier).
                if let (Some(f), Some(t)) = (fences.pop(), self.tier.as_mut()) {
                    t.fence = Some(f);
                }
                placed?;
                return Ok(last_of_group);
            }
            ChunkData::Slot(slot) => slot,
        };
        // Zero copy: the packed weights of a streamed group may be read from the slot in place;
        // the slot then stays out of the ring until the group's last op. At least one slot is
        // never held, so that the readers can always fill the chunk the executor waits for.
        let lend = self.host_memory && streamed && self.held.len() + 2 <= pf.ring().slots();
        let mut lent = Vec::new();
        let mut fences = Vec::new();
        let placed = self.handle(
            &chunk.spec,
            slot.bytes(),
            lend.then_some(&mut lent),
            &mut fences,
        );
        // Uploads from one slot complete in order: the last one frees the slot.
        let fence = fences.pop();
        if let Err(e) = placed {
            // Nothing reads the slot after the lends end and the uploads queued before the
            // error have run: then it goes back to the ring.
            self.end_lends(&lent);
            match fence {
                Some(f) => slot.release_after(f),
                None => drop(slot),
            }
            return Err(e);
        }
        if !lent.is_empty() {
            self.held.push(Held {
                group: g,
                offsets: lent,
                slot,
                fence,
            });
        } else {
            match fence {
                Some(f) => slot.release_after(f),
                None => drop(slot),
            }
        }
        Ok(last_of_group)
    }

    fn end_lends(&mut self, offsets: &[u64]) {
        if let Some(h) = self.backend.host_memory() {
            for &at in offsets {
                h.end_lend(at);
            }
        }
    }

    /// The naive offloader's way (for comparison, `ExecOptions::naive`): the group's tensors
    /// read synchronously into a buffer allocated for this load and dropped after it.
    pub(super) fn load_group_naive(&mut self, g: usize) -> Result<StepStats> {
        let Some(Naive { source }) = &self.naive else {
            return Err(Error::Invalid("not in naive mode".into()));
        };
        let source = source.clone();
        let tensors = self.lay.reads[g].clone();
        let total: u64 = tensors.iter().map(|t| t.len).sum();
        self.backend.begin_group_load(self.lay.slot_of(g));
        let t0 = web_time::Instant::now();
        let mut buf = vec![0u8; total as usize];
        let mut parts = Vec::with_capacity(tensors.len());
        let mut at = 0usize;
        for t in &tensors {
            source.read_exact_at(
                t.shard,
                t.offset,
                &mut buf[at..at + t.len as usize],
                &t.name,
            )?;
            parts.push(ChunkPart {
                tensor: t.name.clone(),
                tensor_offset: 0,
                tensor_len: t.len,
                chunk_offset: at,
                len: t.len as usize,
            });
            at += t.len as usize;
        }
        let read = t0.elapsed();
        let spec = ChunkSpec {
            group: g,
            file: 0,
            offset: 0,
            len: at,
            parts,
        };
        let mut fences = Vec::new();
        let placed = self.handle(&spec, &buf, None, &mut fences);
        // `buf` is dropped below: the copies from it must have run, on the error path too.
        for f in fences {
            f.wait();
        }
        placed?;
        drop(buf);
        self.finish_group(g)?;
        Ok(StepStats {
            bytes: total,
            stall: read,
            read_busy: read,
            ..Default::default()
        })
    }

    /// After a group's bytes arrived: undoes double quantization into the pool.
    fn finish_group(&mut self, g: usize) -> Result<()> {
        let verify = !self.finite_seen[g];
        // Double quantization undone on the host, bit-exactly, into the pool as f32 (the formula
        // of `QuantState::from_parts`; the quant state was checked when the run was planned).
        for wi in 0..self.graph.q4.len() {
            if self.graph.q4[wi].group != g {
                continue;
            }
            let sc = &self.scratch[wi];
            let (absmax, nested_absmax, nested_map) = (
                &self.group_buf[sc.absmax.clone()],
                &self.group_buf[sc.nested_absmax.clone()],
                &self.group_buf[sc.nested_map.clone()],
            );
            let st = &self.states[wi];
            let nblocks = st.num_blocks() as usize;
            let what = &self.graph.q4[wi].tensor;
            let bad = |e: &str| Error::Invalid(format!("{what}: {e}"));
            match &st.nested {
                None if absmax.len() != nblocks * 4 => {
                    return Err(bad(&format!(
                        "streamed absmax has {} bytes, expected {}",
                        absmax.len(),
                        nblocks * 4
                    )))
                }
                Some(n)
                    if absmax.len() != nblocks
                        || nested_absmax.len() != nblocks.div_ceil(n.blocksize as usize) * 4
                        || nested_map.len() != 256 * 4 =>
                {
                    return Err(bad(
                        "streamed double-quant state does not match the quant state",
                    ))
                }
                _ => {}
            }
            let region = self.lay.views[wi].absmax;
            // Host-memory pools are written in place; device pools get one upload.
            let mut buf = std::mem::take(&mut self.absmax_bytes);
            let host = self.backend.host_memory();
            let is_host = host.is_some();
            let out: &mut [u8] = match host {
                Some(h) => {
                    let s = h.pool_mut(region)?;
                    if s.len() < nblocks * 4 {
                        return Err(bad("the pool region is smaller than its absmax"));
                    }
                    s
                }
                None => {
                    buf.clear();
                    buf.resize(nblocks * 4, 0);
                    &mut buf
                }
            };
            match &st.nested {
                None => out[..nblocks * 4].copy_from_slice(absmax),
                Some(n) => {
                    let mut map = [0f32; 256];
                    let scales = &mut self.nested_scales;
                    scales.resize(nested_absmax.len() / 4, 0.0);
                    // The byte counts were checked above.
                    if !widen_into(nested_map, Dtype::F32, &mut map)
                        || !widen_into(nested_absmax, Dtype::F32, scales)
                    {
                        return Err(bad("streamed double-quant state is not f32"));
                    }
                    let out = &mut out[..nblocks * 4];
                    crate::format::bnb::undo_double_quant(
                        absmax,
                        &map,
                        scales,
                        n.blocksize as usize,
                        n.offset_f32(),
                        |j, a| out[4 * j..4 * j + 4].copy_from_slice(&a.to_le_bytes()),
                    );
                }
            }
            let r = if verify {
                let out: &[u8] = match self.backend.host_memory() {
                    Some(h) => h.pool_mut(region)?,
                    None => &buf,
                };
                finite_f32_bytes(&out[..nblocks * 4], &format!("{what} (its absmax)"))
            } else {
                Ok(())
            };
            let r = r.and_then(|()| {
                if is_host {
                    Ok(())
                } else {
                    self.backend.upload(region.offset, &buf).map(drop)
                }
            });
            self.absmax_bytes = buf;
            r?;
        }
        self.finite_seen[g] = true;
        Ok(())
    }

    /// Ends the in-place reads of held slots and returns those slots to the ring (after their
    /// uploads' fences), so that the readers may fill them at once: the slots of the groups
    /// whose last op in program `p` is node `n` for `after: Some((p, n))`, all for `None`.
    pub(super) fn release_held(&mut self, after: Option<(usize, usize)>) {
        let mut i = 0;
        let mut any = false;
        while i < self.held.len() {
            let done = match after {
                None => true,
                Some((p, n)) => self.group_last[p].get(self.held[i].group) == Some(&Some(n)),
            };
            if !done {
                i += 1;
                continue;
            }
            let h = self.held.swap_remove(i);
            self.end_lends(&h.offsets);
            match h.fence {
                Some(f) => h.slot.release_after(f),
                None => drop(h.slot),
            }
            any = true;
        }
        if any {
            if let Some(pf) = self.prefetch.as_mut() {
                // Starts the reads into the freed slots now, not at the next group's load.
                pf.next_ready();
            }
        }
    }
}

/// The stream ran out (its pass limit) before group `g` arrived: running on would compute with
/// whatever the pool region still holds.
fn stream_ended(g: usize) -> Error {
    Error::Invalid(format!(
        "the weight stream ended before group {g} was loaded (more steps than the stream was \
         limited to)"
    ))
}

/// A weight's stored values (f32, f16, bf16 little-endian) are finite, else an error naming it.
fn finite_stored(bytes: &[u8], dtype: Dtype, tensor: &str) -> Result<()> {
    // All exponent bits set is infinity or NaN in each format.
    let bad = match dtype {
        Dtype::F32 => return finite_f32_bytes(bytes, tensor),
        Dtype::F16 => |w: u16| w & 0x7c00 == 0x7c00,
        Dtype::BF16 => |w: u16| w & 0x7f80 == 0x7f80,
        _ => {
            // Other float widths (f64) are checked as they are widened to f32.
            let n = crate::format::dtype::dtype_bits(dtype) as usize / 8;
            if n == 0 || !bytes.len().is_multiple_of(n) {
                return Ok(());
            }
            let mut vals = vec![0f32; bytes.len() / n];
            if widen_into(bytes, dtype, &mut vals) {
                crate::error::check_finite(&vals, || {
                    format!("weight '{tensor}' as stored in the file (as f32)")
                })?;
            }
            return Ok(());
        }
    };
    let words = bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]));
    if !words.clone().any(bad) {
        return Ok(());
    }
    let mut vals = vec![0f32; bytes.len() / 2];
    if widen_into(&bytes[..vals.len() * 2], dtype, &mut vals) {
        crate::error::check_finite(&vals, || format!("weight '{tensor}' as stored in the file"))?;
    }
    Ok(())
}

/// f32 bytes are finite numbers, else an error naming `tensor`.
fn finite_f32_bytes(bytes: &[u8], tensor: &str) -> Result<()> {
    let vals: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    crate::error::check_finite(&vals, || format!("weight '{tensor}' as stored in the file"))
}
