//! SIGINT (Ctrl-C) and SIGTERM, for the commands that must clean up or finish when stopped.

use std::future::Future;

/// Listen for SIGINT and SIGTERM from now on (within a Tokio runtime with I/O enabled): the
/// future ends at the first one with the exit status a shell gives a process that signal killed
/// (130 or 143). Registering before returning means no signal is missed once this returns.
pub fn interrupted() -> std::io::Result<impl Future<Output = i32>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        Ok(async move {
            tokio::select! {
                _ = int.recv() => 130,
                _ = term.recv() => 143,
            }
        })
    }
    #[cfg(not(unix))]
    {
        let ctrl_c = tokio::signal::ctrl_c();
        Ok(async move {
            let _ = ctrl_c.await;
            130
        })
    }
}
