"""Parity oracle: the disaggregated path (encode -> store-shaped embeddings -> prefill/decode)
produces exactly the tokens of ``model.generate`` on raw pixels, on the tiny model (CPU, fp32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpu_workers.compute import ComputeError, ItemEmbedding, encode_images, prefill
from gpu_workers.engine import decode_alone, generate_from_embeddings
from gpu_workers.oracle import generate_monolithic, monolithic_inputs
from producers.render import Renderer
from runtime.model import ModelBundle, load_model
from schemas.types import RenderEvent, SamplingParams

MAX_TOKENS = 10
REPO = Path(__file__).resolve().parents[2]


def rand_image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_model("tiny", device="cpu")


@pytest.fixture(scope="module")
def renderer(bundle: ModelBundle) -> Renderer:
    return Renderer(bundle, max_image_pixels=4096 * 4096)


def encode_event(
    bundle: ModelBundle, event: RenderEvent, groups: list[list[int]] | None = None
) -> list[torch.Tensor]:
    """Embeddings for every image item, encoded in the given groups of item indices."""
    data = event.features.kwargs_data["image"]
    n = len(data)
    groups = groups if groups is not None else [list(range(n))]
    out: dict[int, torch.Tensor] = {}
    for g in groups:
        embs = encode_images(
            bundle, [(data[i]["pixel_values"], data[i]["image_grid_thw"]) for i in g]
        )
        out.update(zip(g, embs, strict=True))
    return [out[i] for i in range(n)]


def items_of(event: RenderEvent, embeds: list[torch.Tensor]) -> list[ItemEmbedding]:
    """What a prefill worker builds: placeholders + metadata grid + fetched embeddings."""
    f = event.features
    meta = f.mm_metadata["image"]
    return [
        ItemEmbedding("image", r.offset, r.length, e, meta[i]["image_grid_thw"])
        for i, (r, e) in enumerate(zip(f.mm_placeholders["image"], embeds, strict=True))
    ]


def oracle(bundle: ModelBundle, event: RenderEvent, **kw) -> list[int]:
    ids, pv, grid = monolithic_inputs(event)
    return generate_monolithic(bundle, ids, pv, grid, MAX_TOKENS, **kw)


CASES = {
    "single": ("Describe <image> please.", [(100, 150, 1)]),
    "two_sizes": ("First <image> then <image> compare them.", [(100, 150, 1), (224, 224, 2)]),
    "repeated": ("A <image> and again <image>.", [(90, 90, 3), (90, 90, 3)]),
    "non_square": ("Tall: <image> ok", [(300, 60, 4)]),
    "at_start": ("<image> what is this?", [(112, 84, 5)]),
    "at_end": ("what is this? <image>", [(84, 112, 6)]),
    "start_and_end": ("<image> versus <image>", [(56, 200, 7), (150, 100, 8)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_disaggregated_matches_generate(bundle: ModelBundle, renderer: Renderer, case: str) -> None:
    prompt, specs = CASES[case]
    event = renderer.render(case, prompt=prompt, images=[rand_image(*s) for s in specs])
    want = oracle(bundle, event, ignore_eos=True)
    assert len(want) == MAX_TOKENS
    got = generate_from_embeddings(
        bundle, event.token_ids, items_of(event, encode_event(bundle, event)), MAX_TOKENS,
        ignore_eos=True,
    )  # fmt: skip
    assert got == want


def test_separate_calls_and_foreign_batches_match(bundle: ModelBundle, renderer: Renderer) -> None:
    """Images encoded one per call, or batched with unrelated images, give the same tokens."""
    imgs = [rand_image(100, 150, 11), rand_image(224, 168, 12)]
    event = renderer.render("sep", prompt="x <image> y <image> z", images=imgs)
    want = oracle(bundle, event, ignore_eos=True)

    separate = encode_event(bundle, event, groups=[[0], [1]])
    batched = encode_event(bundle, event, groups=[[0, 1]])
    # Batch the request's images between two foreign images of other sizes, as the encode
    # worker does across events, and take this request's rows back out.
    others = renderer.render("other", prompt="<image><image>", images=[
        rand_image(56, 56, 13), rand_image(200, 120, 14),
    ])  # fmt: skip
    od, ed = others.features.kwargs_data["image"], event.features.kwargs_data["image"]
    mixed_in = [od[0], ed[1], od[1], ed[0]]
    mixed = encode_images(bundle, [(d["pixel_values"], d["image_grid_thw"]) for d in mixed_in])
    foreign = [mixed[3], mixed[1]]

    for embeds in (separate, batched, foreign):
        for e, ref in zip(embeds, separate, strict=True):
            torch.testing.assert_close(e, ref, rtol=1e-5, atol=1e-5)
        items = items_of(event, embeds)
        assert (
            generate_from_embeddings(bundle, event.token_ids, items, MAX_TOKENS, ignore_eos=True)
            == want
        )


def test_negative_controls_show_the_oracle_can_fail(
    bundle: ModelBundle, renderer: Renderer
) -> None:
    """A wrong rope delta or swapped embeddings change the tokens, so parity is meaningful."""
    imgs = [rand_image(100, 150, 21), rand_image(224, 224, 22)]
    event = renderer.render("neg", prompt="a <image> b <image> c", images=imgs)
    want = oracle(bundle, event, ignore_eos=True)
    embeds = encode_event(bundle, event)

    state = prefill(bundle, event.token_ids, items_of(event, embeds))
    plain = (state.prompt_len,) * 3
    assert state.next_position != plain  # the images moved the positions
    state.next_position = plain
    _, seq = decode_alone(
        bundle, lambda: state, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    assert seq.tokens != want

    # Same-size images so the swap is shape-valid; different pixels.
    ev2 = renderer.render(
        "neg2",
        prompt="a <image> b <image> c",
        images=[rand_image(90, 90, 23), rand_image(90, 90, 24)],
    )
    want2 = oracle(bundle, ev2, ignore_eos=True)
    e2 = encode_event(bundle, ev2)
    swapped = items_of(ev2, [e2[1], e2[0]])
    assert (
        generate_from_embeddings(bundle, ev2.token_ids, swapped, MAX_TOKENS, ignore_eos=True)
        != want2
    )


def test_stop_tokens_and_eos_match(bundle: ModelBundle, renderer: Renderer) -> None:
    event = renderer.render("stop", prompt="stop at <image> here", images=[rand_image(80, 120, 31)])
    items = items_of(event, encode_event(bundle, event))
    full = oracle(bundle, event, ignore_eos=True)
    stop = full[3]
    k = full.index(stop)
    for kw in ({"stop_token_ids": [stop], "ignore_eos": True}, {"stop_token_ids": [stop]}):
        got = generate_from_embeddings(bundle, event.token_ids, items, MAX_TOKENS, **kw)
        assert got == oracle(bundle, event, **kw)
        assert got[-1] == stop and len(got) <= k + 1
    assert generate_from_embeddings(bundle, event.token_ids, items, 0) == []


def test_rejects_inconsistent_items(bundle: ModelBundle, renderer: Renderer) -> None:
    event = renderer.render("bad", prompt="<image> x <image>", images=[
        rand_image(56, 56, 41), rand_image(56, 56, 42),
    ])  # fmt: skip
    items = items_of(event, encode_event(bundle, event))
    bad_len = [ItemEmbedding("image", items[0].offset, items[0].length - 1, items[0].embeds[:-1],
                             items[0].grid_thw), items[1]]  # fmt: skip
    with pytest.raises(ComputeError, match="implied by grid"):
        generate_from_embeddings(bundle, event.token_ids, bad_len, 2)
    shifted = [ItemEmbedding("image", items[0].offset - 1, items[0].length, items[0].embeds,
                             items[0].grid_thw), items[1]]  # fmt: skip
    with pytest.raises(ComputeError, match="pad tokens"):
        generate_from_embeddings(bundle, event.token_ids, shifted, 2)
    wrong_dim = [ItemEmbedding("image", it.offset, it.length, it.embeds[:, :8], it.grid_thw)
                 for it in items]  # fmt: skip
    with pytest.raises(ComputeError, match="embeddings shape"):
        generate_from_embeddings(bundle, event.token_ids, wrong_dim, 2)
    with pytest.raises(ComputeError, match="does not match grid"):
        pv = event.features.kwargs_data["image"][0]["pixel_values"]
        encode_images(bundle, [(pv[:-1], items[0].grid_thw)])


_PROBE = r"""
import json, sys
import numpy as np, torch
from PIL import Image
from runtime.model import load_model
from gpu_workers.compute import encode_images, prefill, ItemEmbedding
from producers.render import Renderer
b = load_model("tiny", device="cpu")
img = Image.fromarray((np.random.RandomState(5).rand(100, 150, 3) * 255).astype("uint8"))
ev = Renderer(b, max_image_pixels=10**8).render("p", prompt="probe <image> end", images=[img])
d = ev.features.kwargs_data["image"][0]
e = encode_images(b, [(d["pixel_values"], d["image_grid_thw"])])[0]
r = ev.features.mm_placeholders["image"][0]
st = prefill(b, ev.token_ids, [ItemEmbedding("image", r.offset, r.length, e, d["image_grid_thw"])])
json.dump({"fp": b.fingerprint, "hash": ev.features.mm_hashes["image"][0],
           "logits": st.logits[:16].tolist()}, sys.stdout)
"""


def test_deterministic_across_processes(bundle: ModelBundle) -> None:
    """Same fingerprint, same mm_hash and same logits in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=REPO,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    other = json.loads(proc.stdout)
    ns: dict = {}
    # Run the same probe here, against this process's independently built model.
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(_PROBE, ns)
    mine = json.loads(buf.getvalue())
    assert mine["fp"] == other["fp"] == bundle.fingerprint
    assert mine["hash"] == other["hash"]
    assert mine["logits"] == other["logits"]


def test_fingerprint_tracks_weights(bundle: ModelBundle) -> None:
    from runtime.model import state_dict_fingerprint

    other = load_model("tiny", device="cpu")
    assert other.fingerprint == bundle.fingerprint
    with torch.no_grad():
        other.model.lm_head.weight[0, 0] += 1.0
    assert state_dict_fingerprint(other.model, other.config) != bundle.fingerprint


def test_local_checkpoint_round_trip(bundle: ModelBundle, renderer: Renderer, tmp_path) -> None:
    """``load_model(PATH)`` loads a saved checkpoint offline and generates the same tokens."""
    from runtime.model import ModelLoadError, load_render_info

    bundle.model.save_pretrained(tmp_path)
    bundle.tokenizer.save_pretrained(tmp_path)
    bundle.image_processor.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    info = load_render_info(str(tmp_path))
    assert loaded.fingerprint == info.fingerprint != bundle.fingerprint  # file-based identity
    assert (loaded.image_token_id, loaded.eos_token_id) == (
        bundle.image_token_id,
        bundle.eos_token_id,
    )

    img = rand_image(100, 150, 51)
    event = renderer.render("ck", prompt="saved <image> model", images=[img])
    event2 = Renderer(info, max_image_pixels=10**8).render(
        "ck", prompt="saved <image> model", images=[img]
    )
    assert event2.token_ids == event.token_ids
    items = items_of(event, encode_event(loaded, event))
    got = generate_from_embeddings(loaded, event.token_ids, items, MAX_TOKENS, ignore_eos=True)
    assert got == oracle(bundle, event, ignore_eos=True)

    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "missing"), device="cpu")
