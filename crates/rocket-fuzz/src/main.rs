//! `rocket-fuzz`: a deterministic mutation fuzzer for rocket's model loaders
//! (safetensors, GGUF, config.json / generation_config.json) and chat-template
//! rendering, runnable on stable Rust. See the README's "Testing" section.
//!
//! ```text
//! rocket-fuzz <target|all> [--iters N] [--seed S] [--corpus DIR] [--time-limit SECS]
//!             [--input-timeout-ms MS] [--mem-limit-mb MB] [--crash-dir DIR] [--stack-kb KB]
//! rocket-fuzz replay <target> FILE...
//! rocket-fuzz make-seeds DIR [--smollm2 GGUF] [--tokenizer-config JSON]...
//! ```
//! Targets: safetensors, gguf, config, chat-template. Exit status 1 when any
//! input panicked, crashed the worker or hung.

mod mutate;
mod runner;
mod seeds;
mod targets;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use runner::{Settings, WorkerArgs};
use targets::Target;

const USAGE: &str = "usage:
  rocket-fuzz <target|all> [--iters N] [--seed S] [--corpus DIR] [--time-limit SECS]
              [--input-timeout-ms MS] [--mem-limit-mb MB] [--crash-dir DIR] [--stack-kb KB]
              [--selftest hang|abort|panic]   (checks the harness: iteration 1 misbehaves)
  rocket-fuzz replay <target> FILE...
  rocket-fuzz make-seeds DIR [--smollm2 GGUF] [--tokenizer-config JSON]...
targets: safetensors, gguf, config, chat-template
defaults: --iters 100000 --seed 0 --corpus <crate>/corpus --time-limit 600 (per target)
          --input-timeout-ms 2000 --mem-limit-mb 4096 --crash-dir fuzz-findings --stack-kb 2048";

fn default_corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

struct Args {
    positional: Vec<String>,
    settings: Settings,
    from: u64,
    to: u64,
    deadline_secs: f64,
    shm: Option<PathBuf>,
    smollm2: Option<PathBuf>,
    tokenizer_configs: Vec<PathBuf>,
}

fn parse(argv: &[String]) -> Result<Args, String> {
    let mut a = Args {
        positional: Vec::new(),
        settings: Settings {
            iters: 100_000,
            seed: 0,
            corpus: default_corpus(),
            time_limit: 600.0,
            input_timeout_ms: 2000,
            mem_limit_mb: 4096,
            crash_dir: PathBuf::from("fuzz-findings"),
            stack_kb: 2048,
            selftest: None,
        },
        from: 0,
        to: 0,
        deadline_secs: 0.0,
        shm: None,
        smollm2: None,
        tokenizer_configs: Vec::new(),
    };
    let mut it = argv.iter();
    while let Some(arg) = it.next() {
        if !arg.starts_with("--") {
            a.positional.push(arg.clone());
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{arg} needs a value"))?;
        let num = |what: &str| value.parse::<u64>().map_err(|_| format!("{what} must be a non-negative integer, got {value:?}"));
        let s = &mut a.settings;
        match arg.as_str() {
            "--iters" => s.iters = num("--iters")?,
            "--seed" => s.seed = num("--seed")?,
            "--corpus" => s.corpus = PathBuf::from(value),
            "--time-limit" => {
                s.time_limit = value
                    .parse::<f64>()
                    .ok()
                    .filter(|t| *t > 0.0 && t.is_finite())
                    .ok_or_else(|| format!("--time-limit must be a positive number of seconds, got {value:?}"))?
            }
            "--input-timeout-ms" => s.input_timeout_ms = num("--input-timeout-ms")?.max(1),
            "--mem-limit-mb" => s.mem_limit_mb = num("--mem-limit-mb")?,
            "--crash-dir" => s.crash_dir = PathBuf::from(value),
            "--stack-kb" => s.stack_kb = (num("--stack-kb")? as usize).max(64),
            "--selftest" => s.selftest = Some(runner::SelfTest::parse(value).ok_or("--selftest takes hang, abort or panic")?),
            "--from" => a.from = num("--from")?,
            "--to" => a.to = num("--to")?,
            "--deadline-secs" => a.deadline_secs = value.parse().map_err(|_| "--deadline-secs".to_string())?,
            "--shm" => a.shm = Some(PathBuf::from(value)),
            "--smollm2" => a.smollm2 = Some(PathBuf::from(value)),
            "--tokenizer-config" => a.tokenizer_configs.push(PathBuf::from(value)),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(a)
}

fn target(name: &str) -> Result<Vec<Target>, String> {
    if name == "all" {
        return Ok(targets::ALL.to_vec());
    }
    Target::parse(name).map(|t| vec![t]).ok_or_else(|| format!("unknown target {name:?}"))
}

fn run(argv: &[String]) -> Result<bool, String> {
    let a = parse(argv)?;
    let Some(cmd) = a.positional.first() else { return Err("no target given".into()) };
    match cmd.as_str() {
        "__worker" => {
            let t = target(a.positional.get(1).ok_or("worker needs a target")?)?[0];
            let shm = a.shm.clone().ok_or("worker needs --shm")?;
            let w = WorkerArgs { target: t, from: a.from, to: a.to, deadline_secs: a.deadline_secs, shm };
            runner::worker(&a.settings, &w).map_err(|e| e.to_string())?;
            Ok(true)
        }
        "replay" => {
            let t = target(a.positional.get(1).ok_or("replay needs a target")?)?[0];
            let files: Vec<PathBuf> = a.positional[2..].iter().map(PathBuf::from).collect();
            let panics = runner::replay(&a.settings, t, &files).map_err(|e| e.to_string())?;
            Ok(panics == 0)
        }
        "make-seeds" => {
            let out = PathBuf::from(a.positional.get(1).ok_or("make-seeds needs an output folder")?);
            let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
            let configs: Vec<&Path> = a.tokenizer_configs.iter().map(PathBuf::as_path).collect();
            let n = seeds::make_seeds(&out, &repo, a.smollm2.as_deref(), &configs).map_err(|e| e.to_string())?;
            println!("wrote {n} seed files under {}", out.display());
            Ok(true)
        }
        name => {
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            let mut clean = true;
            println!("{:<14} {:>11} {:>9} {:>10} {:>10} {:>7} {:>7} {:>6} {:>7}", "target", "inputs", "seconds", "inputs/s", "errors", "panics", "crashes", "hangs", "corpus");
            for t in target(name)? {
                let r = runner::supervise(&exe, &a.settings, t).map_err(|e| format!("{}: {e}", t.name()))?;
                println!(
                    "{:<14} {:>11} {:>9.1} {:>10.0} {:>10} {:>7} {:>7} {:>6} {:>7}",
                    t.name(),
                    r.inputs,
                    r.seconds,
                    r.inputs as f64 / r.seconds.max(1e-9),
                    r.errors,
                    r.panics,
                    r.crashes,
                    r.hangs,
                    r.corpus
                );
                let kinds: Vec<String> = r.error_kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
                println!("    outcomes: {}", kinds.join(", "));
                for f in &r.findings {
                    println!("    FINDING {}", f.display());
                }
                clean &= r.bugs() == 0;
            }
            Ok(clean)
        }
    }
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.is_empty() || argv.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    match run(&argv) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("rocket-fuzz: {e}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}
