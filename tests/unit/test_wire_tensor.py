"""Wire tensors (the render router's torch-free form) behave as torch tensors do wherever the
contract reads them: the bfloat16 cast bit for bit, the digests and item hashes, the codec, the
validator's verdicts (rule, place and message), and the fan-out's events and claim checks."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import SecretStr

from media.sample_images import synthetic_image
from producers.fanout import FanOut
from producers.render import Renderer
from runtime.model import load_render_info
from runtime.render_keys import RenderKeys, render_keys_of
from runtime.settings import Settings
from runtime.stores.local import LocalStore
from schemas import tensor_ops
from schemas.codec import get_codec, wire_codec
from schemas.errors import CodecError, ValidationError
from schemas.signing import ItemHasher, tensor_digest
from schemas.tensors import DTYPES, torch_dtype
from schemas.types import RenderEvent, TensorRef
from schemas.validator import ValidationConfig, validate_render_event
from schemas.wire_tensor import WireTensor, bfloat16_bits

# ---------------------------------------------------------------------------------------------
# bfloat16


def _torch_bf16_bits(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _special_bits() -> np.ndarray[Any, Any]:
    """Bit patterns where rounding can go wrong: zeros, infinities, NaNs of every kind,
    subnormals, ties to even and odd, the largest finite values, and their neighbours."""
    hi = np.arange(0, 1 << 16, dtype=np.uint32) << 16
    low = np.array(
        [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000], dtype=np.uint32
    )
    grid = (hi[:, None] | low[None, :]).reshape(-1)  # every exponent, sign and kept mantissa
    named = np.array(
        [
            0x7F800000,  # +inf
            0xFF800000,  # -inf
            0x7FC00000,  # quiet NaN
            0xFFC00000,  # negative quiet NaN
            0x7F800001,  # signalling NaN
            0x7FFFFFFF,
            0x00000001,  # smallest subnormal
            0x807FFFFF,  # largest negative subnormal
            0x7F7FFFFF,  # largest finite: rounds to inf
            0x7F7F8000,  # tie at the top: rounds to even (inf)
        ],
        dtype=np.uint32,
    )
    return np.concatenate([grid, named])


def test_bfloat16_bits_equal_torchs_on_every_special_pattern() -> None:
    x = _special_bits().view(np.float32)
    assert np.array_equal(bfloat16_bits(x), _torch_bf16_bits(x))


def test_bfloat16_bits_equal_torchs_on_random_values_and_patterns() -> None:
    rng = np.random.default_rng(20240917)
    with np.errstate(over="ignore"):  # the largest scales overflow to inf: values to round too
        scales = 10.0 ** rng.integers(-40, 39, 1 << 18)
        normals = (rng.standard_normal(1 << 18) * scales).astype(np.float32)
    patterns = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32).view(np.float32)  # NaNs too
    for x in (normals, patterns, patterns[:7], patterns[:1]):
        assert np.array_equal(bfloat16_bits(x), _torch_bf16_bits(x))


def test_a_wire_tensors_cast_is_torchs_cast() -> None:
    """Shape, dtype and bytes of the cast, and the widened values of a bfloat16 tensor."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((33, 1176)).astype(np.float32)
    x[0, :4] = [np.nan, np.inf, -np.inf, 1e-45]
    wire = WireTensor.from_array(x).cast("bfloat16")
    want = torch.from_numpy(x).to(torch.bfloat16)
    assert (wire.dtype, list(wire.shape)) == ("bfloat16", list(want.shape))
    assert bytes(wire.data) == bytes(tensor_ops.raw_view(want))
    got, exp = wire.values(), want.float().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(exp))
    assert np.array_equal(got[~np.isnan(got)], exp[~np.isnan(exp)])
    # Through tensor_ops, as the fan-out casts: each form stays itself.
    assert isinstance(tensor_ops.cast(WireTensor.from_array(x), "bfloat16"), WireTensor)
    assert tensor_ops.cast(torch.from_numpy(x), "bfloat16").dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# digests, hashes, codec


def _pairs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = [torch.randn(5, 7, generator=g).to(dt) for dt in DTYPES.values() if dt != torch.bool]
    out += [torch.randn(4, generator=g) > 0, torch.empty(0, 3), torch.tensor([[1, 2, 2]])]
    return out


def _wire(t: torch.Tensor) -> WireTensor:
    return WireTensor.from_bytes(
        tensor_ops.dtype_name(t), list(t.shape), tensor_ops.raw_view(t).tobytes()
    )


@pytest.mark.parametrize("t", _pairs(), ids=lambda t: f"{t.dtype}{list(t.shape)}")
def test_tensor_digest_is_the_same_for_both_forms(t: torch.Tensor) -> None:
    w = _wire(t)
    assert tensor_digest(w) == tensor_digest(t)
    assert tensor_digest(_wire(t.t().contiguous().t() if t.dim() == 2 else t)) == tensor_digest(
        t.t().contiguous().t() if t.dim() == 2 else t
    )  # a non-contiguous torch tensor: its C-order bytes
    assert (tensor_ops.dtype_name(w), tensor_ops.nbytes(w)) == (
        tensor_ops.dtype_name(t),
        tensor_ops.nbytes(t),
    )
    assert tensor_ops.flat_values(w) == tensor_ops.flat_values(t)


def test_item_hash_is_the_same_for_both_forms() -> None:
    hasher = ItemHasher.for_processor("fp", {"patch_size": 14})
    pv, grid = torch.randn(16, 12), torch.tensor([[1, 4, 4]])
    ref = TensorRef("redis://x", "k", "float32", [2], 8, "d" * 64)
    a = hasher.item_hash("image", {"pixel_values": pv, "image_grid_thw": grid, "r": ref}, "salt")
    wire: dict[str, Any] = {"pixel_values": _wire(pv), "image_grid_thw": _wire(grid), "r": ref}
    b = hasher.item_hash("image", wire, "salt")
    assert a == b


def test_wire_tensors_check_their_sizes_as_torchs_decoder_does() -> None:
    w = WireTensor.from_array(np.arange(6, dtype=np.int64).reshape(2, 3))
    with pytest.raises(CodecError, match="size mismatch"):
        WireTensor.from_bytes("float32", [2, 2], b"\0" * 12)
    with pytest.raises(CodecError, match="unknown dtype 'complex64'"):
        WireTensor.from_bytes("complex64", [1], b"\0" * 8)
    assert tensor_ops.int_rows(w, 3) == [[0, 1, 2], [3, 4, 5]]


# ---------------------------------------------------------------------------------------------
# the validator and the fan-out, fed the same event in both forms


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(load_render_info("tiny"), max_image_pixels=4096 * 4096)


def _render(renderer: Renderer) -> RenderEvent:
    return renderer.render(
        f"wire-{uuid.uuid4().hex[:8]}",
        prompt="<image> and <image>",
        images=[synthetic_image(112, 84, seed=1), synthetic_image(84, 56, seed=2)],
    )


def _both(ev: RenderEvent) -> tuple[RenderEvent, RenderEvent]:
    """The event as a torch process and as the router decode it off the wire."""
    value = get_codec().encode(ev)
    return get_codec().decode(value, RenderEvent), wire_codec().decode(value, RenderEvent)


def _item(ev: RenderEvent, i: int = 0) -> dict[str, Any]:
    return ev.features.kwargs_data["image"][i]  # type: ignore[index,return-value]


def _breaks(ev: RenderEvent) -> dict[str, RenderEvent]:
    def edit(change: Any) -> RenderEvent:
        bad = get_codec().decode(get_codec().encode(ev), RenderEvent)
        change(bad)
        return bad

    def nan(e: RenderEvent) -> None:
        pv = _item(e)["pixel_values"].clone()
        pv[0, 0] = float("nan")
        _item(e)["pixel_values"] = pv

    def meta_grid(e: RenderEvent) -> None:
        e.features.mm_metadata = {"image": [{"image_grid_thw": torch.tensor([[1, 2, 8]])}, None]}

    return {
        "nonfinite": edit(nan),
        "float-grid": edit(lambda e: _item(e).update(image_grid_thw=torch.ones(1, 3))),
        "bool-grid": edit(lambda e: _item(e).update(image_grid_thw=torch.ones(1, 3) > 0)),
        "odd-grid": edit(lambda e: _item(e, 1).update(image_grid_thw=torch.tensor([[1, 3, 4]]))),
        "rows": edit(lambda e: _item(e).update(pixel_values=_item(e)["pixel_values"][1:])),
        "agreement": edit(meta_grid),
        "dtype": edit(lambda e: _item(e).update(pixel_values=_item(e)["pixel_values"].double())),
    }


def _verdict(ev: RenderEvent, config: ValidationConfig) -> tuple[Any, ...] | None:
    try:
        validate_render_event(ev, config)
    except ValidationError as e:
        return (e.rule, e.modality, e.item, e.field, str(e))
    return None


def test_the_validator_judges_both_forms_alike(renderer: Renderer) -> None:
    config = ValidationConfig(allowed_dtypes=frozenset(DTYPES) - {"float64"})
    ok_torch, ok_wire = _both(_render(renderer))
    assert _verdict(ok_torch, config) is None and _verdict(ok_wire, config) is None
    for name, bad in _breaks(ok_torch).items():
        as_torch, as_wire = _both(bad)
        verdict = _verdict(as_torch, config)
        assert verdict is not None, name
        assert _verdict(as_wire, config) == verdict, name


async def test_the_fanout_sends_the_same_events_for_both_forms(renderer: Renderer) -> None:
    """bf16 transport and claim checks: the same encode and prefill events (bytes), and the
    same claim-checked bytes in the store, whether the tensors were torch's or wire tensors,
    and whether the model came as its RenderInfo or as its RenderKeys."""
    info = renderer.info
    keys = RenderKeys.from_json(render_keys_of(info).to_json())
    settings = Settings(
        ec_secret=SecretStr("wire-secret"), pixel_dtype="bf16", inline_limit_bytes=1024
    )
    as_torch, as_wire = _both(_render(renderer))
    plans = []
    url = f"local://wire-{uuid.uuid4().hex[:8]}"
    for ev, model in ((as_torch, info), (as_wire, keys)):
        store = LocalStore(url)
        plan = await FanOut(settings, store, model).plan(ev)
        claims = {
            v.key: await store.get_bytes(v.key)
            for enc in plan.encode
            for v in enc.data.values()
            if isinstance(v, TensorRef)
        }
        plans.append((plan, claims))
    (p_torch, c_torch), (p_wire, c_wire) = plans
    assert c_torch == c_wire and len(c_torch) == 2  # both images' pixels, claim-checked

    def sent(plan: Any) -> list[bytes]:
        events = [*plan.encode, plan.prefill]
        # The entries' expiry and signature, the deadline and creation time follow the clock.
        for e in events:
            entries = [
                getattr(e, "ec_transfer", None),
                *getattr(e, "ec_transfer_params", {}).values(),
            ]
            for ec in filter(None, entries):
                ec.expires_ms, ec.signature = 0, ""
        return [
            get_codec().encode(dataclasses.replace(e, deadline_ms=0, created_ms=0)) for e in events
        ]

    assert sent(p_torch) == sent(p_wire)
    # What was parked is torch's bf16 cast of the rendered pixels.
    casts = {
        bytes(tensor_ops.raw_view(_item(as_torch, i)["pixel_values"].to(torch_dtype("bfloat16"))))
        for i in (0, 1)
    }
    assert set(c_wire.values()) == casts
