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

use image::{DynamicImage, ImageFormat, ImageReader, Limits};
use tessera_core::{Error, Result};

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
#[derive(Clone, PartialEq, Eq)]
pub struct Image {
    width: usize,
    height: usize,
    rgb: Vec<u8>,
}

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
        Ok(Image { width, height, rgb })
    }

    /// Decode a PNG, JPEG, WebP, GIF (first frame) or BMP file held in memory.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let reader = || {
            ImageReader::new(Cursor::new(bytes))
                .with_guessed_format()
                .map_err(|e| Error::input(format!("cannot read the image: {e}")))
        };
        let format = reader()?.format();
        let Some(&(format, name)) = FORMATS.iter().find(|(f, _)| Some(*f) == format) else {
            return Err(Error::input(match format {
                Some(f) => {
                    format!("unsupported image format {f:?} (supported: PNG, JPEG, WebP, GIF, BMP)")
                }
                None => "not an image in a supported format (PNG, JPEG, WebP, GIF, BMP)".into(),
            }));
        };
        let bad = |e: image::ImageError| Error::input(format!("corrupt or truncated {name}: {e}"));
        let (w, h) = reader()?.into_dimensions().map_err(bad)?;
        if w == 0 || h == 0 {
            return Err(Error::input(format!("zero-sized {name} image ({w}×{h})")));
        }
        check_pixels(w as u64, h as u64)?;
        let mut limits = Limits::default();
        limits.max_image_width = Some(w);
        limits.max_image_height = Some(h);
        // 16-bit RGBA is the widest layout these decoders produce; allow it plus headroom.
        limits.max_alloc = Some(MAX_PIXELS * 8 + (64 << 20));
        let mut r = reader()?;
        r.set_format(format);
        r.limits(limits);
        let decoded = r.decode().map_err(bad)?;
        to_rgb(decoded, name)
    }

    /// Read and decode an image file; errors name the file.
    pub fn open(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::decode(&bytes).map_err(|e| Error::input(format!("{}: {e}", path.display())))
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
        assert!(Image::from_rgb8(0, 3, vec![]).is_err());
    }
}
