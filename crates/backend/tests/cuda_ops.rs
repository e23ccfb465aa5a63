//! Every op of the [`Backend`] trait on CUDA against the CPU reference: a table of cases in the
//! manner of llama.cpp's test-backend-ops.
//!
//! - [`cases`] lists them, one line each: odd shapes and the real model shapes (each annotated),
//!   grouped by op. A case (`tests/ops/`, one module per op family) names its parameters, the
//!   op it calls, how its inputs are drawn from the seed its name gives, and how it runs on any
//!   backend.
//! - Inputs are rounded to bf16, so both precisions see the same values. Every buffer is NaN
//!   outside the op's view (guard columns left and right, guard rows before and after): the
//!   guards must come back NaN (no write out of bounds), and every output element finite (an
//!   unwritten one stays NaN). Outputs are compared by relative max error (`max|a−b| / max|b|`)
//!   and NMSE, within [`Tol`].
//! - On a GPU machine, `cargo test -p tessera-backend --test cuda_ops -- --ignored --nocapture`
//!   runs every case in f32 and bf16: CUDA may decline an op (`supports`); the runs it declines
//!   must be exactly those [`declined_on_cuda`] lists, and everything else must match. `TESSERA_OP_CASE=attention` runs only the
//!   cases whose name contains `attention` (a failure prints the name to rerun it alone).
//! - Without a GPU (CI), [`every_op_has_cases`] checks the table covers the op set and
//!   [`every_case_runs_on_the_cpu`] runs each case on the CPU, so a broken case shows up before
//!   GPU time is spent on it.
#![cfg(feature = "cuda")]

mod ops;

use std::collections::{BTreeSet, HashSet};

use ops::attention::{attention, qkv};
use ops::gemm::{Blocks, Fp8, matmul};
use ops::image::{avg_down, conv2d, dup_up, group_norm};
use ops::norm::{layer, norm, plain, residual, rms};
use ops::rows::{
    ARGMAX_ROWS, ArgmaxRow, add_positions_2d, argmax_rows, avg_pool2d, cast, embed, gated,
    scatter_rows, segment_mean,
};
use ops::short_conv::short_conv;
use ops::{Case, Dev, Diff, Output, Table, Tol, catching, compare, measure};
use tessera_backend::cpu::CpuBackend;
use tessera_backend::cuda;
use tessera_backend::{
    Activation::{Gelu, GeluTanh, Silu},
    Backend, Epilogue, NormKind, OpKind, Precision,
    Role::{Compute, Stream},
    Run::{Block, Causal},
    View, ViewMut,
};
use tessera_core::DType;

/// The vision cases' patch grids: four images of 18, 108, 9 and 360 patches.
const GRIDS: &[(usize, usize)] = &[(6, 3), (9, 12), (3, 3), (24, 15)];

/// Every case, grouped by op in the order of [`OpKind::ALL`].
fn cases() -> Vec<Box<dyn Case>> {
    let mut t = Table::default();

    // ---- embed: rows of a checkpoint table, scaled, into f32 rows.
    t.add(embed(50, 97, 200).scale(1.5)); // bf16 storage, as the checkpoints
    t.add(embed(1, 97, 33).stored(DType::F32)); // one id, odd width, f32 storage
    t.add(embed(7, 130, 130));
    t.add(embed(17, 1000, 512).scale(22.627_417)); // EmbeddingGemma 2 text: × √512

    // ---- cast between buffer roles (f32 and the compute type).
    t.add(cast(301, 200, Compute, Stream));
    t.add(cast(7, 512, Stream, Compute)); // the residual stream as a GEMM input
    t.add(cast(1, 1, Stream, Compute));
    t.add(cast(33, 130, Compute, Compute));
    t.add(cast(130, 33, Stream, Stream));
    // Four values a thread where 4-vectors tile aligned rows (the cases above with 200 and 512
    // columns), past one pass of the grid here; one value a thread where an output row starts
    // off a vector.
    t.add(cast(2304, 1024, Stream, Compute));
    t.add(cast(96, 256, Stream, Compute).shifted(2));
    t.add(cast(64, 128, Compute, Stream).shifted(6));

    // ---- matmul: bare products, α = 0.75, into both output types.
    t.add(matmul(1, 512, 2048).alpha(0.75)); // EmbeddingGemma 2, W1 query: q|k|v, sliding layer
    t.add(matmul(1, 512, 2048).alpha(0.75).to(Compute));
    t.add(matmul(17, 512, 1536).alpha(0.75));
    t.add(matmul(17, 512, 1536).alpha(0.75).to(Compute));
    t.add(matmul(333, 768, 3072).alpha(0.75)); // vision tower MLP
    t.add(matmul(333, 768, 3072).alpha(0.75).to(Compute));
    t.add(matmul(2208, 2048, 512).alpha(0.75)); // MLP down projection of a long pass
    t.add(matmul(2208, 2048, 512).alpha(0.75).to(Compute));
    t.add(matmul(37, 104, 61).alpha(0.75));
    t.add(matmul(37, 104, 61).alpha(0.75).to(Compute));
    t.add(matmul(4096, 512, 12288).alpha(0.75)); // per-layer-embedding projection, 4096 tokens
    t.add(matmul(4096, 512, 12288).alpha(0.75).to(Compute));
    t.add(matmul(1, 7, 33));
    t.add(matmul(130, 33, 7).to(Compute));
    // Epilogues.
    t.add(matmul(33, 130, 7).bias()); // nn.Linear
    t.add(matmul(7, 64, 130).act(GeluTanh));
    t.add(matmul(64, 2560, 3072).bias().act(Gelu)); // LFM2-VL projector: 4·768 → 2560, erf GELU
    t.add(matmul(1, 256, 1024).bias().act(Silu)); // Z-Image t_embedder: Linear then SiLU
    t.add(matmul(17, 96, 33).gate());
    t.add(matmul(33, 384, 130).tanh_gate().accumulate()); // DiT: h += tanh(g) ⊙ (a · W_oᵀ)
    t.add(matmul(16, 3840, 3840).tanh_gate().accumulate()); // Z-Image attention output
    t.add(matmul(7, 33, 130).row_gate());
    t.add(matmul(130, 64, 33).row_tanh_gate().to(Compute));
    t.add(matmul(7, 33, 130).accumulate());
    // The epilogue four columns a thread where the output's columns are a multiple of 4 (most of
    // the above), else one a thread: the same posts on both sides of that line, and one past a
    // pass of the grid.
    t.add(matmul(33, 132, 7).bias());
    t.add(matmul(17, 98, 33).gate());
    t.add(matmul(130, 66, 33).row_tanh_gate().to(Compute));
    t.add(matmul(7, 68, 130).act(GeluTanh).to(Compute));
    t.add(matmul(4096, 1152, 64).bias());
    t.add(
        matmul(9, 130, 33)
            .alpha(0.5)
            .bias()
            .act(Silu)
            .row_gate()
            .accumulate(),
    );
    // FP8 e4m3 weights (per-tensor scale: a scaled FP8 file; per-row: --quantize fp8, stacked
    // q|k|v), bf16 judged by the floor of e4m3 activations (ops/gemm.rs). 1000 outputs are not
    // a multiple of 16 (the device pads the codes); 300 rows, a full block of the amax pass.
    for scales in [Fp8::Tensor, Fp8::Rows] {
        for (k, n) in [(512, 256), (1024, 1000)] {
            t.add(matmul(1, k, n).fp8(scales));
            t.add(matmul(7, k, n).fp8(scales).to(Compute));
            t.add(matmul(300, k, n).alpha(0.75).fp8(scales));
        }
    }
    t.add(matmul(7, 512, 256).fp8(Fp8::Tensor).accumulate());
    t.add(matmul(300, 1024, 1000).fp8(Fp8::Rows).accumulate());
    // Rows of x not 16-byte aligned (the quantization's one-pair-a-thread path), and more rows
    // than one outer-vector product takes (65,536: two products, each with its scale vector).
    t.add(matmul(300, 1024, 1000).fp8(Fp8::Rows).x_pad(1, 2));
    t.add(matmul(300, 512, 256).fp8(Fp8::Tensor).x_pad(3, 0));
    t.add(matmul(70_000, 16, 48).fp8(Fp8::Rows));
    t.add(matmul(300, 512, 256).fp8(Fp8::Tensor).bias().act(Silu)); // Z-Image t_embedder
    t.add(
        matmul(7, 1024, 1000)
            .fp8(Fp8::Rows)
            .bias()
            .act(GeluTanh)
            .to(Compute),
    );
    t.add(matmul(33, 512, 256).fp8(Fp8::Rows).tanh_gate().accumulate()); // DiT: h += tanh(g) ⊙ (a · W_oᵀ)
    // Stacked per-tensor parts (a scaled file's gate|up): 128|128 rows, a product per part
    // straight into the output; 500|500, one product and the column scales.
    t.add(matmul(300, 512, 256).fp8(Fp8::Parts).to(Compute));
    t.add(matmul(7, 1024, 1000).fp8(Fp8::Parts).accumulate());

    // GGUF block-format weights (kept as stored; blocks.rs): every format at 1 to 16 rows (the
    // decode kernels) and 17 and 64 (decoded to the workspace, then cuBLASLt), odd outputs (a
    // part-filled last CTA of four weight rows), an odd number of blocks a row (a part-filled
    // warp of chunks), rows of more than 256 chunks (a second pass of the CTA's threads), every
    // epilogue and β = 1, x rows that are not 16-byte aligned (the workspace path at few rows).
    for (q, k) in [
        (DType::Q8_0, 160),
        (DType::Q4_0, 160),
        (DType::Q4_K, 768),
        (DType::Q6_K, 768),
    ] {
        let one = Blocks::One(q);
        for m in [1, 2, 5, 16, 17, 64] {
            let out = if m % 2 == 0 { Compute } else { Stream };
            t.add(matmul(m, k, 131).alpha(0.75).blocks(one).to(out));
        }
        t.add(matmul(1, 9216, 67).blocks(one));
        t.add(matmul(3, 9216, 67).blocks(one).to(Compute));
        t.add(matmul(5, k, 131).blocks(one).bias().act(Silu));
        t.add(
            matmul(64, k, 131)
                .blocks(one)
                .bias()
                .act(GeluTanh)
                .to(Compute),
        );
        t.add(matmul(7, k, 131).alpha(0.5).blocks(one).accumulate());
        t.add(
            matmul(9, k, 131)
                .alpha(0.5)
                .blocks(one)
                .accumulate()
                .to(Compute),
        );
        t.add(matmul(33, k, 131).blocks(one).tanh_gate().accumulate());
        t.add(matmul(3, k, 131).blocks(one).row_gate());
        t.add(matmul(3, k, 131).blocks(one).x_pad(1, 2));
    }
    // Stacked parts in two formats (LFM2 Q4_K_M's q|k|v: Q4_K and Q6_K), a run each: 65|66 rows,
    // and LFM2-350M's 1024-wide q|k|v (1024 + 2·256 rows, here split 768|768).
    let q4k_q6k = Blocks::Parts(DType::Q4_K, DType::Q6_K);
    for m in [1, 7, 16, 17, 64] {
        t.add(matmul(m, 768, 131).blocks(q4k_q6k));
    }
    t.add(
        matmul(5, 768, 131)
            .blocks(q4k_q6k)
            .bias()
            .act(Silu)
            .to(Compute),
    );
    t.add(matmul(64, 768, 131).blocks(q4k_q6k).accumulate());
    t.add(
        matmul(16, 256, 131)
            .blocks(Blocks::Parts(DType::Q6_K, DType::Q8_0))
            .to(Compute),
    );
    t.add(matmul(1, 1024, 1536).blocks(q4k_q6k).to(Compute));
    t.add(matmul(300, 1024, 1536).blocks(q4k_q6k));
    // Qwen-Image's widest Q4_K product: 12288 decoded rows of 3072 fill the 64 MiB workspace
    // more than once (two column blocks in bf16, three in f32).
    t.add(matmul(40, 3072, 12288).blocks(Blocks::One(DType::Q4_K)));

    // Decoding's products (up to 16 bf16 rows: the GEMV kernel, 8-wide chunks of k spread over
    // a CTA's threads, four weight rows a CTA): LFM2's 1024-wide rows and 4608-wide MLP down
    // projection; k = 1000 leaves the last pass over k part-filled (125 chunks on 128 threads),
    // n = 1000 and 1003 a part-filled last CTA of weight rows (1003: three rows of four);
    // 3 and 7 rows run on the 4- and 8-row kernels; 17 rows go to cuBLASLt.
    t.add(matmul(1, 1024, 1024).alpha(0.75)); // LFM2-350M: one decoding row
    t.add(matmul(1, 1024, 1024).alpha(0.75).to(Compute));
    t.add(matmul(2, 4608, 1024).alpha(0.75)); // LFM2-350M MLP down projection
    t.add(matmul(2, 4608, 1000).to(Compute));
    t.add(matmul(3, 1000, 1000).alpha(0.75));
    t.add(matmul(3, 1000, 1024).alpha(0.75).to(Compute));
    t.add(matmul(7, 1024, 1000).accumulate()); // β = 1 into f32
    t.add(matmul(7, 4608, 1024).alpha(0.5).accumulate().to(Compute)); // β = 1 into bf16
    t.add(matmul(16, 1000, 1024).alpha(0.75));
    t.add(matmul(16, 4608, 1000).alpha(0.75).to(Compute));
    t.add(matmul(16, 1024, 1003).alpha(0.75));
    t.add(matmul(17, 1024, 1024).alpha(0.75)); // cuBLASLt
    t.add(matmul(17, 1000, 1000).alpha(0.75).to(Compute));
    // Their epilogues: in place on f32; through the product workspace into bf16 and adding.
    t.add(matmul(1, 1024, 1024).bias().act(Silu));
    t.add(matmul(3, 1024, 1000).bias().act(GeluTanh).to(Compute));
    t.add(
        matmul(2, 1000, 1024)
            .alpha(0.5)
            .bias()
            .act(Silu)
            .row_gate()
            .accumulate(),
    );
    // x rows the kernel's 16-byte loads cannot take, to cuBLASLt: an odd row stride; a first
    // row 14 bytes past a 16-byte boundary.
    t.add(matmul(3, 1024, 1024).alpha(0.75).x_pad(8, 9));
    t.add(matmul(2, 1024, 1000).to(Compute).x_pad(7, 9));

    // ---- norm. Rows of 128·k columns (512, 768, 1024) take the warp-per-row kernels (300 rows:
    // a partial last block of rows), the others the block-per-row ones.
    t.add(norm(1, 24, rms()));
    t.add(norm(7, 512, rms()));
    t.add(norm(300, 768, rms()));
    t.add(norm(64, 1024, rms()));
    t.add(norm(33, 1000, rms()));
    t.add(norm(5, 3840, rms()));
    t.add(norm(7, 512, rms()).from(Stream)); // EmbeddingGemma 2: stream → GEMM input
    t.add(norm(33, 768, plain(NormKind::Rms))); // embed_vision: RMSNorm without weight
    t.add(norm(7, 33, plain(NormKind::Rms)));
    t.add(norm(130, 130, rms()));
    t.add(norm(7, 130, layer())); // nn.LayerNorm
    t.add(norm(33, 1000, layer()));
    t.add(norm(1, 24, layer().modulated()));
    // Z-Image: the final LayerNorm without affine × (1 + scale); a modulated RMS pre-norm.
    t.add(norm(17, 3840, plain(NormKind::Layer).modulated()).from(Stream));
    t.add(norm(5, 3840, rms().eps(1e-5).modulated()).from(Stream));
    // Qwen-Image-2.1's VAE: SiLU ∘ RMS norm (eps 1e-24 / C) from the f32 stream, at a 144-wide
    // (vector kernel) and a 130-wide (block kernel) row and the decoder's 1,152-wide middle; GELU
    // (tanh) on a layer norm.
    t.add(norm(65, 144, rms().eps(1e-24 / 144.0).activated(Silu)).from(Stream));
    t.add(norm(9, 1152, rms().eps(1e-24 / 1152.0).activated(Silu)).from(Stream));
    t.add(norm(33, 130, rms().activated(Silu)));
    t.add(norm(7, 130, layer().activated(GeluTanh)));
    // Rows one warp holds go eight to a block (`row_norm_warps`): a row count off the eight,
    // bf16 in, a layer norm with bias, and a full warp's 1,024 columns.
    t.add(norm(1001, 288, rms().eps(1e-24 / 288.0).activated(Silu)));
    t.add(norm(13, 576, layer()).from(Stream));
    t.add(norm(11, 1024, rms()));
    // Narrower rows go several to a warp (`row_norm_warps{2,4,8}`): eight of up to 128 columns,
    // four of up to 256, two of up to 512, a last warp part-filled in each.
    t.add(norm(77, 96, layer()).from(Stream));
    t.add(norm(203, 128, rms().activated(Silu)));
    t.add(norm(1003, 256, layer()));
    t.add(norm(35, 512, layer().activated(Silu)).from(Stream));

    // ---- residual: Gemma's sandwich step h = (h + rms(y) · w) · 0.8, then nothing, the next
    // pre-norm or a copy, on the norms' shapes (warp and block kernels).
    t.add(residual(1, 24));
    t.add(residual(1, 24).then_norm(rms()));
    t.add(residual(1, 24).then_copy());
    t.add(residual(7, 512));
    t.add(residual(7, 512).then_norm(rms()));
    t.add(residual(7, 512).then_copy());
    t.add(residual(300, 768));
    t.add(residual(300, 768).then_norm(rms()));
    t.add(residual(300, 768).then_copy());
    t.add(residual(64, 1024));
    t.add(residual(64, 1024).then_norm(rms()));
    t.add(residual(64, 1024).then_copy());
    t.add(residual(33, 1000));
    t.add(residual(33, 1000).then_norm(rms()));
    t.add(residual(33, 1000).then_copy());
    t.add(residual(5, 3840));
    t.add(residual(5, 3840).then_norm(rms()));
    t.add(residual(5, 3840).then_copy());
    t.add(residual(7, 130).plain()); // h += y
    t.add(residual(7, 130).plain().then_copy());
    t.add(residual(17, 512).post(layer()));
    t.add(residual(7, 512).then_norm(plain(NormKind::Rms)));
    // Z-Image: h += tanh(g) ⊙ rms(y) · w, then the next modulated pre-norm.
    let z_norm = rms().eps(1e-5);
    let z_step = residual(33, 3840).post(z_norm).scale(1.0).tanh_gate();
    t.add(z_step.then_norm(z_norm.modulated()));

    // ---- qkv_norm_rope over 85 text rows (positions up to 4095) or the grids' patches.
    t.add(qkv(4, 2, 256).split_half(1e4)); // EmbeddingGemma 2 sliding layer: the 4-wide kernel
    t.add(qkv(4, 1, 512).split_half(1e6)); // full layer: the 4-wide kernel
    t.add(qkv(12, 12, 64).split_half(100.0));
    t.add(qkv(4, 2, 16).split_half(1e4)); // the tiny test model
    t.add(qkv(4, 1, 32).split_half(1e6));
    t.add(qkv(3, 3, 16).axial(100.0, GRIDS)); // axial 2-D, the scalar kernel
    t.add(qkv(2, 2, 64).axial(100.0, GRIDS)); // vision tower's 64-wide heads: the 8-lane kernel
    t.add(qkv(32, 8, 128).split_half(1e6).no_v_norm()); // Qwen3-4B (Z-Image's text encoder)
    t.add(qkv(4, 2, 256)); // norms alone
    t.add(qkv(3, 1, 6).split_half(1e4).weightless()); // an odd number of pairs
    t.add(qkv(2, 2, 16).split_half(1e4).rope_only()); // Qwen3-VL's vision tower: no q/k norms
    t.add(qkv(16, 16, 72).split_half(1e4).rope_only().no_v_norm()); // its real heads
    // Rotation only on each vector kernel: split-half 256, axial 64, interleaved 128.
    t.add(qkv(2, 1, 256).split_half(1e6).rope_only());
    t.add(qkv(2, 2, 64).axial(100.0, GRIDS).rope_only());
    t.add(qkv(2, 1, 128).interleaved(256.0).rope_only());
    t.add(qkv(4, 4, 128).interleaved(256.0)); // complex-pair RoPE
    // Four 128-wide heads a warp, counted on from the warp's first: 5 and 7 heads a row, so a
    // warp's heads cross rows (value heads skipped across them in the second).
    t.add(qkv(3, 1, 128).interleaved(256.0));
    t.add(qkv(5, 1, 128).interleaved(1e4).no_v_norm());
    t.add(qkv(2, 1, 6).interleaved(1e4).no_v_norm());
    t.add(qkv(4, 4, 128).multi_axis(256.0, [32, 48, 48], 7, (6, 4))); // Z-Image's 3-axis RoPE

    // ---- attention, each on every path (bf16: each flash kernel whole and in 2, 3, 8 chunks;
    // over a cache, the one cached kernel whole and in 2, 3, 8 and 64 chunks per query row).
    let every = |t: &mut Table, c: ops::attention::AttentionCase| t.add_all(c.on_every_path());
    every(&mut t, attention(&[17], 4, 2, 256).window(512)); // W1 query, sliding layer
    every(&mut t, attention(&[17], 4, 1, 512)); // W1 query, full layer
    every(&mut t, attention(&[1100], 4, 2, 256).window(512)); // window narrower than the input
    every(&mut t, attention(&[700, 1, 300], 4, 1, 512)); // MQA, ragged tiles
    every(&mut t, attention(&[256; 6], 4, 2, 256).window(512)); // W3: packed documents
    every(&mut t, attention(&[5, 70, 3, 130, 64], 4, 2, 16).window(3)); // window cuts segments
    every(&mut t, attention(&[9, 200, 65], 4, 1, 32)); // tiny model, full layer
    every(&mut t, attention(&[2394], 12, 12, 64)); // vision tower, one 280-budget image
    every(&mut t, attention(&[300, 129], 12, 12, 64)); // two images packed
    every(&mut t, attention(&[77, 150], 2, 2, 128).causal()); // text encoders of DiTs
    // The warp-specialized kernel's 128-row tiles: ragged, a one-row segment, GQA, a window.
    every(&mut t, attention(&[700, 129, 1], 4, 2, 128));
    every(&mut t, attention(&[390], 2, 2, 128).window(100));
    every(&mut t, attention(&[260, 3], 4, 4, 64).window(70));
    // 16-wide heads, causal over several query tiles: a bf16 run of the LFM2-VL miniature's
    // 4-head LM (85- and 393-row prompts) ended in an illegal address (2026-12-04, run 2).
    every(&mut t, attention(&[85, 50], 4, 2, 16).causal());
    every(&mut t, attention(&[393], 4, 2, 16).causal());
    every(&mut t, attention(&[85], 2, 1, 64).causal()); // the miniature's LM now (heads of 64)
    // 72-wide heads (the SigLIP2 towers of LFM2-VL-1.6B/3B, Qwen3-VL's in the Qwen-Image edit):
    // bf16 on the mma.sync kernel, q·kᵀ over columns zero-padded to 80 and P·V over 9 n-tiles;
    // every mask, odd segment lengths, the models' scale 1/√72.
    every(&mut t, attention(&[1024, 234], 16, 16, 72));
    every(
        &mut t,
        attention(&[63, 129, 5, 1], 4, 4, 72).scale(72f32.sqrt().recip()),
    );
    every(&mut t, attention(&[77, 1, 150], 4, 2, 72).causal());
    every(&mut t, attention(&[200, 3], 2, 2, 72).window(40));
    let blocks: &[&[_]] = &[&[Causal(5), Block(64), Causal(2)], &[Block(9)]];
    every(&mut t, attention(&[71, 9], 4, 2, 72).block_causal(blocks));
    // A width no tensor-core or key-range kernel is built for: bf16 takes the row kernel.
    t.add(attention(&[70, 1, 33], 4, 2, 24));
    t.add(attention(&[90], 2, 2, 40).window(9));
    t.add(attention(&[90], 2, 2, 40).causal());
    // 1152-wide single heads (Qwen-Image-2.1's VAE mid-block, q|k|v slices of one 3456-wide
    // row): bf16 on the tensor cores, f32 on the key-range kernel over each segment's own rows.
    every(&mut t, attention(&[37, 300], 1, 1, 1152)); // ragged tiles, logits up to ±10
    let vae = attention(&[1, 129], 1, 1, 1152).scale(1152f32.sqrt().recip());
    every(&mut t, vae); // a one-row segment; the model's scale
    every(&mut t, attention(&[77, 150], 1, 1, 1152).causal()); // the other masks run too
    t.add(attention(&[4096], 1, 1, 1152)); // a 1024² image's 64×64 latent
    let wide = attention(&[3, 1], 1, 1, 1152).cached(&[(40, 33), (0, 39)], 80);
    every(&mut t, wide); // over key ranges: one head per CTA
    // 768 (the VAE encoder's mid-block) on the same kernels.
    every(&mut t, attention(&[37, 300], 1, 1, 768));
    every(
        &mut t,
        attention(&[1, 129], 1, 1, 768).scale(768f32.sqrt().recip()),
    );
    t.add(attention(&[4096], 1, 1, 768)); // a 1024² image's 64×64 latent
    every(&mut t, attention(&[64, 63, 65], 4, 2, 64).window(0)); // each token sees itself
    let qwen3 = attention(&[33, 1, 130], 32, 8, 128).causal();
    every(&mut t, qwen3.scale(128f32.sqrt().recip())); // Qwen3-4B prompts
    // Qwen-Image: a causal text prefix, then image blocks that see themselves whole. Per-row key
    // limits run on every flash kernel (bf16), whole and split.
    let blocks: &[&[_]] = &[&[Causal(7), Block(33), Causal(1), Block(20)]];
    every(&mut t, attention(&[61], 4, 2, 128).block_causal(blocks));
    let blocks: &[&[_]] = &[&[Causal(5), Block(7)], &[Block(4), Causal(1)]];
    every(&mut t, attention(&[12, 5], 2, 1, 64).block_causal(blocks));
    // Limits at the flash kernels' edges: an image block first, then causal text; a block
    // ending exactly at a 64-row tile's edge and text ending at a 128-row wide tile's (limits
    // 64, 65 and 128, so a tile's last key block is whole, one key, or absent); a first row that
    // sees one key beside rows that see 131, so its later key chunks are empty in a split; a
    // three-row block alone; causal text as limits over two tiles.
    let blocks: &[&[_]] = &[
        &[Block(64), Causal(64), Block(65), Causal(7)],
        &[Causal(1), Block(130)],
        &[Block(3)],
        &[Causal(70)],
    ];
    every(
        &mut t,
        attention(&[200, 131, 3, 70], 4, 2, 128).block_causal(blocks),
    );
    every(
        &mut t,
        attention(&[200, 131, 3, 70], 2, 1, 64).block_causal(blocks),
    );
    // The edit's prefix at the model's scale: text, a 32×32 condition block, text (the DiT has
    // 24 heads of 128; 4 here).
    let blocks: &[&[_]] = &[&[Causal(40), Block(1024), Causal(30)]];
    let prefix = attention(&[1094], 4, 4, 128).scale(128f32.sqrt().recip());
    every(&mut t, prefix.block_causal(blocks));
    // Block-causal at odd sizes, as the op picks the kernel (bf16: the flash kernels at 128 and
    // 1152, the row kernel at 24): one-row segments and blocks, rows across many tiles.
    let blocks: &[&[_]] = &[
        &[Block(1)],
        &[Causal(20), Block(129), Causal(1), Block(150)],
        &[Causal(1)],
    ];
    t.add(attention(&[1, 300, 1], 4, 2, 128).block_causal(blocks));
    let blocks: &[&[_]] = &[&[Causal(3), Block(1), Block(33)], &[Block(2)]];
    t.add(attention(&[37, 2], 4, 2, 24).block_causal(blocks));
    t.add(attention(&[37, 2], 1, 1, 1152).block_causal(blocks));
    // Keys from a cache with gaps: a prefill after a prefix, one decoded token, a whole prompt.
    let ranges = [(3, 40), (60, 17), (100, 33)];
    every(
        &mut t,
        attention(&[5, 1, 33], 4, 2, 64).cached(&ranges, 140),
    );
    every(
        &mut t,
        attention(&[5, 1, 33], 4, 2, 64)
            .cached(&ranges, 140)
            .causal(),
    );
    every(
        &mut t,
        attention(&[5, 1, 33], 4, 2, 64)
            .cached(&ranges, 140)
            .window(8),
    );
    // A cached text prefix, then image queries seeing their block whole; one decoded token.
    let blocks: &[&[_]] = &[&[Causal(16), Block(4)], &[Causal(9)]];
    let prefix = attention(&[4, 1], 4, 2, 128).cached(&[(0, 20), (30, 9)], 45);
    every(&mut t, prefix.block_causal(blocks));
    // Decoding a batch (LFM2): 8 sequences of one query row over 1 to 3,000 keys each, their
    // ranges in the cache in reverse order with gaps.
    let (ranges, rows) = scattered(&[1, 3000, 7, 129, 2000, 64, 1000, 500]);
    let decode = |heads_q| attention(&[1; 8], heads_q, 8, 64).cached(&ranges, rows);
    every(&mut t, decode(16).causal()); // LFM2-350M: 16 q heads on 8 kv heads
    every(&mut t, decode(32).causal()); // LFM2-1.2B: 32 on 8
    // A second user turn: 7 rows appended to a cache of 33.
    let turn = attention(&[7], 16, 8, 64).cached(&[(21, 40)], 64);
    every(&mut t, turn.causal());
    // A first token (a single key) beside a sequence of two.
    let first = attention(&[1, 1], 16, 8, 64).cached(&[(9, 1), (2, 2)], 12);
    every(&mut t, first.causal());
    // Ranges out of order, prompts and steps mixed; other head widths and groups: MQA, 3 q heads
    // per kv head, none shared, 12 (three blocks of q heads) with a prompt that is all its keys.
    let mqa = attention(&[3, 1, 2], 4, 1, 128).cached(&[(90, 30), (0, 50), (51, 20)], 125);
    every(&mut t, mqa);
    let threes = attention(&[2, 1], 6, 2, 72).cached(&[(40, 33), (0, 39)], 80);
    every(&mut t, threes.causal());
    let unshared = attention(&[1, 4], 8, 8, 96).cached(&[(70, 200), (3, 60)], 280);
    every(&mut t, unshared.causal());
    let twelves = attention(&[5, 1], 12, 1, 32).cached(&[(10, 5), (0, 9)], 16);
    every(&mut t, twelves.causal());

    // ---- gated: the 16-byte vector kernel where whole vectors tile aligned rows, else scalar.
    t.add(gated(301, 200, GeluTanh));
    t.add(gated(301, 200, Silu));
    t.add(gated(7, 33, GeluTanh)); // scalar
    t.add(gated(7, 33, Silu)); // scalar
    t.add(gated(130, 130, Silu)); // scalar (130 is no multiple of 4)
    t.add(gated(1, 2048, GeluTanh)); // EmbeddingGemma 2 MLP, one token
    t.add(gated(33, 9728, Silu)); // Qwen3-4B MLP

    // ---- segment_mean.
    t.add(segment_mean(&[100, 1, 0, 200], 200)); // an empty segment among them
    t.add(segment_mean(&[7], 33));
    t.add(segment_mean(&[17, 1, 130], 768)); // EmbeddingGemma 2 mean pooling

    // ---- add_positions_2d, avg_pool2d, scatter_rows: the vision tower's rows.
    t.add(add_positions_2d(GRIDS, 40, 72).stored(DType::F32));
    t.add(add_positions_2d(&[(1, 1), (7, 3)], 8, 33).into_role(Compute));
    t.add(add_positions_2d(&[(48, 48)], 64, 768)); // EmbeddingGemma 2: a 768² image
    t.add(avg_pool2d(GRIDS, 3, 72).scale(1.5));
    t.add(avg_pool2d(&[(2, 2), (4, 6)], 2, 33).roles(Compute, Stream));
    t.add(avg_pool2d(&[(48, 48)], 3, 768).scale(768f32.sqrt())); // EmbeddingGemma 2: × √768
    t.add(scatter_rows(55, 72)); // the grids' pooled rows into a longer sequence
    t.add(scatter_rows(64, 512)); // EmbeddingGemma 2: an image's soft tokens into the text
    t.add(scatter_rows(1, 512).roles(Compute, Compute)); // a new k|v row into a cache
    t.add(scatter_rows(7, 33).roles(Stream, Compute));

    // ---- conv2d (Z-Image's VAE decoder and odd edges), each as the op picks, then (bf16) forced
    // through im2col and, where it applies, through the implicit GEMM.
    t.add_all(conv2d(7, 9, 512, 256, 1).on_every_path()); // the 1×1 shortcut
    t.add_all(conv2d(6, 5, 16, 512, 3).on_every_path()); // conv_in
    t.add_all(conv2d(9, 7, 128, 3, 3).on_every_path()); // conv_out
    t.add_all(conv2d(5, 3, 64, 64, 3).upsampled().on_every_path()); // an up block: nearest 2× then 3×3
    t.add_all(conv2d(4, 4, 256, 256, 3).upsampled().on_every_path());
    t.add_all(conv2d(1, 1, 7, 33, 3).on_every_path()); // one pixel: every tap but the centre is padding
    t.add_all(conv2d(13, 1, 3, 8, 5).on_every_path()); // a 5×5 kernel over a one-pixel-wide image
    t.add_all(conv2d(6, 5, 16, 512, 3).from(Stream).on_every_path()); // conv_in reads the f32 latent
    t.add_all(
        conv2d(5, 3, 64, 64, 3)
            .upsampled()
            .from(Stream)
            .on_every_path(),
    ); // upsampling reads the f32 stream
    t.add_all(conv2d(7, 9, 512, 256, 1).from(Stream).on_every_path()); // the shortcut reads the f32 stream
    // Qwen-Image-2.1's VAE: RMS_norm → SiLU → conv, the activation fused into the gather.
    t.add_all(conv2d(6, 5, 288, 144, 3).of(Silu).on_every_path()); // a resnet's first conv, 288→144
    t.add_all(conv2d(5, 3, 144, 4, 3).of(Silu).on_every_path()); // conv_out into RGBA
    t.add_all(conv2d(4, 6, 72, 40, 1).of(Silu).on_every_path()); // 1×1: the activation skips the bare product
    t.add_all(
        conv2d(5, 3, 7, 9, 3)
            .of(GeluTanh)
            .from(Stream)
            .on_every_path(),
    ); // odd widths: one channel a thread
    // Its encoder's down blocks: stride 2 over the image padded at the bottom and right.
    t.add_all(
        conv2d(10, 6, 96, 96, 3)
            .downsampled()
            .from(Stream)
            .on_every_path(),
    );
    t.add_all(conv2d(2, 4, 7, 9, 3).downsampled().on_every_path());
    t.add_all(conv2d(8, 14, 12, 20, 3).downsampled().on_every_path()); // 4-wide gathers, a 4×7 output
    t.add_all(
        conv2d(2, 2, 16, 8, 3)
            .downsampled()
            .from(Compute)
            .on_every_path(),
    ); // one output pixel
    // The implicit GEMM's tiles (128 pixels × 128 or 64 channels, 32 input channels a step) at
    // the VAE decoders' widths, at edges: pixel counts and output channels off the tile, input
    // channels off the 32-wide step.
    t.add_all(conv2d(13, 11, 128, 128, 3).on_every_path()); // 143 pixels: two tiles, one short
    t.add_all(conv2d(9, 10, 256, 256, 3).on_every_path());
    t.add_all(conv2d(6, 5, 512, 512, 3).on_every_path()); // the mid block's width
    t.add_all(conv2d(5, 6, 512, 512, 3).upsampled().on_every_path()); // up block 1: 10×12
    t.add_all(conv2d(6, 7, 256, 256, 3).upsampled().on_every_path()); // 12×14: two tiles
    t.add_all(conv2d(11, 13, 128, 192, 3).on_every_path()); // a half-filled channel tile
    t.add_all(conv2d(7, 9, 256, 96, 3).on_every_path()); // 96 of a 128-channel tile
    t.add_all(conv2d(12, 11, 128, 40, 3).on_every_path()); // 40 of a 64-channel tile
    t.add_all(conv2d(12, 10, 128, 128, 3).downsampled().on_every_path()); // stride 2 in bf16
    t.add_all(conv2d(9, 8, 96, 96, 3).of(Silu).on_every_path()); // 3 input-channel steps
    t.add_all(conv2d(7, 5, 40, 24, 3).of(Silu).on_every_path()); // a step of 8 of 32 channels
    t.add_all(conv2d(4, 5, 64, 64, 3).upsampled().of(Silu).on_every_path());
    t.add_all(conv2d(11, 12, 128, 256, 1).of(Silu).on_every_path()); // 1×1 implicit
    t.add_all(conv2d(1, 1, 8, 8, 3).on_every_path()); // one pixel, 8 channels
    // The 144-channel tile (Qwen-Image-2.1's decoder at full resolution) and a reduction that
    // runs over (ky, kx, c) flattened, so a 64-wide step spans taps: 144 and 288 input channels
    // (2¼ and 4½ steps a tap), 24 (a step holds 2⅔ taps), two 144-wide tiles, a short one.
    t.add_all(conv2d(13, 11, 144, 144, 3).on_every_path()); // 143 pixels, the 144 tile
    t.add_all(conv2d(9, 10, 288, 144, 3).upsampled().on_every_path());
    t.add_all(conv2d(7, 6, 144, 288, 3).on_every_path()); // two 144-channel tiles
    t.add_all(conv2d(10, 9, 24, 136, 3).on_every_path()); // 136 of a 144-channel tile
    t.add_all(conv2d(6, 7, 144, 144, 3).added_to(Stream).on_every_path());
    // The warp-specialized kernel's tiles (256 pixels × 128 or 144 channels, 128 × 256): several
    // pixel tiles, the last short; reductions that wrap its four stages many times; the weight's
    // columns and rows past its end from the tensor map's zero fill.
    t.add_all(conv2d(23, 25, 144, 144, 3).on_every_path()); // 575 pixels: three tiles
    t.add_all(conv2d(11, 14, 576, 288, 3).on_every_path()); // 81 steps, two channel tiles
    t.add_all(conv2d(9, 12, 1152, 576, 3).on_every_path()); // Qwen-Image-2.1's widest, 162 steps
    t.add_all(conv2d(17, 9, 256, 512, 3).upsampled().on_every_path()); // 306 pixels on 128-pixel tiles
    t.add_all(conv2d(19, 21, 96, 200, 3).added_to(Stream).on_every_path()); // 200 of 256 channels
    t.add_all(conv2d(18, 16, 128, 128, 3).downsampled().on_every_path());
    // A resnet's second convolution added into the f32 stream (its residual add fused), on each
    // kernel: 128 channels (wgmma 128-tile), 512 (im2col + cuBLASLt with β = 1), a short channel
    // tile, upsampled, a 1×1 (the bare product), and into a bf16 output.
    t.add_all(conv2d(13, 11, 128, 128, 3).added_to(Stream).on_every_path());
    t.add_all(conv2d(6, 5, 512, 512, 3).added_to(Stream).on_every_path());
    t.add_all(conv2d(12, 11, 128, 40, 3).added_to(Stream).on_every_path());
    t.add_all(conv2d(9, 7, 256, 256, 3).added_to(Stream).on_every_path());
    t.add_all(
        conv2d(5, 6, 64, 96, 3)
            .upsampled()
            .added_to(Stream)
            .on_every_path(),
    );
    t.add_all(conv2d(7, 9, 512, 256, 1).added_to(Stream).on_every_path());
    t.add_all(
        conv2d(6, 5, 96, 96, 3)
            .of(Silu)
            .added_to(Compute)
            .on_every_path(),
    );

    // ---- dup_up (Qwen-Image-2.1's / Wan 2.2's residual up blocks), added into the f32 stream.
    t.add(dup_up(6, 5, 64, 64, 2)); // in = out: a nearest 2× upsampling
    t.add(dup_up(5, 7, 96, 48, 2)); // 1152→576: channel 2o + 1, the last temporal slot
    t.add(dup_up(7, 3, 48, 24, 1)); // 576→288: channel 2o + sy
    t.add(dup_up(3, 4, 40, 10, 2)); // in = 4·out
    t.add(dup_up(1, 1, 3, 6, 1)); // more output than input channels, one pixel
    t.add(dup_up(5, 7, 96, 48, 2).from(Compute)); // from the compute type
    // Four output channels a thread (cout a multiple of 4, as above but for 10 and 6), here past
    // one pass of the grid.
    t.add(dup_up(128, 96, 96, 48, 2));

    // ---- avg_down (Qwen-Image-2.1's residual VAE encoder down blocks), added into the stream.
    t.add(avg_down(6, 10, 48, 48, 1, 2)); // 96→96: a 2×2 mean per channel
    t.add(avg_down(10, 6, 48, 96, 2, 2)); // 96→192: odd channels the 2×2 mean, even ones zero
    t.add(avg_down(4, 4, 12, 3, 1, 2)); // g = 16: groups across channels
    t.add(avg_down(3, 5, 10, 5, 1, 1)); // the last block's channel-group mean
    t.add(avg_down(2, 2, 3, 6, 2, 2)); // one output pixel, g = 4 across the zero frame
    t.add(avg_down(8, 6, 192, 384, 1, 2)); // g = 2 within one input channel's 2×2

    // ---- group_norm.
    t.add(group_norm(63, 128, 32).then(Silu)); // the VAE's GroupNorm(32) → SiLU
    t.add(group_norm(20, 512, 32)); // the mid block's attention norm
    t.add(group_norm(13, 96, 3).then(GeluTanh));
    t.add(group_norm(1, 7, 7)); // one value a group: the output is the bias
    t.add(group_norm(63, 128, 32).then(Silu).from(Stream)); // a resnet's first norm reads the f32 stream
    t.add(group_norm(33, 64, 16).unaligned()); // four channels a group, rows off the quads

    // ---- short_conv (LFM2): a prefill from zeros, decode steps continuing their state, and a
    // mixed batch; a segment shorter than the kernel keeps part of its old state.
    t.add(short_conv(&[(37, 0)], 1024, 3)); // LFM2-350M prefill
    t.add(short_conv(&[(1, 40), (1, 7), (1, 1)], 1024, 3)); // three decode steps
    t.add(short_conv(&[(5, 0), (1, 9), (1, 1), (3, 2)], 33, 3).bias());
    t.add(short_conv(&[(2, 0), (1, 2)], 130, 4)); // rows fewer than the taps
    t.add(short_conv(&[(3, 0), (0, 4), (0, 0), (1, 2)], 64, 3)); // empty segments: kept, zeroed
    t.add(short_conv(&[(1, 40); 8], 2048, 3)); // LFM2-1.2B: a batch of 8 decode steps
    t.add(short_conv(&[(1, 0), (1, 2), (1, 5)], 40, 4).bias()); // one-row segments, one from zeros

    // ---- argmax_rows: greedy decoding's tokens. Rows cycle through ties, all −∞, a NaN, +∞,
    // drawn values and −∞ but the last; exact indices (a NaN row as the flag).
    for kind in ARGMAX_ROWS {
        t.add(argmax_rows(1, 65536).first(kind)); // LFM2's vocabulary, one sequence
    }
    t.add(argmax_rows(3, 65536));
    t.add(argmax_rows(32, 65536)); // 32 streams decoding
    t.add(argmax_rows(32, 65536).from(Compute)); // bf16 logits under bf16
    t.add(argmax_rows(1, 1000).first(ArgmaxRow::Drawn));
    t.add(argmax_rows(3, 1000));
    t.add(argmax_rows(32, 1000).first(ArgmaxRow::PosInf));
    t.add(argmax_rows(1, 7).first(ArgmaxRow::Ties));
    t.add(argmax_rows(3, 7).first(ArgmaxRow::Nan));
    t.add(argmax_rows(32, 7).from(Compute));

    t.0
}

/// Key ranges of `lens` rows laid out in a cache in reverse order, three rows apart (the rows
/// between are NaN, so reading one fails), and the cache's rows.
fn scattered(lens: &[usize]) -> (Vec<(usize, usize)>, usize) {
    let mut at = 3;
    let mut ranges = vec![(0, 0); lens.len()];
    for (range, &n) in ranges.iter_mut().zip(lens).rev() {
        *range = (at, n);
        at += n + 3;
    }
    (ranges, at)
}

/// What one op kind's cases came to on the device.
#[derive(Default)]
struct Tally {
    run: usize,
    declined: usize,
    failed: usize,
    /// The largest errors per precision (f32, bf16) of the runs that passed.
    worst: [Diff; 2],
}

fn slot(p: Precision) -> usize {
    match p {
        Precision::F32 => 0,
        Precision::Bf16 => 1,
    }
}

/// The CPU reference of a case, from a backend that records the ops it runs: the case must call
/// exactly the op it declares, so that `supports` is asked about what really runs.
fn reference(case: &dyn Case) -> Result<Vec<Output>, String> {
    let cpu = CpuBackend::recording();
    let want = catching(|| case.run_on(Dev::Cpu(&cpu)))?;
    match cpu.recorded()[..] {
        [op] if op == case.op() => Ok(want),
        ref ops => Err(format!("declares {} but calls {ops:?}", case.op())),
    }
}

/// What a run of the table came to.
struct Outcome {
    /// Every failed run, with its reason.
    failures: Vec<String>,
    /// Every run the device declined, as `"{case name} ({precision})"`.
    declined: Vec<String>,
}

/// Runs every case in each of its precisions on `devices` (f32, bf16) against the CPU reference:
/// a line per run (`DECLINED` where the device's `supports` refuses the case: listed, not run),
/// a summary per op kind and a table at the end.
fn run_table(cases: &[Box<dyn Case>], devices: [Dev<'_>; 2]) -> Outcome {
    let mut tallies: Vec<(OpKind, Tally)> = Vec::new();
    let mut failures = Vec::new();
    let mut declined_runs = Vec::new();
    // Computed once per seed: the cases that share one differ only in the device's path
    // (attention's forced kernels), and follow each other in the table.
    let mut last: Option<(u64, Result<Vec<Output>, String>)> = None;
    for &kind in OpKind::ALL {
        let mut tally = Tally::default();
        for case in cases.iter().filter(|c| c.op().kind() == kind) {
            for &p in case.precisions() {
                let dev = devices[slot(p)];
                let label = format!("{} [seed {:#018x}] ({p})", case.name(), case.seed());
                if let Err(why) = case.supported_on(dev) {
                    println!("DECLINED {label}: {why}");
                    tally.declined += 1;
                    declined_runs.push(format!("{} ({p})", case.name()));
                    continue;
                }
                tally.run += 1;
                let want = match &last {
                    Some((seed, want)) if *seed == case.seed() => want,
                    _ => &last.insert((case.seed(), reference(case.as_ref()))).1,
                };
                let got = match want {
                    Ok(want) => catching(|| case.run_on(dev))
                        .and_then(|got| compare(&got, want, case.tol(p))),
                    Err(e) => Err(format!("the CPU reference failed: {e}")),
                };
                match got {
                    Ok(d) => {
                        println!(
                            "ok       {label}: rel max err {:.2e}, nmse {:.2e}",
                            d.rel, d.nmse
                        );
                        tally.worst[slot(p)] = tally.worst[slot(p)].max(d);
                    }
                    Err(e) => {
                        println!("FAIL     {label}: {e}");
                        tally.failed += 1;
                        failures.push(format!("{label}: {e}"));
                    }
                }
            }
        }
        let [f, b] = tally.worst;
        println!(
            "== {}: {} run, {} declined, {} failed; worst passing rel / nmse: f32 {:.1e} / {:.1e}, bf16 {:.1e} / {:.1e}\n",
            kind.name(),
            tally.run,
            tally.declined,
            tally.failed,
            f.rel,
            f.nmse,
            b.rel,
            b.nmse
        );
        tallies.push((kind, tally));
    }
    println!("{:<18}{:>6}{:>10}{:>8}", "op", "run", "declined", "failed");
    for (kind, t) in &tallies {
        let name = kind.name();
        println!("{name:<18}{:>6}{:>10}{:>8}", t.run, t.declined, t.failed);
    }
    let sum = |f: fn(&Tally) -> usize| tallies.iter().map(|(_, t)| f(t)).sum::<usize>();
    let (run, total_declined) = (sum(|t| t.run), sum(|t| t.declined));
    println!(
        "{:<18}{run:>6}{total_declined:>10}{:>8}",
        "total",
        failures.len()
    );
    Outcome {
        failures,
        declined: declined_runs,
    }
}

/// The runs the CUDA backend declines, as `"{case name} ({precision})"`: none since the flash
/// kernels read per-row key limits (the block-causal cases forced onto each flash path were the
/// last). A new decline changes this list: [`ops_match_cpu`] fails until it is updated.
fn declined_on_cuda() -> Vec<String> {
    Vec::new()
}

/// The difference between the runs declined and those expected, or `None` when they agree.
fn decline_changes(declined: &[String], expected: &[String]) -> Option<String> {
    let got: BTreeSet<&String> = declined.iter().collect();
    let want: BTreeSet<&String> = expected.iter().collect();
    let new: Vec<&&String> = got.difference(&want).collect();
    let gone: Vec<&&String> = want.difference(&got).collect();
    if new.is_empty() && gone.is_empty() && declined.len() == expected.len() {
        return None;
    }
    Some(format!(
        "declined {} runs, expected {}; newly declined: {new:#?}; expected to be declined but run: {gone:#?}",
        declined.len(),
        expected.len()
    ))
}

/// Every case in each of its precisions, CUDA against the CPU reference; every failure is
/// collected, and the whole picture printed, before the test fails.
#[test]
#[ignore = "needs a CUDA device"]
fn ops_match_cpu() {
    let filter = std::env::var("TESSERA_OP_CASE").ok();
    let gpus = [Precision::F32, Precision::Bf16]
        .map(|p| cuda::open(0, p).unwrap_or_else(|e| panic!("CUDA device 0 ({p}): {e}")));
    println!("{}", gpus[1].describe());
    let cases: Vec<_> = cases()
        .into_iter()
        .filter(|c| {
            filter
                .as_ref()
                .is_none_or(|f| c.name().contains(f.as_str()))
        })
        .collect();
    let Outcome { failures, declined } =
        run_table(&cases, [Dev::Cuda(&gpus[0]), Dev::Cuda(&gpus[1])]);
    let expected: Vec<String> = declined_on_cuda()
        .into_iter()
        .filter(|d| {
            let name = d.rsplit_once(" (").map_or(d.as_str(), |(name, _)| name);
            filter.as_ref().is_none_or(|f| name.contains(f.as_str()))
        })
        .collect();
    let changed = decline_changes(&declined, &expected);
    assert!(
        failures.is_empty() && changed.is_none(),
        "{} case runs failed (rerun some with TESSERA_OP_CASE=<part of their names>):\n{}\n{}",
        failures.len(),
        failures.join("\n"),
        changed.unwrap_or_default()
    );
}

/// The expected declines name real runs of the table: each is a case name in one of its
/// precisions (so a renamed case cannot leave the list stale and [`ops_match_cpu`] vacuous).
#[test]
fn the_expected_cuda_declines_are_runs_of_the_table() {
    let runs: BTreeSet<String> = cases()
        .iter()
        .flat_map(|c| {
            c.precisions()
                .iter()
                .map(move |p| format!("{} ({p})", c.name()))
        })
        .collect();
    let expected = declined_on_cuda();
    let unknown: Vec<&String> = expected.iter().filter(|d| !runs.contains(*d)).collect();
    assert!(unknown.is_empty(), "not runs of the table: {unknown:#?}");
    assert_eq!(
        expected.iter().collect::<BTreeSet<_>>().len(),
        expected.len(),
        "a decline listed twice"
    );
    assert_eq!(decline_changes(&expected, &expected), None);
    // A run declined beyond the list, and a listed decline that ran, are both reported.
    let mut one_more = expected.clone();
    one_more.push("attention [17] 4/1×512 (bf16)".into());
    assert!(decline_changes(&one_more, &expected).is_some());
    assert!(decline_changes(&expected, &one_more).is_some());
}

/// Every op of the trait has cases, and every case's op is one the CPU reference runs: an op
/// with a CPU implementation and no CUDA case fails here, as does a case with no reference.
#[test]
fn every_op_has_cases() {
    let cases = cases();
    let missing: Vec<&str> = OpKind::ALL
        .iter()
        .filter(|&&k| !cases.iter().any(|c| c.op().kind() == k))
        .map(|k| k.name())
        .collect();
    assert!(missing.is_empty(), "ops without a case: {missing:?}");
    let cpu = CpuBackend::new();
    for c in &cases {
        if let Err(e) = c.supported_on(Dev::Cpu(&cpu)) {
            panic!(
                "{}: the CPU reference does not run {}: {e}",
                c.name(),
                c.op()
            );
        }
        assert!(!c.precisions().is_empty(), "{}: no precision", c.name());
    }
    let mut names = HashSet::new();
    let twice: Vec<String> = cases
        .iter()
        .map(|c| c.name())
        .filter(|n| !names.insert(n.clone()))
        .collect();
    assert!(twice.is_empty(), "names used twice: {twice:?}");
}

/// The GPU runner with the CPU in the device's place, over every case (huge shapes shrunk): each
/// case runs as the reference and again per precision (both f32 here), and must call exactly
/// its declared op, keep its guards, give finite outputs and the same values every time.
#[test]
fn every_case_runs_on_the_cpu() {
    let cpu = CpuBackend::new();
    let cases: Vec<_> = cases().iter().map(|c| c.shrunk()).collect();
    let Outcome { failures, declined } = run_table(&cases, [Dev::Cpu(&cpu), Dev::Cpu(&cpu)]);
    assert!(declined.is_empty(), "the CPU declined {declined:#?}");
    assert!(
        failures.is_empty(),
        "{} broken cases:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A bf16 product of up to 16 rows (the GEMV kernel; on block-format weights, the decode
/// kernels) gives each row the same bits whatever rows it comes with: 16 rows at once, then the
/// same rows alone and in runs of 2, 3 and 7 at offsets 3 rows apart, into f32 and bf16 outputs,
/// on dense bf16 weights and on stacked Q4_K|Q6_K ones. (Under `TESSERA_GEMV=0` this measures
/// cuBLASLt, which promises no such thing.)
#[test]
#[ignore = "needs a CUDA device"]
fn decoding_rows_do_not_depend_on_their_batch() {
    let g = cuda::open(0, Precision::Bf16).unwrap_or_else(|e| panic!("CUDA device 0: {e}"));
    let (m, k, n) = (16, 4608, 1000);
    let mut rng = ops::Rng::new(11);
    let mut xb = g.alloc(m * k, Compute).unwrap();
    g.write_f32(&mut xb, &rng.vec(m * k, 1.0)).unwrap();
    let w = rng.vec(n * k, 0.02);
    let dense = g.matrix_f32(&[(&w, n)], k).unwrap();
    let blocks = g
        .matrix(&Blocks::Parts(DType::Q4_K, DType::Q6_K).tensors(&w, n, k))
        .unwrap();
    let mats = [("dense", &dense), ("Q4_K|Q6_K", &blocks)];
    for ((what, mat), role) in mats.into_iter().flat_map(|m| [(m, Stream), (m, Compute)]) {
        let product = |r0: usize, rows: usize| {
            let mut ob = g.alloc(rows * n, role).unwrap();
            let x = View {
                buf: &xb,
                offset: r0 * k,
                rows,
                cols: k,
                stride: k,
            };
            g.matmul(x, mat, ViewMut::new(&mut ob, rows, n), &Epilogue::default())
                .unwrap();
            g.read_f32(View::new(&ob, rows, n)).unwrap()
        };
        let all = product(0, m);
        for rows in [1, 2, 3, 7] {
            for r0 in (0..=m - rows).step_by(3) {
                let got = product(r0, rows);
                let want = &all[r0 * n..(r0 + rows) * n];
                let same = got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{what} weights, {role:?}: rows {r0}..{} differ from the batch",
                    r0 + rows
                );
            }
        }
    }
}

/// A product replayed from a captured CUDA graph sees new input values written into the same
/// buffers, and gives what the direct launches gave.
#[test]
#[ignore = "needs a CUDA device"]
fn replayed_graph_gives_the_direct_result() {
    let g = cuda::open(0, Precision::Bf16).unwrap_or_else(|e| panic!("CUDA device 0: {e}"));
    let (m, k, n) = (64, 512, 256);
    let mut rng = ops::Rng::new(5);
    let x = rng.vec(m * k, 1.0);
    let mat = g.matrix_f32(&[(&rng.vec(n * k, 0.05), n)], k).unwrap();
    let mut xb = g.alloc(m * k, Compute).unwrap();
    let mut ob = g.alloc(m * n, Stream).unwrap();
    let mut results = Vec::new();
    for round in 0..4 {
        // New input values each round, same buffers: a replay must see them.
        let xr: Vec<f32> = x.iter().map(|v| v * (round + 1) as f32).collect();
        g.write_f32(&mut xb, &xr).unwrap();
        g.run_graph(42, &mut || {
            g.matmul(
                View::new(&xb, m, k),
                &mat,
                ViewMut::new(&mut ob, m, n),
                &Epilogue::default(),
            )
        })
        .unwrap();
        results.push(g.read_f32(View::new(&ob, m, n)).unwrap());
    }
    for (r, got) in results.iter().enumerate().skip(1) {
        let want: Vec<f32> = results[0].iter().map(|v| v * (r + 1) as f32).collect();
        let d = measure(got, &want).unwrap();
        println!(
            "graph round {r}: rel max err {:.2e}, nmse {:.2e}",
            d.rel, d.nmse
        );
        assert!(
            d.within(Tol {
                rel: 1e-2,
                nmse: 1e-4
            }),
            "graph round {r}: {d:?}"
        );
    }
}

/// Whether products of a few bf16 rows take the tensor-core GEMV and every fused decode op is on
/// in this process (the defaults; `TESSERA_GEMV=0` or `cuda` and `TESSERA_FUSE` choose others),
/// where the fused ops apply.
fn tensor_core_gemv() -> bool {
    std::env::var("TESSERA_GEMV").map_or(true, |v| v != "0" && v != "cuda")
        && std::env::var_os("TESSERA_FUSE").is_none()
}

fn same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let differ = got
        .iter()
        .zip(want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(differ, 0, "{what}: {differ} of {} values differ", got.len());
}

/// A gated MLP's gate|up product on a few rows is one launch (the gating done as the GEMV stores
/// its columns) that gives the bits of the product then the gated kernel and leaves the scratch
/// rows untouched; shapes the fused GEMV does not take run the two ops.
#[test]
#[ignore = "needs a CUDA device"]
fn fused_gated_product_gives_the_two_ops_bits() {
    let g = cuda::open(0, Precision::Bf16).unwrap_or_else(|e| panic!("CUDA device 0: {e}"));
    let mut rng = ops::Rng::new(11);
    // (rows, width, inner, activation, fused under the tensor-core GEMV)
    let shapes = [
        (1, 1024, 4608, Silu, true), // LFM2-VL-450M decoding, one stream
        (3, 1024, 4608, Silu, true),
        (16, 1024, 4608, Silu, true),
        (8, 96, 44, GeluTanh, true), // a last CTA with fewer than eight columns
        (17, 1024, 4608, Silu, false), // past the GEMV's rows: cuBLASLt
        (4, 40, 24, Silu, false),    // k not a multiple of 32: the CUDA-core GEMV
        (2, 64, 16, Gelu, false),    // erf GELU: no fused kernel (and no gated one)
    ];
    for (rows, width, inner, act, fused) in shapes {
        let fused = fused && tensor_core_gemv();
        let what = format!("{rows}×{width} → 2×{inner}, {act:?}");
        let mat = g
            .matrix_f32(
                &[
                    (&rng.vec(inner * width, 0.05), inner),
                    (&rng.vec(inner * width, 0.05), inner),
                ],
                width,
            )
            .unwrap();
        let mut x = g.alloc(rows * width, Compute).unwrap();
        g.write_f32(&mut x, &rng.vec(rows * width, 2.0)).unwrap();
        let x = View::new(&x, rows, width);
        let mut gu = g.alloc(rows * 2 * inner, Compute).unwrap();
        let (mut two, mut one) = (
            g.alloc(rows * inner, Compute).unwrap(),
            g.alloc(rows * inner, Compute).unwrap(),
        );
        let two_ops = g
            .matmul(
                x,
                &mat,
                ViewMut::new(&mut gu, rows, 2 * inner),
                &Epilogue::default(),
            )
            .and_then(|()| {
                let both = View::new(&gu, rows, 2 * inner);
                g.gated(
                    both.cols(0, inner),
                    both.cols(inner, inner),
                    ViewMut::new(&mut two, rows, inner),
                    act,
                )
            });
        let nan = vec![f32::NAN; rows * 2 * inner];
        g.write_f32(&mut gu, &nan).unwrap();
        let before = g.kernel_launches();
        let fused_op = g.matmul_gated(
            x,
            &mat,
            ViewMut::new(&mut gu, rows, 2 * inner),
            act,
            ViewMut::new(&mut one, rows, inner),
        );
        let launches = g.kernel_launches() - before;
        if act == Gelu {
            // No CUDA kernel gates with erf GELU; the compound op declines as the gated op does.
            assert!(two_ops.is_err() && fused_op.is_err(), "{what}");
            continue;
        }
        two_ops.unwrap();
        fused_op.unwrap();
        let want = g.read_f32(View::new(&two, rows, inner)).unwrap();
        let got = g.read_f32(View::new(&one, rows, inner)).unwrap();
        same_bits(&what, &got, &want);
        let gu = g.read_f32(View::new(&gu, rows, 2 * inner)).unwrap();
        let untouched = gu.iter().all(|v| v.is_nan());
        println!("{what}: {launches} launch(es), scratch untouched: {untouched}");
        assert_eq!(untouched, fused, "{what}: fused path taken?");
        if fused {
            assert_eq!(launches, 1, "{what}");
        }
    }
}

/// LFM2's q/k/v norm and RoPE with the new keys and values written to their cache rows: one
/// launch, with the bits of `qkv_norm_rope` then two `scatter_rows`, in the q|k|v rows and in
/// every cache row (the others untouched).
#[test]
#[ignore = "needs a CUDA device"]
fn cached_qkv_norm_rope_gives_the_three_ops_bits() {
    use tessera_backend::{CacheWrite, QkvLayout, QkvNorm, RopeStyle, RopeTable};
    for precision in [Precision::Bf16, Precision::F32] {
        let g = cuda::open(0, precision).unwrap_or_else(|e| panic!("CUDA device 0: {e}"));
        let mut rng = ops::Rng::new(12);
        let lay = QkvLayout {
            heads_q: 16,
            heads_kv: 8,
            head_dim: 64,
        };
        let (width, qc, kc) = (lay.width(), lay.q_cols(), lay.kv_cols());
        let hd = lay.head_dim;
        let inv: Vec<f32> = (0..hd / 2)
            .map(|i| 1e6f32.powf(-2.0 * i as f32 / hd as f32))
            .collect();
        let table = RopeTable::new(&g, &inv, 64, RopeStyle::SplitHalf).unwrap();
        let qn = g.vector_f32(&rng.vec(hd, 1.0)).unwrap();
        let kn = g.vector_f32(&rng.vec(hd, 1.0)).unwrap();
        let norm = QkvNorm {
            layout: lay,
            qk_norm: true,
            q_weight: Some(&qn),
            k_weight: Some(&kn),
            v_norm: false,
            eps: 1e-5,
        };
        let cache_len = 40;
        for (rows, at) in [(1, vec![17u32]), (5, vec![3, 17, 0, 39, 20])] {
            let what = format!("{precision}, {rows} rows");
            let x = rng.vec(rows * width, 2.0);
            let pos: Vec<u32> = at.iter().map(|&r| r % 32 + 5).collect();
            let mut posb = g.alloc(rows, tessera_backend::Role::Index).unwrap();
            g.write_u32(&mut posb, &pos).unwrap();
            let mut atb = g.alloc(rows, tessera_backend::Role::Index).unwrap();
            g.write_u32(&mut atb, &at).unwrap();
            let old = rng.vec(cache_len * kc, 1.0);
            let run = |fused: bool| {
                let mut qkv = g.alloc(rows * width, Compute).unwrap();
                g.write_f32(&mut qkv, &x).unwrap();
                let (mut k, mut v) = (
                    g.alloc(cache_len * kc, Compute).unwrap(),
                    g.alloc(cache_len * kc, Compute).unwrap(),
                );
                g.write_f32(&mut k, &old).unwrap();
                g.write_f32(&mut v, &old).unwrap();
                let before = g.kernel_launches();
                if fused {
                    g.qkv_norm_rope_cached(
                        ViewMut::new(&mut qkv, rows, width),
                        &norm,
                        Some((&table, &posb)),
                        CacheWrite {
                            rows: &atb,
                            k: ViewMut::new(&mut k, cache_len, kc),
                            v: ViewMut::new(&mut v, cache_len, kc),
                        },
                    )
                    .unwrap();
                } else {
                    g.qkv_norm_rope(
                        ViewMut::new(&mut qkv, rows, width),
                        &norm,
                        Some((&table, &posb)),
                    )
                    .unwrap();
                    let done = View::new(&qkv, rows, width);
                    g.scatter_rows(done.cols(qc, kc), &atb, ViewMut::new(&mut k, cache_len, kc))
                        .unwrap();
                    g.scatter_rows(
                        done.cols(qc + kc, kc),
                        &atb,
                        ViewMut::new(&mut v, cache_len, kc),
                    )
                    .unwrap();
                }
                let launches = g.kernel_launches() - before;
                let read = |b: &_, r, c| g.read_f32(View::new(b, r, c)).unwrap();
                (
                    launches,
                    read(&qkv, rows, width),
                    read(&k, cache_len, kc),
                    read(&v, cache_len, kc),
                )
            };
            let (three, q3, k3, v3) = run(false);
            let (one, q1, k1, v1) = run(true);
            assert_eq!(three, 3, "{what}: launches");
            if tensor_core_gemv() {
                assert_eq!(one, 1, "{what}: launches");
            }
            same_bits(&format!("{what}: q|k|v"), &q1, &q3);
            same_bits(&format!("{what}: keys"), &k1, &k3);
            same_bits(&format!("{what}: values"), &v1, &v3);
            assert!(k1 != old && v1 != old, "{what}: nothing written");
            println!("{what}: one launch, the three ops' bits");
        }
    }
}

/// A product of a few rows ended by the residual step of a pre-norm block (`h += y`, then the
/// next RMS norm into bf16 `a`) is one launch — its last CTA takes the norm — with the bits of the
/// product into `y` then the residual op, in `h` and in `a`; shapes the fused kernel does not take
/// (17 rows, a post-norm) run the parts.
#[test]
#[ignore = "needs a CUDA device"]
fn products_ended_by_their_residual_step_give_the_parts_bits() {
    use tessera_backend::{After, Residual, RowNorm, ThenResidual};
    fn then<'a>(
        h: ViewMut<'a, cuda::CudaBackend>,
        a: ViewMut<'a, cuda::CudaBackend>,
        res: Residual<'a, cuda::CudaBackend>,
        w: &'a cuda::CudaBuf,
    ) -> ThenResidual<'a, cuda::CudaBackend> {
        ThenResidual {
            h,
            res,
            after: After::Norm(RowNorm::rms(w, 1e-5), a),
        }
    }
    let mut g = cuda::open(0, Precision::Bf16).unwrap_or_else(|e| panic!("CUDA device 0: {e}"));
    g.fuse_residual_steps(true); // off by default (slower where launches overlap)
    let g = g;
    let mut rng = ops::Rng::new(13);
    // (rows, inner, width, post-norm, fused)
    let shapes = [
        (1, 1024, 1024, false, true), // LFM2-VL-450M's out projection, one stream
        (1, 4608, 1024, false, true), // its MLP down product
        (8, 1024, 1024, false, true),
        (16, 4608, 1024, false, true),
        (5, 2048, 2048, false, true), // LFM2-1.2B's width: two warps a row
        (17, 1024, 1024, false, false),
        (3, 1024, 1024, true, false),
    ];
    for (rows, inner, d, post, fused) in shapes {
        let fused = fused && tensor_core_gemv();
        let what = format!("{rows}×{inner} → {d}, post-norm {post}");
        let mat = g
            .matrix_f32(&[(&rng.vec(d * inner, 0.05), d)], inner)
            .unwrap();
        let norm_w = g.vector_f32(&rng.vec(d, 1.0)).unwrap();
        let post_w = g.vector_f32(&rng.vec(d, 1.0)).unwrap();
        let x = rng.vec(rows * inner, 2.0);
        let h0 = rng.vec(rows * d, 4.0);
        let run = |one: bool| {
            let mut xb = g.alloc(rows * inner, Compute).unwrap();
            g.write_f32(&mut xb, &x).unwrap();
            let mut h = g.alloc(rows * d, Stream).unwrap();
            g.write_f32(&mut h, &h0).unwrap();
            let mut a = g.alloc(rows * d, Compute).unwrap();
            let mut y = g.alloc(rows * d, Compute).unwrap();
            let res = Residual {
                post: post.then(|| RowNorm::rms(&post_w, 1e-5)),
                ..Residual::plain()
            };
            let xv = View::new(&xb, rows, inner);
            let before = g.kernel_launches();
            if one {
                let t = then(
                    ViewMut::new(&mut h, rows, d),
                    ViewMut::new(&mut a, rows, d),
                    res,
                    &norm_w,
                );
                g.matmul_residual(
                    xv,
                    &mat,
                    ViewMut::new(&mut y, rows, d),
                    &Epilogue::default(),
                    t,
                )
                .unwrap();
            } else {
                g.matmul(
                    xv,
                    &mat,
                    ViewMut::new(&mut y, rows, d),
                    &Epilogue::default(),
                )
                .unwrap();
                let t = then(
                    ViewMut::new(&mut h, rows, d),
                    ViewMut::new(&mut a, rows, d),
                    res,
                    &norm_w,
                );
                g.residual(t.h, View::new(&y, rows, d), &t.res, t.after)
                    .unwrap();
            }
            let launches = g.kernel_launches() - before;
            let read = |b: &_| g.read_f32(View::new(b, rows, d)).unwrap();
            (launches, read(&h), read(&a))
        };
        let (parts, h_parts, a_parts) = run(false);
        let (one, h_one, a_one) = run(true);
        same_bits(&format!("{what}: h"), &h_one, &h_parts);
        same_bits(&format!("{what}: a"), &a_one, &a_parts);
        println!("{what}: {one} launch(es), the parts took {parts}");
        if fused {
            assert_eq!(one, 1, "{what}: fused path taken?");
        } else {
            assert!(one > 1 || rows > 16, "{what}: {one} launch(es)");
        }
    }
}

/// A VAE's image read back as 8-bit values on the device (`read_rgb8`) gives the host
/// conversion's bytes (`tessera_core::pixels::to_rgb8` of the values `read_f32` returns), from
/// f32 and bf16 buffers and a view of some of their columns (rows packed on the way back), and
/// fails as `check_finite` does — the same count and first index — where a value is not finite.
#[test]
#[ignore = "needs a CUDA device"]
fn rgb8_read_back_gives_the_hosts_bytes() {
    use tessera_core::Error;
    // Every kind of value: the image's range on a fine grid (ties of v·255 among them), values
    // past either end, signed zeros, subnormals and huge values — all finite in both storages
    // (bf16 rounds magnitudes from 3.396e38 up, f32::MAX among them, to infinity; non-finite
    // values are the guard column's case below).
    const BF16_FINITE: f32 = 3.38e38;
    let mut values: Vec<f32> = (0..=300_000).map(|i| -1.2 + i as f32 * 8e-6).collect();
    values.extend(
        (0..=u32::MAX)
            .step_by(1 << 20)
            .map(f32::from_bits)
            .filter(|v| v.abs() <= BF16_FINITE),
    );
    values.extend([
        -0.0,
        0.0,
        1.0,
        -1.0,
        f32::MIN_POSITIVE,
        -BF16_FINITE,
        BF16_FINITE,
    ]);
    let (cols, width) = (3, 4); // RGB of RGBA-wide rows: the view skips a column of each row
    values.resize(values.len().next_multiple_of(cols), 0.5);
    let rows = values.len() / cols;
    for p in [Precision::F32, Precision::Bf16] {
        let g = cuda::open(0, p).unwrap_or_else(|e| panic!("CUDA device 0: {e}"));
        let padded: Vec<f32> = values
            .chunks(cols)
            .flat_map(|r| r.iter().copied().chain([f32::NAN]))
            .collect();
        let mut buf = g.alloc(rows * width, Compute).unwrap();
        g.write_f32(&mut buf, &padded).unwrap();
        let view = View::new(&buf, rows, width).cols(0, cols);
        let stored = g.read_f32(view).unwrap();
        let want = tessera_core::pixels::to_rgb8(&stored);
        let got = g.read_rgb8(view, "test image").unwrap();
        assert_eq!(got.len(), want.len(), "{p:?}: lengths");
        let differ: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
        assert!(
            differ.is_empty(),
            "{p:?}: {} of {} bytes differ, first at {} ({:e}: {} against {})",
            differ.len(),
            want.len(),
            differ[0],
            stored[differ[0]],
            got[differ[0]],
            want[differ[0]]
        );
        // The guard column is NaN: the whole rows fail, counted as the host counts them.
        let whole = View::new(&buf, rows, width);
        let host = tessera_core::check_finite("test image", &g.read_f32(whole).unwrap());
        match (g.read_rgb8(whole, "test image"), host) {
            (
                Err(Error::NonFinite {
                    count, len, first, ..
                }),
                Err(Error::NonFinite {
                    count: c,
                    len: l,
                    first: f,
                    ..
                }),
            ) => assert_eq!((count, len, first), (c, l, f), "{p:?}"),
            (got, host) => panic!("{p:?}: expected two NonFinite errors, got {got:?} and {host:?}"),
        }
    }
}

/// Pixels uploaded as bytes and mapped through a table on the device (`write_u8_mapped`) hold
/// what uploading the mapped values gives — the same storage rounding — for f32 and bf16 buffers,
/// parts of odd lengths back to back, and leave the rest of the buffer as it was; a source longer
/// than the buffer is refused.
#[test]
#[ignore = "needs a CUDA device"]
fn byte_uploads_take_the_tables_values() {
    // Values that round differently to bf16, of both signs and several magnitudes.
    let map: [f32; 256] =
        std::array::from_fn(|b| (b as f32 - 127.3) * 0.013_71 + (b % 7) as f32 * 1e-4);
    let parts: Vec<Vec<u8>> = [1usize, 1001, 3, 70_000]
        .iter()
        .enumerate()
        .map(|(k, &n)| (0..n).map(|i| ((i * 37 + k * 11) % 256) as u8).collect())
        .collect();
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let total: usize = parts.iter().map(Vec::len).sum();
    let spare = 5;
    for p in [Precision::F32, Precision::Bf16] {
        let g = cuda::open(0, p).unwrap_or_else(|e| panic!("CUDA device 0: {e}"));
        let mut got = g.alloc(total + spare, Compute).unwrap();
        g.write_f32(&mut got, &vec![7.5; total + spare]).unwrap();
        g.write_u8_mapped(&mut got, &refs, &map).unwrap();
        let mut want = g.alloc(total + spare, Compute).unwrap();
        let mut values: Vec<f32> = refs.concat().iter().map(|&b| map[b as usize]).collect();
        values.extend(std::iter::repeat_n(7.5, spare));
        g.write_f32(&mut want, &values).unwrap();
        let (got, want) = (
            g.read_f32(View::new(&got, 1, total + spare)).unwrap(),
            g.read_f32(View::new(&want, 1, total + spare)).unwrap(),
        );
        same_bits(&format!("{p:?} byte upload"), &got, &want);
        let mut small = g.alloc(total - 1, Compute).unwrap();
        assert!(g.write_u8_mapped(&mut small, &refs, &map).is_err(), "{p:?}");
    }
}
