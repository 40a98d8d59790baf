"""vLLM ``sampling_params`` <-> this pipeline's ``SamplingParams`` (the vLLM wire's sampling).

vLLM's field names and defaults (``vllm/sampling_params.py``): ``max_tokens`` 16,
``temperature`` 1.0 (0 is greedy), ``top_p`` 1.0, ``top_k`` 0 or -1 (off), ``seed`` None,
``stop`` (a string or a list of them), ``stop_token_ids``, ``ignore_eos``. A field this pipeline
cannot honour is refused when it asks for anything but its neutral value (``n`` > 1,
penalties, ``min_p``, ``min_tokens``, logprobs, logit bias, structured outputs...): ignoring it
would silently give other tokens than the client asked for. Fields vLLM reads that do not change
the tokens (``detokenize``, ``skip_special_tokens``, ``output_kind``, ``extra_args``) and
unknown keys pass without effect.

Rule ``sampling`` names the field, as the prefill worker's own check does; the worker still
applies its bounds (ranges, stop-string counts) to what comes through here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from schemas import defaults
from schemas.errors import ValidationError
from schemas.types import SamplingParams
from schemas.values import is_finite, is_int

VLLM_DEFAULT_TEMPERATURE = 1.0
"""vLLM samples at temperature 1 when a request names none."""

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1, None),
    "best_of": (1, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "min_p": (0, 0.0, None),
    "min_tokens": (0, None),
    "logprobs": (None,),
    "prompt_logprobs": (None,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "include_stop_str_in_output": (False, None),
    "structured_outputs": (None,),
    "guided_decoding": (None,),
    "truncate_prompt_tokens": (None,),
}
"""Fields honoured only at these values (what vLLM does by default). The OpenAI-compatible
routes extend this table (``frontend/api/openai_compat/protocol.py``) and differ on ``logprobs``
alone: OpenAI's is a flag (``false`` is off), vLLM's a count, where 0 (and so ``false``, which
equals 0) asks for the sampled token's log-probability: only null is off."""


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of a field's ``neutral`` values (:data:`NEUTRAL`)."""
    # True == 1 in Python: a boolean is neutral only where a boolean is (n=true is no n=1).
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


def pipeline_top_k(top_k: int | None) -> int:
    """``top_k`` as the pipeline spells it: vLLM's "all tokens" is -1 or 0 (or none), ours 0."""
    return 0 if top_k is None or top_k == -1 else top_k


def _bad(name: str, why: str) -> ValidationError:
    return ValidationError("sampling", f"sampling_params.{name} {why}", field=name)


def _number(params: Mapping[str, Any], name: str, default: float) -> float:
    v = params.get(name, default)
    if v is None:
        return default
    if not is_finite(v):
        raise _bad(name, f"must be a finite number, got {v!r}")
    return float(v)


def _integer(params: Mapping[str, Any], name: str, default: int | None) -> int | None:
    v = params.get(name, default)
    if v is None:
        return default
    if not is_int(v):
        raise _bad(name, f"must be an integer, got {v!r}")
    return v


def sampling_from_vllm(params: Mapping[str, Any]) -> SamplingParams:
    """``SamplingParams`` for a vLLM ``sampling_params`` object (vLLM's defaults where a field
    is absent); rule ``sampling`` for a field it cannot honour or a value of the wrong type."""
    if not isinstance(params, Mapping):
        raise _bad("", "must be an object")
    for name, neutral in NEUTRAL.items():
        if name in params and not is_neutral(params[name], neutral):
            raise _bad(name, f"= {params[name]!r} is not supported (only {neutral[0]!r})")
    stop = params.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", "must be a string or a list of strings")
    stop_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(is_int(t) for t in stop_ids):
        raise _bad("stop_token_ids", "must be a list of integers")
    ignore_eos = params.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos", "must be true or false")
    top_k = _integer(params, "top_k", 0)
    return SamplingParams(
        max_tokens=_integer(params, "max_tokens", defaults.MAX_TOKENS) or defaults.MAX_TOKENS,
        temperature=_number(params, "temperature", VLLM_DEFAULT_TEMPERATURE),
        stop_token_ids=list(stop_ids),
        ignore_eos=ignore_eos,
        top_p=_number(params, "top_p", 1.0),
        top_k=pipeline_top_k(top_k),
        seed=_integer(params, "seed", None),
        stop=list(stop),
    )


def sampling_to_vllm(s: SamplingParams) -> dict[str, Any]:
    """The vLLM ``sampling_params`` of ``s`` (every field spelled out, so vLLM's own defaults,
    e.g. its temperature of 1, never change what ``s`` means)."""
    return {
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "seed": s.seed,
        "stop": list(s.stop),
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
    }
