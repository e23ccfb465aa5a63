//! LFM2-VL on the CPU against the reference's golden fixtures (`tools/fixtures/lfm2vl.py`:
//! float64 transformers 5.25 models built from the saved bf16 weights of two miniatures, one with
//! the projector's LayerNorm and the published weight names, one without either).
//!
//! The processor is tested on its own (`lfm2vl_processor.rs`); here the tower takes the
//! reference's patches and the language model the reference's token ids, so each number below
//! is the model's alone. Bounds: tower, unshuffle and image features within 1e-5 of the float64
//! reference (relative to the tensor's largest value), prompt logits within 1e-4, and the 32
//! greedy tokens identical, with each step's logits within 1e-4.

mod common;

use common::lfm2vl::{Cases, Expected, as_tiles, cases, messages, prompt_tiles, rel, tile_bytes};
use tessera_backend::cpu::CpuBackend;
use tessera_backend::{Backend, View};
use tessera_models::ModelFiles;
use tessera_models::lfm2vl::{CacheShape, Lfm2Vl, Lfm2VlConfig, Prompter, Turn};

fn load(be: &CpuBackend, c: &Cases, model: &str, slots: usize) -> Lfm2Vl<CpuBackend> {
    let files = ModelFiles::Dir(common::root().join(&c.models[model].folder));
    let cfg_path = files.path("config.json");
    let cfg = Lfm2VlConfig::parse(&cfg_path, &files.read("config.json").unwrap()).unwrap();
    Lfm2Vl::load(be, &files, &cfg, CacheShape { slots, ctx: 1024 }).unwrap()
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

/// The whole prompt path — chat template, image processor, placeholder expansion, tokenizer —
/// gives the reference processor's token ids, and the tiles its pixels.
#[test]
fn prompts_tokenise_as_the_reference_processor_does() {
    let (c, x) = (cases(), Expected::load());
    for p in &c.prompts {
        let files = ModelFiles::Dir(common::root().join(&c.models[&p.model].folder));
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
