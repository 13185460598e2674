//! Reading back an MP4 that nibble wrote: the container parsed by the `mp4` crate's reader, the
//! H.264 stream decoded by OpenH264's decoder (a full decoder, independent of the encoder's
//! settings), the 4:2:0 planes turned into RGB with the BT.709 limited-range matrix the stream's
//! VUI declares (its own arithmetic here, not the writer's), and PSNR against reference frames.

/// A decoded MP4 video track.
#[derive(Debug)]
pub struct DecodedVideo {
    pub width: usize,
    pub height: usize,
    /// The track's frames per second (samples over duration).
    pub fps: f64,
    /// RGB frames, `height x width x 3` each.
    pub frames: Vec<Vec<u8>>,
    /// The decoded planes of each frame: Y (`height x width`), Cb and Cr (half size each way).
    pub planes: Vec<[Vec<u8>; 3]>,
    /// The sample description's four-character code (`avc1`).
    pub codec: String,
}

fn clamp_u8(v: f64) -> u8 {
    v.round().clamp(0.0, 255.0) as u8
}

/// Decodes the first video track of the MP4 at `path`.
pub fn decode_mp4(path: &std::path::Path) -> DecodedVideo {
    use openh264::formats::YUVSource;
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let size = f.metadata().expect("metadata").len();
    let mut r = mp4::Mp4Reader::read_header(std::io::BufReader::new(f), size)
        .unwrap_or_else(|e| panic!("{} is not an MP4: {e}", path.display()));
    let (&id, track) = r
        .tracks()
        .iter()
        .find(|(_, t)| matches!(t.track_type(), Ok(mp4::TrackType::Video)))
        .expect("a video track");
    let codec = track.box_type().expect("sample entry").to_string();
    let (width, height) = (track.width() as usize, track.height() as usize);
    let fps = track.frame_rate();
    let start = |nal: &[u8], out: &mut Vec<u8>| {
        out.extend_from_slice(&[0, 0, 0, 1]);
        out.extend_from_slice(nal);
    };
    let mut stream = Vec::new();
    start(track.sequence_parameter_set().expect("SPS"), &mut stream);
    start(track.picture_parameter_set().expect("PPS"), &mut stream);
    let n = r.sample_count(id).expect("samples");
    let mut decoder = openh264::decoder::Decoder::new().expect("OpenH264 decoder");
    let mut frames = Vec::new();
    let mut planes = Vec::new();
    for k in 1..=n {
        let s = r
            .read_sample(id, k)
            .expect("sample")
            .expect("sample present");
        let mut b = &s.bytes[..];
        while b.len() >= 4 {
            let len = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
            start(&b[4..4 + len], &mut stream);
            b = &b[4 + len..];
        }
        if let Some(yuv) = decoder.decode(&stream).expect("H.264 decode") {
            frames.push(yuv_to_rgb(&yuv));
            planes.push(planes_of(&yuv));
        }
        stream.clear();
    }
    for yuv in decoder.flush_remaining().expect("flush") {
        let (w, h) = yuv.dimensions();
        assert_eq!((w, h), (width, height));
        frames.push(yuv_to_rgb(&yuv));
        planes.push(planes_of(&yuv));
    }
    DecodedVideo {
        width,
        height,
        fps,
        frames,
        planes,
        codec,
    }
}

/// The unpadded Y, Cb, Cr planes of a decoded picture.
fn planes_of(yuv: &impl openh264::formats::YUVSource) -> [Vec<u8>; 3] {
    let (w, h) = yuv.dimensions();
    let (sy, su, sv) = yuv.strides();
    let plane = |p: &[u8], stride: usize, w: usize, h: usize| {
        (0..h)
            .flat_map(|y| p[y * stride..y * stride + w].to_vec())
            .collect()
    };
    [
        plane(yuv.y(), sy, w, h),
        plane(yuv.u(), su, w / 2, h / 2),
        plane(yuv.v(), sv, w / 2, h / 2),
    ]
}

/// The BT.709 limited-range 4:2:0 planes an RGB frame should encode to (chroma from the mean of
/// each 2 x 2 block), in f64: what a codec's loss is measured against.
pub fn rgb_to_planes(rgb: &[u8], w: usize, h: usize) -> [Vec<u8>; 3] {
    let (kr, kb) = (0.2126, 0.0722);
    let luma = |r: f64, g: f64, b: f64| kr * r + (1.0 - kr - kb) * g + kb * b;
    let px = |x: usize, y: usize, c: usize| rgb[(y * w + x) * 3 + c] as f64;
    let mut planes = [Vec::new(), Vec::new(), Vec::new()];
    for y in 0..h {
        for x in 0..w {
            let l = luma(px(x, y, 0), px(x, y, 1), px(x, y, 2));
            planes[0].push(clamp_u8(16.0 + l * 219.0 / 255.0));
        }
    }
    for cy in 0..h / 2 {
        for cx in 0..w / 2 {
            let mean = |c| {
                (px(2 * cx, 2 * cy, c)
                    + px(2 * cx + 1, 2 * cy, c)
                    + px(2 * cx, 2 * cy + 1, c)
                    + px(2 * cx + 1, 2 * cy + 1, c))
                    / 4.0
            };
            let (r, g, b) = (mean(0), mean(1), mean(2));
            let l = luma(r, g, b);
            planes[1].push(clamp_u8(
                128.0 + (b - l) / (2.0 * (1.0 - kb)) * 224.0 / 255.0,
            ));
            planes[2].push(clamp_u8(
                128.0 + (r - l) / (2.0 * (1.0 - kr)) * 224.0 / 255.0,
            ));
        }
    }
    planes
}

/// BT.709 limited range 4:2:0 to RGB (chroma sample shared by its 2 x 2 pixels).
fn yuv_to_rgb(yuv: &impl openh264::formats::YUVSource) -> Vec<u8> {
    let (w, h) = yuv.dimensions();
    planes_rgb((yuv.y(), yuv.u(), yuv.v()), yuv.strides(), (w, h))
}

/// [`yuv_to_rgb`] of tightly packed planes (`[Y, Cb, Cr]`, the chroma half size each way): with
/// [`rgb_to_planes`], what 4:2:0 alone keeps of a frame.
pub fn planes_to_rgb(planes: &[Vec<u8>; 3], w: usize, h: usize) -> Vec<u8> {
    planes_rgb(
        (&planes[0], &planes[1], &planes[2]),
        (w, w / 2, w / 2),
        (w, h),
    )
}

fn planes_rgb(
    (yp, up, vp): (&[u8], &[u8], &[u8]),
    (sy, su, sv): (usize, usize, usize),
    (w, h): (usize, usize),
) -> Vec<u8> {
    let mut out = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            let l = (yp[y * sy + x] as f64 - 16.0) * 255.0 / 219.0;
            let cb = (up[(y / 2) * su + x / 2] as f64 - 128.0) * 255.0 / 224.0;
            let cr = (vp[(y / 2) * sv + x / 2] as f64 - 128.0) * 255.0 / 224.0;
            let r = l + 2.0 * (1.0 - 0.2126) * cr;
            let b = l + 2.0 * (1.0 - 0.0722) * cb;
            let g = (l - 0.2126 * r - 0.0722 * b) / 0.7152;
            out.extend([clamp_u8(r), clamp_u8(g), clamp_u8(b)]);
        }
    }
    out
}

/// PSNR in dB of `got` against `want` (8-bit samples); infinite when equal.
pub fn psnr(got: &[u8], want: &[u8]) -> f64 {
    assert_eq!(got.len(), want.len(), "frame sizes differ");
    let mse = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
        .sum::<f64>()
        / got.len() as f64;
    10.0 * (255.0f64 * 255.0 / mse).log10()
}
