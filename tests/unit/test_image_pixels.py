"""``media.image_pixels.ImagePixels``: the processor's ``pixel_values`` by a table, bit for bit,
or not at all."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from media.image_pixels import ImagePixels
from producers.render import Renderer
from runtime.model import load_render_info, tiny_image_processor

FAMILIES = ("qwen2_vl", "qwen3_vl")


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8))


def _processor_out(processor: Any, image: Image.Image) -> tuple[torch.Tensor, list[int]]:
    out = processor(images=[image], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"].reshape(3).tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def processor(request: pytest.FixtureRequest) -> Qwen2VLImageProcessorPil:
    return tiny_image_processor(request.param)


@pytest.fixture(scope="module")
def pixels(processor: Qwen2VLImageProcessorPil) -> ImagePixels:
    made = ImagePixels.for_processor(processor)
    assert made is not None, "the table path refused the tiny family's own processor"
    return made


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    width=st.integers(1, 700),
    height=st.integers(1, 700),
    seed=st.integers(0, 2**16),
)
def test_pixel_values_equal_the_processors_bit_for_bit(
    processor: Qwen2VLImageProcessorPil, pixels: ImagePixels, width: int, height: int, seed: int
) -> None:
    image = _image(width, height, seed)
    if max(width, height) / min(width, height) > 200:
        with pytest.raises(ValueError, match="aspect ratio"):
            pixels(image)
        return
    want, want_grid = _processor_out(processor, image)
    got, grid = pixels(image)
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, want)
    assert grid.dtype == torch.int64 and grid.tolist() == want_grid


def test_a_production_sized_processor_agrees_on_a_large_photo() -> None:
    # Qwen2-VL's shipped defaults: 56*56 .. 28*28*1280 pixels, 14-pixel patches.
    processor = Qwen2VLImageProcessorPil()
    pixels = ImagePixels.for_processor(processor)
    assert pixels is not None
    image = _image(1920, 1080, seed=7)
    want, want_grid = _processor_out(processor, image)
    got, grid = pixels(image)
    assert torch.equal(got, want) and grid.tolist() == want_grid


def test_an_aspect_ratio_over_200_is_the_processors_refusal(pixels: ImagePixels) -> None:
    with pytest.raises(ValueError, match="absolute aspect ratio must be smaller than 200"):
        pixels(_image(1, 201, seed=0))


def test_only_rgb_images_take_the_table_path(pixels: ImagePixels) -> None:
    with pytest.raises(ValueError, match="RGB"):
        pixels(_image(64, 64, seed=0).convert("L"))


@pytest.mark.parametrize("step", ["do_rescale", "do_normalize", "do_resize"])
def test_a_processor_that_skips_a_step_gets_no_table(step: str) -> None:
    processor = tiny_image_processor()
    setattr(processor, step, False)
    assert ImagePixels.for_processor(processor) is None


def test_a_processor_whose_numbers_differ_gets_no_table() -> None:
    class Shifted(Qwen2VLImageProcessorPil):
        """A release whose patch layout moved: the table path would serve other numbers."""

        def patchify(self, image: np.ndarray, *args: Any, **kwargs: Any) -> Any:
            rows, grid_h, grid_w = super().patchify(image, *args, **kwargs)
            return rows[::-1].copy(), grid_h, grid_w

    base = tiny_image_processor()
    assert ImagePixels.for_processor(Shifted(**base.to_dict())) is None


def test_the_renderer_serves_the_processors_numbers_either_way() -> None:
    info = load_render_info("tiny")
    renderer = Renderer(info, max_image_pixels=4096 * 4096)
    assert renderer.pixels is not None
    image = _image(300, 200, seed=3)
    want, want_grid = _processor_out(info.image_processor, image)
    for img in (image, image.convert("RGBA").convert("RGB")):
        got, grid = renderer.process_image(img)
        assert torch.equal(got, want) and grid.tolist() == want_grid
    renderer.pixels = None  # the processor itself
    got, grid = renderer.process_image(image)
    assert torch.equal(got, want) and grid.tolist() == want_grid


def test_a_processor_the_table_cannot_be_built_from_gets_none() -> None:
    class Broken(Qwen2VLImageProcessorPil):
        def normalize(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a release whose normalize takes other arguments")

    assert ImagePixels.for_processor(Broken(**tiny_image_processor().to_dict())) is None
