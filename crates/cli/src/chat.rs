//! `tessera chat`: look at images and answer (LFM2-VL), the reply streamed to stdout.
//!
//! With `--prompt`, one question and its answer. Without, a conversation read from stdin, one
//! user turn per line, that keeps its cache between turns: each follow-up prefills only what it
//! adds. At a terminal the lines come through a line editor (editing, history) and Ctrl-C stops
//! a reply; the commands (`/image PATH`, `/reset`, `/help`, `/quit`) are in [`commands`].

mod commands;
mod input;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use tessera_core::{Error, Result};
use tessera_models::chat_family::CacheShape;
use tessera_models::chat_template::{Message, Part};
use tessera_models::imageproc::{Image, read_file};
use tessera_runtime::Capability;
use tessera_runtime::chat::{self, Chat, ChatOptions, ChatReply, GenerationParams};
use tessera_runtime::decode::{Control, Finish, SamplingParams};

use self::commands::Command;
use self::input::{Input, Lines};
use crate::device::DeviceArgs;
use crate::model;
use crate::sampling::SamplingArgs;

/// Ask a vision-language model (LFM2-VL) about images; the answer streams to stdout.
#[derive(clap::Args, Debug)]
#[command(after_help = after_help())]
pub struct ChatArgs {
    /// An LFM2-VL folder (config.json, model.safetensors, tokenizer.json, chat_template.jinja,
    /// preprocessor_config.json), a folder of its GGUF files (the language model and its
    /// mmproj-*.gguf, as llama.cpp takes them) or a Hugging Face repo id, downloaded on first
    /// use. Without it,
    /// the bundled miniature model runs: random weights, for checking an install.
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// An image for the (first) question; repeat for several, in order.
    #[arg(long = "image", value_name = "PATH")]
    pub images: Vec<PathBuf>,
    /// The question. Without it, an interactive conversation on stdin.
    #[arg(long, short = 'p')]
    pub prompt: Option<String>,
    /// A system message before the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// End the reply before this text; repeat for several.
    #[arg(long = "stop", value_name = "TEXT")]
    pub stops: Vec<String>,
    /// Most tokens a conversation holds (prompt, images and replies); its cache is sized for
    /// this. Default: 8192 or the model's limit if lower.
    #[arg(long, default_value_t = 8192)]
    pub context: usize,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// The text after `chat --help`'s options: where the defaults come from and the commands of a
/// conversation.
fn after_help() -> String {
    format!(
        "Sampling defaults come from the model's generation_config.json (greedy when it has none); \
each flag overrides its own. Statistics (tokens, speed) go to stderr.\n\n\
In a conversation (no --prompt), each line is a question, or one of:\n{}",
        commands::HELP
    )
}

impl ChatArgs {
    fn params(&self, defaults: SamplingParams) -> Result<GenerationParams> {
        if self.max_tokens == 0 {
            return Err(Error::input("--max-tokens must be at least 1"));
        }
        Ok(GenerationParams {
            sampling: self.sampling.params(defaults)?,
            max_tokens: self.max_tokens,
            stop: self.stops.clone(),
        })
    }
}

fn open_image(path: &std::path::Path) -> Result<Image> {
    let bytes = read_file(path)?;
    Image::decode(&bytes).map_err(|e| Error::input(format!("{}: {e}", path.display())))
}

/// A user turn of `text` after `images`.
fn user_turn(text: &str, images: usize) -> Message {
    let mut parts = vec![Part::Image; images];
    parts.push(Part::Text { text: text.into() });
    Message::parts("user", parts)
}

/// Ask, stream the reply to stdout, and return it.
fn ask(
    model: &mut dyn Chat,
    messages: &[Message],
    images: &[Image],
    params: &GenerationParams,
) -> Result<ChatReply> {
    let prompt = model.prompt(messages, images)?;
    let started = Instant::now();
    let mut out = std::io::stdout().lock();
    let mut broken = false;
    let escape = out.is_terminal();
    let reply = model.reply(0, prompt, params, &mut |piece| {
        if input::ctrl_c_pressed() {
            return Control::Stop;
        }
        let piece = if escape {
            input::printable(piece)
        } else {
            piece.into()
        };
        // A closed pipe (`| head`) ends the reply quietly.
        if out
            .write_all(piece.as_bytes())
            .and_then(|_| out.flush())
            .is_err()
        {
            broken = true;
            return Control::Stop;
        }
        Control::Continue
    })?;
    if !broken {
        let _ = writeln!(out);
    }
    let secs = started.elapsed().as_secs_f64();
    let why = match reply.finish {
        Finish::Eos => "end of turn",
        Finish::Length => "token limit",
        Finish::Stopped => "stopped",
    };
    eprintln!(
        "[{} prompt tokens ({} from the cache), {} generated in {:.2} s, {:.1} tokens/s; {why}]",
        reply.prompt_tokens,
        reply.cached_tokens,
        reply.completion_tokens,
        secs,
        reply.completion_tokens as f64 / secs.max(1e-9)
    );
    Ok(reply)
}

pub fn run(args: ChatArgs) -> Result<()> {
    // Settings and images are checked before anything loads, so a mistake fails at once (the
    // sampling defaults the checkpoint fills in are checked again once it is read).
    args.params(SamplingParams::default())?;
    let images = args
        .images
        .iter()
        .map(|p| open_image(p))
        .collect::<Result<Vec<_>>>()?;
    let spec = model::open(args.model.as_deref(), Capability::Chat)?;
    let backend = args.device.open_for(&spec)?;
    let cache = CacheShape {
        slots: 1,
        ctx: args.context.max(1),
    };
    let mut model = chat::load(backend, &spec, cache, ChatOptions::default())?;
    let params = args.params(model.default_sampling())?;
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(Message::new("system", s));
    }
    if let Some(q) = &args.prompt {
        messages.push(user_turn(q, images.len()));
        ask(model.as_mut(), &messages, &images, &params)?;
        model::note_if_bundled(&spec, args.model.as_deref());
        return Ok(());
    }
    // A line longer than any prompt the context can hold is skipped as it is read, never held.
    let max_line = model
        .max_prompt_chars()
        .saturating_mul(4)
        .max(input::MIN_LINE_BYTES);
    let mut lines = Lines::open(max_line)?;
    let interactive = lines.interactive();
    if interactive {
        eprintln!(
            "{} on {}. One question per line; /help lists the commands, /quit (or Ctrl-D) leaves.",
            spec.label,
            model.describe()
        );
    }
    let mut all_images = Vec::new();
    let mut pending = images;
    let base = messages.len();
    // Ctrl-C at the prompt once says how to leave; twice in a row leaves.
    let mut interrupted = false;
    loop {
        let line = match lines.next()? {
            Input::End => break,
            Input::Interrupted if interrupted => break,
            Input::Interrupted => {
                interrupted = true;
                eprintln!("(Ctrl-C again, Ctrl-D or /quit leaves)");
                continue;
            }
            Input::TooLong(number) => {
                eprintln!(
                    "error: line {number} is longer than {max_line} bytes, more than the context can hold ({} characters of text); skipped",
                    model.max_prompt_chars()
                );
                continue;
            }
            Input::NotUtf8(number) => {
                eprintln!("error: line {number} is not valid UTF-8; skipped");
                continue;
            }
            Input::Line(line) => line,
        };
        interrupted = false;
        let question = match commands::parse(&line) {
            Ok(None) => continue,
            Ok(Some(Command::Ask(q))) => q,
            Ok(Some(Command::Quit)) => break,
            Ok(Some(Command::Help)) => {
                eprintln!("{}", commands::HELP);
                continue;
            }
            Ok(Some(Command::Reset)) => {
                messages.truncate(base);
                all_images.clear();
                pending.clear();
                model.end(0);
                eprintln!("[conversation cleared]");
                continue;
            }
            Ok(Some(Command::Image(path))) => {
                match open_image(std::path::Path::new(path)) {
                    Ok(im) => {
                        eprintln!(
                            "[{path}: {}x{}, attached to the next question]",
                            im.width(),
                            im.height()
                        );
                        pending.push(im);
                    }
                    Err(e) => eprintln!("error: {e}"),
                }
                continue;
            }
            Err(e) => {
                eprintln!("error: {e}");
                continue;
            }
        };
        // A Ctrl-C pressed before this question does not stop its reply.
        input::ctrl_c_pressed();
        messages.push(user_turn(question, pending.len()));
        all_images.append(&mut pending);
        match ask(model.as_mut(), &messages, &all_images, &params) {
            Ok(reply) => messages.push(Message::new("assistant", &reply.text)),
            Err(e) => {
                // The turn is dropped; the conversation goes on without it.
                eprintln!("error: {e}");
                let m = messages.pop();
                if let Some(m) = m {
                    let n = m.images();
                    all_images.truncate(all_images.len() - n);
                }
            }
        }
    }
    model::note_if_bundled(&spec, args.model.as_deref());
    Ok(())
}
