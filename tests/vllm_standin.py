"""A stand-in for a vLLM 0.33.0 scale-out server, built from vLLM's own code (no GPU, no model).

Not a live vLLM: the routes are vLLM's (``POST /inference/v1/generate``,
``POST /inference/v1/abort_requests``), every generate body is validated by vLLM's own
``GenerateRequest`` (plus the msgpack encoding and feature decoding its ``serve_tokens`` does
before scheduling) and refused with vLLM's ``ErrorResponse`` (a 400) as vLLM refuses it, and
every answer is one of vLLM's response models (``GenerateTokensStreamResponse`` events ending
``data: [DONE]``, or a whole ``GenerateTokensResponse``). Behind it a stub engine: the instant
engine's tokens (:data:`gpu_workers.instant.INSTANT_TEXT`, one per step), ending at
``max_tokens``, a stop token or a stop string, or ``abort`` when an abort names the request.

Faults on demand (:meth:`StandIn.fail_next`): ``"drop"`` cuts the connection after the first
token, ``"500"`` answers vLLM's 500 ``ErrorResponse``. Given a store (``store_url``), it also
plays an encoder instance with an EC connector in the producer role: an item that carries its
encoder inputs and names an EC entry gets its entry written into our store (through our store
code) before the answer, as vLLM's connector would.

Run it in-process (:class:`StandIn`, a uvicorn server on a thread) or as
``python -m tests.vllm_standin --port N`` with ``tests.vllm_side.side_env()``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from tests.vllm_side import use_vllm

use_vllm()

import msgspec  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from vllm.entrypoints.scale_out.token_in_token_out.mm_features import (  # noqa: E402
    mm_kwargs_from_features,
)
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (  # noqa: E402
    GenerateRequest,
    GenerateTokensChoice,
    GenerateTokensResponse,
    GenerateTokensStreamChoice,
    GenerateTokensStreamResponse,
)
from vllm.entrypoints.serve.exception_handling.error_response import (  # noqa: E402
    create_error_response,
)

from gpu_workers.instant import INSTANT_TEXT  # noqa: E402

LABEL = "stand-in built from vLLM 0.33.0's code, not a live vLLM"
TOKENS_ONLY_STOP = (
    "stop strings are not supported on a --tokens-only server because detokenization is "
    "disabled. Check stop strings on the coordinator, or use stop_token_ids."
)


@dataclass
class StandInState:
    """What the stand-in saw (read by tests) and the faults it is told to make."""

    token_delay_s: float = 0.0
    tokens_only: bool = False
    """Answer as ``vllm serve --tokens-only`` does: stop strings are refused (a 400)."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Every generate body vLLM's model accepted, as sent."""
    rejected: list[str] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    """Engine request ids named by ``abort_requests``."""
    aborted: list[str] = field(default_factory=list)
    """Engine request ids whose generation an abort stopped."""
    faults: list[str] = field(default_factory=list)
    encoded: list[str] = field(default_factory=list)
    running: dict[str, asyncio.Event] = field(default_factory=dict)


def _tokens(req: GenerateRequest):  # type: ignore[no-untyped-def]
    """The stub engine: (token, finish_reason, stop_reason) per step, the instant engine's text."""
    sp = req.sampling_params
    text = b""
    limit = sp.max_tokens or 16
    for step in range(limit):
        tok = INSTANT_TEXT[step % len(INSTANT_TEXT)]
        text += bytes([tok])
        if tok in (sp.stop_token_ids or []):
            yield tok, "stop", tok
            return
        hit = next((s for s in (sp.stop or []) if s in text.decode("latin-1")), None)
        if hit is not None:
            yield tok, "stop", hit
            return
        yield tok, ("length" if step == limit - 1 else None), None


def _error(message: str | Exception, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> JSONResponse:
    err = create_error_response(
        message, "BadRequestError" if status < 500 else "InternalServerError", status
    )
    return JSONResponse(err.model_dump(), status_code=err.error.code)


def _validated(body: Any) -> GenerateRequest:
    """vLLM's acceptance before scheduling (``serve_tokens``)."""
    req = GenerateRequest.model_validate(body)
    msgspec.msgpack.encode((req.sampling_params, req.kv_transfer_params, req.ec_transfer_params))
    if req.features is not None:
        mm_kwargs_from_features(req.features)
    return req


def build_app(state: StandInState, store_url: str | None = None) -> FastAPI:
    """The stand-in's routes over ``state``."""
    app = FastAPI(title=LABEL)
    if store_url is not None:
        from runtime.model import load_model

        _bundle(load_model)  # loaded before serving, not on the first encode's event loop

    @app.post("/inference/v1/generate")
    async def generate(raw: Request) -> Response:
        try:
            body = await raw.json()
            req = _validated(body)
        except Exception as exc:  # vLLM answers every validation failure with a 400
            state.rejected.append(str(exc)[:200])
            return _error(exc)
        if state.tokens_only and req.sampling_params.stop:
            # vLLM's own refusal (serving.py, force_no_detokenize): its words, its 400.
            state.rejected.append("stop strings on --tokens-only")
            return _error(TOKENS_ONLY_STOP)
        # Faults are for the streamed (prefill) requests; an encoder's whole request passes.
        fault = state.faults.pop(0) if state.faults and req.stream else None
        if fault == "500":
            return _error("the stand-in was told to fail once", HTTPStatus.INTERNAL_SERVER_ERROR)
        state.requests.append(body)
        if store_url is not None and req.features is not None and req.features.kwargs_data:
            try:
                state.encoded.extend(await _produce(req, store_url))
            except Exception as exc:  # the encoder failed: vLLM's 500
                return _error(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR)
        rid = f"generate-tokens-{req.request_id}"
        stop = state.running[rid] = asyncio.Event()
        if not req.stream:
            return _whole(req, rid, state)
        return StreamingResponse(
            _stream(req, rid, stop, state, drop=fault == "drop"), media_type="text/event-stream"
        )

    @app.post("/inference/v1/abort_requests")
    async def abort_requests(raw: Request) -> Response:
        body = await raw.json()
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list):
            return _error("Missing 'request_ids' in request body")
        for rid in ids:
            state.aborts.append(rid)
            if rid in state.running:
                state.running[rid].set()
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def _whole(req: GenerateRequest, rid: str, state: StandInState) -> JSONResponse:
    steps = list(_tokens(req))
    state.running.pop(rid, None)
    finish, reason = (steps[-1][1], steps[-1][2]) if steps else ("length", None)
    resp = GenerateTokensResponse(
        request_id=rid,
        choices=[
            GenerateTokensChoice(
                index=0,
                token_ids=[t for t, _, _ in steps],
                finish_reason=finish,
                stop_reason=reason,
            )
        ],
    )
    return JSONResponse(resp.model_dump())


def _chunk(rid: str, tokens: list[int], finish: str | None, reason: Any) -> str:
    chunk = GenerateTokensStreamResponse(
        request_id=rid,
        choices=[
            GenerateTokensStreamChoice(
                index=0, token_ids=tokens, finish_reason=finish, stop_reason=reason
            )
        ],
    )
    exclude = {"prompt_token_ids", "mm_placeholders", "metrics"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


async def _stream(
    req: GenerateRequest, rid: str, stop: asyncio.Event, state: StandInState, *, drop: bool
):  # type: ignore[no-untyped-def]
    try:
        for n, (tok, finish, reason) in enumerate(_tokens(req)):
            if state.token_delay_s:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), state.token_delay_s)
            if stop.is_set():
                state.aborted.append(rid)
                yield _chunk(rid, [], "abort", None)  # vLLM's terminal output of an abort
                break
            if drop and n == 1:
                raise ConnectionResetError("the stand-in was told to drop this connection")
            yield _chunk(rid, [tok], finish, reason)
        yield "data: [DONE]\n\n"
    finally:
        state.running.pop(rid, None)


async def _produce(req: GenerateRequest, store_url: str) -> list[str]:
    """The EC producer's part (an encoder instance): each item that carries its encoder inputs
    and names an EC entry gets its encoder output written there, through our store code (what
    the EC connector does), zero embeddings of the instant engine's shapes."""
    from gpu_workers.entries import store_outputs
    from gpu_workers.instant import instant_encode
    from runtime.model import load_model
    from runtime.stores import open_store
    from schemas.ec_entries import find_ec_entry

    assert req.features is not None
    bundle = _bundle(load_model)
    items = mm_kwargs_from_features(req.features)
    store = open_store(store_url)
    written = []
    try:
        for modality, hashes in req.features.mm_hashes.items():
            for mm_hash, item in zip(hashes, items[modality], strict=True):
                entry = find_ec_entry(req.ec_transfer_params, mm_hash)
                pv = f"pixel_values{'_videos' if modality == 'video' else ''}"
                if item is None or pv not in item or not isinstance(entry, dict):
                    continue
                grid = item[f"{modality}_grid_thw"].data
                (out,) = instant_encode(bundle, [(item[pv].data, grid)])
                await store_outputs(store, entry["key"], out, bundle.family, 600)
                written.append(mm_hash)
    finally:
        await store.close()
    return written


_BUNDLES: dict[str, Any] = {}


def _bundle(load: Any) -> Any:
    if "instant" not in _BUNDLES:
        _BUNDLES["instant"] = load("instant", device="cpu")
    return _BUNDLES["instant"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StandIn:
    """The stand-in on a thread of this process: ``with StandIn() as s: s.url``."""

    def __init__(self, *, token_delay_s: float = 0.0, store_url: str | None = None) -> None:
        self.state = StandInState(token_delay_s=token_delay_s)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            build_app(self.state, store_url), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="vllm-standin", daemon=True)

    def fail_next(self, *faults: str) -> None:
        """The next generate requests fail so: ``"drop"`` or ``"500"``, one each."""
        self.state.faults.extend(faults)

    def __enter__(self) -> StandIn:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the vLLM stand-in did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=LABEL)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--store-url", default=None)
    ap.add_argument("--token-delay-s", type=float, default=0.0)
    args = ap.parse_args()
    state = StandInState(token_delay_s=args.token_delay_s)
    print(f"{LABEL} on port {args.port}", flush=True)
    uvicorn.run(
        build_app(state, args.store_url), host="127.0.0.1", port=args.port, log_level="warning"
    )


if __name__ == "__main__":
    main()
