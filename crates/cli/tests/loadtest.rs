//! `tessera bench serve` in CI: a short load test of the real server (bundled model, CPU) on
//! loopback. No unexpected answer anywhere; the queue-overflowing burst is answered with 429s,
//! and the server's memory stays bounded; the server stops cleanly on SIGTERM.

use std::process::Command;

#[test]
fn load_test_has_no_errors_and_a_burst_gets_429s_not_memory() {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "bench",
            "serve",
            "--device",
            "cpu",
            "--requests",
            "40",
            "--clients",
            "1,4",
            "--image-clients",
            "2",
            "--image-size",
            "320x240",
            "--max-queue",
            "6",
            "--burst",
            "32",
            "--burst-images",
            "3",
            "--phase-secs",
            "60",
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
    for name in ["text_c1", "text_c4", "mixed_text", "mixed_image"] {
        let p = phase(name);
        assert_eq!(p["unexpected"], 0, "{p}");
        assert_eq!(p["rejected_429"], 0, "{p}");
        assert!(p["ok"].as_u64().unwrap() > 0, "{p}");
        assert!(p["p99_ms"].as_f64().unwrap() >= p["p50_ms"].as_f64().unwrap());
    }
    assert_eq!(phase("text_c1")["ok"], 40);
    let burst = phase("burst");
    assert_eq!(burst["unexpected"], 0, "{burst}");
    assert!(burst["rejected_429"].as_u64().unwrap() > 0, "{burst}");
    assert!(burst["ok"].as_u64().unwrap() > 0, "{burst}");
    let memory = phase("memory");
    assert!(memory["growth_mb"].as_f64().unwrap() <= 256.0, "{memory}");
}
