"""The HTTP API against real services: Tansu, Redis, worker processes and ``epd api`` replicas
(uvicorn in subprocesses). One stack serves the module; each test uses requests of its own."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from media.sample_images import png_bytes, synthetic_image
from runtime.settings import Settings
from tests.integration.api_stack import ApiStack, api_stack, auth, isolated

pytestmark = pytest.mark.integration

TERMINAL = {"completed", "failed", "rejected", "expired", "cancelled"}


@pytest.fixture(scope="module")
def stack(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiStack]:
    with api_stack(isolated(settings), tmp_path_factory.mktemp("api-stack")) as s:
        yield s


@pytest.fixture
async def http(stack: ApiStack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.api.url, headers=auth(), timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def bundle() -> Any:
    from runtime.model import load_model

    return load_model("tiny", device="cpu")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def oracle(bundle: Any, prompt: str, images: list[bytes], max_tokens: int) -> list[int]:
    """``model.generate`` in this process on the same prompt and images (the parity oracle)."""
    from gpu_workers.oracle import generate_monolithic, monolithic_inputs
    from producers.render import Renderer

    ev = Renderer(bundle, max_image_pixels=4096 * 4096).render(
        "oracle", prompt=prompt, images=images
    )
    ids, pv, grid = monolithic_inputs(ev)
    return generate_monolithic(bundle, ids, pv, grid, max_tokens)


async def wait_terminal(stack: ApiStack, http: httpx.AsyncClient, rid: str) -> dict[str, Any]:
    """Long-poll until terminal (no client-side sleep)."""
    for _ in range(200):
        stack.workers.check_alive()
        r = await http.get(f"/v1/requests/{rid}", params={"wait": 10})
        assert r.status_code == 200, r.text
        body = r.json()
        if body["status"] in TERMINAL:
            return body
    raise AssertionError(f"{rid} never finished")


def salt() -> str:
    return uuid.uuid4().hex


# ------------------------------------------------------------------------------ happy path


async def test_submit_poll_completes_with_monolithic_tokens(
    stack: ApiStack, http: httpx.AsyncClient, bundle: Any
) -> None:
    images = [
        png_bytes(synthetic_image(112, 84, seed=201)),
        png_bytes(synthetic_image(56, 56, 202)),
    ]
    prompt = "Compare <image> with <image>."
    r = await http.post(
        "/v1/requests",
        json={
            "prompt": prompt,
            "images": [data_url(images[0]), base64.b64encode(images[1]).decode()],
            "max_tokens": 8,
            "cache_salt": salt(),
            "metadata": {"case": "parity"},
        },
    )
    assert r.status_code == 202, r.text
    acc = r.json()
    rid = acc["request_id"]
    assert acc["status_url"] == f"/v1/requests/{rid}" and acc["events_url"].endswith("/events")
    body = await wait_terminal(stack, http, rid)
    assert body["status"] == "completed", body
    expected = await asyncio.to_thread(oracle, bundle, prompt, images, 8)
    assert body["result"]["token_ids"] == expected
    assert body["metadata"] == {"case": "parity"}
    assert [it["modality"] for it in body["items"]] == ["image", "image"]
    assert all(it["encoded"] and it["cache_hit"] is False for it in body["items"])
    for stage in ("render", "encode", "prefill", "decode"):
        assert body["stages"][stage]["ms"] is not None, (stage, body["stages"])


async def test_client_async_and_sync_and_cli_give_the_monolithic_tokens(
    stack: ApiStack, bundle: Any, tmp_path: Path
) -> None:
    from frontend.client import EPDClient, SyncEPDClient

    img = png_bytes(synthetic_image(84, 84, seed=211))
    prompt = "What is <image>?"
    expected = await asyncio.to_thread(oracle, bundle, prompt, [img], 6)
    shared = salt()
    async with EPDClient(stack.api.url, token="alice-token") as client:
        rid = await client.submit(prompt=prompt, images=[img], max_tokens=6, cache_salt=shared)
        st = await client.wait(rid, timeout_s=120)
    assert st.status == "completed" and st.result is not None
    assert st.result.token_ids == expected

    def sync_run() -> Any:
        with SyncEPDClient(stack.api.url, token="alice-token") as c:
            rid = c.submit(prompt=prompt, images=[img], max_tokens=6, cache_salt=shared)
            return c.wait(rid, timeout_s=120)

    st2 = await asyncio.to_thread(sync_run)
    assert st2.status == "completed" and st2.result.token_ids == expected
    # a repeat of the same image is served from the encoder cache
    assert st2.items[0].cache_hit is True

    path = tmp_path / "a.png"
    path.write_bytes(img)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "epd.cli",
        "submit",
        "--image",
        str(path),
        "--prompt",
        prompt,
        "--max-tokens",
        "6",
        "--wait",
        "--json",
        "--url",
        stack.api.url,
        "--token",
        "alice-token",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, err.decode()
    body = json.loads(out)
    assert body["status"] == "completed" and body["result"]["token_ids"] == expected
    progress = err.decode()
    # the progress display names the stages as they happen, in order
    assert progress.index("queued") < progress.index("completed"), progress

    for cmd in (["status", body["request_id"], "--json"], ["cancel", body["request_id"]]):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "epd.cli",
            *cmd,
            "--url",
            stack.api.url,
            "--token",
            "alice-token",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        if cmd[0] == "status":
            assert proc.returncode == 0 and json.loads(out)["status"] == "completed"
        else:  # a completed request cannot be cancelled: exit 1 with the server's rule
            assert proc.returncode == 1 and "cancel.terminal" in err.decode()


async def test_submit_and_wait_in_one_call_answers_the_finished_status(
    stack: ApiStack, http: httpx.AsyncClient, bundle: Any
) -> None:
    """``POST /v1/requests?wait=S``: the answer is held until the request has finished (200,
    its status and tokens, the monolithic model's); one that outlasts the wait is answered
    202 with its status so far (the request runs on); a wait over EPD_API_MAX_WAIT_S is
    refused before the body is read; ``EPDClient.run`` (async and sync) is the one call."""
    from frontend.client import EPDClient, SyncEPDClient

    img = png_bytes(synthetic_image(70, 84, seed=241))
    prompt = "Waited <image>"
    expected = await asyncio.to_thread(oracle, bundle, prompt, [img], 5)
    body = {"prompt": prompt, "images": [data_url(img)], "max_tokens": 5, "cache_salt": salt()}
    done = await http.post("/v1/requests", json=body, params={"wait": 60})
    assert done.status_code == 200, done.text
    view = done.json()
    assert view["status"] == "completed" and view["result"]["token_ids"] == expected
    assert done.headers["location"] == f"/v1/requests/{view['request_id']}"

    slow = {**body, "max_tokens": 200, "ignore_eos": True, "cache_salt": salt()}
    running = await http.post("/v1/requests", json=slow, params={"wait": 0.01})
    assert running.status_code == 202, running.text
    assert running.json()["status"] not in TERMINAL and "created_at" in running.json()
    assert (await wait_terminal(stack, http, running.json()["request_id"]))["status"] == (
        "completed"
    )

    over = await http.post(
        "/v1/requests", json=body, params={"wait": stack.settings.api_max_wait_s + 1}
    )
    assert over.status_code == 422 and over.json()["error"]["rule"] == "request.wait"
    for bad in ("-1", "nan", "inf", "soon"):  # refused as the parameter, nothing enqueued
        refused = await http.post("/v1/requests", json=body, params={"wait": bad})
        assert refused.status_code == 422, (bad, refused.text)
        assert refused.json()["error"]["field"] == "wait", (bad, refused.text)

    async with EPDClient(stack.api.url, token="alice-token") as client:
        st = await client.run(prompt=prompt, images=[img], max_tokens=5, timeout_s=120)
        assert st.status == "completed" and st.result is not None
        assert st.result.token_ids == expected
        # a wait shorter than the request: the client long-polls the rest
        st = await client.run(
            prompt=prompt, images=[img], max_tokens=200, ignore_eos=True, wait_s=0.01
        )
        assert st.status == "completed" and st.result is not None
        assert len(st.result.token_ids) == 200

    def sync_run() -> Any:
        with SyncEPDClient(stack.api.url, token="alice-token") as c:
            return c.run(prompt=prompt, images=[img], max_tokens=5, timeout_s=120)

    st2 = await asyncio.to_thread(sync_run)
    assert st2.status == "completed" and st2.result.token_ids == expected


async def test_idempotency_key_same_body_one_request_other_body_409(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    from runtime.kafka import read_topic
    from schemas.codec import get_codec
    from schemas.types import PrefillEvent

    key = f"idem-{uuid.uuid4().hex}"
    body = {
        "prompt": "Once <image>",
        "images": [data_url(png_bytes(synthetic_image(56, 84, seed=221)))],
        "max_tokens": 3,
        "cache_salt": salt(),
    }
    first = await http.post("/v1/requests", json=body, headers={"Idempotency-Key": key})
    assert first.status_code == 202, first.text
    rid = first.json()["request_id"]
    again = await http.post("/v1/requests", json=body, headers={"Idempotency-Key": key})
    assert again.status_code == 200 and again.json()["request_id"] == rid
    # the key lives in Redis: the other replica finds the same request
    async with httpx.AsyncClient(base_url=stack.replica.url, headers=auth()) as other:
        third = await other.post("/v1/requests", json=body, headers={"Idempotency-Key": key})
    assert third.status_code == 200 and third.json()["request_id"] == rid
    changed = {**body, "max_tokens": 4}
    conflict = await http.post("/v1/requests", json=changed, headers={"Idempotency-Key": key})
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "idempotency_conflict"
    assert conflict.json()["error"]["rule"] == "idempotency.body_mismatch"
    # another tenant may use the same key for its own request
    bob = await http.post(
        "/v1/requests", json=body, headers={"Idempotency-Key": key, **auth("bob")}
    )
    assert bob.status_code == 202 and bob.json()["request_id"] != rid

    assert (await wait_terminal(stack, http, rid))["status"] == "completed"
    prefills = [
        get_codec().decode(r.value, PrefillEvent)
        for r in await read_topic(stack.settings, f"{stack.settings.topic_prefix}.prefill")
    ]
    assert sum(p.request_id == rid for p in prefills) == 1  # enqueued exactly once


async def test_long_poll_wakes_on_change_and_returns_terminal_at_once(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    r = await http.post(
        "/v1/requests",
        json={
            "prompt": "Poll <image>",
            "images": [data_url(png_bytes(synthetic_image(70, 70, seed=231)))],
            "max_tokens": 4,
            "cache_salt": salt(),
        },
    )
    rid = r.json()["request_id"]
    seen = ["queued"]
    loop = asyncio.get_running_loop()
    while seen[-1] not in TERMINAL:
        t0 = loop.time()
        got = (await http.get(f"/v1/requests/{rid}", params={"wait": 30})).json()["status"]
        # answered on the change, long before the 30 s wait ran out
        assert loop.time() - t0 < 20
        assert got != seen[-1] or got in TERMINAL
        seen.append(got)
    assert seen[-1] == "completed", seen
    t0 = loop.time()
    again = await http.get(f"/v1/requests/{rid}", params={"wait": 30})
    assert again.json()["status"] == "completed" and loop.time() - t0 < 2
    # a long-poll of an unchanging status returns the unchanged record when the wait ends
    # (checked on the replica with a short wait: no notification, no spin)


async def test_events_stream_every_status_in_order_and_resume(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    from frontend.client import EPDClient

    r = await http.post(
        "/v1/requests",
        json={
            "prompt": "Stream <image>",
            "images": [data_url(png_bytes(synthetic_image(98, 70, seed=241)))],
            "max_tokens": 5,
            "cache_salt": salt(),
        },
    )
    rid = r.json()["request_id"]
    async with EPDClient(stack.api.url, token="alice-token") as client:
        events = [ev async for ev in client.events(rid)]
        statuses = [e.status for e in events]
        assert statuses[0] == "queued" and statuses[-1] == "completed", statuses
        order = ["queued", "encoding", "prefilling", "decoding", "completed"]
        assert statuses == [s for s in order if s in statuses], statuses
        assert {"encoding", "prefilling", "decoding"} <= set(statuses)
        assert events[-1].data["token_ids"] and len(events[-1].data["token_ids"]) == 5
        # resume after the second event: exactly the rest, same ids
        rest = [ev async for ev in client.events(rid, last_event_id=events[1].id)]
        assert [e.id for e in rest] == [e.id for e in events[2:]]
        # resuming after the terminal event closes at once with nothing
        assert [ev async for ev in client.events(rid, last_event_id=events[-1].id)] == []
    raw = await http.get(f"/v1/requests/{rid}/events")
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.count("event: status") == len(events)
    bad = await http.get(f"/v1/requests/{rid}/events", headers={"Last-Event-ID": "x; DROP"})
    assert bad.status_code == 400 and bad.json()["error"]["rule"] == "events.last_event_id"


async def _record(stack: ApiStack, rid: str) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from runtime.status import StatusStore

    client = aioredis.Redis.from_url(stack.settings.redis_url)
    try:
        rec = await StatusStore(client, prefix=stack.settings.topic_prefix).get(rid)
        assert rec is not None
        return rec.to_dict()
    finally:
        await client.aclose()


async def _until_stage(stack: ApiStack, rid: str, stage: str, timeout_s: float = 60) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        rec = await _record(stack, rid)
        if stage in rec["stages"]:
            return rec
        assert loop.time() < deadline, (stage, rec["stages"])
        await asyncio.sleep(0.2)


async def test_cancel_stops_decoding_and_skips_queued_work(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    def body(seed: int) -> dict[str, Any]:
        return {
            "prompt": "Long <image>",
            "images": [data_url(png_bytes(synthetic_image(56, 56, seed=seed)))],
            "max_tokens": 2000,
            "ignore_eos": True,
            "cache_salt": salt(),
        }

    long_id = (await http.post("/v1/requests", json=body(251))).json()["request_id"]
    status = "queued"
    while status != "decoding":  # long-poll: wakes on each change from the last status seen
        params = {"wait": 30, "changed_from": status}
        status = (await http.get(f"/v1/requests/{long_id}", params=params)).json()["status"]
        assert status not in TERMINAL, await _record(stack, long_id)
    # a long-poll from a status the client saw earlier answers at once: the change is there
    t0 = asyncio.get_running_loop().time()
    r = await http.get(f"/v1/requests/{long_id}", params={"wait": 30, "changed_from": "queued"})
    assert r.json()["status"] == "decoding" and asyncio.get_running_loop().time() - t0 < 10
    bad = await http.get(f"/v1/requests/{long_id}", params={"wait": 1, "changed_from": "nope"})
    assert bad.status_code == 422 and "changed_from" in bad.text
    # until_done: the long-poll answers the end only (here the wait runs out while it decodes)
    t0 = asyncio.get_running_loop().time()
    done_params = {"wait": 1, "changed_from": "queued", "until_done": "true"}
    r = await http.get(f"/v1/requests/{long_id}", params=done_params)
    assert r.json()["status"] == "decoding" and asyncio.get_running_loop().time() - t0 >= 0.9
    not_bool = {"wait": 1, "until_done": "maybe"}
    bad = await http.get(f"/v1/requests/{long_id}", params=not_bool)
    assert bad.status_code == 422 and "until_done" in bad.text
    # The second request's prefill joins the first one's decode batch between two steps.
    queued_id = (await http.post("/v1/requests", json=body(252))).json()["request_id"]
    await _until_stage(stack, queued_id, "prefill:prefilling")
    for rid in (queued_id, long_id):
        r = await http.delete(f"/v1/requests/{rid}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        assert r.json()["error"]["code"] == "cancelled"
    # Each leaves the batch at its next step (2000 steps take 8-30 s on CPU), keeping the tokens
    # it made before the cancel took effect.
    for rid in (long_id, queued_id):
        rec = await _until_stage(stack, rid, "prefill:cancelled")
        said = rec["info"]["prefill.cancelled"]
        made = 0 if said == "skipped before compute" else int(said.split()[2])
        assert made < 2000, rec["info"]
        assert rec["status"] == "cancelled" and len(rec["token_ids"] or []) == made, rec
        assert "prefill:completed" not in rec["stages"]
        final = (await http.get(f"/v1/requests/{rid}")).json()
        assert final["status"] == "cancelled"
        assert ((final["result"] or {}).get("token_ids") or []) == (rec["token_ids"] or [])
        if rid == long_id:
            assert made > 0  # it was decoding when the cancel came
    # cancel is idempotent; a finished request cannot be cancelled
    again = await http.delete(f"/v1/requests/{long_id}")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


async def test_tenants_do_not_see_each_other_or_share_cache_entries(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    shared_salt = salt()
    body = {
        "prompt": "Mine <image>",
        "images": [data_url(png_bytes(synthetic_image(56, 70, seed=261)))],
        "max_tokens": 2,
        "cache_salt": shared_salt,
    }
    alice = (await http.post("/v1/requests", json=body)).json()["request_id"]
    bob = (await http.post("/v1/requests", json=body, headers=auth("bob"))).json()["request_id"]
    for path in (f"/v1/requests/{alice}", f"/v1/requests/{alice}/events"):
        r = await http.get(path, headers=auth("bob"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert (await http.delete(f"/v1/requests/{alice}", headers=auth("bob"))).status_code == 404
    a = await wait_terminal(stack, http, alice)
    b = (await http.get(f"/v1/requests/{bob}", params={"wait": 30}, headers=auth("bob"))).json()
    while b["status"] not in TERMINAL:
        b = (await http.get(f"/v1/requests/{bob}", params={"wait": 30}, headers=auth("bob"))).json()
    assert a["status"] == b["status"] == "completed"
    # the same image and client salt hash apart per tenant: no shared encoder-cache entry
    assert a["items"][0]["mm_hash"] != b["items"][0]["mm_hash"]
    assert b["items"][0]["cache_hit"] is False
    unauth = await http.get(f"/v1/requests/{alice}", headers={"Authorization": "Bearer nope"})
    assert unauth.status_code == 401 and unauth.json()["error"]["rule"] == "auth.token"


async def test_vllm_generate_fans_out_a_render_response(
    stack: ApiStack, http: httpx.AsyncClient, bundle: Any
) -> None:
    from gpu_workers.oracle import generate_monolithic, monolithic_inputs
    from producers.render import Renderer
    from schemas.vllm_wire import GenerateRequest, generate_request_to_json

    ev = Renderer(bundle, max_image_pixels=4096 * 4096).render(
        "vllm-render", prompt="From vLLM <image>", images=[synthetic_image(84, 56, seed=271)]
    )
    req = GenerateRequest(
        token_ids=ev.token_ids,
        features=ev.features,
        sampling_params={"max_tokens": 5, "temperature": 0},
        request_id="vllm-render",
        cache_salt=salt(),
    )
    payload = generate_request_to_json(req)
    key = {"Idempotency-Key": f"vllm-{uuid.uuid4().hex}"}
    r = await http.post("/v1/vllm/generate", json=payload, headers=key)
    assert r.status_code == 202, r.text
    # the same request formatted differently is the same request
    again = await http.post(
        "/v1/vllm/generate",
        content=json.dumps(payload, sort_keys=True, indent=1),
        headers={**key, "content-type": "application/json"},
    )
    assert again.status_code == 200 and again.json()["request_id"] == r.json()["request_id"]
    done = await wait_terminal(stack, http, r.json()["request_id"])
    ids, pv, grid = monolithic_inputs(ev)
    expected = await asyncio.to_thread(generate_monolithic, bundle, ids, pv, grid, 5)
    assert done["status"] == "completed" and done["result"]["token_ids"] == expected
    assert done["metadata"] == {"vllm_request_id": "vllm-render"}

    # metadata-only items would need client-chosen embedding keys: refused, item named
    meta_only = json.loads(json.dumps(payload))
    meta_only["features"]["mm_metadata"] = meta_only["features"]["mm_metadata"] or {}
    meta_only["features"]["kwargs_data"] = None
    meta_only["ec_transfer_params"] = {
        h: {"key": "ec:x"} for h in meta_only["features"]["mm_hashes"]["image"]
    }
    bad = await http.post("/v1/vllm/generate", json=meta_only)
    assert bad.status_code == 422, bad.text
    assert bad.json()["error"]["item"] == 0
    garbage = await http.post("/v1/vllm/generate", json={"token_ids": "x"})
    assert garbage.status_code == 422 and garbage.json()["error"]["rule"]


# ---------------------------------------------------------------------------------- errors


def _png_header_bomb(width: int, height: int) -> bytes:
    """A real PNG whose zlib stream inflates to width*height grey pixels (all zero): a few
    kilobytes on the wire, ``width*height`` bytes once decompressed."""
    import struct
    import zlib

    def chunk(tag: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(tag + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)

    comp = zlib.compressobj(9)
    row = b"\x00" * (width + 1)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _err(r: httpx.Response, status: int, code: str, rule: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == code and err["message"], err
    if rule is not None:
        assert err.get("rule") == rule, err
    return err


async def test_every_error_is_json_with_code_and_rule(
    stack: ApiStack, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    png = png_bytes(synthetic_image(56, 56, seed=281))
    ok_img = data_url(png)

    async def post(body: Any) -> httpx.Response:
        return await http.post("/v1/requests", json=body)

    # 400 malformed
    _err(
        await http.post(
            "/v1/requests", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
        "malformed",
        "body.json",
    )
    _err(
        await post({"prompt": "<image>", "images": ["%%%not-base64"]}),
        400,
        "malformed",
        "image.encoding",
    )
    # A file path is data, never opened: /etc/passwd is not base64 (400); a path whose text
    # happens to be valid base64 decodes to garbage bytes (415), though a real PNG is there.
    err = _err(
        await post({"prompt": "<image>", "images": ["/etc/passwd"]}),
        400,
        "malformed",
        "image.encoding",
    )
    assert err["item"] == 0 and err["field"] == "images"
    for extra in range(4):
        folder = Path("/tmp") / f"epdpath{uuid.uuid4().hex[:8]}{'x' * extra}"
        if len(str(folder / "img")) % 4 == 0:
            break
    folder.mkdir()
    try:
        (folder / "img").write_bytes(png)  # a real image lies at that path
        path_text = str(folder / "img")
        base64.b64decode(path_text, validate=True)  # the path is valid base64 text
        err = _err(
            await post({"prompt": "<image>", "images": [path_text]}),
            415,
            "unsupported_media_type",
            "image.type",
        )
        assert err["item"] == 0
    finally:
        (folder / "img").unlink()
        folder.rmdir()
    # 404 unknown id
    _err(await http.get("/v1/requests/no-such-id"), 404, "not_found")
    _err(await http.delete("/v1/requests/no-such-id"), 404, "not_found")
    # 413 image too large (the limit is 2 MiB here), checked before decoding
    big = "A" * (3 * 1024 * 1024)
    _err(await post({"prompt": "<image>", "images": [big]}), 413, "too_large", "image.size")
    # 413 decompression bomb: 6000x6000 pixels in ~40 KB of PNG, refused from its header
    bomb = _png_header_bomb(6000, 6000)
    assert len(bomb) < 100_000
    err = _err(
        await post({"prompt": "<image>", "images": [data_url(bomb)]}),
        413,
        "too_large",
        "render.image_too_large",
    )
    assert err["item"] == 0 and err["modality"] == "image"
    # 415 EPS (PostScript: Pillow would hand it to Ghostscript), SVG data URL, wrong body type
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    err = _err(
        await post({"prompt": "<image>", "images": [base64.b64encode(eps).decode()]}),
        415,
        "unsupported_media_type",
        "image.type",
    )
    assert err["item"] == 0
    _err(
        await post({"prompt": "<image>", "images": ["data:image/svg+xml;base64,PHN2Zz4="]}),
        415,
        "unsupported_media_type",
        "image.type",
    )
    _err(
        await http.post("/v1/requests", content=b"x", headers={"content-type": "text/plain"}),
        415,
        "unsupported_media_type",
        "body.content_type",
    )
    files = {"images": ("a.eps", eps, "application/postscript")}
    _err(
        await http.post("/v1/requests", data={"prompt": "<image>"}, files=files),
        415,
        "unsupported_media_type",
        "image.type",
    )
    # 422 validation, rule named
    _err(
        await post({"prompt": "two <image> <image>", "images": [ok_img]}),
        422,
        "validation_failed",
        "render.marker_count",
    )
    _err(await post({"prompt": "x", "max_tokens": 0}), 422, "validation_failed", "max-tokens")
    _err(
        await post({"prompt": "x", "temperature": 2.5}),
        422,
        "validation_failed",
        "sampling.temperature",
    )
    _err(await post({"prompt": "x", "top_p": 0}), 422, "validation_failed", "sampling.top_p")
    _err(await post({"prompt": "x", "stop": [""]}), 422, "validation_failed", "sampling.stop")
    sampled = await post({"prompt": "x", "temperature": 0.7, "seed": 3, "max_tokens": 2})
    assert sampled.status_code == 202, sampled.text  # the workers sample now: so does the door
    done = await wait_terminal(stack, http, sampled.json()["request_id"])
    assert done["status"] == "completed", done
    _err(await post({"prompt": "x", "token_ids": [1]}), 422, "validation_failed", "render.prompt")
    _err(await post({"prompt": "x", "surprise": 1}), 422, "validation_failed", "request.schema")
    # multipart works too, and its errors have the same shape
    ok = await http.post(
        "/v1/requests",
        data={"prompt": "Form <image>", "max_tokens": "2", "cache_salt": salt()},
        files={"images": ("a.png", png, "image/png")},
    )
    assert ok.status_code == 202, ok.text
    assert (await wait_terminal(stack, http, ok.json()["request_id"]))["status"] == "completed"
    # nothing above left a request behind in flight
    metrics = (await http.get("/metrics")).text
    assert "epd_api_in_flight 0.0" in metrics, metrics


def _raw_post(url: str, head: bytes, chunks: Iterator[bytes]) -> bytes:
    """Send a request over a plain socket, stopping when the server answers or closes."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as s:
        s.sendall(head)
        s.setblocking(False)
        answer = b""
        for chunk in chunks:
            try:
                answer += s.recv(65536)
            except BlockingIOError:
                pass
            except OSError:
                break
            if answer:
                break
            try:
                s.setblocking(True)
                s.sendall(chunk)
                s.setblocking(False)
            except OSError:
                break  # the server closed the connection: it refused the body
        s.setblocking(True)
        s.settimeout(10)
        try:
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                data = s.recv(65536)
                if not data:
                    break
                answer += data
        except OSError:
            pass
        return answer


async def test_fifty_megabyte_body_is_refused_while_read_and_memory_stays_flat(
    stack: ApiStack,
) -> None:
    size = 50 * 1024 * 1024
    mb = b"A" * (1024 * 1024)
    before = stack.api.rss_bytes()
    head = (
        b"POST /v1/requests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer alice-token\r\n"
    )
    # declared length: refused before a byte of the body is read
    answer = await asyncio.to_thread(
        _raw_post,
        stack.api.url,
        head + f"Content-Length: {size}\r\n\r\n".encode(),
        (mb for _ in range(50)),
    )
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"rule":"body.size"' in answer

    # chunked, no length: refused once the limit (4 MiB here) is crossed
    def chunks() -> Iterator[bytes]:
        for _ in range(50):
            yield f"{len(mb):x}\r\n".encode() + mb + b"\r\n"
        yield b"0\r\n\r\n"

    answer = await asyncio.to_thread(
        _raw_post, stack.api.url, head + b"Transfer-Encoding: chunked\r\n\r\n", chunks()
    )
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    after = stack.api.rss_bytes()
    # far less than the 50 MB sent (twice); the 4 MiB limit bounds what was held
    assert after - before < 20 * 1024 * 1024, (before, after)
    async with httpx.AsyncClient(base_url=stack.api.url) as c:
        assert (await c.get("/healthz")).status_code == 200  # still serving


async def test_burst_beyond_the_in_flight_bound_gets_429_and_accepted_ones_complete(
    stack: ApiStack,
) -> None:
    # The replica allows 2 requests in flight (shared through Redis by every replica).
    img = data_url(png_bytes(synthetic_image(56, 56, seed=291)))
    async with httpx.AsyncClient(base_url=stack.replica.url, headers=auth(), timeout=60) as c:

        async def one(i: int) -> httpx.Response:
            return await c.post(
                "/v1/requests",
                json={
                    "prompt": f"Burst {i} <image>",
                    "images": [img],
                    "max_tokens": 12,
                    "ignore_eos": True,
                },
            )

        answers = await asyncio.gather(*(one(i) for i in range(8)))
        codes = sorted(r.status_code for r in answers)
        assert 202 in codes and 429 in codes, codes
        for r in answers:
            if r.status_code == 429:
                err = _err(r, 429, "throttled", "admission.in_flight")
                assert int(r.headers["Retry-After"]) >= 1, err
        accepted = [r.json()["request_id"] for r in answers if r.status_code == 202]
        for rid in accepted:
            body = (await c.get(f"/v1/requests/{rid}", params={"wait": 60})).json()
            while body["status"] not in TERMINAL:
                body = (await c.get(f"/v1/requests/{rid}", params={"wait": 60})).json()
            assert body["status"] == "completed", body
        # the client honours Retry-After and gets through once slots free up
        from frontend.client import EPDClient

        async with EPDClient(stack.replica.url, token="alice-token", retries=30) as client:
            rids = await asyncio.gather(
                *(
                    client.submit(
                        prompt="Retry <image>",
                        images=[png_bytes(synthetic_image(56, 56, seed=292))],
                        max_tokens=2,
                    )
                    for _ in range(4)
                )
            )
            for rid in rids:
                assert (await client.wait(rid, timeout_s=120)).status == "completed"


async def test_health_ready_metrics_and_offline_docs(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    assert (await http.get("/healthz")).json()["status"] == "ok"
    ready = await http.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {
        "redis": "ok",
        "status_notifications": "ok",
        "kafka": "ok",
        "workers": "ok",
    }
    text = (await http.get("/metrics")).text
    for name in (
        "epd_api_requests_total",
        "epd_api_http_request_seconds_bucket",
        "epd_api_render_seconds_count",
        "epd_api_in_flight",
        "epd_api_http_in_flight",
        'epd_api_unfinished_requests{status="decoding"}',
    ):
        assert name in text, name
    assert 'epd_api_requests_total{status="queued"}' in text
    spec = (await http.get("/openapi.json")).json()
    assert {
        "/v1/requests",
        "/v1/requests/{request_id}",
        "/v1/requests/{request_id}/events",
        "/v1/vllm/generate",
        "/healthz",
        "/readyz",
        "/metrics",
    } <= set(spec["paths"])
    post = spec["paths"]["/v1/requests"]["post"]
    assert post["requestBody"]["content"]["application/json"]["example"]["prompt"]
    # the statuses come from the contract's one Literal (schemas/statuses.py)
    from schemas.statuses import STATUSES

    status_schema = spec["components"]["schemas"]["RequestStatus"]["properties"]["status"]
    assert status_schema["enum"] == list(STATUSES)
    assert {"202", "400", "409", "413", "415", "422", "429", "503"} <= set(post["responses"])
    docs = (await http.get("/docs")).text
    # every asset is served by the API itself: no CDN
    assert "cdn" not in docs.lower() and "https://" not in docs.split("<body>")[-1]
    for asset in ("/static-docs/swagger-ui-bundle.js", "/static-docs/swagger-ui.css"):
        assert asset in docs
        r = await http.get(asset)
        assert r.status_code == 200 and len(r.content) > 10_000


# ------------------------------------------------------- docs in a browser, schema fuzzing

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    # offline: every host but the API's loopback address fails to resolve
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--window-size=1280,1600",
    "--virtual-time-budget=15000",
)


def _chromium() -> str | None:
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser")


async def test_docs_render_offline_in_headless_chromium(stack: ApiStack, tmp_path: Path) -> None:
    import os

    exe = _chromium()
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must have chromium (.ci/run installs it)")
        pytest.skip("chromium is not installed")

    async def chromium(*args: str) -> bytes:
        profile = tmp_path / f"profile-{uuid.uuid4().hex[:6]}"
        proc = await asyncio.create_subprocess_exec(
            exe,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
        return out

    url = f"{stack.api.url}/docs"
    dom = (await chromium("--dump-dom", url)).decode(errors="replace")
    # Swagger UI ran (its JS came from the API) and drew one block per operation
    assert "swagger-ui" in dom and "opblock" in dom, dom[:2000]
    for op in ("/v1/requests", "/v1/requests/{request_id}", "/v1/vllm/generate", "/readyz"):
        assert op in dom, op
    shot = tmp_path / "docs.png"
    await chromium(f"--screenshot={shot}", url)
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    colors = {c for _, c in img.getcolors(maxcolors=1 << 20) or []}

    def near(rgb: tuple[int, int, int]) -> bool:
        return any(sum(abs(a - b) for a, b in zip(c, rgb, strict=True)) < 30 for c in colors)

    # Swagger UI's method colours: POST green, GET blue, DELETE red (the operation list)
    assert near((73, 204, 144)) and near((97, 175, 254)) and near((249, 62, 62)), len(colors)


# ------------------------------------------------------------------------------ schemathesis

DEEP_HOOKS = '''
"""Schemathesis hooks: besides each generated body, the same body with one of its fields
replaced by objects and arrays nested 40 to 900 levels deep (as deep as a JSON encoder
writes); the raw 5,000-deep bodies are sent by test_deeply_nested_json_is_400_on_every_route
(tests/integration/test_api_hardening.py). Each refusal's rule is written down by route."""
import json
import os

import schemathesis
from hypothesis import strategies as st


def nested(depth, leaf):
    node = leaf
    for i in range(depth):
        node = {"n": node} if i % 2 else [node]
    return node


@schemathesis.hook
def flatmap_body(context, body):
    if not isinstance(body, dict) or not body:
        return st.just(body)
    keys = sorted(body)
    deep = st.builds(
        lambda k, d: {**body, k: nested(d, body[k])},
        st.sampled_from(keys),
        st.sampled_from([40, 400, 900]),
    )
    return st.one_of(st.just(body), deep)


@schemathesis.hook
def after_call(context, case, response):
    try:
        rule = json.loads(response.content)["error"]["rule"]
    except Exception:
        return
    with open(os.environ["EPD_ANSWERED_RULES"], "a") as out:
        out.write(f"{case.operation.method.upper()} {case.operation.path} {rule}\\n")
'''


async def test_schemathesis_over_every_route_finds_no_server_error_or_schema_violation(
    stack: ApiStack, tmp_path: Path
) -> None:
    """One schemathesis pass over every operation of ``/openapi.json`` (the native routes, the
    OpenAI-compatible ones, health and metrics): no 5xx, every status code, content type and
    response body as documented, with generated bodies that also come nested 40-900 levels
    deep (the hooks above), which both submit routes answer 400 ``body.json``.

    Last in the module: its accepted requests may keep the workers busy afterwards. One pass,
    where there were three (all routes, the OpenAI routes, the submit routes with nested
    bodies), each with a time budget that schemathesis spends whole (it repeats its fuzzing
    until ``--max-time`` is up): this one ends when each operation has had its examples."""
    async with httpx.AsyncClient(base_url=stack.api.url) as c:
        schema = (await c.get("/openapi.json")).json()
    methods = {"get", "put", "post", "delete", "patch", "head", "options"}
    operations = [(m, p) for p, item in schema["paths"].items() for m in item if m in methods]
    for method, path in [
        ("post", "/v1/requests"),
        ("post", "/v1/vllm/generate"),
        ("post", "/v1/chat/completions"),
        ("post", "/v1/responses"),
        ("get", "/v1/models"),
    ]:
        assert (method, path) in operations, (method, path)
    (tmp_path / "epd_deep_hooks.py").write_text(DEEP_HOOKS)
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "epd_deep_hooks",
        "EPD_ANSWERED_RULES": str(tmp_path / "rules.txt"),
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{stack.api.url}/openapi.json",
        "--checks",
        "not_a_server_error,status_code_conformance,content_type_conformance,"
        "response_schema_conformance",
        # A count per operation, no --max-time: a time budget spent on a slow (shared) machine
        # before the fuzzing phase reached every operation would leave routes untested.
        "--max-examples",
        "12",
        # one worker: Hypothesis' lambda-source cache is not thread-safe (a runtime error of the
        # tool, seen here with two workers)
        "--workers",
        "1",
        "--seed",
        "7",
        "--no-shrink",
        "--phases",
        "examples,coverage,fuzzing",
        "--request-timeout",
        "60",
        "--header",
        "Authorization: Bearer alice-token",
        "--generation-database",
        "none",
        "--no-color",
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 500)
    text = out.decode(errors="replace")
    print(f"\nSCHEMATHESIS (every route, nested bodies too):\n{text[-2500:]}")
    assert proc.returncode == 0, text[-6000:]
    assert "No issues found" in text or "passed" in text.lower(), text[-3000:]
    assert f"Tested: {len(operations)}" in text, text[-3000:]  # every operation, none left out
    rules = Counter((tmp_path / "rules.txt").read_text().splitlines())
    print(f"refusals by route and rule: {dict(rules.most_common(12))}")
    for route in ("POST /v1/requests", "POST /v1/vllm/generate"):
        assert rules[f"{route} body.json"] > 0, rules  # the nested bodies reached both
    tail = stack.api.tail()
    assert "Traceback" not in tail and "RecursionError" not in tail, tail
    assert (await _healthz(stack)) == 200


async def _healthz(stack: ApiStack) -> int:
    async with httpx.AsyncClient(base_url=stack.api.url) as c:
        return (await c.get("/healthz")).status_code
