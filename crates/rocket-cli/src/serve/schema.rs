//! Request bodies of `/v1/completions` and `/v1/chat/completions`: typed
//! structs deserialized with serde, through `serde_path_to_error` so that a
//! type error names the field at fault (`param`). Fields rocket does not know
//! are ignored (as vLLM does); OpenAI features it does not implement (n > 1,
//! tools, logit_bias, ...) are refused with a 400. Value ranges of the sampling
//! fields are checked once, by `Engine::resolve`; here only what the JSON
//! itself decides (types, signs of counts, which field names the length).

use std::fmt;

use rocket_core::sampling::MAX_LOGPROBS;
use rocket_core::sampling_options::sampling_f32;
use rocket_core::{ChatMessage, SamplingOptions};
use serde::de::{self, DeserializeOwned, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::errors::ApiError;

type Result<T> = std::result::Result<T, ApiError>;

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

fn wrong(name: &str, expected: &str, v: &Value) -> ApiError {
    ApiError::invalid_type(name, format!("'{name}' must be {expected}, not {}", type_name(v)))
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

/// The typed view of a body: a type error names the top-level field it is
/// in (`param`), and its message the full path (`'stop[1]': ...`).
fn typed<T: DeserializeOwned>(obj: &Value) -> Result<T> {
    serde_path_to_error::deserialize(obj).map_err(|e| {
        let path = e.path().to_string();
        let param = e.path().iter().next().map(|s| match s {
            serde_path_to_error::Segment::Map { key } => key.clone(),
            other => other.to_string(),
        });
        let message = format!("'{path}': {}", e.inner());
        match param {
            Some(p) => ApiError::invalid_type(&p, message),
            None => ApiError::invalid_json(message),
        }
    })
}

/// A JSON integer; integral floats (`5.0`) are accepted, as Python's pydantic does.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Int(i128);

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Int;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Int, E> {
                Ok(Int(v as i128))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Int, E> {
                Ok(Int(v as i128))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Int, E> {
                if v.fract() == 0.0 && v.abs() < 9.0e15 {
                    Ok(Int(v as i128))
                } else {
                    Err(E::invalid_type(de::Unexpected::Float(v), &self))
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// An integer field within i64 (as OpenAI's schema), or `invalid_value`.
fn int(name: &str, v: Option<Int>) -> Result<Option<i64>> {
    match v {
        None => Ok(None),
        Some(Int(i)) => i64::try_from(i).map(Some).map_err(|_| ApiError::invalid_value(name, format!("'{name}' is out of range: {i}"))),
    }
}

/// An integer field `>= min`.
fn int_min(name: &str, v: Option<Int>, min: i64) -> Result<Option<i64>> {
    match int(name, v)? {
        Some(x) if x < min => Err(ApiError::invalid_value(name, format!("'{name}' must be at least {min}, got {x}"))),
        v => Ok(v),
    }
}

/// A token id: an integer in [0, 2^32).
#[derive(Debug, Clone, Copy, PartialEq)]
struct TokenId(u32);

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        match Int::deserialize(d) {
            Ok(Int(i)) if (0..=u32::MAX as i128).contains(&i) => Ok(TokenId(i as u32)),
            Ok(Int(i)) => Err(de::Error::custom(format!("must be a token id (an integer >= 0), not {i}"))),
            Err(e) => Err(de::Error::custom(format!("must be a token id (an integer >= 0): {e}"))),
        }
    }
}

/// A string or an array of strings (`stop`).
#[derive(Debug, Clone, Default, PartialEq)]
struct Strings(Vec<String>);

impl<'de> Deserialize<'de> for Strings {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Strings;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of strings")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Strings, E> {
                Ok(Strings(vec![v.to_string()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Strings, A::Error> {
                let mut out = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    out.push(s);
                }
                Ok(Strings(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// The sampling fields both endpoints share (`null` counts as absent).
#[derive(Deserialize, Default)]
#[serde(default)]
struct SamplingBody {
    max_tokens: Option<Int>,
    max_completion_tokens: Option<Int>,
    min_tokens: Option<Int>,
    temperature: Option<f64>,
    top_k: Option<Int>,
    top_p: Option<f64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    seed: Option<Int>,
    stop: Option<Strings>,
    stop_token_ids: Option<Vec<TokenId>>,
    ignore_eos: Option<bool>,
    skip_special_tokens: Option<bool>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// Fields both endpoints share besides sampling.
#[derive(Deserialize, Default)]
#[serde(default)]
struct CommonBody {
    model: Option<String>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<Int>,
    logit_bias: Option<Map<String, Value>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct CompletionBody {
    prompt: Option<Value>,
    best_of: Option<Int>,
    suffix: Option<String>,
    logprobs: Option<Int>,
    echo: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ChatBody {
    messages: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    /// The deprecated form of tools (and its `function_call`).
    functions: Option<Value>,
    function_call: Option<Value>,
    response_format: Option<Value>,
    logprobs: Option<bool>,
    top_logprobs: Option<Int>,
}

/// Sampling options as given; `max_tokens_fields` are the names that set
/// max_tokens, in priority order. Ranges are `Engine::resolve`'s to check.
fn sampling(b: SamplingBody, max_tokens_fields: &[&str]) -> Result<SamplingOptions> {
    let mut max_tokens = None;
    for &name in max_tokens_fields {
        let v = if name == "max_completion_tokens" { b.max_completion_tokens } else { b.max_tokens };
        if let Some(n) = int_min(name, v, 1)? {
            max_tokens.get_or_insert(n as usize);
        }
    }
    // vLLM spells "off" as -1; rocket as 0.
    let top_k = int_min("top_k", b.top_k, -1)?.map(|k| k.max(0) as usize);
    Ok(SamplingOptions {
        max_tokens,
        min_tokens: int_min("min_tokens", b.min_tokens, 0)?.map(|n| n as usize),
        temperature: narrow("temperature", b.temperature)?,
        top_k,
        top_p: narrow("top_p", b.top_p)?,
        min_p: narrow("min_p", b.min_p)?,
        repetition_penalty: narrow("repetition_penalty", b.repetition_penalty)?,
        presence_penalty: narrow("presence_penalty", b.presence_penalty)?,
        frequency_penalty: narrow("frequency_penalty", b.frequency_penalty)?,
        // A negative seed is a valid OpenAI seed: its bits are the seed.
        seed: int("seed", b.seed)?.map(|s| s as u64),
        stop: b.stop.unwrap_or_default().0,
        stop_token_ids: b.stop_token_ids.unwrap_or_default().into_iter().map(|t| t.0).collect(),
        ignore_eos: b.ignore_eos.unwrap_or(false),
        logprobs: None,
        skip_special_tokens: b.skip_special_tokens,
    })
}

/// A JSON number as the f32 the options hold (one past f32's range is refused as given).
fn narrow(name: &str, v: Option<f64>) -> Result<Option<f32>> {
    v.map(|x| sampling_f32(name, x)).transpose().map_err(|e| ApiError::from_engine(&e, "prompt"))
}

/// `stream` and `stream_options.include_usage`.
fn parse_stream(c: &CommonBody) -> Result<(bool, bool)> {
    let stream = c.stream.unwrap_or(false);
    let include_usage = match &c.stream_options {
        None => false,
        Some(_) if !stream => {
            return Err(ApiError::invalid_value("stream_options", "'stream_options' is only allowed when 'stream' is true"))
        }
        Some(o) => o.include_usage.unwrap_or(false),
    };
    Ok((stream, include_usage))
}

/// Refuse what rocket does not implement rather than silently ignore it.
fn refuse_unsupported(c: &CommonBody) -> Result<()> {
    if let Some(n) = int("n", c.n)? {
        if n != 1 {
            return Err(ApiError::unsupported("n", format!("only n=1 is supported, got {n}")));
        }
    }
    if c.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::unsupported("logit_bias", "'logit_bias' is not supported"));
    }
    Ok(())
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
    /// As given (`logprobs` included); unset fields are the resolver's to fill.
    pub sampling: SamplingOptions,
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
        Some(v) => Err(wrong("prompt", "a string or an array of token ids", v)),
    }
}

impl CompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self> {
        let obj = Value::Object(parse_object(body)?);
        let common: CommonBody = typed(&obj)?;
        let b: CompletionBody = typed(&obj)?;
        let prompt = parse_prompt(b.prompt.as_ref())?;
        refuse_unsupported(&common)?;
        if let Some(n) = int("best_of", b.best_of)? {
            if n != 1 {
                return Err(ApiError::unsupported("best_of", format!("only best_of=1 is supported, got {n}")));
            }
        }
        if b.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::unsupported("suffix", "'suffix' is not supported"));
        }
        let logprobs = int_min("logprobs", b.logprobs, 0)?;
        if let Some(n) = logprobs.filter(|&n| n > MAX_LOGPROBS as i64) {
            return Err(ApiError::invalid_value("logprobs", format!("'logprobs' must be between 0 and {MAX_LOGPROBS}, got {n}")));
        }
        let echo = b.echo.unwrap_or(false);
        if echo && logprobs.is_some() {
            return Err(ApiError::unsupported("echo", "'echo' together with 'logprobs' (prompt logprobs) is not supported"));
        }
        let (stream, include_usage) = parse_stream(&common)?;
        if stream && logprobs.is_some_and(|n| n > 0) {
            return Err(ApiError::unsupported(
                "logprobs",
                "with 'stream': true only 'logprobs': 0 (the chosen tokens) is supported; use stream=false for alternatives",
            ));
        }
        let logprobs = logprobs.map(|n| n as usize);
        let sampling = SamplingOptions { logprobs, ..sampling(typed(&obj)?, &["max_tokens"])? };
        Ok(CompletionRequest { model: common.model, prompt, stream, include_usage, echo, logprobs, sampling })
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
    /// As given (`logprobs` included); unset fields are the resolver's to fill.
    pub sampling: SamplingOptions,
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
        Some(v) => return Err(wrong("messages", "an array of messages", v)),
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
        let obj = Value::Object(parse_object(body)?);
        let common: CommonBody = typed(&obj)?;
        let b: ChatBody = typed(&obj)?;
        let messages = parse_messages(b.messages.as_ref())?;
        refuse_unsupported(&common)?;
        if b.tools.as_ref().is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()) || t.is_object()) {
            return Err(ApiError::unsupported("tools", "tool calling is not supported"));
        }
        if b.functions.as_ref().is_some_and(|f| f.as_array().is_some_and(|a| !a.is_empty()) || f.is_object()) {
            return Err(ApiError::unsupported("functions", "function calling is not supported"));
        }
        match &b.function_call {
            None => {}
            Some(Value::String(s)) if s == "none" || s == "auto" => {}
            Some(_) => return Err(ApiError::unsupported("function_call", "function calling is not supported")),
        }
        match &b.tool_choice {
            None => {}
            Some(Value::String(s)) if s == "none" || s == "auto" => {}
            Some(_) => return Err(ApiError::unsupported("tool_choice", "tool calling is not supported")),
        }
        match &b.response_format {
            None => {}
            Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("text") => {}
            Some(_) => {
                return Err(ApiError::unsupported("response_format", "only response_format {\"type\": \"text\"} is supported"))
            }
        }
        let logprobs = b.logprobs.unwrap_or(false);
        let top_logprobs = int_min("top_logprobs", b.top_logprobs, 0)?;
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
        let (stream, include_usage) = parse_stream(&common)?;
        if stream && top_logprobs.is_some_and(|n| n > 0) {
            return Err(ApiError::unsupported(
                "top_logprobs",
                "with 'stream': true only 'top_logprobs': 0 (the chosen tokens) is supported; use stream=false for alternatives",
            ));
        }
        let top_logprobs = top_logprobs.unwrap_or(0) as usize;
        let engine_logprobs = logprobs.then_some(top_logprobs);
        let sampling = SamplingOptions {
            logprobs: engine_logprobs,
            ..sampling(typed(&obj)?, &["max_completion_tokens", "max_tokens"])?
        };
        Ok(ChatRequest { model: common.model, messages, stream, include_usage, logprobs, top_logprobs, sampling })
    }

    /// The `logprobs` value the engine takes.
    #[cfg(test)]
    pub fn engine_logprobs(&self) -> Option<usize> {
        self.sampling.logprobs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Parsed, then the ranges `Engine::resolve` checks (those that need no model),
    /// as the server answers them.
    fn completion(v: Value) -> Result<CompletionRequest> {
        let r = CompletionRequest::parse(v.to_string().as_bytes())?;
        r.sampling.check_ranges().map_err(|e| ApiError::from_engine(&e, "prompt"))?;
        Ok(r)
    }

    fn chat(v: Value) -> Result<ChatRequest> {
        let r = ChatRequest::parse(v.to_string().as_bytes())?;
        r.sampling.check_ranges().map_err(|e| ApiError::from_engine(&e, "messages"))?;
        Ok(r)
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
        assert_eq!((s.stop.clone(), s.stop_token_ids.clone(), s.ignore_eos, s.min_tokens), (vec!["\n".to_string()], vec![2, 3], true, Some(2)));
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
            (json!({"prompt": "x", "top_p": 1e-300}), "top_p"),
            (json!({"prompt": "x", "temperature": 1e300}), "temperature"),
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
            (json!({"messages": user, "functions": [{"name": "f"}]}), "functions", "unsupported_value"),
            (json!({"messages": user, "function_call": {"name": "f"}}), "function_call", "unsupported_value"),
            (json!({"messages": user, "response_format": {"type": "json_object"}}), "response_format", "unsupported_value"),
        ];
        for (body, field, code) in cases {
            let got = param_of(chat(body.clone()));
            assert_eq!((got.0, got.1.as_str(), got.2.as_str()), (400, field, code), "{body}");
        }
    }

    #[test]
    fn type_errors_name_the_path() {
        let e = completion(json!({"prompt": "x", "stop": ["a", 1]})).unwrap_err();
        assert!(e.message.contains("'stop[1]'"), "{}", e.message);
        let e = chat(json!({"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": {"include_usage": "y"}})).unwrap_err();
        assert!(e.message.contains("'stream_options.include_usage'"), "{}", e.message);
        // Integral floats are integers; a seed's bits are the seed; null is absent.
        let r = completion(json!({"prompt": "x", "max_tokens": 5.0, "seed": -1, "temperature": null, "skip_special_tokens": false})).unwrap();
        assert_eq!((r.sampling.max_tokens, r.sampling.seed, r.sampling.temperature), (Some(5), Some(u64::MAX), None));
        assert_eq!(r.sampling.skip_special_tokens, Some(false));
        assert_eq!(param_of(completion(json!({"prompt": "x", "seed": 1u64 << 63}))), (400, "seed".into(), "invalid_value".into()));
    }
}
