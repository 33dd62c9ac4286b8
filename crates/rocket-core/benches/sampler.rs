//! Host sampler cost per token on a vocabulary-sized logits row (Qwen3's 151,936),
//! for the settings users run: `cargo bench -p rocket-core --bench sampler`.
//! Two rows: "flat" random logits (the worst case for top-p: the nucleus holds most
//! of the vocabulary) and "peaked" ones (one token in ~1000 far ahead, as a trained
//! model's). Prints ms per token, the median of 5 runs of 40 tokens.

use std::time::Instant;

use rocket_core::sampling::{sample, SamplingParams};

fn main() {
    let mut state = 1u64;
    let flat: Vec<f32> = (0..151_936)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / 16_777_216.0) * 12.0 - 6.0
        })
        .collect();
    let peaked: Vec<f32> = flat.iter().enumerate().map(|(i, &l)| if i % 997 == 0 { l + 14.0 } else { l }).collect();
    let settings = [
        ("temperature 0.7", SamplingParams { temperature: 0.7, ..SamplingParams::default() }),
        ("top-p 0.95", SamplingParams { temperature: 0.7, top_p: 0.95, ..SamplingParams::default() }),
        ("top-k 20 + top-p 0.95 (Qwen3)", SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..SamplingParams::default() }),
        ("min-p 0.05", SamplingParams { temperature: 0.7, min_p: 0.05, ..SamplingParams::default() }),
    ];
    println!("| logits | setting | ms/token |");
    println!("|---|---|---:|");
    for (name, logits) in [("flat", &flat), ("peaked", &peaked)] {
        for (label, params) in &settings {
            let mut runs: Vec<f64> = (0..5)
                .map(|r| {
                    let start = Instant::now();
                    let mut sink = 0u64;
                    for step in 0..40 {
                        sink = sink.wrapping_add(sample(logits, params, 7 + r, step) as u64);
                    }
                    std::hint::black_box(sink);
                    start.elapsed().as_secs_f64() * 1e3 / 40.0
                })
                .collect();
            runs.sort_by(f64::total_cmp);
            println!("| {name} | {label} | {:.2} |", runs[2]);
        }
    }
}
