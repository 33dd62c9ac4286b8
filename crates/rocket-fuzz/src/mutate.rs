//! A deterministic mutation engine: the same seed, corpus and iteration give the
//! same input. Byte-level mutations (bit flips, inserts, deletes, splices,
//! integer boundaries, length fields, dictionary tokens) plus structure-aware
//! ones for JSON (config files and the safetensors header).

use crate::targets::Target;

/// splitmix64: small, fast, and good enough to pick mutations.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

/// The RNG for iteration `iter` of a run: independent of everything before it,
/// so a run resumed after a crash picks the same mutations.
pub fn iteration_rng(seed: u64, target: Target, iter: u64) -> Rng {
    let mut r = Rng::new(seed ^ (target as u64).wrapping_mul(0xA24B_AED4_963E_E407) ^ iter.wrapping_mul(0x9FB2_1C65_1E98_DF25));
    r.next();
    r
}

const BOUNDARY_U64: [u64; 22] = [
    0,
    1,
    2,
    7,
    8,
    31,
    32,
    33,
    255,
    256,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    1 << 40,
    1 << 60,
    (1 << 62) + 1,
    1 << 63,
    i64::MAX as u64,
    u64::MAX,
];

const JSON_TOKENS: &[&str] = &[
    "{", "}", "[", "]", ",", ":", "\"", "null", "true", "false", "0", "-1", "1e308", "1e999", "-0", "0.5", "NaN",
    "18446744073709551615", "18446744073709551616", "9223372036854775807", "4294967296", "\"\\u0000\"", "\"\\ud800\"",
    "\"model_type\"", "\"llama\"", "\"qwen3\"", "\"hidden_size\"", "\"num_attention_heads\"", "\"num_key_value_heads\"",
    "\"head_dim\"", "\"vocab_size\"", "\"num_hidden_layers\"", "\"intermediate_size\"", "\"rope_scaling\"",
    "\"rope_parameters\"", "\"rope_type\"", "\"llama3\"", "\"factor\"", "\"rope_theta\"", "\"eos_token_id\"",
    "\"max_position_embeddings\"", "\"tie_word_embeddings\"", "\"dtype\"", "\"F32\"", "\"BF16\"", "\"F16\"", "\"I8\"",
    "\"F4\"", "\"shape\"", "\"data_offsets\"", "\"__metadata__\"", "[0, 0]", "[]", "{}",
];

const JINJA_TOKENS: &[&str] = &[
    "{%", "%}", "{{", "}}", "{#", "#}", "{%-", "-%}", " for m in messages ", " endfor ", " if ", " endif ", " else ",
    " set ", " ns = namespace(x='ab') ", "ns.x", " ns.x = ns.x ~ ns.x ", " range(100000) ", " range(10) ", " loop.index ",
    " recursive ", " loop(m) ", " macro f(x) ", " endmacro ", " f(f) ", " call ", " endcall ", " caller() ", " filter upper ",
    " endfilter ", "messages", "message['content']", " | tojson ", " | tojson(indent=1000000000000) ", " | tojson(indent=4) ",
    " * 100000000 ", " ~ ", " + ", "[1, [2, [3]]]", " | join(',') ", " | list ", " | length ", " raise_exception('x') ",
    " strftime_now('%Y-%B-%A') ", ".split('</think>') ", ".strip() ", ".replace('a', 'aaaaaaaa') ", " | center(1000000) ",
    " | indent(100000) ", " | batch(3) ", " | sort ", " | unique ", " | map('upper') ", " | selectattr('role') ",
    " | reverse ", " | items ", " | dictsort ", " | format(1) ", "'%s' % x", " | int ", " | float ", "9999999999999999999",
    "-9223372036854775808", " break ", " continue ", " include 'chat' ", " extends 'chat' ", " import 'chat' as m ",
    " block b ", " endblock ", " with ", " endwith ", " autoescape true ", " endautoescape ", " raw ", " endraw ",
    "add_generation_prompt", "bos_token", "eos_token", "'\\u0000'", "\u{1F600}", " namespace() ", " self ",
];

/// GGUF key names and value-type ids worth planting.
const GGUF_TOKENS: &[&str] = &[
    "general.architecture", "general.alignment", "llama.block_count", "llama.embedding_length", "llama.context_length",
    "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.key_length", "llama.vocab_size",
    "llama.rope.dimension_count", "llama.rope.freq_base", "llama.rope.scaling.type", "qwen3.block_count",
    "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
    "tokenizer.ggml.eos_token_id", "tokenizer.chat_template", "rope_freqs.weight", "output.weight", "token_embd.weight",
    "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.4294967295.ffn_up.weight", "gpt2", "llama", "qwen3", "GGUF",
];

fn dictionary(target: Target) -> &'static [&'static str] {
    match target {
        Target::Config | Target::Safetensors => JSON_TOKENS,
        Target::ChatTemplate => JINJA_TOKENS,
        Target::Gguf => GGUF_TOKENS,
    }
}

/// Largest input the mutator makes (bigger inputs are cut).
pub const MAX_INPUT: usize = 1 << 20;

/// One mutated input from `corpus` (non-empty).
pub fn mutate(rng: &mut Rng, target: Target, corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut data = corpus[rng.below(corpus.len())].clone();
    // 1 to 8 stacked mutations, fewer more often.
    let n = 1 + (rng.next().trailing_zeros() as usize).min(7);
    for _ in 0..n {
        mutate_once(rng, target, corpus, &mut data);
    }
    data.truncate(MAX_INPUT);
    data
}

fn mutate_once(rng: &mut Rng, target: Target, corpus: &[Vec<u8>], data: &mut Vec<u8>) {
    let structured = matches!(target, Target::Config | Target::Safetensors);
    match rng.below(if structured { 13 } else { 11 }) {
        10 => {
            // truncate: short files (a cut header, a cut table), mostly very short
            let limit = if rng.chance(2) { 64 } else { data.len() + 1 };
            let keep = rng.below(limit.min(data.len() + 1));
            data.truncate(keep);
        }
        0 => {
            // bit flips
            if !data.is_empty() {
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(data.len());
                    data[i] ^= 1 << rng.below(8);
                }
            }
        }
        1 => {
            // interesting bytes
            if !data.is_empty() {
                let i = rng.below(data.len());
                data[i] = [0u8, 0xff, 0x7f, 0x80, b'"', b'{', b'%', b'\\', b'\n'][rng.below(9)];
            }
        }
        2 => {
            // insert random bytes or a repeated run
            let at = rng.below(data.len() + 1);
            let len = 1 + rng.below(16);
            let bytes: Vec<u8> = if rng.chance(2) {
                (0..len).map(|_| rng.next() as u8).collect()
            } else {
                vec![rng.next() as u8; len * 8]
            };
            data.splice(at..at, bytes);
        }
        3 => {
            // delete a range
            if !data.is_empty() {
                let at = rng.below(data.len());
                let span = if rng.chance(4) { 4096 } else { 16 };
                let len = 1 + rng.below((data.len() - at).min(span));
                data.drain(at..at + len);
            }
        }
        4 => {
            // splice with another corpus entry
            let other = &corpus[rng.below(corpus.len())];
            if !other.is_empty() {
                let from = rng.below(other.len());
                let len = 1 + rng.below((other.len() - from).min(256));
                let at = rng.below(data.len() + 1);
                if rng.chance(2) {
                    data.truncate(at);
                    data.extend_from_slice(&other[from..]);
                } else {
                    data.splice(at..at, other[from..from + len].iter().copied());
                }
            }
        }
        5 | 6 => {
            // integer boundary at a random offset, in a random width
            let v = BOUNDARY_U64[rng.below(BOUNDARY_U64.len())];
            let v = if rng.chance(4) { v.wrapping_neg() } else { v };
            let width = [1usize, 2, 4, 8][rng.below(4)];
            write_int(rng, data, v, width);
        }
        7 => {
            // a length or count field: a small little-endian u64 nudged or blown up
            edit_length_field(rng, data);
        }
        8 | 9 => {
            // dictionary token, inserted or overwriting
            let dict = dictionary(target);
            let tok = dict[rng.below(dict.len())].as_bytes();
            let at = rng.below(data.len() + 1);
            if rng.chance(2) || at + tok.len() > data.len() {
                data.splice(at..at, tok.iter().copied());
            } else {
                data[at..at + tok.len()].copy_from_slice(tok);
            }
        }
        _ => {
            // structure-aware: mutate one JSON value (the safetensors header, or the whole config)
            if target == Target::Safetensors {
                mutate_safetensors_header(rng, data);
            } else if let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(data) {
                mutate_json(rng, &mut v, 0);
                *data = serde_json::to_vec(&v).unwrap_or_default();
            }
        }
    }
}

fn write_int(rng: &mut Rng, data: &mut Vec<u8>, v: u64, width: usize) {
    if data.len() < width {
        data.extend(&v.to_le_bytes()[..width]);
        return;
    }
    // Prefer aligned offsets: binary headers lay their fields out that way.
    let mut at = rng.below(data.len() - width + 1);
    if rng.chance(2) {
        at -= at % width;
    }
    data[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
}

fn edit_length_field(rng: &mut Rng, data: &mut [u8]) {
    if data.len() < 8 {
        return;
    }
    // Look for a plausible length (a u64 below the input size, 4-byte aligned) from a random start.
    let start = rng.below(data.len() - 7) & !3;
    let mut at = start;
    while at + 8 <= data.len() {
        let v = u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"));
        if v > 0 && v <= data.len() as u64 {
            let new = match rng.below(6) {
                0 => v + 1,
                1 => v - 1,
                2 => v.wrapping_add(1 + rng.below(64) as u64),
                3 => v * 2,
                4 => BOUNDARY_U64[rng.below(BOUNDARY_U64.len())],
                _ => 0,
            };
            data[at..at + 8].copy_from_slice(&new.to_le_bytes());
            return;
        }
        at += 4;
    }
}

/// safetensors: parse the JSON header, mutate it, and write it back with a
/// correct (or deliberately wrong) length prefix.
fn mutate_safetensors_header(rng: &mut Rng, data: &mut Vec<u8>) {
    if data.len() < 8 {
        return;
    }
    let n = u64::from_le_bytes(data[..8].try_into().expect("8 bytes")) as usize;
    let Some(header) = data.get(8..8usize.saturating_add(n)) else { return };
    let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(header) else { return };
    mutate_json(rng, &mut v, 0);
    let Ok(new_header) = serde_json::to_vec(&v) else { return };
    let body = data[8 + n..].to_vec();
    let mut out = Vec::with_capacity(8 + new_header.len() + body.len());
    let len = if rng.chance(8) { new_header.len() as u64 + rng.below(16) as u64 } else { new_header.len() as u64 };
    out.extend(len.to_le_bytes());
    out.extend(new_header);
    out.extend(body);
    *data = out;
}

fn boundary_number(rng: &mut Rng) -> serde_json::Value {
    use serde_json::json;
    match rng.below(8) {
        0 => json!(BOUNDARY_U64[rng.below(BOUNDARY_U64.len())]),
        1 => json!(-(rng.below(1 << 20) as i64) - 1),
        2 => json!([0.0, -0.0, 1e-300, 1e300, f64::MAX, f64::MIN_POSITIVE, 0.5, -1.5][rng.below(8)]),
        3 => json!(rng.below(8)),
        4 => json!(null),
        5 => json!("12"),
        6 => json!(true),
        _ => json!([1, 2]),
    }
}

/// Change one value somewhere in `v`: replace, delete, retype or duplicate.
fn mutate_json(rng: &mut Rng, v: &mut serde_json::Value, depth: usize) {
    use serde_json::Value as J;
    let descend = depth < 6 && rng.below(3) != 0;
    match v {
        J::Object(map) if !map.is_empty() => {
            let keys: Vec<String> = map.keys().cloned().collect();
            let key = keys[rng.below(keys.len())].clone();
            if descend && matches!(map.get(&key), Some(J::Object(_) | J::Array(_))) {
                mutate_json(rng, map.get_mut(&key).expect("key exists"), depth + 1);
                return;
            }
            match rng.below(5) {
                0 => {
                    map.remove(&key);
                }
                1 => {
                    let other = keys[rng.below(keys.len())].clone();
                    let copy = map[&other].clone();
                    map.insert(key, copy);
                }
                2 => {
                    let copy = map[&key].clone();
                    map.insert(format!("{key}_"), copy);
                }
                _ => {
                    map.insert(key, boundary_number(rng));
                }
            }
        }
        J::Array(items) if !items.is_empty() => {
            let i = rng.below(items.len());
            if descend && matches!(items[i], J::Object(_) | J::Array(_)) {
                mutate_json(rng, &mut items[i], depth + 1);
                return;
            }
            match rng.below(4) {
                0 => {
                    items.remove(i);
                }
                1 => {
                    let copy = items[i].clone();
                    items.push(copy);
                }
                _ => items[i] = boundary_number(rng),
            }
        }
        _ => *v = boundary_number(rng),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutation_is_deterministic() {
        let corpus = vec![b"{\"a\": [1, 2, {\"b\": 3}]}".to_vec(), b"hello world".to_vec()];
        for target in crate::targets::ALL {
            for iter in 0..200 {
                let a = mutate(&mut iteration_rng(7, target, iter), target, &corpus);
                let b = mutate(&mut iteration_rng(7, target, iter), target, &corpus);
                assert_eq!(a, b);
            }
        }
        let a = mutate(&mut iteration_rng(7, Target::Config, 1), Target::Config, &corpus);
        let different = (2..50).any(|i| mutate(&mut iteration_rng(7, Target::Config, i), Target::Config, &corpus) != a);
        assert!(different);
    }
}
