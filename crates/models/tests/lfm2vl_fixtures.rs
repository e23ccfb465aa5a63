//! LFM2-VL on the CPU against the reference's golden fixtures (`tools/fixtures/lfm2vl.py`:
//! float64 transformers 5.25 models built from the saved bf16 weights of two miniatures, one with
//! the projector's LayerNorm and the published weight names, one without either).
//!
//! The processor is tested on its own (`lfm2vl_processor.rs`); here the tower takes the
//! reference's patches and the language model the reference's token ids, so each number below
//! is the model's alone. Bounds: tower, unshuffle and image features within 1e-5 of the float64
//! reference (relative to the tensor's largest value), prompt logits within 1e-4, and the 32
//! greedy tokens identical, with each step's logits within 1e-4.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tessera_backend::cpu::CpuBackend;
use tessera_backend::{Backend, View};
use tessera_core::config::parse_json;
use tessera_models::ModelFiles;
use tessera_models::chat_template::{Message, Part};
use tessera_models::imageproc::Image;
use tessera_models::lfm2vl::{CacheShape, Lfm2Vl, Lfm2VlConfig, Prompter, TilePatches, Turn};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[derive(Deserialize)]
struct Cases {
    models: BTreeMap<String, ModelCase>,
    images: BTreeMap<String, Vec<ImageCase>>,
    prompts: Vec<PromptCase>,
}

#[derive(Deserialize)]
struct ModelCase {
    folder: String,
}

#[derive(Deserialize)]
struct ImageCase {
    image: String,
    tiles: Vec<TileCase>,
    tokens: usize,
}

#[derive(Deserialize)]
struct TileCase {
    /// `[height, width]` in patches.
    spatial_shape: [usize; 2],
    patch_rows: [usize; 2],
}

#[derive(Deserialize)]
struct PromptCase {
    case: String,
    model: String,
    messages: Vec<serde_json::Value>,
    images: Vec<String>,
    input_ids: Vec<u32>,
    greedy: Vec<u32>,
    min_margin: f64,
}

struct Expected {
    tensors: BTreeMap<String, (Vec<usize>, Vec<f64>)>,
}

impl Expected {
    fn load() -> Self {
        let p = root().join("tests/fixtures/lfm2vl/expected.safetensors");
        let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let st =
            safetensors::SafeTensors::deserialize(&bytes).expect("expected.safetensors parses");
        let mut tensors = BTreeMap::new();
        for (name, t) in st.tensors() {
            let d = t.data();
            let values: Vec<f64> = match t.dtype() {
                safetensors::Dtype::F64 => d
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                safetensors::Dtype::F32 => d
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                safetensors::Dtype::U8 => d.iter().map(|&b| b as f64).collect(),
                other => panic!("{name}: unexpected dtype {other:?}"),
            };
            tensors.insert(name, (t.shape().to_vec(), values));
        }
        Expected { tensors }
    }

    fn get(&self, name: &str) -> &[f64] {
        &self
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("fixture tensor {name} missing"))
            .1
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

fn cases() -> Cases {
    let p = root().join("tests/fixtures/lfm2vl/cases.json");
    let text = std::fs::read_to_string(&p).unwrap();
    parse_json(&p, &text).unwrap()
}

/// `max |got − want| / max(1, max |want|)`.
fn rel(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g.is_finite() {
                (g as f64 - w).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
        / scale
}

fn load(be: &CpuBackend, c: &Cases, model: &str, slots: usize) -> Lfm2Vl<CpuBackend> {
    let files = ModelFiles::Dir(root().join(&c.models[model].folder));
    let cfg_path = files.path("config.json");
    let cfg = Lfm2VlConfig::parse(&cfg_path, &files.read("config.json").unwrap()).unwrap();
    Lfm2Vl::load(be, &files, &cfg, CacheShape { slots, ctx: 1024 }).unwrap()
}

/// Each tile's `(grid_w, grid_h, patch bytes)`, from the reference processor's pixels of the
/// image (the miniature's where this model's are not stored: the same processor settings but
/// the thumbnail, which comes last).
fn tile_bytes(x: &Expected, model: &str, case: &ImageCase) -> Vec<(usize, usize, Vec<u8>)> {
    let own = format!("{model}.{}.pixels", case.image);
    let name = if x.has(&own) {
        own
    } else {
        format!("mini.{}.pixels", case.image)
    };
    let px: Vec<u8> = x.get(&name).iter().map(|&v| v as u8).collect();
    let width = 3 * 16 * 16;
    case.tiles
        .iter()
        .map(|t| {
            let [a, b] = t.patch_rows;
            let [h, w] = t.spatial_shape;
            assert_eq!(b - a, h * w, "{}: patch rows", case.image);
            (w, h, px[a * width..b * width].to_vec())
        })
        .collect()
}

fn as_tiles(owned: &[(usize, usize, Vec<u8>)]) -> Vec<TilePatches<'_>> {
    owned
        .iter()
        .map(|(w, h, b)| TilePatches {
            grid_w: *w,
            grid_h: *h,
            bytes: b,
        })
        .collect()
}

fn read(be: &CpuBackend, v: View<'_, CpuBackend>) -> Vec<f32> {
    be.read_f32(v).unwrap()
}

#[test]
fn image_features_match_the_reference() {
    let (c, x, be) = (cases(), Expected::load(), CpuBackend::new());
    let mut worst = [0f64; 3];
    for (model, images) in &c.images {
        let mut m = load(&be, &c, model, 1);
        for case in images {
            let owned = tile_bytes(&x, model, case);
            let tiles = as_tiles(&owned);
            let patches: usize = tiles.iter().map(|t| t.patches()).sum();
            let map = *m.pixel_map();
            let feats = read(&be, m.encoder.forward(&be, &tiles, &map).unwrap());
            let vision = read(&be, m.encoder.last_hidden(patches).unwrap());
            let un = read(&be, m.encoder.last_unshuffled(case.tokens).unwrap());
            let name = format!("{model}.{}", case.image);
            for (i, (what, got)) in [
                ("vision", &vision),
                ("unshuffled", &un),
                ("features", &feats),
            ]
            .into_iter()
            .enumerate()
            {
                let e = rel(got, x.get(&format!("{name}.{what}")));
                eprintln!("{name}.{what}: rel {e:.2e}");
                assert!(e <= 1e-5, "{name}.{what}: rel {e:.2e} > 1e-5");
                worst[i] = worst[i].max(e);
            }
        }
    }
    eprintln!(
        "worst: vision {:.2e}, unshuffled {:.2e}, features {:.2e}",
        worst[0], worst[1], worst[2]
    );
}

/// The tiles of every image of a prompt, in order.
fn prompt_tiles(c: &Cases, x: &Expected, p: &PromptCase) -> Vec<(usize, usize, Vec<u8>)> {
    p.images
        .iter()
        .flat_map(|name| {
            let case = c.images[&p.model]
                .iter()
                .find(|i| &i.image == name)
                .unwrap_or_else(|| panic!("{}: image {name} not in the fixture", p.case));
            tile_bytes(x, &p.model, case)
        })
        .collect()
}

#[test]
fn prompt_logits_and_greedy_decoding_match_the_reference() {
    let (c, x, be) = (cases(), Expected::load(), CpuBackend::new());
    for p in &c.prompts {
        assert!(
            p.min_margin >= 1e-2,
            "{}: the fixture's margin {} is not a fair test",
            p.case,
            p.min_margin
        );
        let mut m = load(&be, &c, &p.model, 2);
        let owned = prompt_tiles(&c, &x, p);
        let tiles = as_tiles(&owned);
        let vocab = m.config().text.vocab;
        // Every prompt row at once (sequence 1), against the reference's logits.
        let all = read(
            &be,
            m.extend(
                &be,
                &[Turn {
                    seq: 1,
                    tokens: &p.input_ids,
                    tiles: &tiles,
                }],
                true,
            )
            .unwrap(),
        );
        let e = rel(&all, x.get(&format!("{}.logits", p.case)));
        eprintln!("{}: prompt logits rel {e:.2e}", p.case);
        assert!(e <= 1e-4, "{}: prompt logits rel {e:.2e} > 1e-4", p.case);
        m.text.release(1);
        // Prefill, then greedy decoding one token at a time (sequence 2), each step's logits
        // against the reference's.
        let steps = x.get(&format!("{}.step_logits", p.case));
        let mut logits = read(
            &be,
            m.extend(
                &be,
                &[Turn {
                    seq: 2,
                    tokens: &p.input_ids,
                    tiles: &tiles,
                }],
                false,
            )
            .unwrap(),
        );
        let mut got = Vec::new();
        let mut worst = 0f64;
        for (i, want) in steps.chunks_exact(vocab).enumerate().take(p.greedy.len()) {
            worst = worst.max(rel(&logits, want));
            let next = logits
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (t, &v)| if v > b.1 { (t, v) } else { b },
                )
                .0 as u32;
            got.push(next);
            if i + 1 < p.greedy.len() {
                logits = read(
                    &be,
                    m.extend(
                        &be,
                        &[Turn {
                            seq: 2,
                            tokens: &[next],
                            tiles: &[],
                        }],
                        false,
                    )
                    .unwrap(),
                );
            }
        }
        eprintln!("{}: step logits rel {worst:.2e}", p.case);
        assert_eq!(got, p.greedy, "{}: greedy continuation", p.case);
        assert!(
            worst <= 1e-4,
            "{}: step logits rel {worst:.2e} > 1e-4",
            p.case
        );
    }
}

/// The fixture's messages as the chat template takes them, and the images they name, in order.
fn messages(p: &PromptCase) -> (Vec<Message>, Vec<Image>) {
    let mut images = Vec::new();
    let msgs = p
        .messages
        .iter()
        .map(|m| {
            let role = m["role"].as_str().unwrap();
            match &m["content"] {
                serde_json::Value::String(s) => Message::new(role, s),
                serde_json::Value::Array(items) => Message::parts(
                    role,
                    items
                        .iter()
                        .map(|it| match it["type"].as_str().unwrap() {
                            "image" => {
                                let name = it["image"].as_str().unwrap();
                                let path =
                                    root().join(format!("tests/fixtures/lfm2vl/images/{name}.png"));
                                images.push(Image::open(&path).unwrap());
                                Part::Image
                            }
                            _ => Part::Text {
                                text: it["text"].as_str().unwrap().into(),
                            },
                        })
                        .collect(),
                ),
                other => panic!("{}: content {other}", p.case),
            }
        })
        .collect();
    (msgs, images)
}

/// The whole prompt path — chat template, image processor, placeholder expansion, tokenizer —
/// gives the reference processor's token ids, and the tiles its pixels.
#[test]
fn prompts_tokenise_as_the_reference_processor_does() {
    let (c, x) = (cases(), Expected::load());
    for p in &c.prompts {
        let files = ModelFiles::Dir(root().join(&c.models[&p.model].folder));
        let cfg = Lfm2VlConfig::read(&files).unwrap();
        let prompter = Prompter::load(&files, &cfg).unwrap();
        let (msgs, images) = messages(p);
        let prompt = prompter.build(&msgs, &images, true).unwrap();
        assert_eq!(prompt.ids, p.input_ids, "{}: token ids", p.case);
        let want = prompt_tiles(&c, &x, p);
        let got = prompt.tiles(0);
        assert_eq!(got.len(), want.len(), "{}: tiles", p.case);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                (g.grid_w, g.grid_h),
                (w.0, w.1),
                "{}: tile {i} grid",
                p.case
            );
            assert!(
                g.bytes == w.2.as_slice(),
                "{}: tile {i} pixels differ",
                p.case
            );
        }
        // Image spans cover each image's markers and tokens, in order.
        assert_eq!(prompt.spans.len(), images.len());
        assert_eq!(prompt.first_image_after(0), Some(0));
        if let Some(&(a, b)) = prompt.spans.first() {
            assert_eq!(prompt.first_image_after(a + 1), None, "inside an image");
            assert_eq!(prompt.first_image_after(b), Some(1));
        }
    }
}
