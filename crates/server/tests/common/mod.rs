//! A real server on a loopback port for the integration tests: bundled miniature models on the
//! CPU (the embedding model, the chat model for the chat tests, the text-to-image model for the
//! image tests, or several at once), stopped (gracefully) when the test ends.

#![allow(dead_code)] // each test file uses its own subset

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use tessera_backend::AnyBackend;
use tessera_backend::cpu::CpuBackend;
use tessera_models::chat_family::CacheShape;
use tessera_models::egemma2::BUNDLED;
use tessera_runtime::chat::{self, Chat, ChatOptions};
use tessera_runtime::embed::{self, Embed};
use tessera_runtime::{Family, ModelSpec};
use tessera_server::{
    ChatLoader, ImageLoader, Limits, Loader, ModelLoader, Schedule, ServeError, ServedModel,
    ServerConfig,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const NAME: &str = "egemma2-mini";

pub fn config() -> ServerConfig {
    ServerConfig {
        api_key: None,
        allow_origins: vec![],
        allow_file_paths: false,
        metrics_public: false,
        limits: Limits {
            max_request_bytes: 1 << 20,
            max_inputs: 8,
            ..Limits::default()
        },
        schedule: Schedule::Lanes,
    }
}

pub fn bundled() -> Loader {
    Box::new(|| embed::load(AnyBackend::Cpu(CpuBackend::new()), BUNDLED))
}

/// The served id of the bundled chat model.
pub const CHAT_NAME: &str = "lfm2vl-mini";

pub fn chat_config() -> ServerConfig {
    config()
}

/// The served id of the bundled text-to-image model.
pub const IMAGE_NAME: &str = "zimage-mini";

/// The bundled Z-Image on the CPU (whose products do not depend on the row count, so batched
/// requests give the bytes they give alone).
pub fn image_bundled() -> ImageLoader {
    Box::new(|| {
        let cpu = CpuBackend::new();
        tessera_runtime::image::load(AnyBackend::Cpu(cpu), &tessera_models::zimage::BUNDLED, None)
    })
}

/// The bundled Qwen-Image-2.1 on the CPU.
pub fn qwen_image_bundled() -> ImageLoader {
    Box::new(|| {
        let cpu = CpuBackend::new();
        tessera_runtime::image::load_qwen_image(
            AnyBackend::Cpu(cpu),
            &tessera_models::qwen_image::BUNDLED,
        )
    })
}

/// The bundled chat model (LFM2-VL's miniature).
pub fn chat_spec() -> ModelSpec {
    ModelSpec::bundled(Family::Lfm2Vl).unwrap()
}

/// The bundled chat model on the CPU.
pub fn chat_bundled() -> ChatLoader {
    chat_loader(chat_spec())
}

/// The chat model `spec` names on the CPU, as `tessera serve` loads one.
pub fn chat_loader(spec: ModelSpec) -> ChatLoader {
    Box::new(move |cache| {
        chat::load(
            AnyBackend::Cpu(CpuBackend::new()),
            &spec,
            cache,
            ChatOptions::serving(),
        )
    })
}

/// The same chat model, loaded here, with the cache the server's `limits` give it: for
/// expected replies.
pub fn library_chat(limits: &Limits) -> Box<dyn Chat> {
    let cache = CacheShape {
        slots: limits.max_sequences,
        ctx: limits.context,
    };
    chat::load(
        AnyBackend::Cpu(CpuBackend::new()),
        &chat_spec(),
        cache,
        ChatOptions::default(),
    )
    .unwrap()
}

/// The same model, loaded here, for expected values.
pub fn library_model() -> Box<dyn Embed> {
    embed::load(AnyBackend::Cpu(CpuBackend::new()), BUNDLED).unwrap()
}

pub struct Server {
    pub addr: SocketAddr,
    pub url: String,
    pub http: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), ServeError>>>,
}

impl Server {
    /// Start and wait until `/health` is ready.
    pub async fn start(config: ServerConfig) -> Server {
        let server = Self::start_with(config, bundled()).await;
        server.wait_ready().await;
        server
    }

    /// Start the bundled chat model and wait until `/health` is ready.
    pub async fn start_chat(config: ServerConfig) -> Server {
        let server = Self::start_with(config, chat_bundled()).await;
        server.wait_ready().await;
        server
    }

    /// Start the bundled text-to-image model and wait until `/health` is ready.
    pub async fn start_images(config: ServerConfig) -> Server {
        let server = Self::start_models(
            config,
            vec![ServedModel::image(IMAGE_NAME, image_bundled())],
        )
        .await;
        server.wait_ready().await;
        server
    }

    /// Start one model without waiting for it, under the test name of its kind.
    pub async fn start_with(config: ServerConfig, loader: impl Into<ModelLoader>) -> Server {
        let loader = loader.into();
        let name = match loader {
            ModelLoader::Embed(_) => NAME,
            ModelLoader::Chat(_) => CHAT_NAME,
            ModelLoader::Image(_) => IMAGE_NAME,
        };
        Self::start_models(
            config,
            vec![ServedModel {
                name: name.into(),
                loader,
            }],
        )
        .await
    }

    /// Start several models without waiting for them.
    pub async fn start_models(config: ServerConfig, models: Vec<ServedModel>) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(tessera_server::serve(listener, config, models, async {
            let _ = rx.await;
        }));
        Server {
            addr,
            url: format!("http://{addr}"),
            http: reqwest::Client::new(),
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    pub async fn wait_ready(&self) {
        for _ in 0..200 {
            if let Ok(r) = self.http.get(format!("{}/health", self.url)).send().await
                && r.status() == 200
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("the server did not become ready");
    }

    /// POST a JSON body to /v1/embeddings: status and parsed body.
    pub async fn embed(&self, body: serde_json::Value) -> (u16, serde_json::Value) {
        let r = self
            .http
            .post(format!("{}/v1/embeddings", self.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    /// POST a JSON body to /v1/chat/completions: status and parsed body.
    pub async fn chat(&self, body: serde_json::Value) -> (u16, serde_json::Value) {
        let r = self
            .http
            .post(format!("{}/v1/chat/completions", self.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    /// The server's `/metrics` text.
    pub async fn metrics(&self) -> String {
        let r = self.http.get(format!("{}/metrics", self.url)).send();
        r.await.unwrap().text().await.unwrap()
    }

    /// A metric's value in the server's `/metrics` text (0 when absent).
    pub async fn metric(&self, name: &str) -> f64 {
        self.metrics()
            .await
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .map_or(0.0, |v| v.parse().unwrap())
    }

    /// POST a JSON body to /v1/images/generations: status and parsed body.
    pub async fn generate(&self, body: serde_json::Value) -> (u16, serde_json::Value) {
        let r = self
            .http
            .post(format!("{}/v1/images/generations", self.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    /// Wait for `serve` to return by itself (no shutdown signal).
    pub async fn ended(mut self) -> Result<(), ServeError> {
        let task = self.task.take().unwrap();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the server did not stop by itself")
            .unwrap()
    }

    /// Begin a graceful shutdown and wait for `serve` to return.
    pub async fn stop(mut self) -> Result<(), ServeError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task.take().unwrap().await.unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// The vectors of a successful answer.
pub fn vectors(body: &serde_json::Value) -> Vec<Vec<f32>> {
    body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| match &d["embedding"] {
            serde_json::Value::String(b64) => STANDARD
                .decode(b64)
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            v => v
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect(),
        })
        .collect()
}

pub fn assert_close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(d <= 1e-6, "vectors differ by {d:e}");
}

/// A small PNG: a colour gradient of `w × h`.
pub fn png(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([
            (x * 255 / w) as u8,
            (y * 255 / h) as u8,
            ((x + y) % 256) as u8,
        ])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

pub fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", STANDARD.encode(bytes))
}

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}
