//! Bad input, round two (issue 26), against the server in this process: every text field
//! capped, errors that name the request's fields (and set `param`), guidance bounded for every
//! family, negative seeds refused, transparency asked of a model without alpha refused, and a
//! chat request's preparation counted against the queue's budget. (Memory and time under
//! hostile input are measured on the `tessera` process itself, in the CLI's `hostile` tests.)

mod common;

use common::*;
use serde_json::{Value, json};
use tessera_server::{Limits, ServedModel};

fn param(body: &Value) -> &str {
    body["error"]["param"].as_str().unwrap_or("<none>")
}

fn message(body: &Value) -> &str {
    body["error"]["message"].as_str().unwrap_or("")
}

/// A 400 naming `field` in its `param` and its message, and no CLI flag.
fn assert_refused(status: u16, body: &Value, field: &str) {
    assert_eq!(status, 400, "{body}");
    assert_eq!(param(body), field, "{body}");
    assert!(message(body).contains(field), "{body}");
    assert!(
        !message(body).contains("--"),
        "a CLI flag in an HTTP error: {body}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn image_requests_are_refused_by_their_fields() {
    let s = Server::start_images(config()).await;
    let req = |extra: Value| {
        let mut r = json!({"model": IMAGE_NAME, "prompt": "a red fox", "size": "64x64",
                           "num_inference_steps": 1, "seed": 1});
        for (k, v) in extra.as_object().unwrap() {
            r[k] = v.clone();
        }
        r
    };
    // Before: only `prompt` was capped; a 20 MiB negative prompt cost 4.7 GB and answered 200.
    let long = "x".repeat(32_001);
    let (status, b) = s
        .generate(req(json!({"negative_prompt": long, "guidance_scale": 2.0})))
        .await;
    assert_refused(status, &b, "negative_prompt");
    // Before: "--size 1000x1000: …" with no param.
    let (status, b) = s.generate(req(json!({"size": "1000x1000"}))).await;
    assert_refused(status, &b, "size");
    // Before: "--guidance 1000: …" with no param.
    let (status, b) = s.generate(req(json!({"guidance_scale": 1000.0}))).await;
    assert_refused(status, &b, "guidance_scale");
    // Before: -1 became 2⁶⁴−1.
    let (status, b) = s.generate(req(json!({"seed": -1}))).await;
    assert_refused(status, &b, "seed");
    // Before: an opaque image, silently.
    let (status, b) = s.generate(req(json!({"background": "transparent"}))).await;
    assert_refused(status, &b, "background");
    // What stays accepted.
    let (status, b) = s
        .generate(req(
            json!({"negative_prompt": "blurry", "guidance_scale": 2.0}),
        ))
        .await;
    assert_eq!(status, 200, "{b}");
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn qwen_image_guidance_is_bounded_as_z_image_s_is() {
    let s = Server::start_models(
        config(),
        vec![ServedModel::image("qwen-image-mini", qwen_image_bundled())],
    )
    .await;
    s.wait_ready().await;
    // Before: 1e30 returned noise with 200, 3.4e38 a 500 from the VAE.
    for g in [1e30, 3.4e38, 100.5] {
        let (status, b) = s
            .generate(
                json!({"model": "qwen-image-mini", "prompt": "water", "size": "64x64",
                             "num_inference_steps": 2, "guidance_scale": g,
                             "negative_prompt": ""}),
            )
            .await;
        assert_refused(status, &b, "guidance_scale");
    }
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn chat_fields_are_capped_and_checked() {
    let mut config = chat_config();
    config.limits.max_request_bytes = 16 << 20;
    let over = max_text_chars(&config.limits) + 1;
    let s = Server::start_chat(config).await;
    let ask = |extra: Value| {
        let mut r = json!({"model": CHAT_NAME, "max_tokens": 1,
                           "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            r[k] = v.clone();
        }
        r
    };
    let (status, b) = s.chat(ask(json!({"seed": -1}))).await;
    assert_refused(status, &b, "seed");
    let (status, b) = s.chat(ask(json!({"stop": ["y".repeat(1001)]}))).await;
    assert_eq!((status, param(&b)), (400, "stop[0]"), "{b}");
    // Text longer than any prompt the context can hold: refused by its length in characters,
    // before it is rendered or tokenised.
    let (status, b) = s
        .chat(ask(
            json!({"messages": [{"role": "user", "content": "a".repeat(over)}]}),
        ))
        .await;
    assert_eq!((status, param(&b)), (400, "messages"), "{b}");
    assert!(message(&b).contains("characters"), "{b}");
    let (status, b) = s.chat(ask(json!({}))).await;
    assert_eq!(status, 200, "{b}");
    s.stop().await.unwrap();
}

/// The most characters of text the bundled chat model's context holds.
fn max_text_chars(limits: &Limits) -> usize {
    common::library_chat(limits).max_prompt_chars()
}

/// Before: with `--max-queue 1`, four concurrent 4 MiB prompts were all prepared at once and
/// none got a 429: preparing a prompt held a request slot (`--max-queue` + `--max-sequences`)
/// but not a place in the queue.
#[tokio::test(flavor = "multi_thread")]
async fn preparing_a_prompt_counts_against_the_queue() {
    let mut config = chat_config();
    config.limits.max_queue = 1;
    config.limits.max_request_bytes = 16 << 20;
    let s = Server::start_chat(config.clone()).await;
    // Text just within the length bound: the longest preparation a request can ask for.
    let text = "word ".repeat(max_text_chars(&config.limits) / 5 - 1000);
    let body = json!({"model": CHAT_NAME, "max_tokens": 1,
                      "messages": [{"role": "user", "content": text}]});
    let answers = futures_join(&s, &body, 6).await;
    let statuses: Vec<u16> = answers.iter().map(|(st, _)| *st).collect();
    eprintln!("statuses: {statuses:?}");
    assert!(
        statuses.iter().all(|st| [200, 400, 429].contains(st)),
        "{answers:?}"
    );
    assert!(
        statuses.contains(&429),
        "no request was refused: {answers:?}"
    );
    s.stop().await.unwrap();
}

/// `n` copies of `body` sent at once.
async fn futures_join(s: &Server, body: &Value, n: usize) -> Vec<(u16, Value)> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (http, url, body) = (s.http.clone(), s.url.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}
