//! The sampling flags shared by `generate`, `chat` and `bench`: every field of
//! `rocket_core::SamplingOptions` but `max_tokens` (each command words its own
//! length). Unset flags stay unset, so `Engine::resolve` fills them from the
//! model's generation_config exactly as for the Python API and the server.
//! Numbers may be negative on the command line (`-t -1`) so that the resolver,
//! not clap, answers with the field's allowed range.

use rocket_core::SamplingOptions;

/// An integer count (`--max-tokens`, `--top-k`, ...): a negative value is
/// reported with the range instead of as "invalid digit".
pub(crate) fn count(s: &str) -> Result<usize, String> {
    match s.trim().parse::<i128>() {
        Ok(v) if v < 0 => Err(format!("must be an integer >= 0, got {v}")),
        Ok(v) => usize::try_from(v).map_err(|_| format!("is too large: {v}")),
        Err(_) => Err(format!("must be an integer >= 0, got {s:?}")),
    }
}

/// A count that must be at least 1 (`--max-tokens`).
pub(crate) fn positive_count(s: &str) -> Result<usize, String> {
    match s.trim().parse::<i128>() {
        Ok(v) if v < 1 => Err(format!("must be an integer >= 1, got {v}")),
        Ok(v) => usize::try_from(v).map_err(|_| format!("is too large: {v}")),
        Err(_) => Err(format!("must be an integer >= 1, got {s:?}")),
    }
}

/// `--top-k`: a count, or -1 for off as in vLLM (and the server and Python).
fn top_k(s: &str) -> Result<usize, String> {
    match s.trim().parse::<i128>() {
        Ok(-1) => Ok(0),
        Ok(v) if v < 0 => Err(format!("must be an integer >= 0 (or -1: off), got {v}")),
        _ => count(s),
    }
}

fn seed(s: &str) -> Result<u64, String> {
    match s.trim().parse::<i128>() {
        Ok(v) if v < 0 => Err(format!("must be an integer in [0, 2^64), got {v}")),
        Ok(v) => u64::try_from(v).map_err(|_| format!("must be an integer in [0, 2^64), got {v}")),
        Err(_) => Err(format!("must be an integer in [0, 2^64), got {s:?}")),
    }
}

/// A sampling number: one past f32's range is refused as given, not as the inf
/// or 0 it would round to (the resolver checks the field's own range).
fn number(s: &str) -> Result<f32, String> {
    let x: f64 = s.trim().parse().map_err(|_| format!("must be a number, got {s:?}"))?;
    crate::reason(rocket_core::sampling_options::sampling_f32("", x))
}

fn token_id(s: &str) -> Result<u32, String> {
    match s.trim().parse::<i128>() {
        Ok(v) if (0..=u32::MAX as i128).contains(&v) => Ok(v as u32),
        _ => Err(format!("must be a token id (an integer >= 0), got {s:?}")),
    }
}

#[derive(clap::Args, Clone, Debug, Default)]
pub(crate) struct SamplingArgs {
    /// 0 = greedy [default: generation_config's when it sets do_sample, else 0]
    #[arg(long, short = 't', allow_negative_numbers = true, value_parser = number)]
    pub temperature: Option<f32>,
    /// Keep the k most likely tokens, 0 or -1 = off [default: generation_config, else 0]
    #[arg(long, allow_negative_numbers = true, value_parser = top_k)]
    pub top_k: Option<usize>,
    /// Nucleus sampling threshold in (0, 1] [default: generation_config, else 1]
    #[arg(long, allow_negative_numbers = true, value_parser = number)]
    pub top_p: Option<f32>,
    /// Drop tokens below MIN_P x the top probability, in [0, 1] [default: 0]
    #[arg(long, allow_negative_numbers = true, value_parser = number)]
    pub min_p: Option<f32>,
    /// Suppress end tokens until this many tokens exist [default: 0]
    #[arg(long, allow_negative_numbers = true, value_parser = count)]
    pub min_tokens: Option<usize>,
    /// Penalise tokens already seen: a positive logit is divided by it, a negative one
    /// multiplied (HF's rule); > 0, 1 = off [default: generation_config, else 1]
    #[arg(long, allow_negative_numbers = true, value_parser = number)]
    pub repetition_penalty: Option<f32>,
    /// Subtract from logits of generated tokens, in [-2, 2] [default: 0]
    #[arg(long, allow_negative_numbers = true, value_parser = number)]
    pub presence_penalty: Option<f32>,
    /// Subtract per occurrence from logits of generated tokens, in [-2, 2] [default: 0]
    #[arg(long, allow_negative_numbers = true, value_parser = number)]
    pub frequency_penalty: Option<f32>,
    /// Seed for sampling (same seed, same output) [default: a fresh one]
    #[arg(long, allow_negative_numbers = true, value_parser = seed)]
    pub seed: Option<u64>,
    /// A string that ends generation (repeatable)
    #[arg(long, allow_hyphen_values = true)]
    pub stop: Vec<String>,
    /// Token ids that end generation (comma separated or repeated)
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, value_parser = token_id)]
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print each token's log-probability and this many alternatives, 0..=20, to stderr
    #[arg(long, allow_negative_numbers = true, value_parser = count)]
    pub logprobs: Option<usize>,
    /// Keep special tokens in the output text (they are skipped by default)
    #[arg(long)]
    pub keep_special_tokens: bool,
}

impl SamplingArgs {
    /// The request as given; `max_tokens` unset (the command sets its own).
    pub fn options(&self) -> SamplingOptions {
        SamplingOptions {
            max_tokens: None,
            min_tokens: self.min_tokens,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs,
            skip_special_tokens: self.keep_special_tokens.then_some(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sampling: SamplingArgs,
        prompt: Option<String>,
    }

    fn parse(args: &[&str]) -> Result<SamplingArgs, String> {
        Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied())).map(|c| c.sampling).map_err(|e| e.to_string())
    }

    #[test]
    fn every_field_reaches_the_options() {
        let a = parse(&[
            "-t", "0.5", "--top-k", "4", "--top-p", "0.9", "--min-p", "0.1", "--min-tokens", "2", "--repetition-penalty", "1.1",
            "--presence-penalty", "-0.5", "--frequency-penalty", "0.25", "--seed", "9", "--stop", "\n", "--stop", "-end",
            "--stop-token-ids", "1,2", "--stop-token-ids", "3", "--ignore-eos", "--logprobs", "2", "--keep-special-tokens",
        ])
        .unwrap();
        let o = a.options();
        let want = SamplingOptions {
            max_tokens: None,
            min_tokens: Some(2),
            temperature: Some(0.5),
            top_k: Some(4),
            top_p: Some(0.9),
            min_p: Some(0.1),
            repetition_penalty: Some(1.1),
            presence_penalty: Some(-0.5),
            frequency_penalty: Some(0.25),
            seed: Some(9),
            stop: vec!["\n".into(), "-end".into()],
            stop_token_ids: vec![1, 2, 3],
            ignore_eos: true,
            logprobs: Some(2),
            skip_special_tokens: Some(false),
        };
        assert_eq!(o, want);
        assert_eq!(parse(&[]).unwrap().options(), SamplingOptions::default());
    }

    #[test]
    fn negative_numbers_are_values_not_flags() {
        // Parsed as numbers; the resolver's range check answers (with the field's name).
        assert_eq!(parse(&["-t", "-1", "p"]).unwrap().temperature, Some(-1.0));
        assert!(parse(&["-t", "-1", "p"]).unwrap().options().check_ranges().is_err());
        assert_eq!(parse(&["--presence-penalty", "-3"]).unwrap().presence_penalty, Some(-3.0));
        // -1 is top-k off, as in vLLM, the server and Python.
        assert_eq!(parse(&["--top-k", "-1"]).unwrap().top_k, Some(0));
        for (args, want) in [
            (&["--top-k", "-2"][..], "must be an integer >= 0 (or -1: off), got -2"),
            (&["--top-k", "x"][..], "must be an integer >= 0, got \"x\""),
            (&["--seed", "-5"][..], "must be an integer in [0, 2^64), got -5"),
            (&["--stop-token-ids", "-2"][..], "must be a token id"),
            (&["--logprobs", "-1"][..], "must be an integer >= 0, got -1"),
        ] {
            let e = parse(args).unwrap_err();
            assert!(e.contains(want) && !e.contains("-- -"), "{args:?}: {e}");
        }
    }

    #[test]
    fn numbers_past_f32_are_refused_as_given() {
        for (args, given) in [(&["-t", "1e300"][..], "1e300"), (&["--top-p", "1e-300"][..], "1e-300"), (&["--min-p", "-1e60"][..], "-1e60")] {
            let e = parse(args).unwrap_err();
            assert!(e.contains("32-bit float") && e.contains(given), "{args:?}: {e}");
        }
        assert!(parse(&["-t", "warm"]).unwrap_err().contains("must be a number"));
        // As the server and Python read them: through f64.
        assert_eq!(parse(&["--top-p", "0.9"]).unwrap().top_p, Some(0.9f64 as f32));
    }
}
