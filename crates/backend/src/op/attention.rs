//! Attention over packed sequences: where each sequence's queries and keys are, and which keys a
//! query sees.
//!
//! Queries are packed back to back ([`Segments`]). Each segment's keys are either its own rows
//! (self-attention over a whole sequence: `kv: None`) or a range of rows in the key/value views
//! ([`KvRanges`]): a cache whose rows were written by earlier calls (a prefix computed once, the
//! tokens decoded so far) followed by the rows this call appended. Positions: key `j` of a
//! segment is at position `j` of its range; the `q_len` queries of a segment with `kv_len` keys
//! are the sequence's last rows, at positions `kv_len − q_len … kv_len − 1`.

use tessera_core::{Error, Result};

use crate::{Backend, View, ViewMut};

/// The column layout of a packed q|k|v row: `heads_q` q heads, then `heads_kv` k heads, then
/// `heads_kv` v heads, each `head_dim` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QkvLayout {
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
}

impl QkvLayout {
    pub fn q_cols(&self) -> usize {
        self.heads_q * self.head_dim
    }
    pub fn kv_cols(&self) -> usize {
        self.heads_kv * self.head_dim
    }
    pub fn width(&self) -> usize {
        self.q_cols() + 2 * self.kv_cols()
    }
}

/// The per-head norms of [`Backend::qkv_norm_rope`]: RMSNorm of every q and k head (with a
/// `[head_dim]` weight each, or weightless), and of every v head when `v_norm` (weightless).
pub struct QkvNorm<'a, B: Backend> {
    pub layout: QkvLayout,
    /// Whether q and k heads are normed; without it they are only rotated (Qwen3-VL's vision
    /// tower has no q/k norms) and the weights must be `None`.
    pub qk_norm: bool,
    pub q_weight: Option<&'a B::Vector>,
    pub k_weight: Option<&'a B::Vector>,
    pub v_norm: bool,
    pub eps: f32,
}

impl<B: Backend> Clone for QkvNorm<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for QkvNorm<'_, B> {}

/// Where [`Backend::qkv_norm_rope_cached`] puts a call's new keys and values: packed row `i`'s k
/// heads become row `rows[i]` of `k` and its v heads row `rows[i]` of `v` (`[cache rows, kv
/// cols]` each), converted to the cache's element type. Like
/// [`scatter_rows`](Backend::scatter_rows), the device trusts `rows` (the model builds them).
pub struct CacheWrite<'a, B: Backend> {
    pub rows: &'a B::Buf,
    pub k: ViewMut<'a, B>,
    pub v: ViewMut<'a, B>,
}

/// Which keys of its segment a query sees (positions: module docs).
pub enum Mask<'a, B: Backend> {
    /// Every key.
    Full,
    /// Key `j` iff `|pos − j| ≤ radius` (a bidirectional sliding window, inclusive radius).
    Window(usize),
    /// Key `j` iff `j ≤ pos` (decoders).
    Causal,
    /// Key `j` iff `j < limits[r]` for packed query row `r`: a `u32` per query row counting the
    /// keys it sees from the start of its segment's keys. Expresses prefix-causal and
    /// block-causal masks such as a text prefix that is causal followed by image blocks that are
    /// bidirectional inside and see everything before them ([`block_causal_limits`]).
    Limits(&'a B::Buf),
}

impl<B: Backend> Clone for Mask<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Mask<'_, B> {}

/// The kind of a [`Mask`], without its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MaskKind {
    Full,
    Window,
    Causal,
    Limits,
}

impl<B: Backend> Mask<'_, B> {
    pub fn kind(&self) -> MaskKind {
        match self {
            Mask::Full => MaskKind::Full,
            Mask::Window(_) => MaskKind::Window,
            Mask::Causal => MaskKind::Causal,
            Mask::Limits(_) => MaskKind::Limits,
        }
    }
}

/// Attention parameters: `out = softmax(scale · q kᵀ + mask) v` per head, each K/V head shared
/// by `heads_q / heads_kv` consecutive q heads.
pub struct AttnSpec<'a, B: Backend> {
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// Multiplies `q·kᵀ` (1.0 for Gemma 4-style models, which norm q and k instead).
    pub scale: f32,
    pub mask: Mask<'a, B>,
    /// Where each segment's keys are: `None`, its own query rows; `Some`, a range of rows of the
    /// key/value views per segment (a cache).
    pub kv: Option<&'a KvRanges<B>>,
}

impl<B: Backend> Clone for AttnSpec<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for AttnSpec<'_, B> {}

impl<'a, B: Backend> AttnSpec<'a, B> {
    /// Self-attention of packed sequences with `mask`.
    pub fn new(layout: QkvLayout, scale: f32, mask: Mask<'a, B>) -> Self {
        AttnSpec {
            heads_q: layout.heads_q,
            heads_kv: layout.heads_kv,
            head_dim: layout.head_dim,
            scale,
            mask,
            kv: None,
        }
    }

    /// The same attention over the key ranges `kv`.
    pub fn over(self, kv: &'a KvRanges<B>) -> Self {
        AttnSpec {
            kv: Some(kv),
            ..self
        }
    }

    /// Every backend's shape check: q/out `[queries, heads_q·head_dim]` with `queries` the rows of
    /// `segs`; k/v `[keys, heads_kv·head_dim]` covering every segment's keys; whole groups of q
    /// heads per kv head; one key range per segment, each at least as long as its queries.
    pub fn check(
        &self,
        q: &View<'_, B>,
        k: &View<'_, B>,
        v: &View<'_, B>,
        out: &ViewMut<'_, B>,
        segs: &Segments<B>,
    ) -> Result<()> {
        let hd = self.head_dim;
        let total = segs.total();
        let keys_ok = match self.kv {
            None => k.rows == total && v.rows == total,
            Some(kv) => {
                kv.ranges.len() == segs.count()
                    && kv
                        .ranges
                        .iter()
                        .zip(segs.ranges())
                        .all(|(&(s, n), (a, b))| {
                            (s + n) as usize <= k.rows.min(v.rows) && n as usize >= b - a
                        })
            }
        };
        let ok = self.heads_kv > 0
            && self.heads_q.is_multiple_of(self.heads_kv)
            && q.cols == self.heads_q * hd
            && out.cols == q.cols
            && k.cols == self.heads_kv * hd
            && v.cols == k.cols
            && q.rows == total
            && out.rows == total
            && keys_ok;
        if ok {
            return Ok(());
        }
        Err(Error::backend(
            "attention",
            format!(
                "q {}×{}, k {}×{}, v {}×{}, out {}×{} for {} q heads / {} kv heads of {hd} over {total} query rows{}",
                q.rows,
                q.cols,
                k.rows,
                k.cols,
                v.rows,
                v.cols,
                out.rows,
                out.cols,
                self.heads_q,
                self.heads_kv,
                match self.kv {
                    Some(kv) => format!(" and key ranges {:?}", kv.ranges),
                    None => String::new(),
                }
            ),
        ))
    }
}

/// Packed sequences: segment `s` covers rows `offsets[s]..offsets[s + 1]`.
///
/// Allocated once for a capacity and refilled per pass, so its device copy stays at one address
/// (work captured into a CUDA graph keeps pointing at it).
pub struct Segments<B: Backend> {
    /// Host copy (`count + 1` entries, starting at 0).
    pub offsets: Vec<u32>,
    /// Device copy of the offsets, followed by backend-specific work items (CUDA: query tiles).
    pub dev: B::Buf,
    /// Capacity the device buffer was sized for.
    pub max_rows: usize,
    pub max_segs: usize,
    /// Number of backend-specific work items stored after the offsets.
    pub tiles: usize,
    /// Number of a second kind of work items (CUDA: the 128-row query tiles).
    pub wide_tiles: usize,
}

impl<B: Backend> Segments<B> {
    pub fn count(&self) -> usize {
        self.offsets.len() - 1
    }
    pub fn total(&self) -> usize {
        *self.offsets.last().unwrap_or(&0) as usize
    }
    pub fn max_len(&self) -> usize {
        self.offsets
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
    }
    /// `(start, end)` row ranges.
    pub fn ranges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.offsets
            .windows(2)
            .map(|w| (w[0] as usize, w[1] as usize))
    }
}

/// Offsets `[0, l0, l0 + l1, …]` of `lens`, checked against a capacity.
pub fn offsets_of(lens: &[usize], max_rows: usize, max_segs: usize) -> Result<Vec<u32>> {
    let total: usize = lens.iter().sum();
    if lens.len() > max_segs || total > max_rows || total > u32::MAX as usize {
        return Err(Error::backend(
            "segments",
            format!(
                "{} segments of {total} rows exceed the capacity of {max_segs} segments / {max_rows} rows",
                lens.len()
            ),
        ));
    }
    let mut offsets = Vec::with_capacity(lens.len() + 1);
    let mut acc = 0u32;
    offsets.push(0);
    for &l in lens {
        acc += l as u32;
        offsets.push(acc);
    }
    Ok(offsets)
}

/// One key range per segment: `(first row, rows)` in the key/value views, anywhere in them
/// (cache slots need not be packed or in order).
pub struct KvRanges<B: Backend> {
    /// Host copy.
    pub ranges: Vec<(u32, u32)>,
    /// Device copy: two `u32` per segment.
    pub dev: B::Buf,
}

/// A run of rows in a block-causal sequence (see [`block_causal_limits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Run {
    /// Rows that see themselves and everything before them (text).
    Causal(usize),
    /// Rows that see their whole block and everything before it (an image).
    Block(usize),
}

/// Per-row key limits for [`Mask::Limits`] over one sequence made of `runs`: row `i` of a causal
/// run sees keys `..=i`, a row of a block sees keys up to its block's end. This is Qwen-Image's
/// block-causal mask (a causal text prefix, then condition and target images).
pub fn block_causal_limits(runs: &[Run]) -> Vec<u32> {
    let mut limits = Vec::new();
    let mut row = 0u32;
    for run in runs {
        match *run {
            Run::Causal(n) => {
                limits.extend((row + 1..).take(n));
                row += n as u32;
            }
            Run::Block(n) => {
                row += n as u32;
                limits.extend(std::iter::repeat_n(row, n));
            }
        }
    }
    limits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_causal_limits_of_text_then_images() {
        // 3 text rows, a 2-row image, 1 text row, a 3-row target.
        let l =
            block_causal_limits(&[Run::Causal(3), Run::Block(2), Run::Causal(1), Run::Block(3)]);
        assert_eq!(l, [1, 2, 3, 5, 5, 6, 9, 9, 9]);
        // Non-decreasing, and never past the sequence.
        assert!(l.windows(2).all(|w| w[0] <= w[1]) && *l.last().unwrap() == 9);
    }

    #[test]
    fn offsets_are_checked_against_capacity() {
        assert_eq!(offsets_of(&[2, 3], 5, 2).unwrap(), [0, 2, 5]);
        assert!(offsets_of(&[2, 3], 4, 2).is_err());
        assert!(offsets_of(&[1, 1, 1], 5, 2).is_err());
    }
}
