//! Hostile and careless input where the danger was time or memory: a crafted image at the pixel
//! limit (CLI and server), an endless text file, an absurd thread count. Each case checks the
//! message and measures the child process: its wall time and its peak resident memory, `VmHWM`
//! of `/proc/PID/status`. (`wait4`'s `ru_maxrss` would not do: it counts the memory the child
//! shared with this test process between fork and exec.)

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use base64::Engine;

mod common;
use common::{MIB, Run, Server, measured};

/// Under 10 s and 300 MiB: what a refusal from a header or a first line costs.
fn assert_quick_and_small(run: &Run) {
    run.assert_within(Duration::from_secs(10), 300);
}

/// An 8-bit grey PNG of 89,478,485 × 1 pixels — exactly Pillow's bomb threshold — holding one
/// row of zeros, which zlib squeezes into about 90 KB.
fn wide_png() -> Vec<u8> {
    const WIDTH: u32 = 89_478_485;
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, WIDTH, 1);
        enc.set_color(png::ColorType::Grayscale);
        enc.set_depth(png::BitDepth::Eight);
        let mut writer = enc.write_header().unwrap();
        let mut w = writer.stream_writer().unwrap();
        let zeros = vec![0u8; 1 << 20];
        let mut left = WIDTH as usize;
        while left > 0 {
            let n = left.min(zeros.len());
            w.write_all(&zeros[..n]).unwrap();
            left -= n;
        }
        w.finish().unwrap();
        writer.finish().unwrap();
    }
    assert!(out.len() < 200_000, "{} bytes", out.len());
    out
}

/// A large but ordinary image: 6000 × 4000 grey (24 MP decoded, a few KB as a file).
fn large_png() -> Vec<u8> {
    let mut out = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut out),
        &vec![90u8; 6000 * 4000],
        6000,
        4000,
        image::ExtendedColorType::L8,
    )
    .unwrap();
    out
}

#[test]
fn a_wide_png_at_the_pixel_limit_is_refused_from_its_header_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.png");
    std::fs::write(&path, wide_png()).unwrap();
    let run = measured(
        &["embed", "--image", path.to_str().unwrap()],
        None,
        Duration::from_secs(60),
    );
    // Before: 3.8 GB and 16 s in the resize, then this refusal.
    run.assert_fails_with(&[
        "wide.png",
        "89478485×1 image becomes a grid of 210×3 patches",
        "position_embedding_size",
    ]);
    assert_quick_and_small(&run);
}

#[test]
fn an_endless_text_file_fails_at_its_first_line_in_bounded_memory() {
    // Before: /dev/zero grew by 1.3 GB every 2 s until the machine ran out.
    let run = measured(
        &["embed", "--text-file", "/dev/zero"],
        None,
        Duration::from_secs(20),
    );
    run.assert_fails_with(&["/dev/zero: line 1 is longer than 1 MiB"]);
    assert_quick_and_small(&run);
}

#[test]
fn an_absurd_thread_count_is_capped_with_a_warning() {
    // Before: --threads 100000 started threads until it stalled.
    let run = measured(
        &["--threads", "100000", "embed", "--text", "hi"],
        None,
        Duration::from_secs(60),
    );
    assert!(run.status.success(), "{}", run.stderr);
    assert!(
        run.stderr
            .contains("warning: --threads 100000 is more than 4×"),
        "{}",
        run.stderr
    );
    assert!(run.elapsed < Duration::from_secs(30), "{:?}", run.elapsed);
}

// ---- the server, as a process of its own: `common::Server` ------------------------------------

fn image_input(png: &[u8]) -> serde_json::Value {
    let url = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(png)
    );
    serde_json::json!({"input": [{"type": "image_url", "image_url": {"url": url}}]})
}

#[test]
fn the_server_stays_within_its_image_memory_while_clients_send_the_wide_image() {
    const BUDGET_MIB: u64 = 128;
    let server = Server::start(&["--max-image-memory-mb", &BUDGET_MIB.to_string()]);
    let (status, body) = server.post("/v1/embeddings", &serde_json::json!({"input": "warm up"}));
    assert_eq!(status, 200, "{body}");
    let baseline = server.memory("VmRSS");

    let server = std::sync::Arc::new(server);
    let (wide, large) = (image_input(&wide_png()), image_input(&large_png()));
    let mut clients = Vec::new();
    for i in 0..6 {
        let (server, body) = (
            server.clone(),
            if i % 2 == 0 { &wide } else { &large }.clone(),
        );
        clients.push(std::thread::spawn(move || {
            let started = Instant::now();
            let answer = server.post("/v1/embeddings", &body);
            (i % 2 == 0, answer, started.elapsed())
        }));
    }
    // Short texts keep being answered while the images are in.
    let mut slowest = Duration::ZERO;
    for i in 0..10 {
        let started = Instant::now();
        let (status, body) = server.post(
            "/v1/embeddings",
            &serde_json::json!({"input": format!("query {i}")}),
        );
        assert_eq!(status, 200, "{body}");
        slowest = slowest.max(started.elapsed());
        std::thread::sleep(Duration::from_millis(30));
    }
    let answers: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let grew = server.memory("VmHWM").saturating_sub(baseline);
    eprintln!(
        "server: peak grew by {} MiB (budget {BUDGET_MIB} MiB); slowest text {slowest:?}",
        grew / MIB
    );
    assert!(
        grew < (BUDGET_MIB + 64) * MIB,
        "peak memory grew by {} MiB with a budget of {BUDGET_MIB} MiB",
        grew / MIB
    );
    let mut served = 0;
    for (is_wide, (status, body), took) in answers {
        if is_wide {
            assert!(
                took < Duration::from_secs(5),
                "the wide image took {took:?}"
            );
            // Before: decoded (360 MB) and only then refused as over the budget; under a
            // budget that fits it, resized in 3.8 GB and 15 s, then refused for its grid.
            assert_eq!(status, 400, "{body}");
            assert!(body.contains("position_embedding_size"), "{body}");
        } else {
            // One large image at a time fits the budget; the others wait their turn (429).
            assert!(status == 200 || status == 429, "{status}: {body}");
            served += usize::from(status == 200);
        }
    }
    assert!(served >= 1, "no large image was served");
    assert!(
        slowest < Duration::from_secs(5),
        "a text waited {slowest:?}"
    );
}

/// Where the bundled model's image budget puts a large image: accepted, so the memory measured
/// above is the decoding's and not an early refusal's.
#[test]
fn the_large_image_is_one_the_model_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("large.png");
    std::fs::write(&path, large_png()).unwrap();
    let run = measured(
        &["embed", "--image", path.to_str().unwrap()],
        None,
        Duration::from_secs(60),
    );
    assert!(run.status.success(), "{}", run.stderr);
}
