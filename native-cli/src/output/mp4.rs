//! A video's RGB frames to an MP4 file: H.264 (Constrained Baseline, 4:2:0, BT.709 limited range,
//! signalled in the stream's VUI) in an ISO MP4 container, which every browser and player opens.
//!
//! The encoder is Cisco's OpenH264 (the `openh264` crate, built from its bundled C++ source: no
//! external program or shared library at run time; it is the H.264 encoder Firefox and WebRTC
//! ship, BSD-licensed and maintained). The container is written by the `mp4` crate (pure Rust,
//! the most used MP4 muxer on crates.io). The RGB to YCbCr conversion is nibble's own, in plain
//! f32 arithmetic, so the bytes handed to the encoder do not depend on the CPU's instruction set;
//! the encoder runs on one thread at a constant QP of 26.

use anyhow::{anyhow, bail, Result};
use nibble_core::format::writer::OutputFile;
use openh264::encoder::{
    BitRate, Complexity, Encoder, EncoderConfig, FrameRate, IntraFramePeriod, QpRange,
    RateControlMode, UsageType, VuiConfig,
};
use openh264::formats::YUVBuffer;
use openh264::OpenH264API;

/// What an MP4 write produced.
#[derive(Debug, Clone, Copy)]
pub struct Mp4Written {
    pub frames: usize,
    pub bytes: u64,
}

/// BT.709 luma weights.
const KR: f32 = 0.2126;
const KB: f32 = 0.0722;

/// Converts one RGB frame (`h x w x 3`, `h` and `w` even) to planar YCbCr 4:2:0, BT.709 limited
/// range; each chroma sample from the mean of its 2 x 2 RGB pixels.
pub fn rgb_to_i420(rgb: &[u8], w: usize, h: usize) -> Vec<u8> {
    let kg = 1.0 - KR - KB;
    let luma = |r: f32, g: f32, b: f32| KR * r + kg * g + KB * b;
    let to_u8 = |v: f32| v.round().clamp(0.0, 255.0) as u8;
    let mut out = vec![0u8; w * h + 2 * (w / 2) * (h / 2)];
    let (y_plane, chroma) = out.split_at_mut(w * h);
    let (u_plane, v_plane) = chroma.split_at_mut((w / 2) * (h / 2));
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        let y = luma(px[0] as f32, px[1] as f32, px[2] as f32);
        y_plane[i] = to_u8(16.0 + y * (219.0 / 255.0));
    }
    for cy in 0..h / 2 {
        for cx in 0..w / 2 {
            let mut s = [0f32; 3];
            for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                let p = ((2 * cy + dy) * w + 2 * cx + dx) * 3;
                for c in 0..3 {
                    s[c] += rgb[p + c] as f32;
                }
            }
            let (r, g, b) = (s[0] / 4.0, s[1] / 4.0, s[2] / 4.0);
            let y = luma(r, g, b);
            let k = cy * (w / 2) + cx;
            u_plane[k] = to_u8(128.0 + (b - y) / (2.0 * (1.0 - KB)) * (224.0 / 255.0));
            v_plane[k] = to_u8(128.0 + (r - y) / (2.0 * (1.0 - KR)) * (224.0 / 255.0));
        }
    }
    out
}

/// Splits an Annex B byte stream into its NAL units (start codes removed).
fn nal_units(annex_b: &[u8]) -> Vec<&[u8]> {
    let mut starts = Vec::new();
    let mut i = 0;
    while i + 3 <= annex_b.len() {
        if annex_b[i] == 0 && annex_b[i + 1] == 0 && annex_b[i + 2] == 1 {
            starts.push(i + 3);
            i += 3;
        } else {
            i += 1;
        }
    }
    let mut nals = Vec::with_capacity(starts.len());
    for (k, &s) in starts.iter().enumerate() {
        let mut e = starts.get(k + 1).map_or(annex_b.len(), |&n| n - 3);
        // A four-byte start code leaves one zero behind the previous unit.
        while e > s && annex_b[e - 1] == 0 && k + 1 < starts.len() {
            e -= 1;
        }
        nals.push(&annex_b[s..e]);
    }
    nals
}

/// Refuses a frame rate an MP4 player would not take.
pub fn check_fps(fps: f64) -> Result<()> {
    if !(fps.is_finite() && (0.1..=240.0).contains(&fps)) {
        bail!("--fps {fps}: give a frame rate from 0.1 to 240");
    }
    Ok(())
}

/// Track timescale (ticks per second).
const TIMESCALE: u32 = 90_000;

/// An MP4 being written frame by frame, as the frames are decoded: only the encoder's state and
/// the sample table are kept, never the video.
pub struct Mp4Sink {
    path: std::path::PathBuf,
    size: (usize, usize),
    fps: f64,
    encoder: Encoder,
    mux: mp4::Mp4Writer<OutputFile>,
    frames: usize,
}

impl Mp4Sink {
    /// Creates `path` for frames of `h x w` at `fps`.
    pub fn create(path: &std::path::Path, (h, w): (usize, usize), fps: f64) -> Result<Self> {
        if h == 0 || w == 0 || h % 2 != 0 || w % 2 != 0 || h > u16::MAX as usize {
            bail!("an H.264 4:2:0 video needs even sizes up to 65535, not {w} x {h}");
        }
        if w > u16::MAX as usize {
            bail!("an H.264 4:2:0 video needs even sizes up to 65535, not {w} x {h}");
        }
        check_fps(fps)?;
        // OpenH264 with its rate control off: a constant QP of 26 (35 dB or more per plane on
        // the fixture's noise-like frames; real footage fares better). Lower QPs overflow its
        // 400-byte macroblock budget on the colour noise a random-weight model decodes (a
        // buffer-based rate control within QP 4 to 18 failed on 480p noise at the third frame),
        // and no frame may be skipped.
        let bps = ((w * h) as f64 * fps * 2.0).clamp(2e6, 2e9) as u32;
        let config = EncoderConfig::new()
            .usage_type(UsageType::CameraVideoRealTime)
            .rate_control_mode(RateControlMode::Off)
            .bitrate(BitRate::from_bps(bps))
            .max_frame_rate(FrameRate::from_hz(fps as f32))
            .qp(QpRange::new(4, 51))
            .skip_frames(false)
            .scene_change_detect(false)
            .background_detection(false)
            .adaptive_quantization(false)
            .complexity(Complexity::High)
            .intra_frame_period(IntraFramePeriod::from_num_frames(fps.ceil() as u32 * 2))
            .num_threads(1)
            .vui(VuiConfig::bt709());
        let encoder = Encoder::with_api_config(OpenH264API::from_source(), config)
            .map_err(|e| anyhow!("starting the H.264 encoder: {e}"))?;
        let file = OutputFile::create(path)?;
        let mp4_config = mp4::Mp4Config {
            major_brand: "isom".parse().map_err(|e| anyhow!("{e}"))?,
            minor_version: 512,
            compatible_brands: ["isom", "iso2", "avc1", "mp41"]
                .iter()
                .map(|b| b.parse().map_err(|e| anyhow!("{e}")))
                .collect::<Result<_>>()?,
            timescale: 1000,
        };
        let mux = mp4::Mp4Writer::write_start(file, &mp4_config)?;
        Ok(Mp4Sink {
            path: path.to_path_buf(),
            size: (h, w),
            fps,
            encoder,
            mux,
            frames: 0,
        })
    }

    /// Encodes and writes the next frame (`h x w x 3` RGB bytes).
    pub fn push(&mut self, rgb: &[u8]) -> Result<()> {
        let (h, w) = self.size;
        let k = self.frames;
        if rgb.len() != h * w * 3 {
            bail!(
                "frame {k}: {} bytes, not an RGB frame of {w} x {h}",
                rgb.len()
            );
        }
        let tick = |k: usize| ((k as f64) * TIMESCALE as f64 / self.fps).round() as u64;
        let yuv = rgb_to_i420(rgb, w, h);
        let stream = self
            .encoder
            .encode(&YUVBuffer::from_vec(yuv, w, h))
            .map_err(|e| anyhow!("encoding frame {k}: {e}"))?
            .to_vec();
        let (mut sps, mut pps, mut sample, mut sync) = (None, None, Vec::new(), false);
        for nal in nal_units(&stream) {
            match nal.first().map(|b| b & 0x1f) {
                Some(7) => sps = Some(nal.to_vec()),
                Some(8) => pps = Some(nal.to_vec()),
                Some(t) => {
                    sync |= t == 5;
                    sample.extend_from_slice(&(nal.len() as u32).to_be_bytes());
                    sample.extend_from_slice(nal);
                }
                None => {}
            }
        }
        if k == 0 {
            let (Some(sps), Some(pps)) = (sps, pps) else {
                bail!("the H.264 encoder's first frame carried no SPS/PPS");
            };
            self.mux.add_track(&mp4::TrackConfig {
                track_type: mp4::TrackType::Video,
                timescale: TIMESCALE,
                language: "und".into(),
                media_conf: mp4::MediaConfig::AvcConfig(mp4::AvcConfig {
                    width: w as u16,
                    height: h as u16,
                    seq_param_set: sps,
                    pic_param_set: pps,
                }),
            })?;
        }
        if sample.is_empty() {
            bail!("the H.264 encoder skipped frame {k}");
        }
        self.mux.write_sample(
            1,
            &mp4::Mp4Sample {
                start_time: tick(k),
                duration: (tick(k + 1) - tick(k)) as u32,
                rendering_offset: 0,
                is_sync: sync,
                bytes: sample.into(),
            },
        )?;
        self.frames += 1;
        Ok(())
    }

    /// Writes the sample table and closes the file.
    pub fn finish(mut self) -> Result<Mp4Written> {
        if self.frames == 0 {
            bail!("{}: no frame to write", self.path.display());
        }
        self.mux.write_end()?;
        let mut file = self.mux.into_writer();
        let bytes = std::io::Seek::seek(&mut file, std::io::SeekFrom::End(0))?;
        file.finish()?;
        Ok(Mp4Written {
            frames: self.frames,
            bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random-weight models decode colour noise, the hardest input an encoder gets: 480p noise
    /// frames (the first ones smooth, then noise) all encode.
    #[test]
    fn noise_frames_at_480p_encode() {
        let (h, w) = (480, 832);
        let dir = std::env::temp_dir().join(format!("nibble-mp4-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("noise.mp4");
        let mut sink = Mp4Sink::create(&path, (h, w), 16.0).expect("sink");
        let mut x = 12345u64;
        for k in 0..12 {
            let frame: Vec<u8> = (0..h * w * 3)
                .map(|i| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    if k < 2 {
                        (i % 251) as u8
                    } else {
                        (x >> 56) as u8
                    }
                })
                .collect();
            sink.push(&frame)
                .unwrap_or_else(|e| panic!("frame {k}: {e:#}"));
        }
        let done = sink.finish().expect("finish");
        assert_eq!(done.frames, 12);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn nal_units_split_three_and_four_byte_start_codes() {
        let s = [
            0, 0, 0, 1, 0x67, 1, 2, 0, 0, 1, 0x68, 3, 0, 0, 0, 1, 0x65, 4, 5,
        ];
        let n = nal_units(&s);
        assert_eq!(
            n,
            vec![&[0x67, 1, 2][..], &[0x68, 3][..], &[0x65, 4, 5][..]]
        );
    }

    #[test]
    fn bt709_limited_range_of_black_white_and_primaries() {
        // 2 x 2 of one colour: one chroma sample.
        let px = |r: u8, g: u8, b: u8| rgb_to_i420(&[r, g, b].repeat(4), 2, 2);
        assert_eq!(px(0, 0, 0), vec![16, 16, 16, 16, 128, 128]);
        assert_eq!(px(255, 255, 255), vec![235, 235, 235, 235, 128, 128]);
        // BT.709 red: Y 63, Cb 102, Cr 240 (ITU-R BT.709 table, 8-bit).
        assert_eq!(px(255, 0, 0), vec![63, 63, 63, 63, 102, 240]);
        assert_eq!(px(0, 0, 255), vec![32, 32, 32, 32, 240, 118]);
    }
}
