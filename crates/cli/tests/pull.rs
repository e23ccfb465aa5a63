//! `tessera pull` and download on first use against a fake hub on loopback (`fake_hub`), with
//! `HF_ENDPOINT` pointing at it and `HF_HOME` in a temporary folder: the bundled miniature
//! models are the served repos.

mod fake_hub;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use fake_hub::FakeHub;

const COMMIT: &str = "4f6a2c0e9b1d3a5c7e9f0b2d4c6e8a0b1c3d5e7f";

fn assets(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/assets")
        .join(name)
}

/// Every file under `dir`, as `/`-joined relative paths with their bytes.
fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p
                    .strip_prefix(dir)
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .replace('\\', "/");
                out.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

fn names(files: &[(String, Vec<u8>)]) -> BTreeSet<String> {
    files.iter().map(|(n, _)| n.clone()).collect()
}

/// Files a real repo has beside the model that Tessera must not download.
fn extras() -> Vec<(String, Vec<u8>)> {
    [
        (".gitattributes", "*.safetensors filter=lfs"),
        ("README.md", "# a model"),
        ("pytorch_model.bin", "not read by Tessera"),
        ("onnx/model.onnx", "an export"),
        ("1_Pooling/config.json", "{}"),
    ]
    .iter()
    .map(|(n, b)| (n.to_string(), b.as_bytes().to_vec()))
    .collect()
}

/// The hub with the bundled EmbeddingGemma 2 miniature as `org/egemma` (and extras).
fn egemma_hub() -> (FakeHub, Vec<(String, Vec<u8>)>) {
    let hub = FakeHub::start();
    let model = files_of(&assets("egemma2-mini"));
    let mut served = model.clone();
    served.extend(extras());
    hub.add_repo("org/egemma", COMMIT, served);
    (hub, model)
}

fn tessera(hub: &FakeHub, home: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.args(args)
        .env_remove("TESSERA_MODEL")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_TOKEN")
        .env_remove("HF_TOKEN_PATH")
        .env("TESSERA_DEVICE", "cpu")
        .env("HF_HOME", home)
        .env("HF_ENDPOINT", hub.url());
    c
}

fn run(c: &mut Command) -> Output {
    c.output().expect("runs")
}

fn ok(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "failed: {err}");
    assert!(!err.contains("panicked"), "{err}");
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn fails(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}: {err}");
    }
}

fn repo_dir(home: &Path, id: &str) -> PathBuf {
    home.join("hub")
        .join(format!("models--{}", id.replace('/', "--")))
}

fn snapshot(home: &Path, id: &str) -> PathBuf {
    repo_dir(home, id).join("snapshots").join(COMMIT)
}

/// The files each `resolve` request asked for.
fn resolved(hub: &FakeHub) -> BTreeSet<String> {
    hub.requests()
        .iter()
        .filter_map(|r| {
            r.path
                .split_once("/resolve/")
                .map(|(_, rest)| rest.split_once('/').unwrap().1.to_string())
        })
        .collect()
}

/// The embeddings `embed` prints (each line's `embedding`; its `model` is the `--model` given).
fn embed_out(c: &mut Command) -> Vec<serde_json::Value> {
    ok(&run(c.args([
        "--text",
        "which planet is red?",
        "--text",
        "b",
    ])))
    .lines()
    .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["embedding"].clone())
    .collect()
}

#[test]
fn pull_fetches_only_what_the_model_needs_with_the_token_then_embed_runs() {
    let (hub, model) = egemma_hub();
    let home = tempfile::tempdir().unwrap();
    let out = run(tessera(&hub, home.path(), &["pull", "org/egemma"]).env("HF_TOKEN", "hf_secret"));
    let stdout = ok(&out);
    let snap = snapshot(home.path(), "org/egemma");
    assert_eq!(stdout.trim(), snap.to_str().unwrap());
    // Exactly the model's files, byte for byte, in the cache layout.
    assert_eq!(files_of(&snap), model);
    assert_eq!(resolved(&hub), names(&model));
    let refs = std::fs::read_to_string(repo_dir(home.path(), "org/egemma").join("refs/main"));
    assert_eq!(refs.unwrap().trim(), COMMIT);
    let blobs: BTreeSet<String> =
        std::fs::read_dir(repo_dir(home.path(), "org/egemma").join("blobs"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
    assert_eq!(
        blobs.len(),
        model.len(),
        "no part or lock files left: {blobs:?}"
    );
    let weights = &model
        .iter()
        .find(|(n, _)| n == "model.safetensors")
        .unwrap()
        .1;
    assert!(blobs.contains(&fake_hub::sha256_hex(weights)));
    // Every request carried the token.
    let requests = hub.requests();
    assert!(!requests.is_empty());
    for r in &requests {
        assert_eq!(r.auth.as_deref(), Some("Bearer hf_secret"), "{}", r.path);
    }
    // The pulled repo runs offline and embeds as the folder does.
    let by_repo = embed_out(
        tessera(&hub, home.path(), &["embed", "--model", "org/egemma"]).env("HF_HUB_OFFLINE", "1"),
    );
    let folder = assets("egemma2-mini");
    let by_folder = embed_out(&mut tessera(
        &hub,
        home.path(),
        &["embed", "--model", folder.to_str().unwrap()],
    ));
    assert_eq!(by_repo, by_folder);
    assert_eq!(
        hub.requests().len(),
        requests.len(),
        "no request once cached"
    );
    // A second pull downloads nothing.
    let again = run(&mut tessera(&hub, home.path(), &["pull", "org/egemma"]));
    ok(&again);
    let after: Vec<_> = hub.requests()[requests.len()..].to_vec();
    assert!(
        after.iter().all(|r| r.path.starts_with("/api/")),
        "{after:?}"
    );
}

#[test]
fn embed_and_info_download_a_repo_on_first_use() {
    let (hub, _) = egemma_hub();
    let home = tempfile::tempdir().unwrap();
    let folder = assets("egemma2-mini");
    let by_folder = embed_out(&mut tessera(
        &hub,
        home.path(),
        &["embed", "--model", folder.to_str().unwrap()],
    ));
    assert!(hub.requests().is_empty());
    let by_repo = embed_out(&mut tessera(
        &hub,
        home.path(),
        &["embed", "--model", "org/egemma"],
    ));
    assert_eq!(by_repo, by_folder);
    assert!(
        snapshot(home.path(), "org/egemma")
            .join("model.safetensors")
            .is_file()
    );

    let home2 = tempfile::tempdir().unwrap();
    // The token file `hf auth login` writes stands in for HF_TOKEN.
    std::fs::write(home2.path().join("token"), "hf_from_file\n").unwrap();
    let before = hub.requests().len();
    let out = run(&mut tessera(
        &hub,
        home2.path(),
        &["info", "--model", "org/egemma"],
    ));
    let stdout = ok(&out);
    assert!(stdout.contains("EmbeddingGemma 2"), "{stdout}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("downloading"));
    let after = &hub.requests()[before..];
    assert!(!after.is_empty());
    assert!(
        after
            .iter()
            .all(|r| r.auth.as_deref() == Some("Bearer hf_from_file"))
    );
}

#[test]
fn an_interrupted_download_resumes_from_its_part() {
    let (hub, model) = egemma_hub();
    let home = tempfile::tempdir().unwrap();
    let weights = &model
        .iter()
        .find(|(n, _)| n == "model.safetensors")
        .unwrap()
        .1;
    let blobs = repo_dir(home.path(), "org/egemma").join("blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let half = weights.len() / 2;
    let part = blobs.join(format!("{}.part", fake_hub::sha256_hex(weights)));
    std::fs::write(&part, &weights[..half]).unwrap();
    ok(&run(&mut tessera(
        &hub,
        home.path(),
        &["pull", "org/egemma"],
    )));
    assert_eq!(files_of(&snapshot(home.path(), "org/egemma")), model);
    assert!(!part.exists());
    let ranges: Vec<_> = hub
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/model.safetensors"))
        .filter_map(|r| r.range)
        .collect();
    assert!(ranges.contains(&format!("bytes={half}-")), "{ranges:?}");
}

#[test]
fn a_file_that_fails_its_checksum_is_deleted_and_named() {
    let (hub, _) = egemma_hub();
    hub.corrupt("org/egemma", "model.safetensors");
    let home = tempfile::tempdir().unwrap();
    let out = run(&mut tessera(&hub, home.path(), &["pull", "org/egemma"]));
    fails(
        &out,
        &[
            "org/egemma",
            "model.safetensors",
            "checksum mismatch",
            "sha256",
        ],
    );
    let blobs = repo_dir(home.path(), "org/egemma").join("blobs");
    for e in std::fs::read_dir(&blobs).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        assert!(!name.ends_with(".part") && name.len() != 64, "left {name}");
    }
    let snap = snapshot(home.path(), "org/egemma");
    assert!(!snap.join("model.safetensors").exists());
    // The half-done snapshot does not pass for a model: config.json is linked last.
    assert!(!snap.join("config.json").exists());
    let out = run(tessera(
        &hub,
        home.path(),
        &["embed", "--model", "org/egemma", "--text", "x"],
    )
    .env("HF_HUB_OFFLINE", "1"));
    fails(&out, &["models--org--egemma", "HF_HUB_OFFLINE"]);
}

#[test]
fn offline_gives_the_not_cached_error_without_a_request() {
    let (hub, _) = egemma_hub();
    let home = tempfile::tempdir().unwrap();
    for args in [
        &["embed", "--model", "org/egemma", "--text", "x"][..],
        &["info", "--model", "org/egemma"],
    ] {
        let out = run(tessera(&hub, home.path(), args).env("HF_HUB_OFFLINE", "1"));
        fails(
            &out,
            &["models--org--egemma", "HF_HUB_OFFLINE", "tessera pull"],
        );
    }
    let out = run(tessera(&hub, home.path(), &["pull", "org/egemma"]).env("HF_HUB_OFFLINE", "1"));
    fails(&out, &["HF_HUB_OFFLINE"]);
    assert!(hub.requests().is_empty(), "{:?}", hub.requests());
}

#[test]
fn a_diffusers_repo_gives_its_components_and_a_gguf_repo_one_quantization() {
    let hub = FakeHub::start();
    let model = files_of(&assets("zimage-mini"));
    let mut served = model.clone();
    served.extend([
        (
            "z_image_turbo_bf16.safetensors".to_string(),
            b"single file".to_vec(),
        ),
        (
            "transformer/diffusion_pytorch_model.fp16.safetensors".to_string(),
            b"variant".to_vec(),
        ),
        ("assets/demo.png".to_string(), b"png".to_vec()),
    ]);
    hub.add_repo("org/zimage", COMMIT, served);
    let gguf = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/blocks.gguf"),
    )
    .unwrap();
    let quants = ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-f16.gguf"];
    let mut gguf_files: Vec<_> = quants
        .iter()
        .map(|q| (q.to_string(), gguf.clone()))
        .collect();
    gguf_files.push(("README.md".into(), b"# m".to_vec()));
    hub.add_repo("org/m-GGUF", COMMIT, gguf_files);

    let home = tempfile::tempdir().unwrap();
    ok(&run(&mut tessera(
        &hub,
        home.path(),
        &["pull", "org/zimage"],
    )));
    assert_eq!(files_of(&snapshot(home.path(), "org/zimage")), model);
    let out = run(
        tessera(&hub, home.path(), &["info", "--model", "org/zimage"]).env("HF_HUB_OFFLINE", "1"),
    );
    assert!(ok(&out).contains("Z-Image"));

    ok(&run(&mut tessera(
        &hub,
        home.path(),
        &["pull", "org/m-GGUF:Q8_0"],
    )));
    // The model's file and the repo's projector (no Q8_0 one here: F16's).
    let got = names(&files_of(&snapshot(home.path(), "org/m-GGUF")));
    assert_eq!(
        got,
        BTreeSet::from(["m-Q8_0.gguf".to_string(), "mmproj-m-f16.gguf".to_string()])
    );
    let out = run(&mut tessera(
        &hub,
        home.path(),
        &["pull", "org/m-GGUF:IQ1_S"],
    ));
    fails(&out, &["IQ1_S", "m-Q4_K_M.gguf"]);

    let out = run(&mut tessera(&hub, home.path(), &["pull", "org/missing"]));
    fails(&out, &["org/missing", "not found", hub.url()]);
    let out = run(&mut tessera(
        &hub,
        home.path(),
        &["embed", "--model", "org/missing", "--text", "x"],
    ));
    fails(&out, &["not found", "nor is there a folder org/missing"]);
}

/// LFM2-VL's GGUF repo as its authors lay it out (language models of several quantizations and
/// the mmproj file): a pull of one quantization fetches that model and the projector, and the
/// repo id then chats offline.
#[test]
fn a_gguf_vision_repo_pulls_its_projector_and_chats_by_repo_id() {
    let hub = FakeHub::start();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lfm2vl_gguf");
    let served: Vec<(String, Vec<u8>)> = [
        "LFM2-VL-mini-F32.gguf",
        "LFM2-VL-mini-Q8_0.gguf",
        "mmproj-LFM2-VL-mini-F32.gguf",
    ]
    .iter()
    .map(|n| (n.to_string(), std::fs::read(fixtures.join(n)).unwrap()))
    .collect();
    hub.add_repo("org/LFM2-VL-mini-GGUF", COMMIT, served);
    let home = tempfile::tempdir().unwrap();
    ok(&run(&mut tessera(
        &hub,
        home.path(),
        &["pull", "org/LFM2-VL-mini-GGUF:Q8_0"],
    )));
    let got = names(&files_of(&snapshot(home.path(), "org/LFM2-VL-mini-GGUF")));
    assert_eq!(
        got,
        BTreeSet::from([
            "LFM2-VL-mini-Q8_0.gguf".to_string(),
            "mmproj-LFM2-VL-mini-F32.gguf".to_string()
        ])
    );
    let out = run(tessera(
        &hub,
        home.path(),
        &[
            "chat",
            "--model",
            "org/LFM2-VL-mini-GGUF",
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
        ],
    )
    .env("HF_HUB_OFFLINE", "1"));
    ok(&out);
}
