"""Configuration from ``EPD_*`` environment variables (and CLI flags that override them)."""

from __future__ import annotations

import hashlib
import json
import re
from functools import cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from runtime.api_tokens import parse_tokens
from runtime.url_hosts import UrlHosts, parse_url_hosts
from schemas import defaults
from schemas.families import MODEL_HELP

SIGNING_WORKERS = frozenset({"encode", "prefill", "decode", "router", "api"})
"""Processes that sign or verify ``ec_transfer_params`` and parked-KV entries (the API's fan-out
signs them)."""
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_TOPIC_PREFIX = re.compile(r"[A-Za-z0-9._-]{1,200}")
SECRET_FIELDS = frozenset({"ec_secret", "api_tokens", "admin_tokens", "vllm_api_key"})
PLACEHOLDER_SECRETS = frozenset({"change-me", "changeme", "secret", "password", "test"})
MIN_SECRET_CHARS = 16


class InsecureSettings(SystemExit):
    """Settings a worker refuses to run with (a missing or placeholder secret).

    A ``SystemExit``: the worker process ends with the message on stderr and status 1, not a
    traceback."""


def _redis_url_checked(url: str) -> str:
    """``url`` unchanged; a ``redis+cluster://`` one must name its seeds as HOST:PORT, and any
    one's numeric options (``max_connections``, the socket timeouts) must be numbers."""
    from runtime.redis.cluster import ClusterURL, is_cluster_url
    from runtime.stores.url_options import check_store_options

    if url and is_cluster_url(url):
        ClusterURL.parse(url)  # ValueError says which seed or part is wrong
    check_store_options(url)  # ValueError names the option
    return url


class Settings(BaseSettings):
    """Every knob of the pipeline. Read from the environment with the ``EPD_`` prefix."""

    # Errors never echo a value (a secret may be the bad one); settings_error names the variable.
    model_config = SettingsConfigDict(env_prefix="EPD_", extra="ignore", hide_input_in_errors=True)

    # Kafka
    kafka_bootstrap: str = Field("127.0.0.1:9092", description="bootstrap servers, comma separated")
    kafka_idempotence: bool = Field(
        True, description="idempotent producer; the embedded Tansu broker needs false"
    )
    kafka_session_timeout_ms: int = Field(
        10000, description="consumer group session timeout; Tansu holds a join for half of it"
    )
    kafka_heartbeat_interval_ms: int = 3000
    kafka_fetch_max_wait_ms: int = Field(
        500,
        description="longest a fetch waits for data; Kafka answers as soon as data arrives, "
        "Tansu only when the wait ends, so keep it short there",
    )
    results_linger_ms: int = Field(
        5,
        ge=0,
        le=1000,
        description="how long the producer of status updates and encoded marks (the results "
        "and encoded topics) waits to batch records: they are written through to the status "
        "record first, so off the client's path; under load concurrent requests' updates share "
        "a produce request (0: each goes at once)",
    )
    kafka_idle_fetch_max_wait_ms: int = Field(
        5000,
        ge=0,
        le=30000,
        description="fetch wait of a consume loop idle for EPD_KAFKA_FETCH_IDLE_AFTER_S (no "
        "records, nothing in flight), which then takes the first record that comes (min bytes "
        "1); the first record brings the loop's own fetch back. Apache Kafka answers a waiting "
        "fetch as soon as a record lands, so a long wait costs no latency and saves the "
        "polls; Tansu answers only when the wait ends, so after a quiet spell each hop may "
        "wait up to this long once (epd up prints 250 for Tansu); at most the loop's own wait: "
        "no idle back-off",
    )
    kafka_fetch_idle_after_s: float = Field(
        5.0,
        ge=0,
        description="how long a consume loop has had no records and no work before it fetches "
        "with EPD_KAFKA_IDLE_FETCH_MAX_WAIT_MS",
    )
    results_fetch_max_wait_ms: int | None = Field(
        None,
        description="the results collector's fetch wait (unset: EPD_KAFKA_FETCH_MAX_WAIT_MS); "
        "stages write their updates through to the status record, so the collector is off the "
        "client's path and can poll a short-wait broker (Tansu) less often",
    )
    results_fetch_min_bytes: int = Field(
        16384,
        ge=1,
        description="bytes the broker gathers for the results collector before it answers "
        "(within its fetch wait): the collector is off the client's path, so it takes the "
        "updates of many requests per fetch instead of one fetch (and one broker round trip) "
        "per update",
    )
    kafka_transactions: bool = Field(
        False,
        description="transactional consume loops: a batch's output records, dead letters and "
        "offset commit are one Kafka transaction (needs Apache Kafka; Tansu has none)",
    )
    kafka_transactional_id: str = Field(
        "",
        description="base of the transactional ids (one per consume loop); keep it stable per "
        "worker instance (e.g. a StatefulSet pod name) so a restart fences its previous "
        "incarnation at once; empty: group, host and pid (unique, no fencing across restarts)",
    )
    kafka_transaction_timeout_ms: int = Field(
        30000,
        ge=1000,
        description="broker aborts a transaction open this long; one batch must finish within "
        "it, and a crashed worker's open transaction holds read_committed readers this long "
        "at most",
    )
    topic_prefix: str = defaults.TOPIC_PREFIX
    topic_partitions: int = 4
    max_message_bytes: int = Field(16 * 1024 * 1024, description="broker and producer message cap")
    compression: Literal["none", "gzip", "lz4", "zstd"] = Field(
        "none", description="producer compression for encoder inputs (pixels barely compress)"
    )
    prefill_compression: Literal["none", "gzip", "lz4", "zstd"] = Field(
        "gzip",
        description="compression of prefill events: their bytes are mostly runs of placeholder "
        "token ids, which gzip shrinks about tenfold",
    )

    # Redis (status records; also the default embedding store)
    redis_url: str = defaults.REDIS_URL
    redis_max_connections: int = Field(
        64,
        ge=1,
        description="connections per process to EPD_REDIS_URL (status records, replay ledger); "
        "beyond them a command waits for a free one instead of failing",
    )
    redis_pool_timeout_s: float = Field(
        10.0, gt=0, description="longest a command waits for a free Redis connection"
    )
    redis_socket_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest one Redis command waits for its answer before it fails (redis-py 8 "
        "defaults to 5 s, so a Redis frozen for 5 s failed requests that only had to wait)",
    )
    status_ttl_s: int = 3600
    status_hold_ms: float = Field(
        20.0,
        ge=0,
        le=1000,
        description="longest a prefill or decode worker holds a request's progress update "
        "(prefilling, decoding) for the updates behind it, so that a request done meanwhile "
        "writes its record and sends its results in one go; an outcome is never held (0: "
        "each progress update goes at once)",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="deadline of a request that brings none (seconds from its fan-out): no "
        "request can stay unfinished for ever, whatever the broker lost",
    )
    sweep_interval_s: float = Field(
        5.0,
        ge=0,
        description="how often the results collector sweeps unfinished requests: past their "
        "deadline -> expired, their events gone from the broker -> failed broker-lost (0: off)",
    )
    sweep_idle_interval_s: float = Field(
        60.0,
        ge=0,
        description="longest the sweep waits while there is nothing unfinished: from "
        "EPD_SWEEP_INTERVAL_S it doubles after each pass that found nothing, up to this; any "
        "stage update the collector reads (folded or recorded by its stage) brings it back to "
        "EPD_SWEEP_INTERVAL_S (a pass then comes at most that long after it)",
    )
    sweep_stale_s: float = Field(
        60.0,
        gt=0,
        description="a request's record unchanged this long may be judged lost by the sweep; "
        "longer than a producer retries a send (40 s), so an event on its way is not taken "
        "for a lost one",
    )

    # Embedding store and claim checks
    store_url: str = Field("", description="embedding store URI; empty means EPD_REDIS_URL")
    embedding_ttl_s: int = defaults.EMBEDDING_TTL_S
    embedding_wait_s: float = Field(
        60.0,
        description="longest a prefill worker waits for a request's embeddings (the request's "
        "deadline caps it)",
    )
    embedding_recheck_s: float = Field(
        2.0,
        gt=0,
        description="how often a prefill worker waiting for embeddings judges again whether "
        "they can still come (one that was lost ends the request as embedding-lost then)",
    )
    claim_ttl_s: int = Field(
        120,
        ge=1,
        description="lifetime of a claim-checked encoder input in the store (capped by the "
        "request's deadline); the encode worker deletes it once the embedding is stored",
    )
    inline_limit_bytes: int = Field(
        256 * 1024, description="encoder inputs above this size travel as a TensorRef claim check"
    )

    # Safety
    ec_secret: SecretStr | None = Field(None, description="HMAC key for ec_transfer_params")
    ec_namespace: str = Field(
        defaults.EC_NAMESPACE, description="embedding keys must live under this prefix"
    )
    validation_mode: Literal["strict", "vllm"] = "strict"
    spatial_merge_size: int = 2
    max_tensor_bytes: int | None = Field(
        None,
        ge=1,
        description="largest tensor an event may carry or claim-check; unset: derived from the "
        "image processor's max_pixels (max_pixels x 3 x temporal_patch x 4 bytes, at least "
        "256 MiB), so any image the processor accepts can travel",
    )
    max_image_pixels: int | None = Field(
        None,
        ge=1,
        description="width x height refused from the image header before decoding; unset: "
        "the larger of 4096x4096 and 4 x the processor's max_pixels",
    )
    max_image_scans: int = Field(
        100,
        ge=1,
        description="scans of one JPEG (baseline: 1, progressive: about 10), counted before "
        "decoding: each scan makes the decoder pass over the whole image, so a small file of "
        "repeated scans decodes for seconds (413 render.image_too_complex)",
    )
    max_image_chunks: int = Field(
        16384,
        ge=1,
        description="marker segments of one JPEG, chunks of a PNG or WebP, blocks of a GIF, "
        "counted before decoding (413 render.image_too_complex)",
    )
    pixel_dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="dtype encoder inputs travel in (encode topic and claim checks); auto: "
        "bf16 when EPD_DEVICE resolves to CUDA, fp32 on CPU (exact CPU parity)",
    )
    allow_unsigned: bool = Field(
        False,
        description="let encode, prefill and router workers run without EPD_EC_SECRET "
        "(unsigned ec_transfer_params: anyone who can write to the topics can name embedding "
        "keys); for local experiments only",
    )
    max_tokens_limit: int = Field(
        2048, ge=1, description="largest max_tokens a request may ask for; more is rejected"
    )
    max_context_tokens: int = Field(
        0,
        ge=0,
        description="cap on prompt + max_tokens; 0 means the model's max_position_embeddings "
        "(a larger value is still held to the model's context)",
    )

    max_stop_strings: int = Field(
        defaults.MAX_STOP_STRINGS,
        ge=0,
        description="most stop strings one request may carry; more is rejected",
    )
    max_stop_string_chars: int = Field(
        defaults.MAX_STOP_STRING_CHARS,
        ge=1,
        description="longest stop string (characters); longer is rejected",
    )
    max_stop_token_ids: int = Field(
        defaults.MAX_STOP_TOKEN_IDS,
        ge=0,
        description="most stop token ids one request may carry; more is rejected",
    )

    # Decoding: continuous batching and the optional decode stage
    decode_max_batch: int = Field(
        32,
        ge=1,
        description="most sequences one worker decodes together (one forward per step over all "
        "of them); 1 decodes one request at a time",
    )
    decode_kv_budget_bytes: int = Field(
        0,
        ge=0,
        description="KV cache one worker's batch may hold at its largest (sequences x the "
        "longest prompt + max_tokens among them x the model's KV bytes per position); a request "
        "that does not fit waits, one that never could is rejected (kv-budget); 0: derived "
        "(40% of the GPU memory free after loading the model; 2 GiB on CPU)",
    )
    decode_stage: bool = Field(
        False,
        description="prefill workers run the prompt only, park its KV cache in the store and "
        "hand the request to decode workers (`epd worker decode`) through {prefix}.decode",
    )
    engine: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="what computes in the encode and prefill workers: `transformers`, this "
        "project's reference engine (batched, in the worker), or `vllm`: the workers hand each "
        "request to vLLM 0.33 instances (EPD_VLLM_PREFILL_URL, EPD_VLLM_ENCODE_URL) and keep "
        "everything around the compute (consume loop, validation, status, cancel, deadlines, "
        "DLQ, metrics)",
    )
    vllm_prefill_url: str = Field(
        "",
        description="EPD_ENGINE=vllm: the vLLM prefill/decode instances (`vllm serve "
        "--enable-scale-out`), comma-separated base URLs; a request id hashes to one of them",
    )
    vllm_encode_url: str = Field(
        "",
        description="EPD_ENGINE=vllm: the vLLM encoder instances (EC producer role), "
        "comma-separated base URLs; a request id hashes to one of them",
    )
    vllm_model: str = Field(
        "",
        description="EPD_ENGINE=vllm: the served model name the generate requests name (empty: "
        "the instance's own)",
    )
    vllm_timeout_s: float = Field(
        120.0,
        gt=0,
        description="EPD_ENGINE=vllm: longest wait for vLLM's next byte (a reply, the next "
        "streamed token); past it the try is retried",
    )
    vllm_connect_timeout_s: float = Field(
        5.0, gt=0, description="EPD_ENGINE=vllm: longest wait to connect to a vLLM instance"
    )
    vllm_api_key: SecretStr | None = Field(
        None,
        description="EPD_ENGINE=vllm: the key the vLLM instances were started with (`vllm serve "
        "--api-key`), sent as a bearer token",
    )
    kv_ttl_s: int = Field(
        300,
        ge=1,
        description="lifetime of a parked KV cache (capped by the request's deadline); a decode "
        "worker that finds it gone runs the prefill again itself",
    )

    # Token streams (the decode loop -> Redis -> the API's streams)
    stream_tokens: bool = Field(
        True,
        description="prefill and decode workers write each request's tokens to its token "
        "stream while it decodes; false: only the final result (streamed answers then arrive "
        "whole, at the end)",
    )
    stream_interval_ms: float = Field(
        20.0,
        ge=0,
        description="least time between two writes of one request's token stream (the first "
        "tokens go at once; later ones wait at most this long, batched): bounds the rate Redis "
        "sees per request whatever the decode speed",
    )
    stream_ttl_s: int = Field(
        3600, ge=1, description="lifetime of a request's token stream after its last write"
    )
    stream_max_entries: int = Field(
        4096, ge=16, description="entries kept per token stream (oldest trimmed first)"
    )

    # Model
    model: str = Field(defaults.TINY_MODEL, description=MODEL_HELP)
    device: str = Field("auto", description="auto, cpu or cuda[:N]")

    # Video (renderer): frame sampling as the Qwen2-VL video processor does it, and the limits
    # checked from a file's headers before any frame is decoded.
    video_fps: float = Field(2.0, gt=0, description="frames sampled per second of video")
    video_max_frames: int = Field(64, ge=1, description="frames kept per video after sampling")
    video_max_duration_s: float = Field(600.0, gt=0, description="longest video, in seconds")
    video_max_source_frames: int = Field(
        36_000, ge=1, description="frames the decoder may read from one video file"
    )
    video_max_frame_pixels: int = Field(
        3840 * 2160, ge=1, description="width*height of one source video frame"
    )
    video_max_decode_pixels: int = Field(
        4_000_000_000,
        ge=1,
        description="decoding work per video, checked before decoding: frames the decoder must "
        "produce to reach the sampled ones x their pixels (GIF/WebP x16, Pillow is slower)",
    )
    video_min_pixels: int | None = Field(
        None,
        ge=1,
        description="least pixels per processed video frame; unset: the checkpoint's video "
        "processor config, else 128 merged tokens (100,352 px at patch 14)",
    )
    video_max_pixels: int | None = Field(
        None,
        ge=1,
        description="most pixels per processed video frame; unset: the checkpoint's video "
        "processor config, else 768 merged tokens (602,112 px at patch 14)",
    )
    video_max_total_pixels: int | None = Field(
        None,
        ge=1,
        description="pixels of all of a video's processed frames together (each frame gets an "
        "even share, never below the per-frame minimum); unset: what EPD_MAX_TENSOR_BYTES holds",
    )

    # Logs
    log_format: Literal["json", "text"] = Field(
        "json", description="worker log lines: JSON objects (with request_id and trace_id) or text"
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch's CPU threads in each worker and the API; unset: 1 in a process "
        "that runs no model on the CPU (the API; a worker on a GPU or with the instant engine: "
        "idle OpenMP threads spin after each op), torch's default (a thread per core) where a "
        "model computes on the CPU",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="the event loop of workers and the API: uvloop (libuv, C: a fraction of "
        "asyncio's cost per socket event and callback), asyncio, or auto (uvloop where it is "
        "installed)",
    )

    # Consumers
    max_in_flight: int = 64
    max_attempts: int = Field(
        3,
        ge=1,
        description="tries of an event whose handler fails (not counting store/broker outages)",
    )
    transient_retry_s: float = Field(
        30.0,
        ge=0,
        description="how long an event is retried while the store or the broker is unreachable "
        "(capped by the event's deadline); only then is it dead-lettered as retries_exhausted",
    )
    encode_batch_patches: int = Field(16384, description="patch budget of one vision-tower call")
    dlq_replay_ttl_s: int = Field(
        30 * 86400,
        description="how long `epd dlq replay` remembers a dead letter it republished (so a "
        "second run does not republish it again); keep it above the DLQ topic's retention",
    )

    # Fleet view (runtime/fleet): announcements, readiness, heartbeat
    fleet_announce_s: float = Field(
        5.0, gt=0, le=300, description="how often a worker announces itself in Redis"
    )
    fleet_ttl_s: float = Field(
        15.0,
        gt=0,
        le=3600,
        description="how long an announcement counts a worker live (keep it a few times "
        "EPD_FLEET_ANNOUNCE_S: a worker killed -9 drops out of the fleet this long after)",
    )
    ready_stages: str = Field(
        "encode,prefill,results",
        pattern=r"^[a-z,]*$",
        description="stages /readyz needs a live, matching worker of (comma-separated; decode is "
        "added when EPD_DECODE_STAGE is on; empty: readiness does not look at workers, e.g. "
        "for workers that scale to zero on lag)",
    )
    heartbeat_file: Path | None = Field(
        None,
        description="a worker touches this file every EPD_FLEET_ANNOUNCE_S while its consume "
        "loop runs (a liveness probe checks its age)",
    )
    admin_tokens: SecretStr | None = Field(
        None,
        description="bearer tokens (TOKEN=NAME, comma-separated) for the API's admin routes "
        "(/v1/admin/fleet); unset: admin routes are open only on an open API (no "
        "EPD_API_TOKENS)",
    )

    # HTTP API (epd api)
    api_tokens: SecretStr | None = Field(
        None,
        description="bearer tokens, 'TOKEN=TENANT' pairs separated by commas; unset: open API",
    )
    api_max_body_bytes: int = Field(
        32 * 1024 * 1024, description="largest request body; checked while it is read"
    )
    api_body_budget_bytes: int = Field(
        128 * 1024 * 1024,
        ge=1,
        description="request body bytes one API process holds at once, across requests, from "
        "the read to the end of the render (a body's Content-Length is reserved before it is "
        "read; bodies up to 64 KiB take none); beyond: 503 body.budget with Retry-After, "
        "answered without reading the body. Never below EPD_API_MAX_BODY_BYTES",
    )
    api_body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest a request body may take to arrive, its first byte to its last; "
        "slower: 408 body.timeout and the connection is closed",
    )
    api_max_image_bytes: int = Field(
        16 * 1024 * 1024, description="largest encoded image (file bytes, before decoding)"
    )
    api_max_images: int = Field(16, description="images per request")
    api_max_in_flight: int = Field(
        256, description="admitted, unfinished requests across all API replicas; beyond: 429"
    )
    api_max_encode_lag: int = Field(
        10000, description="encode topic consumer lag (events) beyond which the API answers 429"
    )
    api_render_concurrency: int = Field(2, description="renders running at once per process")
    render_cache_bytes: int = Field(
        128 * 1024 * 1024,
        ge=0,
        description="the processor outputs of images a renderer processed, kept by the blake3 "
        "of the file's bytes so an image sent again is not decoded and processed again "
        "(least recently used out first); 0: off",
    )
    api_render_timeout_s: float = Field(
        60.0,
        gt=0,
        description="longest render of one request (decoding stops, the slot frees, 503 "
        "render.timeout)",
    )
    api_idempotency_ttl_s: int = Field(86400, description="lifetime of an Idempotency-Key")
    api_max_wait_s: float = Field(60.0, description="longest ?wait= long-poll")
    api_retry_after_s: int = Field(1, description="Retry-After of 429 and 503 answers")
    api_max_videos: int = Field(4, description="videos per request")
    api_max_video_bytes: int = Field(
        16 * 1024 * 1024,
        description="largest encoded video (file bytes, or all of one video's frame images "
        "together); base64 makes it 4/3 larger in a JSON body (EPD_API_MAX_BODY_BYTES)",
    )
    api_tokens_file: Path | None = Field(
        None,
        description="a file of bearer tokens, one TOKEN=TENANT per line ('#' comments), beside "
        "or instead of EPD_API_TOKENS (keeps secrets out of the environment)",
    )
    api_max_prompt_chars: int = Field(
        262_144, ge=1, description="characters of a prompt (the context is checked once tokenized)"
    )
    api_max_cache_salt_chars: int = Field(256, ge=1, description="characters of a cache_salt")
    api_max_metadata_keys: int = Field(16, ge=0, description="metadata labels per request")
    api_max_metadata_chars: int = Field(
        256, ge=1, description="characters of one metadata key or value"
    )
    api_max_metadata_bytes: int = Field(
        4096, ge=1, description="UTF-8 bytes of all of a request's metadata keys and values"
    )
    api_max_id_chars: int = Field(
        255,
        ge=1,
        description="characters of an id a client gives: a vLLM request_id, an "
        "Idempotency-Key, an item's mm_hash label",
    )
    api_max_json_depth: int = Field(
        32, ge=2, description="nesting of objects and arrays in a JSON body (deeper: 400)"
    )
    api_max_messages: int = Field(
        defaults.API_MAX_MESSAGES,
        ge=1,
        description="messages of one chat request (and input items of a response)",
    )
    api_max_message_parts: int = Field(
        defaults.API_MAX_MESSAGE_PARTS,
        ge=1,
        description="content parts (text, image, video) of one chat message",
    )

    # OpenAI-compatible routes (/v1/chat/completions, /v1/responses, /v1/models)
    served_model_name: str | None = Field(
        None,
        description="the model name /v1/models lists and requests name; unset: EPD_MODEL as given",
    )
    chat_template: Path | None = Field(
        None,
        description="a Jinja chat template file used instead of the checkpoint's own (the "
        "tiny models have one of their own)",
    )
    api_image_url_hosts: str = Field(
        "",
        description="hosts whose http(s) image and video URLs the API fetches, comma "
        "separated, each HOST (any port) or HOST:PORT; empty (the default): none, only data: "
        "URLs are taken, and no request makes the API connect anywhere",
    )
    api_image_url_timeout_s: float = Field(
        10.0, gt=0, description="longest fetch of one image or video URL, redirects included"
    )
    api_image_url_max_redirects: int = Field(
        3, ge=0, description="redirects followed per URL fetch (only to the same host and port)"
    )
    api_max_fetched_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1,
        description="bytes all the media URLs of one request may fetch together (the sum "
        "across its fetches, counted as they stream in; each is also held to its image or "
        "video limit); beyond: 413 image_url.total",
    )
    api_image_url_concurrency: int = Field(
        4,
        ge=1,
        description="media URL fetches one API process runs at once, across requests (more "
        "wait for a slot; each fetch's own timeout starts once it has one)",
    )

    @field_validator("store_url")
    @classmethod
    def _store_scheme(cls, url: str) -> str:
        scheme = urlsplit(url).scheme if url else ""
        if url and scheme not in defaults.STORE_SCHEMES:
            known = ", ".join(f"{s}://" for s in defaults.STORE_SCHEMES)
            raise ValueError(f"unknown embedding store scheme {scheme!r} (known: {known})")
        return _redis_url_checked(url)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str) -> str:
        if urlsplit(url).scheme not in REDIS_SCHEMES:
            raise ValueError(f"a Redis URL must start with {', '.join(REDIS_SCHEMES)}://")
        return _redis_url_checked(url)

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap(cls, servers: str) -> str:
        for server in servers.split(","):
            host, sep, port = server.strip().rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{server.strip()!r} is not HOST:PORT (comma-separated list)")
        return servers

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if not _DEVICE.fullmatch(device.strip().lower()):
            raise ValueError(f"{device!r} is not auto, cpu, cuda or cuda:N")
        return device

    @field_validator("ready_stages")
    @classmethod
    def _ready_stages(cls, value: str) -> str:
        from schemas.topics import STAGE_NAMES

        unknown = [s for s in value.split(",") if s and s not in STAGE_NAMES]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; stages are {list(STAGE_NAMES)}")
        return value

    @field_validator("topic_prefix")
    @classmethod
    def _topic_prefix(cls, prefix: str) -> str:
        if not _TOPIC_PREFIX.fullmatch(prefix):
            raise ValueError("a topic prefix is 1-200 of A-Z a-z 0-9 . _ -")
        return prefix

    @field_validator("api_image_url_hosts")
    @classmethod
    def _url_hosts(cls, hosts: str) -> str:
        parse_url_hosts(hosts)
        return hosts

    @field_validator("api_tokens")
    @classmethod
    def _tokens(cls, tokens: SecretStr | None) -> SecretStr | None:
        if tokens is not None:
            parse_tokens(tokens.get_secret_value(), source="EPD_API_TOKENS")
        return tokens

    @field_validator("admin_tokens")
    @classmethod
    def _admin_tokens(cls, tokens: SecretStr | None) -> SecretStr | None:
        if tokens is not None:
            parse_tokens(tokens.get_secret_value(), source="EPD_ADMIN_TOKENS")
        return tokens

    @field_validator("vllm_prefill_url", "vllm_encode_url")
    @classmethod
    def _vllm_urls(cls, value: str) -> str:
        for url in (u.strip() for u in value.split(",") if u.strip()):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(
                    f"vLLM URL {url!r} is not an http(s) base URL (e.g. http://vllm-prefill:8000)"
                )
        return value

    def vllm_urls(self, stage: str) -> list[str]:
        """The vLLM base URLs of ``stage`` (``prefill`` or ``encode``), without a trailing /."""
        raw = self.vllm_prefill_url if stage == "prefill" else self.vllm_encode_url
        return [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]

    @field_validator("api_tokens_file")
    @classmethod
    def _tokens_file(cls, path: Path | None) -> Path | None:
        if path is not None:
            _read_tokens_file(path)
        return path

    @model_validator(mode="after")
    def _token_sources_agree(self) -> Settings:
        if self.api_tokens is not None and self.api_tokens_file is not None:
            self.api_tenants()  # a token in both is a duplicate: refused like one in either
        return self

    def require_transactions_possible(self) -> None:
        """Refuse ``EPD_KAFKA_TRANSACTIONS=true`` beside ``EPD_KAFKA_IDEMPOTENCE=false``.

        Checked where a transactional loop is built (not at load, so every combination stays
        loadable for tools). The broker itself is checked when the transactional producer
        starts (``runtime.kafka.start_producer``).
        """
        if self.kafka_transactions and not self.kafka_idempotence:
            raise ValueError(
                "EPD_KAFKA_TRANSACTIONS=true needs EPD_KAFKA_IDEMPOTENCE=true: transactions are "
                "built on idempotent producers. EPD_KAFKA_IDEMPOTENCE=false marks the Tansu "
                "broker (`epd up` prints it), which has neither: use Apache Kafka "
                "(EPD_BROKER=apache) or unset EPD_KAFKA_TRANSACTIONS"
            )

    def url_hosts(self) -> UrlHosts:
        """The hosts ``EPD_API_IMAGE_URL_HOSTS`` lets the API fetch media URLs from."""
        return parse_url_hosts(self.api_image_url_hosts)

    def model_name(self) -> str:
        """The name the OpenAI-compatible routes serve the model under."""
        return self.served_model_name or self.model

    @property
    def embedding_store_url(self) -> str:
        return self.store_url or self.redis_url

    def api_tenants(self) -> dict[str, str]:
        """Bearer token -> tenant, from ``EPD_API_TOKENS`` (``TOKEN=TENANT,TOKEN2=TENANT2``)
        and ``EPD_API_TOKENS_FILE``; empty for an open API (see :mod:`runtime.api_tokens`)."""
        tenants: dict[str, str] = {}
        if self.api_tokens is not None:
            tenants = parse_tokens(self.api_tokens.get_secret_value(), source="EPD_API_TOKENS")
        if self.api_tokens_file is not None:
            from_file = _read_tokens_file(self.api_tokens_file)
            if tenants.keys() & from_file.keys():
                raise ValueError(
                    "EPD_API_TOKENS and EPD_API_TOKENS_FILE name the same token (for tenants "
                    f"{sorted({tenants[t] for t in tenants.keys() & from_file.keys()})}); each "
                    "token names one tenant"
                )
            tenants.update(from_file)
        return tenants

    def admin_names(self) -> dict[str, str]:
        """Admin bearer token -> name from ``EPD_ADMIN_TOKENS`` (empty: none configured)."""
        if self.admin_tokens is None:
            return {}
        return parse_tokens(self.admin_tokens.get_secret_value(), source="EPD_ADMIN_TOKENS")

    def secret_bytes(self) -> bytes | None:
        return self.ec_secret.get_secret_value().encode() if self.ec_secret else None

    def to_env(self) -> dict[str, str]:
        """Every setting as the ``EPD_*`` variable that reproduces it in another process.

        Derived from the fields, so a new setting reaches spawned workers without a hand-kept
        list. Unset optional settings are left out (see :func:`env_names` to clear them).
        """
        env: dict[str, str] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, bool):
                value = "true" if value else "false"
            elif not isinstance(value, str):
                value = json.dumps(value) if isinstance(value, list | dict) else str(value)
            env[env_name(name)] = value
        return env

    def describe(self) -> dict[str, Any]:
        """The settings as JSON-ready values; secrets appear as a SHA-256 digest, never in clear."""
        out = self.model_dump(mode="json")
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                digest = hashlib.sha256(value.get_secret_value().encode()).hexdigest()
                out[name] = f"sha256:{digest}"
        return out

    @property
    def required_stages(self) -> tuple[str, ...]:
        """The stages ``/readyz`` needs a live worker of (``EPD_READY_STAGES``, and decode when
        the decode stage is on)."""
        names = [s for s in self.ready_stages.split(",") if s]
        if self.decode_stage and names and "decode" not in names:
            names.append("decode")
        return tuple(dict.fromkeys(names))

    def require_signing(self, kind: str) -> None:
        """Refuse to run a worker that handles ``ec_transfer_params`` (encode, prefill, router)
        without a real secret, unless ``EPD_ALLOW_UNSIGNED=true`` says unsigned is meant.

        Raises ``InsecureSettings`` naming the fix. A placeholder secret (``change-me`` and the
        like) or one shorter than ``MIN_SECRET_CHARS`` counts as none.
        """
        if kind not in SIGNING_WORKERS or self.allow_unsigned:
            return
        secret = self.ec_secret.get_secret_value() if self.ec_secret else ""
        if not secret:
            problem = "EPD_EC_SECRET is not set"
        elif secret.strip().lower() in PLACEHOLDER_SECRETS:
            problem = f"EPD_EC_SECRET is the placeholder {secret!r}"
        elif len(secret) < MIN_SECRET_CHARS:
            problem = f"EPD_EC_SECRET has {len(secret)} characters, fewer than {MIN_SECRET_CHARS}"
        else:
            return
        what = "the API" if kind == "api" else f"the {kind} worker"
        raise InsecureSettings(
            f"refusing to start {what}: {problem}. Without a real secret anyone "
            "who can write to the topics can point workers at other tenants' embeddings. Set "
            "EPD_EC_SECRET to a random value shared by the router, encode and prefill workers "
            "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`), or set "
            "EPD_ALLOW_UNSIGNED=true for a local experiment."
        )


def _read_tokens_file(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    return parse_tokens(text, source=f"EPD_API_TOKENS_FILE ({path})", comments=True)


def settings_error(exc: PydanticValidationError) -> str:
    """One line naming the variable and what is wrong with it (a secret's value never shown)."""
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
    loc = [str(x) for x in err.get("loc", ())]
    name = env_name(loc[0]) if loc else "settings"
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    value = err.get("input")
    shown = ""
    if loc and loc[0] not in SECRET_FIELDS and isinstance(value, str | int | float):
        shown = f" (got {str(value)[:80]!r})"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    head = "" if msg.startswith("EPD_") else f"{name}: "
    return f"{head}{msg}{shown}{more}"


def env_name(field: str) -> str:
    """The environment variable of a setting."""
    return f"EPD_{field.upper()}"


def env_names() -> set[str]:
    """The environment variables of every setting."""
    return {env_name(f) for f in Settings.model_fields}


@cache
def get_settings() -> Settings:
    """Settings read once per process from the environment."""
    return Settings()
