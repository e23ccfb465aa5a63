//! `tessera serve` end to end: a real server on a loopback port, a real HTTP client, every route
//! and every bad input of the issue. Expected vectors come from the library on the same model.

mod common;

use std::time::Duration;

use common::{IMAGE_NAME, NAME, Server, assert_close, config, data_url, png, vectors};
use serde_json::{Value, json};
use tessera_models::egemma2::{Input, Part, TextOptions};
use tessera_models::imageproc::Image;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn library(inputs: &[Input], prompt: Option<&str>, dim: Option<usize>) -> Vec<(Vec<f32>, usize)> {
    let mut m = common::library_model();
    let budget = m.default_image_budget().unwrap();
    let opts = TextOptions {
        prompt_name: prompt.map(str::to_string),
        ..TextOptions::default()
    };
    m.embed_inputs(inputs, &opts, budget, dim, &mut |_| {})
        .unwrap()
        .into_iter()
        .map(|e| (e.vector, e.tokens))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn texts_match_the_library_with_prompts_dimensions_and_base64() {
    let s = Server::start(config()).await;
    let texts = ["hello world", "a second, longer text about planets"];
    let want = library(&texts.map(Input::text), None, None);

    let (status, body) = s.embed(json!({"input": texts, "model": NAME})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "list");
    assert_eq!(body["model"], NAME);
    let got = vectors(&body);
    assert_eq!(got.len(), 2);
    for (i, (g, (w, _))) in got.iter().zip(&want).enumerate() {
        assert_eq!(body["data"][i]["index"], i);
        assert_eq!(body["data"][i]["object"], "embedding");
        assert_close(g, w);
    }
    let tokens: usize = want.iter().map(|(_, t)| t).sum();
    assert_eq!(body["usage"]["prompt_tokens"], tokens);
    assert_eq!(body["usage"]["total_tokens"], tokens);

    // A single string; base64 carries the same floats.
    let (_, b64) = s
        .embed(json!({"input": texts[0], "encoding_format": "base64"}))
        .await;
    assert!(b64["data"][0]["embedding"].is_string());
    assert_close(&vectors(&b64)[0], &want[0].0);

    // A prompt by field and by model suffix: the same, and what the library gives.
    let query = library(&[Input::text(texts[0])], Some("query"), None);
    let (_, by_field) = s
        .embed(json!({"input": texts[0], "prompt_name": "query"}))
        .await;
    let (_, by_suffix) = s
        .embed(json!({"input": texts[0], "model": format!("{NAME}:query")}))
        .await;
    assert_close(&vectors(&by_field)[0], &query[0].0);
    assert_close(&vectors(&by_suffix)[0], &query[0].0);
    assert_eq!(by_suffix["usage"]["prompt_tokens"], query[0].1);
    assert!(query[0].1 > want[0].1, "the prompt adds tokens");

    // Matryoshka.
    let small = library(&[Input::text(texts[0])], None, Some(8));
    let (_, dim8) = s.embed(json!({"input": texts[0], "dimensions": 8})).await;
    assert_close(&vectors(&dim8)[0], &small[0].0);
    let full = library(&[Input::text(texts[0])], None, None)[0].0.len();
    let (status, _) = s
        .embed(json!({"input": texts[0], "dimensions": full}))
        .await;
    assert_eq!(status, 200);
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn images_data_urls_base64_and_combined_parts() {
    let mut cfg = config();
    cfg.allow_file_paths = true;
    let s = Server::start(cfg).await;
    let bytes = png(40, 30);
    let image = Image::decode(&bytes).unwrap();
    let want = library(
        &[
            Input::image(image.clone()),
            Input {
                parts: vec![
                    Part::Text("a picture of ".into()),
                    Part::Image(image.clone()),
                ],
            },
        ],
        None,
        None,
    );
    let part = |url: String| json!({"type": "image_url", "image_url": {"url": url}});
    let b64 = base64_of(&bytes);
    let (status, body) = s
        .embed(json!({"input": [
            part(data_url(&bytes)),
            part(b64),
            [{"type": "text", "text": "a picture of "}, part(data_url(&bytes))],
        ]}))
        .await;
    assert_eq!(status, 200, "{body}");
    let got = vectors(&body);
    assert_eq!(got.len(), 3);
    assert_close(&got[0], &want[0].0);
    assert_close(&got[1], &want[0].0);
    assert_close(&got[2], &want[1].0);
    assert_eq!(body["usage"]["prompt_tokens"], 2 * want[0].1 + want[1].1);

    // A file path, allowed on this server.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pic.png");
    std::fs::write(&path, &bytes).unwrap();
    for url in [
        path.display().to_string(),
        format!("file://{}", path.display()),
    ] {
        let (status, body) = s.embed(json!({"input": [part(url)]})).await;
        assert_eq!(status, 200, "{body}");
        assert_close(&vectors(&body)[0], &want[0].0);
    }
    s.stop().await.unwrap();
}

fn base64_of(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `(what, body, status, code)`: every bad input of the issue, answered in OpenAI's shape.
fn bad_inputs(dim: usize) -> Vec<(&'static str, Vec<u8>, u16, &'static str)> {
    let j = |v: Value| serde_json::to_vec(&v).unwrap();
    let img = |url: &str| j(json!({"input": [{"type": "image_url", "image_url": {"url": url}}]}));
    vec![
        (
            "malformed JSON",
            b"{\"input\": [\"a\",".to_vec(),
            400,
            "invalid_json",
        ),
        (
            "not JSON at all",
            b"input=hello".to_vec(),
            400,
            "invalid_json",
        ),
        (
            "input of the wrong type",
            j(json!({"input": 3})),
            400,
            "invalid_request",
        ),
        (
            "dimensions of the wrong type",
            j(json!({"input": "a", "dimensions": "8"})),
            400,
            "invalid_request",
        ),
        (
            "unknown field",
            j(json!({"input": "a", "inputs": "b"})),
            400,
            "invalid_request",
        ),
        (
            "missing input",
            j(json!({"model": NAME})),
            400,
            "invalid_request",
        ),
        (
            "empty input array",
            j(json!({"input": []})),
            400,
            "invalid_request",
        ),
        (
            "empty text",
            j(json!({"input": ["a", ""]})),
            400,
            "invalid_request",
        ),
        (
            "empty part array",
            j(json!({"input": [[]]})),
            400,
            "invalid_request",
        ),
        (
            "unknown part type",
            j(json!({"input": [{"type": "audio", "audio": "x"}]})),
            400,
            "invalid_request",
        ),
        (
            "token ids",
            j(json!({"input": [[1, 2, 3]]})),
            400,
            "invalid_request",
        ),
        (
            "too many inputs",
            j(json!({"input": vec!["a"; 9]})),
            413,
            "too_many_inputs",
        ),
        (
            "body over the limit",
            j(json!({"input": "a".repeat(2 << 20)})),
            413,
            "body_too_large",
        ),
        (
            "a data URL that is not an image",
            img("data:image/png;base64,aGVsbG8gd29ybGQh"),
            400,
            "invalid_request",
        ),
        (
            "a data URL that is not base64",
            img("data:image/png;base64,@@@@"),
            400,
            "invalid_request",
        ),
        (
            "a non-base64 data URL",
            img("data:image/png,hello"),
            400,
            "invalid_request",
        ),
        ("broken bare base64", img("abc"), 400, "invalid_request"),
        (
            "a remote URL",
            img("https://example.com/cat.png"),
            400,
            "invalid_request",
        ),
        (
            "a path when paths are not allowed",
            img("/etc/hostname"),
            403,
            "file_paths_not_allowed",
        ),
        (
            "a file URL when paths are not allowed",
            img("file:///etc/hostname"),
            403,
            "file_paths_not_allowed",
        ),
        (
            "an unknown model",
            j(json!({"input": "a", "model": "text-embedding-3-small"})),
            404,
            "model_not_found",
        ),
        (
            "an unknown prompt name",
            j(json!({"input": "a", "prompt_name": "nope"})),
            400,
            "invalid_request",
        ),
        (
            "an unknown prompt suffix",
            j(json!({"input": "a", "model": format!("{NAME}:nope")})),
            400,
            "invalid_request",
        ),
        (
            "contradicting prompts",
            j(json!({"input": "a", "model": format!("{NAME}:query"), "prompt_name": "document"})),
            400,
            "invalid_request",
        ),
        (
            "dimensions 0",
            j(json!({"input": "a", "dimensions": 0})),
            400,
            "invalid_request",
        ),
        (
            "dimensions too large",
            j(json!({"input": "a", "dimensions": dim + 1})),
            400,
            "invalid_request",
        ),
        (
            "negative dimensions",
            j(json!({"input": "a", "dimensions": -1})),
            400,
            "invalid_request",
        ),
        (
            "an unknown encoding_format",
            j(json!({"input": "a", "encoding_format": "hex"})),
            400,
            "invalid_request",
        ),
        (
            "an input over --max-input-tokens",
            j(json!({"input": "word ".repeat(300)})),
            400,
            "invalid_request",
        ),
    ]
}

fn assert_openai_error(body: &Value, code: &str, what: &str) {
    let e = &body["error"];
    assert_eq!(e["code"], code, "{what}: {body}");
    assert!(
        !e["message"].as_str().unwrap_or("").is_empty(),
        "{what}: {body}"
    );
    assert!(e["type"].is_string(), "{what}: {body}");
    assert!(e.get("param").is_some(), "{what}: {body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_bad_input_gets_its_4xx_and_the_server_keeps_serving() {
    let mut cfg = config();
    cfg.limits.max_input_tokens = 256;
    cfg.limits.max_batch_tokens = 256;
    let s = Server::start(cfg).await;
    let dim = common::library_model().dim();
    for (what, body, status, code) in bad_inputs(dim) {
        let r = s
            .http
            .post(format!("{}/v1/embeddings", s.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(r.status().as_u16(), status, "{what}");
        if code == "body_too_large" {
            // The connection closes after this answer; the client must not reuse it.
            let connection = r.headers().get("connection").and_then(|v| v.to_str().ok());
            assert_eq!(connection, Some("close"), "{what}");
        }
        let body: Value = r.json().await.unwrap();
        assert_openai_error(&body, code, what);
        // …and a good request still works.
        let (ok, body) = s.embed(json!({"input": "still serving"})).await;
        assert_eq!(ok, 200, "after {what}: {body}");
    }
    // A path that cannot be read, on a server that allows paths.
    let mut cfg = config();
    cfg.allow_file_paths = true;
    let p = Server::start(cfg).await;
    let (status, body) = p
        .embed(json!({"input": [{"type": "image_url", "image_url": {"url": "/no/such/file.png"}}]}))
        .await;
    assert_eq!(status, 400);
    assert_openai_error(&body, "invalid_request", "unreadable path");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/no/such/file.png")
    );

    // Routes and methods.
    let r = s
        .http
        .get(format!("{}/v1/embeddings", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert_openai_error(
        &r.json().await.unwrap(),
        "method_not_allowed",
        "GET embeddings",
    );
    let r = s
        .http
        .get(format!("{}/v2/nothing", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_openai_error(&r.json().await.unwrap(), "not_found", "unknown route");
    s.stop().await.unwrap();
    p.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_input_in_a_merged_batch_fails_alone() {
    let s = Server::start(config()).await;
    // The placeholder passes the edge checks and fails in the model: with good requests sent at
    // the same time it lands in a merged batch, which is then retried request by request.
    let mut tasks = Vec::new();
    for i in 0..12 {
        let (http, url) = (s.http.clone(), s.url.clone());
        let text = if i == 5 {
            "bad <|image|> text".to_string()
        } else {
            format!("good text {i}")
        };
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/embeddings"))
                .json(&json!({"input": [text, "more words to make the batch bigger"]}))
                .send()
                .await
                .unwrap();
            (i, r.status().as_u16(), r.json::<Value>().await.unwrap())
        }));
    }
    for t in tasks {
        let (i, status, body) = t.await.unwrap();
        if i == 5 {
            assert_eq!(status, 400, "{body}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("placeholder"),
                "{body}"
            );
        } else {
            assert_eq!(status, 200, "{i}: {body}");
        }
    }
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn api_key_guards_every_route_but_health() {
    let mut cfg = config();
    cfg.api_key = Some("sekret".into());
    let s = Server::start(cfg).await;
    let health = s
        .http
        .get(format!("{}/health", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    for (method, path) in [
        ("POST", "/v1/embeddings"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
    ] {
        for key in [None, Some("wrong"), Some("sekret")] {
            let mut r = s
                .http
                .request(method.parse().unwrap(), format!("{}{path}", s.url))
                .json(&json!({"input": "hi"}));
            if let Some(k) = key {
                r = r.bearer_auth(k);
            }
            let r = r.send().await.unwrap();
            if key == Some("sekret") {
                assert_eq!(r.status(), 200, "{path} with the key");
            } else {
                assert_eq!(r.status(), 401, "{path} with {key:?}");
                assert_openai_error(&r.json().await.unwrap(), "invalid_api_key", path);
            }
        }
    }
    // The scheme is case-insensitive (RFC 9110): `bearer KEY` is a valid header.
    for header in ["bearer sekret", "BEARER sekret"] {
        let r = s
            .http
            .post(format!("{}/v1/embeddings", s.url))
            .header("authorization", header)
            .json(&json!({"input": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{header}");
    }
    s.stop().await.unwrap();
}

/// `/metrics` for a Prometheus scraper (no token): refused by default when a key is set, open
/// with `--metrics-public`, which opens nothing else.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_without_the_key_only_when_public() {
    for public in [false, true] {
        let mut cfg = config();
        cfg.api_key = Some("sekret".into());
        cfg.metrics_public = public;
        let s = Server::start(cfg).await;
        let get = |path: &str, key: Option<&str>| {
            let r = s.http.get(format!("{}{path}", s.url));
            match key {
                Some(k) => r.bearer_auth(k),
                None => r,
            }
            .send()
        };
        let bare = get("/metrics", None).await.unwrap();
        if public {
            assert_eq!(bare.status(), 200);
            let text = bare.text().await.unwrap();
            assert!(text.contains("tessera_requests_total"), "{text}");
        } else {
            assert_eq!(bare.status(), 401);
            assert_openai_error(&bare.json().await.unwrap(), "invalid_api_key", "metrics");
        }
        // With the key it answers either way; a wrong key is refused where a key is asked for.
        assert_eq!(get("/metrics", Some("sekret")).await.unwrap().status(), 200);
        let wrong = get("/metrics", Some("wrong")).await.unwrap().status();
        assert_eq!(wrong, if public { 200 } else { 401 });
        // The other routes still need the key.
        for path in ["/v1/models", &format!("/v1/models/{NAME}"), "/openapi.json"] {
            assert_eq!(get(path, None).await.unwrap().status(), 401, "{path}");
        }
        let (status, _) = s.embed(json!({"input": "hi"})).await;
        assert_eq!(status, 401);
        s.stop().await.unwrap();
    }
}

/// OpenAI's "retrieve model": each listed id (a prompt name's too) gives its card as the list
/// does; any other id is a 404 in OpenAI's error shape.
#[tokio::test(flavor = "multi_thread")]
async fn one_model_by_id_as_listed_or_404() {
    let s = Server::start(config()).await;
    let get = |path: String| s.http.get(format!("{}{path}", s.url)).send();
    let list: Value = get("/v1/models".into())
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let cards = list["data"].as_array().unwrap();
    assert!(cards.len() > 1, "{list}");
    for card in cards {
        let id = card["id"].as_str().unwrap();
        let r = get(format!("/v1/models/{id}")).await.unwrap();
        assert_eq!(r.status(), 200, "{id}");
        let one: Value = r.json().await.unwrap();
        assert_eq!(&one, card);
        assert_eq!(one["object"], "model");
    }
    for unknown in ["gpt-4o", "egemma2-mini:nope", "org/egemma2-mini", "egemma2"] {
        let r = get(format!("/v1/models/{unknown}")).await.unwrap();
        assert_eq!(r.status(), 404, "{unknown}");
        let body: Value = r.json().await.unwrap();
        assert_openai_error(&body, "model_not_found", unknown);
        assert_eq!(body["error"]["param"], "model");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(unknown) && message.contains(NAME),
            "{message}"
        );
    }
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn models_health_metrics_openapi_and_cors() {
    let mut cfg = config();
    cfg.allow_origins = vec!["https://app.example".into()];
    let s = Server::start(cfg).await;
    let get = |path: &str| s.http.get(format!("{}{path}", s.url)).send();

    let models: Value = get("/v1/models").await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids[0], NAME);
    assert!(
        ids.contains(&"egemma2-mini:query") && ids.contains(&"egemma2-mini:document"),
        "{ids:?}"
    );
    assert_eq!(models["data"][0]["object"], "model");

    let health: Value = get("/health").await.unwrap().json().await.unwrap();
    assert_eq!(health["status"], "ready");
    assert!(health["device"].as_str().unwrap().starts_with("cpu"));

    let (ok, _) = s.embed(json!({"input": ["one", "two"]})).await;
    assert_eq!(ok, 200);
    let (bad, _) = s.embed(json!({"input": []})).await;
    assert_eq!(bad, 400);
    let r = get("/metrics").await.unwrap();
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .contains("openmetrics")
    );
    let text = r.text().await.unwrap();
    for needle in [
        r#"tessera_requests_total{route="/v1/embeddings",status="200",code=""} 1"#,
        r#"tessera_requests_total{route="/v1/embeddings",status="400",code="invalid_request"} 1"#,
        r#"tessera_queue_depth{lane="text"} 0"#,
        r#"tessera_batch_inputs_sum{lane="text"} 2.0"#,
        "tessera_batch_tokens_count",
        "tessera_tokens_total",
        "tessera_request_duration_seconds_bucket",
        "tessera_queue_duration_seconds_count",
        "tessera_batch_duration_seconds_sum",
    ] {
        assert!(text.contains(needle), "metrics lack {needle}:\n{text}");
    }

    let doc: Value = get("/openapi.json").await.unwrap().json().await.unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    assert!(doc["paths"]["/v1/embeddings"]["post"].is_object());

    // CORS: a preflight from the allowed origin is answered, another origin gets no grant.
    let pre = |origin: &'static str| {
        s.http
            .request(reqwest::Method::OPTIONS, format!("{}/v1/embeddings", s.url))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization,content-type",
            )
            .send()
    };
    let ok = pre("https://app.example").await.unwrap();
    assert_eq!(
        ok.headers()["access-control-allow-origin"],
        "https://app.example"
    );
    let other = pre("https://evil.example").await.unwrap();
    assert!(other.headers().get("access-control-allow-origin").is_none());
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn health_is_503_until_the_model_is_loaded() {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let loader: tessera_server::Loader = Box::new(move || {
        let _ = rx.recv();
        common::bundled()()
    });
    let s = Server::start_with(config(), loader).await;
    let r = s
        .http
        .get(format!("{}/health", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "loading");
    let r = s
        .http
        .post(format!("{}/v1/embeddings", s.url))
        .json(&json!({"input": "early"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    assert_openai_error(&r.json().await.unwrap(), "model_loading", "while loading");
    tx.send(()).unwrap();
    s.wait_ready().await;
    let (status, _) = s.embed(json!({"input": "now"})).await;
    assert_eq!(status, 200);
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_load_stops_the_server_with_the_error() {
    let loader: tessera_server::Loader =
        Box::new(|| Err(tessera_core::Error::input("no such model here")));
    let s = Server::start_with(config(), loader).await;
    let e = s.ended().await.unwrap_err().to_string();
    assert!(e.contains("no such model here"), "{e}");
}

/// A request whose body is sent only in part: it holds its slot, as a slow client does.
async fn partial_request(addr: std::net::SocketAddr, full: &str, sent: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        full.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&full.as_bytes()[..sent]).await.unwrap();
    s
}

async fn read_response(mut s: TcpStream) -> (u16, Value) {
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8(raw).unwrap();
    let status = text[9..12].parse().unwrap();
    let body = text.split_once("\r\n\r\n").unwrap().1;
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_queue_answers_429_with_retry_after() {
    let mut cfg = config();
    cfg.limits.max_queue = 1;
    let s = Server::start_images(cfg).await;
    // A request holds its slot until its answer ends. This one is a streamed generation of many
    // steps whose events are not read past the first: it holds the only slot. (A FIFO given
    // as an image path held it before; such paths are now refused at once.)
    let generation = json!({"model": IMAGE_NAME, "prompt": "a lighthouse", "size": "256x256",
                            "num_inference_steps": 100, "stream": true, "seed": 1});
    let mut held = s
        .http
        .post(format!("{}/v1/images/generations", s.url))
        .json(&generation)
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    let first = held.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("image_generation.step"));
    let small = json!({"model": IMAGE_NAME, "prompt": "x", "size": "64x64",
                       "num_inference_steps": 1, "seed": 1});
    let r = s
        .http
        .post(format!("{}/v1/images/generations", s.url))
        .json(&small)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    assert_openai_error(&r.json().await.unwrap(), "queue_full", "full queue");
    // Its client goes away: the generation stops at its next step, and the slot is free again.
    drop(held);
    let started = std::time::Instant::now();
    loop {
        let (status, body) = s.generate(small.clone()).await;
        if status == 200 {
            break;
        }
        assert_eq!(status, 429, "{body}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the slot was not given back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.stop().await.unwrap();
}

/// Headers, a `Content-Length` of 100,000 and 10 bytes of body, then silence, from `from`.
async fn half_sent(addr: std::net::SocketAddr, from: [u8; 4]) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind((from, 0).into()).unwrap();
    let mut s = socket.connect(addr).await.unwrap();
    // One write, so the server has read all of it when it answers and closes.
    let request = "POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"input\": ";
    s.write_all(request.as_bytes()).await.unwrap();
    s
}

#[tokio::test(flavor = "multi_thread")]
async fn a_body_refused_for_too_many_uploads_is_still_answered() {
    let mut cfg = config();
    cfg.limits.max_request_bytes = 16 << 20;
    let per_client = cfg.limits.max_uploads_per_client;
    let s = Server::start(cfg).await;
    // The client's upload places, all held by half-sent bodies.
    let mut quiet = Vec::new();
    for _ in 0..per_client {
        quiet.push(half_sent(s.addr, [127, 0, 0, 3]).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // One more request of the same client, its 8 MB body sent whole: refused before the body is
    // read, it is answered with the 429 all the same. A server that answers and closes with the
    // body unread resets the connection under the client (its write or its read fails here).
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(([127, 0, 0, 3], 0).into()).unwrap();
    let mut stream = socket.connect(s.addr).await.unwrap();
    let body = format!("{{\"input\": \"{}\"}}", "x".repeat(8 << 20));
    let head = format!(
        "POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
        .write_all(body.as_bytes())
        .await
        .expect("the whole body is read");
    let (status, answer) = read_response(stream).await;
    assert_eq!(status, 429, "{answer}");
    assert_openai_error(&answer, "too_many_uploads", "one upload too many");
    drop(quiet);
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn half_sent_bodies_do_not_keep_other_clients_out() {
    let mut cfg = config();
    cfg.limits.body_timeout = Duration::from_secs(2);
    let (max_queue, per_client) = (cfg.limits.max_queue, cfg.limits.max_uploads_per_client);
    let s = Server::start(cfg).await;
    // More half-sent requests than the queue has slots, from one client (127.0.0.2; the other
    // clients below come from 127.0.0.1).
    let mut quiet = Vec::new();
    for _ in 0..max_queue + 6 {
        quiet.push(half_sent(s.addr, [127, 0, 0, 2]).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Everyone else is served at once: no 429 storm.
    let started = std::time::Instant::now();
    let mut others = Vec::new();
    for i in 0..8 {
        let (http, url) = (s.http.clone(), s.url.clone());
        others.push(tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/embeddings"))
                .json(&json!({"input": format!("another client {i}")}))
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        }));
    }
    for o in others {
        assert_eq!(o.await.unwrap(), 200);
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // The quiet client got places for its first few bodies, a 429 for the rest, and a 408 for
    // the first few once the body timeout passed; it holds nothing afterwards.
    let mut statuses = std::collections::BTreeMap::new();
    for q in quiet {
        let (status, body) = read_response(q).await;
        let want = match status {
            408 => "body_timeout",
            429 => "too_many_uploads",
            _ => panic!("{status}: {body}"),
        };
        assert_openai_error(&body, want, "quiet client");
        *statuses.entry(status).or_insert(0) += 1;
    }
    assert_eq!(statuses.get(&408), Some(&per_client), "{statuses:?}");
    let (status, _) = s.embed(json!({"input": "x"})).await;
    assert_eq!(status, 200);
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_body_that_is_not_declared_json_gets_415() {
    let s = Server::start(config()).await;
    let body = r#"{"input": "hello"}"#;
    for content_type in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        None,
    ] {
        let mut r = s.http.post(format!("{}/v1/embeddings", s.url)).body(body);
        if let Some(t) = content_type {
            r = r.header("content-type", t);
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), 415, "{content_type:?}");
        assert_openai_error(
            &r.json().await.unwrap(),
            "unsupported_media_type",
            "not JSON",
        );
    }
    let r = s
        .http
        .post(format!("{}/v1/embeddings", s.url))
        .header("content-type", "application/json; charset=utf-8")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_image_is_refused_from_its_header_when_it_cannot_fit() {
    let mut cfg = config();
    cfg.limits.max_image_memory_mb = 8;
    cfg.limits.max_request_bytes = 32 << 20;
    let s = Server::start(cfg).await;
    let img = |w, h| json!({"input": [{"type": "image_url", "image_url": {"url": data_url(&png(w, h))}}]});
    // Decoding 2000 × 1500 RGB holds two copies of 9 MB: more than 8 MiB, whatever else runs.
    let (status, body) = s.embed(img(2000, 1500)).await;
    assert_eq!(status, 413, "{body}");
    assert_openai_error(&body, "input_too_large", "too large for the image memory");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("2000×1500 PNG image needs") && message.contains("--max-image-memory-mb"),
        "{message}"
    );
    // Too elongated for the tower's position table: refused before decoding too.
    let (status, body) = s.embed(img(3000, 4)).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("position_embedding_size"),
        "{body}"
    );
    let (status, body) = s.embed(img(200, 150)).await;
    assert_eq!(status, 200, "{body}");
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_that_takes_too_long_gets_504() {
    let mut cfg = config();
    cfg.limits.request_timeout = Duration::from_millis(300);
    let s = Server::start(cfg).await;
    let stuck = partial_request(s.addr, r#"{"input": "never finished"}"#, 4).await;
    let (status, body) = read_response(stuck).await;
    assert_eq!(status, 504);
    assert_openai_error(&body, "timeout", "timeout");
    let (status, _) = s.embed(json!({"input": "x"})).await;
    assert_eq!(status, 200);
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn shutdown_finishes_the_requests_in_flight() {
    let s = Server::start(config()).await;
    let full = r#"{"input": ["in flight", "when the signal came"]}"#;
    let mut in_flight = partial_request(s.addr, full, 10).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let addr = s.addr;
    let stopped = tokio::spawn(s.stop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !stopped.is_finished(),
        "the server stopped with a request in flight"
    );
    // New connections are no longer accepted…
    assert!(
        TcpStream::connect(addr).await.is_err()
            || reqwest::get(format!("http://{addr}/health")).await.is_err()
    );
    // …and the request in flight is answered in full.
    in_flight.write_all(&full.as_bytes()[10..]).await.unwrap();
    let (status, body) = read_response(in_flight).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"].as_array().unwrap().len(), 2);
    stopped.await.unwrap().unwrap();
}
