//! EmbeddingGemma 2 on the CPU at `--precision bf16` against the PyTorch fixtures, judged by the
//! storage floor of the CPU's bf16 rounding points ("bf16 in, f32 out" of
//! `tools/device/eg2_bf16_floor.py`: weights, GEMM inputs, q/k/v and the attention
//! probabilities in bf16, everything else f32), within 1.5× of it as on the GPU.

mod common;

use common::floor::{self, assert_none};
use tessera_backend::Precision;
use tessera_backend::cpu::CpuBackend;
use tessera_models::ModelFiles;
use tessera_runtime::embed::Egemma2;

fn bf16_model(dir: &std::path::Path) -> Egemma2<CpuBackend> {
    let be = CpuBackend::with_precision(Precision::Bf16);
    Egemma2::load(be, ModelFiles::Dir(dir.to_path_buf())).unwrap()
}

#[test]
fn text_fixtures_are_within_the_bf16_floor() {
    let mut failures = Vec::new();
    floor::text_fixtures(Precision::Bf16, floor::CPU, bf16_model, &mut failures);
    assert_none(&failures);
}

#[test]
fn vision_fixtures_are_within_the_bf16_floor() {
    let mut failures = Vec::new();
    floor::vision_fixtures(Precision::Bf16, floor::CPU, bf16_model, &mut failures);
    assert_none(&failures);
}
