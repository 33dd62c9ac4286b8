"""The sampler's distributions against an independent numpy reference
(chi-square goodness of fit, fixed seeds), and its reproducibility."""

from __future__ import annotations

import math

import numpy as np
import pytest

import rocket

LOGITS = np.array([2.0, 1.5, 1.2, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0, 0.9], dtype=np.float32)
DRAWS = 20_000


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Written from the rule's definition (crates/rocket-core/src/race.rs), independent of its code:
    top-k keeps the k most likely; top-p keeps whole bins of 1/16 nat of logit/T, from the top, while
    the mass of the bins above is below top_p; min-p keeps the bins at or above (max + ln min_p)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    bins = np.floor(z * 16)
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    keep[order[: top_k if top_k > 0 else len(p)]] = True
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        above = np.array([q[bins > b].sum() for b in bins])
        keep &= above < top_p
    if min_p > 0.0:
        keep &= bins >= np.floor((z.max() + math.log(min_p)) * 16)
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def chi2_critical(df: int, z: float = 4.0) -> float:
    """Wilson–Hilferty upper quantile of chi-square (z = 4: p ≈ 3e-5)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (2.0, 0, 1.0, 0.0), (1.0, 4, 1.0, 0.0), (1.0, 0, 0.7, 0.0), (1.0, 0, 1.0, 0.3), (0.8, 6, 0.9, 0.05)],
)
def test_distribution_matches_reference(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    params = rocket.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = LOGITS.tolist()
    counts = np.bincount([rocket.sample_token(logits, params, 2024, step) for step in range(DRAWS)], minlength=len(LOGITS))
    expected = reference_probs(LOGITS, temperature, top_k, top_p, min_p) * DRAWS
    assert (counts[expected == 0] == 0).all(), "a filtered-out token was sampled"
    support = expected > 0
    chi2 = float((((counts - expected) ** 2)[support] / expected[support]).sum())
    df = int(support.sum()) - 1
    if df > 0:
        assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} with {df} dof"


def test_greedy_and_seed_behaviour() -> None:
    logits = LOGITS.tolist()
    assert rocket.sample_token(logits, rocket.SamplingParams(temperature=0.0), 1, 0) == 0
    p = rocket.SamplingParams(temperature=1.0)
    a = [rocket.sample_token(logits, p, 5, s) for s in range(64)]
    assert a == [rocket.sample_token(logits, p, 5, s) for s in range(64)]
    assert a != [rocket.sample_token(logits, p, 6, s) for s in range(64)]


def test_seeds_and_steps_past_their_range_are_named() -> None:
    logits = LOGITS.tolist()
    p = rocket.SamplingParams(temperature=1.0)
    assert rocket.sample_token(logits, p, 2**64 - 1, 2**64 - 1) in range(len(logits))
    for seed, step, name in [(-1, 0, "seed"), (2**64, 0, "seed"), (0, -3, "step")]:
        with pytest.raises(rocket.InvalidArgumentError) as e:
            rocket.sample_token(logits, p, seed, step)
        assert e.value.parameter == name, str(e.value)
