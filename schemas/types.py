"""In-process event types: plain dataclasses mirroring the Avro records in ``schemas/avro``.

Tensors are ``torch.Tensor`` objects; the codec turns them into ``Tensor`` records (raw
little-endian bytes) and back without copying on decode (:mod:`schemas.tensors`).

Reading this module imports no torch: processes that never hold a tensor (the results
collector and its sweep) read these events too, and torch alone costs them hundreds of MB.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from schemas import defaults

# Re-exported where the event types are: the status vocabulary itself is schemas/statuses.py.
from schemas.statuses import STATUSES as STATUSES
from schemas.statuses import TERMINAL_STATUSES as TERMINAL_STATUSES

DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}
"""The wire's tensor dtypes (the ``epd.DType`` enum; torch's names) and the bytes of one
element of each. Their torch dtypes: ``schemas.tensors.DTYPES``."""

if TYPE_CHECKING:
    from torch import Tensor
else:

    class _HintOnly(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            raise TypeError("schemas.types.Tensor is a type hint only: test against torch.Tensor")

    class Tensor(metaclass=_HintOnly):
        """``torch.Tensor`` as the type hints below name it when the program runs.

        Type checkers see torch's class. At run time only the codec reads this name (its
        converters map it to the ``epd.Tensor`` record, whose values are ``torch.Tensor``s:
        :mod:`schemas.tensors`), so reading the contract imports no torch. A value is never
        tested against it (``isinstance`` raises): test against ``torch.Tensor``."""


def now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch."""
    return int(time.time() * 1000)


@dataclass(slots=True)
class TensorRef:
    """Claim check for a tensor parked in a store instead of travelling inline."""

    store: str
    key: str
    dtype: str
    shape: list[int]
    nbytes: int
    digest: str


TensorLike = Tensor | TensorRef
ItemData = dict[str, TensorLike]
"""One item's fields (``pixel_values``, ``image_grid_thw``, ...)."""


@dataclass(slots=True)
class PlaceholderRange:
    offset: int
    length: int
    is_embed: list[bool] | None = None


@dataclass(slots=True)
class Features:
    """Mirror of vLLM's ``MultiModalFeatures``; every map shares one per-modality item order."""

    mm_hashes: dict[str, list[str]]
    mm_placeholders: dict[str, list[PlaceholderRange]]
    kwargs_data: dict[str, list[ItemData | None]] | None = None
    mm_metadata: dict[str, list[ItemData | None]] | None = None

    def items(self) -> list[tuple[str, int, str]]:
        """(modality, index, mm_hash) for every item, modality by modality."""
        return [(m, i, h) for m, hashes in self.mm_hashes.items() for i, h in enumerate(hashes)]


@dataclass(slots=True)
class ECTransfer:
    """One ``ec_transfer_params`` entry: where an item's encoder output lives."""

    mm_hash: str
    store: str
    key: str
    expires_ms: int
    signature: str = ""


@dataclass(slots=True)
class SamplingParams:
    """How a request's tokens are chosen and when generation ends.

    ``temperature`` 0 is greedy (``top_p``, ``top_k`` and ``seed`` unused); above 0 the logits
    go through temperature, top-k and top-p in transformers' warper order and the token is drawn
    from the request's own generator seeded with ``seed``. ``stop`` strings end generation and
    are cut from the text; ``stop_token_ids`` (and eos unless ``ignore_eos``) end it too."""

    max_tokens: int = defaults.MAX_TOKENS
    temperature: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0.0


@dataclass(slots=True)
class ErrorInfo:
    code: str
    message: str
    rule: str | None = None
    modality: str | None = None
    item: int | None = None
    field: str | None = None


@dataclass(slots=True)
class RenderEvent:
    request_id: str
    model: str
    token_ids: list[int]
    features: Features
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    deadline_ms: int | None = None
    created_ms: int = field(default_factory=now_ms)
    trace: dict[str, str] = field(default_factory=dict)
    kv_transfer_params: str | None = None
    """vLLM's ``kv_transfer_params`` as JSON text, passed through to prefill and decode as is."""


@dataclass(slots=True)
class EncodeEvent:
    request_id: str
    model: str
    modality: str
    item_index: int
    mm_hash: str
    data: ItemData
    ec_transfer: ECTransfer
    deadline_ms: int | None = None
    created_ms: int = field(default_factory=now_ms)
    trace: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class PrefillEvent:
    request_id: str
    model: str
    token_ids: list[int]
    features: Features
    ec_transfer_params: dict[str, ECTransfer] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    deadline_ms: int | None = None
    created_ms: int = field(default_factory=now_ms)
    trace: dict[str, str] = field(default_factory=dict)
    kv_transfer_params: str | None = None
    """vLLM's ``kv_transfer_params`` as JSON text, passed through as is."""


@dataclass(slots=True)
class KVTransfer:
    """Where a request's parked KV cache lives (prefill -> decode handoff); signed like an
    ``ec_transfer_params`` entry, bound to its request."""

    store: str
    key: str
    expires_ms: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    seq_len: int
    next_position: list[int]
    nbytes: int
    signature: str = ""


@dataclass(slots=True)
class DecodeEvent:
    """A request handed from a prefill worker to decode workers (``{prefix}.decode``)."""

    prefill: PrefillEvent
    """The event the request came as: its tokens, sampling, deadline and, should the KV be
    gone, what a decode worker needs to run the prefill again."""
    kv: KVTransfer | None = None
    kv_transfer_params: str | None = None
    created_ms: int = field(default_factory=now_ms)

    @property
    def request_id(self) -> str:
        return self.prefill.request_id

    @property
    def deadline_ms(self) -> int | None:
        return self.prefill.deadline_ms

    @property
    def trace(self) -> dict[str, str]:
        return self.prefill.trace


@dataclass(slots=True)
class EncodedEvent:
    mm_hash: str
    request_id: str
    model: str
    store: str
    key: str
    dtype: str
    shape: list[int]
    ok: bool = True
    error: ErrorInfo | None = None
    cache_hit: bool = False
    encode_ms: float = 0.0
    created_ms: int = field(default_factory=now_ms)


@dataclass(slots=True)
class ResultEvent:
    request_id: str
    stage: str
    status: str
    token_ids: list[int] | None = None
    text: str | None = None
    error: ErrorInfo | None = None
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    worker: str = ""
    created_ms: int = field(default_factory=now_ms)


@dataclass(slots=True)
class DeadLetter:
    original_topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    consumer_group: str
    error: ErrorInfo
    attempts: int = 1
    headers: dict[str, bytes] = field(default_factory=dict)
    failed_ms: int = field(default_factory=now_ms)


Event = (
    RenderEvent | EncodeEvent | PrefillEvent | DecodeEvent | EncodedEvent | ResultEvent | DeadLetter
)
EVENT_TYPES: tuple[type, ...] = (
    RenderEvent,
    EncodeEvent,
    PrefillEvent,
    DecodeEvent,
    EncodedEvent,
    ResultEvent,
    DeadLetter,
)
