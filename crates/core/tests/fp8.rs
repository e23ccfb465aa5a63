//! FP8 e4m3fn against `tests/fixtures/fp8/e4m3fn.safetensors` (written by `tools/fixtures/fp8.py`
//! with torch 2.15): every code decodes to torch's `float32` bit for bit, values round to the
//! codes torch's cast gives, and per-row quantization gives torch's scales and codes. Then FP8
//! tensors in a safetensors file, unscaled, with ComfyUI's per-tensor `scale_weight` and with a
//! per-row `weight_scale`.

use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use tessera_core::{DType, Scale, Weights, fp8};

fn fixture() -> Vec<u8> {
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/fp8/e4m3fn.safetensors");
    std::fs::read(&p).expect("fixture")
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn u8s(st: &SafeTensors<'_>, name: &str) -> Vec<u8> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::U8, "{name}");
    t.data().to_vec()
}

#[test]
fn every_code_decodes_as_torch_does() {
    let bytes = fixture();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want = f32s(&st, "decode");
    assert_eq!(want.len(), 256);
    for (c, w) in want.iter().enumerate() {
        let got = fp8::to_f32(c as u8);
        assert_eq!(
            got.to_bits(),
            w.to_bits(),
            "code {c:#04x}: {got} vs torch {w}"
        );
    }
    assert!(want[0x7F].is_nan() && want[0xFF].is_nan());
    // The same through the dtype's widening, as checkpoints are read.
    let codes: Vec<u8> = (0..=255).collect();
    let mut out = vec![0f32; 256];
    tessera_core::dtype::widen_into(DType::F8_E4M3, &codes, &mut out);
    assert!(
        out.iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
}

#[test]
fn values_round_to_the_codes_torch_gives() {
    let bytes = fixture();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let x = f32s(&st, "encode_in");
    let want = u8s(&st, "encode_out");
    assert_eq!(x.len(), want.len());
    assert!(x.len() > 8000);
    let bad: Vec<String> = x
        .iter()
        .zip(&want)
        .filter(|&(&v, &w)| fp8::from_f32(v) != w)
        .take(10)
        .map(|(&v, &w)| {
            format!(
                "{v:e} ({:#010x}): {:#04x} vs torch {w:#04x}",
                v.to_bits(),
                fp8::from_f32(v)
            )
        })
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn rows_quantize_to_torch_scales_and_codes() {
    let bytes = fixture();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let rows = f32s(&st, "rows");
    let scales = f32s(&st, "row_scale");
    let codes = u8s(&st, "row_codes");
    let c = rows.len() / scales.len();
    for (r, row) in rows.chunks_exact(c).enumerate() {
        let s = fp8::row_scale(row).unwrap();
        assert_eq!(
            s.to_bits(),
            scales[r].to_bits(),
            "row {r}: scale {s} vs torch {}",
            scales[r]
        );
        let mut got = vec![0u8; c];
        fp8::quantize_row(row, s, &mut got);
        assert_eq!(got, codes[r * c..(r + 1) * c], "row {r}");
    }
    assert_eq!(fp8::row_scale(&[1.0, f32::NAN]), None);
    assert_eq!(fp8::row_scale(&[f32::INFINITY]), None);
}

/// A safetensors file of `(name, dtype, shape, bytes)`.
fn write(dir: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> PathBuf {
    let path = dir.join("fp8.safetensors");
    let views = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()));
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

#[test]
fn fp8_tensors_read_with_their_comfyui_scale() {
    let dir = tempfile::tempdir().unwrap();
    let codes: Vec<u8> = (0u8..=255).filter(|c| c & 0x7F != 0x7F).take(12).collect();
    let scale: f32 = 0.013;
    let path = write(
        dir.path(),
        &[
            (
                "model.diffusion_model.a.weight",
                Dtype::F8_E4M3,
                vec![3, 4],
                codes.clone(),
            ),
            (
                "model.diffusion_model.a.scale_weight",
                Dtype::F32,
                vec![],
                scale.to_le_bytes().to_vec(),
            ),
            ("b.weight", Dtype::F8_E4M3, vec![12], codes.clone()),
            ("c.weight", Dtype::F8_E4M3, vec![2, 6], codes.clone()),
            (
                "c.weight_scale",
                Dtype::BF16,
                vec![1],
                half::bf16::from_f32(2.0).to_le_bytes().to_vec(),
            ),
            (
                "model.diffusion_model.scaled_fp8",
                Dtype::F8_E4M3,
                vec![0],
                vec![],
            ),
            ("d.weight", Dtype::F8_E4M3, vec![3, 4], codes.clone()),
            (
                "d.weight_scale",
                Dtype::F32,
                vec![3, 1],
                [0.5f32, 4.0, -1.0]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
        ],
    );
    let w = Weights::open_file(&path).unwrap();
    let comfy = w.pp("model.diffusion_model");
    let a = comfy.get("a.weight", &[3, 4]).unwrap();
    assert_eq!(
        (a.dtype, &a.scale),
        (DType::F8_E4M3, &Some(Scale::Tensor(scale)))
    );
    let want: Vec<f32> = codes.iter().map(|&c| fp8::to_f32(c) * scale).collect();
    assert_eq!(a.to_f32(), want);
    let mut row = [0f32; 4];
    a.read_f32_range(4, &mut row);
    assert_eq!(row, want[4..8]);
    // No scale beside it: the codes' values.
    let b = w.tensor("b.weight").unwrap();
    assert_eq!(b.scale, None);
    assert_eq!(
        b.to_f32(),
        codes.iter().map(|&c| fp8::to_f32(c)).collect::<Vec<_>>()
    );
    // `weight_scale` (ComfyUI's newer layout, compressed-tensors), any float type.
    assert_eq!(
        w.tensor("c.weight").unwrap().scale,
        Some(Scale::Tensor(2.0))
    );
    // One scale per row (fbgemm, compressed-tensors' per channel): `[rows, 1]`.
    let d = w.tensor("d.weight").unwrap();
    assert_eq!(d.scale, Some(Scale::Rows(vec![0.5, 4.0, -1.0])));
    let want: Vec<f32> = codes
        .iter()
        .enumerate()
        .map(|(i, &c)| fp8::to_f32(c) * [0.5, 4.0, -1.0][i / 4])
        .collect();
    assert_eq!(d.to_f32(), want);
    let mut rows = [0f32; 8];
    d.read_f32_range(4, &mut rows);
    assert_eq!(rows, want[4..]);
    assert_eq!(w.main_dtype(), Some(DType::F8_E4M3));
}

#[test]
fn a_scale_of_the_wrong_shape_or_type_names_both_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let per_row: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let path = write(
        dir.path(),
        &[
            ("a.weight", Dtype::F8_E4M3, vec![3, 2], vec![0x38; 6]),
            ("a.weight_scale", Dtype::F32, vec![2, 1], per_row),
            ("b.weight", Dtype::F8_E4M3, vec![2], vec![0x38; 2]),
            (
                "b.scale_weight",
                Dtype::I32,
                vec![],
                1i32.to_le_bytes().to_vec(),
            ),
            ("c.weight", Dtype::F8_E4M3, vec![2], vec![0x38; 2]),
            (
                "c.scale_weight",
                Dtype::F32,
                vec![],
                f32::NAN.to_le_bytes().to_vec(),
            ),
        ],
    );
    let w = Weights::open_file(&path).unwrap();
    for (name, scale, why) in [
        (
            "a.weight",
            "a.weight_scale",
            "shape [2, 1] for a tensor of shape [3, 2]",
        ),
        ("b.weight", "b.scale_weight", "I32"),
        ("c.weight", "c.scale_weight", "NaN"),
    ] {
        let e = w.tensor(name).err().unwrap().to_string();
        assert!(
            e.contains(&format!("`{scale}`"))
                && e.contains(&format!("`{name}`"))
                && e.contains("fp8.safetensors")
                && e.contains(why),
            "{e}"
        );
    }
}
