//! Response bodies and stream chunks in the OpenAI schema, and the token text
//! that logprobs report.

use std::sync::OnceLock;

use rocket_core::text::Tokenizer;
use rocket_core::{FinishReason, RequestOutput, StopReason, TokenLogprob};
use serde_json::{json, Map, Value};

/// What every response and chunk of one request carries.
#[derive(Debug, Clone)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts the
/// prompt tokens whose KV came from the prefix cache.
pub fn usage(out: &RequestOutput) -> Value {
    let (prompt_tokens, completion_tokens) = (out.prompt_token_ids.len(), out.token_ids.len());
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.metrics.cached_prompt_tokens},
    })
}

/// OpenAI's finish_reason; "abort" (vLLM's word) for a request the server cancelled.
pub fn finish_reason(out: &RequestOutput) -> &'static str {
    match out.finish_reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
    }
}

/// vLLM's extra `stop_reason`: the stop string or token id that ended generation.
pub fn stop_reason(out: &RequestOutput) -> Value {
    match &out.stop_reason {
        None => Value::Null,
        Some(StopReason::Token(id)) => json!(id),
        Some(StopReason::String(s)) => json!(s),
    }
}

/// GPT-2 byte-level BPE's byte ↔ printable-char table, reversed: char → byte.
fn byte_level_decoder() -> &'static std::collections::HashMap<char, u8> {
    static TABLE: OnceLock<std::collections::HashMap<char, u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = std::collections::HashMap::with_capacity(256);
        let mut extra = 0u32;
        for b in 0u32..256 {
            let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
            let c = if printable {
                b
            } else {
                extra += 1;
                255 + extra
            };
            table.insert(char::from_u32(c).expect("valid char"), b as u8);
        }
        table
    })
}

/// Token ids as the bytes and text logprobs report.
pub struct TokenText<'a> {
    tokenizer: &'a Tokenizer,
}

impl<'a> TokenText<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        TokenText { tokenizer }
    }

    /// The token's own bytes (a token may hold part of a UTF-8 character).
    pub fn bytes(&self, id: u32) -> Vec<u8> {
        let table = byte_level_decoder();
        if let Some(piece) = self.tokenizer.id_to_token(id) {
            let bytes: Option<Vec<u8>> = piece.chars().map(|c| table.get(&c).copied()).collect();
            if let Some(bytes) = bytes.filter(|b| !b.is_empty()) {
                return bytes;
            }
        }
        // Not byte-level (or an added token with spaces): its decoded text.
        self.tokenizer.decode(&[id], false).unwrap_or_default().into_bytes()
    }

    #[cfg(test)]
    pub fn text(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.bytes(id)).into_owned()
    }
}

/// A token as the legacy completions logprobs name it: its text, or, when its
/// bytes are not whole UTF-8 (part of a character), `bytes:` and the bytes as
/// `\xNN` escapes (OpenAI's form), so partial tokens keep distinct names.
fn legacy_label(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_string(),
        Err(_) => bytes.iter().fold("bytes:".to_string(), |mut s, b| {
            s.push_str(&format!("\\x{b:02x}"));
            s
        }),
    }
}

/// Where the next token's text starts in the completion's text, in characters
/// (the legacy `text_offset`): a token that holds part of a character starts
/// where that character does; an invalid byte counts as the one U+FFFD it
/// decodes to.
#[derive(Debug, Default)]
pub struct TextOffset {
    chars: usize,
    pending: Vec<u8>,
}

impl TextOffset {
    /// Offsets after `chars` characters (an echoed prompt's).
    pub fn after(chars: usize) -> Self {
        TextOffset { chars, pending: Vec::new() }
    }

    /// The offset of a token of `bytes`, then past it.
    fn push(&mut self, bytes: &[u8]) -> usize {
        let at = self.chars;
        self.pending.extend_from_slice(bytes);
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    self.chars += text.chars().count();
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    self.chars += std::str::from_utf8(&self.pending[..valid]).map_or(0, |t| t.chars().count());
                    match e.error_len() {
                        Some(bad) => {
                            self.chars += 1;
                            self.pending.drain(..valid + bad);
                        }
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                    }
                }
            }
        }
        at
    }
}

/// The legacy completions `logprobs` object for `items`; `offset` follows the
/// text across calls (a stream's chunks). Each `top_logprobs` object lists its
/// tokens most likely first.
pub fn completion_logprobs(tt: &TokenText<'_>, items: &[TokenLogprob], offset: &mut TextOffset) -> Value {
    let mut tokens = Vec::with_capacity(items.len());
    let mut token_logprobs = Vec::with_capacity(items.len());
    let mut top_logprobs = Vec::with_capacity(items.len());
    let mut text_offset = Vec::with_capacity(items.len());
    for item in items {
        let bytes = tt.bytes(item.token_id);
        text_offset.push(offset.push(&bytes));
        tokens.push(Value::String(legacy_label(&bytes)));
        token_logprobs.push(json!(item.logprob));
        let mut top = Map::new();
        for &(id, lp) in &item.top {
            top.entry(legacy_label(&tt.bytes(id))).or_insert(json!(lp));
        }
        top_logprobs.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset})
}

/// The chat `logprobs` object for `items`.
pub fn chat_logprobs(tt: &TokenText<'_>, items: &[TokenLogprob]) -> Value {
    let entry = |id: u32, lp: f32| {
        let bytes = tt.bytes(id);
        json!({"token": String::from_utf8_lossy(&bytes), "logprob": lp, "bytes": bytes})
    };
    let content: Vec<Value> = items
        .iter()
        .map(|item| {
            let mut e = entry(item.token_id, item.logprob);
            e["top_logprobs"] = item.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// A whole (non-streamed) completion.
pub fn completion_body(meta: &Meta, text: String, logprobs: Option<Value>, out: &RequestOutput) -> Value {
    json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(out),
            "stop_reason": stop_reason(out),
        }],
        "usage": usage(out),
        "system_fingerprint": null,
    })
}

/// A whole (non-streamed) chat completion.
pub fn chat_body(meta: &Meta, logprobs: Option<Value>, out: &RequestOutput) -> Value {
    json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": out.text, "refusal": null},
            "logprobs": logprobs,
            "finish_reason": finish_reason(out),
            "stop_reason": stop_reason(out),
        }],
        "usage": usage(out),
        "system_fingerprint": null,
    })
}

/// Which endpoint a stream belongs to, with what its chunks need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// Turns one request's engine events into stream chunks (JSON values).
pub struct ChunkWriter {
    pub meta: Meta,
    pub endpoint: Endpoint,
    /// Whether logprobs were requested (only the chosen token's stream).
    pub logprobs: bool,
    pub include_usage: bool,
    /// Text offset of the next token (completions logprobs).
    offset: TextOffset,
    /// Tokens whose text is still held back, waiting for a chunk to carry them.
    pending: Vec<TokenLogprob>,
}

impl ChunkWriter {
    pub fn new(meta: Meta, endpoint: Endpoint, logprobs: bool, include_usage: bool) -> Self {
        ChunkWriter { meta, endpoint, logprobs, include_usage, offset: TextOffset::default(), pending: Vec::new() }
    }

    fn chunk(&self, choice: Value) -> Value {
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        let mut c = json!({
            "id": self.meta.id,
            "object": object,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [choice],
            "system_fingerprint": null,
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    fn choice(&mut self, tt: &TokenText<'_>, text: &str, finish: Option<&RequestOutput>) -> Value {
        let items = std::mem::take(&mut self.pending);
        let (finish_reason, stop_reason) = match finish {
            Some(out) => (json!(finish_reason(out)), stop_reason(out)),
            None => (Value::Null, Value::Null),
        };
        match self.endpoint {
            Endpoint::Completions => {
                let logprobs = self.logprobs.then(|| completion_logprobs(tt, &items, &mut self.offset));
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason})
            }
            Endpoint::Chat => {
                let delta = if finish.is_some() && text.is_empty() { json!({}) } else { json!({"content": text}) };
                let logprobs = self.logprobs.then(|| chat_logprobs(tt, &items));
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason})
            }
        }
    }

    /// Chunks sent before any token: chat's role announcement, or an echoed prompt.
    pub fn start(&mut self, tt: &TokenText<'_>, echo: Option<&str>) -> Vec<Value> {
        match (self.endpoint, echo) {
            (Endpoint::Chat, _) => {
                let choice = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
                vec![self.chunk(choice)]
            }
            (Endpoint::Completions, Some(prompt)) => {
                let choice = self.choice(tt, prompt, None);
                self.offset = TextOffset::after(prompt.chars().count());
                // An echoed prompt carries no token logprobs.
                let mut c = self.chunk(choice);
                c["choices"][0]["logprobs"] = Value::Null;
                vec![c]
            }
            (Endpoint::Completions, None) => Vec::new(),
        }
    }

    /// One generated token; a chunk when it settles text.
    pub fn token(&mut self, tt: &TokenText<'_>, token_id: u32, logprob: Option<f32>, text: &str) -> Option<Value> {
        if self.logprobs {
            self.pending.push(TokenLogprob { token_id, logprob: logprob.unwrap_or(f32::NAN), top: Vec::new() });
        }
        if text.is_empty() {
            return None;
        }
        let choice = self.choice(tt, text, None);
        Some(self.chunk(choice))
    }

    /// The closing chunk (with finish_reason), then the usage chunk when asked for.
    pub fn finish(&mut self, tt: &TokenText<'_>, out: &RequestOutput) -> Vec<Value> {
        let choice = self.choice(tt, "", Some(out));
        let mut chunks = vec![self.chunk(choice)];
        if self.include_usage {
            let mut last = self.chunk(Value::Null);
            last["choices"] = json!([]);
            last["usage"] = usage(out);
            chunks.push(last);
        }
        chunks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rocket_core::Metrics;

    fn output(text: &str, ids: Vec<u32>, finish: FinishReason, stop: Option<StopReason>) -> RequestOutput {
        RequestOutput {
            prompt: "p".into(),
            prompt_token_ids: vec![1, 2, 3],
            text: text.into(),
            token_ids: ids,
            finish_reason: finish,
            stop_reason: stop,
            logprobs: None,
            metrics: Metrics::default(),
        }
    }

    fn meta() -> Meta {
        Meta { id: "cmpl-1".into(), created: 7, model: "m".into() }
    }

    fn tokenizer() -> Tokenizer {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/parity/fixtures/tiny-llama/tokenizer.json");
        Tokenizer::from_file(&path).unwrap()
    }

    #[test]
    fn chat_stream_chunks_carry_held_back_tokens() {
        let tok = tokenizer();
        let tt = TokenText::new(&tok);
        let ids = tok.encode("hello world", false).unwrap();
        assert!(ids.len() >= 2);
        let mut w = ChunkWriter::new(meta(), Endpoint::Chat, true, true);
        let start = w.start(&tt, None);
        assert_eq!(start.len(), 1);
        assert_eq!(start[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
        assert_eq!(start[0]["object"], "chat.completion.chunk");
        // A token whose text is held back makes no chunk; the next chunk reports both tokens.
        assert!(w.token(&tt, ids[0], Some(-0.5), "").is_none());
        let c = w.token(&tt, ids[1], Some(-0.25), "hello world").unwrap();
        assert_eq!(c["choices"][0]["delta"]["content"], "hello world");
        let content = c["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 2);
        assert_eq!((content[0]["logprob"].as_f64(), content[1]["logprob"].as_f64()), (Some(-0.5), Some(-0.25)));
        assert_eq!(content[0]["token"].as_str().unwrap().as_bytes(), tt.bytes(ids[0]).as_slice());
        assert_eq!(c["usage"], Value::Null);
        let out = output("hello world", ids[..2].to_vec(), FinishReason::Length, None);
        let end = w.finish(&tt, &out);
        assert_eq!(end.len(), 2);
        assert_eq!(end[0]["choices"][0]["delta"], json!({}));
        assert_eq!(end[0]["choices"][0]["finish_reason"], "length");
        assert_eq!(end[0]["choices"][0]["logprobs"]["content"], json!([]));
        assert_eq!(end[1]["choices"], json!([]));
        assert_eq!(end[1]["usage"]["total_tokens"], 5);
    }

    #[test]
    fn completion_stream_echo_and_offsets() {
        let tok = tokenizer();
        let tt = TokenText::new(&tok);
        let ids = tok.encode(" world", false).unwrap();
        let mut w = ChunkWriter::new(meta(), Endpoint::Completions, true, false);
        let start = w.start(&tt, Some("hello"));
        assert_eq!(start[0]["choices"][0]["text"], "hello");
        assert_eq!(start[0]["choices"][0]["logprobs"], Value::Null);
        assert!(start[0].get("usage").is_none());
        let c = w.token(&tt, ids[0], Some(-1.0), &tt.text(ids[0])).unwrap();
        let lp = &c["choices"][0]["logprobs"];
        assert_eq!(lp["text_offset"], json!([5]));
        assert_eq!(lp["tokens"], json!([tt.text(ids[0])]));
        assert_eq!(lp["top_logprobs"], json!([{}]));
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["choices"][0]["finish_reason"], Value::Null);
        let out = output(" world", ids.clone(), FinishReason::Stop, Some(StopReason::Token(2)));
        let end = w.finish(&tt, &out);
        assert_eq!(end.len(), 1);
        assert_eq!((end[0]["choices"][0]["finish_reason"].as_str(), end[0]["choices"][0]["stop_reason"].as_u64()), (Some("stop"), Some(2)));
    }

    #[test]
    fn token_bytes_undo_byte_level_encoding() {
        let tok = tokenizer();
        let tt = TokenText::new(&tok);
        for text in [" hello", "\n", "é"] {
            let ids = tok.encode(text, false).unwrap();
            let bytes: Vec<u8> = ids.iter().flat_map(|&id| tt.bytes(id)).collect();
            assert_eq!(bytes, text.as_bytes(), "{text:?} -> {ids:?}");
        }
        let lp = completion_logprobs(&tt, &[TokenLogprob { token_id: 5, logprob: -0.1, top: vec![(5, -0.1), (6, -2.0)] }], &mut TextOffset::after(3));
        assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
        assert_eq!(lp["text_offset"], json!([3]));
        let chat = chat_logprobs(&tt, &[TokenLogprob { token_id: 5, logprob: -0.1, top: vec![(6, -2.0)] }]);
        assert_eq!(chat["content"][0]["top_logprobs"][0]["logprob"].as_f64(), Some(-2.0f32 as f64));
    }

    #[test]
    fn legacy_logprobs_name_partial_tokens_by_bytes_and_offset_by_characters() {
        let tok = tokenizer();
        let tt = TokenText::new(&tok);
        let text = "I love 😀 and Перевод, 日本語.";
        let ids = tok.encode(text, false).unwrap();
        let partial: Vec<u32> = ids.iter().copied().filter(|&id| std::str::from_utf8(&tt.bytes(id)).is_err()).collect();
        assert!(partial.len() >= 2, "the fixture's tokenizer splits some characters: {ids:?}");
        // Each token lists every partial token as an alternative, most likely first.
        let top: Vec<(u32, f32)> = partial.iter().rev().enumerate().map(|(i, &id)| (id, -1.0 - i as f32)).collect();
        let items: Vec<TokenLogprob> = ids.iter().map(|&id| TokenLogprob { token_id: id, logprob: -0.5, top: top.clone() }).collect();
        // Split over two calls, as a stream's chunks are.
        let mut offset = TextOffset::default();
        let (a, b) = items.split_at(items.len() / 2);
        let (first, second) = (completion_logprobs(&tt, a, &mut offset), completion_logprobs(&tt, b, &mut offset));
        let field = |name: &str| -> Vec<Value> { [&first, &second].iter().flat_map(|lp| lp[name].as_array().unwrap().clone()).collect() };
        let (tokens, offsets, tops) = (field("tokens"), field("text_offset"), field("top_logprobs"));
        let chars: Vec<char> = text.chars().collect();
        for ((token, off), id) in tokens.iter().zip(&offsets).zip(&ids) {
            let (token, off) = (token.as_str().unwrap(), off.as_u64().unwrap() as usize);
            match std::str::from_utf8(&tt.bytes(*id)) {
                // A whole token's text is the text at its offset.
                Ok(whole) => assert!(chars[off..].iter().collect::<String>().starts_with(whole), "{token:?} at {off}"),
                // A partial one names its bytes and starts where its first character does.
                Err(e) => {
                    assert!(token.starts_with("bytes:\\x"), "{token:?}");
                    let bytes = tt.bytes(*id);
                    let head = std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap();
                    if head.is_empty() {
                        assert!(off < chars.len() && chars[off].len_utf8() > 1, "{token:?} at {off}: {:?}", chars.get(off));
                    } else {
                        assert!(chars[off..].iter().collect::<String>().starts_with(head), "{token:?} at {off}");
                    }
                }
            }
        }
        // Every alternative keeps its own entry, in the order given (most likely first).
        let want: Vec<String> = partial.iter().rev().map(|&id| legacy_label(&tt.bytes(id))).collect();
        let in_order = want.iter().fold(Vec::new(), |mut v: Vec<&String>, k| {
            if !v.contains(&k) {
                v.push(k)
            }
            v
        });
        assert!(in_order.windows(2).any(|w| w[0] > w[1]), "the order given must not be the sorted one: {in_order:?}");
        for t in &tops {
            let keys: Vec<&String> = t.as_object().unwrap().keys().collect();
            assert_eq!(keys, in_order);
        }
        // Invalid bytes count as one character each.
        let mut o = TextOffset::default();
        assert_eq!((o.push(&[0xff]), o.push(b"a"), o.push(&[0xe2, 0x82]), o.push(&[0xac]), o.push(b"b")), (0, 1, 2, 2, 3));
    }

    #[test]
    fn byte_level_table_is_a_bijection() {
        let t = byte_level_decoder();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'Ġ'], b' ');
        assert_eq!(t[&'Ċ'], b'\n');
        assert_eq!(t[&'a'], b'a');
        let mut bytes: Vec<u8> = t.values().copied().collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
    }

    #[test]
    fn bodies_have_usage_and_finish_reason() {
        let out = output("Paris.", vec![5, 6], FinishReason::Stop, Some(StopReason::String("\n".into())));
        let b = completion_body(&meta(), out.text.clone(), None, &out);
        assert_eq!(b["object"], "text_completion");
        assert_eq!(b["choices"][0]["text"], "Paris.");
        assert_eq!(b["choices"][0]["finish_reason"], "stop");
        assert_eq!(b["choices"][0]["stop_reason"], "\n");
        let details = json!({"cached_tokens": 0});
        assert_eq!(b["usage"], json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": details}));
        let mut cached = out.clone();
        cached.metrics.cached_prompt_tokens = 2;
        assert_eq!(completion_body(&meta(), out.text.clone(), None, &cached)["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
        let out = output("Hi", vec![5], FinishReason::Length, None);
        let b = chat_body(&meta(), None, &out);
        assert_eq!(b["object"], "chat.completion");
        assert_eq!(b["choices"][0]["message"], json!({"role": "assistant", "content": "Hi", "refusal": null}));
        assert_eq!(b["choices"][0]["finish_reason"], "length");
        assert_eq!(b["choices"][0]["stop_reason"], Value::Null);
    }
}
