//! What `tessera serve` writes on stderr: one access line per request at info (method, route,
//! status, time, model, tokens), every line JSON with `--log-format json` (the start-up notes
//! and a failure to start included), "model loaded" naming its model, and no ERROR line for the
//! 503s of `/health` while the model loads.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{Server, free_port, tessera};
use serde_json::{Value, json};

/// `tessera serve` with `args` and its stderr collected line by line, polled from the start (so
/// the `/health` 503s while it loads are among the requests) until it is ready.
fn start(args: &[&str]) -> (Server, JoinHandle<()>, Arc<Mutex<Vec<String>>>) {
    let port = free_port();
    let mut child: Child = tessera()
        .args(["serve", "--port", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tessera serve runs");
    let lines = Arc::new(Mutex::new(Vec::new()));
    let stderr = child.stderr.take().expect("piped stderr");
    let reader = {
        let lines = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                lines.lock().unwrap().push(line);
            }
        })
    };
    let server = Server {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    };
    let started = Instant::now();
    while server.get("/health").0 != 200 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "not ready in 60 s: {:?}",
            lines.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    (server, reader, lines)
}

/// Stop the server and give every line it wrote.
fn stop(mut server: Server, reader: JoinHandle<()>, lines: Arc<Mutex<Vec<String>>>) -> Vec<String> {
    assert!(
        server.terminate(Duration::from_secs(10)).is_some(),
        "still running 10 s after SIGTERM"
    );
    reader.join().unwrap();
    lines.lock().unwrap().clone()
}

/// The access lines (message `request`) of a JSON log.
fn access(lines: &[Value]) -> Vec<&Value> {
    lines
        .iter()
        .filter(|l| l["fields"]["message"] == "request")
        .collect()
}

#[test]
fn json_logs_have_one_access_line_per_request_and_every_line_is_json() {
    // `--device auto` on a machine without CUDA adds a start-up note: it must be JSON too.
    let (server, reader, lines) = start(&["--log-format", "json", "--device", "auto"]);
    let (status, body) = server.post("/v1/embeddings", &json!({"input": ["hello", "world"]}));
    assert_eq!(status, 200, "{body}");
    let tokens: u64 = serde_json::from_str::<Value>(&body).unwrap()["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    let (status, body) = server.get("/v1/models/egemma2-mini");
    assert_eq!(status, 200, "{body}");
    let (status, _) = server.post("/v1/embeddings", &json!({"input": []}));
    assert_eq!(status, 400);
    assert_eq!(server.get("/no/such/route").0, 404);
    let lines = stop(server, reader, lines);

    let parsed: Vec<Value> = lines
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(parsed.iter().all(|l| l["level"].is_string()), "{parsed:#?}");
    assert!(
        !parsed.iter().any(|l| l["level"] == "ERROR"),
        "an ERROR line: {parsed:#?}"
    );
    let message = |m: &str| parsed.iter().find(|l| l["fields"]["message"] == m);
    // Start-up notes: the bundled model's warning, the listener, the model named when loaded.
    assert!(
        parsed.iter().any(|l| l["level"] == "WARN"
            && l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("random weights"))),
        "{parsed:#?}"
    );
    assert!(
        message("listening; loading the models").is_some(),
        "{parsed:#?}"
    );
    let loaded = message("model loaded").expect("a model loaded line");
    assert_eq!(loaded["fields"]["model"], "egemma2-mini", "{loaded}");

    let requests = access(&parsed);
    for r in &requests {
        assert_eq!(r["level"], "INFO", "{r}");
        assert!(
            r["fields"]["ms"].as_f64().is_some_and(|ms| ms >= 0.0),
            "{r}"
        );
    }
    let find = |method: &str, route: &str, status: u64| {
        requests
            .iter()
            .find(|r| {
                r["fields"]["method"] == method
                    && r["fields"]["route"] == route
                    && r["fields"]["status"] == status
            })
            .unwrap_or_else(|| panic!("no {method} {route} {status} line: {requests:#?}"))
    };
    let ok = find("POST", "/v1/embeddings", 200);
    assert_eq!(ok["fields"]["model"], "egemma2-mini", "{ok}");
    assert_eq!(ok["fields"]["prompt_tokens"], tokens, "{ok}");
    let bad = find("POST", "/v1/embeddings", 400);
    assert_eq!(bad["fields"]["code"], "invalid_request", "{bad}");
    assert_eq!(bad["fields"]["model"], "egemma2-mini", "{bad}");
    let card = find("GET", "/v1/models/{*model}", 200);
    assert_eq!(card["fields"]["model"], "egemma2-mini", "{card}");
    find("GET", "/no/such/route", 404);
    find("GET", "/health", 200);
    // One line per request: the health polls, then the four requests above.
    let health = requests
        .iter()
        .filter(|r| r["fields"]["route"] == "/health")
        .count();
    assert_eq!(requests.len(), health + 4, "{requests:#?}");
    // While it loaded, `/health` answered 503: at info, like every answer.
    let loading = requests
        .iter()
        .filter(|r| r["fields"]["route"] == "/health" && r["fields"]["status"] == 503)
        .count();
    eprintln!("{loading} health polls answered 503 while the model loaded");
}

#[test]
fn text_logs_have_the_access_line_in_words() {
    let (server, reader, lines) = start(&[]);
    let (status, body) = server.post("/v1/embeddings", &json!({"input": "hello"}));
    assert_eq!(status, 200, "{body}");
    let lines = stop(server, reader, lines);
    let line = lines
        .iter()
        .find(|l| l.contains("route=/v1/embeddings"))
        .unwrap_or_else(|| panic!("no access line: {lines:#?}"));
    for needle in [
        " INFO ",
        "method=POST",
        "status=200",
        "model=egemma2-mini",
        "prompt_tokens=",
        "ms=",
    ] {
        assert!(line.contains(needle), "{needle:?} not in {line}");
    }
    let loaded = lines
        .iter()
        .find(|l| l.contains("model loaded"))
        .expect("a model loaded line");
    assert!(loaded.contains("model=egemma2-mini"), "{loaded}");
}

#[test]
fn a_failure_to_start_is_a_json_line_too() {
    let out = tessera()
        .args([
            "serve",
            "--log-format",
            "json",
            "--model",
            "/no/such/model/dir",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("tessera runs");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<Value> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let error = lines
        .iter()
        .find(|l| l["level"] == "ERROR")
        .unwrap_or_else(|| panic!("no ERROR line: {stderr}"));
    assert!(
        error["fields"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("/no/such/model/dir")),
        "{error}"
    );
}

#[test]
fn chat_and_image_access_lines_carry_tokens_images_and_the_seed() {
    let (server, reader, lines) = start(&[
        "--log-format",
        "json",
        "--model",
        "bundled:lfm2vl",
        "--model",
        "bundled:zimage",
    ]);
    // A streamed reply: its counts are known only at its end, when its line is written.
    let (status, stream) = server.post(
        "/v1/chat/completions",
        &json!({"model": "lfm2vl-mini", "stream": true, "max_tokens": 3,
                "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(status, 200, "{stream}");
    let usage: Value = stream
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|c| c.get("usage").filter(|u| u.is_object()).cloned())
        .unwrap_or_else(|| panic!("no usage chunk: {stream}"));
    // No seed: the one drawn comes back with the image and goes into the log line.
    let (status, body) = server.post(
        "/v1/images/generations",
        &json!({"model": "zimage-mini", "prompt": "", "size": "32x32",
                "num_inference_steps": 1}),
    );
    assert_eq!(status, 200, "{body}");
    let seed = serde_json::from_str::<Value>(&body).unwrap()["data"][0]["seed"]
        .as_u64()
        .unwrap();
    let lines = stop(server, reader, lines);
    let parsed: Vec<Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let requests = access(&parsed);
    let line = |route: &str| {
        requests
            .iter()
            .find(|r| r["fields"]["route"] == route)
            .unwrap_or_else(|| panic!("no {route} line: {requests:#?}"))
    };
    let chat = line("/v1/chat/completions")["fields"].clone();
    assert_eq!(chat["status"], 200);
    assert_eq!(chat["model"], "lfm2vl-mini");
    assert_eq!(chat["prompt_tokens"], usage["prompt_tokens"], "{chat}");
    assert_eq!(
        chat["completion_tokens"], usage["completion_tokens"],
        "{chat}"
    );
    let images = line("/v1/images/generations")["fields"].clone();
    assert_eq!(images["status"], 200);
    assert_eq!(images["model"], "zimage-mini");
    assert_eq!(images["images"], 1, "{images}");
    assert_eq!(images["seed"], seed, "{images}");
}
