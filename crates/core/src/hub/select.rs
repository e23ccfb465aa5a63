//! Which files of a repo Tessera needs, from the repo's file list (and the few JSON files that
//! name others). The rule, per model folder (the root of a transformers repo, each component
//! folder that a diffusers `model_index.json` names):
//!
//! - its `*.json`, `*.jinja` and `*.txt` files (configs, tokenizers, templates, merges);
//! - its weights as [`crate::Weights::open_dir`] reads them: `{stem}.safetensors.index.json` and
//!   the shards its `weight_map` names, else `{stem}.safetensors` (`stem` is `model` or
//!   `diffusion_pytorch_model`); other safetensors (fp16 variants, single-file checkpoints)
//!   and other formats (`.bin`, ONNX, …) are left;
//! - failing those, one GGUF model: the file whose name holds the `:QUANT` asked for, else the
//!   one holding `Q4_K_M`, else the first by name (with every part of a split file); and, where
//!   the repo has vision projectors (`mmproj*.gguf`, which a vision model such as LFM2-VL
//!   cannot run without), one of them: the one holding the same `:QUANT`, else `F16`, else the
//!   first by name. The projector is fetched first.
//!
//! A diffusers repo's root gives only `model_index.json`; a transformers repo's subfolders
//! (sentence-transformers modules, ONNX exports) are left.

use std::collections::BTreeSet;

use serde::Deserialize;

use crate::error::{Error, Result};

/// The safetensors stems Tessera's loader opens.
const STEMS: [&str; 2] = ["model", "diffusion_pytorch_model"];

/// The files of `repo` to download, in the order to fetch them (files other files are read
/// from first). `read` gives the text of a listed file (downloading it); it is called only for
/// `model_index.json` and safetensors indexes.
pub fn plan(
    repo: &str,
    files: &[String],
    quant: Option<&str>,
    read: &mut dyn FnMut(&str) -> Result<String>,
) -> Result<Vec<String>> {
    let listed: BTreeSet<&str> = files.iter().map(String::as_str).collect();
    let mut out = Vec::new();
    if listed.contains("model_index.json") {
        let index = read("model_index.json")?;
        out.push("model_index.json".to_string());
        let components = components(repo, &index)?;
        if components.is_empty() {
            return Err(hub_error(
                repo,
                "model_index.json names no component folders",
            ));
        }
        for c in components {
            folder(repo, &listed, &format!("{c}/"), None, read, &mut out)?;
        }
    } else {
        let found = folder(repo, &listed, "", quant, read, &mut out)?;
        if !found {
            return Err(hub_error(
                repo,
                "has neither model.safetensors (or its index) nor a GGUF file: Tessera reads safetensors and GGUF weights",
            ));
        }
    }
    if let Some(q) = quant
        && !out.iter().any(|f| f.ends_with(".gguf"))
    {
        return Err(hub_error(
            repo,
            &format!(":{q} picks a GGUF file, and this repo's model has none"),
        ));
    }
    Ok(out)
}

fn hub_error(repo: &str, message: &str) -> Error {
    Error::Hub {
        repo: repo.to_string(),
        message: message.to_string(),
    }
}

/// The component folders a diffusers `model_index.json` names: keys not starting with `_` whose
/// value is a `[library, class]` pair (null pairs are absent components).
fn components(repo: &str, json: &str) -> Result<Vec<String>> {
    let index: serde_json::Map<String, serde_json::Value> = serde_json::from_str(json)
        .map_err(|e| hub_error(repo, &format!("model_index.json: invalid JSON: {e}")))?;
    let mut out = Vec::new();
    for (name, value) in index {
        if name.starts_with('_') {
            continue;
        }
        let Some(pair) = value.as_array() else {
            continue;
        };
        if pair.len() == 2 && pair.iter().all(|v| v.is_string()) {
            if !safe_segment(&name) {
                return Err(hub_error(
                    repo,
                    &format!("model_index.json: component {name:?} is not a folder name"),
                ));
            }
            out.push(name);
        }
    }
    Ok(out)
}

fn safe_segment(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\\'])
}

/// Adds the files of the folder `prefix` (`""` or `"name/"`) to `out`; true when it has weights.
fn folder(
    repo: &str,
    listed: &BTreeSet<&str>,
    prefix: &str,
    quant: Option<&str>,
    read: &mut dyn FnMut(&str) -> Result<String>,
    out: &mut Vec<String>,
) -> Result<bool> {
    let here: Vec<&str> = listed
        .iter()
        .copied()
        .filter(|f| f.strip_prefix(prefix).is_some_and(|r| !r.contains('/')))
        .collect();
    let weights = weights(repo, &here, prefix, quant, read)?;
    for f in &here {
        let text = [".json", ".jinja", ".txt"].iter().any(|e| f.ends_with(e));
        if text && !f.ends_with(".safetensors.index.json") && !out.iter().any(|o| o == f) {
            out.push(f.to_string());
        }
    }
    let found = !weights.is_empty();
    out.extend(weights);
    Ok(found)
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: std::collections::HashMap<String, String>,
}

/// The weight files of one folder (its index first), empty when it has none.
fn weights(
    repo: &str,
    here: &[&str],
    prefix: &str,
    quant: Option<&str>,
    read: &mut dyn FnMut(&str) -> Result<String>,
) -> Result<Vec<String>> {
    for stem in STEMS {
        let index = format!("{prefix}{stem}.safetensors.index.json");
        if here.contains(&index.as_str()) {
            let text = read(&index)?;
            let parsed: ShardIndex = serde_json::from_str(&text)
                .map_err(|e| hub_error(repo, &format!("{index}: invalid shard index: {e}")))?;
            let shards: BTreeSet<String> = parsed.weight_map.into_values().collect();
            let mut out = vec![index.clone()];
            for s in shards {
                let path = format!("{prefix}{s}");
                if !safe_segment(&s) || !here.contains(&path.as_str()) {
                    return Err(hub_error(
                        repo,
                        &format!("{index} names the shard {s:?}, which the repo does not list"),
                    ));
                }
                out.push(path);
            }
            return Ok(out);
        }
        let single = format!("{prefix}{stem}.safetensors");
        if here.contains(&single.as_str()) {
            return Ok(vec![single]);
        }
    }
    gguf(repo, here, quant)
}

/// One GGUF model of the folder (all parts of a split one), by the rule in the module doc.
fn gguf(repo: &str, here: &[&str], quant: Option<&str>) -> Result<Vec<String>> {
    let models: Vec<&str> = here
        .iter()
        .copied()
        .filter(|f| f.ends_with(".gguf") && !base(f).to_ascii_lowercase().contains("mmproj"))
        .collect();
    if models.is_empty() {
        return Ok(Vec::new());
    }
    let holds = |f: &str, q: &str| {
        let (f, q) = (base(f).to_ascii_uppercase(), q.to_ascii_uppercase());
        // `Q4_K` must not pick `Q4_K_M`: the quantization ends at a separator.
        f.match_indices(&q).any(|(i, _)| {
            let before = f[..i].chars().next_back();
            let after = f[i + q.len()..].chars().next();
            before.is_none_or(|c| !c.is_ascii_alphanumeric() && c != '_')
                && after.is_none_or(|c| !c.is_ascii_alphanumeric() && c != '_')
        })
    };
    let chosen = match quant {
        Some(q) => models.iter().find(|f| holds(f, q)).ok_or_else(|| {
            hub_error(
                repo,
                &format!("no GGUF file holds {q} (there are {})", models.join(", ")),
            )
        })?,
        None => models
            .iter()
            .find(|f| holds(f, "Q4_K_M"))
            .unwrap_or(&models[0]),
    };
    let projectors: Vec<&str> = here
        .iter()
        .copied()
        .filter(|f| f.ends_with(".gguf") && base(f).to_ascii_lowercase().contains("mmproj"))
        .collect();
    let projector = quant
        .and_then(|q| projectors.iter().find(|f| holds(f, q)))
        .or_else(|| projectors.iter().find(|f| holds(f, "F16")))
        .or(projectors.first());
    let mut out: Vec<String> = projector.iter().map(|f| f.to_string()).collect();
    match split_stem(chosen) {
        Some(stem) => out.extend(
            models
                .iter()
                .filter(|f| split_stem(f) == Some(stem))
                .map(|f| f.to_string()),
        ),
        None => out.push(chosen.to_string()),
    }
    Ok(out)
}

fn base(f: &str) -> &str {
    f.rsplit('/').next().unwrap_or(f)
}

/// `name` of a split GGUF `name-00001-of-00003.gguf`.
fn split_stem(f: &str) -> Option<&str> {
    let stem = f.strip_suffix(".gguf")?;
    let (head, total) = stem.rsplit_once("-of-")?;
    let (name, part) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.chars().all(|c| c.is_ascii_digit());
    (digits(part) && digits(total)).then_some(name)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn run(files: &[&str], texts: &[(&str, &str)], quant: Option<&str>) -> Result<Vec<String>> {
        let files: Vec<String> = files.iter().map(|s| s.to_string()).collect();
        let texts: HashMap<&str, &str> = texts.iter().copied().collect();
        let mut reads = Vec::new();
        let out = plan("o/r", &files, quant, &mut |f| {
            reads.push(f.to_string());
            texts
                .get(f)
                .map(|t| t.to_string())
                .ok_or_else(|| Error::Input(format!("read {f}")))
        });
        // Only files the plan keeps are ever read.
        if let Ok(out) = &out {
            assert!(reads.iter().all(|r| out.contains(r)), "{reads:?} {out:?}");
        }
        out
    }

    #[test]
    fn transformers_repo_takes_configs_and_model_safetensors() {
        let got = run(
            &[
                ".gitattributes",
                "README.md",
                "config.json",
                "tokenizer.json",
                "tokenizer.model",
                "chat_template.jinja",
                "merges.txt",
                "model.safetensors",
                "pytorch_model.bin",
                "onnx/model.onnx",
                "1_Pooling/config.json",
            ],
            &[],
            None,
        )
        .unwrap();
        assert_eq!(
            got,
            [
                "chat_template.jinja",
                "config.json",
                "merges.txt",
                "tokenizer.json",
                "model.safetensors"
            ]
        );
    }

    #[test]
    fn sharded_checkpoint_takes_the_shards_its_index_names() {
        let index = r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}}"#;
        let got = run(
            &[
                "config.json",
                "model.safetensors.index.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "model-00001-of-00009.safetensors",
            ],
            &[("model.safetensors.index.json", index)],
            None,
        )
        .unwrap();
        assert_eq!(
            got,
            [
                "config.json",
                "model.safetensors.index.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        let bad = r#"{"weight_map": {"a": "../x.safetensors"}}"#;
        let e = run(
            &["config.json", "model.safetensors.index.json"],
            &[("model.safetensors.index.json", bad)],
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("../x.safetensors") && e.contains("o/r"), "{e}");
    }

    #[test]
    fn diffusers_repo_takes_the_components_model_index_names() {
        let index = r#"{"_class_name": "ZImagePipeline", "scheduler": ["diffusers", "S"], "transformer": ["diffusers", "T"], "vae": ["diffusers", "V"], "safety_checker": [null, null]}"#;
        let got = run(
            &[
                "model_index.json",
                "z_image_turbo_bf16.safetensors",
                "assets/a.png",
                "scheduler/scheduler_config.json",
                "transformer/config.json",
                "transformer/diffusion_pytorch_model.safetensors",
                "transformer/diffusion_pytorch_model.fp16.safetensors",
                "vae/config.json",
                "vae/diffusion_pytorch_model.safetensors",
                "vae/diffusion_pytorch_model.bin",
            ],
            &[("model_index.json", index)],
            None,
        )
        .unwrap();
        assert_eq!(
            got,
            [
                "model_index.json",
                "scheduler/scheduler_config.json",
                "transformer/config.json",
                "transformer/diffusion_pytorch_model.safetensors",
                "vae/config.json",
                "vae/diffusion_pytorch_model.safetensors"
            ]
        );
    }

    #[test]
    fn gguf_repo_takes_one_quantization() {
        let files = [
            "README.md",
            "m-Q4_K.gguf",
            "m-Q4_K_M.gguf",
            "m-Q8_0.gguf",
            "m-F16-00001-of-00002.gguf",
            "m-F16-00002-of-00002.gguf",
            "mmproj-m-f16.gguf",
            "mmproj-m-Q8_0.gguf",
        ];
        // With the projector: the same quantization's, else F16's.
        let p = "mmproj-m-f16.gguf";
        assert_eq!(run(&files, &[], None).unwrap(), [p, "m-Q4_K_M.gguf"]);
        assert_eq!(run(&files, &[], Some("q4_k")).unwrap(), [p, "m-Q4_K.gguf"]);
        assert_eq!(
            run(&files, &[], Some("Q8_0")).unwrap(),
            ["mmproj-m-Q8_0.gguf", "m-Q8_0.gguf"]
        );
        assert_eq!(
            run(&files, &[], Some("F16")).unwrap(),
            [p, "m-F16-00001-of-00002.gguf", "m-F16-00002-of-00002.gguf"]
        );
        // A repo of projectors only has no model.
        assert!(run(&["mmproj-m-f16.gguf"], &[], None).is_err());
        let e = run(&files, &[], Some("IQ2_XS")).unwrap_err().to_string();
        assert!(e.contains("IQ2_XS") && e.contains("m-Q8_0.gguf"), "{e}");
        // Without Q4_K_M: the first by name.
        assert_eq!(
            run(&["b-Q8_0.gguf", "a-Q5_0.gguf"], &[], None).unwrap(),
            ["a-Q5_0.gguf"]
        );
    }

    #[test]
    fn a_repo_without_weights_tessera_reads_is_refused() {
        let e = run(&["config.json", "pytorch_model.bin"], &[], None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("safetensors") && e.contains("GGUF"), "{e}");
        let e = run(&["config.json", "model.safetensors"], &[], Some("Q4_K_M"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(":Q4_K_M"), "{e}");
    }
}
