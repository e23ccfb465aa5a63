//! Row-wise ops: `embed`, `cast`, `gated`, `segment_mean`, and the vision towers'
//! `add_positions_2d`, `avg_pool2d` and `scatter_rows`; `argmax_rows`, greedy decoding's token.

use tessera_backend::{Activation, NAN_ROW, Op, Precision, Role};
use tessera_core::DType;

use super::{Device, Guarded, Layout, OpCase, Output, Res, Rng, Tol, checkpoint, indices, patches};

/// `ids` rows of a `[vocab, dim]` checkpoint table (stored as `stored`), times `scale`, into f32.
#[derive(Clone, Debug)]
pub struct EmbedCase {
    ids: usize,
    vocab: usize,
    dim: usize,
    scale: f32,
    stored: DType,
}

/// Rows of a bf16 table, scale 1.
pub fn embed(ids: usize, vocab: usize, dim: usize) -> EmbedCase {
    EmbedCase {
        ids,
        vocab,
        dim,
        scale: 1.0,
        stored: DType::BF16,
    }
}

impl EmbedCase {
    pub fn scale(self, scale: f32) -> Self {
        EmbedCase { scale, ..self }
    }
    pub fn stored(self, stored: DType) -> Self {
        EmbedCase { stored, ..self }
    }
}

impl OpCase for EmbedCase {
    fn name(&self) -> String {
        let EmbedCase {
            ids, vocab, dim, ..
        } = *self;
        format!(
            "embed {ids} ids of a {vocab}×{dim} {} table × {}",
            self.stored, self.scale
        )
    }

    fn op(&self) -> Op {
        Op::Embed
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let EmbedCase { vocab, dim, .. } = *self;
        let values = rng.vec(vocab * dim, 1.0);
        let weights = checkpoint("emb", &[vocab, dim], self.stored, &values)?;
        let table = be.table(&weights, "emb", &[vocab, dim])?;
        // The table's last row first, then a stride through the rest.
        let ids: Vec<u32> = (0..self.ids)
            .map(|i| ((i * 13 + vocab - 1) % vocab) as u32)
            .collect();
        let ids = indices(be, &ids)?;
        let at = Layout::padded(self.ids, dim, 0, 8);
        let mut out = Guarded::empty(be, Role::Stream, at)?;
        be.embed(&table, &ids, self.scale, out.view_mut())?;
        Ok(vec![out.read(be, "out")?])
    }
}

/// `out = x` between buffer roles.
#[derive(Clone, Debug)]
pub struct CastCase {
    rows: usize,
    cols: usize,
    from: Role,
    to: Role,
    /// Elements before each output row (8: the output's rows start where 4-vectors align).
    left: usize,
}

pub fn cast(rows: usize, cols: usize, from: Role, to: Role) -> CastCase {
    CastCase {
        rows,
        cols,
        from,
        to,
        left: 8,
    }
}

impl CastCase {
    /// The output's rows `left` elements into each padded row (2: no 4-vector starts a row).
    pub fn shifted(self, left: usize) -> Self {
        CastCase { left, ..self }
    }
}

impl OpCase for CastCase {
    fn name(&self) -> String {
        let CastCase { rows, cols, .. } = *self;
        let shift = if self.left == 8 {
            String::new()
        } else {
            format!(", output rows {} in", self.left)
        };
        format!("cast {rows}×{cols} {:?} → {:?}{shift}", self.from, self.to)
    }

    fn op(&self) -> Op {
        Op::Cast
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let CastCase { rows, cols, .. } = *self;
        let x = Guarded::drawn(be, self.from, Layout::padded(rows, cols, 0, 8), rng, 4.0)?;
        let mut out = Guarded::empty(be, self.to, Layout::padded(rows, cols, self.left, 0))?;
        be.cast(x.view(), out.view_mut())?;
        Ok(vec![out.read(be, "out")?])
    }
}

/// `out = act(gate) ⊙ up` for gate|up halves of one product's rows.
#[derive(Clone, Debug)]
pub struct GatedCase {
    rows: usize,
    cols: usize,
    act: Activation,
}

pub fn gated(rows: usize, cols: usize, act: Activation) -> GatedCase {
    GatedCase { rows, cols, act }
}

impl OpCase for GatedCase {
    fn name(&self) -> String {
        format!("gated {:?} {}×{}", self.act, self.rows, self.cols)
    }

    fn op(&self) -> Op {
        Op::Gated(self.act)
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let GatedCase { rows, cols, .. } = *self;
        // gate|up as the fused gate|up product writes them.
        let at = Layout::padded(rows, 2 * cols, 0, 8);
        let gu = Guarded::drawn(be, Role::Compute, at, rng, 4.0)?;
        let mut out = Guarded::empty(be, Role::Compute, Layout::padded(rows, cols, 8, 0))?;
        let (gate, up) = (gu.view().cols(0, cols), gu.view().cols(cols, cols));
        be.gated(gate, up, out.view_mut(), self.act)?;
        Ok(vec![out.read(be, "out")?])
    }
}

/// The mean of each segment's rows, into f32 rows.
#[derive(Clone, Debug)]
pub struct SegmentMeanCase {
    lens: Vec<usize>,
    cols: usize,
}

pub fn segment_mean(lens: &[usize], cols: usize) -> SegmentMeanCase {
    SegmentMeanCase {
        lens: lens.to_vec(),
        cols,
    }
}

impl OpCase for SegmentMeanCase {
    fn name(&self) -> String {
        format!("segment_mean {:?} × {}", self.lens, self.cols)
    }

    fn op(&self) -> Op {
        Op::SegmentMean
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let (rows, n, cols) = (self.lens.iter().sum(), self.lens.len(), self.cols);
        let x = Guarded::drawn(
            be,
            Role::Compute,
            Layout::padded(rows, cols, 0, 8),
            rng,
            4.0,
        )?;
        let segs = be.segments(&self.lens)?;
        let mut out = Guarded::empty(be, Role::Stream, Layout::padded(n, cols, 0, 8))?;
        be.segment_mean(x.view(), &segs, out.view_mut())?;
        Ok(vec![out.read(be, "out")?])
    }
}

/// Learned 2-D positions added in place: a `[2, axis, dim]` table (x rows, then y rows).
#[derive(Clone, Debug)]
pub struct PositionsCase {
    grids: Vec<(usize, usize)>,
    axis: usize,
    dim: usize,
    stored: DType,
    x: Role,
}

/// Positions of every patch of `grids` from a bf16 table into f32 rows.
pub fn add_positions_2d(grids: &[(usize, usize)], axis: usize, dim: usize) -> PositionsCase {
    PositionsCase {
        grids: grids.to_vec(),
        axis,
        dim,
        stored: DType::BF16,
        x: Role::Stream,
    }
}

impl PositionsCase {
    pub fn stored(self, stored: DType) -> Self {
        PositionsCase { stored, ..self }
    }
    pub fn into_role(self, x: Role) -> Self {
        PositionsCase { x, ..self }
    }
}

impl OpCase for PositionsCase {
    fn name(&self) -> String {
        let PositionsCase { axis, dim, .. } = *self;
        format!(
            "add_positions_2d grids {:?} from a 2×{axis}×{dim} {} table into {:?}",
            self.grids, self.stored, self.x
        )
    }

    fn op(&self) -> Op {
        Op::AddPositions2d
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let PositionsCase { axis, dim, .. } = *self;
        let values = rng.vec(2 * axis * dim, 1.0);
        let weights = checkpoint("pos", &[2, axis, dim], self.stored, &values)?;
        let table = be.table(&weights, "pos", &[2, axis, dim])?;
        let pos: Vec<u32> = patches(&self.grids)
            .flat_map(|(x, y)| [x as u32, y as u32])
            .collect();
        let rows = pos.len() / 2;
        let pos = indices(be, &pos)?;
        let mut x = Guarded::drawn(be, self.x, Layout::padded(rows, dim, 8, 8), rng, 2.0)?;
        be.add_positions_2d(&table, axis, &pos, x.view_mut())?;
        Ok(vec![x.read(be, "x")?])
    }
}

/// `kernel × kernel` average pooling of every grid, times `scale`.
#[derive(Clone, Debug)]
pub struct PoolCase {
    grids: Vec<(usize, usize)>,
    kernel: usize,
    cols: usize,
    scale: f32,
    from: Role,
    to: Role,
}

/// f32 rows into f32 rows, scale 1.
pub fn avg_pool2d(grids: &[(usize, usize)], kernel: usize, cols: usize) -> PoolCase {
    PoolCase {
        grids: grids.to_vec(),
        kernel,
        cols,
        scale: 1.0,
        from: Role::Stream,
        to: Role::Stream,
    }
}

impl PoolCase {
    pub fn scale(self, scale: f32) -> Self {
        PoolCase { scale, ..self }
    }
    pub fn roles(self, from: Role, to: Role) -> Self {
        PoolCase { from, to, ..self }
    }
}

impl OpCase for PoolCase {
    fn name(&self) -> String {
        let PoolCase {
            kernel,
            cols,
            scale,
            ..
        } = *self;
        format!(
            "avg_pool2d {kernel}×{kernel} of grids {:?} × {cols} × {scale} {:?} → {:?}",
            self.grids, self.from, self.to
        )
    }

    fn op(&self) -> Op {
        Op::AvgPool2d
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let cols = self.cols;
        let grids = be.grids(&self.grids, self.kernel)?;
        let (rows, pooled) = (grids.patches(), grids.pooled());
        let x = Guarded::drawn(be, self.from, Layout::padded(rows, cols, 0, 8), rng, 2.0)?;
        let mut out = Guarded::empty(be, self.to, Layout::padded(pooled, cols, 8, 0))?;
        be.avg_pool2d(x.view(), &grids, self.scale, out.view_mut())?;
        Ok(vec![out.read(be, "out")?])
    }
}

/// `rows` source rows into every other row, from the end, of `2·rows + 3` destination rows.
#[derive(Clone, Debug)]
pub struct ScatterCase {
    rows: usize,
    cols: usize,
    from: Role,
    to: Role,
}

/// f32 rows into f32 rows.
pub fn scatter_rows(rows: usize, cols: usize) -> ScatterCase {
    ScatterCase {
        rows,
        cols,
        from: Role::Stream,
        to: Role::Stream,
    }
}

impl ScatterCase {
    pub fn roles(self, from: Role, to: Role) -> Self {
        ScatterCase { from, to, ..self }
    }
}

impl OpCase for ScatterCase {
    fn name(&self) -> String {
        let ScatterCase { rows, cols, .. } = *self;
        format!(
            "scatter_rows {rows}×{cols} into {} rows {:?} → {:?}",
            2 * rows + 3,
            self.from,
            self.to
        )
    }

    fn op(&self) -> Op {
        Op::ScatterRows
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let ScatterCase { rows, cols, .. } = *self;
        let dst_rows = 2 * rows + 3;
        let src = Guarded::drawn(be, self.from, Layout::padded(rows, cols, 8, 0), rng, 2.0)?;
        // The rows left alone keep what they held.
        let at = Layout::padded(dst_rows, cols, 0, 8);
        let mut dst = Guarded::drawn(be, self.to, at, rng, 1.0)?;
        let to: Vec<u32> = (0..rows).map(|i| (dst_rows - 1 - 2 * i) as u32).collect();
        let to = indices(be, &to)?;
        be.scatter_rows(src.view(), &to, dst.view_mut())?;
        Ok(vec![dst.read(be, "dst")?])
    }
}

/// What a row of an [`ArgmaxCase`] holds, around values drawn in `[-1, 1)` (rounded to bf16, so
/// equal values, several maxima among them, are common in a long row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgmaxRow {
    /// Drawn values only.
    Drawn,
    /// 2.0, above everything drawn, at up to three places: the first of them wins, though a
    /// later one may lie in a lower thread's columns.
    Ties,
    /// −∞ everywhere: no value above −∞, so 0.
    NegInf,
    /// −∞ everywhere but −3.0 at the last column.
    LastFinite,
    /// +∞ at the tie places, −∞ and 2.0 elsewhere among drawn values: the first +∞.
    PosInf,
    /// A NaN after a 2.0: the row is flagged, whatever its largest value.
    Nan,
}

/// Every kind, in the order a case's rows cycle through them.
pub const ARGMAX_ROWS: [ArgmaxRow; 6] = [
    ArgmaxRow::Ties,
    ArgmaxRow::NegInf,
    ArgmaxRow::Nan,
    ArgmaxRow::PosInf,
    ArgmaxRow::Drawn,
    ArgmaxRow::LastFinite,
];

/// Greedy decoding's token of `rows` rows of `cols` logits; row `r` is of kind
/// `ARGMAX_ROWS[(first + r) % 6]`.
#[derive(Clone, Debug)]
pub struct ArgmaxCase {
    rows: usize,
    cols: usize,
    first: ArgmaxRow,
    from: Role,
}

/// f32 rows, starting with a row of ties.
pub fn argmax_rows(rows: usize, cols: usize) -> ArgmaxCase {
    ArgmaxCase {
        rows,
        cols,
        first: ArgmaxRow::Ties,
        from: Role::Stream,
    }
}

impl ArgmaxCase {
    /// Rows starting from one of `kind`.
    pub fn first(self, first: ArgmaxRow) -> Self {
        ArgmaxCase { first, ..self }
    }

    /// Rows in the compute type (bf16 under bf16).
    pub fn from(self, from: Role) -> Self {
        ArgmaxCase { from, ..self }
    }

    /// The values of one row of `kind`.
    fn row(&self, kind: ArgmaxRow, rng: &mut Rng) -> Vec<f32> {
        let cols = self.cols;
        let mut v = rng.vec(cols, 1.0);
        // Three places spread over the row (fewer where it is short); with 1024 threads a
        // block, at 65,536 columns the first lies in thread 1's columns and the second in
        // thread 0's.
        let places = [cols * 3 / 8 + 1, cols / 2, cols - 1].map(|p| p.min(cols - 1));
        match kind {
            ArgmaxRow::Drawn => {}
            ArgmaxRow::Ties => places.iter().for_each(|&p| v[p] = 2.0),
            ArgmaxRow::NegInf => v.fill(f32::NEG_INFINITY),
            ArgmaxRow::LastFinite => {
                v.fill(f32::NEG_INFINITY);
                v[cols - 1] = -3.0;
            }
            ArgmaxRow::PosInf => {
                v.iter_mut().step_by(3).for_each(|x| *x = f32::NEG_INFINITY);
                v[0] = 2.0;
                places.iter().for_each(|&p| v[p] = f32::INFINITY);
            }
            ArgmaxRow::Nan => {
                v[cols / 3] = 2.0;
                v[cols * 2 / 3] = f32::NAN;
            }
        }
        v
    }
}

impl OpCase for ArgmaxCase {
    fn name(&self) -> String {
        let ArgmaxCase {
            rows, cols, first, ..
        } = *self;
        format!("argmax_rows {rows}×{cols} from {first:?} {:?}", self.from)
    }

    fn op(&self) -> Op {
        Op::ArgmaxRows
    }

    /// Indices: exact.
    fn tol(&self, _: Precision) -> Tol {
        Tol {
            rel: 0.0,
            nmse: 0.0,
        }
    }

    fn run<B: Device>(&self, be: &B, rng: &mut Rng) -> Res<Vec<Output>> {
        let ArgmaxCase { rows, cols, .. } = *self;
        let start = ARGMAX_ROWS
            .iter()
            .position(|&k| k == self.first)
            .unwrap_or(0);
        let values: Vec<f32> = (0..rows)
            .flat_map(|r| self.row(ARGMAX_ROWS[(start + r) % ARGMAX_ROWS.len()], rng))
            .collect();
        let at = Layout::padded(rows, cols, 3, 5);
        let x = Guarded::new(be, self.from, at, Some(&values))?;
        // Unwritten indices keep the sentinel (no row has that many columns); the four after
        // the rows must keep it.
        const UNSET: u32 = 0xDEAD_BEEF;
        let mut out = indices(be, &vec![UNSET; rows + 4])?;
        be.argmax_rows(x.view(), &mut out)?;
        let got = be.read_u32(&out, rows + 4)?;
        if let Some(i) = (rows..rows + 4).find(|&i| got[i] != UNSET) {
            return Err(format!("wrote {:#x} at index {i}, past {rows} rows", got[i]).into());
        }
        if let Some(r) = (0..rows).find(|&r| got[r] != NAN_ROW && got[r] as usize >= cols) {
            return Err(format!("row {r}: index {} of {cols} columns", got[r]).into());
        }
        // NaN rows as −1, so the comparison sees a finite value.
        let values = got[..rows]
            .iter()
            .map(|&i| if i == NAN_ROW { -1.0 } else { i as f32 })
            .collect();
        Ok(vec![Output {
            what: "indices",
            values,
        }])
    }
}
