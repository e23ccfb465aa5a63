//! Which model a folder holds, what it does, and which devices can run it — read from the
//! folder's `model_index.json` (diffusers pipelines) or `config.json` (transformers models)
//! before any weight loads.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tessera_backend::{AnyBackend, DeviceRequest, Op, Precision, Quantization};
use tessera_core::{DType, Error, Result, config::read_json, model_dir};
use tessera_models::ModelFiles;
use tessera_models::egemma2::{self, Config as Egemma2Config};
use tessera_models::gguf_folder::{GgufFolder, file_name};
use tessera_models::lfm2vl::{self, Lfm2VlConfig};
use tessera_models::qwen_image::{self, QwenImageConfigs, QwenImageFiles};
use tessera_models::zimage::{self, ZImageConfigs, ZImageFiles};

/// A model family Tessera runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    EmbeddingGemma2,
    ZImage,
    Lfm2Vl,
    QwenImage,
}

/// What a family does, and so which front end serves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capability {
    /// Text and image embeddings (`tessera embed`, `/v1/embeddings`).
    Embed,
    /// Text to image (`tessera generate`).
    GenerateImage,
    /// Images and a question in, text out (`tessera chat`, `/v1/chat/completions`).
    Chat,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::EmbeddingGemma2 => "EmbeddingGemma 2",
            Family::ZImage => "Z-Image",
            Family::Lfm2Vl => "LFM2-VL",
            Family::QwenImage => "Qwen-Image-2.1",
        }
    }

    /// The name of the miniature model of this family compiled into the binary.
    pub fn bundled_name(self) -> &'static str {
        match self {
            Family::EmbeddingGemma2 => "bundled egemma2-mini",
            Family::ZImage => "bundled zimage-mini",
            Family::Lfm2Vl => "bundled lfm2vl-mini",
            Family::QwenImage => "bundled qwen-image-mini",
        }
    }

    pub fn capability(self) -> Capability {
        match self {
            Family::EmbeddingGemma2 => Capability::Embed,
            Family::ZImage | Family::QwenImage => Capability::GenerateImage,
            Family::Lfm2Vl => Capability::Chat,
        }
    }
}

impl Capability {
    /// The command that uses it, for messages.
    pub fn command(self) -> &'static str {
        match self {
            Capability::Embed => "tessera embed",
            Capability::GenerateImage => "tessera generate",
            Capability::Chat => "tessera chat",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Capability::Embed => "embeddings",
            Capability::GenerateImage => "text to image",
            Capability::Chat => "chat",
        }
    }
}

/// Where a model's files are and its configs as read (and checked) from them, by family.
#[derive(Clone, Debug)]
pub enum ModelFilesOf {
    EmbeddingGemma2(ModelFiles, Box<Egemma2Config>),
    ZImage(ZImageFiles, Box<ZImageConfigs>),
    Lfm2Vl(ModelFiles, Box<Lfm2VlConfig>),
    QwenImage(QwenImageFiles, Box<QwenImageConfigs>),
}

impl ModelFilesOf {
    fn embedding_gemma2(files: ModelFiles) -> Result<Self> {
        let config = Egemma2Config::read(&files)?;
        Ok(ModelFilesOf::EmbeddingGemma2(files, Box::new(config)))
    }

    fn lfm2vl(files: ModelFiles) -> Result<Self> {
        let config = Lfm2VlConfig::read(&files)?;
        Ok(ModelFilesOf::Lfm2Vl(files, Box::new(config)))
    }

    fn qwen_image(files: QwenImageFiles) -> Result<Self> {
        let configs = QwenImageConfigs::read(&files)?;
        Ok(ModelFilesOf::QwenImage(files, Box::new(configs)))
    }

    fn zimage(files: ZImageFiles) -> Result<Self> {
        let configs = ZImageConfigs::read(&files)?;
        Ok(ModelFilesOf::ZImage(files, Box::new(configs)))
    }
}

/// A model identified, its configs read, no weights loaded.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub family: Family,
    pub files: ModelFilesOf,
    /// What `--model` said, or the bundled model's name.
    pub label: String,
    ops: Vec<Op>,
    /// The quantized format the model's weights are stored in (a GGUF folder's), so that a
    /// device without products on it declines before loading.
    stored: Option<DType>,
}

#[derive(Deserialize)]
struct ModelIndex {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
}

#[derive(Deserialize)]
struct ModelConfig {
    model_type: Option<String>,
    #[serde(default)]
    architectures: Vec<String>,
}

/// The families of the published layouts Tessera knows of but does not run yet.
fn planned(name: &str) -> Option<&'static str> {
    let n = name.to_ascii_lowercase();
    if n.contains("qwenimage") {
        Some("Qwen-Image (the 2025 20B MMDiT; Tessera runs Qwen-Image-2.1)")
    } else {
        None
    }
}

const SUPPORTED: &str = "EmbeddingGemma 2 (config.json model_type embedding_gemma2), LFM2-VL (model_type lfm2_vl, or its GGUF files with their mmproj), Z-Image (model_index.json ZImagePipeline) and Qwen-Image-2.1 (QwenImage21Pipeline)";

/// The bundled miniatures by the names `--model bundled:NAME` takes (`-mini` may be added).
pub const BUNDLED_NAMES: [(&str, Family); 4] = [
    ("egemma2", Family::EmbeddingGemma2),
    ("zimage", Family::ZImage),
    ("lfm2vl", Family::Lfm2Vl),
    ("qwen-image", Family::QwenImage),
];

/// The family of the model in `dir`.
pub fn detect(dir: &Path) -> Result<Family> {
    let unknown = |what: &str, name: &str| match planned(name) {
        Some(f) => Error::input(format!(
            "{}: {what} {name:?} is {f}, which Tessera does not run yet",
            dir.display()
        )),
        None => Error::input(format!(
            "{}: {what} {name:?} is not a model Tessera runs (it runs {SUPPORTED})",
            dir.display()
        )),
    };
    let index = dir.join("model_index.json");
    if index.is_file() {
        let idx: ModelIndex = read_json(&index)?;
        let class = idx.class_name.unwrap_or_default();
        return match class.as_str() {
            "ZImagePipeline" => Ok(Family::ZImage),
            "QwenImage21Pipeline" => Ok(Family::QwenImage),
            other => Err(unknown("the diffusers pipeline", other)),
        };
    }
    let config = dir.join("config.json");
    if !config.is_file() && model_dir::holds_gguf(dir) {
        return detect_gguf(dir);
    }
    let cfg: ModelConfig = read_json(&config)?;
    let model_type = cfg.model_type.unwrap_or_default();
    if model_type == "embedding_gemma2"
        || cfg
            .architectures
            .iter()
            .any(|a| a.starts_with("EmbeddingGemma2"))
    {
        return Ok(Family::EmbeddingGemma2);
    }
    if model_type == "lfm2_vl"
        || cfg
            .architectures
            .iter()
            .any(|a| a == "Lfm2VlForConditionalGeneration")
    {
        return Ok(Family::Lfm2Vl);
    }
    let name = cfg.architectures.first().cloned().unwrap_or(model_type);
    Err(unknown("the model", &name))
}

/// The first quantized dtype among `w`'s tensors.
fn stored_format(w: &tessera_core::Weights) -> Option<DType> {
    w.names()
        .into_iter()
        .filter_map(|n| w.tensor(n).ok())
        .map(|t| t.dtype)
        .find(|d| d.is_quantized())
}

/// The family of a folder of GGUF files, by its language model's `general.architecture`.
fn detect_gguf(dir: &Path) -> Result<Family> {
    let folder = GgufFolder::scan(dir)?;
    let (path, arch) = folder.model()?;
    if arch == lfm2vl::gguf::ARCHITECTURE {
        return Ok(Family::Lfm2Vl);
    }
    Err(Error::input(format!(
        "{}: {} is a GGUF of architecture {arch:?}, which Tessera does not run as --model: it \
         runs LFM2-VL's GGUF files ({:?}, with its mmproj file); a GGUF diffusion transformer \
         goes to `tessera generate --transformer FILE.gguf`",
        dir.display(),
        file_name(path),
        lfm2vl::gguf::ARCHITECTURE
    )))
}

/// LFM2-VL's files: the Hugging Face checkpoint in `dir`, or its GGUF files.
fn lfm2vl_files(dir: PathBuf) -> Result<ModelFiles> {
    if dir.join("config.json").is_file() {
        Ok(ModelFiles::Dir(dir))
    } else {
        lfm2vl::gguf::files(&dir)
    }
}

impl ModelSpec {
    /// The model `spec` names (a folder or a cached repo id), or the bundled miniature of
    /// `bundled` when there is none; its configs are read and checked.
    pub fn open(spec: Option<&str>, bundled: Family) -> Result<Self> {
        let Some(spec) = spec else {
            return Self::bundled(bundled);
        };
        if let Some(name) = spec.strip_prefix("bundled:") {
            let name = name.strip_suffix("-mini").unwrap_or(name);
            let family = BUNDLED_NAMES
                .iter()
                .find(|(n, _)| *n == name)
                .map(|&(_, f)| f)
                .ok_or_else(|| {
                    let names: Vec<String> = BUNDLED_NAMES
                        .iter()
                        .map(|(n, _)| format!("bundled:{n}"))
                        .collect();
                    Error::input(format!(
                        "--model {spec}: no such bundled model (there are {})",
                        names.join(", ")
                    ))
                })?;
            return Self::bundled(family);
        }
        let dir = model_dir::resolve_any(spec, &model_dir::MODEL_MARKERS)?;
        let family = detect(&dir)?;
        let files = match family {
            Family::EmbeddingGemma2 => ModelFilesOf::embedding_gemma2(ModelFiles::Dir(dir))?,
            Family::ZImage => ModelFilesOf::zimage(ZImageFiles::dir(&dir)?)?,
            Family::Lfm2Vl => ModelFilesOf::lfm2vl(lfm2vl_files(dir)?)?,
            Family::QwenImage => ModelFilesOf::qwen_image(QwenImageFiles::dir(&dir)?)?,
        };
        Self::with(family, files, spec.to_string())
    }

    /// The miniature random-weight model of `family` compiled into the binary.
    pub fn bundled(family: Family) -> Result<Self> {
        let files = match family {
            Family::EmbeddingGemma2 => ModelFilesOf::embedding_gemma2(egemma2::BUNDLED)?,
            Family::ZImage => ModelFilesOf::zimage(zimage::BUNDLED)?,
            Family::Lfm2Vl => ModelFilesOf::lfm2vl(lfm2vl::BUNDLED)?,
            Family::QwenImage => ModelFilesOf::qwen_image(qwen_image::BUNDLED)?,
        };
        Self::with(
            family,
            files,
            format!("{} (random weights)", family.bundled_name()),
        )
    }

    fn with(family: Family, files: ModelFilesOf, label: String) -> Result<Self> {
        let ops = match &files {
            ModelFilesOf::EmbeddingGemma2(_, c) => egemma2::ops(c),
            ModelFilesOf::ZImage(_, c) => zimage::ops(c),
            ModelFilesOf::Lfm2Vl(_, c) => lfm2vl::ops(c),
            ModelFilesOf::QwenImage(_, c) => qwen_image::ops(c),
        };
        let stored = match &files {
            ModelFilesOf::Lfm2Vl(f @ ModelFiles::Derived(_), _) => {
                stored_format(&f.weights("model")?)
            }
            _ => None,
        };
        Ok(ModelSpec {
            family,
            files,
            label,
            ops,
            stored,
        })
    }

    /// This model, if it does what `want` asks; else an error naming the command it needs.
    pub fn expect(self, want: Capability) -> Result<Self> {
        let has = self.family.capability();
        if has == want {
            return Ok(self);
        }
        Err(Error::input(format!(
            "{} is {} ({}); `{}` needs a model for {} — use `{}` with it",
            self.label,
            self.family.name(),
            has.describe(),
            want.command(),
            want.describe(),
            has.command()
        )))
    }

    /// This model with the ops of an edit (condition images) added, so that a device that
    /// cannot run them is declined before anything loads (`auto` then takes the CPU); a family
    /// that cannot edit is refused, naming it.
    pub fn for_editing(mut self) -> Result<Self> {
        match &self.files {
            ModelFilesOf::QwenImage(files, c) => {
                let vision = qwen_image::edit::vision_config(files).map_err(|e| {
                    Error::input(format!(
                        "{} cannot edit images: its text encoder has no vision tower ({e})",
                        self.label
                    ))
                })?;
                self.ops.extend(qwen_image::edit::ops(c, &vision));
                Ok(self)
            }
            _ => Err(Error::input(format!(
                "{} is {}, which makes images from text only; editing (--image) needs Qwen-Image-2.1",
                self.label,
                self.family.name()
            ))),
        }
    }

    /// Whether this came compiled into the binary.
    pub fn is_bundled(&self) -> bool {
        match &self.files {
            ModelFilesOf::EmbeddingGemma2(f, _) => f.is_embedded(),
            ModelFilesOf::ZImage(f, _) => f.is_bundled(),
            ModelFilesOf::Lfm2Vl(f, _) => f.is_embedded(),
            ModelFilesOf::QwenImage(f, _) => f.is_bundled(),
        }
    }

    /// Where the files are, for messages.
    pub fn location(&self) -> String {
        match &self.files {
            ModelFilesOf::EmbeddingGemma2(f, _) => f.location(),
            ModelFilesOf::ZImage(f, _) => f.location(),
            ModelFilesOf::Lfm2Vl(f, _) => f.location(),
            ModelFilesOf::QwenImage(f, _) => f.location(),
        }
    }

    /// Every op a forward of this model calls.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// The quantized format its weights are stored in, if any (the first quantized tensor's).
    pub fn stored_format(&self) -> Option<DType> {
        self.stored
    }

    /// Open the device `req` asks for, declining one that cannot run this model's ops before
    /// anything loads: `auto` then runs on the CPU and says why through `note`; an explicit
    /// `cuda` fails with the reason.
    /// `quant`: quantization at load (`--quantize`) and of the products' activations.
    pub fn device(
        &self,
        req: DeviceRequest,
        precision: Option<Precision>,
        quant: Quantization,
        note: impl FnMut(&str),
    ) -> Result<AnyBackend> {
        let quant = Quantization {
            stored: quant.stored.or(self.stored),
            ..quant
        };
        AnyBackend::open_for(req, precision, quant, &self.ops, note).map_err(|e| match e {
            Error::Device(m) => Error::Device(format!("{}: {m}", self.family.name())),
            other => other,
        })
    }

    /// What each device could run with `quant` (`--quantize`): the CPU always; CUDA device 0 at
    /// its default precision if it opens and runs every op (products on quantized weights
    /// included), else why not.
    pub fn support(&self, quant: Quantization) -> Vec<(String, Result<String>)> {
        let quant = Quantization {
            stored: quant.stored.or(self.stored),
            ..quant
        };
        let cpu = AnyBackend::open_for(DeviceRequest::Cpu, None, quant, &self.ops, |_| {})
            .map(|b| b.describe());
        let cuda = AnyBackend::open_for(DeviceRequest::Cuda(0), None, quant, &self.ops, |_| {})
            .map(|b| b.describe());
        vec![("cpu".to_string(), cpu), ("cuda".to_string(), cuda)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(files: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(d.path().join(name), text).unwrap();
        }
        d
    }

    #[test]
    fn detects_families_from_their_configs() {
        let eg = folder(&[("config.json", r#"{"model_type": "embedding_gemma2"}"#)]);
        assert_eq!(detect(eg.path()).unwrap(), Family::EmbeddingGemma2);
        let zi = folder(&[("model_index.json", r#"{"_class_name": "ZImagePipeline"}"#)]);
        assert_eq!(detect(zi.path()).unwrap(), Family::ZImage);
        let qi = folder(&[(
            "model_index.json",
            r#"{"_class_name": "QwenImage21Pipeline"}"#,
        )]);
        assert_eq!(detect(qi.path()).unwrap(), Family::QwenImage);
        let old = folder(&[(
            "model_index.json",
            r#"{"_class_name": "QwenImagePipeline"}"#,
        )]);
        let e = detect(old.path()).unwrap_err().to_string();
        assert!(
            e.contains("Qwen-Image-2.1") && e.contains("does not run yet"),
            "{e}"
        );
        let lf = folder(&[(
            "config.json",
            r#"{"model_type": "lfm2_vl", "architectures": ["Lfm2VlForConditionalGeneration"]}"#,
        )]);
        assert_eq!(detect(lf.path()).unwrap(), Family::Lfm2Vl);
        let bert = folder(&[("config.json", r#"{"model_type": "bert"}"#)]);
        let e = detect(bert.path()).unwrap_err().to_string();
        assert!(
            e.contains("\"bert\"") && e.contains("EmbeddingGemma 2"),
            "{e}"
        );
    }

    #[test]
    fn a_model_for_another_command_says_which_one() {
        let z = ModelSpec::bundled(Family::ZImage).unwrap();
        assert!(!z.ops().is_empty());
        let e = z.expect(Capability::Embed).unwrap_err().to_string();
        assert!(
            e.contains("Z-Image") && e.contains("tessera embed") && e.contains("tessera generate"),
            "{e}"
        );
        assert!(
            ModelSpec::bundled(Family::EmbeddingGemma2)
                .unwrap()
                .expect(Capability::Embed)
                .is_ok()
        );
    }

    #[test]
    fn the_cpu_runs_every_family() {
        for f in [
            Family::EmbeddingGemma2,
            Family::ZImage,
            Family::Lfm2Vl,
            Family::QwenImage,
        ] {
            let spec = ModelSpec::bundled(f).unwrap();
            let be = spec
                .device(DeviceRequest::Cpu, None, Quantization::default(), |_| {})
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(be.supports_all(spec.ops()).is_ok());
        }
    }
}
