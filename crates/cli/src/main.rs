//! `tessera`: multimodal inference from the Hugging Face files you already have.
//!
//! Every failure is one line on stderr and a non-zero exit; usage errors exit with 2.

mod bench;
mod device;
mod embed;
mod info;
mod input;
mod model;
mod output;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    /// Embed texts with EmbeddingGemma 2 (JSON lines or .npy out).
    Embed(embed::EmbedArgs),
    /// Describe a model and what it will run on.
    Info(info::InfoArgs),
    /// Measure throughput and latency (see BENCHMARKS.md).
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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
        Command::Embed(args) => embed::run(args),
        Command::Info(args) => info::run(args),
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
