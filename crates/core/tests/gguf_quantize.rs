//! The quantizers against `tests/fixtures/gguf_quantize/` (written by
//! `tools/fixtures/gguf_quantize.py`): the same rows give the same bytes as llama.cpp's reference
//! quantizers write — through its `gguf` 0.19.0 package for Q8_0 and Q4_0, and ggml-quants.c
//! itself (llama-cpp-python 0.3.36's vendored copy) for Q4_K and Q6_K, which that package lacks.

use std::path::{Path, PathBuf};

use tessera_core::gguf::{GgmlType, quantize};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_quantize")
}

#[test]
fn rows_quantize_to_the_bytes_gguf_writes() {
    let raw = std::fs::read(fixtures().join("rows.f32")).expect("rows.f32");
    let x: Vec<f32> = raw
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(x.len(), 12 * 256);
    for (t, file) in [
        (GgmlType::Q8_0, "q8_0.bin"),
        (GgmlType::Q4_0, "q4_0.bin"),
        (GgmlType::Q4_K, "q4_k.bin"),
        (GgmlType::Q6_K, "q6_k.bin"),
    ] {
        let want = std::fs::read(fixtures().join(file)).expect(file);
        let mut got = vec![0u8; t.bytes_for(x.len()).unwrap()];
        quantize(t, &x, &mut got).unwrap();
        assert_eq!(got.len(), want.len(), "{t}");
        let bb = t.block_bytes();
        for (i, (g, w)) in got.chunks(bb).zip(want.chunks(bb)).enumerate() {
            assert_eq!(
                g,
                w,
                "{t}: block {i} (row {}) differs",
                i * t.block_size() / 256
            );
        }
    }
}
