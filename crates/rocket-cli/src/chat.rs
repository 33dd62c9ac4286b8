//! `rocket chat`: an interactive multi-turn conversation. Ctrl-D ends it;
//! Ctrl-C stops the answer being generated (the partial answer stays in the
//! conversation) and returns to the prompt.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rocket_core::{ChatMessage, RequestKind, SamplingOptions};

use crate::sampling_args::{count, SamplingArgs};
use crate::ModelArgs;

#[derive(clap::Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens per answer at most [default: until the context is full]
    #[arg(long, short = 'n', allow_negative_numbers = true, value_parser = count)]
    max_tokens: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// A system message to start the conversation with
    #[arg(long)]
    system: Option<String>,
}

pub fn run(args: &ChatArgs) -> anyhow::Result<()> {
    let engine = args.model.load()?;
    // Fail now, not after the first question, if the model cannot chat.
    engine.apply_chat_template(&[ChatMessage { role: "user".into(), content: "hi".into() }], true)?;
    if args.sampling.logprobs.is_some() {
        anyhow::bail!("--logprobs is shown by `rocket generate` only");
    }
    let options = SamplingOptions { max_tokens: args.max_tokens, ..args.sampling.options() };
    // Refuse bad values now, not after the first question.
    engine.resolve(&options, RequestKind::Chat, 1)?;

    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    // Without a handler (e.g. one is already installed) Ctrl-C simply ends the process.
    let _ = ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst));

    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!("rocket chat — {} (Ctrl-D to quit, Ctrl-C stops an answer)", engine.info().path.display());
    }
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(system) = &args.system {
        messages.push(ChatMessage { role: "system".into(), content: system.clone() });
    }
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout().lock();
    let mut line = String::new();
    loop {
        if interactive {
            eprint!("> ");
        }
        line.clear();
        interrupted.store(false, Ordering::SeqCst);
        if stdin.lock().read_line(&mut line)? == 0 {
            if interactive {
                eprintln!();
            }
            return Ok(());
        }
        let question = line.trim_end_matches(['\n', '\r']);
        if question.trim().is_empty() {
            continue;
        }
        messages.push(ChatMessage { role: "user".into(), content: question.to_string() });
        let result = engine.apply_chat_template(&messages, true).and_then(|prompt| {
            let ids = engine.encode_prompt(&prompt)?;
            let params = engine.resolve(&options, RequestKind::Chat, ids.len())?;
            engine.generate_ids(prompt, ids, &params, &mut |delta| {
                let _ = stdout.write_all(delta.text.as_bytes());
                let _ = stdout.flush();
                !interrupted.load(Ordering::SeqCst)
            })
        });
        writeln!(stdout)?;
        match result {
            Ok(out) => messages.push(ChatMessage { role: "assistant".into(), content: out.text }),
            Err(e) => {
                // Keep the conversation usable: drop the turn that failed (e.g. context full).
                messages.pop();
                eprintln!("error: {e}");
            }
        }
    }
}
