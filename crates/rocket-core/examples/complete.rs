//! `Engine::generate` with default options: the Rust door of the test that
//! every front end gives the same tokens for a prompt with no sampling
//! arguments (tests/test_doors.py). Prints `{"text": ..., "token_ids": [...]}`.
//!
//! ```text
//! cargo run -p rocket-core --example complete -- [MODEL] PROMPT
//! ```

use rocket_core::{default_model, Engine, EngineOptions, Progress, SamplingOptions};

fn main() -> Result<(), rocket_core::RocketError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (model, prompt) = match args.as_slice() {
        // A front end: the one place this program reads the environment.
        [prompt] => (default_model::locate(std::env::var_os("ROCKET_DEFAULT_MODEL").map(Into::into))?, prompt.clone()),
        [model, prompt] => (model.into(), prompt.clone()),
        _ => return Err(rocket_core::RocketError::invalid_arg("args", args.len(), "usage: complete [MODEL] PROMPT")),
    };
    let options = EngineOptions { device: rocket_core::Device::Cpu, progress: Progress::Off, ..EngineOptions::default() };
    let engine = Engine::load(model, options)?;
    let out = engine.generate(&prompt, &SamplingOptions::default())?;
    let json = serde_json::json!({ "text": out.text, "token_ids": out.token_ids });
    println!("{json}");
    Ok(())
}
