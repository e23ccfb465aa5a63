//! LFM2-VL from its GGUF files (`tests/fixtures/lfm2vl_gguf/`, the bundled miniature converted by
//! llama.cpp's converter: `tools/fixtures/lfm2vl_gguf.py`) against the same model read from its
//! Hugging Face folder (`crates/models/assets/lfm2vl-mini`).
//!
//! The F32 file holds the checkpoint's bf16 weights exactly, so a folder of it must tokenise,
//! render, process and compute as the Hugging Face folder does. The GGUF files carry no image
//! settings beyond patch, merge factor and normalisation (llama.cpp applies the published
//! ones), while the miniature's `preprocessor_config.json` asks for smaller tiles: the folder
//! compared against is the miniature without that file, i.e. with the published settings.
//! The Q8_0 and Q4_0 files are compared with checkpoints of their own weights decoded to f32, and
//! so are the Q4_K_M and Q6_K files of a 256-wide variant (`k_quants/`: rows of 256, which the K
//! formats need). llama.cpp is the oracle of every language-model file (`llama_greedy.json`): it
//! tokenises each prompt as Tessera does, and its greedy continuations of the F32 file are
//! Tessera's. On the block-format files its tokens are the exact reading's wherever int8
//! rounding cannot decide the step (382 of 512 steps: all agree); its whole greedy runs are not
//! Tessera's int8 runs, which near-ties part (the ignored test says why).

mod common;

use std::path::{Path, PathBuf};

use tessera_backend::Backend;
use tessera_backend::cpu::CpuBackend;
use tessera_models::ModelFiles;
use tessera_models::chat_template::{ChatTemplate, Message, Part};
use tessera_models::imageproc::Image;
use tessera_models::lfm2vl::{self, CacheShape, Lfm2Vl, Lfm2VlConfig, Prompter, Turn};
use tessera_models::tokenize::TextTokenizer;
use tessera_runtime::{Family, ModelSpec};

const LM_F32: &str = "LFM2-VL-mini-F32.gguf";
const LM_Q8: &str = "LFM2-VL-mini-Q8_0.gguf";
const LM_Q4: &str = "LFM2-VL-mini-Q4_0.gguf";
const MMPROJ: &str = "mmproj-LFM2-VL-mini-F32.gguf";
/// The 256-wide variant, in its own folder with its projector.
const K_DIR: &str = "k_quants";
const LM_Q4KM: &str = "LFM2-VL-mini256-Q4_K_M.gguf";
const LM_Q6K: &str = "LFM2-VL-mini256-Q6_K.gguf";
const MMPROJ_256: &str = "mmproj-LFM2-VL-mini256-F32.gguf";

fn fixture(name: &str) -> PathBuf {
    common::root().join("tests/fixtures/lfm2vl_gguf").join(name)
}

fn mini() -> PathBuf {
    common::root().join("crates/models/assets/lfm2vl-mini")
}

/// A folder holding copies of the fixture files `names`.
fn folder(names: &[&str]) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for n in names {
        std::fs::copy(fixture(n), d.path().join(n)).unwrap();
    }
    d
}

/// The miniature's Hugging Face folder with the published image settings (its own
/// `preprocessor_config.json` left out).
fn hf_published_images() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(mini()).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap();
        if name != "preprocessor_config.json" {
            std::fs::copy(&p, d.path().join(name)).unwrap();
        }
    }
    d
}

/// A folder holding the language model `lm` (a path under the fixture folder) and its projector.
fn pair(lm: &str) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let lm = Path::new(lm);
    let sub = lm.parent().unwrap_or(Path::new(""));
    let proj = if sub == Path::new(K_DIR) {
        MMPROJ_256
    } else {
        MMPROJ
    };
    for f in [lm.to_path_buf(), sub.join(proj)] {
        std::fs::copy(
            fixture(f.to_str().unwrap()),
            d.path().join(f.file_name().unwrap()),
        )
        .unwrap();
    }
    d
}

fn gguf_files(dir: &Path) -> ModelFiles {
    lfm2vl::gguf::files(dir).unwrap()
}

fn image(name: &str) -> Image {
    Image::open(&common::root().join(format!("tests/fixtures/lfm2vl/images/{name}.png"))).unwrap()
}

/// A 1024×771 image: large enough for the published settings to cut it into 3×2 tiles and add
/// a thumbnail (a gradient with some deterministic noise).
fn large_image() -> Image {
    let (w, h): (usize, usize) = (1024, 771);
    let rgb = (0..w * h * 3)
        .map(|i| {
            let (p, c) = (i / 3, i % 3);
            let (x, y) = (p % w, p / w);
            let noise = (p.wrapping_mul(2_654_435_761) >> 7) % 41;
            ((x * 255 / w + y * (c + 1) * 97 / h + noise) % 256) as u8
        })
        .collect();
    Image::from_rgb8(w, h, rgb).unwrap()
}

/// Conversations that exercise the template: a system turn, text and image parts, several turns.
fn conversations() -> Vec<Vec<Message>> {
    vec![
        vec![Message::new("user", "Hello there!")],
        vec![
            Message::new("system", "You answer briefly."),
            Message::parts(
                "user",
                vec![
                    Part::Image,
                    Part::Text {
                        text: "What is in this image? Ünïcödé 東京 🚀".into(),
                    },
                ],
            ),
            Message::new("assistant", "A gradient."),
            Message::new("user", "And the numbers 12345, 678?"),
        ],
    ]
}

#[test]
fn the_tokenizer_from_gguf_metadata_encodes_and_decodes_as_the_checkpoints() {
    let dir = folder(&[LM_F32, MMPROJ]);
    let hf_files = ModelFiles::Dir(mini());
    let hf = TextTokenizer::load(&hf_files, (None, None)).unwrap();
    let gg = TextTokenizer::load(&gguf_files(dir.path()), (None, None)).unwrap();
    assert_eq!((gg.bos_id, gg.eos_id), (hf.bos_id, hf.eos_id));
    assert_eq!(gg.vocab_size(), hf.vocab_size());
    for id in 0..hf.vocab_size() as u32 {
        assert_eq!(gg.id_to_token(id), hf.id_to_token(id), "token {id}");
    }
    let template = ChatTemplate::load(&hf_files).unwrap().unwrap();
    let mut texts: Vec<String> = [
        "Hello, world! It's a test.",
        "the numbers 1, 22, 333, 4444 and 123456789",
        "naïve café — 東京 🚀 Ünïcödé",
        "tabs\tand  spaces\n\n  new lines \r\n end ",
        "<|im_start|>user\n<image><|im_end|>",
        "<|image_start|><|img_row_1_col_2|><image><image><|img_thumbnail|><|image_end|>",
        "<|startoftext|>text<|endoftext|><|pad|>",
        "",
    ]
    .map(String::from)
    .to_vec();
    for msgs in conversations() {
        texts.push(template.render(&msgs, true, &[]).unwrap());
    }
    for t in &texts {
        let ids = hf.encode_plain(t).unwrap();
        assert_eq!(gg.encode_plain(t).unwrap(), ids, "{t:?}");
        assert_eq!(
            gg.encode_with_bos_eos(t).unwrap(),
            hf.encode_with_bos_eos(t).unwrap(),
            "{t:?}"
        );
        for skip in [false, true] {
            assert_eq!(
                gg.decode(&ids, skip).unwrap(),
                hf.decode(&ids, skip).unwrap(),
                "{t:?}"
            );
        }
    }
}

#[test]
fn the_chat_template_from_gguf_renders_as_the_checkpoints() {
    let dir = folder(&[LM_F32, MMPROJ]);
    let hf = ChatTemplate::load(&ModelFiles::Dir(mini()))
        .unwrap()
        .unwrap();
    let gg = ChatTemplate::load(&gguf_files(dir.path()))
        .unwrap()
        .unwrap();
    for msgs in conversations() {
        for gen_prompt in [false, true] {
            assert_eq!(
                gg.render(&msgs, gen_prompt, &[]).unwrap(),
                hf.render(&msgs, gen_prompt, &[]).unwrap()
            );
        }
    }
}

/// The config, the prompt (ids, image spans and patches) and the logits of every prompt row of
/// `a` and `b` for the same conversation with images; returns the largest logit difference
/// relative to the largest logit.
fn compare_runs(a: &ModelFiles, b: &ModelFiles) -> f64 {
    let be = CpuBackend::new();
    let cfg_a = Lfm2VlConfig::read(a).unwrap();
    let cfg_b = Lfm2VlConfig::read(b).unwrap();
    assert_eq!(cfg_a, cfg_b);
    let images = [image("exact270x250"), large_image()];
    let msgs = vec![Message::parts(
        "user",
        vec![
            Part::Image,
            Part::Text {
                text: "Compare these two images.".into(),
            },
            Part::Image,
        ],
    )];
    let mut logits = Vec::new();
    let mut prompts = Vec::new();
    for files in [a, b] {
        let prompter = Prompter::load(files, &cfg_a).unwrap();
        let p = prompter.build(&msgs, &images, true).unwrap();
        let shape = CacheShape {
            slots: 1,
            ctx: 4096,
        };
        let mut m = Lfm2Vl::load(&be, files, &cfg_a, shape).unwrap();
        let tiles = p.tiles(0);
        let turn = Turn {
            seq: 1,
            tokens: &p.ids,
            tiles: &tiles,
        };
        logits.push(be.read_f32(m.extend(&be, &[turn], true).unwrap()).unwrap());
        prompts.push(p);
    }
    assert_eq!(prompts[0].ids, prompts[1].ids);
    assert_eq!(prompts[0].spans, prompts[1].spans);
    let patches = |i: usize| -> Vec<&[u8]> {
        prompts[i]
            .images
            .iter()
            .flat_map(|im| &im.tiles)
            .map(|t| &t.patches[..])
            .collect()
    };
    assert_eq!(patches(0), patches(1));
    assert!(
        prompts[0].images[1].tiles.len() > 1,
        "the second image is tiled"
    );
    let scale = logits[1].iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    assert!(scale > 0.0 && logits[0].len() == logits[1].len());
    let worst = logits[0]
        .iter()
        .zip(&logits[1])
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max);
    worst / scale
}

#[test]
fn the_f32_gguf_folder_computes_the_checkpoints_logits() {
    let dir = folder(&[LM_F32, MMPROJ]);
    let hf = hf_published_images();
    let rel = compare_runs(&gguf_files(dir.path()), &ModelFiles::Dir(hf.path().into()));
    eprintln!("F32 GGUF vs checkpoint: logits rel {rel:.2e}");
    assert!(rel <= 1e-5, "logits rel {rel:.2e} > 1e-5");
}

/// The miniature's folder (published image settings) with `model.safetensors` replaced by
/// every tensor of `files` decoded to f32, under the checkpoint's names.
fn decoded_checkpoint(files: &ModelFiles) -> tempfile::TempDir {
    let d = hf_published_images();
    let w = files.weights("model").unwrap();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = w
        .names()
        .into_iter()
        .map(|n| {
            let t = w.tensor(n).unwrap();
            let bytes = t.to_f32().iter().flat_map(|v| v.to_le_bytes()).collect();
            (n.to_string(), t.shape.clone(), bytes)
        })
        .collect();
    let views = tensors.iter().map(|(n, s, b)| {
        let v =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap();
        (n.clone(), v)
    });
    safetensors::serialize_to_file(views, None, &d.path().join("model.safetensors")).unwrap();
    d
}

#[test]
fn quantized_gguf_folders_compute_the_logits_of_their_decoded_weights() {
    use tessera_core::DType;
    for (lm, format) in [(LM_Q8, DType::Q8_0), (LM_Q4, DType::Q4_0)] {
        let dir = folder(&[lm, MMPROJ]);
        let gg = gguf_files(dir.path());
        // The blocks reach the backend as blocks (the table as llama.cpp's tools chose: Q8_0).
        let w = gg.weights("model").unwrap();
        let q = w
            .tensor("model.language_model.layers.0.conv.in_proj.weight")
            .unwrap();
        assert_eq!(q.dtype, format, "{lm}");
        let embed = w
            .tensor("model.language_model.embed_tokens.weight")
            .unwrap();
        assert_eq!(embed.dtype, DType::Q8_0, "{lm}");
        let decoded = decoded_checkpoint(&gg);
        let rel = compare_runs(&gg, &ModelFiles::Dir(decoded.path().into()));
        eprintln!("{lm} vs its decoded weights: logits rel {rel:.2e}");
        assert!(rel <= 1e-5, "{lm}: logits rel {rel:.2e} > 1e-5");
    }
}

#[test]
fn k_quant_gguf_folders_compute_the_logits_of_their_decoded_weights() {
    use tessera_core::DType;
    // llama-quantize's Q4_K_M: Q4_K, with Q6_K for the embedding table (also the tied output),
    // the attention's values and the last FFN's down projection; Q6_K: Q6_K throughout.
    let layer = |l: usize, t: &str| format!("model.language_model.layers.{l}.{t}.weight");
    for (lm, blocks) in [
        (
            LM_Q4KM,
            [
                (layer(0, "conv.in_proj"), DType::Q4_K),
                (layer(0, "feed_forward.w2"), DType::Q4_K),
                (layer(1, "self_attn.q_proj"), DType::Q4_K),
                (layer(1, "self_attn.v_proj"), DType::Q6_K),
                (layer(1, "feed_forward.w2"), DType::Q6_K),
            ],
        ),
        (
            LM_Q6K,
            [
                (layer(0, "conv.in_proj"), DType::Q6_K),
                (layer(0, "feed_forward.w2"), DType::Q6_K),
                (layer(1, "self_attn.q_proj"), DType::Q6_K),
                (layer(1, "self_attn.v_proj"), DType::Q6_K),
                (layer(1, "feed_forward.w2"), DType::Q6_K),
            ],
        ),
    ] {
        let dir = pair(&format!("{K_DIR}/{lm}"));
        let gg = gguf_files(dir.path());
        let w = gg.weights("model").unwrap();
        for (name, format) in &blocks {
            assert_eq!(w.tensor(name).unwrap().dtype, *format, "{lm}: {name}");
        }
        let embed = w
            .tensor("model.language_model.embed_tokens.weight")
            .unwrap();
        assert_eq!(embed.dtype, DType::Q6_K, "{lm}");
        let decoded = decoded_checkpoint(&gg);
        // The variant has no checkpoint folder of its own: its config is the one its files give.
        std::fs::write(
            decoded.path().join("config.json"),
            gg.read("config.json").unwrap(),
        )
        .unwrap();
        let rel = compare_runs(&gg, &ModelFiles::Dir(decoded.path().into()));
        eprintln!("{lm} vs its decoded weights: logits rel {rel:.2e}");
        assert!(rel <= 1e-5, "{lm}: logits rel {rel:.2e} > 1e-5");
    }
}

/// `llama_greedy.json`: llama.cpp's greedy continuations of each language-model file.
#[derive(serde::Deserialize)]
struct Oracle {
    llama_cpp: String,
    files: std::collections::BTreeMap<String, Vec<OracleCase>>,
}

#[derive(serde::Deserialize)]
struct OracleCase {
    name: String,
    /// The conversation a chat prompt renders (absent for a raw text).
    messages: Option<Vec<OracleMessage>>,
    /// What llama.cpp was given: the raw text, or the rendered conversation after its BOS.
    text: String,
    prompt_ids: Vec<u32>,
    generated: Vec<u32>,
}

#[derive(serde::Deserialize)]
struct OracleMessage {
    role: String,
    content: String,
}

fn oracle() -> Oracle {
    let path = fixture("llama_greedy.json");
    let oracle: Oracle = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    eprintln!("oracle: {}", oracle.llama_cpp);
    oracle
}

/// The top logit's index, and its lead over the second.
fn top2(logits: &[f32]) -> (u32, f32) {
    let (mut best, mut second) = ((0, f32::NEG_INFINITY), f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if v > best.1 {
            second = best.1;
            best = (i as u32, v);
        } else if v > second {
            second = v;
        }
    }
    (best.0, best.1 - second)
}

/// Tessera's greedy continuation of each case of the language-model file `file` (its ids as
/// llama.cpp gave them) against llama.cpp's; returns the divergences, each with both tokens'
/// logits and Tessera's lead at that step. Products on block weights take int8 activations
/// (`--precision int8`), as llama.cpp's CPU products do; on float weights they are f32.
fn greedy_divergences(file: &str, cases: &[OracleCase]) -> Vec<String> {
    use tessera_backend::Quantization;
    let dir = pair(file);
    let files = gguf_files(dir.path());
    let blocks = files
        .weights("model")
        .unwrap()
        .tensor("model.language_model.layers.0.conv.in_proj.weight")
        .unwrap()
        .dtype
        .is_quantized();
    let be = CpuBackend::new().quantizing(Quantization {
        int8: blocks,
        ..Quantization::default()
    });
    let cfg = Lfm2VlConfig::read(&files).unwrap();
    let mut failures = Vec::new();
    for case in cases {
        let shape = CacheShape { slots: 1, ctx: 256 };
        let mut m = Lfm2Vl::load(&be, &files, &cfg, shape).unwrap();
        let mut next = case.prompt_ids.clone();
        let mut min_lead = f32::INFINITY;
        for (step, &want) in case.generated.iter().enumerate() {
            let turn = Turn {
                seq: 1,
                tokens: &next,
                tiles: &[],
            };
            let logits = be.read_f32(m.extend(&be, &[turn], false).unwrap()).unwrap();
            let (got, lead) = top2(&logits);
            min_lead = min_lead.min(lead);
            if got != want {
                failures.push(format!(
                    "{file} {}: step {step}: Tessera {got} (logit {:.6}, lead {lead:.2e} over the \
                     next), llama.cpp {want} (logit {:.6})",
                    case.name, logits[got as usize], logits[want as usize]
                ));
                break;
            }
            next = vec![got];
        }
        eprintln!("{file} {}: smallest top-2 lead {min_lead:.4}", case.name);
    }
    failures
}

#[test]
fn llama_cpp_and_tessera_render_and_tokenise_every_prompt_alike() {
    let oracle = oracle();
    assert_eq!(oracle.files.len(), 5);
    for (file, cases) in &oracle.files {
        let dir = pair(file);
        let files = gguf_files(dir.path());
        let tok = TextTokenizer::load(&files, (None, None)).unwrap();
        let template = ChatTemplate::load(&files).unwrap().unwrap();
        let bos = tok.id_to_token(tok.bos_id).unwrap();
        for case in cases {
            let label = format!("{file} {}", case.name);
            let ids = match &case.messages {
                Some(msgs) => {
                    let msgs: Vec<Message> = msgs
                        .iter()
                        .map(|m| Message::new(&m.role, &m.content))
                        .collect();
                    let rendered = template.render(&msgs, true, &[]).unwrap();
                    assert_eq!(rendered, format!("{bos}{}", case.text), "{label}");
                    tok.encode_plain(&rendered).unwrap()
                }
                None => [vec![tok.bos_id], tok.encode_plain(&case.text).unwrap()].concat(),
            };
            assert_eq!(ids, case.prompt_ids, "{label}: prompt ids");
        }
    }
}

#[test]
fn the_f32_file_continues_every_prompt_as_llama_cpp_greedily() {
    let oracle = oracle();
    let failures = greedy_divergences(LM_F32, &oracle.files[LM_F32]);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Not yet: on the block-format files Tessera's int8 mode and llama.cpp part at a near-tie in 9
/// of the 16 cases. Int8 activations make logits jump with any upstream difference: moving
/// every activation that Tessera rounds to int8 up by one ulp either changes nothing or, where a
/// rounding flips, moves these miniatures' logits by 0.3–1.2 (of up to 80). Only bit-identical
/// activations could agree, and the engines' differ (f32 sums in another order; llama.cpp also
/// keeps f16 activation scales, f16 activations on F16 weights and 256-blocks for Q4_K/Q6_K):
/// along llama.cpp's path their largest logit difference is 0.6–2.2 at every step (median 1.2),
/// and every divergence is between two tokens within 0.0001–0.41 of each other in Tessera's
/// logits and 0.04–1.22 in llama.cpp's. The F32 file's logits differ by at most 8.5e-5.
#[test]
#[ignore = "Tessera's int8 mode does not round as llama.cpp's CPU does: near-ties part them"]
fn block_format_files_continue_every_prompt_as_llama_cpp_greedily() {
    let oracle = oracle();
    let failures: Vec<String> = oracle
        .files
        .iter()
        .filter(|(f, _)| *f != LM_F32)
        .flat_map(|(f, cases)| greedy_divergences(f, cases))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// What the block-format files' oracle can decide: llama.cpp's greedy token at each step of
/// its own path, against the token the file's weights give exactly. Tessera runs that path
/// twice, teacher-forced with llama.cpp's tokens: exact (f32 on the decoded weights, the
/// reference within 1e-5) and in int8 mode; the int8 run's largest logit error `F` at a step is
/// what int8 activations cost there. An engine whose int8 rounding is within 1.5× of that (the
/// rule for fast modes) cannot pick another token than the exact one where the exact top-2 lead
/// exceeds 2.5 `F`; at those steps llama.cpp's token must be the exact top token. So llama.cpp is
/// the oracle of how the file is read (tensors, layout, scales), not of int8's rounding, which
/// two engines never share (see the ignored test above). Steps closer than that are counted,
/// not judged, and must stay a minority or the test would decide nothing.
#[test]
fn block_format_files_agree_with_llama_cpp_wherever_int8_rounding_cannot_decide() {
    use tessera_backend::Quantization;
    let oracle = oracle();
    let (mut decided, mut total) = (0usize, 0usize);
    let mut failures = Vec::new();
    for (file, cases) in oracle.files.iter().filter(|(f, _)| *f != LM_F32) {
        let dir = pair(file);
        let files = gguf_files(dir.path());
        let cfg = Lfm2VlConfig::read(&files).unwrap();
        let run = |int8: bool| {
            CpuBackend::new().quantizing(Quantization {
                int8,
                ..Quantization::default()
            })
        };
        let (exact_be, int8_be) = (run(false), run(true));
        for case in cases {
            let shape = CacheShape { slots: 1, ctx: 256 };
            let mut exact = Lfm2Vl::load(&exact_be, &files, &cfg, shape).unwrap();
            let mut fast = Lfm2Vl::load(&int8_be, &files, &cfg, shape).unwrap();
            let mut next = case.prompt_ids.clone();
            for (step, &want) in case.generated.iter().enumerate() {
                let turn = Turn {
                    seq: 1,
                    tokens: &next,
                    tiles: &[],
                };
                let e = exact_be
                    .read_f32(
                        exact
                            .extend(&exact_be, std::slice::from_ref(&turn), false)
                            .unwrap(),
                    )
                    .unwrap();
                let q = int8_be
                    .read_f32(fast.extend(&int8_be, &[turn], false).unwrap())
                    .unwrap();
                let floor = e
                    .iter()
                    .zip(&q)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                let (top, lead) = top2(&e);
                total += 1;
                if lead > 2.5 * floor {
                    decided += 1;
                    if top != want {
                        failures.push(format!(
                            "{file} {} step {step}: llama.cpp {want}, the exact reading {top}                              (lead {lead:.3} > 2.5 × int8's {floor:.3})",
                            case.name
                        ));
                    }
                }
                next = vec![want];
            }
        }
    }
    eprintln!("decided {decided} of {total} steps");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        2 * decided > total,
        "only {decided} of {total} steps are decided: the oracle says too little"
    );
}

fn open_error(dir: &Path) -> String {
    match ModelSpec::open(Some(dir.to_str().unwrap()), Family::Lfm2Vl) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// A GGUF file of architecture `arch` with no tensors.
fn other_architecture(path: &Path, arch: &str) {
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // metadata entries
    let key = "general.architecture";
    b.extend((key.len() as u64).to_le_bytes());
    b.extend(key.as_bytes());
    b.extend(8u32.to_le_bytes()); // string
    b.extend((arch.len() as u64).to_le_bytes());
    b.extend(arch.as_bytes());
    std::fs::write(path, b).unwrap();
}

#[test]
fn a_gguf_folder_opens_and_a_wrong_one_says_what_is_wrong_and_what_to_do() {
    let ok = folder(&[LM_Q8, MMPROJ]);
    let spec = ModelSpec::open(Some(ok.path().to_str().unwrap()), Family::Lfm2Vl).unwrap();
    assert_eq!(spec.family, Family::Lfm2Vl);

    let only_mmproj = folder(&[MMPROJ]);
    let e = open_error(only_mmproj.path());
    assert!(
        e.contains("only a vision projector") && e.contains(MMPROJ) && e.contains("beside it"),
        "{e}"
    );
    let only_lm = folder(&[LM_F32]);
    let e = open_error(only_lm.path());
    assert!(
        e.contains(LM_F32) && e.contains("mmproj-*.gguf") && e.contains("download"),
        "{e}"
    );
    // The fixture folder itself holds two language models.
    let e = open_error(&fixture(""));
    assert!(
        e.contains("3 language-model GGUF files")
            && e.contains(LM_F32)
            && e.contains(LM_Q4)
            && e.contains(LM_Q8)
            && e.contains("move the others out"),
        "{e}"
    );
    let llama = tempfile::tempdir().unwrap();
    other_architecture(&llama.path().join("llama-7b-Q4_0.gguf"), "llama");
    let e = open_error(llama.path());
    assert!(
        e.contains("llama-7b-Q4_0.gguf") && e.contains("\"llama\"") && e.contains("LFM2-VL"),
        "{e}"
    );
    // Two projectors, and a projector for another model.
    let two = folder(&[LM_F32, MMPROJ]);
    std::fs::copy(fixture(MMPROJ), two.path().join("mmproj-other.gguf")).unwrap();
    let e = open_error(two.path());
    assert!(
        e.contains("2 projector files") && e.contains("keep the one"),
        "{e}"
    );
}

/// `bytes` with the u32 metadata value of `key` replaced by `value`.
fn patched(bytes: &[u8], key: &str, value: u32) -> Vec<u8> {
    // A key is its length (u64), its bytes, then the value's type (4 = u32) and the value.
    let mut needle = (key.len() as u64).to_le_bytes().to_vec();
    needle.extend(key.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("no key {key}"))
        + needle.len();
    assert_eq!(bytes[at..at + 4], 4u32.to_le_bytes(), "{key} is not a u32");
    let mut out = bytes.to_vec();
    out[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
    out
}

#[test]
fn metadata_that_disagrees_with_the_tensors_is_refused_naming_the_key() {
    let lm = std::fs::read(fixture(LM_F32)).unwrap();
    for (key, value) in [
        ("lfm2.block_count", 1 << 30),
        ("lfm2.embedding_length", u32::MAX),
        ("lfm2.feed_forward_length", 1 << 31),
        ("lfm2.shortconv.l_cache", 1 << 20),
        ("tokenizer.ggml.eos_token_id", 1 << 20),
    ] {
        let dir = folder(&[MMPROJ]);
        std::fs::write(dir.path().join(LM_F32), patched(&lm, key, value)).unwrap();
        let e = match lfm2vl::gguf::files(dir.path()) {
            Ok(_) => panic!("{key} = {value} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(key) && e.contains(LM_F32), "{key}: {e}");
    }
    let proj = std::fs::read(fixture(MMPROJ)).unwrap();
    for key in [
        "clip.vision.block_count",
        "clip.vision.embedding_length",
        "clip.vision.patch_size",
        "clip.vision.feed_forward_length",
    ] {
        let dir = folder(&[LM_F32]);
        std::fs::write(dir.path().join(MMPROJ), patched(&proj, key, 1 << 24)).unwrap();
        let e = match lfm2vl::gguf::files(dir.path()) {
            Ok(_) => panic!("{key} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(key) && e.contains(MMPROJ), "{key}: {e}");
    }
}
