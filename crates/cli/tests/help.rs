//! Every subcommand's `--help`: no option or argument without a description, and the names a
//! newcomer looks for (both image families, chat's interactive commands, the familiar flags).

use std::process::Command;

fn help(path: &[String]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(path)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "{path:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

/// The lines of the section that starts with `title` (up to the next unindented line).
fn section<'a>(text: &'a str, title: &str) -> Vec<&'a str> {
    text.lines()
        .skip_while(|l| *l != title)
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with(' '))
        .collect()
}

/// The subcommands a help text lists (`help` aside).
fn subcommands(text: &str) -> Vec<String> {
    section(text, "Commands:")
        .iter()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// The entries of a long help's Options and Arguments sections that have no description: an
/// entry's first line is indented less than its text, or holds it after the flag; `[env: …]`, `[default: …]` and the list of
/// possible values are not a description.
fn empty_entries(text: &str) -> Vec<String> {
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut empty = Vec::new();
    for title in ["Options:", "Arguments:"] {
        let lines = section(text, title);
        for (i, l) in lines.iter().enumerate() {
            if l.trim().is_empty() || indent(l) >= 10 {
                continue;
            }
            // Short lines put the text beside the flag, two spaces or more after it.
            let beside = l.trim().split_once("  ").map(|(_, t)| t.trim());
            let described = beside
                .into_iter()
                .chain(
                    lines[i + 1..]
                        .iter()
                        .take_while(|b| b.trim().is_empty() || indent(b) >= 10)
                        .map(|b| b.trim()),
                )
                .any(|b| {
                    !b.is_empty()
                        && !b.starts_with('[')
                        && !b.starts_with("- ")
                        && b != "Possible values:"
                });
            if !described {
                empty.push(l.trim().to_string());
            }
        }
    }
    empty
}

/// Every command path: `[]`, `["embed"]`, …, `["bench", "chat"]`, ….
fn all_commands() -> Vec<Vec<String>> {
    let mut all = vec![Vec::new()];
    let mut i = 0;
    while i < all.len() {
        let path = all[i].clone();
        for c in subcommands(&help(&path)) {
            let mut p = path.clone();
            p.push(c);
            all.push(p);
        }
        i += 1;
    }
    all
}

#[test]
fn no_help_entry_is_empty() {
    let commands = all_commands();
    assert!(commands.len() > 8, "{commands:?}");
    let mut bad = Vec::new();
    for path in &commands {
        for entry in empty_entries(&help(path)) {
            bad.push(format!("tessera {} {entry}", path.join(" ")));
        }
    }
    assert!(bad.is_empty(), "entries without help:\n{}", bad.join("\n"));
}

#[test]
fn the_walker_sees_an_empty_entry() {
    let text = "Options:\n      --port <PORT>\n          [env: PORT=]\n          [default: 8080]\n\n      --host <HOST>\n          Where to listen\n\n  -h, --help\n          Print help\n";
    assert_eq!(empty_entries(text), vec!["--port <PORT>"]);
    let short = "Options:\n      --port <PORT>  [default: 8080]\n      --host <HOST>  Where to listen\n      --top-p <TOP_P>\n";
    assert_eq!(
        empty_entries(short),
        vec!["--port <PORT>  [default: 8080]", "--top-p <TOP_P>"]
    );
}

#[test]
fn help_names_both_image_families_and_the_familiar_flags() {
    let top = help(&[]);
    let generate = help(&["generate".into()]);
    for text in [&top, &generate] {
        assert!(
            text.contains("Z-Image") && text.contains("Qwen-Image-2.1"),
            "{text}"
        );
    }
    for flag in [
        "-m, --model",
        "-p, --prompt",
        "-o, --out",
        "-n, --num-images",
        "--cfg-scale",
        "--offload",
    ] {
        assert!(generate.contains(flag), "generate --help lacks {flag}");
    }
}

#[test]
fn chat_help_lists_the_interactive_commands_and_the_seed_default() {
    let chat = help(&["chat".into()]);
    for needle in [
        "/image PATH",
        "/reset",
        "/help",
        "/quit",
        "Ctrl-C",
        "[default: 0]",
    ] {
        assert!(
            chat.contains(needle),
            "chat --help lacks {needle:?}:\n{chat}"
        );
    }
}
