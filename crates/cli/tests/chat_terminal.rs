//! `tessera chat` as a person uses it at a terminal: the line editor driven through a
//! pseudo-terminal against the bundled miniature LFM2-VL.

use std::path::Path;
use std::process::Command;

use rexpect::session::PtySession;

/// Long enough for any step on a loaded machine; a hang fails instead of blocking.
const TIMEOUT_MS: u64 = 30_000;

fn chat(args: &[&str]) -> PtySession {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.arg("chat")
        .args(args)
        .env_remove("TESSERA_MODEL")
        .env("TESSERA_DEVICE", "cpu")
        .env("TERM", "xterm");
    let mut s = rexpect::session::spawn_command(c, Some(TIMEOUT_MS)).unwrap();
    s.exp_string("/help lists the commands").unwrap();
    s.exp_string("> ").unwrap();
    s
}

/// Wait for the program to end and check it ended well.
fn assert_exits_cleanly(mut s: PtySession) {
    let rest = s.exp_eof().unwrap();
    assert!(!rest.contains("panicked"), "{rest}");
    let status = s.process().wait().unwrap();
    let status = format!("{status:?}");
    assert!(
        status.starts_with("Exited(") && status.ends_with(", 0)"),
        "{status}: {rest}"
    );
}

fn image() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/egemma2/images/grey_64x48.png")
        .to_str()
        .unwrap()
        .to_string()
}

#[test]
fn commands_are_acknowledged_and_a_bare_image_command_is_an_error() {
    let mut s = chat(&["--max-tokens", "4"]);
    s.send_line("/help").unwrap();
    s.exp_string("/image PATH").unwrap();
    s.exp_string("Ctrl-C").unwrap();
    s.send_line("/image").unwrap();
    s.exp_string("error: /image needs the path of an image")
        .unwrap();
    s.send_line(&format!("/image {}", image())).unwrap();
    s.exp_string("attached to the next question").unwrap();
    s.send_line("/reset").unwrap();
    s.exp_string("[conversation cleared]").unwrap();
    // The bare /image was not sent as a question: no reply came before this one.
    s.send_line("what is this?").unwrap();
    let (before, _) = s
        .exp_regex(r"\[\d+ prompt tokens \(0 from the cache\)")
        .unwrap();
    assert!(!before.contains("tokens/s"), "{before}");
    s.send_line("/quit").unwrap();
    assert_exits_cleanly(s);
}

#[test]
fn ctrl_c_stops_the_reply_and_keeps_the_conversation_then_twice_leaves() {
    let mut s = chat(&["--max-tokens", "1500"]);
    s.send_line("tell me a long story").unwrap();
    s.exp_string("tell me a long story").unwrap();
    // Some of the reply, then Ctrl-C.
    s.exp_regex(r"[^\s]{8}").unwrap();
    s.send_control('c').unwrap();
    let (_, first) = s
        .exp_regex(r"\[\d+ prompt tokens[^\]]*; stopped\]")
        .unwrap();
    s.exp_string("> ").unwrap();
    // The conversation goes on with the part of the reply that was shown: the follow-up, shorter
    // than the first question, makes a longer prompt.
    s.send_line("and then?").unwrap();
    let (_, second) = s.exp_regex(r"\[\d+ prompt tokens").unwrap();
    let tokens = |stats: &str| -> usize {
        let digits: String = stats[1..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().unwrap()
    };
    assert!(tokens(&second) > tokens(&first), "{first} then {second}");
    s.exp_string("> ").unwrap();
    // Up arrow brings the last question back.
    s.send("\x1b[A").unwrap();
    s.flush().unwrap();
    s.exp_string("and then?").unwrap();
    // Ctrl-C at the prompt drops the line and says how to leave; a second one leaves.
    s.send_control('c').unwrap();
    s.exp_string("Ctrl-C again").unwrap();
    s.send_control('c').unwrap();
    assert_exits_cleanly(s);
}

#[test]
fn ctrl_d_leaves() {
    let mut s = chat(&["--max-tokens", "4"]);
    s.send_control('d').unwrap();
    assert_exits_cleanly(s);
}
