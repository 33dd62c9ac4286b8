//! What a caller asks for ([`SamplingOptions`], every field optional) and how
//! the engine turns it into the concrete [`SamplingParams`] the batcher runs
//! ([`crate::Engine::resolve`]). Every front end (Rust, Python, the CLI, the
//! server) converts its input into `SamplingOptions` and resolves it here, so
//! the defaults and the validation exist once.
//!
//! Defaults for fields left unset:
//! - `temperature`, `top_k`, `top_p`, `repetition_penalty`: the model's
//!   generation_config, as HF transformers and vLLM read it — greedy unless it
//!   sets `do_sample: true`; an absent value means "off" (top_k 0, top_p 1,
//!   repetition_penalty 1; vLLM's reading, not HF's top_k=50).
//! - `max_tokens`: by kind of request ([`RequestKind`]): a completion of a plain
//!   prompt generates at most [`DEFAULT_COMPLETION_MAX_TOKENS`] (16, as OpenAI's
//!   completions API and vLLM), a chat turn until the context is full (as
//!   OpenAI's chat API).
//! - everything else: off (min_tokens 0, min_p 0, penalties 0, no stops,
//!   skip_special_tokens true, a fresh seed per request).
//!
//! A temperature below [`crate::sampling::MIN_TEMPERATURE`] (1e-5), given or
//! from generation_config, becomes 0: greedy, as in vLLM.

use crate::model::GenerationConfig;
use crate::sampling::{effective_temperature, SamplingParams};

/// `max_tokens` of a completion that sets none (OpenAI's and vLLM's default).
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// The kind of request, which decides the `max_tokens` default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// A continuation of a plain prompt: at most [`DEFAULT_COMPLETION_MAX_TOKENS`].
    Completion,
    /// An answer to chat messages: up to the room the context has left.
    Chat,
}

/// Sampling as a caller asks for it; `None` means "the default" (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingOptions {
    /// Tokens to generate at most (≥ 1) [default: by [`RequestKind`]].
    pub max_tokens: Option<usize>,
    /// End-of-sequence and stop tokens are suppressed until this many tokens exist [default: 0].
    pub min_tokens: Option<usize>,
    /// 0 = greedy [default: generation_config's when it sets do_sample, else 0].
    pub temperature: Option<f32>,
    /// Keep the k most likely tokens, 0 = off [default: generation_config, else 0].
    pub top_k: Option<usize>,
    /// Nucleus threshold in (0, 1] [default: generation_config, else 1].
    pub top_p: Option<f32>,
    /// Drop tokens below min_p × the top probability, in [0, 1] [default: 0].
    pub min_p: Option<f32>,
    /// HF-style repetition penalty, > 0, 1 = off [default: generation_config, else 1].
    pub repetition_penalty: Option<f32>,
    /// OpenAI-style, in [-2, 2] [default: 0].
    pub presence_penalty: Option<f32>,
    /// OpenAI-style, in [-2, 2] [default: 0].
    pub frequency_penalty: Option<f32>,
    /// Seed for sampling [default: a fresh one per request].
    pub seed: Option<u64>,
    /// Strings that end generation (cut from the output).
    pub stop: Vec<String>,
    /// Token ids that end generation (kept in token_ids, like EOS); each below the vocabulary size.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Also return log-probabilities of each chosen token and this many alternatives (0..=20).
    pub logprobs: Option<usize>,
    /// Leave special tokens out of the output text [default: true].
    pub skip_special_tokens: Option<bool>,
}

/// A concrete `SamplingParams` is a request with every field set.
impl From<&SamplingParams> for SamplingOptions {
    fn from(p: &SamplingParams) -> Self {
        SamplingOptions {
            max_tokens: Some(p.max_tokens),
            min_tokens: Some(p.min_tokens),
            temperature: Some(p.temperature),
            top_k: Some(p.top_k),
            top_p: Some(p.top_p),
            min_p: Some(p.min_p),
            repetition_penalty: Some(p.repetition_penalty),
            presence_penalty: Some(p.presence_penalty),
            frequency_penalty: Some(p.frequency_penalty),
            seed: p.seed,
            stop: p.stop.clone(),
            stop_token_ids: p.stop_token_ids.clone(),
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs,
            skip_special_tokens: Some(p.skip_special_tokens),
        }
    }
}

impl From<SamplingParams> for SamplingOptions {
    fn from(p: SamplingParams) -> Self {
        SamplingOptions::from(&p)
    }
}

impl From<&SamplingOptions> for SamplingOptions {
    fn from(o: &SamplingOptions) -> Self {
        o.clone()
    }
}

impl SamplingOptions {
    /// Greedy decoding of at most `max_tokens` tokens, the rest at defaults.
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingOptions { max_tokens: Some(max_tokens), temperature: Some(0.0), ..Self::default() }
    }

    /// Fill the unset fields from `generation` with `max_tokens` as the
    /// fallback for an unset `max_tokens`. No validation: see `Engine::resolve`.
    pub(crate) fn fill(&self, generation: &GenerationConfig, default_max_tokens: usize) -> SamplingParams {
        let g = generation;
        SamplingParams {
            max_tokens: self.max_tokens.unwrap_or(default_max_tokens),
            min_tokens: self.min_tokens.unwrap_or(0),
            temperature: effective_temperature(self.temperature.unwrap_or_else(|| {
                if g.do_sample == Some(true) { g.temperature.unwrap_or(1.0) as f32 } else { 0.0 }
            })),
            top_k: self.top_k.unwrap_or_else(|| g.top_k.unwrap_or(0) as usize),
            top_p: self.top_p.unwrap_or_else(|| g.top_p.unwrap_or(1.0) as f32),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or_else(|| g.repetition_penalty.unwrap_or(1.0) as f32),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs,
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
        }
    }

    /// The values the caller set, checked without a model (each field's range,
    /// min_tokens against max_tokens): front ends call it before loading one, so a
    /// bad flag fails at once. `Engine::resolve` checks again with the model's
    /// defaults, its vocabulary and the prompt.
    pub fn check_given(&self) -> crate::Result<()> {
        self.fill(&GenerationConfig::default(), usize::MAX).validate()
    }

    /// Unset fields at their defaults for a model with no generation_config
    /// (greedy, filters off) and an unset `max_tokens` at 16: what the bare
    /// sampler (`rocket.sample_token`) runs, with no model to resolve against.
    pub fn without_model(&self) -> SamplingParams {
        self.fill(&GenerationConfig::default(), DEFAULT_COMPLETION_MAX_TOKENS)
    }

    /// The checks that need no model: each set field within its range (the
    /// same rules `Engine::resolve` applies). For front ends that want to
    /// refuse a bad value when it is given rather than when it is used.
    pub fn check_ranges(&self) -> crate::Result<()> {
        // Neutral fills cannot fail the checks, so only set fields can.
        let neutral = GenerationConfig::default();
        let max = self.max_tokens.unwrap_or_else(|| self.min_tokens.unwrap_or(0).max(1));
        self.fill(&neutral, max).validate()
    }
}

/// A sampling number given wider than the options hold it (JSON, Python floats, the
/// command line) as its `f32`, or an error naming `parameter` with the value as
/// given: a finite value past f32's range would become inf, and a nonzero one below
/// it 0, and the range check would then report that instead. NaN and the infinities
/// pass through for the range check to refuse.
pub fn sampling_f32(parameter: &str, given: f64) -> crate::Result<f32> {
    let narrow = given as f32;
    if (given.is_finite() && narrow.is_infinite()) || (given != 0.0 && narrow == 0.0) {
        // `{:?}` writes 1e300 as such, where `{}` writes every digit.
        return Err(crate::RocketError::invalid_arg(parameter, format!("{given:?}"), "outside a 32-bit float's range: magnitudes from 1.4e-45 to 3.4e38, or 0"));
    }
    Ok(narrow)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Engine, EngineOptions, ErrorKind, RocketError};
    use serde_json::json;

    #[test]
    fn given_values_are_checked_without_a_model() {
        let bad = |o: SamplingOptions| o.check_given().unwrap_err();
        assert!(matches!(bad(SamplingOptions { temperature: Some(-1.0), ..Default::default() }), RocketError::InvalidArgument { ref parameter, .. } if parameter == "temperature"));
        assert!(matches!(bad(SamplingOptions { top_p: Some(2.0), ..Default::default() }), RocketError::InvalidArgument { ref parameter, .. } if parameter == "top_p"));
        assert!(matches!(bad(SamplingOptions { logprobs: Some(21), ..Default::default() }), RocketError::InvalidArgument { ref parameter, .. } if parameter == "logprobs"));
        let late = SamplingOptions { min_tokens: Some(20), max_tokens: Some(5), ..Default::default() };
        assert!(matches!(bad(late), RocketError::InvalidArgument { ref parameter, .. } if parameter == "min_tokens"));
        // Unset fields and an unset max_tokens are no error: the model supplies them.
        assert!(SamplingOptions { min_tokens: Some(20), ..Default::default() }.check_given().is_ok());
        assert!(SamplingOptions::default().check_given().is_ok());
    }

    #[test]
    fn numbers_past_f32_are_refused_as_given() {
        assert_eq!(sampling_f32("top_p", 0.9).unwrap(), 0.9f32);
        assert_eq!(sampling_f32("temperature", 0.0).unwrap(), 0.0);
        assert_eq!(sampling_f32("min_p", 1e-45).unwrap(), 1e-45f32);
        assert!(sampling_f32("temperature", f64::INFINITY).unwrap().is_infinite());
        assert!(sampling_f32("temperature", f64::NAN).unwrap().is_nan());
        for (name, x, shown) in [("top_p", 1e-300, "1e-300"), ("temperature", 1e300, "1e300"), ("presence_penalty", -1e39, "-1e39")] {
            let e = sampling_f32(name, x).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(&format!(": {shown} (")), "{e}");
        }
    }

    /// tiny-llama: vocabulary 512, context 256.
    fn engine(generation: serde_json::Value) -> Engine {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/parity/fixtures/tiny-llama");
        let opts = EngineOptions { device: crate::Device::Cpu, progress: crate::Progress::Off, ..EngineOptions::default() };
        Engine::load(path, opts).unwrap().with_generation_config(GenerationConfig::from_json(&generation).unwrap())
    }

    #[test]
    fn unset_fields_come_from_generation_config() {
        let sampled = engine(json!({"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1}));
        let p = sampled.resolve(&SamplingOptions::default(), RequestKind::Completion, 4).unwrap();
        assert_eq!((p.temperature, p.top_k, p.top_p, p.repetition_penalty), (0.6, 20, 0.95, 1.1));
        assert_eq!((p.max_tokens, p.min_tokens, p.min_p, p.skip_special_tokens, p.seed), (16, 0, 0.0, true, None));
        // Explicit values win, field by field.
        let o = SamplingOptions { temperature: Some(0.0), top_p: Some(0.5), max_tokens: Some(3), ..Default::default() };
        let p = sampled.resolve(&o, RequestKind::Completion, 4).unwrap();
        assert_eq!((p.temperature, p.top_k, p.top_p, p.max_tokens), (0.0, 20, 0.5, 3));
        // Without do_sample (false or absent) the default is greedy, other absent values off.
        for cfg in [json!({"do_sample": false, "temperature": 0.6, "top_p": 0.9}), json!({})] {
            let p = engine(cfg.clone()).resolve(&SamplingOptions::default(), RequestKind::Completion, 4).unwrap();
            assert_eq!(p.temperature, 0.0, "{cfg}");
        }
        let p = engine(json!({})).resolve(&SamplingOptions::default(), RequestKind::Completion, 4).unwrap();
        assert_eq!((p.top_k, p.top_p, p.repetition_penalty), (0, 1.0, 1.0));
        // do_sample without a temperature samples at 1.
        assert_eq!(engine(json!({"do_sample": true})).resolve(&SamplingOptions::default(), RequestKind::Chat, 4).unwrap().temperature, 1.0);
    }

    #[test]
    fn max_tokens_default_depends_on_the_kind() {
        let e = engine(json!({}));
        assert_eq!(e.resolve(&SamplingOptions::default(), RequestKind::Completion, 10).unwrap().max_tokens, 16);
        assert_eq!(e.resolve(&SamplingOptions::default(), RequestKind::Chat, 10).unwrap().max_tokens, 246);
        assert_eq!(e.default_max_tokens(RequestKind::Chat, 300), 1);
        // A full context is refused, not answered with 0 tokens.
        let err = e.resolve(&SamplingOptions::default(), RequestKind::Chat, 256).unwrap_err();
        assert!(matches!(err, RocketError::ContextOverflow { prompt_tokens: 256, max_tokens: 1, limit: 256 }), "{err}");
        let err = e.resolve(&SamplingOptions { max_tokens: Some(250), ..Default::default() }, RequestKind::Completion, 10).unwrap_err();
        assert!(matches!(err, RocketError::ContextOverflow { .. }), "{err}");
        // A SamplingParams is a request with every field set: resolving it changes nothing.
        let p = SamplingParams { top_k: 3, seed: Some(5), ..SamplingParams::greedy(7) };
        assert_eq!(e.resolve(&SamplingOptions::from(&p), RequestKind::Chat, 10).unwrap(), p);
    }

    #[test]
    fn temperatures_below_the_floor_decode_greedily() {
        let e = engine(json!({"do_sample": true, "temperature": 1e-7}));
        let t = |o: SamplingOptions| e.resolve(&o, RequestKind::Completion, 4).unwrap().temperature;
        for tiny in [f32::from_bits(1), 1e-45, 1e-38, 3e-38, 9.99e-6] {
            assert_eq!(t(SamplingOptions { temperature: Some(tiny), ..Default::default() }), 0.0, "{tiny:e}");
        }
        assert_eq!(t(SamplingOptions::default()), 0.0, "generation_config's temperature too");
        assert_eq!(t(SamplingOptions { temperature: Some(1e-5), ..Default::default() }), 1e-5);
        assert_eq!(t(SamplingOptions { temperature: Some(0.7), ..Default::default() }), 0.7);
        // The same tokens as greedy, where the race keys would all tie at infinity.
        let greedy = e.generate("hello", &SamplingOptions { max_tokens: Some(8), ..SamplingOptions::greedy(8) }).unwrap();
        let tiny = e.generate("hello", &SamplingOptions { max_tokens: Some(8), temperature: Some(1e-45), seed: Some(1), ..Default::default() }).unwrap();
        assert_eq!(tiny.token_ids, greedy.token_ids);
    }

    #[test]
    fn each_bad_field_is_named() {
        let e = engine(json!({"do_sample": true, "temperature": 0.7}));
        let d = SamplingOptions::default;
        let cases = [
            (SamplingOptions { max_tokens: Some(0), ..d() }, "max_tokens"),
            (SamplingOptions { max_tokens: Some(4), min_tokens: Some(5), ..d() }, "min_tokens"),
            // Against the default max_tokens (16) too.
            (SamplingOptions { min_tokens: Some(17), ..d() }, "min_tokens"),
            (SamplingOptions { temperature: Some(-1.0), ..d() }, "temperature"),
            (SamplingOptions { temperature: Some(f32::NAN), ..d() }, "temperature"),
            (SamplingOptions { top_p: Some(0.0), ..d() }, "top_p"),
            (SamplingOptions { top_p: Some(1.5), ..d() }, "top_p"),
            (SamplingOptions { min_p: Some(-0.1), ..d() }, "min_p"),
            (SamplingOptions { repetition_penalty: Some(0.0), ..d() }, "repetition_penalty"),
            (SamplingOptions { presence_penalty: Some(2.5), ..d() }, "presence_penalty"),
            (SamplingOptions { frequency_penalty: Some(-3.0), ..d() }, "frequency_penalty"),
            (SamplingOptions { stop: vec!["".into()], ..d() }, "stop"),
            (SamplingOptions { logprobs: Some(21), ..d() }, "logprobs"),
            (SamplingOptions { stop_token_ids: vec![3, 512], ..d() }, "stop_token_ids"),
        ];
        for (o, field) in cases {
            let err = e.resolve(&o, RequestKind::Completion, 4).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{o:?}");
            match &err {
                RocketError::InvalidArgument { parameter, .. } => assert_eq!(parameter, field, "{o:?}"),
                other => panic!("{other}"),
            }
            // The model-free check agrees on everything but the vocabulary.
            if field != "stop_token_ids" && !(field == "min_tokens" && o.max_tokens.is_none()) {
                assert!(o.check_ranges().is_err(), "{o:?}");
            }
        }
        assert!(e.resolve(&SamplingOptions { stop_token_ids: vec![511], ..d() }, RequestKind::Completion, 4).is_ok());
        assert!(SamplingOptions { min_tokens: Some(40), ..d() }.check_ranges().is_ok(), "no max_tokens yet: min_tokens is checked when resolved");
    }
}
