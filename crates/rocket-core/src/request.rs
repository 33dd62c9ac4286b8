//! One request's generation policy, token by token: sampling, stop ids and
//! strings, incremental detokenisation, held-back streaming text, logprobs and
//! metrics. Backend-agnostic: it sees one logits row per step, so a single
//! request and a batch of them run exactly the same logic.

use std::time::Instant;

use crate::backend::SampleRequest;
use crate::error::{Result, RocketError};
use crate::output::{FinishReason, Metrics, RequestOutput, StopReason, StreamDelta, TokenLogprob};
use crate::sampling::{fresh_seed, logprobs, SamplingParams, TokenHistory};
use crate::text::Tokenizer;

/// One request for the engine: the prompt text (echoed in the output), its
/// token ids (what runs), and how to sample.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
}

/// An owned copy of what `RequestState::sample_request` lends.
pub(crate) struct LoopSampling {
    params: SamplingParams,
    seed: u64,
    step: u64,
    history: TokenHistory,
    end_ids: Vec<u32>,
}

impl LoopSampling {
    pub(crate) fn request(&self) -> SampleRequest<'_> {
        SampleRequest { params: &self.params, seed: self.seed, step: self.step, history: &self.history, end_ids: &self.end_ids }
    }
}

pub(crate) struct RequestState {
    prompt: String,
    prompt_ids: Vec<u32>,
    params: SamplingParams,
    seed: u64,
    end_ids: Vec<u32>,
    max_stop_len: usize,
    history: TokenHistory,
    token_ids: Vec<u32>,
    token_logprobs: Option<Vec<TokenLogprob>>,
    detok: Detokenizer,
    text: String,
    emitted: usize,
    finish: (FinishReason, Option<StopReason>),
    started: Instant,
    first_token_at: Option<f64>,
    max_batch_size: usize,
    /// Leading prompt tokens whose KV was copied from the prefix cache.
    cached_prompt_tokens: usize,
}

impl RequestState {
    /// `params` must already be validated; `eos_ids` are the model's end ids.
    pub(crate) fn new(request: EngineRequest, eos_ids: &[u32]) -> Self {
        let EngineRequest { prompt, prompt_ids, params } = request;
        let seed = params.seed.unwrap_or_else(fresh_seed);
        let mut end_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            end_ids.extend(eos_ids);
        }
        let max_stop_len = params.stop.iter().map(String::len).max().unwrap_or(0);
        RequestState {
            history: TokenHistory::new(&prompt_ids),
            token_ids: Vec::with_capacity(params.max_tokens),
            token_logprobs: params.logprobs.map(|_| Vec::with_capacity(params.max_tokens)),
            detok: Detokenizer::default(),
            text: String::new(),
            emitted: 0,
            finish: (FinishReason::Length, None),
            started: Instant::now(),
            first_token_at: None,
            max_batch_size: 0,
            cached_prompt_tokens: 0,
            prompt,
            prompt_ids,
            params,
            seed,
            end_ids,
            max_stop_len,
        }
    }

    pub(crate) fn prompt_ids(&self) -> &[u32] {
        &self.prompt_ids
    }

    /// KV room the request needs.
    pub(crate) fn capacity(&self) -> usize {
        self.prompt_ids.len() + self.params.max_tokens
    }

    /// Records that the first `tokens` of the prompt came from the prefix cache.
    pub(crate) fn reused_prefix(&mut self, tokens: usize) {
        self.cached_prompt_tokens = tokens;
    }

    /// Records that a forward pass of `rows` requests included this one.
    pub(crate) fn ran_in_batch(&mut self, rows: usize) {
        self.max_batch_size = self.max_batch_size.max(rows);
    }

    /// The next token from its logits on the host (the request's sampler) and,
    /// when asked for, its logprobs; changes nothing (rows of a batch pick in
    /// parallel, then `accept_with` each).
    pub(crate) fn pick_on_host(&self, logits: &[f32]) -> (u32, Option<TokenLogprob>) {
        let token = self.sample_request().sample_on_host(logits);
        let logprob = self.params.logprobs.map(|n| {
            let (lp, top) = logprobs(logits, token, n);
            TokenLogprob { token_id: token, logprob: lp, top }
        });
        (token, logprob)
    }

    /// Takes a token `pick_on_host` chose: updates the text and returns the delta
    /// to stream and whether the request is now finished.
    pub(crate) fn accept_with(&mut self, tokenizer: &Tokenizer, (token, logprob): (u32, Option<TokenLogprob>)) -> Result<(StreamDelta, bool)> {
        self.push_token(tokenizer, token, logprob)
    }

    pub(crate) fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether the request samples greedily from the raw logits: no penalties
    /// and no logprobs, so a device may pick its tokens.
    pub(crate) fn plain_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature == 0.0 && !p.has_penalties() && p.logprobs.is_none()
    }

    /// What a sampler needs for this step's token.
    pub(crate) fn sample_request(&self) -> SampleRequest<'_> {
        SampleRequest {
            params: &self.params,
            seed: self.seed,
            step: self.token_ids.len() as u64,
            history: &self.history,
            end_ids: &self.end_ids,
        }
    }

    /// Whether a device may pick this request's tokens (`sample_request`): all
    /// but logprobs, which need the logits row on the host.
    pub(crate) fn wants_device_sampling(&self) -> bool {
        self.params.logprobs.is_none()
    }

    /// Whether this step's token is the plain argmax of the raw logits (greedy,
    /// no penalties, no EOS masking, no logprobs), so a backend may pick it on
    /// the device.
    pub(crate) fn wants_plain_argmax(&self) -> bool {
        self.plain_greedy() && self.token_ids.len() >= self.params.min_tokens
    }

    /// The sampler's inputs for a device token loop, owned (the loop's token
    /// callback borrows the request meanwhile); None when plain greedy, whose
    /// loop takes the argmax.
    pub(crate) fn loop_sampling(&self) -> Option<LoopSampling> {
        (!self.plain_greedy()).then(|| LoopSampling {
            params: self.params.clone(),
            seed: self.seed,
            step: self.token_ids.len() as u64,
            history: self.history.clone(),
            end_ids: self.end_ids.clone(),
        })
    }

    /// Tokens still to generate.
    pub(crate) fn remaining(&self) -> usize {
        self.params.max_tokens - self.token_ids.len()
    }

    /// Tokens that end generation (EOS unless ignored, and stop ids).
    pub(crate) fn end_ids(&self) -> &[u32] {
        &self.end_ids
    }

    /// How many of the next tokens cannot be an end id (min_tokens).
    pub(crate) fn mask_end_steps(&self) -> usize {
        self.params.min_tokens.saturating_sub(self.token_ids.len())
    }

    /// Takes a token already chosen on the backend, by its argmax (see
    /// `wants_plain_argmax`) or its sampler (see `sample_request`).
    pub(crate) fn accept_picked(&mut self, tokenizer: &Tokenizer, token: u32, logprob: Option<TokenLogprob>) -> Result<(StreamDelta, bool)> {
        if self.params.logprobs.is_some() && logprob.is_none() {
            return Err(RocketError::Internal("a device picked a token without the logprobs the request asked for".into()));
        }
        self.push_token(tokenizer, token, logprob)
    }

    fn push_token(&mut self, tokenizer: &Tokenizer, token: u32, logprob: Option<TokenLogprob>) -> Result<(StreamDelta, bool)> {
        let step = self.token_ids.len();
        self.history.push(token);
        self.token_ids.push(token);
        self.first_token_at.get_or_insert_with(|| self.started.elapsed().as_secs_f64());

        let last_step = step + 1 == self.params.max_tokens;
        let skip = self.params.skip_special_tokens;
        if self.end_ids.contains(&token) {
            // An end id's own text is not output (as a stop string's is not, and as
            // in vLLM), unless special tokens are asked for: then the text shows every
            // token, the end one too. Bytes still pending are the final text.
            // As in vLLM, stop_reason names a token the request asked to stop at;
            // the model's own end of sequence leaves it None.
            let asked = self.params.stop_token_ids.contains(&token);
            self.finish = (FinishReason::Stop, asked.then_some(StopReason::Token(token)));
            let upto = if skip { step } else { step + 1 };
            let rest = self.detok.push(tokenizer, &self.token_ids[..upto], skip, &self.text, true)?;
            self.text.push_str(&rest);
        } else {
            let searched_upto = self.text.len();
            let new_text = self.detok.push(tokenizer, &self.token_ids, skip, &self.text, last_step)?;
            self.text.push_str(&new_text);
            // No stop string ends the text before min_tokens tokens (as end ids cannot).
            let stop = if step + 1 >= self.params.min_tokens {
                find_stop(&self.text, searched_upto.saturating_sub(self.max_stop_len), &self.params.stop)
            } else {
                None
            };
            if let Some((at, stop)) = stop {
                self.text.truncate(at);
                self.finish = (FinishReason::Stop, Some(StopReason::String(stop)));
            }
        }
        let done = self.finish.0 == FinishReason::Stop || last_step;
        let settled = if done { self.text.len() } else { settled_len(&self.text, &self.params.stop) };
        let delta_text = if settled > self.emitted { self.text[self.emitted..settled].to_string() } else { String::new() };
        self.emitted = self.emitted.max(settled);
        if let (Some(all), Some(lp)) = (self.token_logprobs.as_mut(), logprob.as_ref()) {
            all.push(lp.clone());
        }
        Ok((StreamDelta { text: delta_text, token_id: token, logprob: logprob.map(|l| l.logprob) }, done))
    }

    /// The last sampled token: the next step's input.
    pub(crate) fn last_token(&self) -> Option<u32> {
        self.token_ids.last().copied()
    }

    /// Stops before the natural end: the text is what was already streamed.
    pub(crate) fn cancel(&mut self) {
        self.text.truncate(self.emitted);
        self.finish = (FinishReason::Cancelled, None);
    }

    pub(crate) fn finish(self) -> RequestOutput {
        let total = self.started.elapsed().as_secs_f64();
        let ttft = self.first_token_at.unwrap_or(total);
        let decode_tokens = self.token_ids.len().saturating_sub(1);
        let metrics = Metrics {
            time_to_first_token: ttft,
            decode_tokens_per_second: if total > ttft { decode_tokens as f64 / (total - ttft) } else { 0.0 },
            prompt_tokens: self.prompt_ids.len(),
            output_tokens: self.token_ids.len(),
            total_seconds: total,
            max_batch_size: self.max_batch_size,
            cached_prompt_tokens: self.cached_prompt_tokens,
        };
        RequestOutput {
            prompt: self.prompt,
            prompt_token_ids: self.prompt_ids,
            text: self.text,
            token_ids: self.token_ids,
            finish_reason: self.finish.0,
            stop_reason: self.finish.1,
            logprobs: self.token_logprobs,
            metrics,
        }
    }
}

/// Incremental detokenisation in O(new tokens) per step (vLLM's prefix/read
/// offsets): decode a short window of recent tokens and release what the newest
/// token added, once it no longer ends in an incomplete UTF-8 sequence.
#[derive(Default)]
struct Detokenizer {
    prefix_offset: usize,
    read_offset: usize,
}

impl Detokenizer {
    /// New text completed by the tokens after `read_offset`. `flush` releases an
    /// incomplete trailing sequence too (as U+FFFD, as a full decode would).
    fn push(&mut self, tok: &Tokenizer, ids: &[u32], skip: bool, so_far: &str, flush: bool) -> Result<String> {
        if self.read_offset == ids.len() {
            return Ok(String::new());
        }
        let prefix = tok.decode(&ids[self.prefix_offset..self.read_offset], skip)?;
        let window = tok.decode(&ids[self.prefix_offset..], skip)?;
        let new = match window.strip_prefix(prefix.as_str()) {
            Some(new) => new.to_string(),
            None => {
                // The window decoded differently from its prefix: fall back to a
                // full decode (never seen with byte-level BPE tokenizers).
                let full = tok.decode(ids, skip)?;
                full.strip_prefix(so_far).unwrap_or_default().to_string()
            }
        };
        if !flush && (new.is_empty() || new.ends_with('\u{FFFD}')) {
            return Ok(String::new());
        }
        self.prefix_offset = self.read_offset;
        self.read_offset = ids.len();
        Ok(new)
    }
}

/// The first stop string in `text` that starts at or after `from`, as (byte offset, string).
fn find_stop(text: &str, from: usize, stops: &[String]) -> Option<(usize, String)> {
    let mut from = from.min(text.len());
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    stops
        .iter()
        .filter_map(|s| text[from..].find(s.as_str()).map(|i| (from + i, s.clone())))
        .min_by_key(|(i, _)| *i)
}

/// How much of `text` can be released: not a trailing incomplete UTF-8 sequence
/// (decoded as U+FFFD), nor the longest tail that begins one of `stops` (the
/// next tokens may complete it). Text that cannot start a stop string goes out
/// with the token that made it.
fn settled_len(text: &str, stops: &[String]) -> usize {
    let end = text.trim_end_matches('\u{FFFD}').len();
    let head = &text[..end];
    // A whole stop string in the text has ended the request already: only proper prefixes are held.
    let held = stops
        .iter()
        .filter_map(|stop| {
            (1..stop.len().min(end + 1))
                .rev()
                .find(|&k| stop.is_char_boundary(k) && head.ends_with(&stop[..k]))
        })
        .max()
        .unwrap_or(0);
    end - held
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn only_a_tail_that_may_start_a_stop_string_is_held_back() {
        // Nothing in " Paris." can begin "xyz" or "answer": all of it goes out.
        assert_eq!(settled_len(" Paris.", &stops(&["xyz"])), 7);
        assert_eq!(settled_len(" Paris.", &stops(&["answer"])), 7);
        // "an" may become "answer"; "x" may become "xyz": the longest such tail waits.
        assert_eq!(settled_len("The an", &stops(&["answer", "xyz"])), 4);
        assert_eq!(settled_len("max", &stops(&["answer", "xyz"])), 2);
        assert_eq!(settled_len("The answ", &stops(&["answer", "wer!"])), 4);
        // A stop string longer than the text: the whole text may be its start.
        assert_eq!(settled_len("ans", &stops(&["answer"])), 0);
        // No stop strings: everything but a pending incomplete character.
        assert_eq!(settled_len("abc", &[]), 3);
        assert_eq!(settled_len("abc\u{FFFD}", &[]), 3);
        // Multi-byte characters: held back whole, and never split.
        assert_eq!(settled_len("x é", &stops(&["éa"])), 2);
        assert_eq!(settled_len("x \u{e9}", &stops(&["\u{e9}\u{e9}"])), 2);
        assert_eq!(settled_len("x \u{e9}", &stops(&["\u{e8}"])), 4);
    }
}
