//! `/v1/chat/completions` end to end: the bundled miniature LFM2-VL served on a loopback port,
//! a real HTTP client. Expected replies come from `tessera_runtime::chat` on the same model, so
//! every reply the server gives — whole, streamed, stopped, cut at its token limit, or batched
//! with others — is checked token for token.

mod common;

use std::time::Duration;

use common::{CHAT_NAME, Server, chat_config, data_url, png};
use serde_json::{Value, json};
use tessera_models::chat_template::{Message, Part};
use tessera_models::imageproc::Image;
use tessera_runtime::chat::{ChatReply, GenerationParams};
use tessera_runtime::decode::{Control, Finish, SamplingParams};
use tessera_server::Limits;

const QUESTION: &str = "What is in this image?";

/// The fixture image of the runtime's LFM2-VL tests, as a file's bytes.
fn image_bytes() -> Vec<u8> {
    std::fs::read(common::workspace().join("tests/fixtures/lfm2vl/images/exact270x250.png"))
        .unwrap()
}

/// A user turn: the image, then the question — as the API takes it.
fn image_question() -> Value {
    json!([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(&image_bytes())}},
        {"type": "text", "text": QUESTION},
    ]}])
}

/// The reply the runtime gives alone for `messages` (text and image parts as the API's), greedy.
fn library(limits: &Limits, api_messages: &Value, max_tokens: usize, stop: &[&str]) -> ChatReply {
    let mut images = Vec::new();
    let messages: Vec<Message> = api_messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let role = m["role"].as_str().unwrap();
            match &m["content"] {
                Value::String(s) => Message::new(role, s),
                Value::Array(parts) => Message::parts(
                    role,
                    parts
                        .iter()
                        .map(|p| match p["type"].as_str().unwrap() {
                            "text" => Part::Text {
                                text: p["text"].as_str().unwrap().into(),
                            },
                            _ => {
                                images.push(Image::decode(&image_bytes()).unwrap());
                                Part::Image
                            }
                        })
                        .collect(),
                ),
                other => panic!("{other}"),
            }
        })
        .collect();
    let mut model = common::library_chat(limits);
    let prompt = model.prompt(&messages, &images).unwrap();
    let params = GenerationParams {
        sampling: SamplingParams::default(),
        max_tokens,
        stop: stop.iter().map(|s| s.to_string()).collect(),
    };
    model
        .reply(1, prompt, &params, &mut |_| Control::Continue)
        .unwrap()
}

fn text_question(q: &str) -> Value {
    json!([{"role": "user", "content": q}])
}

fn greedy(messages: &Value, max_tokens: usize) -> Value {
    json!({"model": CHAT_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
}

fn finish(f: Finish) -> &'static str {
    match f {
        Finish::Length => "length",
        _ => "stop",
    }
}

/// Check a whole answer against the library's reply.
fn assert_reply(body: &Value, want: &ChatReply) {
    assert_eq!(body["object"], "chat.completion", "{body}");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert!(body["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(body["model"], CHAT_NAME);
    let choice = &body["choices"][0];
    assert_eq!(body["choices"].as_array().unwrap().len(), 1);
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], want.text.as_str());
    assert_eq!(choice["finish_reason"], finish(want.finish));
    let u = &body["usage"];
    assert_eq!(u["prompt_tokens"], want.prompt_tokens);
    assert_eq!(u["completion_tokens"], want.completion_tokens);
    assert_eq!(
        u["total_tokens"],
        want.prompt_tokens + want.completion_tokens
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_image_question_gets_the_runtimes_reply() {
    let cfg = chat_config();
    let want = library(&cfg.limits, &image_question(), 24, &[]);
    assert_eq!(want.prompt_tokens, 85);
    let s = Server::start_chat(cfg).await;
    let (status, body) = s.chat(greedy(&image_question(), 24)).await;
    assert_eq!(status, 200, "{body}");
    assert_reply(&body, &want);
    // Without `model`, and with `max_completion_tokens` winning over `max_tokens`.
    let (status, body) = s
        .chat(json!({"messages": image_question(), "max_tokens": 3, "max_completion_tokens": 24, "temperature": 0}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_reply(&body, &want);
    s.stop().await.unwrap();
}

/// The events of a streamed answer: each `data:` payload, in order.
fn events(raw: &str) -> Vec<String> {
    let mut out = Vec::new();
    for block in raw.split("\n\n").filter(|b| !b.is_empty()) {
        let data = block
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not a data event: {block:?}"));
        out.push(data.to_string());
    }
    out
}

async fn stream(s: &Server, body: Value) -> (reqwest::header::HeaderMap, Vec<String>) {
    let r = s
        .http
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let headers = r.headers().clone();
    (headers, events(&r.text().await.unwrap()))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_streamed_reply_is_the_whole_reply_in_chunks() {
    let cfg = chat_config();
    let want = library(&cfg.limits, &image_question(), 32, &[]);
    let s = Server::start_chat(cfg).await;
    for include_usage in [false, true] {
        let mut body = greedy(&image_question(), 32);
        body["stream"] = json!(true);
        if include_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        let (headers, events) = stream(&s, body).await;
        assert!(
            headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        assert_eq!(events.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let id = chunks[0]["id"].as_str().unwrap();
        assert!(id.starts_with("chatcmpl-"));
        for c in &chunks {
            assert_eq!(c["object"], "chat.completion.chunk");
            assert_eq!(c["id"], id);
            assert_eq!(c["model"], CHAT_NAME);
            // `usage` is null in every chunk but the last when asked for, absent otherwise.
            assert_eq!(c.get("usage").is_some(), include_usage, "{c}");
        }
        // The role first; content deltas; then the finish reason; then (if asked) the usage.
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let (ends, usage) = if include_usage {
            let u = &chunks[chunks.len() - 1];
            assert_eq!(u["choices"], json!([]));
            assert_eq!(u["usage"]["prompt_tokens"], want.prompt_tokens);
            assert_eq!(u["usage"]["completion_tokens"], want.completion_tokens);
            assert_eq!(
                u["usage"]["total_tokens"],
                want.prompt_tokens + want.completion_tokens
            );
            (chunks.len() - 2, 1)
        } else {
            (chunks.len() - 1, 0)
        };
        let last = &chunks[ends]["choices"][0];
        assert_eq!(last["finish_reason"], finish(want.finish));
        assert_eq!(last["delta"], json!({}));
        let middle = &chunks[1..ends];
        assert!(middle.len() > 1, "one chunk per piece of text");
        let mut text = String::new();
        for c in middle {
            assert!(c["choices"][0]["finish_reason"].is_null());
            text.push_str(c["choices"][0]["delta"]["content"].as_str().unwrap());
        }
        assert_eq!(text, want.text);
        assert_eq!(chunks.len(), 1 + middle.len() + 1 + usage);
    }
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn stop_strings_and_token_limits_end_the_reply() {
    let cfg = chat_config();
    let full = library(&cfg.limits, &image_question(), 32, &[]);
    assert_eq!(full.finish, Finish::Length);
    // A stop string from the middle of the greedy reply: the text ends right before it.
    let cut = full
        .text
        .char_indices()
        .nth(full.text.chars().count() / 2)
        .unwrap()
        .0;
    let stop: String = full.text[cut..].chars().take(3).collect();
    let at = full.text.find(&stop).unwrap();
    let stopped = library(&cfg.limits, &image_question(), 32, &[&stop]);
    assert_eq!(stopped.text, full.text[..at]);
    let s = Server::start_chat(cfg).await;
    for stop_field in [json!(stop), json!(["never appears", stop])] {
        let mut body = greedy(&image_question(), 32);
        body["stop"] = stop_field;
        let (status, body) = s.chat(body).await;
        assert_eq!(status, 200, "{body}");
        assert_reply(&body, &stopped);
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
    }
    // The token limit: `length`, and exactly that many tokens.
    let (status, body) = s.chat(greedy(&image_question(), 5)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 5);
    s.stop().await.unwrap();
}

/// Prompts of different lengths, with and without an image.
fn mixed() -> Vec<(Value, usize)> {
    vec![
        (image_question(), 32),
        (text_question("Tell me a story."), 40),
        (text_question("Hello"), 24),
        (
            json!([
                {"role": "system", "content": "You are brief."},
                {"role": "user", "content": "Why is the sky blue? Say it in one long sentence."},
                {"role": "assistant", "content": "Because of scattering."},
                {"role": "user", "content": [{"type": "text", "text": "And at sunset?"}]},
            ]),
            48,
        ),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_each_get_their_own_reply() {
    let cfg = chat_config();
    let want: Vec<ChatReply> = mixed()
        .iter()
        .map(|(m, n)| library(&cfg.limits, m, *n, &[]))
        .collect();
    let s = Server::start_chat(cfg).await;
    for round in 0..2 {
        let answers = futures_join(
            mixed()
                .into_iter()
                .map(|(m, n)| {
                    let mut body = greedy(&m, n);
                    // Streamed in the second round: the same replies, piece by piece.
                    if round == 1 {
                        body["stream"] = json!(true);
                    }
                    let (http, url) = (s.http.clone(), s.url.clone());
                    tokio::spawn(async move {
                        let r = http
                            .post(format!("{url}/v1/chat/completions"))
                            .json(&body)
                            .send()
                            .await
                            .unwrap();
                        assert_eq!(r.status(), 200);
                        r.text().await.unwrap()
                    })
                })
                .collect(),
        )
        .await;
        for (raw, want) in answers.iter().zip(&want) {
            if round == 0 {
                assert_reply(&serde_json::from_str(raw).unwrap(), want);
            } else {
                let text: String = events(raw)
                    .iter()
                    .filter(|e| *e != "[DONE]")
                    .filter_map(|e| {
                        let c: Value = serde_json::from_str(e).unwrap();
                        c["choices"][0]["delta"]["content"]
                            .as_str()
                            .map(str::to_string)
                    })
                    .collect();
                assert_eq!(text, want.text);
            }
        }
    }
    // The replies shared steps: some step ran more than one sequence.
    let metrics = s.metrics().await;
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name}:\n{metrics}"))
            .parse()
            .unwrap()
    };
    let (sum, count) = (
        value("tessera_chat_step_sequences_sum"),
        value("tessera_chat_step_sequences_count"),
    );
    assert!(
        sum > count,
        "no step batched two sequences ({sum} over {count} steps)"
    );
    s.stop().await.unwrap();
}

/// Await every task, in order.
async fn futures_join(tasks: Vec<tokio::task::JoinHandle<String>>) -> Vec<String> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn assert_openai_error(status: u16, body: &Value, want_status: u16, code: &str, what: &str) {
    assert_eq!(status, want_status, "{what}: {body}");
    let e = &body["error"];
    assert_eq!(e["code"], code, "{what}: {body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}"
    );
    assert!(e["type"].is_string(), "{what}");
    assert!(e.get("param").is_some(), "{what}");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_bad_request_gets_its_4xx_and_the_server_keeps_serving() {
    let mut cfg = chat_config();
    cfg.limits.max_inputs = 2;
    let s = Server::start_chat(cfg).await;
    let user = |content: Value| json!([{"role": "user", "content": content}]);
    let image = |url: &str| {
        user(json!([
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "and?"},
        ]))
    };
    let ok = text_question("hi");
    let png = data_url(&png(40, 30));
    let cases: Vec<(&str, Value, u16, &str, &str)> = vec![
        (
            "missing messages",
            json!({"model": CHAT_NAME}),
            400,
            "invalid_request",
            "messages",
        ),
        (
            "empty messages",
            json!({"messages": []}),
            400,
            "invalid_request",
            "messages",
        ),
        (
            "messages not a list",
            json!({"messages": "hi"}),
            400,
            "invalid_request",
            "messages",
        ),
        (
            "bad role",
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            400,
            "invalid_request",
            "messages[0].role",
        ),
        (
            "tool role",
            json!({"messages": [{"role": "tool", "content": "42", "tool_call_id": "x"}]}),
            400,
            "invalid_request",
            "messages[0].role",
        ),
        (
            "no content",
            json!({"messages": [{"role": "user"}]}),
            400,
            "invalid_request",
            "messages[0].content",
        ),
        (
            "content a number",
            json!({"messages": user(json!(7))}),
            400,
            "invalid_request",
            "messages[0].content",
        ),
        (
            "unknown part",
            json!({"messages": user(json!([{"type": "input_audio", "input_audio": {}}]))}),
            400,
            "invalid_request",
            "messages[0].content[0].type",
        ),
        (
            "remote image URL",
            json!({"messages": image("https://example.com/cat.png")}),
            400,
            "invalid_request",
            "messages[0].content[0]",
        ),
        (
            "data URL that is not base64",
            json!({"messages": image("data:image/png,rawbytes")}),
            400,
            "invalid_request",
            "messages[0].content[0]",
        ),
        (
            "not an image",
            json!({"messages": image(&data_url(b"this is not an image at all"))}),
            400,
            "invalid_request",
            "messages[0].content[0]",
        ),
        (
            "file path without --allow-file-paths",
            json!({"messages": image("/etc/hosts.png")}),
            403,
            "file_paths_not_allowed",
            "",
        ),
        (
            "an image in a system message",
            json!({"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": png}}]}]}),
            400,
            "invalid_request",
            "messages[0].content[0]",
        ),
        (
            "more images than --max-inputs",
            json!({"messages": user(json!([
                {"type": "image_url", "image_url": {"url": png}},
                {"type": "image_url", "image_url": {"url": png}},
                {"type": "image_url", "image_url": {"url": png}},
            ]))}),
            413,
            "too_many_inputs",
            "messages",
        ),
        (
            "the image placeholder in text",
            json!({"messages": user(json!("<image> what is this"))}),
            400,
            "invalid_request",
            "messages[0].content",
        ),
        (
            "n = 2",
            json!({"messages": ok, "n": 2}),
            400,
            "invalid_request",
            "n",
        ),
        (
            "tools",
            json!({"messages": ok, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            400,
            "invalid_request",
            "tools",
        ),
        (
            "JSON mode",
            json!({"messages": ok, "response_format": {"type": "json_object"}}),
            400,
            "invalid_request",
            "response_format",
        ),
        (
            "logprobs",
            json!({"messages": ok, "logprobs": true}),
            400,
            "invalid_request",
            "logprobs",
        ),
        (
            "max_tokens 0",
            json!({"messages": ok, "max_tokens": 0}),
            400,
            "invalid_request",
            "max_tokens",
        ),
        (
            "negative temperature",
            json!({"messages": ok, "temperature": -1}),
            400,
            "invalid_request",
            "temperature",
        ),
        (
            "top_p 0",
            json!({"messages": ok, "top_p": 0}),
            400,
            "invalid_request",
            "top_p",
        ),
        (
            "temperature a string",
            json!({"messages": ok, "temperature": "hot"}),
            400,
            "invalid_request",
            "temperature",
        ),
        (
            "empty stop",
            json!({"messages": ok, "stop": [""]}),
            400,
            "invalid_request",
            "stop[0]",
        ),
        (
            "seed a string",
            json!({"messages": ok, "seed": "x"}),
            400,
            "invalid_request",
            "seed",
        ),
        (
            "another model",
            json!({"messages": ok, "model": "gpt-4o"}),
            404,
            "model_not_found",
            "model",
        ),
    ];
    for (what, body, status, code, param) in cases {
        let (got, answer) = s.chat(body).await;
        assert_openai_error(got, &answer, status, code, what);
        if !param.is_empty() {
            assert_eq!(answer["error"]["param"], param, "{what}: {answer}");
        }
        // The server goes on answering.
        let (got, answer) = s.chat(greedy(&ok, 2)).await;
        assert_eq!(got, 200, "after {what}: {answer}");
    }
    // Not JSON.
    let r = s
        .http
        .post(format!("{}/v1/chat/completions", s.url))
        .header("content-type", "application/json")
        .body("{\"messages\": [")
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    assert_openai_error(
        status,
        &r.json().await.unwrap(),
        400,
        "invalid_json",
        "malformed JSON",
    );
    // The embeddings route of a chat server says what is served.
    let (status, body) = s.embed(json!({"input": "x"})).await;
    assert_openai_error(status, &body, 400, "invalid_request", "embeddings on chat");
    let m = body["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("chat model") && m.contains("/v1/chat/completions"),
        "{m}"
    );
    let (got, answer) = s.chat(greedy(&ok, 2)).await;
    assert_eq!(got, 200, "{answer}");
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prompt_longer_than_the_context_is_refused() {
    let mut cfg = chat_config();
    cfg.limits.context = 64;
    let s = Server::start_chat(cfg).await;
    let (status, body) = s.chat(greedy(&image_question(), 4)).await;
    assert_openai_error(status, &body, 400, "invalid_request", "long prompt");
    let m = body["error"]["message"].as_str().unwrap();
    assert!(m.contains("85 tokens") && m.contains("64"), "{m}");
    // A short prompt gets at most what the context leaves, and says why it ended.
    let (status, body) = s
        .chat(greedy(&text_question("Tell me a story."), 500))
        .await;
    assert_eq!(status, 200, "{body}");
    let u = &body["usage"];
    assert_eq!(u["total_tokens"], 64, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_embedding_server_refuses_chat() {
    let s = Server::start(common::config()).await;
    let (status, body) = s.chat(greedy(&text_question("hi"), 2)).await;
    assert_openai_error(status, &body, 400, "invalid_request", "chat on embeddings");
    let m = body["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("embedding model") && m.contains("/v1/embeddings"),
        "{m}"
    );
    s.stop().await.unwrap();
}

/// POST a chat request from a task of its own.
fn post(s: &Server, body: Value) -> tokio::task::JoinHandle<(u16, Option<String>, Value)> {
    let (http, url) = (s.http.clone(), s.url.clone());
    tokio::spawn(async move {
        let r = http
            .post(format!("{url}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .expect("an answer, not a transport error");
        let status = r.status().as_u16();
        let retry = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        (status, retry, r.json::<Value>().await.unwrap())
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn more_requests_than_slots_and_queue_get_429_never_a_broken_connection() {
    let mut cfg = chat_config();
    cfg.limits.max_sequences = 1;
    cfg.limits.max_queue = 1;
    let s = Server::start_chat(cfg).await;
    // One reply generating and one waiting: every place is taken for a while. They are sent
    // one after the other: a request being prepared holds a place in the queue (--max-queue) as
    // a waiting one does, so two prepared at once would not both fit a queue of one.
    let long = greedy(&text_question("Tell me a story."), 800);
    let first = post(&s, long.clone());
    let mut running = false;
    for _ in 0..400 {
        running = s.metric("tessera_chat_running").await == 1.0;
        if running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(running, "the first request did not start");
    let admitted = [first, post(&s, long.clone())];
    let mut full = false;
    for _ in 0..400 {
        let running = s.metric("tessera_chat_running").await;
        let waiting = s.metric(r#"tessera_queue_depth{lane="chat"}"#).await;
        full = (running, waiting) == (1.0, 1.0);
        if full {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(full, "the two requests were not admitted");
    // A burst meanwhile: each is refused with 429 and Retry-After, none is dropped.
    let burst: Vec<_> = (0..6).map(|_| post(&s, long.clone())).collect();
    for t in burst {
        let (status, retry, body) = t.await.unwrap();
        assert_eq!(status, 429, "{body}");
        assert_eq!(retry.as_deref(), Some("1"));
        // Refused at admission, or (bodies arriving together) at upload.
        let code = body["error"]["code"].as_str().unwrap();
        assert!(code == "queue_full" || code == "too_many_uploads", "{body}");
        if code == "queue_full" {
            let m = body["error"]["message"].as_str().unwrap();
            assert!(
                m.contains("--max-sequences") && m.contains("--max-queue"),
                "{m}"
            );
        }
    }
    for t in admitted {
        let (status, _, body) = t.await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 800);
    }
    let (status, _) = s.chat(greedy(&text_question("hi"), 2)).await;
    assert_eq!(status, 200);
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_goes_away_frees_its_slot() {
    let mut cfg = chat_config();
    cfg.limits.max_sequences = 1;
    cfg.limits.request_timeout = Duration::from_millis(400);
    let s = Server::start_chat(cfg).await;
    // A long streamed reply read for one chunk, then dropped.
    let mut body = greedy(&text_question("Tell me a story."), 1900);
    body["stream"] = json!(true);
    let mut r = s
        .http
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.chunk().await.unwrap().is_some());
    drop(r);
    // The only slot is free again long before 1900 tokens could be generated.
    let (status, body) = s.chat(greedy(&text_question("hi"), 2)).await;
    assert_eq!(status, 200, "{body}");
    // A whole reply past --request-timeout: 504, and its slot is freed the same way.
    let (status, body) = s
        .chat(greedy(&text_question("Tell me a story."), 1900))
        .await;
    assert_openai_error(status, &body, 504, "timeout", "timeout");
    let (status, body) = s.chat(greedy(&text_question("hi"), 2)).await;
    assert_eq!(status, 200, "{body}");
    let metrics = s.metrics().await;
    assert!(
        metrics.contains(r#"tessera_chat_replies_total{finish="cancelled"} 2"#),
        "{metrics}"
    );
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn models_health_and_metrics_of_a_chat_server() {
    let s = Server::start_chat(chat_config()).await;
    let get = |path: &str| s.http.get(format!("{}{path}", s.url)).send();
    let models: Value = get("/v1/models").await.unwrap().json().await.unwrap();
    assert_eq!(
        models["data"],
        json!([{"id": CHAT_NAME, "object": "model", "created": models["data"][0]["created"], "owned_by": "tessera", "capability": "chat"}])
    );
    let health: Value = get("/health").await.unwrap().json().await.unwrap();
    assert_eq!(health["status"], "ready");
    assert!(health["device"].as_str().unwrap().starts_with("cpu"));
    let (status, body) = s.chat(greedy(&image_question(), 6)).await;
    assert_eq!(status, 200, "{body}");
    let (status, _) = s.chat(json!({"messages": []})).await;
    assert_eq!(status, 400);
    let text = get("/metrics").await.unwrap().text().await.unwrap();
    for needle in [
        r#"tessera_requests_total{route="/v1/chat/completions",status="200",code=""} 1"#,
        r#"tessera_requests_total{route="/v1/chat/completions",status="400",code="invalid_request"} 1"#,
        r#"tessera_queue_depth{lane="chat"} 0"#,
        r#"tessera_chat_replies_total{finish="length"} 1"#,
        "tessera_chat_prompt_tokens_total 85",
        "tessera_chat_completion_tokens_total 6",
        "tessera_chat_running 0",
        "tessera_chat_time_to_first_token_seconds_count 1",
        "tessera_chat_decode_tokens_per_second_count 1",
        r#"tessera_queue_duration_seconds_count{lane="chat"} 1"#,
        r#"tessera_request_duration_seconds_count{lane="chat"} 1"#,
        "tessera_chat_step_sequences_count 6",
        "tessera_chat_step_duration_seconds_sum",
    ] {
        assert!(text.contains(needle), "metrics lack {needle}:\n{text}");
    }
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn sampling_follows_the_seed() {
    let s = Server::start_chat(chat_config()).await;
    let sample = |seed: i64| {
        json!({"messages": image_question(), "max_tokens": 16, "temperature": 1.0, "top_p": 0.9,
               "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "seed": seed})
    };
    let text = |b: &Value| {
        b["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (_, a) = s.chat(sample(5)).await;
    let (_, b) = s.chat(sample(5)).await;
    let (_, c) = s.chat(sample(6)).await;
    assert_eq!(text(&a), text(&b));
    assert_ne!(text(&a), text(&c));
    s.stop().await.unwrap();
}

/// A client re-sending its growing conversation: the follow-up continues the cache slot the
/// first turn left (prefilling only the new turn) and answers as the library does without a
/// prefix cache; `/metrics` counts the tokens that came from the cache beside the prompt tokens.
#[tokio::test(flavor = "multi_thread")]
async fn a_follow_up_turn_prefills_only_its_new_tokens() {
    let cfg = chat_config();
    let s = Server::start_chat(cfg.clone()).await;
    // A one-token first reply re-tokenises as generated (see the runtime's lfm2vl_chat.rs).
    let first = library(&cfg.limits, &image_question(), 1, &[]);
    let (status, body) = s.chat(greedy(&image_question(), 1)).await;
    assert_eq!(status, 200, "{body}");
    assert_reply(&body, &first);
    let mut follow = image_question();
    let turns = follow.as_array_mut().unwrap();
    turns.push(json!({"role": "assistant", "content": first.text}));
    turns.push(json!({"role": "user", "content": "And what colour is it?"}));
    let want = library(&cfg.limits, &follow, 12, &[]);
    assert_eq!(want.cached_tokens, 0);
    let (status, body) = s.chat(greedy(&follow, 12)).await;
    assert_eq!(status, 200, "{body}");
    assert_reply(&body, &want);
    // The same reply as the library's without a cache, and its usage says what came from it,
    // as OpenAI reports cached prompt tokens.
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"], first.prompt_tokens,
        "{body}"
    );
    let text = s.metrics().await;
    // The follow-up prefilled only what it added to the first prompt.
    for needle in [
        format!(
            "tessera_chat_prompt_tokens_total {}",
            first.prompt_tokens + want.prompt_tokens
        ),
        format!(
            "tessera_chat_prefix_cache_hit_tokens_total {}",
            first.prompt_tokens
        ),
    ] {
        assert!(text.contains(&needle), "metrics lack {needle}:\n{text}");
    }
    s.stop().await.unwrap();
}
