//! `/v1/images/generations` end to end: the bundled miniature Z-Image (and, where the test says
//! so, the bundled embedding model beside it) served on a loopback port, a real HTTP client.
//! Expected images come from `tessera_runtime::image` on the same model, so every image the
//! server gives — alone, batched with others, streamed — is checked byte for byte.

mod common;

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use common::{IMAGE_NAME, NAME, Server, config, image_bundled, qwen_image_bundled};
use serde_json::{Value, json};
use tessera_models::text_to_image::Request;
use tessera_models::zimage;
use tessera_server::{ServedModel, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A PNG's pixels: width, height, channels, bytes.
fn decode(b64: &str) -> (u32, u32, usize, Vec<u8>) {
    let bytes = STANDARD.decode(b64).unwrap();
    let img = image::load_from_memory(&bytes).unwrap();
    let channels = img.color().channel_count() as usize;
    (img.width(), img.height(), channels, img.into_bytes())
}

/// The image the runtime makes alone for this request (RGB bytes).
fn library(prompt: &str, w: usize, h: usize, steps: usize, seed: u64) -> Vec<u8> {
    let mut model = image_bundled()().unwrap();
    let req = Request {
        width: w,
        height: h,
        steps,
        seed,
        ..Request::new(prompt, zimage::DEFAULTS)
    };
    let mut images = model
        .generate(&req, &mut |_| ControlFlow::Continue(()))
        .unwrap();
    images.remove(0).pixels
}

fn body(prompt: &str, size: &str, steps: usize, seed: u64) -> Value {
    json!({"model": IMAGE_NAME, "prompt": prompt, "size": size, "num_inference_steps": steps,
           "seed": seed, "response_format": "b64_json"})
}

/// Both bundled models: the embedding model (`egemma2-mini`) and Z-Image (`zimage-mini`).
async fn both(cfg: ServerConfig) -> Server {
    let s = Server::start_models(
        cfg,
        vec![
            ServedModel::new(NAME, common::bundled()),
            ServedModel::image(IMAGE_NAME, image_bundled()),
        ],
    )
    .await;
    s.wait_ready().await;
    s
}

#[tokio::test(flavor = "multi_thread")]
async fn images_are_pngs_of_the_size_asked_with_their_seeds() {
    let s = Server::start_images(config()).await;
    let (status, b) = s
        .generate(body("a red fox in the snow", "64x48", 3, 7))
        .await;
    assert_eq!(status, 200, "{b}");
    assert!(b["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(b["output_format"], "png");
    assert_eq!(b["size"], "64x48");
    assert_eq!(b["background"], "opaque");
    let data = b["data"].as_array().unwrap();
    assert_eq!(data.len(), 1);
    assert_eq!(data[0]["seed"], 7);
    let (w, h, c, pixels) = decode(data[0]["b64_json"].as_str().unwrap());
    assert_eq!((w, h, c), (64, 48, 3));
    assert_eq!(pixels, library("a red fox in the snow", 64, 48, 3, 7));

    // n = 2: seeds 7 and 8, two different images; the first is the one above.
    let mut two = body("a red fox in the snow", "64x48", 3, 7);
    two["n"] = json!(2);
    let (status, b2) = s.generate(two).await;
    assert_eq!(status, 200, "{b2}");
    let d2 = b2["data"].as_array().unwrap();
    assert_eq!(d2.len(), 2);
    assert_eq!(
        (d2[0]["seed"].as_u64(), d2[1]["seed"].as_u64()),
        (Some(7), Some(8))
    );
    assert_eq!(d2[0]["b64_json"], data[0]["b64_json"]);
    assert_ne!(d2[0]["b64_json"], d2[1]["b64_json"]);
    assert_eq!(
        decode(d2[1]["b64_json"].as_str().unwrap()).3,
        library("a red fox in the snow", 64, 48, 3, 8)
    );

    // No seed: a fresh one each time, reported; the reported seed makes the same image again
    // (and the one the library makes from it).
    let mut unseeded = body("a red fox in the snow", "64x48", 3, 0);
    unseeded.as_object_mut().unwrap().remove("seed");
    let (_, a) = s.generate(unseeded.clone()).await;
    let (_, b) = s.generate(unseeded).await;
    assert_ne!(a["data"][0]["seed"], b["data"][0]["seed"]);
    let drawn = a["data"][0]["seed"].as_u64().unwrap();
    let (status, again) = s
        .generate(body("a red fox in the snow", "64x48", 3, drawn))
        .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["data"][0]["seed"], drawn);
    assert_eq!(again["data"][0]["b64_json"], a["data"][0]["b64_json"]);
    assert_eq!(
        decode(a["data"][0]["b64_json"].as_str().unwrap()).3,
        library("a red fox in the snow", 64, 48, 3, drawn)
    );

    // An empty prompt is a request like any other, as in diffusers (and `generate --prompt ""`).
    for prompt in ["", "  \n"] {
        let (status, e) = s.generate(body(prompt, "64x48", 3, 7)).await;
        assert_eq!(status, 200, "{prompt:?}: {e}");
        assert_eq!(
            decode(e["data"][0]["b64_json"].as_str().unwrap()).3,
            library(prompt, 64, 48, 3, 7),
            "{prompt:?}"
        );
    }

    // JPEG (over white, at the quality asked) and lossless WebP.
    let mut jpeg = body("a red fox in the snow", "64x48", 3, 7);
    jpeg["output_format"] = json!("jpeg");
    jpeg["output_compression"] = json!(90);
    let (status, j) = s.generate(jpeg).await;
    assert_eq!(status, 200, "{j}");
    assert_eq!(j["output_format"], "jpeg");
    let bytes = STANDARD
        .decode(j["data"][0]["b64_json"].as_str().unwrap())
        .unwrap();
    assert_eq!(&bytes[..3], [0xFF, 0xD8, 0xFF], "not a JPEG");
    let (w, h, _, jp) = decode(j["data"][0]["b64_json"].as_str().unwrap());
    assert_eq!((w, h), (64, 48));
    let worst = jp
        .iter()
        .zip(&pixels)
        .map(|(a, b)| a.abs_diff(*b))
        .max()
        .unwrap();
    assert!(worst < 80, "a quality-90 JPEG this far off: {worst}");
    let mut webp = body("a red fox in the snow", "64x48", 3, 7);
    webp["output_format"] = json!("webp");
    let (status, wb) = s.generate(webp).await;
    assert_eq!(status, 200, "{wb}");
    let bytes = STANDARD
        .decode(wb["data"][0]["b64_json"].as_str().unwrap())
        .unwrap();
    assert_eq!((&bytes[..4], &bytes[8..12]), (&b"RIFF"[..], &b"WEBP"[..]));
    assert_eq!(
        decode(wb["data"][0]["b64_json"].as_str().unwrap()).3,
        pixels
    );
    s.stop().await.unwrap();
}

/// The events of a streamed answer: (event name, data) in order.
fn events(raw: &str) -> Vec<(Option<String>, String)> {
    raw.split("\n\n")
        .filter(|b| !b.is_empty())
        .map(|block| {
            let mut name = None;
            let mut data = None;
            for line in block.lines() {
                if let Some(e) = line.strip_prefix("event: ") {
                    name = Some(e.to_string());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = Some(d.to_string());
                } else {
                    panic!("not an event line: {line:?}");
                }
            }
            (name, data.unwrap_or_else(|| panic!("no data: {block:?}")))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_reports_each_step_in_order_then_the_images() {
    let s = Server::start_images(config()).await;
    let steps = 6;
    let mut req = body("a lighthouse at dusk", "64x64", steps, 21);
    req["stream"] = json!(true);
    req["n"] = json!(2);
    req["partial_images"] = json!(2);
    let r = s
        .http
        .post(format!("{}/v1/images/generations", s.url))
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let evs = events(&r.text().await.unwrap());
    assert_eq!(evs.last().unwrap().1, "[DONE]");
    let parsed: Vec<Value> = evs[..evs.len() - 1]
        .iter()
        .map(|(name, d)| {
            let v: Value = serde_json::from_str(d).unwrap();
            assert_eq!(name.as_deref(), v["type"].as_str(), "{v}");
            v
        })
        .collect();
    let kinds: Vec<&str> = parsed.iter().map(|v| v["type"].as_str().unwrap()).collect();
    // Steps 1..6 in order, the previews after steps 2 and 4 (one per image), then the images.
    let mut want = Vec::new();
    for step in 1..=steps {
        want.push("image_generation.step");
        if step == 2 || step == 4 {
            want.extend(["image_generation.partial_image"; 2]);
        }
    }
    want.extend(["image_generation.completed"; 2]);
    assert_eq!(kinds, want);
    let mut last_elapsed = 0.0;
    let step_events: Vec<&Value> = parsed
        .iter()
        .filter(|v| v["type"] == "image_generation.step")
        .collect();
    for (i, v) in step_events.iter().enumerate() {
        assert_eq!(v["step"], i + 1);
        assert_eq!(v["steps"], steps);
        assert!(v["step_ms"].as_f64().unwrap() > 0.0, "{v}");
        let elapsed = v["elapsed_ms"].as_f64().unwrap();
        assert!(elapsed >= last_elapsed, "{v}");
        last_elapsed = elapsed;
    }
    let partials: Vec<&Value> = parsed
        .iter()
        .filter(|v| v["type"] == "image_generation.partial_image")
        .collect();
    for (k, p) in partials.iter().enumerate() {
        assert_eq!(p["partial_image_index"], k / 2);
        assert_eq!(p["image_index"], k % 2);
        assert_eq!(p["step"], if k < 2 { 2 } else { 4 });
        // One pixel per latent pixel: 64 / 8.
        assert_eq!(p["size"], "8x8");
        let (w, h, _, _) = decode(p["b64_json"].as_str().unwrap());
        assert_eq!((w, h), (8, 8));
    }
    // The previews of the two images differ, as their latents do.
    assert_ne!(partials[0]["b64_json"], partials[1]["b64_json"]);
    let done: Vec<&Value> = parsed
        .iter()
        .filter(|v| v["type"] == "image_generation.completed")
        .collect();
    for (i, d) in done.iter().enumerate() {
        assert_eq!(d["image_index"], i);
        assert_eq!(d["seed"], 21 + i as u64);
        assert_eq!(d["size"], "64x64");
        assert_eq!(d["output_format"], "png");
        let (_, _, _, pixels) = decode(d["b64_json"].as_str().unwrap());
        assert_eq!(
            pixels,
            library("a lighthouse at dusk", 64, 64, steps, 21 + i as u64),
            "image {i}"
        );
    }
    s.stop().await.unwrap();
}

fn assert_openai_error(status: u16, body: &Value, want: u16, code: &str, what: &str) {
    assert_eq!(status, want, "{what}: {body}");
    let e = &body["error"];
    assert_eq!(e["code"], code, "{what}: {body}");
    assert!(e["type"].is_string(), "{what}: {body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {body}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_bad_input_gets_an_openai_error_and_the_server_keeps_serving() {
    let mut cfg = config();
    cfg.api_key = Some("sekret".into());
    cfg.limits.max_image_pixels = 128 * 128;
    cfg.limits.max_image_steps = 20;
    let s = both(cfg).await;
    let ok = || body("a fox", "32x32", 2, 1);
    let with = |k: &str, v: Value| {
        let mut b = ok();
        b[k] = v;
        b
    };
    let without = |k: &str| {
        let mut b = ok();
        b.as_object_mut().unwrap().remove(k);
        b
    };
    // (what, body, status, code, param, a word the message must hold)
    let cases: Vec<(&str, Value, u16, &str, &str, &str)> = vec![
        (
            "prompt a number",
            with("prompt", json!(5)),
            400,
            "invalid_request",
            "prompt",
            "string",
        ),
        (
            "prompt missing",
            without("prompt"),
            400,
            "invalid_request",
            "",
            "prompt",
        ),
        (
            "size off the grid",
            with("size", json!("40x32")),
            400,
            "invalid_request",
            "",
            "multiples of 16",
        ),
        (
            "size over the limit",
            with("size", json!("256x256")),
            400,
            "invalid_request",
            "size",
            "--max-image-pixels",
        ),
        (
            "size not a size",
            with("size", json!("big")),
            400,
            "invalid_request",
            "size",
            "WIDTHxHEIGHT",
        ),
        (
            "size zero",
            with("size", json!("0x32")),
            400,
            "invalid_request",
            "size",
            "WIDTHxHEIGHT",
        ),
        (
            "n zero",
            with("n", json!(0)),
            400,
            "invalid_request",
            "n",
            "1 to 8",
        ),
        (
            "n nine",
            with("n", json!(9)),
            400,
            "invalid_request",
            "n",
            "1 to 8",
        ),
        (
            "n a string",
            with("n", json!("2")),
            400,
            "invalid_request",
            "n",
            "invalid type",
        ),
        (
            "steps zero",
            with("num_inference_steps", json!(0)),
            400,
            "invalid_request",
            "num_inference_steps",
            "1 to 20",
        ),
        (
            "steps over the limit",
            with("num_inference_steps", json!(21)),
            400,
            "invalid_request",
            "num_inference_steps",
            "--max-image-steps",
        ),
        (
            "guidance out of range",
            with("guidance_scale", json!(1000.0)),
            400,
            "invalid_request",
            "",
            "guidance",
        ),
        (
            "url responses",
            with("response_format", json!("url")),
            400,
            "invalid_request",
            "response_format",
            "inline",
        ),
        (
            "an unknown output format",
            with("output_format", json!("gif")),
            400,
            "invalid_request",
            "output_format",
            "png, jpeg or webp",
        ),
        (
            "compression of a png",
            with("output_compression", json!(50)),
            400,
            "invalid_request",
            "output_compression",
            "jpeg",
        ),
        (
            "compression out of range",
            with("output_compression", json!(101)),
            400,
            "invalid_request",
            "output_compression",
            "0 to 100",
        ),
        (
            "a transparent jpeg",
            {
                let mut b = with("output_format", json!("jpeg"));
                b["background"] = json!("transparent");
                b
            },
            400,
            "invalid_request",
            "background",
            "alpha",
        ),
        (
            "previews without a stream",
            with("partial_images", json!(1)),
            400,
            "invalid_request",
            "partial_images",
            "stream",
        ),
        (
            "too many previews",
            {
                let mut b = with("partial_images", json!(4));
                b["stream"] = json!(true);
                b
            },
            400,
            "invalid_request",
            "partial_images",
            "0 to 3",
        ),
        (
            "a seed that is not an integer",
            with("seed", json!("x")),
            400,
            "invalid_request",
            "seed",
            "integer",
        ),
        (
            "an unknown field",
            with("steps", json!(4)),
            400,
            "invalid_request",
            "",
            "unknown field",
        ),
        (
            "an unknown model",
            with("model", json!("dall-e-3")),
            404,
            "model_not_found",
            "model",
            "zimage-mini",
        ),
        (
            "the embedding model",
            with("model", json!(NAME)),
            400,
            "invalid_request",
            "model",
            "/v1/embeddings",
        ),
    ];
    let post = |b: Value, key: &'static str| {
        s.http
            .post(format!("{}/v1/images/generations", s.url))
            .bearer_auth(key)
            .json(&b)
            .send()
    };
    for (what, b, status, code, param, word) in cases {
        let r = post(b, "sekret").await.unwrap();
        let got = r.status().as_u16();
        let answer: Value = r.json().await.unwrap();
        assert_openai_error(got, &answer, status, code, what);
        if !param.is_empty() {
            assert_eq!(answer["error"]["param"], param, "{what}: {answer}");
        }
        let m = answer["error"]["message"].as_str().unwrap();
        assert!(m.contains(word), "{what}: {m}");
        // The server goes on answering.
        let r = post(ok(), "sekret").await.unwrap();
        assert_eq!(r.status(), 200, "after {what}");
    }
    // Malformed JSON, a body over the size limit, a wrong key, no key.
    let raw = |b: Vec<u8>, key: Option<&str>| {
        let mut r = s
            .http
            .post(format!("{}/v1/images/generations", s.url))
            .header("content-type", "application/json")
            .body(b);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    let r = raw(b"{\"prompt\": \"a fox\", ".to_vec(), Some("sekret"))
        .await
        .unwrap();
    let st = r.status().as_u16();
    assert_openai_error(
        st,
        &r.json().await.unwrap(),
        400,
        "invalid_json",
        "malformed JSON",
    );
    let mut big = serde_json::to_vec(&ok()).unwrap();
    big.truncate(big.len() - 1);
    big.extend(format!(", \"user\": \"{}\"}}", "x".repeat(1 << 20)).bytes());
    let r = raw(big, Some("sekret")).await.unwrap();
    let st = r.status().as_u16();
    assert_openai_error(
        st,
        &r.json().await.unwrap(),
        413,
        "body_too_large",
        "a large body",
    );
    for key in [Some("wrong"), None] {
        let r = raw(serde_json::to_vec(&ok()).unwrap(), key).await.unwrap();
        let st = r.status().as_u16();
        assert_openai_error(
            st,
            &r.json().await.unwrap(),
            401,
            "invalid_api_key",
            "a bad key",
        );
    }
    // Embeddings name the image model: a 400 saying which route serves it.
    let r = s
        .http
        .post(format!("{}/v1/embeddings", s.url))
        .bearer_auth("sekret")
        .json(&json!({"model": IMAGE_NAME, "input": "x"}))
        .send()
        .await
        .unwrap();
    let st = r.status().as_u16();
    let answer: Value = r.json().await.unwrap();
    assert_openai_error(
        st,
        &answer,
        400,
        "invalid_request",
        "embeddings to the image model",
    );
    let m = answer["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("/v1/images/generations") && m.contains(NAME),
        "{m}"
    );
    let r = post(ok(), "sekret").await.unwrap();
    assert_eq!(r.status(), 200);
    s.stop().await.unwrap();
}

/// Both models in one server: `/v1/models` lists each with its capability, `/health` each
/// model's state, and requests are routed by `model` (or to the route's model without one).
#[tokio::test(flavor = "multi_thread")]
async fn several_models_are_listed_and_routed() {
    let s = both(config()).await;
    let models: Value = s
        .http
        .get(format!("{}/v1/models", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let cards: Vec<(&str, &str)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["capability"].as_str().unwrap()))
        .collect();
    assert!(cards.contains(&(NAME, "embeddings")), "{cards:?}");
    assert!(
        cards.contains(&("egemma2-mini:query", "embeddings")),
        "{cards:?}"
    );
    assert!(cards.contains(&(IMAGE_NAME, "images")), "{cards:?}");
    let health: Value = s
        .http
        .get(format!("{}/health", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["status"], "ready");
    let states: Vec<(&str, &str, &str)> = health["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap(),
                m["capability"].as_str().unwrap(),
                m["status"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        states,
        [
            (NAME, "embeddings", "ready"),
            (IMAGE_NAME, "images", "ready")
        ]
    );
    // Without `model`, each route goes to its own model.
    let (status, _) = s.embed(json!({"input": "hello"})).await;
    assert_eq!(status, 200);
    let mut b = body("a fox", "32x32", 1, 1);
    b.as_object_mut().unwrap().remove("model");
    let (status, g) = s.generate(b).await;
    assert_eq!(status, 200, "{g}");
    // An embedding prompt name still works with two models.
    let (status, _) = s
        .embed(json!({"model": "egemma2-mini:query", "input": "hello"}))
        .await;
    assert_eq!(status, 200);
    // The image metrics.
    let text = s.metrics().await;
    for needle in [
        r#"tessera_images_generated_total{model="zimage-mini"} 1"#,
        r#"tessera_image_requests_total{model="zimage-mini",outcome="done"} 1"#,
        r#"tessera_image_step_duration_seconds_count{model="zimage-mini"} 1"#,
        r#"tessera_image_batch_images_sum{model="zimage-mini"} 1.0"#,
        r#"tessera_queue_duration_seconds_count{lane="generation"} 1"#,
        r#"tessera_model_queue_depth{model="zimage-mini",lane="generation"} 0"#,
        r#"tessera_model_queue_depth{model="egemma2-mini",lane="text"} 0"#,
        r#"tessera_queue_depth{lane="generation"} 0"#,
        r#"tessera_request_duration_seconds_count{lane="generation"} 1"#,
    ] {
        assert!(text.contains(needle), "metrics lack {needle}:\n{text}");
    }
    s.stop().await.unwrap();
}

/// Read a streamed answer until `n` step events have come; the connection stays open.
async fn read_steps(stream: &mut TcpStream, n: usize) -> Vec<Value> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&raw).to_string();
        let steps: Vec<Value> = text
            .split("\n\n")
            .filter_map(|b| b.lines().find_map(|l| l.strip_prefix("data: ")))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter(|v| v["type"] == "image_generation.step")
            .collect();
        if steps.len() >= n {
            return steps;
        }
        let got = stream.read(&mut buf).await.unwrap();
        assert!(got > 0, "the stream ended early: {text}");
        raw.extend_from_slice(&buf[..got]);
    }
}

/// A raw HTTP request for a body.
async fn send(addr: std::net::SocketAddr, path: &str, body: &Value) -> TcpStream {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    s
}

/// A client that goes away mid-generation frees the device at the next step: a request sent
/// just after starts (and ends) long before the abandoned one would have finished. Both for a
/// streamed request and for one waiting for its whole answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_disconnects_cancels_its_generation() {
    let s = Server::start_images(config()).await;
    let steps = 40;
    for streamed in [true, false] {
        let cancelled_before = s
            .metric(r#"tessera_image_requests_total{model="zimage-mini",outcome="cancelled"}"#)
            .await;
        let mut long = body("a long one", "256x256", steps, 3);
        long["stream"] = json!(true);
        // A streamed twin tells when steps happen; the request under test is `long` itself
        // when streamed, else a whole-answer request sent alongside.
        let mut watch = send(s.addr, "/v1/images/generations", &long).await;
        let first = read_steps(&mut watch, 2).await;
        let step_ms = first[1]["step_ms"].as_f64().unwrap();
        let victim = if streamed {
            watch
        } else {
            // Queue a whole-answer request behind the streamed one, then let the streamed one
            // finish its run: drop it, and wait for the victim's work to start.
            let mut whole = body("a long one", "256x256", steps, 4);
            whole["stream"] = json!(false);
            let victim = send(s.addr, "/v1/images/generations", &whole).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(watch);
            // The streamed one is cancelled at its next step and the victim starts.
            tokio::time::sleep(Duration::from_millis((step_ms * 4.0) as u64 + 200)).await;
            victim
        };
        let dropped = Instant::now();
        drop(victim);
        // Had it run to the end, it would have taken about this long from here.
        let would_finish = Duration::from_secs_f64(step_ms * (steps as f64 - 6.0) / 1e3);
        let (status, b) = s.generate(body("next", "64x64", 2, 1)).await;
        assert_eq!(status, 200, "{b}");
        let took = dropped.elapsed();
        assert!(
            took < would_finish,
            "streamed {streamed}: the next request ended {took:?} after the disconnect; the abandoned one would have run about {would_finish:?} more"
        );
        let cancelled = s
            .metric(r#"tessera_image_requests_total{model="zimage-mini",outcome="cancelled"}"#)
            .await;
        let want = if streamed { 1.0 } else { 2.0 };
        assert_eq!(cancelled - cancelled_before, want, "streamed {streamed}");
    }
    s.stop().await.unwrap();
}

/// Requests of one size and step count that wait together run as one batch, and each gets the
/// bytes it gets alone; with batching off, one request at a time.
#[tokio::test(flavor = "multi_thread")]
async fn requests_waiting_together_share_a_batch_and_keep_their_images() {
    for batching in [true, false] {
        let mut cfg = config();
        cfg.limits.batch_images = batching;
        let s = Server::start_images(cfg).await;
        // Occupy the worker so the next requests wait together.
        let mut long = body("hold the device", "256x256", 16, 1);
        long["stream"] = json!(true);
        let mut holder = send(s.addr, "/v1/images/generations", &long).await;
        read_steps(&mut holder, 1).await;
        let prompts = ["a cat", "a dog on a beach", "three red apples"];
        let tasks: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (http, url) = (s.http.clone(), s.url.clone());
                let mut b = body(p, "64x48", 3, 100 + i as u64);
                if i == 1 {
                    b["n"] = json!(2);
                }
                tokio::spawn(async move {
                    let r = http
                        .post(format!("{url}/v1/images/generations"))
                        .json(&b)
                        .send()
                        .await
                        .unwrap();
                    (r.status().as_u16(), r.json::<Value>().await.unwrap())
                })
            })
            .collect();
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(t.await.unwrap());
        }
        drop(holder);
        for (i, (status, b)) in answers.iter().enumerate() {
            assert_eq!(*status, 200, "{b}");
            for (k, d) in b["data"].as_array().unwrap().iter().enumerate() {
                let seed = 100 + i as u64 + k as u64;
                assert_eq!(d["seed"], seed);
                assert_eq!(
                    decode(d["b64_json"].as_str().unwrap()).3,
                    library(prompts[i], 64, 48, 3, seed),
                    "batching {batching}: request {i}, image {k}"
                );
            }
        }
        // The holder's batch, then the three waiting requests' (four images) in one batch, or
        // one batch each.
        let batches = s
            .metric(r#"tessera_image_batch_images_count{model="zimage-mini"}"#)
            .await;
        let images = s
            .metric(r#"tessera_image_batch_images_sum{model="zimage-mini"}"#)
            .await;
        assert_eq!(images, 5.0);
        assert_eq!(
            batches,
            if batching { 2.0 } else { 4.0 },
            "batching {batching}"
        );
        s.stop().await.unwrap();
    }
}

/// An embedding request is answered while a long generation runs on the same server: each
/// model has its own worker.
#[tokio::test(flavor = "multi_thread")]
async fn embeddings_do_not_wait_behind_a_generation() {
    let s = both(config()).await;
    let steps = 30;
    let mut long = body("a long one", "256x256", steps, 3);
    long["stream"] = json!(true);
    let started = Instant::now();
    let mut gen_stream = send(s.addr, "/v1/images/generations", &long).await;
    let first = read_steps(&mut gen_stream, 2).await;
    let step_ms = first[1]["step_ms"].as_f64().unwrap();
    let t = Instant::now();
    let (status, _) = s
        .embed(json!({"input": ["a short query", "and another"]}))
        .await;
    assert_eq!(status, 200);
    let embed_ms = t.elapsed().as_secs_f64() * 1e3;
    // The generation is still running: more steps come after the embedding's answer.
    let later = read_steps(&mut gen_stream, 3).await;
    let remaining_ms = step_ms * (steps as f64 - 3.0);
    eprintln!(
        "embedding answered in {embed_ms:.0} ms while a generation ran ({step_ms:.0} ms per step, started {:.0} ms before)",
        (t - started).as_secs_f64() * 1e3
    );
    assert!(later.len() >= 3);
    assert!(
        embed_ms < remaining_ms,
        "the embedding took {embed_ms:.0} ms, as long as the generation's remaining {remaining_ms:.0} ms"
    );
    s.stop().await.unwrap();
}

/// The queue is bounded by the work it holds: beyond `--max-image-queue-mps` a request gets 429
/// with `Retry-After`; one that could never fit gets 413.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_image_queue_answers_429_and_a_request_too_large_413() {
    let mut cfg = config();
    // 1 megapixel-step: two 256² requests of 8 steps (½ each).
    cfg.limits.max_image_queue_mps = 1;
    let s = Server::start_images(cfg).await;
    let mut holders = Vec::new();
    for seed in 0..2 {
        let mut b = body("hold", "256x256", 8, seed);
        b["stream"] = json!(true);
        let mut h = send(s.addr, "/v1/images/generations", &b).await;
        if seed == 0 {
            read_steps(&mut h, 1).await;
        }
        holders.push(h);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r = s
        .http
        .post(format!("{}/v1/images/generations", s.url))
        .json(&body("one more", "256x256", 8, 9))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let answer: Value = r.json().await.unwrap();
    assert_openai_error(429, &answer, 429, "queue_full", "a full image queue");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-image-queue-mps")
    );
    let (status, answer) = s.generate(body("huge", "512x512", 8, 1)).await;
    assert_openai_error(
        status,
        &answer,
        413,
        "input_too_large",
        "a request larger than the queue",
    );
    drop(holders);
    // The held work is cancelled and its budget given back.
    let mut ok = false;
    for _ in 0..100 {
        let (status, _) = s.generate(body("after", "256x256", 8, 2)).await;
        if status == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ok, "the budget was not given back");
    s.stop().await.unwrap();
}

/// `--image-timeout` answers 504 and stops the generation at its next step.
#[tokio::test(flavor = "multi_thread")]
async fn a_generation_past_its_timeout_gets_504_and_stops() {
    let mut cfg = config();
    cfg.limits.image_timeout = Duration::from_secs(1);
    let s = Server::start_images(cfg).await;
    let t = Instant::now();
    // Far more work than a second holds on any CPU (100 steps of 4,096 image tokens), in steps
    // short enough that the cancellation lands well within the 5 s checked below.
    let (status, answer) = s.generate(body("too slow", "1024x1024", 100, 1)).await;
    assert_openai_error(status, &answer, 504, "timeout", "a slow generation");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--image-timeout")
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    // The worker stops the generation at its next step (it counts it as cancelled then). Waiting
    // for that before the next request keeps the step it was in from eating that request's own
    // one-second budget on a loaded machine.
    let cancelled = r#"tessera_image_requests_total{model="zimage-mini",outcome="cancelled"}"#;
    let stopped = Instant::now();
    while s.metric(cancelled).await < 1.0 {
        assert!(
            stopped.elapsed() < Duration::from_secs(30),
            "the generation did not stop"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The worker moves on: the next request is answered.
    let (status, b) = s.generate(body("quick", "32x32", 1, 1)).await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(s.metric(cancelled).await, 1.0);
    s.stop().await.unwrap();
}

/// Qwen-Image-2.1 (the bundled miniature) is served through the same route unchanged: its RGBA
/// images keep their alpha in PNG and are composited over white in JPEG, its own size rule
/// (multiples of 32) comes back as a 400, it has no previews, and a disconnect stops it.
#[tokio::test(flavor = "multi_thread")]
async fn qwen_image_is_served_through_the_same_route() {
    let s = Server::start_models(
        config(),
        vec![ServedModel::image("qwen-image-mini", qwen_image_bundled())],
    )
    .await;
    s.wait_ready().await;
    let req = |size: &str| {
        json!({"model": "qwen-image-mini", "prompt": "a glass of water", "size": size,
               "num_inference_steps": 2, "seed": 5})
    };
    let (status, b) = s.generate(req("64x64")).await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["background"], "transparent");
    let (w, h, c, rgba) = decode(b["data"][0]["b64_json"].as_str().unwrap());
    assert_eq!((w, h, c), (64, 64, 4));
    let want = {
        let cpu = tessera_backend::cpu::CpuBackend::new();
        let mut model = tessera_runtime::image::load_qwen_image(
            tessera_backend::AnyBackend::Cpu(cpu),
            &tessera_models::qwen_image::BUNDLED,
        )
        .unwrap();
        let defaults = model.defaults();
        let r = Request {
            width: 64,
            height: 64,
            steps: 2,
            seed: 5,
            ..Request::new("a glass of water", defaults)
        };
        model
            .generate(&r, &mut |_| ControlFlow::Continue(()))
            .unwrap()
            .remove(0)
    };
    assert_eq!(rgba, want.pixels);
    let mut jpeg = req("64x64");
    jpeg["output_format"] = json!("jpeg");
    let (status, j) = s.generate(jpeg).await;
    assert_eq!(status, 200, "{j}");
    assert_eq!(j["background"], "opaque");
    assert_eq!(decode(j["data"][0]["b64_json"].as_str().unwrap()).2, 3);
    let (status, e) = s.generate(req("48x48")).await;
    assert_openai_error(status, &e, 400, "invalid_request", "off Qwen-Image's grid");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("32"),
        "{e}"
    );
    let mut previews = req("64x64");
    previews["stream"] = json!(true);
    previews["partial_images"] = json!(1);
    let (status, e) = s.generate(previews).await;
    assert_openai_error(
        status,
        &e,
        400,
        "invalid_request",
        "previews of a model without a map",
    );
    // A streamed request dropped after its first step is cancelled.
    let mut long = req("64x64");
    long["num_inference_steps"] = json!(60);
    long["stream"] = json!(true);
    let mut watch = send(s.addr, "/v1/images/generations", &long).await;
    read_steps(&mut watch, 1).await;
    drop(watch);
    let name = r#"tessera_image_requests_total{model="qwen-image-mini",outcome="cancelled"}"#;
    let mut cancelled = 0.0;
    for _ in 0..200 {
        cancelled = s.metric(name).await;
        if cancelled > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(cancelled, 1.0);
    s.stop().await.unwrap();
}
