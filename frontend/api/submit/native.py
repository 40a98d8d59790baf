"""A ``/v1/requests`` body -> the intake's :class:`Submission` (JSON or ``multipart/form-data``).

Parse: the JSON text (:mod:`~frontend.api.submit.json_text`), or the form's fields and image
parts (files read, at most the image limit each). Check: image and video counts before
pydantic copies megabytes of image strings around, a prompt far over its limit before pydantic
sees it, the schema (:class:`frontend.api.protocol.SubmitRequest`), then the bounds the body
alone decides (:class:`runtime.request_limits.RequestLimits`; the intake checks the rest).
Media: every image string decoded, sized and sniffed, every video likewise
(:mod:`~frontend.api.submit.media`). The render (run by the intake) decodes them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError as PydanticValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request

from frontend.api.errors import ApiError, answered, bad_request, pydantic_error
from frontend.api.protocol import SubmitRequest
from frontend.api.submit import SubmitHeaders
from frontend.api.submit.json_text import parse_json, refuse_long_text
from frontend.api.submit.media import check_image_bytes, decode_image_string, decode_videos
from frontend.api.submit.reading import (
    FILE_WALK_SHARE,
    JSON,
    MULTIPART,
    off_the_loop,
    replayed,
)
from media.image_structure import StructureLimits
from producers.intake import RenderContext, Submission
from runtime.request_limits import RequestLimits
from schemas.errors import ValidationError
from schemas.types import RenderEvent, SamplingParams, now_ms
from schemas.vllm_sampling import pipeline_top_k

if TYPE_CHECKING:
    from frontend.api.state import ApiState


@dataclass(slots=True)
class SubmitInput:
    """A checked submission, its media as bytes (sniffed, size-checked, not yet decoded)."""

    request: SubmitRequest
    """The body's fields (its ``images`` and ``videos`` strings are the bytes below now)."""
    images: list[bytes]
    image_types: list[str] = field(default_factory=list)
    videos: list[bytes | list[bytes]] = field(default_factory=list)

    @property
    def stop(self) -> list[str]:
        stop = self.request.stop
        return [stop] if isinstance(stop, str) else list(stop or [])

    def sampling(self) -> SamplingParams:
        """The request's sampling parameters (``top_k`` -1 means off, as in vLLM)."""
        r = self.request
        return SamplingParams(
            max_tokens=r.max_tokens,
            temperature=r.temperature,
            ignore_eos=r.ignore_eos,
            top_p=r.top_p,
            top_k=pipeline_top_k(r.top_k),
            seed=r.seed,
            stop=self.stop,
        )

    def fingerprint(self) -> str:
        """A digest of the request's meaning (not its bytes: multipart boundaries and base64
        line breaks differ between identical requests). Used by Idempotency-Key."""
        fields = self.request.model_dump(exclude={"images", "videos"})
        h = hashlib.sha256(json.dumps({**fields, "stop": self.stop}, sort_keys=True).encode())
        for img in self.images:
            h.update(hashlib.sha256(img).digest())
        for k, video in enumerate(self.videos):
            h.update(f"\0video{k}:".encode())
            for part in [video] if isinstance(video, bytes) else video:
                h.update(hashlib.sha256(part).digest())
        return h.hexdigest()


def _checked(req: SubmitRequest, limits: RequestLimits) -> None:
    """The bounds of a submission the body alone decides (the intake checks the rest)."""
    if (req.prompt is None) == (req.token_ids is None):
        raise ValidationError(
            "render.prompt", "give exactly one of prompt or token_ids", field="prompt"
        )
    limits.check_prompt(req.prompt, req.token_ids)
    limits.check_deadline(req.deadline_s)
    limits.check_sampling(
        req.max_tokens,
        req.temperature,
        top_p=req.top_p,
        top_k=pipeline_top_k(req.top_k),
        seed=req.seed,
        stop=req.stop,
    )


IMAGE_PARTS = ("images", "image", "images[]")
"""The form fields that hold an image (a file, or a base64 string)."""


@dataclass(slots=True)
class NativeBody:
    """A parsed body: its fields and, for a form, its image parts as sent (files read, or
    strings; counted as they came). ``images`` None: a JSON body's images are in its fields."""

    fields: dict[str, Any]
    images: list[bytes | str] | None = None


@dataclass(slots=True)
class CheckedBody:
    """A body the schema and the limits accept; its images not yet decoded."""

    request: SubmitRequest
    images: list[bytes | str]


def json_fields(body: bytes, limits: RequestLimits) -> NativeBody:
    """Parse: a JSON body's fields (400 ``body.json``; 413 for a prompt far over its limit)."""
    refuse_long_text(body, ("prompt",), limits.max_prompt_chars)
    obj = parse_json(body, limits.max_json_depth)
    if not isinstance(obj, dict):
        raise bad_request("body must be a JSON object", rule="body.json")
    return NativeBody(obj)


async def form_fields(
    request: Request, body: bytes, limits: RequestLimits, settings: Any
) -> NativeBody:
    """Parse: a ``multipart/form-data`` body (``body``: the bytes already read) as its fields
    (``token_ids`` and ``metadata`` as JSON, ``stop`` repeated per string) and its image parts,
    counted as they come."""
    try:
        form = await replayed(request, body).form(
            max_files=limits.max_images + 1, max_fields=64, max_part_size=1024 * 1024
        )
    except Exception as e:  # python-multipart and Starlette raise several types here
        raise bad_request(f"cannot parse the form: {e}", rule="body.form") from None
    try:
        return await _form_parts(form, limits, settings)
    finally:
        await form.close()


async def _form_parts(form: FormData, limits: RequestLimits, settings: Any) -> NativeBody:
    parsed = NativeBody({}, [])
    images: list[bytes | str] = []
    for name, value in form.multi_items():
        if name in IMAGE_PARTS:
            limits.check_counts(len(images) + 1, 0)
            if isinstance(value, UploadFile):
                images.append(await value.read(settings.api_max_image_bytes + 1))
            else:
                images.append(str(value))
        elif isinstance(value, UploadFile):
            raise bad_request(f"unexpected file part {name!r}", rule="body.form", field=name)
        elif name == "stop":  # one stop string per field (repeat the field for more)
            parsed.fields.setdefault("stop", []).append(value)
        elif name in ("token_ids", "metadata"):
            where = f"form field {name}"
            parsed.fields[name] = parse_json(value, limits.max_json_depth, where=where)
        else:
            parsed.fields[name] = value
    parsed.images = images
    return parsed


def checked(parsed: NativeBody, limits: RequestLimits) -> CheckedBody:
    """Check: counts and the prompt before pydantic (a JSON body), the schema, the bounds."""
    obj = parsed.fields
    if parsed.images is None:  # counted before pydantic copies megabytes of image strings
        images, videos = obj.get("images"), obj.get("videos")
        limits.check_counts(
            len(images) if isinstance(images, list) else 0,
            len(videos) if isinstance(videos, list) else 0,
        )
        if isinstance(obj.get("prompt"), str):  # a 30 MB prompt: refused before pydantic
            limits.check_prompt(obj["prompt"], None)
    try:
        req = SubmitRequest.model_validate(obj)
    except PydanticValidationError as e:
        raise pydantic_error(e) from None
    _checked(req, limits)
    return CheckedBody(req, list(req.images) if parsed.images is None else parsed.images)


def with_media(body: CheckedBody, settings: Any) -> SubmitInput:
    """Media: each image's bytes (decoded from its string) sized, sniffed and their structure
    counted; each video's file or frames likewise."""
    datas, types = [], []
    limit = settings.api_max_image_bytes
    structure = StructureLimits.from_settings(settings)
    for i, image in enumerate(body.images):
        data = image if isinstance(image, bytes) else decode_image_string(image, i, limit)
        types.append(check_image_bytes(data, i, limit, structure))
        datas.append(data)
    inp = SubmitInput(body.request, datas, types)
    if body.request.videos:
        inp.videos = decode_videos(body.request.videos, settings)
    return inp


def parse_json_submit(body: bytes, limits: RequestLimits, settings: Any) -> SubmitInput:
    """A JSON submission, parsed, checked and its media decoded (400 bad JSON, 422 schema,
    413/415/400 per image), as :class:`NativeDoor` reads one (in one call: for tests)."""
    with answered():
        return with_media(checked(json_fields(body, limits), limits), settings)


@dataclass(frozen=True, slots=True)
class NativeDoor:
    """``POST /v1/requests`` on the one path (:func:`frontend.api.submit.submit_body`)."""

    st: ApiState
    accepts: tuple[str, ...] = (JSON, MULTIPART)

    async def parse(self, request: Request, ctype: str, body: bytes) -> NativeBody:
        st = self.st
        if ctype == JSON:
            return await off_the_loop(
                len(body), json_fields, body, st.limits, slot=st.bodies.parsing
            )
        return await form_fields(request, body, st.limits, st.settings)

    def work_bytes(self, parsed: NativeBody, body_bytes: int) -> int:
        """A JSON body's bytes; a form's image strings, and its image files at a share
        (:data:`~frontend.api.submit.reading.FILE_WALK_SHARE`): only their structure is
        walked."""
        if parsed.images is None:
            return body_bytes
        strings = sum(len(i) for i in parsed.images if isinstance(i, str))
        files = sum(len(i) for i in parsed.images if isinstance(i, bytes))
        return strings + files // FILE_WALK_SHARE

    def check(self, parsed: NativeBody) -> CheckedBody:
        return checked(parsed, self.st.limits)

    def media(self, body: CheckedBody) -> SubmitInput:
        return with_media(body, self.st.settings)

    def submission(
        self, inp: SubmitInput, tenant: str | None, headers: SubmitHeaders
    ) -> Submission:
        return native_submission(self.st, inp, tenant, headers)

    def blame(self, inp: SubmitInput, exc: ValidationError | ApiError) -> None:
        """A native error names the native field already."""


def native_submission(
    st: ApiState, inp: SubmitInput, tenant: str | None, headers: SubmitHeaders
) -> Submission:
    """A parsed ``/v1/requests`` body as the intake's :class:`Submission`."""
    req = inp.request

    async def render(ctx: RenderContext) -> RenderEvent:
        return await st.renderer.render_async(
            ctx.request_id,
            timeout_s=st.settings.api_render_timeout_s,
            prompt=req.prompt,
            token_ids=req.token_ids,
            images=inp.images,
            videos=inp.videos,
            sampling=ctx.sampling,
            cache_salt=ctx.cache_salt,
            deadline_ms=ctx.deadline_ms,
        )

    deadline = None if req.deadline_s is None else now_ms() + int(req.deadline_s * 1000)
    return Submission(
        render=render,
        sampling=inp.sampling(),
        tenant=tenant,
        cache_salt=req.cache_salt,
        deadline_ms=deadline,
        metadata=req.metadata,
        traceparent=headers.traceparent,
        idempotency_key=headers.idempotency_key,
        # Only a keyed request is compared by meaning: no digest of the images otherwise.
        fingerprint=inp.fingerprint() if headers.idempotency_key is not None else "",
        decodes_media=bool(inp.images or inp.videos),
        door_checked=True,  # checked(): sampling and counts
    )
