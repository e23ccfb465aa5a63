//! The joint sequence of Qwen-Image-2.1's DiT: text runs and image blocks in prompt order, the
//! target image last (spec A4).
//!
//! Every row has a position on three axes (frame, height, width). Text rows advance one shared
//! position on all three; an image block of `h × w` latent tokens keeps the frame at the position
//! reached so far and lays its rows on a height/width grid centred on zero
//! (`−⌈h/2⌉ … ⌊h/2⌋ − 1`), then advances the position by `max(h, w)`. The target's positions
//! therefore depend on its prefix: a negative prompt of another length rotates it differently.
//!
//! Attention is block-causal: a text row sees itself and every row before it; an image row sees
//! its whole block and everything before it ([`tessera_backend::block_causal_limits`]). So the
//! prefix (every row before the target) never sees the target, and its keys and values are the
//! same at every step: the prefix cache of [`super::transformer`].

use tessera_backend::Run;
use tessera_core::{Error, Result};

use super::config::ROPE_THETA;

/// A run of the joint sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Rows of text features.
    Text(usize),
    /// An image block of `h × w` latent tokens in raster order.
    Image { h: usize, w: usize },
}

impl Part {
    pub fn rows(&self) -> usize {
        match *self {
            Part::Text(n) => n,
            Part::Image { h, w } => h * w,
        }
    }
}

/// A whole sequence: the prefix parts, then the target image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    parts: Vec<Part>,
}

impl Layout {
    /// `parts` in sequence order; the last is the target image.
    pub fn new(parts: Vec<Part>) -> Result<Self> {
        match parts.last() {
            Some(Part::Image { h, w }) if *h > 0 && *w > 0 => {}
            _ => {
                return Err(Error::input(
                    "a Qwen-Image sequence ends with the target image",
                ));
            }
        }
        if parts.iter().any(|p| p.rows() == 0) {
            return Err(Error::input("a Qwen-Image sequence has an empty part"));
        }
        if parts.len() < 2 {
            return Err(Error::input(
                "a Qwen-Image sequence needs a prompt before its image",
            ));
        }
        Ok(Layout { parts })
    }

    /// Text-to-image: `text` prompt rows, then an `h × w` target.
    pub fn text_to_image(text: usize, (h, w): (usize, usize)) -> Result<Self> {
        Layout::new(vec![Part::Text(text), Part::Image { h, w }])
    }

    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// The prefix parts (everything before the target).
    pub fn prefix(&self) -> &[Part] {
        &self.parts[..self.parts.len() - 1]
    }

    pub fn prefix_rows(&self) -> usize {
        self.prefix().iter().map(Part::rows).sum()
    }

    pub fn text_rows(&self) -> usize {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Text(n) => *n,
                Part::Image { .. } => 0,
            })
            .sum()
    }

    /// The target's `(h, w)` in latent tokens.
    pub fn target(&self) -> (usize, usize) {
        match self.parts.last() {
            Some(&Part::Image { h, w }) => (h, w),
            _ => (0, 0),
        }
    }

    pub fn target_rows(&self) -> usize {
        let (h, w) = self.target();
        h * w
    }

    pub fn rows(&self) -> usize {
        self.prefix_rows() + self.target_rows()
    }

    /// `(frame, height, width)` of every row, in sequence order.
    pub fn positions(&self) -> Vec<[i32; 3]> {
        let mut out = Vec::with_capacity(self.rows());
        let mut pos = 0i32;
        for p in &self.parts {
            match *p {
                Part::Text(n) => {
                    out.extend((pos..pos + n as i32).map(|q| [q, q, q]));
                    pos += n as i32;
                }
                Part::Image { h, w } => {
                    let (h, w) = (h as i32, w as i32);
                    let (y0, x0) = (-(h - h / 2), -(w - w / 2));
                    for y in 0..h {
                        out.extend((0..w).map(|x| [pos, y0 + y, x0 + x]));
                    }
                    pos += h.max(w);
                }
            }
        }
        out
    }

    /// The prefix as block-causal runs ([`tessera_backend::block_causal_limits`]).
    pub fn prefix_runs(&self) -> Vec<Run> {
        self.prefix()
            .iter()
            .map(|p| match *p {
                Part::Text(n) => Run::Causal(n),
                Part::Image { .. } => Run::Block(p.rows()),
            })
            .collect()
    }

    /// The whole sequence as block-causal runs.
    pub fn runs(&self) -> Vec<Run> {
        let mut r = self.prefix_runs();
        r.push(Run::Block(self.target_rows()));
        r
    }

    /// Whether the prefix is text alone (plain causal attention).
    pub fn prefix_is_text(&self) -> bool {
        self.prefix().iter().all(|p| matches!(p, Part::Text(_)))
    }
}

/// Qwen-Image's 3-axis RoPE frequencies, in `f32` as diffusers computes them
/// (`1 / θ^(2i/d)` per axis, `θ` and the exponent in `f32`); a row's angles are its position on
/// each axis (in `f32`) times that axis's frequencies, the axes concatenated.
#[derive(Clone, Debug)]
pub struct Rope {
    freqs: [Vec<f32>; 3],
}

impl Rope {
    pub fn new(axes: [usize; 3]) -> Self {
        Rope {
            freqs: axes.map(|d| {
                (0..d / 2)
                    .map(|i| 1.0 / ROPE_THETA.powf((2 * i) as f32 / d as f32))
                    .collect()
            }),
        }
    }

    /// Rotated pairs per head.
    pub fn pairs(&self) -> usize {
        self.freqs.iter().map(Vec::len).sum()
    }

    /// The angles `[rows, pairs]` of rows at `positions`.
    pub fn angles(&self, positions: &[[i32; 3]]) -> Vec<f32> {
        let mut out = Vec::with_capacity(positions.len() * self.pairs());
        for p in positions {
            for (&pos, f) in p.iter().zip(&self.freqs) {
                out.extend(f.iter().map(|&f| pos as f32 * f));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_backend::block_causal_limits;

    #[test]
    fn positions_restart_per_image_and_resume_after_it() {
        // The spec's example: text 3, then a 2×3 image, then text after a 2×4 image.
        let l = Layout::new(vec![
            Part::Text(3),
            Part::Image { h: 2, w: 3 },
            Part::Text(1),
            Part::Image { h: 2, w: 4 },
        ])
        .unwrap();
        let p = l.positions();
        assert_eq!(&p[..3], &[[0, 0, 0], [1, 1, 1], [2, 2, 2]]);
        assert_eq!(&p[3..6], &[[3, -1, -2], [3, -1, -1], [3, -1, 0]]);
        assert_eq!(p[6], [3, 0, -2]);
        // After the 2×3 block the position is 3 + 3; the text row takes it.
        assert_eq!(p[9], [6, 6, 6]);
        assert_eq!(p[10], [7, -1, -2]);
        assert_eq!((l.prefix_rows(), l.target_rows(), l.rows()), (10, 8, 18));
        let lim = block_causal_limits(&l.runs());
        assert_eq!(&lim[..4], &[1, 2, 3, 9]);
        assert_eq!(lim[9], 10);
        assert!(lim[10..].iter().all(|&x| x == 18));
    }

    #[test]
    fn a_sequence_ends_with_its_target() {
        assert!(Layout::new(vec![Part::Text(3)]).is_err());
        assert!(Layout::new(vec![Part::Image { h: 2, w: 2 }]).is_err());
        assert!(Layout::text_to_image(0, (2, 2)).is_err());
        assert!(Layout::text_to_image(5, (2, 2)).unwrap().prefix_is_text());
    }
}
