"""The LLM's one scheduler: concurrent calls from several Python threads share
forward passes (each output still equal to its solo run), and Ctrl-C
interrupts a long ``generate`` at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import rocket

PROMPTS = ["Once upon a time", "The capital of France is"]


def greedy(max_tokens: int) -> rocket.SamplingParams:
    return rocket.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_two_threads_share_forward_passes_and_keep_their_solo_outputs(smollm2: rocket.LLM) -> None:
    params = greedy(32)
    solo = [smollm2.generate(p, params)[0] for p in PROMPTS]
    assert [o.metrics["max_batch_size"] for o in solo] == [1, 1]

    start = threading.Barrier(len(PROMPTS))
    got: dict[int, rocket.RequestOutput] = {}

    def work(i: int) -> None:
        start.wait()
        got[i] = smollm2.generate(PROMPTS[i], params)[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, want in enumerate(solo):
        # Both requests ran in one pass (32 decode steps each, started together).
        assert got[i].metrics["max_batch_size"] == 2, f"thread {i} never shared a pass"
        assert got[i].token_ids == want.token_ids and got[i].text == want.text


def test_stream_and_generate_from_two_threads_share_passes(smollm2: rocket.LLM) -> None:
    params = greedy(24)
    want = smollm2.generate(PROMPTS[1], params)[0]
    stream = smollm2.stream(PROMPTS[0], greedy(200))
    next(stream)  # the streamed request is running now
    out: list[rocket.RequestOutput] = []
    t = threading.Thread(target=lambda: out.extend(smollm2.generate(PROMPTS[1], params)))
    t.start()
    t.join()
    stream.close()
    assert out[0].metrics["max_batch_size"] == 2
    assert out[0].token_ids == want.token_ids


CHILD = textwrap.dedent(
    """
    import signal, sys, rocket
    # Python raises KeyboardInterrupt only where SIGINT was not ignored at its start,
    # and a launcher in the background (`cmd &` in a script) starts it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = rocket.LLM(sys.argv[1], device="cpu")
    params = rocket.SamplingParams(max_tokens=int(sys.argv[2]), temperature=0.0, ignore_eos=True)
    print("generating", flush=True)
    llm.generate("Once upon a time", params)
    print("finished", flush=True)
    """
)


def test_ctrl_c_interrupts_generate(smollm2: rocket.LLM, smollm2_path: str) -> None:
    max_tokens = 1500
    # How long the generation would take here, from this machine's decode speed.
    tps = smollm2.generate(PROMPTS[0], greedy(32))[0].metrics["decode_tokens_per_second"]
    would_take = max_tokens / tps
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, smollm2_path, str(max_tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "generating"
        started = time.monotonic()
        time.sleep(1.0)
        child.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = child.communicate(timeout=30.0)
        ended = time.monotonic()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "KeyboardInterrupt" in err, err
    assert "finished" not in out
    assert child.returncode != 0
    assert ended - sent < 5.0, f"took {ended - sent:.1f} s to stop after SIGINT"
    assert ended - started < would_take / 3, f"stopped after {ended - started:.1f} s; the generation takes ~{would_take:.0f} s"


TFL_CHILD = """
import signal, sys
import rocket
# As in CHILD: SIGINT may be ignored from the start where a launcher runs in the background.
signal.signal(signal.SIGINT, signal.default_int_handler)
llm = rocket.LLM(sys.argv[1], device="cpu")
ids = llm.tokenizer.encode("word " * 400)
print("running", flush=True)
try:
    llm.teacher_forced_logits(ids)
    print("finished")
except KeyboardInterrupt:
    print("interrupted")
"""


def test_ctrl_c_during_teacher_forced_logits_is_a_keyboard_interrupt(smollm2_path: str) -> None:
    # A fresh interpreter: numpy's array API is loaded by the call's result, with the signal pending.
    child = subprocess.Popen([sys.executable, "-c", TFL_CHILD, smollm2_path], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "running"
        time.sleep(0.3)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120.0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "interrupted" in out and "panicked" not in err and "PanicException" not in err, out + err
