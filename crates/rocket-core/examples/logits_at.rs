//! Logits of a teacher-forced token sequence at chosen positions, from the
//! CUDA backend's graph path or its megakernel, written as .npy files for an
//! outside reference to compare (benches/long_context_check.py compares them
//! with an fp32 torch forward on the GPU machine).
//!
//! ```text
//! logits_at MODEL JOBS.json
//! ```
//! JOBS.json is a list of `{"ids": FILE, "positions": [p, ...], "path":
//! "graph" | "megakernel", "out": FILE.npy}` or `{"ids": FILE, "steps": N,
//! "path": "greedy", "out": FILE.npy}`: `ids` holds the sequence as
//! little-endian u32; the output is f32 [positions][vocab], row i the logits
//! at position positions[i] (predicting the token after it), in the order
//! given (greedy: [steps][vocab], row i the logits that picked token i).
//! - graph: the sequence up to the last position prefilled as the batcher
//!   feeds a prompt (passes of PREFILL_CHUNK tokens), every row's logits kept.
//! - megakernel: each run of consecutive positions a..=b is one megakernel
//!   launch on a session whose first a tokens were prefilled on the graph path
//!   (the product's path: prefill, then decode from position a), teacher-forced
//!   on the sequence, every step's logits kept.
//! - greedy: batch-1 greedy decoding as the batcher runs it: the sequence
//!   prefilled as a prompt, its last row's argmax the first token, then
//!   megakernel launches of up to `batch::LOOP_STEPS` steps each, free
//!   running (ignoring EOS) until `steps` tokens; a last single step, where
//!   the batcher takes one, is a graph-path pass. The tokens and the number of
//!   launches go to the printed JSON line. Fails when no megakernel runs.
//!
//! Default GPU options (what users get); a GGUF's quantized tensors become
//! bf16, as `Engine::load` makes them for a GPU. Needs the `diagnostics` feature:
//! `cargo build --release -p rocket-core --features diagnostics --example logits_at`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use rocket_core::backend::cuda::CudaBackend;
use rocket_core::backend::{Backend, Chunk, Logits, Session};
use rocket_core::batch::{LOOP_STEPS, PREFILL_CHUNK};
use rocket_core::model::{ModelSource, ModelWeights};
use rocket_core::progress::LoadProgress;
use rocket_core::weights::DType;
use rocket_core::{GpuOptions, Progress, RocketError};

type Result<T> = std::result::Result<T, RocketError>;

fn bad(what: &str, value: impl std::fmt::Display, why: impl Into<String>) -> RocketError {
    RocketError::invalid_arg(what, value, why.into())
}

#[derive(serde::Deserialize)]
struct Job {
    ids: PathBuf,
    #[serde(default)]
    positions: Vec<usize>,
    /// Tokens to generate (greedy only).
    #[serde(default)]
    steps: Option<usize>,
    path: String,
    out: PathBuf,
}

fn read_ids(path: &Path) -> Result<Vec<u32>> {
    let bytes = std::fs::read(path).map_err(|e| bad("ids", path.display(), e.to_string()))?;
    if bytes.len() % 4 != 0 || bytes.is_empty() {
        return Err(bad("ids", path.display(), "must hold little-endian u32 token ids"));
    }
    Ok(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// A .npy file (format 1.0) of little-endian f32 [rows][cols].
fn write_npy(path: &Path, rows: usize, cols: usize, data: &[f32]) -> Result<()> {
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // Magic (6) + version (2) + length (2) + header + '\n', a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * 4);
    out.extend(b"\x93NUMPY\x01\x00");
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    for v in data {
        out.extend(v.to_le_bytes());
    }
    std::fs::write(path, out).map_err(|e| bad("out", path.display(), e.to_string()))
}

/// Feeds `ids` into `session` in passes of PREFILL_CHUNK tokens; returns every row's logits when `all`.
fn prefill(gpu: &CudaBackend, session: &mut dyn Session, ids: &[u32], all: bool) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for piece in ids.chunks(PREFILL_CHUNK) {
        let logits = gpu.forward(&mut [Chunk { session: &mut *session, tokens: piece }], if all { Logits::All } else { Logits::Last })?;
        if all {
            out.extend(logits);
        }
    }
    Ok(out)
}

/// The first index of the largest logit.
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The `greedy` job: (tokens, their logits rows, megakernel launches).
fn greedy(gpu: &CudaBackend, ids: &[u32], steps: usize) -> Result<(Vec<u32>, Vec<f32>, usize)> {
    let mut session = gpu.new_session(ids.len() + steps)?;
    let mut rows = Vec::new();
    for piece in ids.chunks(PREFILL_CHUNK) {
        rows = gpu.forward(&mut [Chunk { session: session.as_mut(), tokens: piece }], Logits::Last)?;
    }
    let mut tokens = vec![argmax(&rows)];
    let mut launches = 0;
    while tokens.len() < steps {
        let last = *tokens.last().unwrap();
        let n = (steps - tokens.len()).min(LOOP_STEPS);
        if n < 2 {
            // The batcher's device loop needs two steps to go; one left is a plain pass.
            let row = gpu.forward(&mut [Chunk { session: session.as_mut(), tokens: &[last] }], Logits::Last)?;
            tokens.push(argmax(&row));
            rows.extend(row);
            continue;
        }
        let (picked, logits) = gpu
            .megakernel_decode_logits(session.as_mut(), last, &[], n)?
            .ok_or_else(|| bad("path", "greedy", "no megakernel is loaded for this model"))?;
        if picked.len() != n {
            return Err(bad("steps", n, format!("the megakernel launch returned {} tokens", picked.len())));
        }
        launches += 1;
        tokens.extend(picked);
        rows.extend(logits);
    }
    Ok((tokens, rows, launches))
}

fn run_job(gpu: &CudaBackend, job: &Job) -> Result<()> {
    let vocab = gpu.spec().vocab_size;
    let ids = read_ids(&job.ids)?;
    if job.path == "greedy" {
        let steps = job.steps.ok_or_else(|| bad("steps", "none", "greedy needs the number of tokens to generate"))?;
        if steps == 0 || !job.positions.is_empty() {
            return Err(bad("steps", steps, "greedy takes steps >= 1 and no positions"));
        }
        let t = Instant::now();
        let (tokens, rows, launches) = greedy(gpu, &ids, steps)?;
        write_npy(&job.out, steps, vocab, &rows)?;
        let json = serde_json::json!({ "out": job.out, "path": job.path, "tokens": ids.len(), "generated": tokens, "launches": launches, "seconds": t.elapsed().as_secs_f64() });
        println!("{json}");
        return Ok(());
    }
    if job.steps.is_some() {
        return Err(bad("steps", job.path.as_str(), "only greedy jobs take steps"));
    }
    if job.positions.is_empty() {
        return Err(bad("positions", "[]", "name at least one position"));
    }
    if let Some(&p) = job.positions.iter().find(|&&p| p >= ids.len()) {
        return Err(bad("positions", p, format!("must be < the sequence's {} tokens", ids.len())));
    }
    let t = Instant::now();
    let mut rows = vec![0f32; job.positions.len() * vocab];
    match job.path.as_str() {
        "graph" => {
            let end = job.positions.iter().max().unwrap() + 1;
            let mut session = gpu.new_session(end)?;
            let all = prefill(gpu, session.as_mut(), &ids[..end], true)?;
            for (i, &p) in job.positions.iter().enumerate() {
                rows[i * vocab..(i + 1) * vocab].copy_from_slice(&all[p * vocab..(p + 1) * vocab]);
            }
        }
        "megakernel" => {
            let mut sorted = job.positions.clone();
            sorted.sort_unstable();
            sorted.dedup();
            // Runs of consecutive positions, one launch each.
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for p in sorted {
                match runs.last_mut() {
                    Some((_, b)) if *b + 1 == p => *b = p,
                    _ => runs.push((p, p)),
                }
            }
            for (a, b) in runs {
                let mut session = gpu.new_session(b + 1)?;
                if a > 0 {
                    prefill(gpu, session.as_mut(), &ids[..a], false)?;
                }
                let steps = b - a + 1;
                let (_, logits) = gpu
                    .megakernel_decode_logits(session.as_mut(), ids[a], &ids[a + 1..=b], steps)?
                    .ok_or_else(|| bad("path", "megakernel", "no megakernel is loaded for this model"))?;
                for (i, &p) in job.positions.iter().enumerate().filter(|(_, p)| (a..=b).contains(*p)) {
                    rows[i * vocab..(i + 1) * vocab].copy_from_slice(&logits[(p - a) * vocab..(p - a + 1) * vocab]);
                }
            }
        }
        other => return Err(bad("path", other, "expected graph, megakernel or greedy")),
    }
    write_npy(&job.out, job.positions.len(), vocab, &rows)?;
    let json = serde_json::json!({ "out": job.out, "path": job.path, "tokens": ids.len(), "positions": job.positions.len(), "seconds": t.elapsed().as_secs_f64() });
    println!("{json}");
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, jobs] = args.as_slice() else { return Err(bad("args", args.len(), "usage: logits_at MODEL JOBS.json")) };
    let jobs: Vec<Job> = serde_json::from_str(&std::fs::read_to_string(jobs).map_err(|e| bad("JOBS.json", jobs, e.to_string()))?)
        .map_err(|e| bad("JOBS.json", jobs, e.to_string()))?;
    let source = ModelSource::open_with_progress(Path::new(model), DType::BF16, &LoadProgress::new(Progress::Off))?;
    let spec = source.spec.clone();
    let weights = ModelWeights::from_weights(&spec, source.weights)?;
    let gpu = CudaBackend::with_options(spec, &weights, &LoadProgress::new(Progress::Off), GpuOptions::default())?;
    drop(weights);
    eprintln!("{}: megakernel {:?}", gpu.device_description(), gpu.megakernel_fuel()?);
    for job in &jobs {
        run_job(&gpu, job)?;
    }
    Ok(())
}
