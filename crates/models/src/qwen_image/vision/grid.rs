//! Host tables of one image's patch grid, in the processor's merge-block row order: the learned
//! position rows resampled to the grid, and the 2-D rotary angles (transformers 5.25.0
//! `get_vision_interpolation_indices_and_weights` with `bilinear, align_corners=True`, and
//! `Qwen3VLVisionRotaryEmbedding`).

/// `(row, column)` of each patch of a `gh × gw` grid, in merge-block order: block rows, block
/// columns, then the block's `m × m` patches row-major.
pub fn block_order(gh: usize, gw: usize, m: usize) -> impl Iterator<Item = (usize, usize)> {
    let blocks_w = gw / m;
    (0..gh * gw).map(move |k| {
        let (block, inner) = (k / (m * m), k % (m * m));
        (
            (block / blocks_w) * m + inner / m,
            (block % blocks_w) * m + inner % m,
        )
    })
}

/// The two taps and their f32 weights of output `index` of `size` over a `side`-long axis
/// (`align_corners=True`: the ends map onto the ends), as the reference computes them in f32.
fn taps(index: usize, size: usize, side: usize) -> [(usize, f32); 2] {
    let src = index as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
    let floor = src.floor();
    let f = floor as usize;
    [0usize, 1].map(|o| {
        let w = (1.0 - (src - floor - o as f32).abs()).max(0.0);
        ((f + o).min(side - 1), w)
    })
}

/// The position rows `[gh·gw, c]` of a grid, merge-block order: each the bilinear blend of four
/// rows of the learned `side × side` table (`[side², c]`), weights the f32 products of the two
/// axes' weights, summed in f64 and rounded once.
pub fn position_rows(
    table: &[f32],
    side: usize,
    c: usize,
    gh: usize,
    gw: usize,
    m: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(gh * gw * c);
    let mut acc = vec![0f64; c];
    for (r, col) in block_order(gh, gw, m) {
        acc.fill(0.0);
        for (ty, wy) in taps(r, gh, side) {
            for (tx, wx) in taps(col, gw, side) {
                let w = (wy * wx) as f64;
                let src = &table[(ty * side + tx) * c..][..c];
                for (a, &s) in acc.iter_mut().zip(src) {
                    *a += w * s as f64;
                }
            }
        }
        out.extend(acc.iter().map(|&a| a as f32));
    }
    out
}

/// The rotary frequencies of heads of `head_dim`: `head_dim / 4` of them, `1 / θ^(2j / (head_dim/2))`,
/// shared by the row and column axes (computed as [`crate::blocks::rope::inv_freq`] does).
pub fn rope_inv_freq(theta: f64, head_dim: usize) -> Vec<f32> {
    crate::blocks::rope::inv_freq(theta, head_dim / 2)
}

/// Split-half rotary angles `[Σ gh·gw, head_dim / 2]`, one row per patch of the `(gh, gw)`
/// grids in turn (merge-block order): pairs `j < head_dim/4` turn by `row · f_j`, the others by
/// `column · f_(j − head_dim/4)`, each product in f32 as the reference's.
pub fn rope_angles(inv: &[f32], grids: &[(usize, usize)], m: usize) -> Vec<f32> {
    let n: usize = grids.iter().map(|&(h, w)| h * w).sum();
    let mut out = Vec::with_capacity(n * 2 * inv.len());
    for &(gh, gw) in grids {
        for (r, c) in block_order(gh, gw, m) {
            out.extend(inv.iter().map(|&f| r as f32 * f));
            out.extend(inv.iter().map(|&f| c as f32 * f));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_order_walks_merge_blocks() {
        let order: Vec<_> = block_order(2, 4, 2).collect();
        assert_eq!(
            order,
            [
                (0, 0),
                (0, 1),
                (1, 0),
                (1, 1),
                (0, 2),
                (0, 3),
                (1, 2),
                (1, 3)
            ]
        );
    }

    #[test]
    fn rotary_angles_follow_row_then_column() {
        let a = rope_angles(&[1.0, 0.5], &[(2, 2)], 2);
        // Patch 3 of the block is (1, 1); patch 1 is (0, 1).
        assert_eq!(&a[4..8], [0.0, 0.0, 1.0, 0.5]);
        assert_eq!(&a[12..16], [1.0, 0.5, 1.0, 0.5]);
    }

    #[test]
    fn corners_take_the_table_corners_and_the_middle_blends() {
        // A 2×2 table of one channel; a 3×3 grid of one patch per block.
        let table = [1.0, 2.0, 3.0, 4.0];
        let rows = position_rows(&table, 2, 1, 3, 3, 1);
        assert_eq!(rows[0], 1.0);
        assert_eq!(rows[2], 2.0);
        assert_eq!(rows[8], 4.0);
        assert_eq!(rows[4], 2.5);
        // One output along an axis reads the first source.
        assert_eq!(position_rows(&table, 2, 1, 1, 1, 1), [1.0]);
    }
}
