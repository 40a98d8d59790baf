"""What a prefill worker agrees to run: max_tokens, context, vocabulary, sampling, deadline.

``RequestLimits.check_prefill`` is pure (the door's limits and an event: the workers hold
events to the door's own checks); the compute-level guards run on the
seeded tiny model (CPU), with the clock the decode loop reads replaced so the deadline falls
between two given steps.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from gpu_workers import compute, engine
from gpu_workers.compute import ComputeError, check_token_range, context_length, prefill, vocab_size
from gpu_workers.engine import EXPIRED, decode_alone, generate_from_embeddings
from gpu_workers.lifecycle.admission import worker_limits
from runtime.model import ModelBundle, load_model, text_config
from runtime.request_limits import RequestLimits
from runtime.settings import Settings
from schemas.errors import ValidationError
from schemas.types import Features, PrefillEvent, SamplingParams

BOUNDS = RequestLimits.from_settings(
    Settings(max_tokens_limit=16, max_context_tokens=0), vocab_size=100, model_context=64
)


def event(token_ids: list[int], **sampling: object) -> PrefillEvent:
    return PrefillEvent(
        "r",
        "m",
        token_ids,
        Features({}, {}),
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def rule_of(ev: PrefillEvent, bounds: RequestLimits = BOUNDS) -> str | None:
    try:
        bounds.check_prefill(ev)
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
        BOUNDS.check_prefill(event([1, bad, 2], max_tokens=4))
    assert (err.value.rule, err.value.field, err.value.item) == ("render.token_ids", "token_ids", 1)
    assert "token_ids[1]" in str(err.value)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3},
        {"temperature": 1.0},
        {"temperature": 2.0, "top_p": 1.0, "top_k": 0},
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
        ({"temperature": 2.5}, "temperature"),  # the door's cap (MAX_TEMPERATURE), held here too
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_p": float("nan")}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"stop_token_ids": [1] * 65}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x" * 257]}, "stop"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
    ],
)
def test_sampling_out_of_bounds_is_refused_naming_the_field(
    sampling: dict[str, object], field: str
) -> None:
    with pytest.raises(ValidationError) as err:
        BOUNDS.check_prefill(event([1], max_tokens=4, **sampling))
    assert (err.value.rule, err.value.field) == (f"sampling.{field}", field)


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_model("tiny", device="cpu")


def test_bounds_follow_settings_within_the_model(bundle: ModelBundle) -> None:
    tc = text_config(bundle.config)
    s = Settings(max_tokens_limit=32, max_context_tokens=0)
    b = worker_limits(s, bundle)
    assert b == RequestLimits.from_settings(
        s, vocab_size=tc.vocab_size, model_context=tc.max_position_embeddings
    )
    assert (b.vocab_size, b.context_tokens, b.max_tokens) == (
        vocab_size(bundle),
        context_length(bundle),
        32,
    )
    assert (b.max_stop_strings, b.max_stop_string_chars, b.max_stop_token_ids) == (16, 256, 64)
    assert worker_limits(Settings(max_context_tokens=100), bundle).context_tokens == 100
    # A setting above the model's context cannot raise it.
    huge = Settings(max_context_tokens=tc.max_position_embeddings * 4)
    assert worker_limits(huge, bundle).context_tokens == tc.max_position_embeddings


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
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)

    def start() -> compute.Prefilled:
        return prefill(bundle, prompt, [])

    # The clock reads 0 at the pre-prefill check and the first two step checks, then 1000.
    ticks = itertools.chain([0, 0, 0], itertools.repeat(1000))
    monkeypatch.setattr(engine, "now_ms", lambda: next(ticks))
    done, seq = decode_alone(bundle, start, sampling, deadline_ms=500)
    assert done.outcome == EXPIRED
    assert seq.tokens == full[:3]  # stopped before the 4th token's forward pass
    # Already past before prefill: nothing runs.
    monkeypatch.setattr(engine, "now_ms", lambda: 1000)
    done, seq = decode_alone(bundle, lambda: pytest.fail("prefill ran"), sampling, deadline_ms=500)
    assert done.outcome == EXPIRED
    assert seq.tokens == []
    assert torch.is_grad_enabled()  # inference_mode was left cleanly
