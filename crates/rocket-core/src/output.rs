//! What a request produces: its final output, the deltas it streams, and why
//! it stopped. The bottom of the engine → batch → request chain: everything
//! above builds these, nothing here depends on how they are made.

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
    /// A `stop_token_ids` token (kept in token_ids). The model's own end of
    /// sequence stops with no reason, as in vLLM.
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

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    /// Seconds from the call to the first generated token (prefill included).
    pub time_to_first_token: f64,
    /// Generated tokens after the first, per second of decoding.
    pub decode_tokens_per_second: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub total_seconds: f64,
    /// The most requests in one forward pass with this one (itself included):
    /// 1 when it ran alone, more when it shared passes with other requests.
    pub max_batch_size: usize,
    /// Prompt tokens whose KV came from the prefix cache (their prefill was
    /// skipped; see `prefix_cache`): 0 when nothing was reused.
    pub cached_prompt_tokens: usize,
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
