"""What a prefill worker agrees to run: max_tokens, context, vocabulary, sampling, deadline.

``check_bounds`` is pure (a ``Bounds`` and an event); the compute-level guards run on the
seeded tiny model (CPU), with the clock the decode loop reads replaced so the deadline falls
between two given steps.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from gpu_workers import compute
from gpu_workers.compute import (
    ComputeError,
    DeadlineExceeded,
    check_token_range,
    generate_from_embeddings,
)
from gpu_workers.prefill import Bounds, check_bounds
from runtime.model import ModelBundle, load_model, text_config
from runtime.settings import Settings
from schemas.errors import ValidationError
from schemas.types import Features, PrefillEvent, SamplingParams

BOUNDS = Bounds(vocab_size=100, context=64, max_tokens=16)


def event(token_ids: list[int], **sampling: object) -> PrefillEvent:
    return PrefillEvent(
        "r",
        "m",
        token_ids,
        Features({}, {}),
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def rule_of(ev: PrefillEvent, bounds: Bounds = BOUNDS) -> str | None:
    try:
        check_bounds(ev, bounds)
    except ValidationError as e:
        return e.rule
    return None


def test_within_bounds_passes() -> None:
    assert rule_of(event([0, 5, 99], max_tokens=16)) is None
    assert rule_of(event(list(range(48)), max_tokens=16)) is None  # exactly the context


@pytest.mark.parametrize("max_tokens", [0, -1, 17, 10**9])
def test_max_tokens_is_capped(max_tokens: int) -> None:
    assert rule_of(event([1, 2], max_tokens=max_tokens)) == "max-tokens"


def test_prompt_plus_max_tokens_must_fit_the_context() -> None:
    assert rule_of(event(list(range(49)), max_tokens=16)) == "context-length"
    assert rule_of(event([1] * 65, max_tokens=1)) == "context-length"


@pytest.mark.parametrize("bad", [100, 101, 2**31])
def test_token_ids_must_be_inside_the_vocabulary(bad: int) -> None:
    with pytest.raises(ValidationError) as err:
        check_bounds(event([1, bad, 2], max_tokens=4), BOUNDS)
    assert (err.value.rule, err.value.field) == ("token-ids", "token_ids")
    assert "token_ids[1]" in str(err.value)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3},
        {"temperature": 1.0},
        {"temperature": 2.5, "top_p": 1.0, "top_k": 0},
        {"temperature": 0.0, "stop": ["\n\n", "END"]},
        {"temperature": 0.001},
    ],
)
def test_sampling_within_bounds_runs(sampling: dict[str, object]) -> None:
    assert rule_of(event([1], max_tokens=4, **sampling)) is None


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e-9}, "temperature"),  # logits / 1e-9 overflow: refused, not NaN
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_p": float("nan")}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x" * 257]}, "stop"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
    ],
)
def test_sampling_out_of_bounds_is_refused_naming_the_field(
    sampling: dict[str, object], field: str
) -> None:
    with pytest.raises(ValidationError) as err:
        check_bounds(event([1], max_tokens=4, **sampling), BOUNDS)
    assert (err.value.rule, err.value.field) == ("sampling", field)


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_model("tiny", device="cpu")


def test_bounds_follow_settings_within_the_model(bundle: ModelBundle) -> None:
    tc = text_config(bundle.config)
    b = Bounds.for_model(Settings(max_tokens_limit=32, max_context_tokens=0), bundle)
    assert b == Bounds(tc.vocab_size, tc.max_position_embeddings, 32, 16, 256)
    assert Bounds.for_model(Settings(max_context_tokens=100), bundle).context == 100
    # A setting above the model's context cannot raise it.
    huge = Settings(max_context_tokens=tc.max_position_embeddings * 4)
    assert Bounds.for_model(huge, bundle).context == tc.max_position_embeddings


def test_out_of_vocabulary_id_is_refused_before_any_tensor(
    bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    vocab = int(text_config(bundle.config).vocab_size)

    def no_tensors(*a: object, **k: object) -> None:
        raise AssertionError("a tensor was built")

    # On CUDA, embed_tokens on such an id is a device-side assert that kills the process.
    monkeypatch.setattr(compute.torch, "tensor", no_tensors)
    with pytest.raises(ComputeError, match="outside the vocabulary"):
        generate_from_embeddings(bundle, [1, vocab, 2], [], 4)
    with pytest.raises(ComputeError, match="outside the vocabulary"):
        check_token_range(bundle, [-1])


def test_prompt_longer_than_the_context_is_refused(bundle: ModelBundle) -> None:
    ctx = int(text_config(bundle.config).max_position_embeddings)
    with pytest.raises(ComputeError, match="context"):
        generate_from_embeddings(bundle, [1] * (ctx + 1), [], 1)


def test_deadline_is_checked_between_decode_steps(
    bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = [5, 6, 7, 8]
    full = generate_from_embeddings(bundle, prompt, [], 6, ignore_eos=True)
    assert len(full) == 6
    # The clock reads 0 at the pre-prefill check and the first two step checks, then 1000.
    ticks = itertools.chain([0, 0, 0], itertools.repeat(1000))
    monkeypatch.setattr(compute, "now_ms", lambda: next(ticks))
    with pytest.raises(DeadlineExceeded) as err:
        generate_from_embeddings(bundle, prompt, [], 6, ignore_eos=True, deadline_ms=500)
    assert err.value.tokens == full[:3]  # stopped before the 4th token's forward pass
    # Already past before prefill: nothing runs.
    monkeypatch.setattr(compute, "now_ms", lambda: 1000)
    with pytest.raises(DeadlineExceeded) as err:
        generate_from_embeddings(bundle, prompt, [], 6, deadline_ms=500)
    assert err.value.tokens == []
    assert torch.is_grad_enabled()  # inference_mode was left cleanly
