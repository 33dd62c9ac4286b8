//! Request bodies of `/v1/completions` and `/v1/chat/completions`: parsed from
//! JSON by hand so that every type or range error names the field at fault.
//! Fields rocket does not know are ignored (as vLLM does); OpenAI features it
//! does not implement (n > 1, tools, logit_bias, ...) are refused with a 400.

use rocket_core::model::{GenerationConfig, UnsetFields};
use rocket_core::sampling::MAX_LOGPROBS;
use rocket_core::{ChatMessage, SamplingParams};
use serde_json::{Map, Value};

use super::errors::ApiError;

type Result<T> = std::result::Result<T, ApiError>;

/// OpenAI's default `max_tokens` for the legacy completions endpoint.
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parse a request body into a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid_json("the request body is empty; expected a JSON object"));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(ApiError::invalid_json(format!("the request body must be a JSON object, not {}", type_name(&other)))),
        Err(e) => Err(ApiError::invalid_json(format!("the request body is not valid JSON: {e}"))),
    }
}

/// Typed access to a request object's fields; `null` counts as absent.
pub struct Fields<'a> {
    obj: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    pub fn new(obj: &'a Map<String, Value>) -> Self {
        Fields { obj }
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn wrong(name: &str, expected: &str, v: &Value) -> ApiError {
        ApiError::invalid_type(name, format!("'{name}' must be {expected}, not {}", type_name(v)))
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong(name, "a boolean", v)),
        }
    }

    pub fn string(&self, name: &str) -> Result<Option<&'a str>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(Self::wrong(name, "a string", v)),
        }
    }

    pub fn number(&self, name: &str) -> Result<Option<f64>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(v) => Err(Self::wrong(name, "a number", v)),
        }
    }

    /// A number within `[lo, hi]`.
    pub fn number_in(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f64>> {
        let v = self.number(name)?;
        match v {
            Some(x) if !(lo..=hi).contains(&x) => {
                Err(ApiError::invalid_value(name, format!("'{name}' must be between {lo} and {hi}, got {x}")))
            }
            _ => Ok(v),
        }
    }

    pub fn integer(&self, name: &str) -> Result<Option<i64>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => match (n.as_i64(), n.as_f64()) {
                (Some(i), _) => Ok(Some(i)),
                // Integral floats (`5.0`) are accepted, as Python's pydantic does.
                (None, Some(f)) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
                (None, _) if n.as_u64().is_some() => {
                    Err(ApiError::invalid_value(name, format!("'{name}' is out of range: {n}")))
                }
                _ => Err(ApiError::invalid_type(name, format!("'{name}' must be an integer, not {n}"))),
            },
            Some(v) => Err(Self::wrong(name, "an integer", v)),
        }
    }

    /// An integer `>= min`.
    pub fn integer_min(&self, name: &str, min: i64) -> Result<Option<i64>> {
        let v = self.integer(name)?;
        match v {
            Some(x) if x < min => Err(ApiError::invalid_value(name, format!("'{name}' must be at least {min}, got {x}"))),
            _ => Ok(v),
        }
    }

    /// A string or a list of strings (`stop`).
    pub fn strings(&self, name: &str) -> Result<Vec<String>> {
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(ApiError::invalid_type(
                        name,
                        format!("'{name}[{i}]' must be a string, not {}", type_name(other)),
                    )),
                })
                .collect(),
            Some(v) => Err(Self::wrong(name, "a string or an array of strings", v)),
        }
    }

    /// A list of token ids.
    pub fn token_ids(&self, name: &str) -> Result<Vec<u32>> {
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => token_id_list(name, items),
            Some(v) => Err(Self::wrong(name, "an array of token ids", v)),
        }
    }
}

fn token_id_list(name: &str, items: &[Value]) -> Result<Vec<u32>> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(id) if id <= u32::MAX as u64 => Ok(id as u32),
            _ => Err(ApiError::invalid_type(name, format!("'{name}[{i}]' must be a token id (an integer >= 0), not {v}"))),
        })
        .collect()
}

/// Sampling fields shared by both endpoints, as given (unset ones are `None`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sampling {
    pub max_tokens: Option<usize>,
    pub min_tokens: usize,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: f32,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
}

impl Sampling {
    /// `max_tokens_fields` are the names that set max_tokens, in priority order.
    fn parse(f: &Fields<'_>, max_tokens_fields: &[&str]) -> Result<Self> {
        let mut max_tokens = None;
        for name in max_tokens_fields {
            if let Some(n) = f.integer_min(name, 1)? {
                max_tokens.get_or_insert(n as usize);
            }
        }
        let min_tokens = f.integer_min("min_tokens", 0)?.unwrap_or(0) as usize;
        if let Some(max) = max_tokens.filter(|&m| min_tokens > m) {
            return Err(ApiError::invalid_value(
                "min_tokens",
                format!("'min_tokens' ({min_tokens}) must not exceed max_tokens ({max})"),
            ));
        }
        let temperature = f.number("temperature")?;
        if let Some(t) = temperature.filter(|t| *t < 0.0) {
            return Err(ApiError::invalid_value("temperature", format!("'temperature' must be >= 0 (0 = greedy), got {t}")));
        }
        let top_p = f.number("top_p")?;
        if let Some(p) = top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(ApiError::invalid_value("top_p", format!("'top_p' must be in (0, 1], got {p}")));
        }
        // vLLM spells "off" as -1; rocket as 0.
        let top_k = f.integer_min("top_k", -1)?.map(|k| k.max(0) as usize);
        let repetition_penalty = f.number("repetition_penalty")?;
        if let Some(r) = repetition_penalty.filter(|r| *r <= 0.0) {
            return Err(ApiError::invalid_value(
                "repetition_penalty",
                format!("'repetition_penalty' must be > 0 (1 = off), got {r}"),
            ));
        }
        let seed = f.integer("seed")?.map(|s| s as u64);
        let stop = f.strings("stop")?;
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid_value("stop", "stop strings must not be empty"));
        }
        Ok(Sampling {
            max_tokens,
            min_tokens,
            temperature: temperature.map(|t| t as f32),
            top_k,
            top_p: top_p.map(|p| p as f32),
            min_p: f.number_in("min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
            repetition_penalty: repetition_penalty.map(|r| r as f32),
            presence_penalty: f.number_in("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
            frequency_penalty: f.number_in("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
            seed,
            stop,
            stop_token_ids: f.token_ids("stop_token_ids")?,
            ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
            skip_special_tokens: f.bool("skip_special_tokens")?.unwrap_or(true),
        })
    }

    /// Engine parameters: unset fields from the model's generation_config, as
    /// `rocket generate` and the Python API do.
    pub fn to_params(&self, max_tokens: usize, logprobs: Option<usize>, generation: &GenerationConfig) -> SamplingParams {
        let mut params = SamplingParams {
            max_tokens,
            min_tokens: self.min_tokens,
            temperature: self.temperature.unwrap_or_default(),
            top_k: self.top_k.unwrap_or_default(),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs,
            skip_special_tokens: self.skip_special_tokens,
        };
        let unset = UnsetFields {
            temperature: self.temperature.is_none(),
            top_k: self.top_k.is_none(),
            top_p: self.top_p.is_none(),
            repetition_penalty: self.repetition_penalty.is_none(),
        };
        generation.fill_defaults(&mut params, unset);
        params
    }
}

/// `stream` and `stream_options.include_usage`.
fn parse_stream(f: &Fields<'_>, obj: &Map<String, Value>) -> Result<(bool, bool)> {
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options").filter(|v| !v.is_null()) {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid_value("stream_options", "'stream_options' is only allowed when 'stream' is true"));
            }
            match o.get("include_usage").filter(|v| !v.is_null()) {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(ApiError::invalid_type(
                        "stream_options",
                        format!("'stream_options.include_usage' must be a boolean, not {}", type_name(v)),
                    ))
                }
            }
        }
        Some(v) => return Err(Fields::wrong("stream_options", "an object", v)),
    };
    Ok((stream, include_usage))
}

/// Refuse what rocket does not implement rather than silently ignore it.
fn refuse_unsupported(f: &Fields<'_>, obj: &Map<String, Value>) -> Result<()> {
    if let Some(n) = f.integer("n")? {
        if n != 1 {
            return Err(ApiError::unsupported("n", format!("only n=1 is supported, got {n}")));
        }
    }
    match obj.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) if m.is_empty() => {}
        Some(Value::Object(_)) => return Err(ApiError::unsupported("logit_bias", "'logit_bias' is not supported")),
        Some(v) => return Err(Fields::wrong("logit_bias", "an object", v)),
    }
    Ok(())
}

fn parse_model(f: &Fields<'_>) -> Result<Option<String>> {
    Ok(f.string("model")?.map(str::to_string))
}

/// A completions prompt: text, or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub stream: bool,
    pub include_usage: bool,
    pub echo: bool,
    /// Legacy `logprobs: N`: the chosen token's and N alternatives' log-probabilities.
    pub logprobs: Option<usize>,
    pub sampling: Sampling,
}

fn parse_prompt(v: Option<&Value>) -> Result<Prompt> {
    let one_only = || ApiError::unsupported("prompt", "only one prompt per request is supported");
    match v {
        None | Some(Value::Null) => Err(ApiError::missing("prompt")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Err(ApiError::invalid_value("prompt", "'prompt' must not be empty")),
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [Value::Array(ids)] => Ok(Prompt::Ids(token_id_list("prompt", ids)?)),
            [Value::Number(_), ..] => Ok(Prompt::Ids(token_id_list("prompt", items)?)),
            [Value::String(_) | Value::Array(_), _, ..] => Err(one_only()),
            [other, ..] => Err(ApiError::invalid_type(
                "prompt",
                format!("'prompt' must be a string, an array of token ids, or a one-element array of either; found {}", type_name(other)),
            )),
        },
        Some(v) => Err(Fields::wrong("prompt", "a string or an array of token ids", v)),
    }
}

impl CompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self> {
        let obj = parse_object(body)?;
        let f = Fields::new(&obj);
        let model = parse_model(&f)?;
        let prompt = parse_prompt(obj.get("prompt"))?;
        refuse_unsupported(&f, &obj)?;
        if let Some(b) = f.integer("best_of")? {
            if b != 1 {
                return Err(ApiError::unsupported("best_of", format!("only best_of=1 is supported, got {b}")));
            }
        }
        if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::unsupported("suffix", "'suffix' is not supported"));
        }
        let logprobs = f.integer_min("logprobs", 0)?;
        if let Some(n) = logprobs.filter(|&n| n > MAX_LOGPROBS as i64) {
            return Err(ApiError::invalid_value("logprobs", format!("'logprobs' must be between 0 and {MAX_LOGPROBS}, got {n}")));
        }
        let echo = f.bool("echo")?.unwrap_or(false);
        if echo && logprobs.is_some() {
            return Err(ApiError::unsupported("echo", "'echo' together with 'logprobs' (prompt logprobs) is not supported"));
        }
        let (stream, include_usage) = parse_stream(&f, &obj)?;
        if stream && logprobs.is_some_and(|n| n > 0) {
            return Err(ApiError::unsupported(
                "logprobs",
                "with 'stream': true only 'logprobs': 0 (the chosen tokens) is supported; use stream=false for alternatives",
            ));
        }
        let sampling = Sampling::parse(&f, &["max_tokens"])?;
        Ok(CompletionRequest { model, prompt, stream, include_usage, echo, logprobs: logprobs.map(|n| n as usize), sampling })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
    pub top_logprobs: usize,
    pub sampling: Sampling,
}

/// Message content: a string, or text parts `[{"type": "text", "text": ...}]`.
fn parse_content(i: usize, role: &str, v: Option<&Value>) -> Result<String> {
    let param = "messages";
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        // An assistant turn may carry no content (OpenAI allows null there).
        None | Some(Value::Null) if role == "assistant" => Ok(String::new()),
        None | Some(Value::Null) => Err(ApiError::invalid_value(param, format!("'messages[{i}].content' is required"))),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    (Some("text"), _) => {
                        return Err(ApiError::invalid_type(param, format!("'messages[{i}].content[{j}].text' must be a string")))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::unsupported(
                            param,
                            format!("'messages[{i}].content[{j}]' has type {other:?}; only \"text\" parts are supported"),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::invalid_type(param, format!("'messages[{i}].content[{j}]' must be an object with a \"type\"")))
                    }
                }
            }
            Ok(text)
        }
        Some(v) => Err(ApiError::invalid_type(
            param,
            format!("'messages[{i}].content' must be a string or an array of text parts, not {}", type_name(v)),
        )),
    }
}

fn parse_messages(v: Option<&Value>) -> Result<Vec<ChatMessage>> {
    let items = match v {
        None | Some(Value::Null) => return Err(ApiError::missing("messages")),
        Some(Value::Array(items)) => items,
        Some(v) => return Err(Fields::wrong("messages", "an array of messages", v)),
    };
    if items.is_empty() {
        return Err(ApiError::invalid_value("messages", "'messages' must contain at least one message"));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let Value::Object(m) = m else {
                return Err(ApiError::invalid_type("messages", format!("'messages[{i}]' must be an object, not {}", type_name(m))));
            };
            let role = match m.get("role") {
                Some(Value::String(r)) => r.as_str(),
                None | Some(Value::Null) => {
                    return Err(ApiError::invalid_value("messages", format!("'messages[{i}].role' is required")))
                }
                Some(v) => {
                    return Err(ApiError::invalid_type("messages", format!("'messages[{i}].role' must be a string, not {}", type_name(v))))
                }
            };
            let role = match role {
                "system" | "user" | "assistant" => role,
                // OpenAI's newer name for the system role.
                "developer" => "system",
                "tool" | "function" => {
                    return Err(ApiError::unsupported("messages", format!("'messages[{i}].role' {role:?}: tool calls are not supported")))
                }
                other => {
                    return Err(ApiError::invalid_value(
                        "messages",
                        format!("'messages[{i}].role' must be one of system, developer, user, assistant; got {other:?}"),
                    ))
                }
            };
            if m.get("tool_calls").is_some_and(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty())) {
                return Err(ApiError::unsupported("messages", format!("'messages[{i}].tool_calls': tool calls are not supported")));
            }
            Ok(ChatMessage { role: role.to_string(), content: parse_content(i, role, m.get("content"))? })
        })
        .collect()
}

impl ChatRequest {
    pub fn parse(body: &[u8]) -> Result<Self> {
        let obj = parse_object(body)?;
        let f = Fields::new(&obj);
        let model = parse_model(&f)?;
        let messages = parse_messages(obj.get("messages"))?;
        refuse_unsupported(&f, &obj)?;
        if obj.get("tools").is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()) || t.is_object()) {
            return Err(ApiError::unsupported("tools", "tool calling is not supported"));
        }
        match obj.get("tool_choice") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "none" || s == "auto" => {}
            Some(_) => return Err(ApiError::unsupported("tool_choice", "tool calling is not supported")),
        }
        match obj.get("response_format") {
            None | Some(Value::Null) => {}
            Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("text") => {}
            Some(_) => {
                return Err(ApiError::unsupported("response_format", "only response_format {\"type\": \"text\"} is supported"))
            }
        }
        let logprobs = f.bool("logprobs")?.unwrap_or(false);
        let top_logprobs = f.integer_min("top_logprobs", 0)?;
        if let Some(n) = top_logprobs {
            if n > MAX_LOGPROBS as i64 {
                return Err(ApiError::invalid_value(
                    "top_logprobs",
                    format!("'top_logprobs' must be between 0 and {MAX_LOGPROBS}, got {n}"),
                ));
            }
            if !logprobs {
                return Err(ApiError::invalid_value("top_logprobs", "'top_logprobs' requires 'logprobs' to be true"));
            }
        }
        let (stream, include_usage) = parse_stream(&f, &obj)?;
        if stream && top_logprobs.is_some_and(|n| n > 0) {
            return Err(ApiError::unsupported(
                "top_logprobs",
                "with 'stream': true only 'top_logprobs': 0 (the chosen tokens) is supported; use stream=false for alternatives",
            ));
        }
        let sampling = Sampling::parse(&f, &["max_completion_tokens", "max_tokens"])?;
        Ok(ChatRequest {
            model,
            messages,
            stream,
            include_usage,
            logprobs,
            top_logprobs: top_logprobs.unwrap_or(0) as usize,
            sampling,
        })
    }

    /// The `logprobs` value the engine takes.
    pub fn engine_logprobs(&self) -> Option<usize> {
        self.logprobs.then_some(self.top_logprobs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn completion(v: Value) -> Result<CompletionRequest> {
        CompletionRequest::parse(v.to_string().as_bytes())
    }

    fn chat(v: Value) -> Result<ChatRequest> {
        ChatRequest::parse(v.to_string().as_bytes())
    }

    fn param_of(r: Result<impl std::fmt::Debug>) -> (u16, String, String) {
        let e = r.expect_err("expected an error");
        (e.status.as_u16(), e.param.unwrap_or_default(), e.code.unwrap_or_default().to_string())
    }

    #[test]
    fn completion_defaults_and_fields() {
        let r = completion(json!({"model": "m", "prompt": "hi"})).unwrap();
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        assert_eq!((r.stream, r.echo, r.logprobs, r.sampling.max_tokens), (false, false, None, None));
        assert_eq!(r.sampling.temperature, None);
        let r = completion(json!({
            "prompt": ["one"], "max_tokens": 8, "temperature": 0, "top_p": 0.9, "top_k": -1, "seed": 7,
            "stop": "\n", "logprobs": 0, "stream": true, "stream_options": {"include_usage": true},
            "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "stop_token_ids": [2, 3], "ignore_eos": true, "min_tokens": 2, "n": 1, "user": "ignored"
        }))
        .unwrap();
        let s = &r.sampling;
        assert_eq!(r.prompt, Prompt::Text("one".into()));
        assert_eq!((s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed), (Some(8), Some(0.0), Some(0.9), Some(0), Some(7)));
        assert_eq!((s.stop.clone(), s.stop_token_ids.clone(), s.ignore_eos, s.min_tokens), (vec!["\n".to_string()], vec![2, 3], true, 2));
        assert_eq!((r.logprobs, r.stream, r.include_usage), (Some(0), true, true));
        assert_eq!(completion(json!({"prompt": [1, 2, 3]})).unwrap().prompt, Prompt::Ids(vec![1, 2, 3]));
        assert_eq!(completion(json!({"prompt": [[4, 5]]})).unwrap().prompt, Prompt::Ids(vec![4, 5]));
        assert_eq!(completion(json!({"prompt": "x", "stop": ["a", "b"]})).unwrap().sampling.stop, vec!["a", "b"]);
    }

    #[test]
    fn malformed_bodies_are_invalid_json() {
        for body in ["", "{", "[1, 2]", "\"text\"", "{\"prompt\": \"x\",}"] {
            let e = CompletionRequest::parse(body.as_bytes()).unwrap_err();
            assert_eq!((e.status.as_u16(), e.code), (400, Some("invalid_json")), "{body}");
        }
    }

    #[test]
    fn wrong_types_name_the_field() {
        let cases = [
            (json!({"prompt": 5}), "prompt"),
            (json!({"prompt": [true]}), "prompt"),
            (json!({"prompt": [1, -2]}), "prompt"),
            (json!({"prompt": "x", "max_tokens": "8"}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 2.5}), "max_tokens"),
            (json!({"prompt": "x", "temperature": "hot"}), "temperature"),
            (json!({"prompt": "x", "stream": "yes"}), "stream"),
            (json!({"prompt": "x", "stop": 3}), "stop"),
            (json!({"prompt": "x", "stop": ["a", 1]}), "stop"),
            (json!({"prompt": "x", "seed": "1"}), "seed"),
            (json!({"prompt": "x", "model": 3}), "model"),
            (json!({"prompt": "x", "stop_token_ids": [1.5]}), "stop_token_ids"),
            (json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}}), "stream_options"),
        ];
        for (body, field) in cases {
            let (status, param, code) = param_of(completion(body.clone()));
            assert_eq!((status, param.as_str(), code.as_str()), (400, field, "invalid_type"), "{body}");
        }
    }

    #[test]
    fn out_of_range_values_name_the_field() {
        let cases = [
            (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
            (json!({"prompt": "x", "temperature": -0.1}), "temperature"),
            (json!({"prompt": "x", "top_p": 0}), "top_p"),
            (json!({"prompt": "x", "top_p": 1.5}), "top_p"),
            (json!({"prompt": "x", "top_k": -2}), "top_k"),
            (json!({"prompt": "x", "min_p": 2}), "min_p"),
            (json!({"prompt": "x", "presence_penalty": 2.5}), "presence_penalty"),
            (json!({"prompt": "x", "frequency_penalty": -3}), "frequency_penalty"),
            (json!({"prompt": "x", "repetition_penalty": 0}), "repetition_penalty"),
            (json!({"prompt": "x", "logprobs": 21}), "logprobs"),
            (json!({"prompt": "x", "logprobs": -1}), "logprobs"),
            (json!({"prompt": "x", "max_tokens": 4, "min_tokens": 5}), "min_tokens"),
            (json!({"prompt": "x", "stop": [""]}), "stop"),
            (json!({"prompt": []}), "prompt"),
            (json!({"prompt": "x", "stream_options": {"include_usage": true}}), "stream_options"),
        ];
        for (body, field) in cases {
            let (status, param, code) = param_of(completion(body.clone()));
            assert_eq!((status, param.as_str(), code.as_str()), (400, field, "invalid_value"), "{body}");
        }
    }

    #[test]
    fn unsupported_features_are_refused() {
        let cases = [
            (json!({"prompt": "x", "n": 2}), "n"),
            (json!({"prompt": "x", "best_of": 3}), "best_of"),
            (json!({"prompt": "x", "suffix": "end"}), "suffix"),
            (json!({"prompt": "x", "logit_bias": {"50": 10}}), "logit_bias"),
            (json!({"prompt": ["a", "b"]}), "prompt"),
            (json!({"prompt": "x", "echo": true, "logprobs": 1}), "echo"),
            (json!({"prompt": "x", "stream": true, "logprobs": 2}), "logprobs"),
        ];
        for (body, field) in cases {
            let (status, param, code) = param_of(completion(body.clone()));
            assert_eq!((status, param.as_str(), code.as_str()), (400, field, "unsupported_value"), "{body}");
        }
        assert_eq!(param_of(completion(json!({"max_tokens": 3}))), (400, "prompt".into(), "missing_required_parameter".into()));
        // Neutral values of unsupported features are fine.
        completion(json!({"prompt": "x", "n": 1, "best_of": 1, "logit_bias": {}, "suffix": null})).unwrap();
    }

    #[test]
    fn chat_messages_and_logprobs() {
        let r = chat(json!({
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null},
                {"role": "user", "content": "c", "name": "bob"}
            ],
            "max_completion_tokens": 5, "max_tokens": 9, "logprobs": true, "top_logprobs": 2
        }))
        .unwrap();
        let roles: Vec<_> = r.messages.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
        assert_eq!(roles, vec![("system", "be brief"), ("user", "ab"), ("assistant", ""), ("user", "c")]);
        assert_eq!(r.sampling.max_tokens, Some(5), "max_completion_tokens wins over max_tokens");
        assert_eq!(r.engine_logprobs(), Some(2));
        let r = chat(json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9})).unwrap();
        assert_eq!((r.sampling.max_tokens, r.engine_logprobs()), (Some(9), None));
        assert_eq!(chat(json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true})).unwrap().engine_logprobs(), Some(0));
    }

    #[test]
    fn bad_chat_requests_name_the_field() {
        let user = json!([{"role": "user", "content": "x"}]);
        let cases = [
            (json!({}), "messages", "missing_required_parameter"),
            (json!({"messages": "hi"}), "messages", "invalid_type"),
            (json!({"messages": []}), "messages", "invalid_value"),
            (json!({"messages": [3]}), "messages", "invalid_type"),
            (json!({"messages": [{"content": "x"}]}), "messages", "invalid_value"),
            (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages", "invalid_value"),
            (json!({"messages": [{"role": "user"}]}), "messages", "invalid_value"),
            (json!({"messages": [{"role": "user", "content": 5}]}), "messages", "invalid_type"),
            (json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}), "messages", "unsupported_value"),
            (json!({"messages": [{"role": "tool", "content": "x"}]}), "messages", "unsupported_value"),
            (json!({"messages": user, "top_logprobs": 2}), "top_logprobs", "invalid_value"),
            (json!({"messages": user, "logprobs": true, "top_logprobs": 99}), "top_logprobs", "invalid_value"),
            (json!({"messages": user, "logprobs": 1}), "logprobs", "invalid_type"),
            (json!({"messages": user, "max_completion_tokens": 0}), "max_completion_tokens", "invalid_value"),
            (json!({"messages": user, "n": 3}), "n", "unsupported_value"),
            (json!({"messages": user, "stream": true, "logprobs": true, "top_logprobs": 1}), "top_logprobs", "unsupported_value"),
            (json!({"messages": user, "tools": [{"type": "function"}]}), "tools", "unsupported_value"),
            (json!({"messages": user, "response_format": {"type": "json_object"}}), "response_format", "unsupported_value"),
        ];
        for (body, field, code) in cases {
            let got = param_of(chat(body.clone()));
            assert_eq!((got.0, got.1.as_str(), got.2.as_str()), (400, field, code), "{body}");
        }
    }

    #[test]
    fn unset_fields_come_from_generation_config() {
        let cfg = GenerationConfig::from_json(&json!({"do_sample": true, "temperature": 0.6, "top_p": 0.9}));
        let s = Sampling { temperature: None, top_p: Some(0.5), ..Sampling::default() };
        let p = s.to_params(7, Some(1), &cfg);
        assert_eq!((p.max_tokens, p.temperature, p.top_p, p.top_k, p.logprobs), (7, 0.6, 0.5, 0, Some(1)));
        assert!(p.validate().is_ok());
        let greedy = Sampling { temperature: Some(0.0), ..Sampling::default() }.to_params(3, None, &cfg);
        assert_eq!(greedy.temperature, 0.0);
    }
}
