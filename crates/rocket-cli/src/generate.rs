//! `rocket generate`: stream a continuation of a prompt to stdout (only the
//! continuation and a final newline; `--echo` puts the prompt before it).

use std::io::{Read, Write};

use anyhow::Context;
use rocket_core::{ChatMessage, RequestKind, SamplingOptions};

use crate::sampling_args::{positive_count, SamplingArgs};
use crate::ModelArgs;

#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens to generate at most [default: 16; with --chat, until the context is full]
    #[arg(long, short = 'n', allow_negative_numbers = true, value_parser = positive_count)]
    max_tokens: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
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
    /// The prompt; "-" reads it from stdin (without the input's final line break)
    prompt: String,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    let options = SamplingOptions { max_tokens: args.max_tokens, ..args.sampling.options() };
    crate::check_given(&options)?;
    let engine = args.model.load()?;
    let mut prompt = args.prompt.clone();
    if prompt == "-" {
        prompt.clear();
        std::io::stdin().read_to_string(&mut prompt).context("reading the prompt from stdin")?;
        // `echo ... |` and editors end the input with a line break the prompt does not mean.
        let end = prompt.strip_suffix('\n').map_or(prompt.len(), |p| p.strip_suffix('\r').unwrap_or(p).len());
        prompt.truncate(end);
    }
    if args.chat {
        let messages = [ChatMessage { role: "user".into(), content: prompt }];
        prompt = engine.apply_chat_template(&messages, true)?;
    }
    let ids = engine.encode_prompt(&prompt)?;
    let kind = if args.chat { RequestKind::Chat } else { RequestKind::Completion };
    let params = engine.resolve(&options, kind, ids.len())?;
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
    if let Some(items) = &out.logprobs {
        let tokenizer = engine.tokenizer();
        for lp in items {
            let text = tokenizer.decode(&[lp.token_id], false).unwrap_or_default();
            let top: Vec<String> = lp.top.iter().map(|(id, l)| format!("{id}:{l:.4}")).collect();
            note!("{:>8} {:>10.4} {text:?} [{}]", lp.token_id, lp.logprob, top.join(" "));
        }
    }
    if args.stats {
        let m = &out.metrics;
        let tokens = |n: usize| if n == 1 { "1 token".to_string() } else { format!("{n} tokens") };
        // The decode rate counts the tokens after the first: none with one token.
        let decode = if m.output_tokens > 1 { format!("{:.1} tokens/s", m.decode_tokens_per_second) } else { "n/a".to_string() };
        note!(
            "prompt {}, output {} ({}), ttft {:.1} ms, decode {decode}, total {:.2} s, backend {}",
            tokens(m.prompt_tokens),
            tokens(m.output_tokens),
            out.finish_reason.as_str(),
            m.time_to_first_token * 1e3,
            m.total_seconds,
            engine.info().backend
        );
    }
    Ok(())
}
