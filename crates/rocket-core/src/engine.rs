//! The engine: loads a model, picks a backend, and turns prompts into outputs.
//! Generation policy (limits, stopping, detokenisation) lives here, above the
//! backends, so every backend inherits it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, Device, Logits};
use crate::error::{Result, RocketError};
use crate::model::{Format, GenerationConfig, ModelSource, ModelSpec, ModelWeights};
use crate::sampling::{fresh_seed, logprobs, process_logits, sample, SamplingParams, TokenHistory};
use crate::text::{ChatMessage, ChatTemplate, Tokenizer};

#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub device: Device,
    /// Context limit (prompt + generated tokens); defaults to the model's
    /// trained maximum. The KV cache is sized per request, not to this.
    pub max_seq_len: Option<usize>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { device: Device::Auto, max_seq_len: None }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was generated.
    Stop,
    /// max_tokens was reached.
    Length,
    /// The caller asked to stop (a stream was dropped, Ctrl-C, a disconnect).
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Why generation stopped early.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// An end-of-sequence or stop_token_ids token (kept in token_ids).
    Token(u32),
    /// A stop string (cut from the text).
    String(String),
}

/// One generated token as streamed.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamDelta {
    /// New settled text (may be empty while text is held back).
    pub text: String,
    pub token_id: u32,
    /// Log-probability of the token when logprobs were requested.
    pub logprob: Option<f32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// The most likely alternatives, most likely first.
    pub top: Vec<(u32, f32)>,
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
/// (decoded as U+FFFD), nor the last `max_stop_len - 1` bytes, which could be the
/// start of a stop string.
fn settled_len(text: &str, max_stop_len: usize) -> usize {
    let mut end = text.trim_end_matches('\u{FFFD}').len();
    end = end.saturating_sub(max_stop_len.saturating_sub(1));
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    end
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    /// Seconds from the call to the first generated token (prefill included).
    pub time_to_first_token: f64,
    /// Generated tokens after the first, per second of decoding.
    pub decode_tokens_per_second: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub total_seconds: f64,
}

#[derive(Debug, Clone)]
pub struct RequestOutput {
    pub prompt: String,
    pub prompt_token_ids: Vec<u32>,
    pub text: String,
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub stop_reason: Option<StopReason>,
    /// Per generated token, when `SamplingParams::logprobs` was set.
    pub logprobs: Option<Vec<TokenLogprob>>,
    pub metrics: Metrics,
}

/// Information about the loaded model, for `inspect` and callers.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub format: Format,
    pub spec: ModelSpec,
    pub dtype_groups: Vec<(&'static str, String)>,
    pub bytes_per_decode_step: usize,
    pub tokenizer_size: usize,
    pub has_chat_template: bool,
    pub eos_token_ids: Vec<u32>,
    pub load_seconds: f64,
    pub max_seq_len: usize,
    pub backend: &'static str,
}

pub struct Engine {
    backend: Box<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    chat: Option<ChatTemplate>,
    generation: GenerationConfig,
    info: ModelInfo,
}

impl Engine {
    pub fn load(path: impl AsRef<Path>, options: EngineOptions) -> Result<Self> {
        let start = Instant::now();
        let source = ModelSource::open(path.as_ref())?;
        let spec = source.spec.clone();
        let max_seq_len = match options.max_seq_len {
            None => spec.max_position_embeddings,
            Some(0) => return Err(RocketError::invalid_arg("max_seq_len", 0, "must be at least 1")),
            Some(n) if n > spec.max_position_embeddings => {
                return Err(RocketError::invalid_arg(
                    "max_seq_len",
                    n,
                    format!("must be at most the model's max_position_embeddings ({})", spec.max_position_embeddings),
                ))
            }
            Some(n) => n,
        };
        let weights = Arc::new(ModelWeights::from_weights(&spec, source.weights)?);
        let dtype_groups = weights.dtype_groups();
        let bytes_per_decode_step = weights.bytes_per_decode_step();
        let backend: Box<dyn Backend> = match options.device {
            Device::Auto | Device::Cpu => Box::new(CpuBackend::new(spec.clone(), weights)),
            Device::Cuda => {
                return Err(RocketError::Device(
                    "this build of rocket has no CUDA backend; use device=\"cpu\" or \"auto\"".into(),
                ))
            }
        };
        let chat = source
            .chat_template
            .as_deref()
            .map(|t| ChatTemplate::new(t, &source.special.bos_token, &source.special.eos_token))
            .transpose()?;
        let info = ModelInfo {
            path: source.path,
            format: source.format,
            spec,
            dtype_groups,
            bytes_per_decode_step,
            tokenizer_size: source.tokenizer.vocab_size(),
            has_chat_template: chat.is_some(),
            eos_token_ids: source.generation.eos_token_ids.clone(),
            load_seconds: start.elapsed().as_secs_f64(),
            max_seq_len,
            backend: backend.name(),
        };
        Ok(Engine { backend, tokenizer: Arc::new(source.tokenizer), chat, generation: source.generation, info })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.info.spec
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn generation_config(&self) -> &GenerationConfig {
        &self.generation
    }

    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let chat = self
            .chat
            .as_ref()
            .ok_or_else(|| RocketError::ChatTemplate("this model has no chat template".into()))?;
        chat.render(messages, add_generation_prompt)
    }

    /// Tokenise a prompt the way generation does (with the tokenizer's special-token rules).
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(RocketError::EmptyPrompt);
        }
        let ids = self.tokenizer.encode(prompt, true)?;
        if ids.is_empty() {
            return Err(RocketError::EmptyPrompt);
        }
        Ok(ids)
    }

    pub fn generate(&self, prompt: &str, params: &SamplingParams) -> Result<RequestOutput> {
        let ids = self.encode_prompt(prompt)?;
        self.generate_ids(prompt.to_string(), ids, params, &mut |_| true)
    }

    pub fn generate_batch(&self, prompts: &[String], params: &SamplingParams) -> Result<Vec<RequestOutput>> {
        prompts.iter().map(|p| self.generate(p, params)).collect()
    }

    /// Generate from token ids. `on_delta` receives every generated token with the
    /// text it completes; the deltas' text concatenates to the output's `text`.
    /// Text that could still turn into a stop string, or an incomplete UTF-8
    /// sequence, is held back until it is settled. Returning false from
    /// `on_delta` cancels the request (finish_reason `Cancelled`).
    pub fn generate_ids(
        &self,
        prompt: String,
        prompt_ids: Vec<u32>,
        params: &SamplingParams,
        on_delta: &mut dyn FnMut(&StreamDelta) -> bool,
    ) -> Result<RequestOutput> {
        params.validate()?;
        self.check_fits(prompt_ids.len(), params.max_tokens)?;
        let started = Instant::now();
        let seed = params.seed.unwrap_or_else(fresh_seed);
        let mut end_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            end_ids.extend(&self.info.eos_token_ids);
        }
        let max_stop_len = params.stop.iter().map(String::len).max().unwrap_or(0);
        let mut history = TokenHistory::new(&prompt_ids);
        let mut session = self.backend.new_session(prompt_ids.len() + params.max_tokens)?;
        let mut logits = session.forward(&prompt_ids, Logits::Last)?;
        let mut token_ids = Vec::with_capacity(params.max_tokens);
        let mut token_logprobs = params.logprobs.map(|_| Vec::with_capacity(params.max_tokens));
        let mut first_token_at = None;
        let mut text = String::new();
        let mut emitted = 0usize;
        let mut finish = (FinishReason::Length, None);
        for step in 0..params.max_tokens {
            let mut processed = logits.clone();
            process_logits(&mut processed, params, &history, &end_ids);
            let token = sample(&processed, params, seed, step as u64);
            let logprob = params.logprobs.map(|n| {
                let (lp, top) = logprobs(&logits, token, n);
                TokenLogprob { token_id: token, logprob: lp, top }
            });
            history.push(token);
            token_ids.push(token);
            first_token_at.get_or_insert_with(|| started.elapsed().as_secs_f64());

            let searched_upto = text.len();
            text = self.tokenizer.decode(&token_ids, params.skip_special_tokens)?;
            if let Some((at, stop)) = find_stop(&text, searched_upto.saturating_sub(max_stop_len), &params.stop) {
                text.truncate(at);
                finish = (FinishReason::Stop, Some(StopReason::String(stop)));
            } else if end_ids.contains(&token) {
                finish = (FinishReason::Stop, Some(StopReason::Token(token)));
            }
            let done = finish.1.is_some() || step + 1 == params.max_tokens;
            let settled = if done { text.len() } else { settled_len(&text, max_stop_len) };
            let delta_text = if settled > emitted { text[emitted..settled].to_string() } else { String::new() };
            emitted = emitted.max(settled);
            let keep_going =
                on_delta(&StreamDelta { text: delta_text, token_id: token, logprob: logprob.as_ref().map(|l| l.logprob) });
            if let (Some(all), Some(lp)) = (token_logprobs.as_mut(), logprob) {
                all.push(lp);
            }
            if !keep_going && !done {
                text.truncate(emitted);
                finish = (FinishReason::Cancelled, None);
                break;
            }
            if done {
                break;
            }
            logits = session.forward(&[token], Logits::Last)?;
        }
        let total = started.elapsed().as_secs_f64();
        let ttft = first_token_at.unwrap_or(total);
        let decode_tokens = token_ids.len().saturating_sub(1);
        let metrics = Metrics {
            time_to_first_token: ttft,
            decode_tokens_per_second: if total > ttft { decode_tokens as f64 / (total - ttft) } else { 0.0 },
            prompt_tokens: prompt_ids.len(),
            output_tokens: token_ids.len(),
            total_seconds: total,
        };
        Ok(RequestOutput {
            prompt,
            prompt_token_ids: prompt_ids,
            text,
            token_ids,
            finish_reason: finish.0,
            stop_reason: finish.1,
            logprobs: token_logprobs,
            metrics,
        })
    }

    /// Logits at every position of `ids` in one pass ([len][vocab], row-major).
    pub fn teacher_forced_logits(&self, ids: &[u32]) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(RocketError::EmptyPrompt);
        }
        self.check_fits(ids.len(), 0)?;
        let mut session = self.backend.new_session(ids.len())?;
        session.forward(ids, Logits::All)
    }

    fn check_fits(&self, prompt_tokens: usize, max_tokens: usize) -> Result<()> {
        if prompt_tokens == 0 {
            return Err(RocketError::EmptyPrompt);
        }
        let limit = self.info.max_seq_len;
        if prompt_tokens + max_tokens > limit {
            return Err(RocketError::ContextOverflow { prompt_tokens, max_tokens, limit });
        }
        Ok(())
    }
}
