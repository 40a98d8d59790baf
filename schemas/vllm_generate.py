"""vLLM's ``/inference/v1/generate`` as a prefill worker speaks it: request bodies and replies.

The vLLM engine backend (``EPD_ENGINE=vllm``) hands a validated :class:`PrefillEvent` to a vLLM
instance started with ``--enable-scale-out`` (or ``--tokens-only``). The body is the
``GenerateRequest`` of vLLM 0.33.0 (``vllm/entrypoints/scale_out/token_in_token_out/
protocol.py``): the prompt's ``token_ids``, ``features`` with ``mm_hashes``,
``mm_placeholders`` and ``mm_metadata`` (the encoder inputs stay out: the embeddings arrive
through vLLM's EC connector from our store), every sampling field spelled out, and
``ec_transfer_params`` at the top level, where vLLM's serving code reads it and copies it into
``sampling_params.extra_args`` for its EC connector.

Replies are read in vLLM's own shapes: a whole ``GenerateTokensResponse``, the server-sent
events of ``GenerateTokensStreamResponse`` chunks ending ``data: [DONE]``, and
``ErrorResponse`` (``{"error": {message, type, param, code}}``), as a 4xx/5xx body or as a
chunk inside a stream. A 400, 413 or 422 is the request's fault (:class:`VllmRejected`, rule
``vllm.rejected``: dead-lettered); any other status, a dropped connection or a stream that ends
without its finish is not (:class:`VllmUnavailable`, a ``ConnectionError``: retried).

Plain JSON dicts only: this module does not import vLLM. ``tests/unit/test_vllm_contract.py``
holds it to vLLM's own models.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.ec_entries import ec_entry_json
from schemas.errors import ValidationError
from schemas.types import ECTransfer, PrefillEvent
from schemas.vllm_sampling import sampling_to_vllm
from schemas.vllm_wire import features_to_json, kv_transfer_params_from_text

GENERATE_PATH = "/inference/v1/generate"
"""vLLM's token-in/token-out generate route (``--enable-scale-out`` or ``--tokens-only``)."""
ABORT_PATH = "/inference/v1/abort_requests"
"""vLLM's abort route: ``{"request_ids": [...]}`` (vLLM's engine ids, :func:`engine_request_id`)."""
VLLM_VERSION = "0.33.0"
"""The vLLM release these bodies and replies are built and tested against."""

REJECTED_RULE = "vllm.rejected"
"""The rule a request vLLM refused (a 400, 413 or 422) is dead-lettered with."""
ITEM_SOURCE_RULE = "vllm.item-source"
"""The rule of an item this backend cannot hand to vLLM safely (see :func:`generate_body`)."""
MAX_MESSAGE_CHARS = 500
"""vLLM's error message is cut to this length (it reaches DLQ headers and status records)."""

EVENT_FAULTS = frozenset({400, 413, 422})
"""vLLM's answers that blame the request itself (a bad or too large body): dead-lettered. Any
other status (a 401/403 or 404 of a misconfigured deployment, a 429, a 5xx) is retried: the
event is fine and must not be lost while the deployment is put right."""

FINISH_ABORT = "abort"
"""vLLM's finish reason for a request its engine aborted."""


def engine_request_id(request_id: str) -> str:
    """The id vLLM's engine runs ``request_id`` under: its generate route prefixes the body's
    ``request_id`` (``serving.py``: ``generate-tokens-{id}``), and ``abort_requests`` takes
    that engine id."""
    return f"generate-tokens-{request_id}"


def ec_params_json(params: Mapping[str, ECTransfer]) -> dict[str, dict[str, Any]]:
    """``ec_transfer_params`` as JSON, ``{mm_hash: {mm_hash, store, key, expires_ms,
    signature}}`` (the shape the render split writes and the EC connector reads)."""
    return {h: ec_entry_json(ec) for h, ec in params.items()}


def _check_item_sources(ev: PrefillEvent) -> None:
    """Every item must bring its encoder inputs (``kwargs_data``) or its metadata with its own
    EC entry. vLLM's ``/generate`` reads an item with neither (a render made with
    ``return_mm_kwargs: false``) as "in my processor cache", which a fresh instance is not."""
    f = ev.features
    kwargs, meta = f.kwargs_data or {}, f.mm_metadata or {}
    for modality, index, mm_hash in f.items():
        if (kwargs.get(modality) or [None] * (index + 1))[index] is not None:
            continue
        if (meta.get(modality) or [None] * (index + 1))[index] is None:
            raise ValidationError(
                ITEM_SOURCE_RULE,
                "the item has neither kwargs_data nor mm_metadata: vLLM would look it up in "
                "its own processor cache",
                modality=modality,
                item=index,
            )
        if mm_hash not in ev.ec_transfer_params:
            raise ValidationError(
                ITEM_SOURCE_RULE,
                "a metadata-only item needs its ec_transfer_params entry (its embedding "
                "arrives through the EC connector)",
                modality=modality,
                item=index,
            )


def generate_body(
    ev: PrefillEvent, *, model: str | None = None, stream: bool = True
) -> dict[str, Any]:
    """The ``GenerateRequest`` JSON for ``ev`` (validated by the worker's gate first).

    ``model``: the served model name to name (None: vLLM's default). Stop strings are sent as
    they are: a ``--tokens-only`` server refuses them (it does not detokenize), so requests
    with stop strings need an ``--enable-scale-out`` server. Raises ``ValidationError``
    (:data:`ITEM_SOURCE_RULE`) for an item vLLM would misread.
    """
    _check_item_sources(ev)
    body: dict[str, Any] = {"request_id": ev.request_id, "token_ids": list(ev.token_ids)}
    if ev.features.mm_hashes:
        feats = features_to_json(ev.features)
        if feats["kwargs_data"] is None:
            del feats["kwargs_data"]
        body["features"] = feats
    body["sampling_params"] = sampling_to_vllm(ev.sampling)
    if model is not None:
        body["model"] = model
    body["stream"] = stream
    if ev.cache_salt is not None:
        body["cache_salt"] = ev.cache_salt
    kv = kv_transfer_params_from_text(ev.kv_transfer_params)
    if kv is not None:
        body["kv_transfer_params"] = kv
    if ev.ec_transfer_params:
        body["ec_transfer_params"] = ec_params_json(ev.ec_transfer_params)
    return body


def abort_body(request_ids: list[str]) -> dict[str, Any]:
    """The ``abort_requests`` body for our request ids (as vLLM's engine names them)."""
    return {"request_ids": [engine_request_id(r) for r in request_ids]}


# ---------------------------------------------------------------------------------------------
# Replies


class VllmRejected(ValidationError):
    """vLLM refused the request (:data:`EVENT_FAULTS`, as a reply or inside a stream): the
    event's fault."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(REJECTED_RULE, f"vLLM answered {status}: {_bounded(message)}")


class VllmUnavailable(ConnectionError):
    """vLLM could not serve the request now (a 5xx, a dropped connection, a stream cut short):
    the consume loop retries it (a ``ConnectionError`` is an infrastructure failure there)."""


def _bounded(message: str) -> str:
    return (
        message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 3] + "..."
    )


@dataclass(slots=True)
class VllmOutput:
    """What one reply (a whole response, or one streamed chunk) says about choice 0."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def error_for(status: int, body: bytes | str) -> Exception:
    """The error a non-200 reply stands for: :class:`VllmRejected` for :data:`EVENT_FAULTS`
    (with vLLM's own message when the body is an ``ErrorResponse``), :class:`VllmUnavailable`
    otherwise."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    message = text
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            message = err["message"]
        elif isinstance(doc.get("detail"), str | list):  # FastAPI's HTTPException shape
            message = str(doc["detail"])
    if status in EVENT_FAULTS:
        return VllmRejected(status, message)
    return VllmUnavailable(f"vLLM answered {status}: {_bounded(message)}")


def _choice0(doc: Mapping[str, Any]) -> VllmOutput:
    if "error" in doc and isinstance(doc["error"], dict):
        err = doc["error"]
        code = err.get("code")
        raise error_for(code if isinstance(code, int) else 500, json.dumps(doc))
    choices = doc.get("choices")
    if not isinstance(choices, list):
        raise VllmUnavailable(f"a vLLM reply without choices: {_bounded(json.dumps(doc))}")
    for c in choices:
        if isinstance(c, dict) and c.get("index", 0) == 0:
            tokens = c.get("token_ids") or []
            return VllmOutput(list(tokens), c.get("finish_reason"), c.get("stop_reason"))
    return VllmOutput()  # the usage-only last chunk has no choices


def parse_response(doc: Any) -> VllmOutput:
    """A whole (``stream: false``) ``GenerateTokensResponse``: every token and the finish."""
    if not isinstance(doc, dict):
        raise VllmUnavailable("a vLLM reply that is not a JSON object")
    return _choice0(doc)


DONE = "[DONE]"


def parse_event(line: str) -> VllmOutput | None:
    """One server-sent event line of a streamed reply: its delta (tokens, and on the last chunk
    the finish reason), None for a line that carries none (blank, a comment, ``[DONE]``).
    An ``ErrorResponse`` chunk raises (:func:`error_for`)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == DONE:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        raise VllmUnavailable(f"an unreadable vLLM stream chunk: {_bounded(data)}") from None
    return parse_response(doc)
