//! HF chat templates rendered with minijinja, configured like transformers'
//! sandboxed Jinja environment (trim_blocks, lstrip_blocks, loop controls) and
//! with the helpers HF templates call: raise_exception, strftime_now, tojson
//! (Python `json.dumps` formatting) and Python string methods.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;

use crate::error::{Result, RocketError};

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    limits: ChatTemplateLimits,
}

/// Bounds on one render. Templates come from model files rocket did not write,
/// and Jinja can loop, recurse and build strings without end: a render past a
/// bound stops with a `ChatTemplate` error instead of hanging or exhausting memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatTemplateLimits {
    /// minijinja fuel per render: about one unit per instruction executed and one
    /// per 64 bytes the template creates, so it bounds both time and memory
    /// (roughly `fuel * 64` bytes).
    pub fuel: u64,
    /// Most bytes one render may output.
    pub max_output_bytes: usize,
}

impl Default for ChatTemplateLimits {
    /// 4 million fuel (at most ~256 MB created; tens of milliseconds of work; the
    /// shipped templates use a few thousand per message) and 64 MiB of output.
    fn default() -> Self {
        ChatTemplateLimits { fuel: 4_000_000, max_output_bytes: 64 << 20 }
    }
}

/// Deepest value `tojson` serialises (Python's json module stops near 1000;
/// chat data is a few levels deep).
const MAX_TOJSON_DEPTH: usize = 64;
/// Largest `tojson(indent=...)`.
const MAX_TOJSON_INDENT: usize = 64;

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        Self::with_limits(source, bos_token, eos_token, ChatTemplateLimits::default())
    }

    /// `new` with explicit bounds on each render.
    pub fn with_limits(source: &str, bos_token: &str, eos_token: &str, limits: ChatTemplateLimits) -> Result<Self> {
        if limits.fuel == 0 || limits.max_output_bytes == 0 {
            return Err(RocketError::invalid_arg("chat template limits", format!("{limits:?}"), "fuel and max_output_bytes must be positive"));
        }
        let mut env = Environment::new();
        env.set_fuel(Some(limits.fuel));
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| RocketError::ChatTemplate(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| RocketError::ChatTemplate(format!("template does not parse: {e}")))?;
        Ok(ChatTemplate { env, bos_token: bos_token.to_string(), eos_token: eos_token.to_string(), limits })
    }

    pub fn limits(&self) -> ChatTemplateLimits {
        self.limits
    }

    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| RocketError::ChatTemplate(e.to_string()))?;
        let mut out = BoundedOutput { bytes: Vec::new(), limit: self.limits.max_output_bytes, overflowed: false };
        let rendered = tmpl.render_captured_to(
            minijinja::context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            },
            &mut out,
        );
        if out.overflowed {
            return Err(RocketError::ChatTemplate(format!(
                "the template's output exceeds the limit of {} bytes",
                self.limits.max_output_bytes
            )));
        }
        drop(rendered.map_err(|e| RocketError::ChatTemplate(render_error(&e, &self.limits)))?);
        String::from_utf8(out.bytes).map_err(|_| RocketError::ChatTemplate("the template's output is not UTF-8".into()))
    }
}

/// The render's output, refusing bytes past `limit`.
struct BoundedOutput {
    bytes: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len().saturating_add(buf.len()) > self.limit {
            self.overflowed = true;
            return Err(std::io::Error::other("chat template output limit"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn render_error(e: &Error, limits: &ChatTemplateLimits) -> String {
    match e.kind() {
        ErrorKind::InvalidOperation => e.detail().unwrap_or("template raised an exception").to_string(),
        ErrorKind::OutOfFuel => format!(
            "the template did too much work (more than its fuel of {}: about one unit per instruction and per 64 bytes created)",
            limits.fuel
        ),
        _ => e.to_string(),
    }
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time, with the strftime codes templates use.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    const MONTHS: [&str; 12] =
        ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    const WEEKDAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&format!("{year:04}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('A') => out.push_str(WEEKDAYS[days.rem_euclid(7) as usize]),
            Some('a') => out.push_str(&WEEKDAYS[days.rem_euclid(7) as usize][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 → (year, month, day) in the proleptic Gregorian calendar.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `tojson` as HF defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`.
/// Bounded: the value's depth and the indent are capped, and the output is paid
/// for in fuel before it is built (indentation can make it far larger than the value).
fn tojson(state: &minijinja::State, value: Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<Value> = kwargs.get("separators")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    if indent.is_some_and(|n| n > MAX_TOJSON_INDENT) {
        return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson indent is limited to {MAX_TOJSON_INDENT}")));
    }
    if value_depth(&value, MAX_TOJSON_DEPTH + 1) > MAX_TOJSON_DEPTH {
        return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: value nested deeper than {MAX_TOJSON_DEPTH} levels")));
    }
    let json = serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    state.consume_fuel(python_json_len(&json, indent.unwrap_or(0), 0) / 64)?;
    let mut out = String::new();
    write_python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Nesting depth of a template value, counted up to `cap`.
fn value_depth(v: &Value, cap: usize) -> usize {
    use minijinja::value::ValueKind;
    if cap == 0 || !matches!(v.kind(), ValueKind::Seq | ValueKind::Map | ValueKind::Iterable) {
        return 0;
    }
    let Ok(items) = v.try_iter() else { return 0 };
    let mut deepest = 0;
    for item in items {
        // Map items are keys; their values carry the depth.
        let child = if v.kind() == ValueKind::Map { v.get_item(&item).unwrap_or_default() } else { item };
        deepest = deepest.max(value_depth(&child, cap - 1));
        if deepest + 1 >= cap {
            break;
        }
    }
    deepest + 1
}

/// An upper bound of the bytes `write_python_json` writes (saturating).
fn python_json_len(v: &serde_json::Value, indent: usize, depth: usize) -> u64 {
    use serde_json::Value as J;
    let line = 1 + (indent as u64).saturating_mul(depth as u64 + 1);
    match v {
        J::Array(items) => items
            .iter()
            .fold(2 + line, |n, item| n.saturating_add(line + 2).saturating_add(python_json_len(item, indent, depth + 1))),
        J::Object(map) => map.iter().fold(2 + line, |n, (k, item)| {
            n.saturating_add(line + 4 + 6 * k.len() as u64).saturating_add(python_json_len(item, indent, depth + 1))
        }),
        J::String(s) => 2 + 6 * s.len() as u64,
        _ => 32,
    }
}

fn write_python_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).expect("string serialises"));
                out.push_str(": ");
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).expect("json serialises")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }

    #[test]
    fn chatml_renders_with_trimmed_blocks() {
        let t = ChatTemplate::new(
            "{% for message in messages %}\n<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n{% endfor %}\n{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "", "<|im_end|>",
        )
        .unwrap();
        let out = t.render(&[msg("user", " hi ")], true).unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn raise_exception_surfaces_message() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("roles must alternate"), "{e}");
    }

    #[test]
    fn python_methods_and_tojson() {
        let t = ChatTemplate::new("{{ messages[0].content.startswith('Hi') }} {{ {'a': [1, 'é']} | tojson }}", "", "").unwrap();
        assert_eq!(t.render(&[msg("user", "Hi")], false).unwrap(), "True {\"a\": [1, \"é\"]}");
    }

    fn render_err(source: &str, limits: ChatTemplateLimits) -> String {
        let t = ChatTemplate::with_limits(source, "<s>", "</s>", limits).unwrap();
        let start = std::time::Instant::now();
        let e = t.render(&[msg("user", "hi")], true).unwrap_err();
        assert!(start.elapsed().as_secs_f64() < 20.0, "{source}: took {:?}", start.elapsed());
        assert!(matches!(e, RocketError::ChatTemplate(_)), "{e}");
        e.to_string()
    }

    #[test]
    fn hostile_templates_end_with_an_error() {
        let d = ChatTemplateLimits::default();
        // Endless loops, exponential strings, a big repeat: the fuel runs out. (Not
        // bounded: doubling a *list* 33 times, which minijinja 3.1.0 materializes
        // without charging fuel; see benches/NOTES.md.)
        for source in [
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "{% set ns = namespace(x='ab') %}{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x | length }}",
            "{{ 'x' * 100000000 }}",
        ] {
            let e = render_err(source, d);
            assert!(e.contains("too much work") || e.contains("too large") || e.contains("exceeds the limit"), "{source}: {e}");
        }
        // Unbounded recursion stops at minijinja's recursion limit.
        let e = render_err("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", d);
        assert!(e.contains("recursion"), "{e}");
        // tojson: indentation and nesting are capped.
        let e = render_err("{{ messages | tojson(indent=1000000000000) }}", d);
        assert!(e.contains("indent is limited"), "{e}");
        let e = render_err("{% set ns = namespace(x=[]) %}{% for i in range(100) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | tojson }}", d);
        assert!(e.contains("nested deeper"), "{e}");
        // Output beyond the limit.
        let small = ChatTemplateLimits { fuel: 1_000_000, max_output_bytes: 1000 };
        let e = render_err("{% for i in range(100) %}{{ 'x' * 50 }}{% endfor %}", small);
        assert!(e.contains("exceeds the limit of 1000 bytes"), "{e}");
    }

    #[test]
    fn real_templates_fit_the_default_limits() {
        // The tiny Qwen3 fixture's template (a copy of Qwen3's) over a long conversation.
        let source = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/parity/fixtures/tiny-qwen3/chat_template.jinja")).unwrap();
        let t = ChatTemplate::new(&source, "", "<|im_end|>").unwrap();
        let long = "word ".repeat(2000);
        let messages: Vec<ChatMessage> =
            (0..1000).map(|i| msg(if i % 2 == 0 { "user" } else { "assistant" }, &long)).collect();
        let out = t.render(&messages, true).unwrap();
        assert!(out.len() > 1000 * long.len());
        assert!(ChatTemplate::with_limits("x", "", "", ChatTemplateLimits { fuel: 0, max_output_bytes: 1 }).is_err());
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_454), (2026, 1, 1));
        assert!(strftime_now("%d %B %Y".into()).len() >= 10);
    }
}
