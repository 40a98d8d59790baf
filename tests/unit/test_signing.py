"""Entry signatures (framing, request binding) and the content hash store keys are made of."""

from __future__ import annotations

import dataclasses

import blake3
import pytest
import torch

from schemas.signing import (
    ItemHasher,
    ec_message,
    make_ec_transfer,
    sign_ec,
    tensor_digest,
    verify_ec,
)
from schemas.tensors import tensor_bytes
from schemas.types import TensorRef

SECRET = b"signing-test-secret"
FIELDS = {"mm_hash": "h", "store": "redis://s", "key": "ec:fp:h", "expires_ms": 10**13}


def test_fields_are_length_prefixed_not_joined() -> None:
    # With a separator, moving it between neighbouring fields gave the same message.
    a = ec_message(request_id="r", mm_hash="a\x1fb", store="c", key="k", expires_ms=1)
    b = ec_message(request_id="r", mm_hash="a", store="b\x1fc", key="k", expires_ms=1)
    c = ec_message(request_id="r\x1fa", mm_hash="", store="b\x1fc", key="k", expires_ms=1)
    assert len({a, b, c}) == 3
    shifted = [
        dict(FIELDS, mm_hash="h:redis", store="//s"),
        dict(FIELDS, key="ec:fp:h" + "1", expires_ms=int(str(10**13)[1:])),
    ]
    sig = sign_ec(SECRET, request_id="r", **FIELDS)  # type: ignore[arg-type]
    for f in shifted:
        assert sign_ec(SECRET, request_id="r", **f) != sig  # type: ignore[arg-type]


def test_signature_binds_the_request() -> None:
    ec = make_ec_transfer(secret=SECRET, request_id="req-1", **FIELDS)  # type: ignore[arg-type]
    assert verify_ec(SECRET, ec, request_id="req-1")
    assert not verify_ec(SECRET, ec, request_id="req-2")
    assert not verify_ec(SECRET, ec, request_id="")
    assert not verify_ec(SECRET, ec)  # nor as an entry bound to no request
    unbound = make_ec_transfer(secret=SECRET, **FIELDS)  # type: ignore[arg-type]
    assert verify_ec(SECRET, unbound)
    assert not verify_ec(SECRET, unbound, request_id="req-1")
    for name, value in (("key", "ec:fp:x"), ("expires_ms", 1), ("store", "x"), ("mm_hash", "x")):
        assert not verify_ec(SECRET, dataclasses.replace(ec, **{name: value}), request_id="req-1")


HASHER = ItemHasher.for_processor("fp", {"patch_size": 14, "merge_size": 2})


def item(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(16, 12, generator=g),
        "image_grid_thw": torch.tensor([1, 4, 4], dtype=torch.int64),
    }


def test_item_hash_covers_every_input() -> None:
    base = HASHER.item_hash("image", item(), None)
    pv = item()["pixel_values"]
    variants = [
        HASHER.item_hash("image", item(1), None),  # other pixels
        HASHER.item_hash("video", item(), None),
        HASHER.item_hash("image", item(), ""),  # an empty salt is still a salt
        HASHER.item_hash("image", item(), "tenant"),
        HASHER.item_hash("image", {**item(), "pixel_values": pv.reshape(12, 16)}, None),
        HASHER.item_hash("image", {**item(), "pixel_values": pv.to(torch.float64)}, None),
        HASHER.item_hash("image", {"pixel_values": pv}, None),  # a field fewer
        ItemHasher.for_processor("other-fp", {"patch_size": 14, "merge_size": 2}).item_hash(
            "image", item(), None
        ),
        ItemHasher.for_processor("fp", {"patch_size": 16, "merge_size": 2}).item_hash(
            "image", item(), None
        ),
    ]
    assert base not in variants and len(set(variants)) == len(variants)
    # Same inputs, same hash, whatever the dict order or the processor config's key order.
    rev = dict(reversed(list(item().items())))
    assert HASHER.item_hash("image", rev, None) == base
    assert ItemHasher.for_processor("fp", {"merge_size": 2, "patch_size": 14}) == HASHER


def test_claim_checked_and_inline_inputs_hash_alike() -> None:
    data = item(3)
    pv = data["pixel_values"]
    raw = tensor_bytes(pv)
    assert tensor_digest(pv) == blake3.blake3(raw).hexdigest()
    ref = TensorRef("redis://s", "ec:claim:x:pixel_values", "float32", [16, 12], len(raw), "")
    ref.digest = blake3.blake3(raw).hexdigest()
    inline = HASHER.item_hash("image", data, "t")
    assert HASHER.item_hash("image", {**data, "pixel_values": ref}, "t") == inline
    # Given digests are used as they are (the fan-out computes them once, for claim checks too).
    assert HASHER.item_hash("image", data, "t", digests={"pixel_values": ref.digest}) == inline
    wrong = dataclasses.replace(ref, digest="0" * 64)
    assert HASHER.item_hash("image", {**data, "pixel_values": wrong}, "t") != inline


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.uint8])
def test_tensor_digest_of_any_wire_dtype(dtype: torch.dtype) -> None:
    t = torch.arange(24).reshape(2, 3, 4).to(dtype)
    assert tensor_digest(t) == blake3.blake3(tensor_bytes(t)).hexdigest()
    # A non-contiguous view digests its logical (C-order) bytes.
    assert (
        tensor_digest(t.transpose(0, 2))
        == blake3.blake3(tensor_bytes(t.transpose(0, 2))).hexdigest()
    )


def test_tensor_digest_is_remembered_until_the_tensor_changes() -> None:
    from schemas.signing import DIGEST_MEMO_ATTR, tensor_digest

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    first = tensor_digest(t)
    assert getattr(t, DIGEST_MEMO_ATTR)[1] == first
    assert tensor_digest(t) == first
    t[0, 0] = 99.0  # in place: the version counter moves, the digest is computed anew
    changed = tensor_digest(t)
    assert changed != first and changed == tensor_digest(t.clone())
    # a copy (what a decoder makes) is hashed on its own and agrees
    assert tensor_digest(t.clone()) == changed
    with torch.inference_mode():
        frozen = torch.ones(4)
        assert tensor_digest(frozen) == tensor_digest(torch.ones(4))


def test_undigested_bytes_counts_what_a_digest_would_still_read() -> None:
    from schemas.signing import undigested_bytes
    from schemas.wire_tensor import WireTensor

    t = torch.zeros(256, 4, dtype=torch.float32)
    grid = torch.tensor([1, 16, 16], dtype=torch.int64)
    ref = TensorRef("redis://s", "claim:k", "float32", [256, 4], 4096, "0" * 64)
    assert undigested_bytes([t, grid, ref, "not a tensor"]) == 4096 + 24
    tensor_digest(t)
    assert undigested_bytes([t, grid]) == 24  # remembered: nothing to read again
    t[0, 0] = 1.0  # changed in place: its digest is made anew
    assert undigested_bytes([t]) == 4096
    wire = WireTensor.from_bytes("float32", [256, 4], bytes(4096))
    tensor_digest(wire)
    assert undigested_bytes([wire]) == 4096  # decoded from the wire: always hashed
    with torch.inference_mode():
        frozen = torch.ones(8)
    tensor_digest(frozen)
    assert undigested_bytes([frozen]) == 32  # no version counter: never remembered
