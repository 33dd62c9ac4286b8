//! `rocket chat`: an interactive multi-turn conversation. Ctrl-D ends it;
//! Ctrl-C stops the answer being generated (the partial answer stays in the
//! conversation) and returns to the prompt; at the prompt, Ctrl-C drops the
//! line being typed and shows a fresh prompt, as a shell does. When the
//! conversation outgrows the context, the oldest exchanges are dropped (the
//! system message stays) and stderr says so.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rocket_core::{ChatMessage, RequestKind, SamplingOptions};

use crate::sampling_args::{positive_count, SamplingArgs};
use crate::ModelArgs;

#[derive(clap::Args)]
#[command(mut_arg("logprobs", |a| a.hide(true)))]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens per answer at most [default: until the context is full]
    #[arg(long, short = 'n', allow_negative_numbers = true, value_parser = positive_count)]
    max_tokens: Option<usize>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// A system message to start the conversation with
    #[arg(long)]
    system: Option<String>,
}

/// How the newest turn of a conversation fits the context: drop the first
/// `drop` messages after the system message, and answer in at most `max_tokens`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Fit {
    pub drop: usize,
    pub max_tokens: usize,
}

/// Makes room for the answer to the last message of `messages` (the new
/// question): drops whole exchanges, oldest first, while the rendered prompt
/// (`prompt_tokens`) plus `max_tokens` exceeds `limit`. The system message
/// (the first, when `has_system`) and the new question are always kept; when
/// they alone leave less than `max_tokens`, the answer gets what is left. A
/// question that leaves no room at all is a context-length error.
pub(crate) fn fit_turn(
    messages: &[ChatMessage],
    has_system: bool,
    max_tokens: usize,
    limit: usize,
    prompt_tokens: &mut dyn FnMut(&[ChatMessage]) -> rocket_core::Result<usize>,
) -> rocket_core::Result<Fit> {
    let first = usize::from(has_system).min(messages.len());
    let history = &messages[first..];
    // An exchange starts at a user message; the new question is the last one.
    let starts = (0..history.len()).filter(|&k| k == 0 || history[k].role == "user");
    let mut tokens = 0;
    for drop in starts {
        let kept: Vec<ChatMessage> = messages[..first].iter().chain(&history[drop..]).cloned().collect();
        tokens = prompt_tokens(&kept)?;
        if tokens + max_tokens <= limit {
            return Ok(Fit { drop, max_tokens });
        }
    }
    if tokens < limit {
        return Ok(Fit { drop: history.len().saturating_sub(1), max_tokens: limit - tokens });
    }
    Err(rocket_core::RocketError::ContextOverflow { prompt_tokens: tokens, max_tokens, limit })
}

pub fn run(args: &ChatArgs) -> anyhow::Result<()> {
    let options = SamplingOptions { max_tokens: args.max_tokens, ..args.sampling.options() };
    crate::check_given(&options)?;
    if args.sampling.logprobs.is_some() {
        return Err(crate::UsageError("--logprobs is shown by `rocket generate` only".into()).into());
    }
    let engine = args.model.load()?;
    // Fail now, not after the first question, if the model cannot chat.
    engine.apply_chat_template(&[ChatMessage { role: "user".into(), content: "hi".into() }], true)?;
    // Refuse bad values now, not after the first question; the context is each
    // turn's to fit (an answer gets what the conversation leaves, with a note).
    engine.resolve(&SamplingOptions { max_tokens: None, ..options.clone() }, RequestKind::Chat, 1)?;

    let interactive = std::io::stdin().is_terminal();
    // `answering` is set while an answer streams: Ctrl-C then sets `interrupted`,
    // which stops that answer. At the prompt the terminal has already dropped the
    // typed line; the handler only draws a new prompt, so nothing carries over
    // into the next answer.
    let answering = Arc::new(AtomicBool::new(false));
    let interrupted = Arc::new(AtomicBool::new(false));
    let (busy, flag) = (answering.clone(), interrupted.clone());
    // Without a handler (e.g. one is already installed) Ctrl-C simply ends the process.
    let _ = ctrlc::set_handler(move || {
        if busy.load(Ordering::SeqCst) {
            flag.store(true, Ordering::SeqCst);
        } else if interactive {
            note_inline!("\n> ");
        }
    });

    if interactive {
        note!("rocket chat — {} (Ctrl-D to quit, Ctrl-C stops an answer)", engine.info().path.display());
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
            note_inline!("> ");
        }
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            if interactive {
                note!();
            }
            return Ok(());
        }
        let question = line.trim_end_matches(['\n', '\r']);
        if question.trim().is_empty() {
            continue;
        }
        messages.push(ChatMessage { role: "user".into(), content: question.to_string() });
        let limit = engine.info().max_seq_len;
        let mut count = |m: &[ChatMessage]| Ok(engine.encode_prompt(&engine.apply_chat_template(m, true)?)?.len());
        // Room kept for the answer: max_tokens when set; without it the answer may
        // use the context left, and old exchanges go once less than a quarter is left.
        let wanted = options.max_tokens.unwrap_or(limit / 4).max(1);
        let result = fit_turn(&messages, args.system.is_some(), wanted, limit, &mut count).and_then(|fit| {
            if fit.drop > 0 {
                let first = usize::from(args.system.is_some());
                messages.drain(first..first + fit.drop);
                note!("chat: the conversation outgrew the context ({limit} tokens); dropped its {} oldest messages", fit.drop);
            }
            if fit.max_tokens < wanted {
                note!("chat: this answer is limited to {} tokens by the context ({limit} tokens)", fit.max_tokens);
            }
            let turn = SamplingOptions { max_tokens: options.max_tokens.map(|_| fit.max_tokens), ..options.clone() };
            let prompt = engine.apply_chat_template(&messages, true)?;
            let ids = engine.encode_prompt(&prompt)?;
            let params = engine.resolve(&turn, RequestKind::Chat, ids.len())?;
            // A Ctrl-C that came before this answer does not stop it.
            interrupted.store(false, Ordering::SeqCst);
            answering.store(true, Ordering::SeqCst);
            let out = engine.generate_ids(prompt, ids, &params, &mut |delta| {
                let _ = stdout.write_all(delta.text.as_bytes());
                let _ = stdout.flush();
                !interrupted.load(Ordering::SeqCst)
            });
            answering.store(false, Ordering::SeqCst);
            out
        });
        writeln!(stdout)?;
        match result {
            Ok(out) => {
                // Each turn's prompt starts with the last one's: the prefix cache
                // (--prefix-cache-bytes) skips the prefill of its whole blocks.
                let m = &out.metrics;
                tracing::info!(prompt_tokens = m.prompt_tokens, cached_prompt_tokens = m.cached_prompt_tokens, ttft_s = m.time_to_first_token, "chat turn");
                messages.push(ChatMessage { role: "assistant".into(), content: out.text });
            }
            Err(e) => {
                // Keep the conversation usable: drop the turn that failed (e.g. context full).
                messages.pop();
                note!("error: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }

    /// A stand-in for the chat template and tokenizer: one token per byte, plus 2 per message.
    fn tokens(m: &[ChatMessage]) -> rocket_core::Result<usize> {
        Ok(m.iter().map(|m| m.content.len() + 2).sum())
    }

    fn conversation() -> Vec<ChatMessage> {
        vec![
            msg("system", "be brief"),   // 10
            msg("user", "first"),        // 7
            msg("assistant", "answer1"), // 9
            msg("user", "second"),       // 8
            msg("assistant", "answer2"), // 9
            msg("user", "third"),        // 7: 50 in all
        ]
    }

    #[test]
    fn a_turn_that_fits_keeps_the_whole_conversation() {
        assert_eq!(fit_turn(&conversation(), true, 10, 60, &mut tokens).unwrap(), Fit { drop: 0, max_tokens: 10 });
    }

    #[test]
    fn the_oldest_exchanges_go_first_and_the_system_message_stays() {
        let fit = |limit| fit_turn(&conversation(), true, 10, limit, &mut tokens).unwrap();
        // 50 + 10 > 59: the first exchange (16 tokens) goes.
        assert_eq!(fit(59), Fit { drop: 2, max_tokens: 10 });
        assert_eq!(fit(44), Fit { drop: 2, max_tokens: 10 });
        // 34 + 10 > 43: the second exchange (17) goes too; system + question = 17.
        assert_eq!(fit(43), Fit { drop: 4, max_tokens: 10 });
        assert_eq!(fit(27), Fit { drop: 4, max_tokens: 10 });
        // System + question leave less than max_tokens: the answer gets what is left.
        assert_eq!(fit(20), Fit { drop: 4, max_tokens: 3 });
        assert_eq!(fit(18), Fit { drop: 4, max_tokens: 1 });
    }

    #[test]
    fn without_a_system_message_the_first_exchange_can_go() {
        let convo = &conversation()[1..]; // 40 tokens
        assert_eq!(fit_turn(convo, false, 10, 50, &mut tokens).unwrap(), Fit { drop: 0, max_tokens: 10 });
        assert_eq!(fit_turn(convo, false, 10, 49, &mut tokens).unwrap(), Fit { drop: 2, max_tokens: 10 });
        assert_eq!(fit_turn(convo, false, 10, 12, &mut tokens).unwrap(), Fit { drop: 4, max_tokens: 5 });
    }

    #[test]
    fn an_exchange_is_dropped_whole() {
        // Two answers in a row (a cut answer then a retry) belong to one exchange.
        let mut convo = conversation();
        convo.insert(3, msg("assistant", "more")); // 6: 56 in all
        assert_eq!(fit_turn(&convo, true, 10, 60, &mut tokens).unwrap(), Fit { drop: 3, max_tokens: 10 });
    }

    #[test]
    fn a_question_longer_than_the_context_is_a_context_length_error() {
        let err = fit_turn(&conversation(), true, 10, 17, &mut tokens).unwrap_err();
        assert!(matches!(err, rocket_core::RocketError::ContextOverflow { prompt_tokens: 17, limit: 17, .. }), "{err}");
        // The counter's own errors pass through.
        let mut failing = |_: &[ChatMessage]| Err(rocket_core::RocketError::EmptyPrompt);
        assert!(matches!(fit_turn(&conversation(), true, 10, 60, &mut failing), Err(rocket_core::RocketError::EmptyPrompt)));
    }
}
