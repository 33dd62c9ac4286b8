"""Type stubs for the compiled module ``rocket._rocket``."""

from collections.abc import Sequence
from typing import Final, final

import numpy as np
import numpy.typing as npt

__version__: Final[str]
__all__ = [
    "SamplingParams",
    "RequestOutput",
    "Tokenizer",
    "Engine_",
    "EngineOptions",
    "Stream",
    "StreamDelta",
    "Engine",
    "default_model_path",
    "run_cli",
    "render_chat_template",
    "sample_token",
    "__version__",
]

@final
class SamplingParams:
    """Sampling options; a field left as None takes its default when a request is
    resolved: temperature/top_k/top_p/repetition_penalty from the model's
    generation_config (greedy unless it sets do_sample), max_tokens 16 for
    ``generate``/``stream`` and the context left for ``chat``, the rest off
    (skip_special_tokens True)."""

    @property
    def max_tokens(self) -> int | None: ...
    @property
    def min_tokens(self) -> int | None: ...
    @property
    def temperature(self) -> float | None: ...
    @property
    def top_k(self) -> int | None: ...
    @property
    def top_p(self) -> float | None: ...
    @property
    def min_p(self) -> float | None: ...
    @property
    def repetition_penalty(self) -> float | None: ...
    @property
    def presence_penalty(self) -> float | None: ...
    @property
    def frequency_penalty(self) -> float | None: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def stop(self) -> list[str]: ...
    @property
    def stop_token_ids(self) -> list[int]: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def skip_special_tokens(self) -> bool | None: ...
    def __new__(
        cls,
        max_tokens: int | None = None,
        min_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool | None = None,
        logprobs: int | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams: ...

@final
class RequestOutput:
    prompt: Final[str]
    prompt_token_ids: Final[list[int]]
    text: Final[str]
    token_ids: Final[list[int]]
    finish_reason: Final[str]
    stop_reason: Final[int | str | None]
    logprobs: Final[list[dict[str, object]] | None]
    # time_to_first_token, decode_tokens_per_second, prompt_tokens, output_tokens,
    # total_seconds, max_batch_size (most requests in one forward pass with this one),
    # cached_prompt_tokens (prompt tokens whose KV came from the prefix cache)
    metrics: Final[dict[str, float | int]]

@final
class StreamDelta:
    text: Final[str]
    token_id: Final[int]
    logprob: Final[float | None]

@final
class Stream:
    def __iter__(self) -> Stream: ...
    def __next__(self) -> StreamDelta: ...
    def __enter__(self) -> Stream: ...
    def __exit__(self, _exc_type: object = None, _exc: object = None, _traceback: object = None) -> bool: ...
    @property
    def finish_reason(self) -> str | None:
        """None while tokens still come; then "stop" or "length", or "cancelled" for a
        stream closed before its end."""
    def close(self) -> None: ...

@final
class Tokenizer:
    @staticmethod
    def from_file(path: str) -> Tokenizer: ...
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    @property
    def vocab_size(self) -> int: ...

@final
class EngineOptions:
    """Validated engine options (see ``rocket.LLM``); ``env`` holds ``ROCKET_*``
    (name, value) pairs that keywords left as None fall back to."""

    def __new__(
        cls,
        *,
        device: str | None = None,
        max_seq_len: int | None = None,
        progress: str | None = None,
        decode: str | None = None,
        matmul: str | None = None,
        sampler: str | None = None,
        cuda_graphs: bool | None = None,
        prompt_graphs: bool | None = None,
        loop_sampling: bool | None = None,
        pdl: bool | None = None,
        fuse: bool | None = None,
        tc_attention: bool | None = None,
        wgmma_attention: bool | None = None,
        watchdog_ms: int | None = None,
        trace_step: int | None = None,
        prefix_cache_bytes: int | None = None,
        prefix_block: int | None = None,
        env: list[tuple[str, str]] = ...,
    ) -> EngineOptions: ...

@final
class Engine_:
    def __new__(cls, model: str, options: EngineOptions, devices: str | None = None) -> Engine_: ...
    def generate(self, prompts: list[str], params: list[SamplingParams], chat: bool = False) -> list[RequestOutput]: ...
    def generate_from_ids(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> RequestOutput: ...
    def stream(self, prompt: str, params: SamplingParams) -> Stream: ...
    def apply_chat_template(self, messages: list[tuple[str, str]], add_generation_prompt: bool = True) -> str: ...
    def teacher_forced_logits(self, ids: Sequence[int]) -> npt.NDArray[np.float32]: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def info(self) -> dict[str, object]: ...
    def prefix_cache_stats(self) -> dict[str, int]: ...

Engine = Engine_

def default_model_path(chosen: str | None = None) -> str: ...
def run_cli(argv: list[str]) -> int: ...
def render_chat_template(
    template: str,
    messages: list[tuple[str, str]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str: ...
def sample_token(logits: list[float], params: SamplingParams, seed: int, step: int) -> int:
    """The sampler on its own: the token chosen from ``logits`` at generation ``step`` of a
    request seeded with ``seed`` (both in [0, 2**64)). Only the cuts and the draw: penalties
    and the ``min_tokens`` mask need the request's history and the model's end tokens."""
