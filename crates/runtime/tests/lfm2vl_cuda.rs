//! LFM2-VL on CUDA against the CPU reference and the float64 fixtures
//! (`tools/fixtures/lfm2vl.py`), on a GPU machine: `lfm2vl_cuda --ignored`.
//!
//! - f32: image features, prompt logits and every greedy step's logits within 1e-5 of the CPU
//!   (relative to the tensor's largest value, at least 1), and the 32 greedy tokens identical to
//!   the reference's, decoded through the chat runtime (cached attention, the short
//!   convolution's state, continuous batching: every prompt case decodes in one batch);
//! - bf16: each tap against the float64 reference within 1.5× its bf16 storage floor
//!   (`tests/fixtures/lfm2vl/bf16_floor.json`, `tools/device/lfm2vl_bf16_floor.py`), the steps
//!   teacher-forced with the reference's tokens so both see the same inputs;
//! - `TESSERA_LFM2_FULL=DIR`: a full-size folder (`tools/device/make_lfm2vl_full.py`), CUDA f32
//!   against the CPU on an image prompt.

#![cfg(feature = "cuda")]

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::lfm2vl::{Cases, Expected, PromptCase, cases, files, image, messages, rel, spec};
use common::root;
use tessera_backend::cpu::CpuBackend;
use tessera_backend::cuda;
use tessera_backend::{AnyBackend, Backend, Precision};
use tessera_models::ModelFiles;
use tessera_models::chat_template::{Message, Part};
use tessera_models::lfm2vl::{CacheShape, Lfm2Vl, Lfm2VlConfig, Prompter, TilePatches, Turn};
use tessera_runtime::chat::{self, ChatEvent, ChatOptions, GenerationParams};
use tessera_runtime::decode::{Control, SamplingParams};

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn gpu(p: Precision) -> cuda::CudaBackend {
    cuda::open(0, p).unwrap_or_else(|e| panic!("CUDA device 0: {e}"))
}

/// What a backend gives for one prompt case: prompt logits (all rows) and each teacher-forced
/// step's logits; and each image's features.
struct Taps {
    logits: Vec<f32>,
    steps: Vec<f32>,
}

fn prompt_taps<B: Backend>(be: &B, c: &Cases, p: &PromptCase) -> Taps {
    let (f, cfg) = files(c, &p.model);
    let prompter = Prompter::load(&f, &cfg).unwrap();
    let (msgs, images) = messages(p);
    let prompt = prompter.build(&msgs, &images, true).unwrap();
    assert_eq!(prompt.ids, p.input_ids);
    let tiles = prompt.tiles(0);
    let mut m = Lfm2Vl::load(
        be,
        &f,
        &cfg,
        CacheShape {
            slots: 2,
            ctx: 1024,
        },
    )
    .unwrap();
    let logits = be
        .read_f32(
            m.extend(
                be,
                &[Turn {
                    seq: 1,
                    tokens: &prompt.ids,
                    tiles: &tiles,
                }],
                true,
            )
            .unwrap(),
        )
        .unwrap();
    let mut steps = be
        .read_f32(
            m.extend(
                be,
                &[Turn {
                    seq: 2,
                    tokens: &prompt.ids,
                    tiles: &tiles,
                }],
                false,
            )
            .unwrap(),
        )
        .unwrap();
    for &t in &p.greedy[..p.greedy.len() - 1] {
        let l = be
            .read_f32(
                m.extend(
                    be,
                    &[Turn {
                        seq: 2,
                        tokens: &[t],
                        tiles: &[],
                    }],
                    false,
                )
                .unwrap(),
            )
            .unwrap();
        steps.extend(l);
    }
    Taps { logits, steps }
}

fn image_features<B: Backend>(be: &B, c: &Cases, model: &str, name: &str) -> Vec<f32> {
    let (f, cfg) = files(c, model);
    let prompter = Prompter::load(&f, &cfg).unwrap();
    let processed = prompter.processor().process(&image(name)).unwrap();
    let tiles: Vec<TilePatches<'_>> = processed
        .tiles
        .iter()
        .map(|t| TilePatches {
            grid_w: t.grid_w,
            grid_h: t.grid_h,
            bytes: &t.patches,
        })
        .collect();
    let mut m = Lfm2Vl::load(be, &f, &cfg, CacheShape { slots: 1, ctx: 16 }).unwrap();
    let map = *m.pixel_map();
    be.read_f32(m.encoder.forward(be, &tiles, &map).unwrap())
        .unwrap()
}

/// The tower's pass is a replayable region keyed by its tiles' grids: captured the second time
/// a shape comes, replayed after. Two images of one shape, each encoded directly, then while
/// captured, then replayed (new pixels in the same buffers), give the same bits every time.
#[test]
#[ignore = "needs a CUDA device"]
fn replayed_tower_gives_the_direct_features() {
    use tessera_models::imageproc::Image;
    let c = cases();
    let model = &c.prompts[0].model;
    let (f, cfg) = files(&c, model);
    let prompter = Prompter::load(&f, &cfg).unwrap();
    let processed: Vec<_> = [3usize, 7]
        .iter()
        .map(|&k| {
            let rgb = (0..96 * 80 * 3).map(|i| ((i * k) % 253) as u8).collect();
            let img = Image::from_rgb8(96, 80, rgb).unwrap();
            prompter.processor().process(&img).unwrap()
        })
        .collect();
    let tiles: Vec<Vec<TilePatches<'_>>> =
        processed.iter().map(|p| p.patches().collect()).collect();
    assert_eq!(
        tiles[0]
            .iter()
            .map(|t| (t.grid_w, t.grid_h))
            .collect::<Vec<_>>(),
        tiles[1]
            .iter()
            .map(|t| (t.grid_w, t.grid_h))
            .collect::<Vec<_>>(),
        "one shape"
    );
    for p in [Precision::F32, Precision::Bf16] {
        let be = gpu(p);
        let mut m = Lfm2Vl::load(&be, &f, &cfg, CacheShape { slots: 1, ctx: 16 }).unwrap();
        let map = *m.pixel_map();
        let mut encode = |i: usize| {
            be.read_f32(m.encoder.forward(&be, &tiles[i], &map).unwrap())
                .unwrap()
        };
        // Direct (first sight), captured (second), then replayed twice.
        let runs: Vec<Vec<f32>> = [0, 1, 0, 1].into_iter().map(&mut encode).collect();
        assert_ne!(runs[0], runs[1], "{p:?}: the two images differ");
        for (a, b) in [(0, 2), (1, 3)] {
            let same = runs[a]
                .iter()
                .zip(&runs[b])
                .all(|(x, y)| x.to_bits() == y.to_bits());
            println!("{p:?}: run {b} against run {a}: the same bits: {same}");
            assert!(same, "{p:?}: replayed run {b} differs from run {a}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn f32_matches_the_cpu_and_decodes_the_reference_tokens() {
    let c = cases();
    let (cpu, gpu32) = (CpuBackend::new(), gpu(Precision::F32));
    let mut failures = Vec::new();
    let mut check = |what: String, e: f64, bound: f64| {
        println!("f32: {what}: rel {e:.2e} (bound {bound:.0e})");
        if e > bound || e.is_nan() {
            failures.push(format!("{what}: rel {e:.2e} > {bound:.0e}"));
        }
    };
    for (model, images) in &c.images {
        for im in images {
            let want = f64s(&image_features(&cpu, &c, model, &im.image));
            let got = image_features(&gpu32, &c, model, &im.image);
            check(
                format!("{model}.{} features", im.image),
                rel(&got, &want),
                1e-5,
            );
        }
    }
    for p in &c.prompts {
        let want = prompt_taps(&cpu, &c, p);
        let got = prompt_taps(&gpu32, &c, p);
        check(
            format!("{} prompt logits", p.case),
            rel(&got.logits, &f64s(&want.logits)),
            1e-5,
        );
        check(
            format!("{} step logits", p.case),
            rel(&got.steps, &f64s(&want.steps)),
            1e-5,
        );
    }
    // Greedy decoding through the chat runtime, every case of a model in one running batch.
    for model in c.models.keys() {
        let mut m = chat::load(
            AnyBackend::Cuda(Box::new(gpu(Precision::F32))),
            &spec(&c, model),
            CacheShape {
                slots: 4,
                ctx: 1024,
            },
            ChatOptions::default(),
        )
        .unwrap();
        let cases: Vec<&PromptCase> = c.prompts.iter().filter(|p| &p.model == model).collect();
        let params = GenerationParams {
            sampling: SamplingParams::default(),
            max_tokens: 32,
            stop: Vec::new(),
        };
        for (i, p) in cases.iter().enumerate() {
            let (msgs, images) = messages(p);
            m.begin(i as u64, m.prompt(&msgs, &images).unwrap(), &params)
                .unwrap();
        }
        let mut got = BTreeMap::new();
        while m
            .step(&mut |conv, ev| {
                if let ChatEvent::Done(r) = ev {
                    got.insert(conv, r.tokens);
                }
                Control::Continue
            })
            .unwrap()
            > 0
        {}
        for (i, p) in cases.iter().enumerate() {
            let ok = got.get(&(i as u64)) == Some(&p.greedy);
            println!("f32: {} greedy tokens identical: {ok}", p.case);
            if !ok {
                failures.push(format!(
                    "{}: greedy {:?} != {:?}",
                    p.case,
                    got.get(&(i as u64)),
                    p.greedy
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA device"]
fn bf16_stays_within_its_storage_floor() {
    let c = cases();
    let x = Expected::load();
    let floor_path = root().join("tests/fixtures/lfm2vl/bf16_floor.json");
    let floors: BTreeMap<String, BTreeMap<String, f64>> =
        serde_json::from_str(&std::fs::read_to_string(&floor_path).unwrap()).unwrap();
    let be = gpu(Precision::Bf16);
    let mut failures = Vec::new();
    let mut check = |case: &str, tap: &str, e: f64| {
        let floor = floors
            .get(case)
            .and_then(|t| t.get(tap))
            .copied()
            .unwrap_or_else(|| panic!("no floor for {case} / {tap} in {}", floor_path.display()));
        let ratio = e / floor;
        println!("bf16: {case} {tap}: rel {e:.3e}, floor {floor:.3e}, {ratio:.2}× the floor");
        if ratio > 1.5 || e.is_nan() {
            failures.push(format!("{case} {tap}: {ratio:.2}× the floor"));
        }
    };
    for (model, images) in &c.images {
        for im in images {
            let got = image_features(&be, &c, model, &im.image);
            let name = format!("{model}.{}", im.image);
            check(
                &name,
                "features",
                rel(&got, x.get(&format!("{name}.features"))),
            );
        }
    }
    for p in &c.prompts {
        let got = prompt_taps(&be, &c, p);
        check(
            &p.case,
            "logits",
            rel(&got.logits, x.get(&format!("{}.logits", p.case))),
        );
        check(
            &p.case,
            "step_logits",
            rel(&got.steps, x.get(&format!("{}.step_logits", p.case))),
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA device and TESSERA_LFM2_FULL"]
fn full_size_f32_matches_the_cpu() {
    let Some(dir) = std::env::var_os("TESSERA_LFM2_FULL") else {
        panic!("set TESSERA_LFM2_FULL to a full-size LFM2-VL folder");
    };
    let f = ModelFiles::Dir(PathBuf::from(dir));
    let cfg = Lfm2VlConfig::read(&f).unwrap();
    let prompter = Prompter::load(&f, &cfg).unwrap();
    let img = image("tiled400x368");
    let msgs = [Message::parts(
        "user",
        vec![
            Part::Image,
            Part::Text {
                text: "What is in this image?".into(),
            },
        ],
    )];
    let prompt = prompter
        .build(&msgs, std::slice::from_ref(&img), true)
        .unwrap();
    let tiles = prompt.tiles(0);
    let want = CpuBackend::new().logits(&f, &cfg, &prompt.ids, &tiles);
    let got = gpu(Precision::F32).logits(&f, &cfg, &prompt.ids, &tiles);
    let e = rel(&got, &f64s(&want));
    println!(
        "f32 full size: {} prompt tokens, last-row logits rel {e:.2e}",
        prompt.ids.len()
    );
    assert!(e <= 1e-5, "full size: rel {e:.2e}");
}

/// The last row's logits of a prompt, on any backend (for the full-size comparison).
trait BackendLogits {
    fn logits(
        &self,
        f: &ModelFiles,
        cfg: &Lfm2VlConfig,
        ids: &[u32],
        tiles: &[TilePatches<'_>],
    ) -> Vec<f32>;
}

impl<B: Backend> BackendLogits for B {
    fn logits(
        &self,
        f: &ModelFiles,
        cfg: &Lfm2VlConfig,
        ids: &[u32],
        tiles: &[TilePatches<'_>],
    ) -> Vec<f32> {
        let mut m = Lfm2Vl::load(
            self,
            f,
            cfg,
            CacheShape {
                slots: 1,
                ctx: ids.len() + 1,
            },
        )
        .unwrap();
        self.read_f32(
            m.extend(
                self,
                &[Turn {
                    seq: 1,
                    tokens: ids,
                    tiles,
                }],
                false,
            )
            .unwrap(),
        )
        .unwrap()
    }
}
