//! `tessera generate` as a person sees it at a terminal (a pseudo-terminal, where indicatif
//! draws): a denoising bar with its step count, elapsed time and ETA, the VAE decode as its own
//! stage, and a summary line that stays after the bar.

use rexpect::session::spawn_command;
use std::process::Command;

/// Long enough for the whole run on a loaded machine; a hang fails instead of blocking. The
/// size makes the decode last longer than the bar's redraw interval, as a real model's does.
const TIMEOUT_MS: u64 = 120_000;

#[test]
fn the_bar_shows_steps_elapsed_and_eta_then_the_decode_then_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("fox.png");
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.args([
        "generate",
        "-p",
        "a red fox",
        "--size",
        "512x512",
        "--steps",
        "6",
    ])
    .args(["--seed", "3", "-o"])
    .arg(&out)
    .env_remove("TESSERA_MODEL")
    .env("TESSERA_DEVICE", "cpu")
    .env("TERM", "xterm");
    let mut s = spawn_command(c, Some(TIMEOUT_MS)).unwrap();
    s.exp_string("denoising [").unwrap();
    s.exp_string("/6 steps [").unwrap();
    s.exp_string("ETA").unwrap();
    s.exp_string("decoding (VAE)").unwrap();
    let rest = s.exp_eof().unwrap();
    // The summary stays: what was written, its size, steps and seed, and the stages' times.
    let summary = rest
        .lines()
        .find(|l| l.contains("wrote"))
        .unwrap_or_else(|| panic!("no summary line in {rest:?}"));
    for part in [
        out.to_str().unwrap(),
        "(512x512, 6 steps, seed 3)",
        "encode",
        "denoise",
        "decode",
    ] {
        assert!(summary.contains(part), "{part:?} not in {summary:?}");
    }
    assert!(out.is_file());
}
