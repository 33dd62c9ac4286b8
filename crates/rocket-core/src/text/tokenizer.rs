//! Tokenizer: HF `tokenizer.json`, or one rebuilt from GGUF metadata the way
//! transformers' GGUF converter builds it (byte-level BPE, "gpt2" model).

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::error::{Result, RocketError};
use crate::weights::gguf::{GgufFile, MetaValue};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

fn tok_err(e: impl std::fmt::Display) -> RocketError {
    RocketError::Tokenizer(e.to_string())
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(RocketError::ModelNotFound { path: path.to_path_buf() });
        }
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| RocketError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Tokenizer { inner })
    }

    pub fn from_json(json: &str) -> Result<Self> {
        let inner: tokenizers::Tokenizer = json.parse().map_err(tok_err)?;
        Ok(Tokenizer { inner })
    }

    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        Self::from_json(&gguf_tokenizer_json(file)?)
    }

    /// The tokenizer as HF `tokenizer.json` (for a GGUF: the tokenizer rebuilt
    /// from its metadata, as transformers' converter builds it).
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(true).map_err(tok_err)
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, add_special_tokens).map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids the tokenizer does not know (models often pad their vocabulary past
    /// the tokenizer's) decode to nothing, as in HF tokenizers.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tok_err)
    }

    /// Number of ids the tokenizer knows, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Ids of tokens marked special (control tokens).
    pub fn special_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }
}

/// ggml token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// A `tokenizer.json` equivalent to what transformers builds from GGUF metadata
/// for `tokenizer.ggml.model == "gpt2"`.
fn gguf_tokenizer_json(file: &GgufFile) -> Result<String> {
    let model = file.get_str("tokenizer.ggml.model").unwrap_or("");
    if model != "gpt2" {
        return Err(RocketError::Tokenizer(format!(
            "GGUF tokenizer model {model:?} is not supported (supported: \"gpt2\" byte-level BPE)"
        )));
    }
    let strings = |key: &str| -> Result<Vec<String>> {
        let arr = file
            .get(key)
            .and_then(MetaValue::as_array)
            .ok_or_else(|| RocketError::Tokenizer(format!("GGUF metadata has no {key}")))?;
        arr.iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(|| RocketError::Tokenizer(format!("{key} must hold strings"))))
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    let types: Vec<i64> = match file.get("tokenizer.ggml.token_type").and_then(MetaValue::as_array) {
        Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(1.0) as i64).collect(),
        None => vec![1; tokens.len()],
    };

    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert(tok.clone(), json!(id));
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == TOKEN_TYPE_CONTROL,
            }));
        }
    }
    let byte_level = |add_prefix_space: bool, trim_offsets: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": trim_offsets, "use_regex": true})
    };
    // `tokenizer.ggml.add_bos_token` (llama.cpp's converter copies it from the HF tokenizer,
    // true for Llama 3): prepend BOS as the HF tokenizer's TemplateProcessing does.
    let add_bos = file.get("tokenizer.ggml.add_bos_token").and_then(MetaValue::as_bool).unwrap_or(false);
    let bos = file.get_u64("tokenizer.ggml.bos_token_id").filter(|_| add_bos);
    let post_processor = match bos {
        None => byte_level(true, false),
        Some(id) => {
            let tok = tokens.get(id as usize).ok_or_else(|| {
                RocketError::Tokenizer(format!("tokenizer.ggml.bos_token_id {id} is outside the {}-token vocabulary", tokens.len()))
            })?;
            let special = |type_id: u32| json!({"SpecialToken": {"id": tok, "type_id": type_id}});
            let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
            json!({"type": "Sequence", "processors": [byte_level(true, false), {
                "type": "TemplateProcessing",
                "single": [special(0), seq("A", 0)],
                "pair": [special(0), seq("A", 0), special(1), seq("B", 1)],
                "special_tokens": {tok.as_str(): {"id": tok, "ids": [id], "tokens": [tok]}},
            }]})
        }
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level(false, true),
        "post_processor": post_processor,
        "decoder": byte_level(true, true),
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": Value::Object(vocab), "merges": merges,
        },
    });
    Ok(tokenizer.to_string())
}
