//! Where a conversation's lines come from: a line editor (editing, history) when a person types
//! at a terminal, plain lines otherwise (a pipe, a file); and Ctrl-C, which at a terminal stops
//! the reply being written instead of the program.

use std::io::{BufRead, IsTerminal, StdinLock};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use rustyline::error::ReadlineError;
use tessera_core::{Error, Result};

/// Lines of at least this many bytes are always read (commands such as `/image PATH`).
pub const MIN_LINE_BYTES: usize = 64 << 10;

/// Questions the editor remembers for the up arrow (in memory only: prompts are not written to
/// disk).
const HISTORY: usize = 1000;

/// One step of input.
#[derive(Debug, PartialEq)]
pub enum Input {
    Line(String),
    /// Ctrl-C at the prompt (what was typed is dropped).
    Interrupted,
    /// Ctrl-D, or the end of piped input.
    End,
    /// Line `n` of piped input was longer than the limit; it was read and dropped.
    TooLong(usize),
    /// Line `n` of piped input was not UTF-8; it was dropped.
    NotUtf8(usize),
}

/// The lines of a conversation.
pub enum Lines {
    /// A person at a terminal (stdin and stdout both terminals).
    Editor(Box<rustyline::DefaultEditor>),
    /// Anything else, read line by line within `max` bytes a line; `prompt` when stdin is a
    /// terminal but stdout is not (the prompt then goes to stderr).
    Plain {
        stdin: StdinLock<'static>,
        max: usize,
        prompt: bool,
        number: usize,
    },
}

impl Lines {
    /// The editor when a person is typing and can see the replies, plain lines otherwise;
    /// `max` bounds a line's bytes (a longer line is skipped as it is read, never held).
    pub fn open(max: usize) -> Result<Self> {
        let stdin = std::io::stdin();
        if stdin.is_terminal() && std::io::stdout().is_terminal() {
            let config = rustyline::Config::builder()
                .max_history_size(HISTORY)
                .map_err(editor_error)?
                .auto_add_history(true)
                .build();
            let editor = rustyline::DefaultEditor::with_config(config).map_err(editor_error)?;
            catch_ctrl_c()?;
            return Ok(Lines::Editor(Box::new(editor)));
        }
        Ok(Lines::Plain {
            prompt: stdin.is_terminal(),
            stdin: stdin.lock(),
            max,
            number: 0,
        })
    }

    /// Whether a person is typing (a prompt is shown, commands are acknowledged aloud).
    pub fn interactive(&self) -> bool {
        match self {
            Lines::Editor(_) => true,
            Lines::Plain { prompt, .. } => *prompt,
        }
    }

    pub fn next(&mut self) -> Result<Input> {
        match self {
            Lines::Editor(editor) => match editor.readline("> ") {
                Ok(line) => Ok(Input::Line(line)),
                Err(ReadlineError::Interrupted) => Ok(Input::Interrupted),
                Err(ReadlineError::Eof) => Ok(Input::End),
                Err(e) => Err(editor_error(e)),
            },
            Lines::Plain {
                stdin,
                max,
                prompt,
                number,
            } => {
                if *prompt {
                    eprint!("> ");
                }
                *number += 1;
                let read = read_line(stdin, *max)
                    .map_err(|e| Error::input(format!("reading stdin: {e}")))?;
                Ok(match read {
                    None => Input::End,
                    Some(Line::Text(line)) => Input::Line(line),
                    Some(Line::TooLong) => Input::TooLong(*number),
                    Some(Line::NotUtf8) => Input::NotUtf8(*number),
                })
            }
        }
    }
}

fn editor_error(e: impl std::fmt::Display) -> Error {
    Error::input(format!("the line editor: {e}"))
}

/// Set by SIGINT once [`catch_ctrl_c`] has run.
static CTRL_C: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// From now on SIGINT (Ctrl-C while a reply is written: the editor reads Ctrl-C at the prompt
/// as a key) sets a flag that [`ctrl_c_pressed`] reads, instead of ending the program.
fn catch_ctrl_c() -> Result<()> {
    let flag = CTRL_C.get_or_init(|| Arc::new(AtomicBool::new(false)));
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(flag))
        .map_err(|e| Error::io("<SIGINT handler>", e))?;
    Ok(())
}

/// Whether Ctrl-C was pressed since the last call (always false unless the editor is in use).
pub fn ctrl_c_pressed() -> bool {
    CTRL_C
        .get()
        .is_some_and(|f| f.swap(false, Ordering::Relaxed))
}

/// `piece` as it may be shown on a terminal: control characters other than newline and tab
/// (which could move the cursor, clear the screen or retitle the window) written as escapes.
pub fn printable(piece: &str) -> std::borrow::Cow<'_, str> {
    let shown = |c: char| !c.is_control() || c == '\n' || c == '\t';
    if piece.chars().all(shown) {
        return piece.into();
    }
    let mut out = String::with_capacity(piece.len() + 8);
    for c in piece.chars() {
        if shown(c) {
            out.push(c);
        } else {
            out.extend(c.escape_default());
        }
    }
    out.into()
}

/// One line of input.
#[derive(Debug, PartialEq)]
enum Line {
    Text(String),
    /// Longer than the limit: its bytes were read and dropped up to its end.
    TooLong,
    NotUtf8,
}

/// The next line of `input` (without its `\n`, or `\r\n`), holding at most `max` bytes of it
/// whatever its length; `None` at the end of input.
fn read_line(input: &mut impl BufRead, max: usize) -> std::io::Result<Option<Line>> {
    let mut line = Vec::new();
    let mut too_long = false;
    let mut any = false;
    loop {
        let buf = input.fill_buf()?;
        if buf.is_empty() {
            break;
        }
        any = true;
        let (chunk, ended) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], Some(i + 1)),
            None => (buf, None),
        };
        if !too_long {
            if line.len() + chunk.len() > max {
                too_long = true;
                line = Vec::new();
            } else {
                line.extend_from_slice(chunk);
            }
        }
        let used = ended.unwrap_or(buf.len());
        input.consume(used);
        if ended.is_some() {
            break;
        }
    }
    if !any {
        return Ok(None);
    }
    if too_long {
        return Ok(Some(Line::TooLong));
    }
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    Ok(Some(match String::from_utf8(line) {
        Ok(s) => Line::Text(s),
        Err(_) => Line::NotUtf8,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_read_within_their_limit_and_bad_ones_are_skipped() {
        let mut input: &[u8] = b"hi\r\n\xff\xfe\n0123456789\nlast";
        let text = |s: &str| Some(Line::Text(s.into()));
        assert_eq!(read_line(&mut input, 8).unwrap(), text("hi"));
        assert_eq!(read_line(&mut input, 8).unwrap(), Some(Line::NotUtf8));
        assert_eq!(read_line(&mut input, 8).unwrap(), Some(Line::TooLong));
        assert_eq!(read_line(&mut input, 8).unwrap(), text("last"));
        assert_eq!(read_line(&mut input, 8).unwrap(), None);
    }

    #[test]
    fn control_characters_are_escaped_for_a_terminal() {
        assert_eq!(printable("plain\ttext\n"), "plain\ttext\n");
        assert_eq!(printable("a\x1b[2Jb\r\x07"), "a\\u{1b}[2Jb\\r\\u{7}");
        assert_eq!(printable("\u{9b}31m"), "\\u{9b}31m");
    }
}
