//! `tessera`: multimodal inference from a model's Hugging Face files (a folder, or a repo id
//! downloaded into the Hugging Face cache on first use).
//!
//! Every failure is one line on stderr and a non-zero exit; usage errors exit with 2.

mod bench;
mod chat;
mod device;
mod embed;
mod generate;
mod info;
mod input;
mod loadtest;
mod loadtest_images;
mod model;
mod noise;
mod output;
mod pull;
mod sampling;
mod serve;
mod signals;
mod stdout;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Multimodal inference engine: embeddings, image generation and visual chat"
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
    /// Ask a vision-language model (LFM2-VL) about images; the answer streams to stdout.
    Chat(Box<chat::ChatArgs>),
    /// Describe a model and what it will run on.
    Info(info::InfoArgs),
    /// Generate an image from a prompt with Z-Image or Qwen-Image-2.1 (PNG, JPEG or WebP out).
    Generate(generate::GenerateArgs),
    /// Serve one or several models over HTTP: OpenAI-compatible /v1/embeddings,
    /// /v1/chat/completions and /v1/images/generations.
    Serve(Box<serve::ServeArgs>),
    /// Measure throughput and latency (see BENCHMARKS.md).
    Bench(bench::BenchArgs),
    /// Download a model from the Hugging Face hub into its cache (only the files Tessera
    /// needs); prints the snapshot folder.
    Pull(pull::PullArgs),
}

/// `--threads` beyond this many per core only adds overhead (each thread a stack, every
/// parallel loop a split per thread): `--threads 100000` used to stall starting them.
const THREADS_PER_CORE: usize = 4;

fn capped_threads(asked: usize, cores: usize) -> usize {
    asked.min(THREADS_PER_CORE * cores.max(1))
}

fn main() -> ExitCode {
    // Kept for `embed --combine`, which orders parts as they appear on the command line.
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Some(asked) = cli.threads {
        if asked == 0 {
            eprintln!("error: --threads must be at least 1");
            return ExitCode::from(2);
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let n = capped_threads(asked, cores);
        if n < asked {
            eprintln!(
                "warning: --threads {asked} is more than {THREADS_PER_CORE}× this machine's {cores} cores, which only adds overhead; using {n}"
            );
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
        Command::Chat(args) => chat::run(*args),
        Command::Serve(args) => serve::run(*args),
        Command::Bench(args) => bench::run(args),
        Command::Pull(args) => pull::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader has what it wanted (`| head`): nothing to say.
        Err(e) if stdout::is_closed_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn threads_are_capped_at_a_multiple_of_the_cores() {
        assert_eq!(super::capped_threads(3, 2), 3);
        assert_eq!(super::capped_threads(8, 2), 8);
        assert_eq!(super::capped_threads(100_000, 2), 8);
        assert_eq!(super::capped_threads(5, 0), 4);
    }
}
