//! `rocket bench`: llama-bench-style figures for one model — load time, TTFT,
//! prefill tokens/s, decode ms per step at each batch size, effective GB/s and
//! its share of the copy bandwidth measured in the same process — as a table
//! (printed last) and optionally as JSON with the date, commit, GPU and command.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use rocket_core::{Engine, EngineRequest, RequestKind, SamplingOptions, SamplingParams};
use serde_json::json;

use crate::sampling_args::SamplingArgs;
use crate::ModelArgs;

#[derive(clap::Args)]
#[command(after_help = "The last column is the CPU time the host thread spends per decoded token while a GPU \
decodes (scheduling, launches, polling); on the CPU backend that thread does the computing itself, so the column \
shows \"-\" (null in --json).")]
#[command(mut_arg("seed", |a| a.help("Seed for sampling (same seed, same output) [default: 1234]")))]
#[command(mut_arg("temperature", |a| a.help("0 = greedy (below 1e-5 too) [default: 0; bench ignores generation_config]")))]
#[command(mut_arg("top_k", |a| a.help("Keep the k most likely tokens, 0 or -1 = off [default: 0]")))]
#[command(mut_arg("top_p", |a| a.help("Nucleus sampling threshold in (0, 1] [default: 1]")))]
#[command(mut_arg("repetition_penalty", |a| a.help("Penalise tokens already seen: a positive logit is divided by it, a negative one multiplied (HF's rule); > 0, 1 = off [default: 1]")))]
#[command(mut_arg("stop", |a| a.hide(true)))]
#[command(mut_arg("stop_token_ids", |a| a.hide(true)))]
#[command(mut_arg("ignore_eos", |a| a.hide(true)))]
#[command(mut_arg("logprobs", |a| a.help("Compute each token's log-probability and this many alternatives, 0..=20 (timed, not printed)")))]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Batch sizes, comma separated
    #[arg(long, default_value = "1", value_delimiter = ',')]
    batch: Vec<usize>,
    /// Prompt lengths in tokens, comma separated (random ids, seeded): each is
    /// timed at every batch size, with its own table
    #[arg(long, default_value = "128", value_delimiter = ',')]
    prompt_len: Vec<usize>,
    /// Tokens generated per sequence (EOS ignored)
    #[arg(long, default_value_t = 256)]
    gen_len: usize,
    /// Sampling, as for `generate`, except: unset flags are off (greedy, no
    /// filters; not the model's generation_config), unset --seed is 1234, and EOS
    /// is always ignored (every sequence runs to --gen-len, so --stop and
    /// --stop-token-ids are refused)
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Timed repetitions per batch size (after one warm-up)
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Also write the results as JSON to FILE
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also time prefix reuse: a first request of N prompt tokens fills the
    /// prefix cache, then the TTFT of a second one, the same N tokens followed
    /// by --prompt-len new ones (its first length), with its whole blocks reused, against the same
    /// prompt with the cache emptied (e.g. --prefix-reuse 4000 --prompt-len 100:
    /// a chat turn over a 4,000-token conversation). On the GPU a reuse leaves the
    /// second request at least 128 tokens to compute, and a prompt shorter than
    /// 512 tokens is neither cached nor reuses a cached one
    #[arg(long, value_name = "N")]
    prefix_reuse: Option<usize>,
}

/// An f32 setting as the user wrote it (0.8, not its f64 widening 0.800000011920929).
fn as_typed(v: f32) -> f64 {
    v.to_string().parse().unwrap_or(v as f64)
}

/// The sampling settings of a report: temperature, top_p and top_k always, the
/// other fields when they are on.
fn sampling_report(p: &SamplingParams) -> serde_json::Value {
    let mut r = json!({ "temperature": as_typed(p.temperature), "top_p": as_typed(p.top_p), "top_k": p.top_k });
    let extra = [
        ("min_p", p.min_p != 0.0, json!(as_typed(p.min_p))),
        ("repetition_penalty", p.repetition_penalty != 1.0, json!(as_typed(p.repetition_penalty))),
        ("presence_penalty", p.presence_penalty != 0.0, json!(as_typed(p.presence_penalty))),
        ("frequency_penalty", p.frequency_penalty != 0.0, json!(as_typed(p.frequency_penalty))),
        ("min_tokens", p.min_tokens != 0, json!(p.min_tokens)),
        ("logprobs", p.logprobs.is_some(), json!(p.logprobs)),
        ("stop", !p.stop.is_empty(), json!(p.stop)),
        ("stop_token_ids", !p.stop_token_ids.is_empty(), json!(p.stop_token_ids)),
    ];
    for (name, on, v) in extra {
        if on {
            r[name] = v;
        }
    }
    r
}

/// mean ± std of repeated timings.
fn stats(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 { xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
}

/// Seeded prompt ids spread over the vocabulary (splitmix64).
fn random_prompt(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state.wrapping_add(0x9e3779b97f4a7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
            z ^= z >> 31;
            // Skip the top of the range, where special tokens usually live.
            (z % (vocab as u64 * 9 / 10)) as u32
        })
        .collect()
}

/// CPU time of the calling thread in seconds (the engine drives the device from it).
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes one timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// One timed run of `batch` requests together.
struct Run {
    ttft: f64,
    /// Seconds per decode step.
    step: f64,
    /// Host CPU seconds per decoded token (this thread): the run's CPU time less
    /// a prefill-only run's, over the tokens after the first.
    host_cpu_per_token: f64,
}

fn run_batch(engine: &Engine, prompts: &[Vec<u32>], gen_len: usize, sampling: &SamplingParams) -> anyhow::Result<Run> {
    let params = SamplingParams { max_tokens: gen_len, ..sampling.clone() };
    // Every run prefills its whole prompts: the bench repeats them, and the prefix
    // cache would otherwise serve the repeats (that case is `--prefix-reuse`'s).
    engine.clear_prefix_cache();
    let requests = |max_tokens| prompts.iter().map(|p| EngineRequest { prompt: String::new(), prompt_ids: p.clone(), params: SamplingParams { max_tokens, ..params.clone() } }).collect();
    // The prefill (and first token) alone, so the decode's host CPU time can be told apart.
    let cpu = thread_cpu_seconds();
    engine.generate_many(requests(1))?;
    let prefill_cpu = thread_cpu_seconds() - cpu;
    engine.clear_prefix_cache();
    let cpu = thread_cpu_seconds();
    let outs = engine.generate_many(requests(gen_len))?;
    let decoded = (prompts.len() * gen_len.saturating_sub(1)).max(1) as f64;
    let host_cpu_per_token = ((thread_cpu_seconds() - cpu) - prefill_cpu).max(0.0) / decoded;
    let m = &outs[0].metrics;
    if outs.iter().any(|o| o.token_ids.len() != gen_len) {
        bail!("a sequence stopped before gen_len");
    }
    let steps = gen_len.saturating_sub(1).max(1) as f64;
    Ok(Run { ttft: m.time_to_first_token, step: (m.total_seconds - m.time_to_first_token) / steps, host_cpu_per_token })
}

/// The prefix-reuse case: TTFT of a prompt whose first `shared` tokens were
/// another's, with (`reused` of them from the cache) and without reuse.
struct PrefixRow {
    shared: usize,
    new: usize,
    reused: usize,
    ttft: (f64, f64),
    ttft_no_reuse: (f64, f64),
}

fn prefix_case(engine: &Engine, shared: usize, new: usize, vocab: usize, sampling: &SamplingParams, reps: usize) -> anyhow::Result<PrefixRow> {
    let first = random_prompt(2000, shared, vocab);
    let second: Vec<u32> = first.iter().copied().chain(random_prompt(2001, new, vocab)).collect();
    let params = SamplingParams { max_tokens: 1, ..sampling.clone() };
    let ttft_of = |ids: &Vec<u32>| -> anyhow::Result<(f64, usize)> {
        let out = engine.generate_ids(String::new(), ids.clone(), &params, &mut |_| true)?;
        Ok((out.metrics.time_to_first_token, out.metrics.cached_prompt_tokens))
    };
    let (mut with, mut without, mut reused) = (Vec::new(), Vec::new(), 0);
    // Two warm-up rounds: a prompt pass's shape records its graph at its second pass
    // (`prompt_graphs`), as decode graphs record theirs at their first.
    const WARM_UP: usize = 2;
    for rep in 1 - WARM_UP as isize..=reps as isize {
        engine.clear_prefix_cache();
        ttft_of(&first)?;
        let (t, r) = ttft_of(&second)?;
        engine.clear_prefix_cache();
        let (t0, _) = ttft_of(&second)?;
        if rep <= 0 {
            continue;
        }
        note!("bench: prefix reuse rep {rep}/{reps}: ttft {:.2} ms with {r} tokens reused, {:.2} ms without", t * 1e3, t0 * 1e3);
        with.push(t);
        without.push(t0);
        reused = r;
    }
    engine.clear_prefix_cache();
    if reused == 0 {
        let rows = engine.prefix_reuse_rows();
        note!(
            "bench: nothing was reused: the cache keeps whole blocks of {} tokens of prompts of at least {} tokens, and a request reusing them computes at least {} itself (--prefix-reuse {shared}, --prompt-len {new})",
            engine.prefix_cache_limits().1,
            rows.first,
            rows.later
        );
    }
    let ms = |(m, s): (f64, f64)| (m * 1e3, s * 1e3);
    Ok(PrefixRow { shared, new, reused, ttft: ms(stats(&with)), ttft_no_reuse: ms(stats(&without)) })
}

struct Row {
    prompt_len: usize,
    batch: usize,
    path: &'static str,
    /// None on the CPU backend, where the host thread is the one computing.
    host_us_per_token: Option<f64>,
    ttft: (f64, f64),
    prefill_tps: f64,
    step_ms: (f64, f64),
    tokens_per_s: f64,
    gbs: f64,
    pct_copy: Option<f64>,
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    if args.batch.is_empty() || args.batch.contains(&0) {
        bail!("--batch needs sizes of at least 1");
    }
    if args.prompt_len.is_empty() || args.prompt_len.contains(&0) || args.gen_len < 2 || args.reps == 0 {
        bail!("--prompt-len must be >= 1, --gen-len >= 2 and --reps >= 1");
    }
    if !args.sampling.stop.is_empty() || !args.sampling.stop_token_ids.is_empty() {
        bail!("--stop and --stop-token-ids do not apply to bench: every sequence runs to --gen-len");
    }
    crate::check_given(&SamplingOptions { max_tokens: Some(args.gen_len), ..args.sampling.options() })?;
    // The report's file is opened before the work, so a bad path fails at once,
    // and removed if the work fails, so no empty report is left behind.
    let json_out = match &args.json {
        Some(path) => Some((path, std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?)),
        None => None,
    };
    let json_path = json_out.as_ref().map(|(path, _)| path.to_path_buf());
    let result = run_with(args, json_out);
    if let (Err(_), Some(path)) = (&result, json_path) {
        let _ = std::fs::remove_file(path);
    }
    result
}

fn run_with(args: &BenchArgs, json_out: Option<(&PathBuf, std::fs::File)>) -> anyhow::Result<()> {
    let first_len = args.prompt_len[0];
    let t = Instant::now();
    let engine = args.model.load().context("loading the model")?;
    let load_s = t.elapsed().as_secs_f64();
    if args.prefix_reuse.is_some() && engine.prefix_cache_limits().0 == 0 {
        bail!("--prefix-reuse needs the prefix cache (--prefix-cache-bytes above 0)");
    }
    let info = engine.info().clone();
    let copy_gbs = engine.copy_bandwidth_gbs()?;
    let device = engine.device_description();
    note!("bench: {} on {device}, load {load_s:.3} s", info.path.display());
    let vocab = info.spec.vocab_size.min(info.tokenizer_size.max(1));
    // Benchmarks compare runs and models: unset flags are off (greedy, no filters,
    // a fixed seed), not the model's generation_config.
    let given = args.sampling.options();
    let options = SamplingOptions {
        max_tokens: Some(args.gen_len),
        temperature: Some(given.temperature.unwrap_or(0.0)),
        top_k: Some(given.top_k.unwrap_or(0)),
        top_p: Some(given.top_p.unwrap_or(1.0)),
        repetition_penalty: Some(given.repetition_penalty.unwrap_or(1.0)),
        seed: Some(given.seed.unwrap_or(1234)),
        ignore_eos: true,
        ..given
    };
    let longest = args.prompt_len.iter().copied().max().unwrap_or(first_len);
    let sampling = engine.resolve(&options, RequestKind::Completion, longest)?;

    let mut rows = Vec::new();
    for (&prompt_len, &b) in args.prompt_len.iter().flat_map(|p| args.batch.iter().map(move |b| (p, b))) {
        let prompts: Vec<Vec<u32>> = (0..b).map(|i| random_prompt(1000 + i as u64, prompt_len, vocab)).collect();
        run_batch(&engine, &prompts, args.gen_len.min(8), &sampling)?; // warm-up: graphs (run_batch prefills twice: a prompt pass records its graph at its second), caches
        let (mut ttfts, mut steps, mut host) = (Vec::new(), Vec::new(), Vec::new());
        for rep in 0..args.reps {
            let r = run_batch(&engine, &prompts, args.gen_len, &sampling)?;
            let host_cpu = if info.backend == "cpu" { String::new() } else { format!(", host CPU {:.1} µs/token", r.host_cpu_per_token * 1e6) };
            note!("bench: prompt {prompt_len} batch {b} rep {}/{}: ttft {:.2} ms, {:.3} ms/step{host_cpu}", rep + 1, args.reps, r.ttft * 1e3, r.step * 1e3);
            ttfts.push(r.ttft);
            steps.push(r.step);
            host.push(r.host_cpu_per_token);
        }
        let ttft = stats(&ttfts);
        let step = stats(&steps);
        let gbs = info.bytes_per_decode_step as f64 / step.0 / 1e9;
        rows.push(Row {
            prompt_len,
            batch: b,
            path: engine.decode_path(b, &sampling),
            host_us_per_token: (info.backend != "cpu").then(|| stats(&host).0 * 1e6),
            ttft: (ttft.0 * 1e3, ttft.1 * 1e3),
            prefill_tps: (b * prompt_len) as f64 / ttft.0,
            step_ms: (step.0 * 1e3, step.1 * 1e3),
            tokens_per_s: b as f64 / step.0,
            gbs,
            pct_copy: copy_gbs.map(|c| 100.0 * gbs / c),
        });
    }

    let prefix = args.prefix_reuse.map(|n| prefix_case(&engine, n, first_len, vocab, &sampling, args.reps)).transpose()?;

    if let Some((path, mut file)) = json_out {
        let report = json!({
            "date_unix": SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            "commit": env!("ROCKET_GIT_COMMIT"),
            "command": std::env::args().collect::<Vec<_>>(),
            "device": device,
            "gpu_clocks": nvidia_smi_clocks(),
            "model": info.path.display().to_string(),
            "backend": info.backend,
            "bytes_per_decode_step": info.bytes_per_decode_step,
            "copy_bandwidth_gbs": copy_gbs,
            "load_seconds": load_s,
            "prompt_len": first_len,
            "prompt_lens": args.prompt_len,
            "gen_len": args.gen_len,
            "sampling": sampling_report(&sampling),
            "reps": args.reps,
            "results": rows.iter().map(|r| json!({
                "prompt_len": r.prompt_len,
                "batch": r.batch,
                "decode_path": r.path,
                "host_cpu_us_per_token": r.host_us_per_token,
                "ttft_ms": r.ttft.0, "ttft_ms_std": r.ttft.1,
                "prefill_tokens_per_s": r.prefill_tps,
                "decode_ms_per_step": r.step_ms.0, "decode_ms_per_step_std": r.step_ms.1,
                "decode_tokens_per_s": r.tokens_per_s,
                "effective_gbs": r.gbs,
                "pct_of_copy_bandwidth": r.pct_copy,
            })).collect::<Vec<_>>(),
            "prefix_reuse": prefix.as_ref().map(|p| json!({
                "shared_tokens": p.shared,
                "new_tokens": p.new,
                "reused_tokens": p.reused,
                "prefix_block": engine.prefix_cache_limits().1,
                "ttft_ms": p.ttft.0, "ttft_ms_std": p.ttft.1,
                "ttft_no_reuse_ms": p.ttft_no_reuse.0, "ttft_no_reuse_ms_std": p.ttft_no_reuse.1,
            })),
        });
        file.write_all(serde_json::to_string_pretty(&report)?.as_bytes()).with_context(|| format!("writing {}", path.display()))?;
    }

    let mut out = std::io::stdout().lock();
    writeln!(out, "model: {}  device: {device}  commit: {}", info.path.display(), env!("ROCKET_GIT_COMMIT"))?;
    writeln!(out, 
        "load {load_s:.3} s  weights/step {:.3} GB  copy bandwidth {}",
        info.bytes_per_decode_step as f64 / 1e9,
        copy_gbs.map_or("n/a".into(), |c| format!("{c:.0} GB/s"))
    )?;
    // One table per prompt length, each headed by its length.
    for (i, &prompt_len) in args.prompt_len.iter().enumerate() {
        if i > 0 {
            writeln!(out)?;
        }
        writeln!(out, 
            "| batch | decode path | TTFT ms (p={prompt_len}) | prefill tok/s | decode ms/step | tok/s | GB/s | % copy BW | decode host CPU µs/tok |"
        )?;
        writeln!(out, "|------:|:------------|---------------:|--------------:|---------------:|------:|-----:|----------:|----------------:|")?;
        for r in rows.iter().filter(|r| r.prompt_len == prompt_len) {
            writeln!(out, 
                "| {} | {} | {:.2} ± {:.2} | {:.0} | {:.3} ± {:.3} | {:.1} | {:.0} | {} | {} |",
                r.batch,
                r.path,
                r.ttft.0,
                r.ttft.1,
                r.prefill_tps,
                r.step_ms.0,
                r.step_ms.1,
                r.tokens_per_s,
                r.gbs,
                r.pct_copy.map_or("n/a".into(), |p| format!("{p:.1}%")),
                r.host_us_per_token.map_or("-".into(), |h| format!("{h:.1}"))
            )?;
        }
    }
    if let Some(p) = &prefix {
        writeln!(out)?;
        writeln!(out, "| prefix reuse | prompt tokens | reused | TTFT ms | TTFT ms without reuse |")?;
        writeln!(out, "|:-------------|--------------:|-------:|--------:|----------------------:|")?;
        writeln!(out, 
            "| {} shared + {} new | {} | {} | {:.2} ± {:.2} | {:.2} ± {:.2} |",
            p.shared,
            p.new,
            p.shared + p.new,
            p.reused,
            p.ttft.0,
            p.ttft.1,
            p.ttft_no_reuse.0,
            p.ttft_no_reuse.1
        )?;
    }
    Ok(())
}

/// SM/memory clocks now and at most, from nvidia-smi where it exists.
fn nvidia_smi_clocks() -> Option<String> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"])
        .output()
        .ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}
