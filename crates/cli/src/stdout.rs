//! Standard output that a closed pipe (`tessera info | head -1`) ends quietly.
//!
//! `println!` panics when the reader has gone; every command writes its results through
//! [`line`] (or maps its own write errors with [`error`]) instead, and `main` ends a run whose
//! error is a closed stdout without a word, as `cat` or `grep` would.

use std::fmt;
use std::io::Write;

use tessera_core::Error;

/// How stdout is named in errors, and how [`is_closed_pipe`] recognises it.
const STDOUT: &str = "<stdout>";

/// A write error on stdout.
pub fn error(e: std::io::Error) -> Error {
    Error::io(STDOUT, e)
}

/// Write one line to stdout and flush it.
pub fn line(args: fmt::Arguments<'_>) -> tessera_core::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush())
        .map_err(error)
}

/// Whether `e` says stdout's reader has gone (its pipe closed): the run ends quietly.
pub fn is_closed_pipe(e: &Error) -> bool {
    matches!(e, Error::Io { path, source }
        if path.as_os_str() == STDOUT && source.kind() == std::io::ErrorKind::BrokenPipe)
}

/// `println!` that returns a [`tessera_core::Result`] instead of panicking on a closed pipe.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::stdout::line(format_args!($($arg)*))
    };
}
pub(crate) use outln;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_closed_stdout_is_quiet() {
        let broken = || std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        assert!(is_closed_pipe(&error(broken())));
        assert!(!is_closed_pipe(&Error::io("out.jsonl", broken())));
        assert!(!is_closed_pipe(&error(std::io::Error::from(
            std::io::ErrorKind::PermissionDenied
        ))));
    }
}
