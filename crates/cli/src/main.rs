//! `tessera`: the command-line front end. One module per subcommand.

mod generate;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Multimodal inference: embeddings and text-to-image"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Generate(generate::GenerateArgs),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Generate(args) => generate::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
