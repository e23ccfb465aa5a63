//! `POST /v1/images/edits` with the bundled Qwen-Image-2.1: a multipart form in, the image the
//! library makes for the same edit out (whole and streamed), and every bad input answered with
//! an OpenAI error while the server keeps serving.

mod common;

use std::ops::ControlFlow;
use std::path::PathBuf;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use common::{IMAGE_NAME, Server, config, image_bundled, qwen_image_bundled};
use serde_json::Value;
use tessera_models::imageproc::decode_rgba;
use tessera_models::text_to_image::{Edit, Request};
use tessera_server::{ServedModel, ServerConfig};

const QWEN: &str = "qwen-image-mini";
const BOUNDARY: &str = "tessera-test-boundary";

fn condition(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!(
        "../../tests/fixtures/qwen_image/condition/{name}.png"
    ));
    std::fs::read(p).unwrap()
}

/// A multipart body of `text` fields and `files` (field name, bytes).
fn form(text: &[(&str, &str)], files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut body = Vec::new();
    for (name, value) in text {
        body.extend(
            format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n")
                .bytes(),
        );
        body.extend(value.bytes());
        body.extend(b"\r\n");
    }
    for (i, (name, data)) in files.iter().enumerate() {
        body.extend(
            format!(
                "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{i}.png\"\r\nContent-Type: image/png\r\n\r\n"
            )
            .bytes(),
        );
        body.extend(*data);
        body.extend(b"\r\n");
    }
    body.extend(format!("--{BOUNDARY}--\r\n").bytes());
    body
}

async fn post(s: &Server, body: Vec<u8>, headers: &[(&str, &str)]) -> (u16, String) {
    let mut r = s
        .http
        .post(format!("{}/v1/images/edits", s.url))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn edit(s: &Server, text: &[(&str, &str)], files: &[(&str, &[u8])]) -> (u16, Value) {
    let (status, body) = post(s, form(text, files), &[]).await;
    (
        status,
        serde_json::from_str(&body).unwrap_or(Value::String(body)),
    )
}

async fn both(cfg: ServerConfig) -> Server {
    let s = Server::start_models(
        cfg,
        vec![
            ServedModel::image(QWEN, qwen_image_bundled()),
            ServedModel::image(IMAGE_NAME, image_bundled()),
        ],
    )
    .await;
    s.wait_ready().await;
    s
}

fn assert_error(status: u16, body: &Value, want: u16, needle: &str) {
    assert_eq!(status, want, "{body}");
    let m = body["error"]["message"].as_str().unwrap_or_default();
    assert!(m.contains(needle), "{needle:?} not in {body}");
    assert!(body["error"]["code"].is_string(), "{body}");
}

/// The library's image for the same edit (RGBA bytes).
fn library(images: &[&[u8]], prompt: &str, (w, h): (usize, usize), seed: u64) -> Vec<u8> {
    let mut model = qwen_image_bundled()().unwrap();
    let edit = Edit {
        images: images
            .iter()
            .map(|b| decode_rgba(b).unwrap())
            .collect::<Vec<_>>()
            .into(),
        output_resolution: 96,
    };
    let req = Request {
        width: w,
        height: h,
        steps: 2,
        seed,
        edit: Some(edit),
        ..Request::new(prompt, model.defaults())
    };
    model
        .generate(&req, &mut |_| ControlFlow::Continue(()))
        .unwrap()
        .remove(0)
        .pixels
}

#[tokio::test(flavor = "multi_thread")]
async fn an_edit_form_makes_the_librarys_image_whole_and_streamed() {
    let s = both(config()).await;
    let (tall, wide) = (condition("tall_37x100"), condition("wide_203x61"));
    let text = [
        ("model", QWEN),
        ("prompt", "make the fox blue"),
        ("num_inference_steps", "2"),
        ("seed", "9"),
        ("output_resolution", "96"),
        ("response_format", "b64_json"),
    ];
    // Two images of different sizes as image[]; the size is the last one's (64x128 is the
    // tall one's at 96: 64×160).
    let (status, b) = edit(&s, &text, &[("image[]", &wide), ("image[]", &tall)]).await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["size"], "64x160", "{b}");
    let png = STANDARD
        .decode(b["data"][0]["b64_json"].as_str().unwrap())
        .unwrap();
    let got = image::load_from_memory(&png).unwrap();
    assert_eq!((got.width(), got.height()), (64, 160));
    let want = library(&[&wide, &tall], "make the fox blue", (64, 160), 9);
    assert_eq!(got.into_rgba8().into_raw(), want);

    // The same with `image` and streamed: a step event per step, then the image.
    let mut streamed = text.to_vec();
    streamed.push(("stream", "true"));
    let (status, body) = post(&s, form(&streamed, &[("image", &tall)]), &[]).await;
    assert_eq!(status, 200, "{body}");
    let events: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let steps = events
        .iter()
        .filter(|e| e["type"] == "image_edit.step")
        .count();
    assert_eq!(steps, 2, "{body}");
    let done: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "image_edit.completed")
        .collect();
    assert_eq!(done.len(), 1, "{body}");
    let png = STANDARD
        .decode(done[0]["b64_json"].as_str().unwrap())
        .unwrap();
    let want = library(&[&tall], "make the fox blue", (64, 160), 9);
    assert_eq!(
        image::load_from_memory(&png)
            .unwrap()
            .into_rgba8()
            .into_raw(),
        want
    );
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_edits_get_openai_errors_and_the_server_keeps_serving() {
    let mut cfg = config();
    cfg.limits.max_request_bytes = 64 << 10;
    let s = both(cfg).await;
    let tall = condition("tall_37x100");
    let ok = [
        ("model", QWEN),
        ("prompt", "x"),
        ("num_inference_steps", "2"),
        ("output_resolution", "96"),
    ];
    // More than ten images.
    let tiny = common::png(64, 64);
    let eleven: Vec<(&str, &[u8])> = (0..11).map(|_| ("image[]", tiny.as_slice())).collect();
    let (status, b) = edit(&s, &ok, &eleven).await;
    assert_error(status, &b, 400, "11 images");
    assert_eq!(b["error"]["param"], "image", "{b}");
    // A file that is not an image, and a truncated PNG.
    let (status, b) = edit(&s, &ok, &[("image", b"hello, not an image")]).await;
    assert_error(status, &b, 400, "image 1");
    let (status, b) = edit(&s, &ok, &[("image", &tall[..tall.len() / 2])]).await;
    assert_error(status, &b, 400, "image 1");
    // No image at all.
    let (status, b) = edit(&s, &ok, &[]).await;
    assert_error(status, &b, 400, "at least one image");
    // A body over the upload limit.
    let big = vec![7u8; 100 << 10];
    let (status, b) = edit(&s, &ok, &[("image", &big)]).await;
    assert_error(status, &b, 413, "--max-request-mb");
    // A model that cannot edit (Z-Image), named.
    let zimage = [("model", IMAGE_NAME), ("prompt", "x")];
    let (status, b) = edit(&s, &zimage, &[("image", &tall)]).await;
    assert_error(status, &b, 400, "cannot edit");
    // A mask, an unknown field, a JSON body, a page's form from another origin.
    let (status, b) = edit(&s, &ok, &[("image", &tall), ("mask", &tall)]).await;
    assert_error(status, &b, 400, "mask is not supported");
    let mut typo = ok.to_vec();
    typo.push(("steps", "2"));
    let (status, b) = edit(&s, &typo, &[("image", &tall)]).await;
    assert_error(status, &b, 400, "unknown field `steps`");
    let r = s
        .http
        .post(format!("{}/v1/images/edits", s.url))
        .json(&serde_json::json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 415);
    let (status, body) = post(
        &s,
        form(&ok, &[("image", &tall)]),
        &[("origin", "https://evil.example")],
    )
    .await;
    assert_eq!(status, 415, "{body}");
    assert!(body.contains("--allow-origin"), "{body}");
    // A condition copy under the text encoder's pixel range, from the model's own check.
    let mut small = ok.to_vec();
    small[3] = ("output_resolution", "32");
    let (status, b) = edit(&s, &small, &[("image", &tall)]).await;
    assert_error(status, &b, 400, "condition image 1");
    // Still serving.
    let (status, b) = edit(&s, &ok, &[("image", &tall)]).await;
    assert_eq!(status, 200, "{b}");
    s.stop().await.unwrap();
}
