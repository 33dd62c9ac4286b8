//! `rocket generate`: stream a continuation of a prompt to stdout (only the
//! continuation and a final newline; `--echo` puts the prompt before it).

use std::io::{Read, Write};

use anyhow::Context;
use rocket_core::model::UnsetFields;
use rocket_core::{ChatMessage, SamplingParams};

use crate::ModelArgs;

#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens to generate at most
    #[arg(long, short = 'n', default_value_t = 64)]
    max_tokens: usize,
    /// 0 = greedy [default: generation_config when it sets do_sample, else 0]
    #[arg(long, short = 't')]
    temperature: Option<f32>,
    /// Keep the k most likely tokens (0 = off) [default: generation_config, else 0]
    #[arg(long)]
    top_k: Option<usize>,
    /// Nucleus sampling threshold in (0, 1] [default: generation_config, else 1]
    #[arg(long)]
    top_p: Option<f32>,
    /// Seed for sampling (same seed, same output)
    #[arg(long)]
    seed: Option<u64>,
    /// Wrap PROMPT as a user message in the model's chat template
    #[arg(long)]
    chat: bool,
    /// Print timing and token counts to stderr when done
    #[arg(long)]
    stats: bool,
    /// Write the prompt (with --chat: the rendered chat prompt) to stdout before the
    /// continuation, once the request is accepted
    #[arg(long)]
    echo: bool,
    /// The prompt; "-" reads it from stdin
    prompt: String,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    let engine = args.model.load()?;
    let mut prompt = args.prompt.clone();
    if prompt == "-" {
        prompt.clear();
        std::io::stdin().read_to_string(&mut prompt).context("reading the prompt from stdin")?;
    }
    if args.chat {
        let messages = [ChatMessage { role: "user".into(), content: prompt }];
        prompt = engine.apply_chat_template(&messages, true)?;
    }
    let mut params = SamplingParams {
        max_tokens: args.max_tokens,
        temperature: args.temperature.unwrap_or_default(),
        top_k: args.top_k.unwrap_or_default(),
        top_p: args.top_p.unwrap_or(1.0),
        seed: args.seed,
        ..SamplingParams::default()
    };
    let unset = UnsetFields {
        temperature: args.temperature.is_none(),
        top_k: args.top_k.is_none(),
        top_p: args.top_p.is_none(),
        repetition_penalty: true,
    };
    engine.generation_config().fill_defaults(&mut params, unset);
    let ids = engine.encode_prompt(&prompt)?;
    let mut stdout = std::io::stdout().lock();
    // The echo waits for the first token: a request the engine refuses (too long
    // for the context, bad parameters) writes nothing to stdout.
    let mut echo = args.echo.then(|| prompt.clone());
    let out = engine.generate_ids(prompt, ids, &params, &mut |delta| {
        if let Some(p) = echo.take() {
            let _ = stdout.write_all(p.as_bytes());
        }
        let _ = stdout.write_all(delta.text.as_bytes());
        stdout.flush().is_ok()
    })?;
    if let Some(p) = echo.take() {
        write!(stdout, "{p}")?; // nothing was generated
    }
    writeln!(stdout)?;
    stdout.flush()?;
    if args.stats {
        let m = &out.metrics;
        eprintln!(
            "prompt {} tokens, output {} tokens ({}), ttft {:.1} ms, decode {:.1} tokens/s, total {:.2} s, backend {}",
            m.prompt_tokens,
            m.output_tokens,
            out.finish_reason.as_str(),
            m.time_to_first_token * 1e3,
            m.decode_tokens_per_second,
            m.total_seconds,
            engine.info().backend
        );
    }
    Ok(())
}
