"""Default values that both the settings (runtime floor) and contract-level tools need.

Written once here: ``runtime.settings.Settings`` uses them as its defaults, and so do tools of
the contract floor that run without settings (``schemas.vllm_split.split_render``).
"""

from __future__ import annotations

TOPIC_PREFIX = "epd"
REDIS_URL = "redis://127.0.0.1:6379/0"
EC_NAMESPACE = "ec"
EMBEDDING_TTL_S = 600
TINY_MODEL = "tiny"
STORE_SCHEMES = ("redis", "rediss", "redis+cluster", "shm", "local", "cuda")
"""Embedding store URI schemes (``runtime.stores.open_store``; checked when settings load)."""
MAX_KV_TRANSFER_PARAMS_BYTES = 64 * 1024
"""Largest vLLM ``kv_transfer_params`` (JSON text) an event may carry through to decode."""
MAX_TENSOR_BYTES = 256 * 1024 * 1024
"""The floor of the largest tensor an event may carry or claim-check (``EPD_MAX_TENSOR_BYTES``
unset: derived from the processor's ``max_pixels``, never below this)."""
MAX_TOKENS = 16
"""``max_tokens`` of a request that names none (this pipeline's and vLLM's default)."""
MAX_STOP_STRINGS = 16
"""Stop strings one request may carry (``EPD_MAX_STOP_STRINGS``)."""
MAX_STOP_STRING_CHARS = 256
"""Characters of one stop string (``EPD_MAX_STOP_STRING_CHARS``)."""
MAX_STOP_TOKEN_IDS = 64
"""Stop token ids one request may carry (``EPD_MAX_STOP_TOKEN_IDS``)."""
API_MAX_MESSAGES = 256
"""Messages of one chat request (``EPD_API_MAX_MESSAGES``)."""
API_MAX_MESSAGE_PARTS = 64
"""Content parts of one chat message (``EPD_API_MAX_MESSAGE_PARTS``)."""
