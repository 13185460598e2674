//! Reading the arena back: a copy into a mappable buffer, mapped asynchronously (awaited in the
//! browser; natively the device is polled until it is done).

use crate::{Result, WgpuBackend, WgpuError};

impl WgpuBackend {
    /// Copies `bytes` of `src` into a mappable buffer and asks for its mapping; the returned
    /// future resolves once the device has finished (on an event loop: when the loop runs).
    pub(crate) fn read_back_async(
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
        self.submit(Some(enc.finish()));
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
        #[cfg(not(target_arch = "wasm32"))]
        self.device_idle();
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
    pub(crate) fn read_back(&self, src: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>> {
        pollster::block_on(self.read_back_async(src, offset, bytes))
    }
}

/// Little-endian words from read-back bytes.
pub(crate) fn words(bytes: &[u8], n: usize) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .take(n)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
