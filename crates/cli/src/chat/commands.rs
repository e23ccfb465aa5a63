//! What a line typed into `tessera chat` asks for: a question, or one of the slash commands.

/// One line of a conversation, understood.
#[derive(Debug, PartialEq, Eq)]
pub enum Command<'a> {
    /// A question for the model.
    Ask(&'a str),
    /// Attach the image at this path to the next question.
    Image(&'a str),
    /// Forget the conversation.
    Reset,
    /// List the commands.
    Help,
    /// Leave.
    Quit,
}

/// The commands, as `/help` and `chat --help` list them.
pub const HELP: &str = "\
/image PATH  attach an image to the next question (repeat for several)
/reset       forget the conversation and start over
/help        list these commands
/quit        leave (also /exit, Ctrl-D, or Ctrl-C twice at an empty prompt)
Ctrl-C while a reply is written stops it; the conversation keeps what was said.";

/// `line` understood: `Ok(None)` for a blank line, `Err` with what to say for a command used
/// wrongly (it is not sent to the model as a question).
pub fn parse(line: &str) -> Result<Option<Command<'_>>, String> {
    let line = line.trim();
    if line.is_empty() {
        return Ok(None);
    }
    let Some(rest) = line.strip_prefix('/') else {
        return Ok(Some(Command::Ask(line)));
    };
    let (name, arg) = match rest.split_once(char::is_whitespace) {
        Some((name, arg)) => (name, arg.trim()),
        None => (rest, ""),
    };
    let bare = |c: Command<'static>| {
        if arg.is_empty() {
            Ok(Some(c))
        } else {
            Err(format!("/{name} takes nothing after it"))
        }
    };
    match name {
        "quit" | "exit" => bare(Command::Quit),
        "reset" => bare(Command::Reset),
        "help" | "?" => bare(Command::Help),
        "image" if arg.is_empty() => {
            Err("/image needs the path of an image: /image PATH".to_string())
        }
        "image" => Ok(Some(Command::Image(arg))),
        // A word after the slash is a command mistyped; anything else (`/usr/bin?`, `/ 2`) is
        // a question that happens to start with one.
        _ if !name.is_empty() && name.chars().all(|c| c.is_ascii_alphabetic()) => {
            Err(format!("unknown command /{name}; /help lists the commands"))
        }
        _ => Ok(Some(Command::Ask(line))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_understood_and_misused_ones_are_errors_not_questions() {
        assert_eq!(parse("  "), Ok(None));
        assert_eq!(
            parse(" what is this? "),
            Ok(Some(Command::Ask("what is this?")))
        );
        assert_eq!(parse("/quit"), Ok(Some(Command::Quit)));
        assert_eq!(parse("/exit"), Ok(Some(Command::Quit)));
        assert_eq!(parse("/reset"), Ok(Some(Command::Reset)));
        assert_eq!(parse("/help"), Ok(Some(Command::Help)));
        assert_eq!(
            parse("/image  a b.png "),
            Ok(Some(Command::Image("a b.png")))
        );
        assert!(parse("/image").unwrap_err().contains("/image PATH"));
        assert!(parse("/image   ").unwrap_err().contains("/image PATH"));
        assert!(parse("/imgae x.png").unwrap_err().contains("/help"));
        assert!(parse("/reset now").is_err());
        assert_eq!(
            parse("/usr/bin holds what?"),
            Ok(Some(Command::Ask("/usr/bin holds what?")))
        );
    }
}
