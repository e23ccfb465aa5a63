//! The GGUF reader against `tests/fixtures/gguf/` (written by `tools/fixtures/gguf_blocks.py` with
//! gguf 0.19.0): every tensor decodes bit for bit as gguf's own `dequantize`, metadata of every
//! type reads back, and corrupt copies of the file fail with an error naming the file and the
//! key or tensor, never a panic.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tessera_core::gguf::{Array, GgmlType, Gguf, Value};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf")
}

fn good() -> Gguf {
    Gguf::open(fixtures().join("blocks.gguf")).expect("the fixture opens")
}

fn good_bytes() -> Vec<u8> {
    std::fs::read(fixtures().join("blocks.gguf")).expect("the fixture reads")
}

#[derive(Deserialize)]
struct Expected {
    name: String,
    #[serde(rename = "type")]
    ggml_type: String,
    dims: Vec<usize>,
    expected: String,
}

#[test]
fn every_tensor_decodes_bit_exactly_as_gguf_does() {
    let g = good();
    let manifest: Vec<Expected> = serde_json::from_slice(
        &std::fs::read(fixtures().join("tensors.json")).expect("tensors.json"),
    )
    .expect("tensors.json parses");
    let names: Vec<&str> = g.tensors().map(|t| t.name).collect();
    let expected_names: Vec<&str> = manifest.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, expected_names);
    let mut seen = Vec::new();
    for e in &manifest {
        let t = g.tensor(&e.name).expect("listed tensor");
        assert_eq!(t.ggml_type.name(), e.ggml_type, "{}", e.name);
        assert_eq!(t.dims, e.dims, "{}", e.name);
        assert_eq!(t.shape(), e.dims.iter().rev().copied().collect::<Vec<_>>());
        let want: Vec<u32> = std::fs::read(fixtures().join(&e.expected))
            .expect("expected values")
            .as_chunks::<4>()
            .0
            .iter()
            .map(|b| u32::from_le_bytes(*b))
            .collect();
        let got: Vec<u32> = t
            .to_f32()
            .expect("decodes")
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got.len(), want.len(), "{}", e.name);
        if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
            panic!(
                "{}: element {i} is {} ({:#010x}), gguf gives {} ({:#010x})",
                e.name,
                f32::from_bits(got[i]),
                got[i],
                f32::from_bits(want[i]),
                want[i]
            );
        }
        // Borrowed from the map (page-aligned), at the file's 32-byte data alignment, not copied.
        assert_eq!(t.bytes.as_ptr() as usize % 32, 0, "{}", e.name);
        assert!(std::ptr::eq(t.bytes, g.tensor(&e.name).unwrap().bytes));
        seen.push(t.ggml_type);
    }
    for t in GgmlType::ALL {
        assert!(seen.contains(&t), "the fixture has no {t} tensor");
    }
}

#[test]
fn metadata_of_every_type_reads_back() {
    let g = good();
    assert_eq!((g.version(), g.alignment()), (3, 32));
    assert_eq!(g.get_str("general.architecture").unwrap(), "tessera-test");
    assert_eq!(g.get_str("general.name").unwrap(), "Tessera GGUF fixture ✓");
    assert_eq!(g.get("tessera.u8"), Some(&Value::U8(200)));
    assert_eq!(g.get("tessera.i8"), Some(&Value::I8(-100)));
    assert_eq!(g.get("tessera.u16"), Some(&Value::U16(60000)));
    assert_eq!(g.get("tessera.i16"), Some(&Value::I16(-30000)));
    assert_eq!(g.get_u32("tessera.u32").unwrap(), 4_000_000_000);
    assert_eq!(g.get("tessera.i32"), Some(&Value::I32(-2_000_000_000)));
    assert_eq!(g.get_f32("tessera.f32").unwrap(), 0.1f32);
    assert_eq!(g.get_u64("tessera.u64").unwrap(), (1 << 40) + 3);
    assert_eq!(g.get("tessera.i64"), Some(&Value::I64(-(1 << 40))));
    assert_eq!(
        g.get("tessera.f64"),
        Some(&Value::F64(std::f64::consts::PI))
    );
    assert!(g.get_bool("tessera.bool").unwrap());
    assert_eq!(
        g.get_str_array("tessera.strings").unwrap(),
        ["a", "", "ünïcode", "<0x0A>"]
    );
    assert_eq!(
        g.get_array("tessera.i32s").unwrap(),
        &Array::I32(vec![1, -2, 3])
    );
    assert_eq!(
        g.get_array("tessera.f32s").unwrap(),
        &Array::F32(vec![0.5, -1.25])
    );
    assert_eq!(
        g.get_array("tessera.u8s").unwrap(),
        &Array::U8(vec![0, 255])
    );
    assert_eq!(
        g.get_array("tessera.nested").unwrap(),
        &Array::Array(vec![Array::I32(vec![1, 2]), Array::I32(vec![3])])
    );
    // Integers of any width are read as u32 when they fit: converters differ in the width.
    assert_eq!(g.get_u32("tessera.u8").unwrap(), 200);
    let keys: Vec<&str> = g.metadata().map(|(k, _)| k).collect();
    assert_eq!(keys.len(), 18);
    assert_eq!(keys[..2], ["general.architecture", "general.name"]);
}

#[test]
fn metadata_accessors_name_the_key() {
    let g = good();
    let cases = [
        (
            g.get_u32("no.such.key").unwrap_err(),
            "metadata `no.such.key` not found",
        ),
        (
            g.get_u32("tessera.i8").unwrap_err(),
            "metadata `tessera.i8` = -100 does not fit in u32",
        ),
        (g.get_u32("tessera.u64").unwrap_err(), "does not fit in u32"),
        (
            g.get_str("tessera.f32").unwrap_err(),
            "metadata `tessera.f32` has type f32, expected string",
        ),
        (
            g.get_f32("tessera.strings").unwrap_err(),
            "has type array, expected f32",
        ),
        (
            g.get_str_array("tessera.i32s").unwrap_err(),
            "metadata `tessera.i32s` is an array of i32, expected strings",
        ),
    ];
    for (e, want) in cases {
        let e = e.to_string();
        assert!(e.contains("blocks.gguf: ") && e.contains(want), "{e}");
    }
    let e = g.tensor("missing").unwrap_err().to_string();
    assert!(
        e.contains("`missing` not found") && e.contains("blocks.gguf"),
        "{e}"
    );
    let t = g.tensor("q8_0.mat").unwrap();
    let e = t.dequantize_into(&mut [0.0; 32]).unwrap_err().to_string();
    assert!(
        e.contains("tensor `q8_0.mat`: Q8_0: 408 bytes do not hold 32 elements"),
        "{e}"
    );
}

/// Write `bytes` as `bad.gguf` in a fresh directory and open it; the error must name the file.
fn open_err(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.gguf");
    std::fs::write(&path, bytes).expect("write");
    match Gguf::open(&path) {
        Ok(_) => panic!("a corrupt file opened"),
        Err(e) => {
            let e = e.to_string();
            assert!(e.starts_with(&path.display().to_string()), "{e}");
            e
        }
    }
}

/// Byte offset of the first occurrence of `needle`.
fn find(bytes: &[u8], needle: &[u8]) -> usize {
    bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("needle in the fixture")
}

fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Where tensor `name`'s table entry stores n_dims: after its length-prefixed name.
fn tensor_entry(bytes: &[u8], name: &str) -> usize {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend_from_slice(name.as_bytes());
    find(bytes, &key) + key.len()
}

#[test]
fn wrong_magic_or_version_is_refused() {
    let mut b = good_bytes();
    b[3] = b'X';
    assert!(open_err(&b).contains("not a GGUF file: it starts with \"GGUX\""));
    assert!(open_err(b"GG").contains("not a GGUF file: 2 bytes is too short"));
    assert!(open_err(b"").contains("0 bytes is too short"));
    for v in [1, 4] {
        let mut b = good_bytes();
        put_u32(&mut b, 4, v);
        let e = open_err(&b);
        assert!(
            e.contains(&format!("GGUF version {v} is not supported")),
            "{e}"
        );
    }
    let mut b = good_bytes();
    put_u32(&mut b, 4, 3u32.swap_bytes());
    assert!(open_err(&b).contains("big-endian"));
}

#[test]
fn truncation_anywhere_fails_or_leaves_every_tensor_intact() {
    let full = good_bytes();
    let g = good();
    let want: Vec<Vec<u32>> = g
        .tensors()
        .map(|t| t.to_f32().unwrap().iter().map(|v| v.to_bits()).collect())
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cut.gguf");
    std::fs::write(&path, &full).expect("write");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("reopen");
    let mut opened = 0;
    for len in (0..full.len()).rev() {
        file.set_len(len as u64).expect("truncate");
        // Only the padding after the last tensor may be cut without losing data.
        if let Ok(g) = Gguf::open(&path) {
            opened += 1;
            for (t, want) in g.tensors().zip(&want) {
                let got: Vec<u32> = t.to_f32().unwrap().iter().map(|v| v.to_bits()).collect();
                assert_eq!(&got, want, "{} cut to {len} bytes", t.name);
            }
        }
    }
    let last = g.tensors().last().unwrap();
    let padding = last.bytes.len().next_multiple_of(32) - last.bytes.len();
    assert_eq!(opened, padding);
    let e = open_err(&full[..full.len() - padding - 1]);
    assert!(
        e.contains("tensor `q6_k.mat`: its 630 bytes") && e.contains("past the end"),
        "{e}"
    );
    let e = open_err(&full[..100]);
    assert!(e.contains("the metadata count: 18 metadata entries cannot fit in the 76 bytes that remain of the file (truncated"), "{e}");
    let e = open_err(&full[..300]);
    assert!(e.contains("metadata key #8: 11 string bytes cannot fit in the 10 bytes that remain of the file (truncated"), "{e}");
}

#[test]
fn a_tensor_pointing_past_the_end_is_named() {
    for offset in [1 << 40, u64::MAX - 31] {
        let mut b = good_bytes();
        let at = tensor_entry(&b, "f32.vec") + 4 + 8 + 4;
        put_u64(&mut b, at, offset);
        let e = open_err(&b);
        assert!(
            e.contains(&format!(
                "tensor `f32.vec`: its 28 bytes at data offset {offset} run past the end"
            )),
            "{e}"
        );
    }
    let mut b = good_bytes();
    let at = tensor_entry(&b, "f32.vec") + 4 + 8 + 4;
    put_u64(&mut b, at, 33);
    assert!(
        open_err(&b)
            .contains("tensor `f32.vec`: data offset 33 is not a multiple of the alignment 32")
    );
}

#[test]
fn bad_dimensions_are_named() {
    let entry = |b: &[u8]| tensor_entry(b, "f16.mat");
    let mut b = good_bytes();
    let at = entry(&b);
    put_u64(&mut b, at + 4, 1 << 40);
    put_u64(&mut b, at + 12, 1 << 40);
    let e = open_err(&b);
    assert!(
        e.contains("tensor `f16.mat`: dimensions [1099511627776, 1099511627776] overflow"),
        "{e}"
    );

    let mut b = good_bytes();
    let at = entry(&b);
    put_u64(&mut b, at + 4, u64::MAX);
    assert!(open_err(&b).contains("tensor `f16.mat`: dimension 18446744073709551615 is too large"));

    let mut b = good_bytes();
    let at = entry(&b);
    put_u32(&mut b, at, 5);
    assert!(open_err(&b).contains("tensor `f16.mat`: 5 dimensions (GGUF allows at most 4)"));

    let mut b = good_bytes();
    let at = tensor_entry(&b, "q8_0.mat");
    put_u64(&mut b, at + 4, 48);
    let e = open_err(&b);
    assert!(
        e.contains("tensor `q8_0.mat`: rows of 48 elements are not whole Q8_0 blocks of 32"),
        "{e}"
    );
}

#[test]
fn unknown_or_unsupported_block_types_are_named() {
    for (id, want) in [
        (99, "unknown ggml type id 99"),
        (13, "ggml type Q5_K (id 13) is not supported"),
    ] {
        let mut b = good_bytes();
        let at = tensor_entry(&b, "q4_k.mat") + 4 + 2 * 8;
        assert_eq!(b[at], 12, "the fixture's Q4_K id");
        put_u32(&mut b, at, id);
        let e = open_err(&b);
        assert!(
            e.contains(&format!(
                "tensor `q4_k.mat`: {want}; Tessera reads F32, F16, BF16"
            )),
            "{e}"
        );
    }
}

#[test]
fn absurd_lengths_and_counts_fail_before_allocating() {
    let huge = 1u64 << 40;
    // The first key, general.architecture, and its string value.
    let mut b = good_bytes();
    assert_eq!(&b[32..52], b"general.architecture");
    put_u64(&mut b, 24, huge);
    let e = open_err(&b);
    assert!(
        e.contains("metadata key #0: 1099511627776 string bytes cannot fit"),
        "{e}"
    );
    let mut b = good_bytes();
    put_u64(&mut b, 56, huge);
    let e = open_err(&b);
    assert!(
        e.contains("metadata `general.architecture`: 1099511627776 string bytes cannot fit"),
        "{e}"
    );

    let mut b = good_bytes();
    let at = find(&b, b"tessera.strings") + "tessera.strings".len() + 4 + 4;
    put_u64(&mut b, at, huge);
    let e = open_err(&b);
    assert!(
        e.contains("metadata `tessera.strings`: 1099511627776 string array elements cannot fit"),
        "{e}"
    );

    let mut b = good_bytes();
    put_u64(&mut b, 8, u64::MAX);
    let e = open_err(&b);
    assert!(
        e.contains("the tensor count 18446744073709551615 cannot fit"),
        "{e}"
    );
    let mut b = good_bytes();
    put_u64(&mut b, 16, huge);
    assert!(open_err(&b).contains("the metadata count: 1099511627776 metadata entries cannot fit"));

    let mut b = good_bytes();
    let at = tensor_entry(&b, "f32.vec") - "f32.vec".len() - 8;
    put_u64(&mut b, at, huge);
    assert!(open_err(&b).contains("tensor name #0: 1099511627776 string bytes cannot fit"));
}

#[test]
fn duplicates_and_bad_values_are_named() {
    let mut b = good_bytes();
    let at = tensor_entry(&b, "f16.mat") - "f16.mat".len();
    b[at..at + 7].copy_from_slice(b"f32.vec");
    assert!(open_err(&b).contains("tensor `f32.vec` appears twice"));

    let mut b = good_bytes();
    let at = find(&b, b"tessera.i16");
    b[at..at + 11].copy_from_slice(b"tessera.u16");
    assert!(open_err(&b).contains("metadata `tessera.u16` appears twice"));

    let mut b = good_bytes();
    let at = find(&b, b"tessera.bool") + "tessera.bool".len() + 4;
    b[at] = 2;
    assert!(open_err(&b).contains("metadata `tessera.bool`: bool byte 2 is neither 0 nor 1"));

    let mut b = good_bytes();
    let at = find(&b, b"tessera.u8s") + "tessera.u8s".len();
    put_u32(&mut b, at, 77);
    assert!(open_err(&b).contains("metadata `tessera.u8s`: unknown value type 77"));

    let mut b = good_bytes();
    let at = find(&b, "✓".as_bytes());
    b[at] = 0xff;
    assert!(open_err(&b).contains("metadata `general.name`: string is not UTF-8"));
}

/// A GGUF v3 file built field by field, for what the Python writer will not produce.
#[derive(Default)]
struct Builder {
    kv: Vec<u8>,
    n_kv: u64,
    table: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
}

fn gguf_string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

impl Builder {
    /// `value` is the type id followed by the encoded value.
    fn kv(mut self, key: &str, value: &[u8]) -> Self {
        self.kv.extend(gguf_string(key));
        self.kv.extend_from_slice(value);
        self.n_kv += 1;
        self
    }

    fn f32_tensor(mut self, name: &str, values: &[f32], alignment: usize) -> Self {
        self.data
            .resize(self.data.len().next_multiple_of(alignment), 0);
        self.table.extend(gguf_string(name));
        self.table.extend(1u32.to_le_bytes());
        self.table.extend((values.len() as u64).to_le_bytes());
        self.table.extend(0u32.to_le_bytes());
        self.table.extend((self.data.len() as u64).to_le_bytes());
        self.data
            .extend(values.iter().flat_map(|v| v.to_le_bytes()));
        self.n_tensors += 1;
        self
    }

    fn build(self, alignment: usize) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(self.kv);
        out.extend(self.table);
        out.resize(out.len().next_multiple_of(alignment), 0);
        out.extend(self.data);
        out
    }
}

fn u32_value(v: u32) -> Vec<u8> {
    [4u32.to_le_bytes(), v.to_le_bytes()].concat()
}

#[test]
fn general_alignment_places_the_data() {
    let file = Builder::default()
        .kv("general.alignment", &u32_value(64))
        .f32_tensor("a", &[1.0, 2.0, 3.0], 64)
        .f32_tensor("b", &[-4.0], 64)
        .build(64);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("aligned.gguf");
    std::fs::write(&path, file).unwrap();
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.tensor("a").unwrap().to_f32().unwrap(), [1.0, 2.0, 3.0]);
    assert_eq!(g.tensor("b").unwrap().to_f32().unwrap(), [-4.0]);

    for bad in [0, 48] {
        let file = Builder::default()
            .kv("general.alignment", &u32_value(bad))
            .build(32);
        let e = open_err(&file);
        assert!(
            e.contains(&format!(
                "metadata `general.alignment` must be a u32 power of two, not U32({bad})"
            )),
            "{e}"
        );
    }
}

#[test]
fn deeply_nested_arrays_are_refused() {
    // Nine levels of single-element arrays around an empty u8 array.
    let mut value = [9u32.to_le_bytes(), 0u32.to_le_bytes()].concat();
    value.extend(0u64.to_le_bytes());
    for _ in 0..8 {
        value = [
            &9u32.to_le_bytes()[..],
            &9u32.to_le_bytes()[..],
            &1u64.to_le_bytes()[..],
            &value[4..],
        ]
        .concat();
    }
    let e = open_err(&Builder::default().kv("deep", &value).build(32));
    assert!(
        e.contains("metadata `deep`: arrays nested deeper than 8"),
        "{e}"
    );
}
