//! `tessera bench serve-images` in CI: a short load test of the real server generating images
//! (the bundled miniature Z-Image beside the bundled embedding model, CPU) on loopback: 1 and 16
//! concurrent clients, embedding requests idle and while generations run, and a burst of 200
//! requests at once. Only 200s (and 429s in the burst) come back, never a transport error; the
//! server's peak RSS grows by at most 256 MiB during the burst (its admission bounds it: at most
//! --max-queue requests and --max-image-queue-mps of work are held at once); the server stops
//! cleanly on SIGTERM.

use std::process::Command;

#[test]
fn image_load_test_has_only_200s_and_429s_and_bounded_memory() {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "bench",
            "serve-images",
            "--device",
            "cpu",
            "--sizes",
            "64x64",
            "--steps",
            "2",
            "--clients",
            "1,16",
            "--requests",
            "32",
            "--embed-requests",
            "20",
            "--gen-clients",
            "2",
            "--burst",
            "200",
            "--burst-size",
            "64x64",
            "--max-queue",
            "24",
            // 16 cost units (2¹⁶ pixel-steps each; one 64² two-step image is one): the burst
            // meets the cost bound before the count bound.
            "--server-args",
            "--max-image-queue-mps 1",
            "--phase-secs",
            "120",
            "--max-rss-growth-mb",
            "256",
            "--check",
        ])
        .env_remove("TESSERA_MODEL")
        .env_remove("TESSERA_API_KEY")
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let phase = |name: &str| {
        lines
            .iter()
            .find(|l| l["phase"] == name)
            .unwrap_or_else(|| panic!("no {name} line in {stdout}"))
    };
    for name in [
        "gen_64x64_c1",
        "gen_64x64_c16",
        "embed_idle",
        "embed_during",
        "gen_beside_embed",
    ] {
        let p = phase(name);
        assert_eq!(p["unexpected"], 0, "{p}");
        assert_eq!(p["rejected_429"], 0, "{p}");
        assert!(p["ok"].as_u64().unwrap() > 0, "{p}");
        assert!(p["p95_ms"].as_f64().unwrap() >= p["p50_ms"].as_f64().unwrap());
    }
    assert_eq!(phase("gen_64x64_c1")["ok"], 32);
    assert_eq!(phase("gen_64x64_c16")["ok"], 32);
    assert!(phase("gen_64x64_c16")["images_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(phase("embed_during")["ok"], 20);
    let burst = phase("burst");
    assert_eq!(burst["unexpected"], 0, "only 200s and 429s: {burst}");
    assert_eq!(
        burst["statuses"].get("0"),
        None,
        "transport errors: {burst}"
    );
    let (ok, refused) = (
        burst["ok"].as_u64().unwrap(),
        burst["rejected_429"].as_u64().unwrap(),
    );
    assert_eq!(ok + refused, 200, "{burst}");
    assert!(ok > 0 && refused > 0, "{burst}");
    let memory = phase("memory");
    assert!(memory["growth_mb"].as_f64().unwrap() <= 256.0, "{memory}");
}
