"""OpenAI's objects from a request's status record: ``chat.completion``, ``response``, and the
error a request that did not complete is answered with."""

from __future__ import annotations

import copy
from typing import Any

from frontend.api.errors import ApiError
from schemas.status_record import StatusRecord

CHAT_PREFIX = "chatcmpl-"
RESPONSE_PREFIX = "resp_"
MESSAGE_PREFIX = "msg_"

RESPONSE_STATUS = {
    "queued": "queued",
    "encoding": "in_progress",
    "prefilling": "in_progress",
    "decoding": "in_progress",
    "completed": "completed",
    "cancelled": "cancelled",
    "failed": "failed",
    "rejected": "failed",
    "expired": "failed",
}
"""A record's status as a response's."""


def finish_reason(rec: StatusRecord) -> str:
    """``stop`` (end of sequence, a stop token or string) or ``length``."""
    found = rec.info.get("finish_reason")
    if found in ("stop", "length"):
        return str(found)
    max_tokens = rec.front.get("max_tokens")
    made = len(rec.token_ids or [])
    return "length" if max_tokens is not None and made >= max_tokens else "stop"


def usage(rec: StatusRecord) -> dict[str, int]:
    prompt = rec.prompt_tokens
    completion = len(rec.token_ids or [])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def record_gone_503() -> ApiError:
    """What an OpenAI route answers (a non-streamed answer) or ends its stream with when the
    request's record went before the request ended: 503 with ``Retry-After``, as the OpenAI
    clients retry (resubmit), since this API can no longer give the outcome. The native routes
    say the same as 404 (``frontend.api.events.record_gone``): there a request id is read,
    here a conversation is answered. A new error each time: a raised exception keeps its
    traceback, so one shared instance would pin the frames of every request it was raised for."""
    return ApiError(
        503,
        "unavailable",
        "the request's status record is gone (expired, or lost with a Redis restart) before "
        "the request ended; its outcome, if any, is on the results topic",
        rule="status-gone",
        headers={"Retry-After": "1"},
    )


def not_completed(rec: StatusRecord) -> ApiError:
    """The error a non-streamed answer gives for a request that ended other than completed,
    in the native API's terms: a worker's refusal is 422 naming its rule, a cancel 409, a
    failure or an expiry 503 (a retry may succeed)."""
    status = rec.status
    err = rec.error or {}
    message = str(err.get("message") or f"the request ended {status}")
    if status == "rejected":
        return ApiError(
            422,
            "validation_failed",
            message,
            rule=err.get("rule") or err.get("code"),
            field=err.get("field"),
            item=err.get("item"),
        )
    if status == "cancelled":
        return ApiError(409, "cancelled", message, rule="request.cancelled")
    return ApiError(
        503, "unavailable", message, rule=err.get("code") or status, headers={"Retry-After": "1"}
    )


def chat_completion(rec: StatusRecord) -> dict[str, Any]:
    """The ``chat.completion`` of a completed request."""
    front = rec.front
    return {
        "id": CHAT_PREFIX + rec.request_id,
        "object": "chat.completion",
        "created": int(front.get("created_s") or rec.created_ms // 1000),
        "model": front.get("model", ""),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": rec.text or "", "refusal": None},
                "finish_reason": finish_reason(rec),
                "logprobs": None,
            }
        ],
        "usage": usage(rec),
        "system_fingerprint": None,
    }


def _response_output(rec: StatusRecord) -> list[dict[str, Any]]:
    """A completed response's one assistant message (nothing before it completes)."""
    if rec.status != "completed":
        return []
    content = [{"type": "output_text", "text": rec.text or "", "annotations": []}]
    return [
        {
            "type": "message",
            "id": MESSAGE_PREFIX + rec.request_id,
            "status": "completed",
            "role": "assistant",
            "content": content,
        }
    ]


def _response_usage(rec: StatusRecord) -> dict[str, Any] | None:
    """A completed response's usage in the Responses API's names."""
    if rec.status != "completed":
        return None
    u = usage(rec)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _response_error(rec: StatusRecord, status: str) -> dict[str, str] | None:
    """A failed response's error (its rule as the code)."""
    if status != "failed":
        return None
    err = rec.error or {}
    return {
        "code": str(err.get("rule") or err.get("code") or rec.status),
        "message": str(err.get("message") or f"the request ended {rec.status}"),
    }


def created_response_object(rec: StatusRecord) -> dict[str, Any]:
    """The ``response`` a background create answers: as created, ``queued`` with no output,
    however far the workers got meanwhile (a short one may have finished before the create
    answers); the client polls by id for the rest, as with OpenAI's."""
    view = response_object(rec)
    view.update(
        status="queued",
        output=[],
        output_text=None,
        error=None,
        incomplete_details=None,
        usage=None,
    )
    return view


RESPONSE_FIXED: dict[str, Any] = {
    "instructions": None,
    "parallel_tool_calls": False,
    "tool_choice": "none",
    "tools": [],
    "text": {"format": {"type": "text"}},
    "truncation": "disabled",
    "reasoning": None,
    "previous_response_id": None,
    "store": True,
    "user": None,
}
"""The fields of a response this pipeline always answers the same (no tools, plain text)."""


def response_object(rec: StatusRecord) -> dict[str, Any]:
    """The ``response`` of a record the Responses API made, as it stands."""
    front = rec.front
    status = RESPONSE_STATUS.get(rec.status, "in_progress")
    completed = rec.status == "completed"
    length = completed and finish_reason(rec) == "length"
    return {
        "id": RESPONSE_PREFIX + rec.request_id,
        "object": "response",
        "created_at": int(front.get("created_s") or rec.created_ms // 1000),
        "status": status,
        "background": bool(front.get("background")),
        "model": front.get("model", ""),
        "output": _response_output(rec),
        "output_text": (rec.text or "") if completed else None,
        "error": _response_error(rec, status),
        "incomplete_details": {"reason": "max_output_tokens"} if length else None,
        "max_output_tokens": front.get("max_tokens"),
        "temperature": front.get("temperature"),
        "top_p": front.get("top_p"),
        "usage": _response_usage(rec),
        "metadata": rec.metadata or {},
        **copy.deepcopy(RESPONSE_FIXED),
    }
