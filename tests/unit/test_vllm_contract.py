"""Contract: the vLLM engine backend's bodies and replies against vLLM 0.33.0's own models.

Every ``/inference/v1/generate`` body :func:`schemas.vllm_generate.generate_body` builds (every
model family, image and video, metadata-only items with their EC entries and items carrying
their encoder inputs, text only, greedy and sampled with a seed, stop strings and stop token
ids) is parsed by vLLM's ``GenerateRequest`` and checked: what vLLM read is what we meant. Every
reply the backend reads is made here by vLLM's own response models (``GenerateTokensResponse``,
``GenerateTokensStreamResponse`` chunks as its serving code writes them, ``ErrorResponse`` from
its ``create_error_response``), never written by hand.

vLLM's code comes from ``tools/vllm-side.sh`` (:mod:`tests.vllm_side`): skipped, saying so,
where it is not assembled; required in CI.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any

import pytest
import torch

from tests.vllm_side import VLLM_VERSION, use_vllm

use_vllm()

import msgspec  # noqa: E402
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
from vllm.entrypoints.serve.engine.protocol import UsageInfo  # noqa: E402
from vllm.entrypoints.serve.exception_handling.error_response import (  # noqa: E402
    create_error_response,
)

from schemas.errors import ValidationError  # noqa: E402
from schemas.families import FAMILIES, ModelFamily  # noqa: E402
from schemas.signing import make_ec_transfer  # noqa: E402
from schemas.types import Features, PlaceholderRange, PrefillEvent, SamplingParams  # noqa: E402
from schemas.vllm_generate import (  # noqa: E402
    ITEM_SOURCE_RULE,
    REJECTED_RULE,
    VllmRejected,
    VllmUnavailable,
    abort_body,
    ec_params_json,
    engine_request_id,
    error_for,
    generate_body,
    parse_event,
    parse_response,
)
from schemas.vllm_generate import VLLM_VERSION as PINNED  # noqa: E402

SECRET = b"contract-secret"


def _meta(family: ModelFamily, modality: str, t: int, h: int, w: int) -> dict[str, torch.Tensor]:
    meta: dict[str, torch.Tensor] = {f"{modality}_grid_thw": torch.tensor([t, h, w])}
    if "second_per_grid_ts" in family.metadata[modality]:
        meta["second_per_grid_ts"] = torch.tensor(0.5, dtype=torch.float64)
    return meta


@dataclass(frozen=True)
class Shape:
    family: str
    modalities: tuple[str, ...]
    source: str  # "ec": metadata-only + EC entry; "inline": kwargs_data; "mixed": one of each
    sampling: str

    @property
    def name(self) -> str:
        return f"{self.family}-{'+'.join(self.modalities) or 'text'}-{self.source}-{self.sampling}"


SAMPLINGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(max_tokens=8),
    "seeded": SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=20, seed=1234),
    "stops": SamplingParams(
        max_tokens=12, temperature=0.3, seed=7, stop=["</s>", "\n\n"], stop_token_ids=[151645]
    ),
    "ignore-eos": SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=[2, 3]),
}


def _shapes() -> list[Shape]:
    out = []
    for fam, mods, source, sampling in itertools.product(
        FAMILIES,
        [("image",), ("video",), ("image", "video")],
        ["ec", "inline", "mixed"],
        SAMPLINGS,
    ):
        if source == "mixed" and len(mods) < 2:
            continue
        out.append(Shape(fam, mods, source, sampling))
    out += [Shape(fam, (), "text", s) for fam in FAMILIES for s in SAMPLINGS]
    return out


SHAPES = _shapes()


def event_for(shape: Shape) -> PrefillEvent:
    """A validated-looking PrefillEvent of ``shape``: a placeholder run per item, its grid (and
    the video timing where the family has one), its EC entry or its encoder inputs."""
    family = FAMILIES[shape.family]
    tokens = [101, 102, 103]
    hashes: dict[str, list[str]] = {}
    places: dict[str, list[PlaceholderRange]] = {}
    meta: dict[str, list[Any]] = {}
    kwargs: dict[str, list[Any]] = {}
    ec = {}
    for i, modality in enumerate(shape.modalities):
        t, h, w = (1, 4, 4) if modality == "image" else (2, 4, 8)
        length = t * h * w // 4
        mm_hash = f"{shape.family}-{modality}-{i}"
        is_embed = None
        if modality == "video" and family.video_timestamps:
            # Qwen3-VL lays frames out with timestamp text between: is_embed marks the pads.
            is_embed = [k % (length // t + 2) < length // t for k in range(length + 2 * t)]
            length = len(is_embed)
        hashes[modality] = [mm_hash]
        places[modality] = [PlaceholderRange(len(tokens), length, is_embed)]
        tokens += [151655] * length + [104, 105]
        meta[modality] = [_meta(family, modality, t, h, w)]
        inline = shape.source == "inline" or (shape.source == "mixed" and modality == "video")
        if inline:
            pv = torch.randn(t * h * w, 12)
            kwargs[modality] = [
                {f"pixel_values{'_videos' * (modality == 'video')}": pv, **meta[modality][0]}
            ]
        else:
            kwargs[modality] = [None]
            ec[mm_hash] = make_ec_transfer(
                mm_hash=mm_hash,
                store="redis://store:6379/0",
                key=f"epd:emb:{mm_hash}",
                expires_ms=4_000_000_000_000,
                secret=SECRET,
                request_id=shape.name,
            )
    any_inline = any(v != [None] for v in kwargs.values())
    return PrefillEvent(
        request_id=shape.name,
        model="m",
        token_ids=tokens,
        features=Features(hashes, places, kwargs if any_inline else None, meta or None),
        ec_transfer_params=ec,
        sampling=SAMPLINGS[shape.sampling],
        cache_salt="salt-" + shape.family if shape.sampling == "seeded" else None,
        kv_transfer_params=json.dumps({"do_remote_decode": False})
        if shape.sampling == "stops"
        else None,
    )


def vllm_parse(body: dict[str, Any]) -> GenerateRequest:
    """vLLM's whole acceptance before scheduling: the model, the msgpack of what goes to the
    engine, the features decoded (as ``serve_tokens`` does)."""
    wire = json.loads(json.dumps(body))  # exactly what goes over HTTP
    req = GenerateRequest.model_validate(wire)
    msgspec.msgpack.encode((req.sampling_params, req.kv_transfer_params, req.ec_transfer_params))
    if req.features is not None:
        mm_kwargs_from_features(req.features)
    return req


def test_pinned_version() -> None:
    import vllm

    assert PINNED == VLLM_VERSION
    assert vllm.__version__.startswith(PINNED), vllm.__version__


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_vllm_accepts_what_we_send(shape: Shape) -> None:
    ev = event_for(shape)
    body = generate_body(ev)
    req = vllm_parse(body)
    assert req.request_id == ev.request_id and req.token_ids == ev.token_ids
    assert req.stream is True and req.output_mode == "tokens"
    assert req.cache_salt == ev.cache_salt
    sp, want = req.sampling_params, ev.sampling
    assert sp.max_tokens == want.max_tokens and sp.temperature == want.temperature
    assert sp.top_p == want.top_p and sp.top_k in (want.top_k, -1 if want.top_k == 0 else None)
    assert sp.seed == want.seed and sp.ignore_eos == want.ignore_eos
    assert list(sp.stop or []) == want.stop
    assert list(sp.stop_token_ids or []) == want.stop_token_ids
    assert req.is_sampling_param_provided("max_tokens")  # vLLM's server default never applies
    assert req.ec_transfer_params == (ec_params_json(ev.ec_transfer_params) or None)
    assert req.kv_transfer_params == (json.loads(ev.kv_transfer_params or "null"))
    if not shape.modalities:
        assert req.features is None
        return
    assert req.features is not None
    assert req.features.mm_hashes == ev.features.mm_hashes
    for modality, ranges in ev.features.mm_placeholders.items():
        got = req.features.mm_placeholders[modality]
        # vLLM 0.33's PlaceholderRangeInfo has no is_embed yet (a TODO there): it drops it.
        assert [(p.offset, p.length) for p in got] == [(p.offset, p.length) for p in ranges]
    decoded = mm_kwargs_from_features(req.features)
    for modality, items in decoded.items():
        (item,) = items
        assert item is not None
        meta = (ev.features.mm_metadata or {})[modality][0] or {}
        inline = (ev.features.kwargs_data or {}).get(modality, [None])[0] or {}
        for name, t in [*meta.items(), *inline.items()]:
            assert isinstance(t, torch.Tensor) and torch.equal(item[name].data, t), (modality, name)
    # The EC connector reads the entries from extra_args, where serve_tokens copies them.
    for mm_hash in ev.ec_transfer_params:
        assert req.ec_transfer_params is not None and mm_hash in req.ec_transfer_params


def test_shape_count(capsys: pytest.CaptureFixture[str]) -> None:
    families = {s.family for s in SHAPES}
    assert families == set(FAMILIES) and len(SHAPES) >= 80
    with capsys.disabled():
        print(
            f"\nvLLM {VLLM_VERSION} GenerateRequest accepted {len(SHAPES)} request shapes "
            f"({len(families)} families x image/video/both/text x ec/inline/mixed x "
            f"{len(SAMPLINGS)} samplings), and {len(FAMILIES) * 2} encoder request shapes "
            f"({len(FAMILIES)} families x image/video); {len(FINISHES) * 2 + 1} reply checks "
            "made by vLLM's response models"
        )


# --------------------------------------------------------------------------- traps


def _ec_shape() -> PrefillEvent:
    return event_for(Shape("qwen2_vl", ("image",), "ec", "greedy"))


def test_metadata_only_without_ec_refused_by_both() -> None:
    ev = _ec_shape()
    bare = replace(ev, ec_transfer_params={})
    with pytest.raises(ValidationError) as err:
        generate_body(bare)
    assert err.value.rule == ITEM_SOURCE_RULE and err.value.modality == "image"
    body = generate_body(ev)
    del body["ec_transfer_params"]
    with pytest.raises(Exception, match="metadata-only multimodal items require ec_transfer"):
        vllm_parse(body)


def test_item_with_neither_source_refused() -> None:
    """A render made with ``return_mm_kwargs: false`` and no metadata: vLLM would read the item
    as cached in its own processor cache, so we never send it."""
    ev = _ec_shape()
    ev.features.mm_metadata = {"image": [None]}
    with pytest.raises(ValidationError) as err:
        generate_body(ev)
    assert err.value.rule == ITEM_SOURCE_RULE and err.value.item == 0
    # vLLM itself accepts such a body: the check has to be ours.
    body = generate_body(_ec_shape())
    body["features"]["mm_metadata"] = {"image": [None]}
    assert vllm_parse(body).features is not None


def test_abort_body_names_vllm_engine_ids() -> None:
    assert abort_body(["r1"]) == {"request_ids": ["generate-tokens-r1"]}
    assert engine_request_id("x") == "generate-tokens-x"


# --------------------------------------------------------------------------- replies


def _sse(chunk: GenerateTokensStreamResponse) -> str:
    # As serve_tokens_stream_generator writes a token chunk.
    exclude = {
        n for n in ("prompt_token_ids", "mm_placeholders", "metrics") if getattr(chunk, n) is None
    }
    return f"data: {chunk.model_dump_json(exclude=exclude)}"


FINISHES = [("length", None), ("stop", None), ("stop", "</s>"), ("stop", 151645), ("abort", None)]


@pytest.mark.parametrize(("finish", "stop_reason"), FINISHES)
def test_streamed_reply(finish: str, stop_reason: int | str | None) -> None:
    deltas = [[5, 6], [7], []]
    lines = []
    for i, d in enumerate(deltas):
        last = i == len(deltas) - 1
        choice = GenerateTokensStreamChoice(
            index=0,
            token_ids=d,
            finish_reason=finish if last else None,
            stop_reason=stop_reason if last else None,
        )
        lines.append(
            _sse(GenerateTokensStreamResponse(request_id="generate-tokens-r", choices=[choice]))
        )
    usage = GenerateTokensStreamResponse(
        request_id="r", choices=[], usage=UsageInfo(prompt_tokens=3)
    )
    lines += [f"data: {usage.model_dump_json(exclude_none=True)}", "", "data: [DONE]"]
    outs = [o for o in (parse_event(line) for line in lines) if o is not None]
    assert [t for o in outs for t in o.token_ids] == [5, 6, 7]
    finals = [o for o in outs if o.finish_reason is not None]
    assert [(o.finish_reason, o.stop_reason) for o in finals] == [(finish, stop_reason)]


@pytest.mark.parametrize(("finish", "stop_reason"), FINISHES)
def test_whole_reply(finish: str, stop_reason: int | str | None) -> None:
    resp = GenerateTokensResponse(
        request_id="generate-tokens-r",
        choices=[
            GenerateTokensChoice(
                index=0, token_ids=[1, 2, 3], finish_reason=finish, stop_reason=stop_reason
            )
        ],
        ec_transfer_params={"h": {"key": "k"}},
    )
    out = parse_response(json.loads(json.dumps(resp.model_dump())))
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([1, 2, 3], finish, stop_reason)


def test_error_replies() -> None:
    bad = create_error_response("max_tokens must be at least 1, got 0.")
    err = error_for(bad.error.code, json.dumps(bad.model_dump()))
    assert isinstance(err, VllmRejected) and err.rule == REJECTED_RULE
    assert "max_tokens must be at least 1" in str(err) and err.status == 400
    long = create_error_response("x" * 5000)
    assert len(str(error_for(400, json.dumps(long.model_dump())))) < 600
    down = create_error_response(
        "engine dead", err_type="InternalServerError", status_code=HTTPStatus.INTERNAL_SERVER_ERROR
    )
    assert isinstance(error_for(down.error.code, json.dumps(down.model_dump())), VllmUnavailable)
    assert isinstance(error_for(503, b"<html>bad gateway</html>"), VllmUnavailable)
    # A deployment's fault (wrong model name, an API key, overload) is retried, not dead-lettered.
    missing = create_error_response(
        "The model `m` does not exist.", "NotFoundError", HTTPStatus.NOT_FOUND
    )
    assert isinstance(error_for(404, json.dumps(missing.model_dump())), VllmUnavailable)
    assert isinstance(error_for(401, b'{"error": "Unauthorized"}'), VllmUnavailable)
    assert isinstance(error_for(429, b""), VllmUnavailable)
    assert isinstance(error_for(422, json.dumps(bad.model_dump())), VllmRejected)
    # An error inside a stream, as create_streaming_error_response writes it.
    with pytest.raises(VllmUnavailable, match="Internal server error"):
        parse_event(
            "data: "
            + json.dumps(
                create_error_response(
                    "Internal server error", "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR
                ).model_dump()
            )
        )
    with pytest.raises(VllmRejected):
        parse_event("data: " + json.dumps(bad.model_dump()))


# --------------------------------------------------------------------------- encoder requests


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("modality", ["image", "video"])
def test_vllm_accepts_our_encoder_requests(family: str, modality: str) -> None:
    from gpu_workers.vllm_engine.encode import encode_body
    from schemas.types import EncodeEvent

    t, h, w = (1, 4, 4) if modality == "image" else (2, 4, 8)
    pv = "pixel_values" + ("_videos" if modality == "video" else "")
    grid_name = f"{modality}_grid_thw"
    tensors = {pv: torch.randn(t * h * w, 12), grid_name: torch.tensor([t, h, w])}
    ec = make_ec_transfer(
        mm_hash="h1", store="redis://s:6379/0", key="k1", expires_ms=4 * 10**12, secret=SECRET
    )
    ev = EncodeEvent("r", "m", modality, 0, "h1", dict(tensors), ec)
    body = encode_body(ev, tensors, grid_name, pad_id=151655, merge_size=2)
    req = vllm_parse(body)
    assert req.features is not None and req.stream is False
    assert req.features.mm_placeholders[modality][0].length == len(req.token_ids) == t * h * w // 4
    (item,) = mm_kwargs_from_features(req.features)[modality]
    assert item is not None and torch.equal(item[pv].data, tensors[pv])
    assert req.ec_transfer_params == ec_params_json({"h1": ec})
    assert req.sampling_params.max_tokens == 1


# --------------------------------------------------------------------------- the README's servers


def test_readme_ec_transfer_configs_are_vllms() -> None:
    """The README's ``--ec-transfer-config`` JSON (encoder, prefill/decode) builds vLLM's own
    ``ECTransferConfig`` with the roles it names (the connector module filled in)."""
    import importlib
    import re
    from pathlib import Path

    from vllm.config.ec_transfer import ECTransferConfig

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## vLLM backend") :]
    section = section[: section.index("\n## ", 5)]
    blobs = re.findall(r"--ec-transfer-config '(\{.*?\})'\n", section, flags=re.S)
    assert len(blobs) == 2
    configs = [ECTransferConfig(**json.loads(b)) for b in blobs]
    assert [(c.is_ec_producer, c.is_ec_consumer) for c in configs] == [(True, False), (False, True)]
    for c in configs:  # the module and class vLLM will load are ours, and there
        assert c.ec_connector_module_path == "epd_vllm_ec.connector"
        module = importlib.import_module(c.ec_connector_module_path)
        assert c.ec_connector is not None and hasattr(module, c.ec_connector)
        extra = c.ec_connector_extra_config
        assert {"store_url", "model_fingerprint"} <= set(extra), extra
    assert "--enable-scale-out" in section and VLLM_VERSION in section


def test_a_sampled_request_goes_with_the_reference_engines_seed() -> None:
    """An unseeded sampled request is sent with the seed the reference engine would draw with
    (derived from its request id), so a retried request generates the same tokens again and
    its token stream resumes on them; a request's own seed and greedy requests pass as they
    are. vLLM reads the seed we mean."""
    from dataclasses import replace

    from gpu_workers.sampling import request_seed
    from gpu_workers.vllm_engine.generation import seeded_body

    ev = _ec_shape()
    unseeded = replace(ev, sampling=SamplingParams(max_tokens=4, temperature=0.8))
    body = seeded_body(unseeded, None)
    derived = request_seed(unseeded.sampling, ev.request_id)
    assert vllm_parse(body).sampling_params.seed == derived
    assert seeded_body(unseeded, None) == body  # a retry asks for the same tokens
    own = replace(ev, sampling=SAMPLINGS["seeded"])
    assert vllm_parse(seeded_body(own, None)).sampling_params.seed == 1234
    greedy = replace(ev, sampling=SAMPLINGS["greedy"])
    assert vllm_parse(seeded_body(greedy, None)).sampling_params.seed is None
