//! `rocket serve` end to end on the tiny fixture model, over raw HTTP/1.1 on
//! loopback: readiness, a completion, a streamed chat, errors, SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/parity/fixtures").join(name).display().to_string()
}

struct Server {
    child: Child,
    addr: String,
    log: mpsc::Receiver<String>,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rocket"))
            .args(["serve", "--model", &fixture("tiny-llama"), "--host", "127.0.0.1", "--port", "0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, log) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let first = log.recv_timeout(Duration::from_secs(60)).expect("server printed nothing");
        let addr = first
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in {first:?}"))
            .to_string();
        let server = Server { child, addr, log };
        let deadline = Instant::now() + Duration::from_secs(60);
        while server.request("GET", "/health", "").0 != 200 {
            assert!(Instant::now() < deadline, "not ready in time");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// (status, body) of one request on a fresh connection.
    fn request(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        )
        .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let status = raw.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (status, body)
    }

    fn terminate(&mut self) -> Option<i32> {
        let ok = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap().success();
        assert!(ok);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(Instant::now() < deadline, "no exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn serves_completions_and_errors_then_exits_on_sigterm() {
    let mut server = Server::start(&["--max-batch", "2"]);
    let (status, body) = server.request("GET", "/health", "");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"status\":\"ok\""), "{body}");

    let (status, body) =
        server.request("POST", "/v1/completions", r#"{"prompt": "hello world", "max_tokens": 5, "temperature": 0}"#);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap() + v["usage"]["prompt_tokens"].as_u64().unwrap(),
               v["usage"]["total_tokens"].as_u64().unwrap());
    assert!(matches!(v["choices"][0]["finish_reason"].as_str(), Some("length" | "stop")));

    let (status, body) = server.request(
        "POST",
        "/v1/completions",
        r#"{"prompt": "hello world", "max_tokens": 5, "temperature": 0, "stream": true}"#,
    );
    assert_eq!(status, 200);
    assert!(body.contains("data: {") && body.contains("data: [DONE]"), "{body}");

    let (status, body) = server.request("POST", "/v1/completions", r#"{"prompt": "hi", "top_p": "high"}"#);
    assert_eq!(status, 400);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!((v["error"]["param"].as_str(), v["error"]["code"].as_str()), (Some("top_p"), Some("invalid_type")));
    assert_eq!(server.request("POST", "/v1/completions", "{oops").0, 400);
    assert_eq!(server.request("POST", "/v1/completions", r#"{"prompt": "hi", "model": "other"}"#).0, 404);

    assert_eq!(server.terminate(), Some(0));
    let log: Vec<String> = server.log.try_iter().collect();
    assert!(log.iter().any(|l| l.contains("stopped")), "{log:?}");
}

#[test]
fn a_model_that_fails_to_load_ends_the_server_with_its_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_rocket"))
        .args(["serve", "--model", "/no/such/model.gguf", "--port", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/no/such/model.gguf") && err.lines().last().unwrap().starts_with("error:"), "{err}");
}

#[test]
fn bad_limits_are_usage_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_rocket")).args(["serve", "--max-batch", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-batch"));
}

#[test]
fn a_prompt_sharing_whole_blocks_with_an_earlier_one_reuses_them() {
    let server = Server::start(&["--prefix-block", "4"]);
    let ask = |prompt: &str| {
        let body = serde_json::json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}).to_string();
        let (status, body) = server.request("POST", "/v1/completions", &body);
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<serde_json::Value>(&body).unwrap()
    };
    let shared = "the quick brown fox jumps over the lazy dog and then";
    let first = ask(&format!("{shared} sleeps"));
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second = ask(&format!("{shared} runs far away"));
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > 0 && cached % 4 == 0, "{second}");
    let (_, metrics) = server.request("GET", "/metrics", "");
    assert!(metrics.lines().any(|l| l == "rocket_prefix_cache_hits_total 1"), "{metrics}");
    assert!(metrics.lines().any(|l| l == format!("rocket_prefix_cache_reused_tokens_total {cached}")), "{metrics}");
    let (_, health) = server.request("GET", "/health", "");
    let h: serde_json::Value = serde_json::from_str(&health).unwrap();
    assert_eq!((h["prefix_cache"]["hits"].as_u64(), h["prefix_cache"]["block"].as_u64()), (Some(1), Some(4)), "{h}");
    assert!(h["prefix_cache"]["bytes"].as_u64().unwrap() > 0);
}

#[test]
fn devices_are_checked_and_a_cpu_engine_cannot_take_a_gpu_list() {
    let out = Command::new(env!("CARGO_BIN_EXE_rocket")).args(["serve", "--devices", "gpu0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--devices") && err.contains("\"all\""), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_rocket"))
        .args(["serve", "--model", &fixture("tiny-llama"), "--device", "cpu", "--devices", "0,1", "--port", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.lines().last().unwrap().contains("devices") && err.contains("\"cpu\""), "{err}");
}
