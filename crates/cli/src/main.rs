//! `tessera`: multimodal inference from the Hugging Face files you already have.
//!
//! Every failure is one line on stderr and a non-zero exit; usage errors exit with 2.

mod bench;
mod device;
mod embed;
mod generate;
mod info;
mod input;
mod loadtest;
mod model;
mod output;
mod serve;
mod signals;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Multimodal inference engine: embeddings and image generation"
)]
struct Cli {
    /// CPU threads for the reference backend (default: all cores).
    #[arg(long, global = true, env = "TESSERA_THREADS")]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Embed texts and images with EmbeddingGemma 2 (JSON lines or .npy out).
    Embed(Box<embed::EmbedArgs>),
    /// Describe a model and what it will run on.
    Info(info::InfoArgs),
    /// Generate an image from a prompt with Z-Image (PNG out).
    Generate(generate::GenerateArgs),
    /// Serve embeddings over HTTP (OpenAI-compatible /v1/embeddings).
    Serve(Box<serve::ServeArgs>),
    /// Measure throughput and latency (see BENCHMARKS.md).
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    // Kept for `embed --combine`, which orders parts as they appear on the command line.
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Some(n) = cli.threads {
        if n == 0 {
            eprintln!("error: --threads must be at least 1");
            return ExitCode::from(2);
        }
        if let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
        {
            eprintln!("error: could not start {n} threads: {e}");
            return ExitCode::FAILURE;
        }
    }
    let result = match cli.command {
        Command::Embed(args) => embed::run(*args, matches.subcommand_matches("embed")),
        Command::Info(args) => info::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Serve(args) => serve::run(*args),
        Command::Bench(args) => bench::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
