"""Type stubs for the compiled module ``rocket._rocket``."""

from typing import Final, final

import numpy as np
import numpy.typing as npt

__version__: Final[str]

@final
class SamplingParams:
    max_tokens: Final[int]
    temperature: Final[float]
    top_k: Final[int]
    top_p: Final[float]
    seed: Final[int | None]
    ignore_eos: Final[bool]
    def __new__(
        cls,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> SamplingParams: ...

@final
class RequestOutput:
    prompt: Final[str]
    prompt_token_ids: Final[list[int]]
    text: Final[str]
    token_ids: Final[list[int]]
    finish_reason: Final[str]
    metrics: Final[dict[str, float | int]]

@final
class Tokenizer:
    @staticmethod
    def from_file(path: str) -> Tokenizer: ...
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...
    @property
    def vocab_size(self) -> int: ...

@final
class Engine_:
    def __new__(cls, model: str, device: str = "auto", max_seq_len: int | None = None) -> Engine_: ...
    def generate(self, prompts: list[str], params: SamplingParams) -> list[RequestOutput]: ...
    def generate_from_ids(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestOutput: ...
    def apply_chat_template(self, messages: list[tuple[str, str]], add_generation_prompt: bool = True) -> str: ...
    def teacher_forced_logits(self, ids: list[int]) -> npt.NDArray[np.float32]: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def info(self) -> dict[str, object]: ...

Engine = Engine_

def default_model_path() -> str: ...
def run_cli(argv: list[str]) -> int: ...
def render_chat_template(
    template: str,
    messages: list[tuple[str, str]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str: ...
