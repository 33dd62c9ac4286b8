"""The `rocket` console script installed by pip behaves like the Rust CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rocket
from conftest import FIXTURES


def rocket_exe() -> str:
    # The script pip installed beside this interpreter (a venv's bin/ need not be on PATH).
    exe = shutil.which("rocket", path=os.path.dirname(sys.executable)) or shutil.which("rocket")
    assert exe, "`pip install .` must put a rocket command on PATH"
    return exe


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([rocket_exe(), *args], capture_output=True, text=True, timeout=300, input=stdin)


def test_generate_with_default_model() -> None:
    r = run("generate", "--max-tokens", "8", "--temperature", "0", "The capital of France is")
    assert r.returncode == 0, r.stderr
    # stdout is the continuation alone; --echo puts the prompt before it.
    assert "Paris" in r.stdout and not r.stdout.startswith("The capital of France is")
    echoed = run("generate", "--echo", "--max-tokens", "8", "--temperature", "0", "The capital of France is")
    assert echoed.returncode == 0, echoed.stderr
    assert echoed.stdout == "The capital of France is" + r.stdout


def test_an_empty_default_model_variable_is_unset() -> None:
    # As in Python's default_model_path: an empty ROCKET_DEFAULT_MODEL means the embedded model.
    env = {**os.environ, "ROCKET_DEFAULT_MODEL": ""}
    r = subprocess.run([rocket_exe(), "generate", "--max-tokens", "8", "--temperature", "0", "The capital of France is"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "Paris" in r.stdout, r.stderr


def test_generate_reads_the_prompt_from_stdin_without_its_line_break() -> None:
    args = ("generate", "--max-tokens", "8", "--temperature", "0", "--stats")
    direct = run(*args, "The capital of France is")
    for piped in ("The capital of France is\n", "The capital of France is\r\n"):
        r = run(*args, "-", stdin=piped)
        assert r.returncode == 0, r.stderr
        assert r.stdout == direct.stdout and "prompt 5 tokens" in r.stderr and "prompt 5 tokens" in direct.stderr


def test_generate_into_a_closed_pipe_ends_quietly() -> None:
    proc = subprocess.Popen([rocket_exe(), "generate", "--max-tokens", "64", "--temperature", "0", "--ignore-eos", "Once upon a time"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(1)  # what `| head -c 1` takes, then the reader goes away
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and "error" not in err, err


@pytest.mark.parametrize("args", [("inspect",), ("generate", "--max-tokens", "24", "--temperature", "0", "--logprobs", "2", "Once upon a time")])
def test_output_into_a_closed_pipe_ends_quietly(args: tuple[str, ...]) -> None:
    # `rocket inspect | head -1`, `rocket generate --logprobs 2 ... 2>&1 | head -2`: both
    # streams on one pipe whose reader goes away after the first line.
    proc = subprocess.Popen([rocket_exe(), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0


def test_chat_answer_longer_than_the_context_is_fitted_per_turn() -> None:
    # -n past --max-seq-len: each answer gets what the conversation leaves, with a note
    # (it was refused up front as "prompt of 1 tokens + max_tokens 200").
    r = run("chat", "-n", "200", "--max-seq-len", "100", "--temperature", "0", stdin="Hi\n")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert "limited to" in r.stderr and "(100 tokens)" in r.stderr, r.stderr


def test_serve_refuses_gpus_on_the_cpu_before_it_listens() -> None:
    r = run("serve", "--devices", "0", "--device", "cpu", "--port", "0")
    assert r.returncode == 1 and "devices" in r.stderr and "listening" not in r.stderr, r.stderr


def test_generate_stats_and_max_tokens_bounds() -> None:
    r = run("generate", "--max-tokens", "1", "--temperature", "0", "--stats", "The capital of France is")
    assert r.returncode == 0, r.stderr
    # One token has no decode rate; counts agree with their nouns.
    assert "output 1 token (" in r.stderr and "decode n/a" in r.stderr, r.stderr
    for bad in ("0", "-5"):
        r = run("generate", "--max-tokens", bad, "hi")
        assert r.returncode == 2 and "must be an integer >= 1" in r.stderr, r.stderr


def test_generate_refused_writes_nothing_to_stdout() -> None:
    r = run("generate", "--echo", "--max-seq-len", "32", "word " * 100)
    assert r.returncode == 1 and r.stdout == ""
    assert "context" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_generate_chat_and_stats() -> None:
    r = run("generate", "--chat", "--stats", "-n", "16", "What is 2+2?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "tokens/s" in r.stderr


def test_inspect() -> None:
    r = run("inspect", str(FIXTURES / "tiny-llama"))
    assert r.returncode == 0, r.stderr
    assert "llama3 scaling" in r.stdout and "bytes read per decode step" in r.stdout


def test_inspect_defaults_to_the_default_model(smollm2_path: str) -> None:
    r = run("inspect")
    assert r.returncode == 0, r.stderr
    assert smollm2_path in r.stdout and "chat template" in r.stdout


def test_inspect_exports_the_gguf_tokenizer_as_an_hf_folder(smollm2: rocket.LLM, smollm2_path: str, tmp_path: Path) -> None:
    out = tmp_path / "tok"
    r = run("inspect", smollm2_path, "--export-tokenizer", str(out))
    assert r.returncode == 0, r.stderr
    exported = rocket.Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "Héllo wörld! <|im_start|>user\n日本語 and emoji 🚀 in 2026."
    for special in (False, True):
        ids = smollm2.tokenizer.encode(text, add_special_tokens=special)
        assert exported.encode(text, add_special_tokens=special) == ids
        assert exported.decode(ids) == smollm2.tokenizer.decode(ids)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and "<|im_start|>" in config["chat_template"]


@pytest.mark.parametrize("sampled", [False, True])
def test_bench_prints_a_table_and_writes_json(sampled: bool, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    extra = ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "20"] if sampled else []
    r = run("bench", "--model", str(FIXTURES / "tiny-llama"), "--device", "cpu", "--batch", "1,3", "--prompt-len", "12",
            "--gen-len", "6", "--reps", "2", *extra, "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and not line.startswith("| batch")]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "3"], r.stdout
    report = json.loads(out.read_text())
    assert report["backend"] == "cpu" and report["prompt_len"] == 12 and report["gen_len"] == 6
    assert report["sampling"] == {"temperature": 0.8 if sampled else 0.0, "top_p": 0.9 if sampled else 1.0, "top_k": 20 if sampled else 0}
    for res in report["results"]:
        # The host CPU figure means something only while a GPU computes.
        assert res["decode_ms_per_step"] > 0 and res["ttft_ms"] > 0 and res["host_cpu_us_per_token"] is None
    assert all(row.rstrip().endswith("| - |") for row in rows), r.stdout


def test_bench_rejects_bad_settings() -> None:
    for args in (["--batch", "0"], ["--gen-len", "1"], ["--top-p", "0"]):
        r = run("bench", "--model", str(FIXTURES / "tiny-llama"), "--device", "cpu", *args)
        assert r.returncode != 0 and r.stderr.strip(), args
    # A report that cannot be written is refused before the work, not after it.
    r = run("bench", "--model", str(FIXTURES / "tiny-llama"), "--device", "cpu", "--json", "/no/such/dir/b.json")
    assert r.returncode == 1 and "/no/such/dir/b.json" in r.stderr and "| batch" not in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("args", [("generate", "--model", "/no/such/dir", "hi"), ("inspect", "/no/such/file.gguf")])
def test_errors_are_one_line(args: tuple[str, ...]) -> None:
    r = run(*args)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "/no/such" in r.stderr


def test_usage_error() -> None:
    r = run("frobnicate")
    assert r.returncode == 2


def _inspect_output(path: str, on_terminal: bool) -> str:
    """stderr of `rocket inspect PATH` with ROCKET_PROGRESS=always (bar at once, not after 1 s)."""
    exe = rocket_exe()
    env = {**os.environ, "ROCKET_PROGRESS": "always"}
    if not on_terminal:
        r = subprocess.run([exe, "inspect", path], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        return r.stderr
    import pty

    main_fd, child_fd = pty.openpty()
    proc = subprocess.Popen([exe, "inspect", path], stdin=child_fd, stdout=subprocess.DEVNULL, stderr=child_fd, env=env)
    os.close(child_fd)
    chunks = []
    while True:
        try:
            data = os.read(main_fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main_fd)
    assert proc.wait(timeout=120) == 0
    return b"".join(chunks).decode(errors="replace")


def test_load_progress_bar_only_on_a_terminal(smollm2_path: str) -> None:
    # Dequantizing the GGUF is the load's slow phase; the bar names it.
    assert "converting" in _inspect_output(smollm2_path, on_terminal=True)
    assert "converting" not in _inspect_output(smollm2_path, on_terminal=False)
