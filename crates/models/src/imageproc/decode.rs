//! Decoding image files to 8-bit RGB as the reference sees them.
//!
//! The reference (transformers 5.25 `TorchvisionBackend.process_image` on a Pillow image) calls
//! `convert_to_rgb`, which composites any transparency onto **white** with Pillow's
//! `alpha_composite` and otherwise uses `Image.convert("RGB")` (grey replicated). Orientation is
//! the stored one: no EXIF rotation is applied. Pillow's conversions of 16-bit files are kept as
//! well: 16-bit colour keeps the high byte, 16-bit grey (`I;16`) saturates at 255.
//!
//! The format is sniffed from the content, and the pixel count is checked against
//! [`MAX_PIXELS`] from the header before anything is decoded.

use std::io::Cursor;
use std::path::Path;

use std::sync::Arc;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits};
use tessera_core::{Error, Result};

use super::patches::{ImageBudget, PatchSpec, Patches};
use super::pil::Rgba8;

/// The largest image accepted, in pixels: Pillow's decompression-bomb threshold
/// (`Image.MAX_IMAGE_PIXELS`, 89,478,485 ≈ 9,459²). Larger files are refused from their header,
/// before the decoder allocates anything.
pub const MAX_PIXELS: u64 = 89_478_485;

/// The formats we decode, by the `image` crate's sniffed format.
const FORMATS: &[(ImageFormat, &str)] = &[
    (ImageFormat::Png, "PNG"),
    (ImageFormat::Jpeg, "JPEG"),
    (ImageFormat::WebP, "WebP"),
    (ImageFormat::Gif, "GIF"),
    (ImageFormat::Bmp, "BMP"),
];

/// A decoded image: 8-bit RGB, row-major `[height, width, 3]`.
#[derive(Clone)]
pub struct Image {
    width: usize,
    height: usize,
    rgb: Vec<u8>,
    /// Patches made ahead of time by [`Image::prepare`].
    prepared: Option<Prepared>,
}

/// An image's patches for one patch geometry and budget, shared with the passes that use them.
#[derive(Clone)]
struct Prepared {
    spec: PatchSpec,
    budget: ImageBudget,
    patches: Arc<Patches>,
}

/// Images are equal when their pixels are; patches made ahead of time do not count.
impl PartialEq for Image {
    fn eq(&self, other: &Self) -> bool {
        (self.width, self.height) == (other.width, other.height) && self.rgb == other.rgb
    }
}
impl Eq for Image {}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Image({}×{} RGB)", self.width, self.height)
    }
}

impl Image {
    /// Wrap RGB bytes (`[height, width, 3]`, row-major).
    pub fn from_rgb8(width: usize, height: usize, rgb: Vec<u8>) -> Result<Self> {
        if width == 0 || height == 0 {
            return Err(Error::input(format!("zero-sized image ({width}×{height})")));
        }
        check_pixels(width as u64, height as u64)?;
        if rgb.len() != width * height * 3 {
            return Err(Error::input(format!(
                "{} bytes for a {width}×{height} RGB image (expected {})",
                rgb.len(),
                width * height * 3
            )));
        }
        Ok(Image {
            width,
            height,
            rgb,
            prepared: None,
        })
    }

    /// Read an image file's header: format, size and what decoding it costs. Nothing is
    /// decoded; an image over [`MAX_PIXELS`] is refused here.
    pub fn header(bytes: &[u8]) -> Result<Header> {
        let (format, name) = sniff(bytes)?;
        let bad = |e: image::ImageError| Error::input(format!("corrupt or truncated {name}: {e}"));
        // A PNG's size is at a fixed place: checked before the decoder, which refuses sizes it
        // cannot hold (2³¹−1 per side) as corrupt.
        if let Some((w, h)) = png_size(bytes) {
            check_size(name, w as u64, h as u64)?;
        }
        let mut r = ImageReader::new(Cursor::new(bytes));
        r.set_format(format);
        r.no_limits();
        let decoder = r.into_decoder().map_err(bad)?;
        let (w, h) = decoder.dimensions();
        check_size(name, w as u64, h as u64)?;
        let pixels = w as u64 * h as u64;
        Ok(Header {
            format: name,
            kind: format,
            width: w as usize,
            height: h as usize,
            decode_bytes: pixels * (decoder.color_type().bytes_per_pixel() as u64 + work(format)),
        })
    }

    /// Decode a PNG, JPEG, WebP, GIF (first frame) or BMP file held in memory.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        Self::decode_with(bytes, &Self::header(bytes)?)
    }

    /// [`Image::decode`] with the header already read from `bytes` by [`Image::header`], for a
    /// caller that planned from it: the decoder is held to the header's size.
    pub fn decode_with(bytes: &[u8], header: &Header) -> Result<Self> {
        to_rgb(decode_limited(bytes, header)?, header.format)
    }

    /// Read and decode an image file; errors name the file.
    pub fn open(path: &Path) -> Result<Self> {
        let bytes = read_file(path)?;
        Self::decode(&bytes).map_err(|e| Error::input(format!("{}: {e}", path.display())))
    }

    /// Resize and cut into patches now, for `spec` and `budget`: [`preprocess`] with the same
    /// settings then returns these patches instead of redoing the work. The server does this
    /// while it checks a request, so that the device's thread only runs the model.
    ///
    /// [`preprocess`]: super::preprocess
    pub fn prepare(&mut self, spec: PatchSpec, budget: ImageBudget) -> Result<()> {
        let patches = super::preprocess(self, spec, budget)?;
        self.prepared = Some(Prepared {
            spec,
            budget,
            patches,
        });
        Ok(())
    }

    /// The patches [`Image::prepare`] made for `spec` and `budget`, if it did.
    pub(super) fn prepared(&self, spec: PatchSpec, budget: ImageBudget) -> Option<&Arc<Patches>> {
        self.prepared
            .as_ref()
            .filter(|p| (p.spec, p.budget) == (spec, budget))
            .map(|p| &p.patches)
    }

    pub fn width(&self) -> usize {
        self.width
    }
    pub fn height(&self) -> usize {
        self.height
    }
    /// Row-major `[height, width, 3]` bytes.
    pub fn rgb(&self) -> &[u8] {
        &self.rgb
    }
}

/// Decode `bytes` whose header is `header`, the decoder held to the header's size.
fn decode_limited(bytes: &[u8], header: &Header) -> Result<DynamicImage> {
    let name = header.format;
    let bad = |e: image::ImageError| Error::input(format!("corrupt or truncated {name}: {e}"));
    let mut limits = Limits::default();
    limits.max_image_width = Some(header.width as u32);
    limits.max_image_height = Some(header.height as u32);
    // 16-bit RGBA is the widest layout these decoders produce; allow it plus headroom.
    limits.max_alloc = Some(MAX_PIXELS * 8 + (64 << 20));
    let mut r = ImageReader::new(Cursor::new(bytes));
    r.set_format(header.kind);
    r.limits(limits);
    r.decode().map_err(bad)
}

/// Decode a PNG, JPEG, WebP, GIF (first frame) or BMP file held in memory to straight 8-bit
/// RGBA, opaque where the file has no alpha: what Pillow's `convert("RGBA")` hands the edit
/// pipeline for a condition image (8-bit files; 16-bit ones are scaled, not truncated). Sniffed
/// and size-checked from the header first, as [`Image::decode`].
pub fn decode_rgba(bytes: &[u8]) -> Result<Rgba8> {
    let header = Image::header(bytes)?;
    let rgba = decode_limited(bytes, &header)?.into_rgba8();
    let (w, h) = rgba.dimensions();
    Rgba8::new(w as usize, h as usize, rgba.into_raw())
}

/// Read and decode an image file to RGBA ([`decode_rgba`]); errors name the file.
pub fn open_rgba(path: &Path) -> Result<Rgba8> {
    let bytes = read_file(path)?;
    decode_rgba(&bytes).map_err(|e| Error::input(format!("{}: {e}", path.display())))
}

/// What an image file's header says, read without decoding a pixel ([`Image::header`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The format's name: PNG, JPEG, WebP, GIF or BMP.
    pub format: &'static str,
    kind: ImageFormat,
    pub width: usize,
    pub height: usize,
    /// Bytes the decoder holds at most besides the RGB result: its own output layout and the
    /// format's working buffers (progressive JPEG coefficients, WebP and GIF canvases).
    pub decode_bytes: u64,
}

/// The largest file read as an image: an uncompressed 16-bit RGBA image at [`MAX_PIXELS`],
/// plus room for metadata. Anything longer cannot be an image we accept.
pub const MAX_FILE_BYTES: u64 = MAX_PIXELS * 8 + (64 << 20);

/// Read an image file, at most [`MAX_FILE_BYTES`] of it, refusing early what is not an image:
/// the format is sniffed from the first bytes before the rest is read, so a device such as
/// `/dev/zero` fails at once. Errors name the file.
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let named = |e: Error| Error::input(format!("{}: {e}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut file = file.take(MAX_FILE_BYTES + 1);
    let mut bytes = Vec::new();
    (&mut file)
        .take(64 << 10)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    sniff(&bytes).map_err(named)?;
    file.read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(named(Error::input(format!(
            "more than {} MiB, larger than any image within the limit of {MAX_PIXELS} pixels",
            MAX_FILE_BYTES >> 20
        ))));
    }
    Ok(bytes)
}

/// The format of `bytes`, from their content.
fn sniff(bytes: &[u8]) -> Result<(ImageFormat, &'static str)> {
    let format = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Error::input(format!("cannot read the image: {e}")))?
        .format();
    match FORMATS.iter().find(|(f, _)| Some(*f) == format) {
        Some(&found) => Ok(found),
        None => Err(Error::input(match format {
            Some(f) => {
                format!("unsupported image format {f:?} (supported: PNG, JPEG, WebP, GIF, BMP)")
            }
            None => "not an image in a supported format (PNG, JPEG, WebP, GIF, BMP)".into(),
        })),
    }
}

/// Width and height from a PNG's `IHDR` chunk, which the format puts first.
fn png_size(bytes: &[u8]) -> Option<(u32, u32)> {
    let be = |at: usize| Some(u32::from_be_bytes(bytes.get(at..at + 4)?.try_into().ok()?));
    (bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.get(12..16) == Some(b"IHDR"))
        .then(|| Some((be(16)?, be(20)?)))
        .flatten()
}

/// Working bytes per pixel a decoder needs beyond its output.
fn work(format: ImageFormat) -> u64 {
    match format {
        // Progressive JPEG keeps every coefficient: 64 i16 per 8×8 block of each of 3 planes.
        ImageFormat::Jpeg => 6,
        // The decoded RGBA canvas beside the frame.
        ImageFormat::WebP | ImageFormat::Gif => 4,
        _ => 0,
    }
}

fn check_size(name: &str, w: u64, h: u64) -> Result<()> {
    if w == 0 || h == 0 {
        return Err(Error::input(format!("zero-sized {name} image ({w}×{h})")));
    }
    check_pixels(w, h)
}

fn check_pixels(w: u64, h: u64) -> Result<()> {
    if w * h > MAX_PIXELS {
        return Err(Error::input(format!(
            "image of {w}×{h} = {} pixels is larger than the limit of {MAX_PIXELS} pixels",
            w * h
        )));
    }
    Ok(())
}

/// Pillow's `alpha_composite` of `c` with alpha `a` over opaque white (libImaging
/// `AlphaComposite.c`, 7 fraction bits). The destination is opaque, so its coefficients reduce to
/// `a·2⁷` and `(255 − a)·2⁷`. Checked against Pillow for all 65,536 `(c, a)` pairs.
#[inline]
fn over_white(c: u8, a: u8) -> u8 {
    if a == 0 {
        return 255;
    }
    let (c, a) = (c as u32, a as u32);
    let tmp = c * (a << 7) + 255 * ((255 - a) << 7) + (0x80 << 7);
    ((((tmp >> 8) + tmp) >> 8) >> 7) as u8
}

fn to_rgb(img: DynamicImage, name: &str) -> Result<Image> {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let n = w * h;
    let mut rgb = Vec::with_capacity(n * 3);
    match img {
        DynamicImage::ImageRgb8(b) => rgb = b.into_raw(),
        DynamicImage::ImageLuma8(b) => b.as_raw().iter().for_each(|&v| rgb.extend([v; 3])),
        DynamicImage::ImageRgba8(b) => b.as_raw().chunks_exact(4).for_each(|p| {
            rgb.extend([p[0], p[1], p[2]].map(|c| over_white(c, p[3])));
        }),
        DynamicImage::ImageLumaA8(b) => b.as_raw().chunks_exact(2).for_each(|p| {
            rgb.extend([over_white(p[0], p[1]); 3]);
        }),
        DynamicImage::ImageRgb16(b) => rgb.extend(b.as_raw().iter().map(|&v| (v >> 8) as u8)),
        // Pillow opens 16-bit grey as `I;16`, whose conversion to RGB saturates.
        DynamicImage::ImageLuma16(b) => b
            .as_raw()
            .iter()
            .for_each(|&v| rgb.extend([v.min(255) as u8; 3])),
        DynamicImage::ImageRgba16(b) => b.as_raw().chunks_exact(4).for_each(|p| {
            let a = (p[3] >> 8) as u8;
            rgb.extend([p[0], p[1], p[2]].map(|c| over_white((c >> 8) as u8, a)));
        }),
        DynamicImage::ImageLumaA16(b) => b.as_raw().chunks_exact(2).for_each(|p| {
            rgb.extend([over_white((p[0] >> 8) as u8, (p[1] >> 8) as u8); 3]);
        }),
        other => {
            return Err(Error::input(format!(
                "unsupported {name} pixel layout {:?}",
                other.color()
            )));
        }
    }
    debug_assert_eq!(rgb.len(), n * 3);
    Ok(Image {
        width: w,
        height: h,
        rgb,
        prepared: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32, color: image::ExtendedColorType, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        image::ImageEncoder::write_image(
            image::codecs::png::PngEncoder::new(&mut out),
            data,
            w,
            h,
            color,
        )
        .unwrap();
        out
    }

    /// A 24-bit BMP file header with no pixel data.
    pub(crate) fn bmp_header(w: i32, h: i32) -> Vec<u8> {
        let mut b = b"BM".to_vec();
        for v in [54u32 + 16, 0, 54, 40] {
            b.extend(v.to_le_bytes());
        }
        b.extend(w.to_le_bytes());
        b.extend(h.to_le_bytes());
        b.extend(1u16.to_le_bytes());
        b.extend(24u16.to_le_bytes());
        b.extend([0u8; 24]);
        b.extend([0u8; 16]);
        b
    }

    #[test]
    fn the_header_gives_the_size_and_the_decoding_cost() {
        let h = Image::header(&png(300, 2, image::ExtendedColorType::La8, &[0; 1200])).unwrap();
        assert_eq!(
            (h.format, h.width, h.height, h.decode_bytes),
            ("PNG", 300, 2, 1200)
        );
        let h = Image::header(&bmp_header(7, 5)).unwrap();
        assert_eq!((h.format, h.width, h.height), ("BMP", 7, 5));
    }

    #[test]
    fn reading_a_device_that_is_not_an_image_stops_at_once() {
        let e = read_file(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("/dev/zero") && e.contains("not an image"), "{e}");
    }

    #[test]
    fn grey_is_replicated_and_alpha_goes_onto_white() {
        let grey = Image::decode(&png(2, 1, image::ExtendedColorType::L8, &[7, 200])).unwrap();
        assert_eq!(grey.rgb(), &[7, 7, 7, 200, 200, 200]);
        let rgba = [10, 20, 30, 255, 10, 20, 30, 0, 100, 0, 200, 128];
        let img = Image::decode(&png(3, 1, image::ExtendedColorType::Rgba8, &rgba)).unwrap();
        let want: Vec<u8> = rgba
            .chunks(4)
            .flat_map(|p| {
                let a = p[3] as f64 / 255.0;
                [p[0], p[1], p[2]].map(|c| (c as f64 * a + 255.0 * (1.0 - a)).round() as u8)
            })
            .collect();
        // Pillow's integer composite agrees with exact rounding on these values.
        assert_eq!(img.rgb(), &want[..]);
    }

    #[test]
    fn sixteen_bit_files_convert_as_pillow_does() {
        // Pillow keeps the high byte of 16-bit colour, and saturates 16-bit grey (`I;16`).
        let vals: [u16; 4] = [0, 255, 1000, 40000];
        let be: Vec<u8> = vals.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let grey = Image::decode(&png(4, 1, image::ExtendedColorType::L16, &be)).unwrap();
        let want: Vec<u8> = vals.iter().flat_map(|&v| [v.min(255) as u8; 3]).collect();
        assert_eq!(grey.rgb(), &want[..]);
        let rgb: Vec<u8> = vals
            .iter()
            .flat_map(|v| [*v; 3])
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        let colour = Image::decode(&png(4, 1, image::ExtendedColorType::Rgb16, &rgb)).unwrap();
        let want: Vec<u8> = vals.iter().flat_map(|&v| [(v >> 8) as u8; 3]).collect();
        assert_eq!(colour.rgb(), &want[..]);
    }

    #[test]
    fn bad_inputs_are_refused_with_a_reason() {
        let e = |bytes: &[u8]| Image::decode(bytes).unwrap_err().to_string();
        assert!(e(b"hello, not an image").contains("not an image"));
        let good = png(4, 4, image::ExtendedColorType::Rgb8, &[9; 48]);
        let msg = e(&good[..good.len() - 20]);
        assert!(msg.contains("corrupt or truncated PNG"), "{msg}");
        // A TIFF header: sniffed but not a format we decode.
        assert!(e(b"II*\0\x08\0\0\0\0\0").contains("unsupported image format"));
        // A BMP header claiming 20000 × 20000 pixels and no data: refused before decoding.
        let msg = e(&bmp_header(20000, 20000));
        assert!(msg.contains("larger than the limit"), "{msg}");
        // A PNG header claiming 2³¹−1 pixels per side (the format's largest): the pixel limit,
        // not "corrupt".
        let side = (1u32 << 31) - 1;
        let mut huge = png(1, 1, image::ExtendedColorType::L8, &[0]);
        huge[16..20].copy_from_slice(&side.to_be_bytes());
        huge[20..24].copy_from_slice(&side.to_be_bytes());
        let msg = e(&huge);
        assert!(
            msg.contains("2147483647×2147483647") && msg.contains("larger than the limit"),
            "{msg}"
        );
        assert!(Image::from_rgb8(0, 3, vec![]).is_err());
    }
}
