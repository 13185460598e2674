//! A video's frames written as they are decoded: the MP4 (`--out`) and the PNG frames
//! (`--frames-dir`) take each chunk of frames from the pipeline's `Event::Frames`, so a long
//! video is never held whole in memory on its way to disk.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::mp4::{Mp4Sink, Mp4Written};

/// Where a video's frames go; the files are created when the first frame comes.
pub struct FrameSink {
    mp4_path: Option<PathBuf>,
    fps: f64,
    mp4: Option<Mp4Sink>,
    dir: Option<PathBuf>,
    size: (usize, usize),
    pngs: Vec<String>,
    frames: usize,
    err: Option<anyhow::Error>,
}

/// What a [`FrameSink`] wrote.
#[derive(Debug, Default)]
pub struct FramesWritten {
    /// The MP4 and what it holds.
    pub mp4: Option<(PathBuf, Mp4Written)>,
    /// The PNG files, in order.
    pub pngs: Vec<String>,
}

impl FrameSink {
    /// A sink writing an MP4 at `mp4` (at `fps`) and/or PNGs into `dir`.
    pub fn new(mp4: Option<&Path>, fps: f64, dir: Option<&Path>) -> Self {
        FrameSink {
            mp4_path: mp4.map(Path::to_path_buf),
            fps,
            mp4: None,
            dir: dir.map(Path::to_path_buf),
            size: (0, 0),
            pngs: Vec::new(),
            frames: 0,
            err: None,
        }
    }

    /// Takes the frames `first..` (`[n, h, w, 3]` RGB); frames must come in order. The first
    /// error is kept for [`FrameSink::finish`] and later frames are dropped.
    pub fn take(&mut self, first: usize, (h, w): (usize, usize), rgb: &[u8]) {
        if self.err.is_some() {
            return;
        }
        if let Err(e) = self.write(first, (h, w), rgb) {
            self.err = Some(e);
        }
    }

    fn write(&mut self, first: usize, (h, w): (usize, usize), rgb: &[u8]) -> Result<()> {
        if self.frames == 0 {
            self.size = (h, w);
            if let Some(d) = &self.dir {
                std::fs::create_dir_all(d).with_context(|| d.display().to_string())?;
            }
            if let Some(p) = &self.mp4_path {
                self.mp4 = Some(
                    Mp4Sink::create(p, (h, w), self.fps)
                        .with_context(|| format!("writing the video {}", p.display()))?,
                );
            }
        } else if self.size != (h, w) {
            anyhow::bail!(
                "frames of {w} x {h} after frames of {} x {}",
                self.size.1,
                self.size.0
            );
        }
        if first != self.frames {
            anyhow::bail!("frame {first} came after {} frames", self.frames);
        }
        for frame in rgb.chunks_exact(h * w * 3) {
            if let Some(dir) = &self.dir {
                let path = dir.join(format!("frame_{:04}.png", self.frames));
                super::write_png(&path, frame, w, h)?;
                self.pngs.push(path.display().to_string());
            }
            if let (Some(path), Some(sink)) = (&self.mp4_path, &mut self.mp4) {
                sink.push(frame)
                    .with_context(|| format!("writing the video {}", path.display()))?;
            }
            self.frames += 1;
        }
        Ok(())
    }

    /// Closes the MP4; the first error met while writing, if any.
    pub fn finish(self) -> Result<FramesWritten> {
        if let Some(e) = self.err {
            return Err(e);
        }
        let mp4 = match (self.mp4_path, self.mp4) {
            (Some(path), Some(sink)) => {
                let w = sink
                    .finish()
                    .with_context(|| format!("writing the video {}", path.display()))?;
                Some((path, w))
            }
            _ => None,
        };
        Ok(FramesWritten {
            mp4,
            pngs: self.pngs,
        })
    }
}
