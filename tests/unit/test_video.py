"""Video rendering: decoding limits (checked before decoding), frame sampling, the Qwen2-VL video
patch rules against independent references, prompt layout mixed with images, the codec round
trip of ``pixel_values_videos``, the fan-out split, and parity with ``model.generate``."""

from __future__ import annotations

import dataclasses
import io
import math
import uuid
from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image

from gpu_workers.compute import encode_items, item_embedding
from gpu_workers.engine import generate_from_embeddings
from gpu_workers.oracle import generate_monolithic, monolithic_inputs, monolithic_video_inputs
from media.sample_images import png_bytes, synthetic_image
from media.sample_videos import (
    encode_animation,
    encode_video,
    synthetic_frames,
)
from media.video import (
    VideoError,
    VideoFrames,
    VideoLimits,
    load_video,
    sample_indices,
)
from media.video_file import VideoHeader, check_header
from media.video_processing import config_from_image_processor, process_video
from producers.fanout import FanOut
from producers.render import Renderer
from runtime.model import load_model, load_render_info
from runtime.settings import Settings
from runtime.stores.local import LocalStore
from schemas.codec import get_codec
from schemas.errors import ValidationError
from schemas.types import RenderEvent
from schemas.validator import ValidationConfig, validate_prefill_event, validate_render_event

LIMITS = VideoLimits()


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(load_render_info("tiny"), max_image_pixels=4096 * 4096)


@pytest.fixture(scope="module")
def frames() -> list[Image.Image]:
    return synthetic_frames(12, 96, 64, seed=1)


def rule_of(fn, *args) -> tuple[str, str | None, int | None]:  # type: ignore[no-untyped-def]
    with pytest.raises(VideoError) as err:
        fn(*args)
    return err.value.rule, err.value.modality, err.value.item


# ------------------------------------------------------------------ limits and bad files


def test_ten_hour_header_is_refused_before_decoding(renderer: Renderer) -> None:
    """Two frames ten hours apart: the header says 36001 s; refused naming rule and item."""
    ten_hours = encode_video(
        synthetic_frames(2, 64, 64), fps=1, codec="mpeg4", pts=[0, 36000], time_base=Fraction(1)
    )
    assert len(ten_hours) < 16 * 1024
    with pytest.raises(VideoError) as err:
        renderer.render("r", prompt="<image> and <video>", images=[synthetic_image(56, 56)],
                        videos=[ten_hours])  # fmt: skip
    e = err.value
    assert (e.rule, e.modality, e.item) == ("render.video_too_long", "video", 0)
    assert "36001" in str(e) and "600" in str(e)


def test_header_checks_are_pure_and_run_first() -> None:
    """The header alone decides: no decoder is involved in these refusals."""
    ok = VideoHeader("mov,mp4,m4a,3gp,3g2,mj2", "h264", 1920, 1080, 10.0, 300, 30.0)
    assert check_header(ok, LIMITS) == 300
    bad = {
        "render.video_too_long": dataclasses.replace(ok, duration_s=36000.0),
        "render.video_too_large": dataclasses.replace(ok, width=16000, height=16000),
        "render.video_too_many_frames": dataclasses.replace(ok, frames=10**7),
        "render.video_codec": dataclasses.replace(ok, codec="prores"),
    }
    for rule, header in bad.items():
        assert rule_of(check_header, header, LIMITS, 3) == (rule, "video", 3)
    # No frame count in the header (WebM): estimated from duration x rate and still bounded.
    no_count = dataclasses.replace(ok, frames=None, duration_s=599.0, fps=240.0)
    assert rule_of(check_header, no_count, LIMITS) == ("render.video_too_many_frames", "video", 0)


def _zero_frame_file(container: str, codec: str) -> bytes:
    import av

    buf = io.BytesIO()
    out = av.open(buf, "w", format=container)
    s = out.add_stream(codec, rate=10)
    s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
    out.start_encoding()
    out.close()
    return buf.getvalue()


@pytest.mark.parametrize(("container", "codec"), [("mp4", "mpeg4"), ("webm", "libvpx-vp9")])
def test_zero_frame_file_is_refused(renderer: Renderer, container: str, codec: str) -> None:
    data = _zero_frame_file(container, codec)
    assert data  # a real container with a header, just no frames
    with pytest.raises(VideoError) as err:
        renderer.render("r", prompt="<video> <video>", videos=[synthetic_frames(2, 56, 56), data])
    assert (err.value.rule, err.value.item) == ("render.video_empty", 1)


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x00\x00\x18ftypmp42" + b"\x13" * 500,  # MP4 magic, then garbage
        bytes(range(256)) * 8,
        b"%PDF-1.7 not a video",
    ],
    ids=["mp4-garbage", "random", "pdf"],
)
def test_corrupt_file_is_refused(renderer: Renderer, data: bytes) -> None:
    with pytest.raises(VideoError) as err:
        renderer.render("r", prompt="<video>", videos=[data])
    assert (err.value.rule, err.value.modality, err.value.item) == (
        "render.video_unreadable",
        "video",
        0,
    )
    assert "MP4" in str(err.value)


def test_truncated_file_is_refused(renderer: Renderer, frames: list[Image.Image]) -> None:
    mp4 = encode_video(frames, fps=6)
    with pytest.raises(VideoError) as err:
        renderer.render("r", prompt="<video>", videos=[mp4[: len(mp4) // 2]])
    assert err.value.rule == "render.video_unreadable"


def test_other_containers_and_codecs_never_reach_a_decoder(frames: list[Image.Image]) -> None:
    avi = encode_video(frames[:4], fps=6, container="avi", codec="mpeg4")
    assert rule_of(load_video, avi, LIMITS) == ("render.video_unreadable", "video", 0)
    # FFV1 in Matroska: an accepted container, a decoder outside the list.
    ffv1 = encode_video(frames[:4], fps=6, container="matroska", codec="ffv1")
    assert rule_of(load_video, ffv1, LIMITS) == ("render.video_codec", "video", 0)


def test_frame_size_and_file_size_limits(frames: list[Image.Image]) -> None:
    small = dataclasses.replace(LIMITS, max_frame_pixels=32 * 32)
    mp4 = encode_video(frames, fps=6)
    for src in (mp4, encode_animation(frames), frames):
        assert rule_of(load_video, src, small)[0] == "render.video_too_large"
    with pytest.raises(VideoError, match="bytes; the limit is 100"):
        load_video(mp4, LIMITS, max_bytes=100)


def test_frame_list_errors_name_the_frame() -> None:
    odd = [*synthetic_frames(3, 64, 64), synthetic_image(32, 32)]
    with pytest.raises(VideoError, match="frame 3 is 32x32"):
        load_video(odd, LIMITS)
    with pytest.raises(VideoError, match="frame 1: arrays must be"):
        load_video([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 8, 3), np.float32)], LIMITS)
    assert rule_of(load_video, [], LIMITS)[0] == "render.video_empty"
    assert rule_of(load_video, "clip.mp4", LIMITS)[0] == "render.video_type"
    long = VideoFrames(synthetic_frames(4, 16, 16), fps=0.001)  # 4 frames = 4000 s
    assert rule_of(load_video, long, LIMITS)[0] == "render.video_too_long"


def test_oversize_encoder_input_is_refused_before_resizing(frames: list[Image.Image]) -> None:
    r = Renderer(load_render_info("tiny"), max_image_pixels=4096 * 4096, max_tensor_bytes=10_000)
    with pytest.raises(VideoError, match=r"pixel_values_videos of .* bytes; the limit is 10000"):
        r.render("r", prompt="<video>", videos=[frames])


# ------------------------------------------------------------------ sampling


def reference_indices(total: int, native_fps: float, fps: float, max_frames: int) -> list[int]:
    """The transformers ``Qwen2VLVideoProcessor.sample_frames`` arithmetic, in torch."""
    tps, min_frames = 2, 4
    max_frames = math.floor(min(max_frames, total) / tps) * tps
    num = total / native_fps * fps
    num = min(max(num, min_frames), max_frames, total)
    num = math.floor(num / tps) * tps
    return torch.arange(0, total, total / num).int().tolist()


@pytest.mark.parametrize(
    ("total", "native", "fps", "cap"),
    [
        (300, 30.0, 2.0, 64),
        (12, 6.0, 2.0, 64),
        (7, 25.0, 2.0, 64),
        (1000, 24.0, 2.0, 16),
        (90, 30.0, 5.0, 768),
        (5, 1.0, 2.0, 64),
    ],
)
def test_sampling_follows_the_processor(total: int, native: float, fps: float, cap: int) -> None:
    limits = dataclasses.replace(LIMITS, fps=fps, max_frames=cap)
    assert sample_indices(total, native, limits) == reference_indices(total, native, fps, cap)


def test_clip_too_short_for_a_temporal_patch_keeps_its_frame() -> None:
    assert sample_indices(1, 10.0, LIMITS) == [0]


@pytest.mark.parametrize("kind", ["mp4", "webm", "mkv", "gif", "webp", "frames"])
def test_every_input_kind_samples_the_same_frames(kind: str, frames: list[Image.Image]) -> None:
    """12 frames at 6 fps (2 s): every kind yields frames 0, 3, 6, 9 at 2 fps."""
    src: object = {
        "mp4": lambda: encode_video(frames, fps=6),
        "webm": lambda: encode_video(frames, fps=6, container="webm", codec="libvpx-vp9"),
        "mkv": lambda: encode_video(frames, fps=6, container="matroska"),
        "gif": lambda: encode_animation(frames, "GIF", duration_ms=1000 // 6),
        "webp": lambda: encode_animation(frames, "WEBP", duration_ms=1000 // 6),
        "frames": lambda: VideoFrames(frames, fps=6),
    }[kind]()
    clip = load_video(src, LIMITS)  # type: ignore[arg-type]
    assert len(clip.frames) == 4 and clip.source_frames == 12
    assert clip.fps == pytest.approx(2.0, rel=0.05)
    for got, k in zip(clip.frames, (0, 3, 6, 9), strict=True):
        assert got.size == (96, 64) and got.mode == "RGB"
        # Lossy codecs: close to the source frame, and closer to it than to its neighbours.
        err = np.abs(np.asarray(got, np.float32) - np.asarray(frames[k], np.float32)).mean()
        assert err < 12, (kind, k, err)


# ------------------------------------------------------------------ processing


def test_still_frames_equal_the_image_processor() -> None:
    """Two copies of one frame are exactly what the image processor makes of that image (it
    repeats a still image over the temporal patch)."""
    proc = load_render_info("tiny").image_processor
    cfg = config_from_image_processor(proc)
    for size in ((100, 150), (30, 40), (500, 300)):
        img = synthetic_image(*size, seed=3)
        pv, grid = process_video([img, img], cfg)
        ref = proc(images=[img], return_tensors="pt")
        assert torch.equal(pv, ref["pixel_values"])
        assert grid.tolist() == ref["image_grid_thw"][0].tolist()


def reference_patches(frames: list[Image.Image], cfg) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Patch rows by explicit loops, from the processor's documented layout: rows ordered
    (t, h-block, w-block, h-in-block, w-in-block); each row C x T x P x P."""
    proc = load_render_info("tiny").image_processor
    # Each frame normalised by the image processor itself (still-frame pair, first temporal slot).
    norm = []
    for f in frames:
        pv = proc(images=[f], return_tensors="np")
        gh, gw = (int(x) for x in pv["image_grid_thw"][0][1:])
        norm.append((pv["pixel_values"], gh, gw))
    while len(norm) % cfg.temporal_patch_size:
        norm.append(norm[-1])
    p, m, tps = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = norm[0][1], norm[0][2]
    rows = []
    for t in range(len(norm) // tps):
        for hb in range(gh // m):
            for wb in range(gw // m):
                for hi in range(m):
                    for wi in range(m):
                        # an image row is C x T x P x P with T copies; take slot 0 of each frame
                        r = (hb * (gw // m) + wb) * m * m + hi * m + wi
                        per_frame = [
                            norm[t * tps + k][0][r].reshape(3, tps, p, p)[:, 0] for k in range(tps)
                        ]
                        rows.append(np.stack(per_frame, axis=1).reshape(-1))
    return np.stack(rows)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_distinct_frames_match_a_loop_reference(n: int) -> None:
    cfg = config_from_image_processor(load_render_info("tiny").image_processor)
    fr = synthetic_frames(n, 90, 70, seed=n)
    pv, grid = process_video(fr, cfg)
    ref = reference_patches(fr, cfg)
    assert grid.tolist() == [-(-n // 2), 4, 6]  # 70x90 -> 56x84
    assert pv.shape == ref.shape and np.array_equal(pv.numpy(), ref)


# ------------------------------------------------------------------ prompt layout


def test_layout_mixed_with_images_in_any_order(renderer: Renderer) -> None:
    info = renderer.info
    vids = [synthetic_frames(4, 84, 56, seed=5), synthetic_frames(2, 56, 56, seed=6)]
    imgs = [synthetic_image(56, 84, seed=7)]
    ev = renderer.render("r", prompt="<video> x <image> y <video> z", images=imgs, videos=vids)
    f = ev.features
    assert list(f.mm_hashes) == ["video", "image"]
    v0, v1 = f.mm_placeholders["video"]
    (i0,) = f.mm_placeholders["image"]
    assert v0.offset < i0.offset < v1.offset
    for k, ph in enumerate((v0, v1)):
        data = f.kwargs_data["video"][k]  # type: ignore[index]
        t, h, w = data["video_grid_thw"].tolist()  # type: ignore[union-attr]
        assert ph.length == t * h * w // 4
        assert data["pixel_values_videos"].shape == (t * h * w, 1176)  # type: ignore[union-attr]
        assert ev.token_ids[ph.offset - 1] == info.vision_start_id
        assert ev.token_ids[ph.offset : ph.offset + ph.length] == [info.video_token_id] * ph.length
        assert ev.token_ids[ph.offset + ph.length] == info.vision_end_id
        assert set(f.mm_metadata["video"][k]) == {"video_grid_thw"}  # type: ignore[index,arg-type]
    assert f.kwargs_data["video"][0]["video_grid_thw"].tolist() == [2, 4, 6]  # type: ignore[index,union-attr]

    # The chat template's block and token ids give the same event.
    block = "<|vision_start|><|video_pad|><|vision_end|>"
    ev2 = renderer.render("r", prompt=f"{block} x <image> y <video> z", images=imgs, videos=vids)
    assert ev2.token_ids == ev.token_ids and ev2.features.mm_hashes == f.mm_hashes
    ids = [*b"a", info.video_token_id, *b"b", info.vision_start_id, info.image_token_id,
           info.vision_end_id, info.video_token_id]  # fmt: skip
    ev3 = renderer.render("r", token_ids=ids, images=imgs, videos=vids)
    assert ev3.features.mm_hashes == f.mm_hashes


def test_marker_counts_are_checked(renderer: Renderer) -> None:
    marks = r"marks 1 video \(1 '<video>'\) but 2 videos were given"
    with pytest.raises(ValidationError, match=marks):
        renderer.render("r", prompt="<video>", videos=[synthetic_frames(2, 56, 56)] * 2)
    ids = [1, renderer.info.video_token_id]
    with pytest.raises(ValidationError, match="1 video pad tokens but 0 videos"):
        renderer.render("r", token_ids=ids)


def test_qwen2_5_vl_carries_timing() -> None:
    r = Renderer(load_render_info("tiny-qwen2.5-vl"), max_image_pixels=4096 * 4096)
    ev = r.render("r", prompt="<video>", videos=[VideoFrames(synthetic_frames(4, 56, 56), 4.0)])
    meta = ev.features.mm_metadata["video"][0]  # type: ignore[index]
    assert set(meta) == {"video_grid_thw", "second_per_grid_ts"}  # type: ignore[arg-type]
    # all 4 frames kept (min_frames), so 4 fps sampled: temporal patch 2 / 4 fps = 0.5 s
    assert meta["second_per_grid_ts"].tolist() == [0.5]  # type: ignore[index,union-attr]


def _qwen3_processor_text(grid: torch.Tensor, fps: float, indices: list[int]) -> str:
    """What transformers' Qwen3-VL processor writes for one video: its own
    ``replace_video_token`` on a bare instance (its video processor needs torchvision, which
    is not installed here; the method reads only the two sizes given)."""
    from types import SimpleNamespace

    from transformers import Qwen3VLProcessor

    proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    proc.video_processor = SimpleNamespace(temporal_patch_size=2, merge_size=2)
    proc.video_token = "<|video_pad|>"
    proc.vision_start_token = "<|vision_start|>"
    proc.vision_end_token = "<|vision_end|>"
    meta = SimpleNamespace(fps=fps, frames_indices=list(indices))
    inputs = {"video_grid_thw": grid.reshape(1, 3), "video_metadata": [meta]}
    return str(proc.replace_video_token(inputs, 0))


@pytest.mark.parametrize("spec", ["tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def test_qwen3_vl_video_is_laid_out_frame_by_frame_with_its_timestamps(spec: str) -> None:
    """Each temporal row after its timestamp, exactly as Qwen3-VL's processor writes the video
    (from the same frame indices and rate); the item's placeholder spans it all with is_embed
    marking the pads (vLLM's layout), and the grid still counts the embeddings."""
    info = load_render_info(spec)
    r = Renderer(info, max_image_pixels=4096 * 4096)
    video = VideoFrames(synthetic_frames(12, 64, 64, seed=5), 6.0)
    ev = r.render("q3", prompt="Watch <video> now", videos=[video])
    (ph,) = ev.features.mm_placeholders["video"]
    grid = ev.features.mm_metadata["video"][0]["video_grid_thw"]  # type: ignore[index]
    t, h, w = grid.tolist()
    assert t >= 2
    keep = sample_indices(12, 6.0, r.videos.limits)
    want = info.tokenizer.encode(_qwen3_processor_text(grid, 6.0, keep), add_special_tokens=False)
    span = ev.token_ids[ph.offset : ph.offset + ph.length]
    assert span == want
    assert "<0." in info.tokenizer.decode(span[:8])
    assert ph.is_embed == [tok == info.video_token_id for tok in span]
    assert sum(ph.is_embed) == t * h * w // 4
    # Text on both sides is untouched; the vLLM-shaped placeholder passes the gate.
    assert info.tokenizer.decode(ev.token_ids[: ph.offset]) == "Watch "
    assert info.tokenizer.decode(ev.token_ids[ph.offset + ph.length :]) == " now"
    validate_render_event(ev)


# ------------------------------------------------------------------ wire and fan-out


def _video_event(renderer: Renderer) -> RenderEvent:
    return renderer.render(
        f"v-{uuid.uuid4().hex[:8]}",
        prompt="see <image> and <video>",
        images=[synthetic_image(56, 56, seed=2)],
        videos=[encode_video(synthetic_frames(12, 96, 64, seed=4), fps=6)],
    )


def test_codec_round_trip_of_pixel_values_videos(renderer: Renderer) -> None:
    ev = _video_event(renderer)
    codec = get_codec()
    back = codec.decode(codec.encode(ev))
    src, got = ev.features.kwargs_data["video"][0], back.features.kwargs_data["video"][0]  # type: ignore[index]
    for name in ("pixel_values_videos", "video_grid_thw"):
        a, b = src[name], got[name]  # type: ignore[index]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)  # type: ignore[union-attr]
    assert back.token_ids == ev.token_ids
    assert back.features.mm_placeholders == ev.features.mm_placeholders


async def test_fanout_prefill_event_carries_only_video_grid(renderer: Renderer) -> None:
    ev = _video_event(renderer)
    ns = f"ec-video-{uuid.uuid4().hex[:8]}"
    settings = Settings(ec_namespace=ns, ec_secret=None, inline_limit_bytes=1 << 30)
    plan = await FanOut(settings, LocalStore(f"local://{ns}"), renderer.info).plan(ev)
    pre = plan.prefill
    assert pre.features.kwargs_data is None
    meta = pre.features.mm_metadata
    assert meta is not None and set(meta["video"][0]) == {"video_grid_thw"}  # type: ignore[arg-type]
    assert set(meta["image"][0]) == {"image_grid_thw"}  # type: ignore[arg-type]
    validate_prefill_event(pre, ValidationConfig.from_settings(settings))
    encodes = {e.modality: e for e in plan.encode}
    assert set(encodes) == {"image", "video"}
    assert set(encodes["video"].data) >= {"pixel_values_videos", "video_grid_thw"}
    wire = get_codec().encode(pre)
    assert b"pixel_values" not in wire and len(wire) < 2048


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("spec", ["tiny", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def test_rendered_video_matches_generate(spec: str) -> None:
    """A rendered video + image request: disaggregated tokens == model.generate tokens."""
    bundle = load_model(spec, device="cpu")
    r = Renderer(bundle, max_image_pixels=4096 * 4096)
    ev = r.render(
        "p",
        prompt="<video> and <image> then <video>",
        images=[synthetic_image(84, 56, seed=8)],
        videos=[synthetic_frames(5, 84, 84, seed=9), encode_video(synthetic_frames(8, 56, 84))],
    )
    f = ev.features
    items = []
    for mod in ("video", "image"):
        data = f.kwargs_data[mod]  # type: ignore[index]
        enc = [(d[f"pixel_values{'_videos' if mod == 'video' else ''}"], d[f"{mod}_grid_thw"])
               for d in data]  # type: ignore[index]  # fmt: skip
        outs = encode_items(bundle, enc)  # type: ignore[arg-type]
        for ph, o, m in zip(f.mm_placeholders[mod], outs, f.mm_metadata[mod], strict=True):  # type: ignore[index]
            items.append(item_embedding(mod, ph.offset, ph.length, o, m, ph.is_embed))  # type: ignore[arg-type]
    ids, pv, grid = monolithic_inputs(ev)
    want = generate_monolithic(
        bundle, ids, pv, grid, 8, ignore_eos=True, **monolithic_video_inputs(ev)
    )
    got = generate_from_embeddings(bundle, ev.token_ids, items, 8, ignore_eos=True)
    assert got == want and len(got) == 8


# ------------------------------------------------------------------ review fixes: cost, memory,
# default sizes, bombs, offsets, rotation, transparency


def _gif_claiming(width: int, height: int, frames: int, delay_cs: int = 1) -> bytes:
    """A GIF whose screen is ``width x height`` and whose ``frames`` frames are 1x1 each: a few
    bytes a frame, but every frame composites the whole canvas."""
    out = bytearray(b"GIF89a" + width.to_bytes(2, "little") + height.to_bytes(2, "little"))
    out += bytes([0x80, 0, 0]) + bytes([0, 0, 0, 255, 255, 255])  # 2-colour global table
    for _ in range(frames):
        out += bytes([0x21, 0xF9, 4, 0]) + delay_cs.to_bytes(2, "little") + bytes([0, 0])
        out += bytes([0x2C, 0, 0, 0, 0, 1, 0, 1, 0, 0]) + bytes([2, 2, 0x44, 0x01, 0])
    return bytes(out + b"\x3b")


def test_gif_decode_cost_is_refused_from_its_headers() -> None:
    """40 frames on a 3840x2160 canvas: a 1 kB file, 40 full-canvas composites. Refused by the
    decode budget before Pillow seeks to a single frame."""
    gif = _gif_claiming(3840, 2160, 40, delay_cs=10)
    assert len(gif) < 2048
    assert rule_of(load_video, gif, LIMITS) == ("render.video_decode_budget", "video", 0)
    with pytest.raises(VideoError, match="EPD_VIDEO_MAX_DECODE_PIXELS"):
        load_video(gif, LIMITS)
    # The same structure, small: accepted, and the delays come from the block headers.
    clip = load_video(_gif_claiming(8, 8, 40, delay_cs=10), LIMITS)  # 4 s at 10 fps
    assert (clip.source_frames, len(clip.frames)) == (40, 8)


def test_gif_delays_from_block_headers_match_pillow() -> None:
    from media.animation_headers import gif_frame_delays

    frames = synthetic_frames(5, 32, 24)
    buf = io.BytesIO()
    durations = [40, 120, 0, 1000, 70]
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=durations)
    img = Image.open(io.BytesIO(buf.getvalue()))
    pillow = []
    for k in range(img.n_frames):  # type: ignore[attr-defined]
        img.seek(k)
        pillow.append(img.info.get("duration", 0))
    assert gif_frame_delays(buf.getvalue()) == pillow


def _gop_mp4(n: int, fps: int, gop: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=fps, options={"g": str(gop), "keyint_min": str(gop)})
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for f in synthetic_frames(n, 64, 48, seed=3):
            for p in s.encode(av.VideoFrame.from_image(f)):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return buf.getvalue()


def test_only_gops_holding_sampled_frames_are_decoded() -> None:
    """120 frames at 30 fps (4 s), keyframe every 5: 8 sampled frames 15 apart need 8 GOPs
    (40 frames, +1 probe), not the 106 frames up to the last sampled one; and the frames are the
    ones a full sequential decode gives at those indices."""
    import av

    from media.video import plan_video

    mp4 = _gop_mp4(120, 30, 5)
    plan = plan_video(mp4, LIMITS)
    assert plan.keep == list(range(0, 120, 15))
    assert plan.decode_frames <= 1 + 8 * 5 + 8 * 5  # each GOP, at most once more if open
    assert plan.decode_frames < max(plan.keep) + 1
    got = plan.clip().frames
    with av.open(io.BytesIO(mp4)) as c:
        ref = [f.to_image() for f in c.decode(video=0)]  # type: ignore[union-attr]
    for k, img in zip(plan.keep, got, strict=True):
        assert np.array_equal(np.asarray(img), np.asarray(ref[k])), k
    # The budget counts those frames: one fewer pixel than they cost is refused.
    tight = dataclasses.replace(LIMITS, max_decode_pixels=plan.decode_frames * 64 * 48 - 1)
    assert rule_of(load_video, mp4, tight)[0] == "render.video_decode_budget"


def test_render_time_limit_stops_decoding(renderer: Renderer) -> None:
    import asyncio
    import time

    mp4 = encode_video(synthetic_frames(12, 96, 64), fps=6)
    with pytest.raises(ValidationError) as err:
        renderer.render("r", prompt="<video>", videos=[mp4], give_up_at=time.monotonic() - 1)
    assert (err.value.rule, err.value.item) == ("render.timeout", 0)
    # inside a video: checked between frames
    with pytest.raises(VideoError) as err:
        renderer.videos.render(mp4, 3, give_up_at=time.monotonic() - 1)
    assert (err.value.rule, err.value.item) == ("render.timeout", 3)
    with pytest.raises(ValidationError) as err2:
        asyncio.run(renderer.render_async("r", timeout_s=1e-6, prompt="<video>", videos=[mp4]))
    assert err2.value.rule == "render.timeout"
    ev = asyncio.run(renderer.render_async("r", timeout_s=60, prompt="<video>", videos=[mp4]))
    assert ev.features.mm_hashes["video"]


def test_oversize_video_is_refused_before_any_frame_decodes() -> None:
    """Frame images whose headers are fine but whose pixel data is broken: the tensor-size
    refusal comes first (decoding them would fail with render.video_frames)."""
    good = png_bytes(synthetic_image(96, 64))
    broken = good[:60]  # IHDR intact, image data cut
    r = Renderer(load_render_info("tiny"), max_image_pixels=4096 * 4096, max_tensor_bytes=10_000)
    with pytest.raises(VideoError) as err:
        r.render("r", prompt="<video>", videos=[[broken] * 4])
    assert err.value.rule == "render.video_too_large"
    assert "EPD_MAX_TENSOR_BYTES" in str(err.value) and "min_pixels" in str(err.value)


def test_kept_frames_are_resized_as_they_decode() -> None:
    from media.video import plan_video

    plan = plan_video(encode_video(synthetic_frames(12, 96, 64), fps=6), LIMITS)
    clip = plan.clip((56, 28))
    assert [f.size for f in clip.frames] == [(56, 28)] * 4


def _public_items(tmp_path=None, **kw):  # type: ignore[no-untyped-def]
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from media.video_items import VideoItems
    from runtime.processor_limits import input_limits

    proc = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)  # the public config
    info = dataclasses.replace(
        load_render_info("tiny"),
        image_processor=proc,
        model_name=str(tmp_path or "no-such-checkpoint"),
    )
    tensor = input_limits(Settings(), proc).max_tensor_bytes
    return VideoItems(info, max_tensor_bytes=tensor, **kw), tensor


@pytest.mark.parametrize(
    ("frames", "w", "h"),
    [(20, 1920, 1080), (64, 1920, 1080), (4, 3840, 2160), (64, 3840, 2160), (64, 1080, 1920)],
)
def test_public_config_accepts_ordinary_videos(frames: int, w: int, h: int) -> None:
    """With the public Qwen2-VL config, HD and 4K videos at every sampled length fit: frames get
    the video processor's per-frame bounds (100,352 to 602,112 px), shared out of what
    EPD_MAX_TENSOR_BYTES holds when there are many."""
    items, tensor = _public_items()
    assert (items.config.min_pixels, items.config.max_pixels) == (128 * 784, 768 * 784)
    _cfg, (rh, rw) = items.sized(frames, w, h)
    assert 128 * 784 <= rh * rw <= 768 * 784
    assert frames * rh * rw * 3 * 4 <= tensor
    if frames <= 20:
        assert rh * rw > 700 * 784  # not cut: a short video keeps the full per-frame size


def test_checkpoint_video_config_and_settings_set_the_frame_bounds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 3136, "longest_edge": 256 * 784}})
    )
    items, _ = _public_items(tmp_path)
    assert (items.config.min_pixels, items.config.max_pixels) == (3136, 256 * 784)
    items, _ = _public_items(tmp_path, max_pixels=64 * 784)
    assert items.config.max_pixels == 64 * 784
    # A tiny processor (images below the default floor) keeps its own bounds.
    proc = load_render_info("tiny").image_processor
    cfg = config_from_image_processor(proc)
    r = Renderer(load_render_info("tiny"), max_image_pixels=1 << 24)
    assert (r.videos.config.min_pixels, r.videos.config.max_pixels) == (
        cfg.min_pixels,
        cfg.max_pixels,
    )


def _png_claiming(width: int, height: int) -> bytes:
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_frame_whose_header_claims_a_decompression_bomb_is_too_large() -> None:
    bomb = _png_claiming(20_000, 20_000)  # 400 MP: Pillow raises DecompressionBombError
    assert len(bomb) < 100
    with pytest.raises(VideoError) as err:
        load_video([png_bytes(synthetic_image(16, 16)), bomb], LIMITS, 2)
    assert (err.value.rule, err.value.item) == ("render.video_too_large", 2)
    assert "frame 1" in str(err.value)


@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_clip_starting_at_700_s_is_as_long_as_it_plays(container: str) -> None:
    """12 frames at 6 fps whose timestamps start at 700 s: a 2 s clip, not a 702 s one."""
    frames = synthetic_frames(12, 96, 64)
    start = 700 * 6
    data = encode_video(
        frames, fps=6, container=container, pts=[start + k for k in range(12)],
        time_base=Fraction(1, 6),
    )  # fmt: skip
    limits = dataclasses.replace(LIMITS, max_duration_s=60)
    clip = load_video(data, limits)
    assert clip.source_frames == 12 and len(clip.frames) == 4
    assert clip.fps == pytest.approx(2.0, rel=0.05)
    err = np.abs(np.asarray(clip.frames[1], np.float32) - np.asarray(frames[3], np.float32))
    assert err.mean() < 12


def test_portrait_phone_video_is_turned_upright() -> None:
    """Stored as 96x64 landscape pixels plus a display matrix of -90 degrees (a phone held
    upright): the frames come out 64x96, turned as a player shows them."""
    import av

    frames = synthetic_frames(8, 96, 64, seed=2)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=4)
        s.width, s.height, s.pix_fmt = 96, 64, "yuv420p"
        s.set_display_rotation(-90)
        for f in frames:
            for p in s.encode(av.VideoFrame.from_image(f)):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    clip = load_video(buf.getvalue(), LIMITS)
    assert {f.size for f in clip.frames} == {(64, 96)}
    want = np.asarray(frames[0].rotate(-90, expand=True), np.float32)
    assert np.abs(np.asarray(clip.frames[0], np.float32) - want).mean() < 12
    # and the grid is laid out for the upright size
    r = Renderer(load_render_info("tiny"), max_image_pixels=1 << 24)
    data = r.render("r", prompt="<video>", videos=[buf.getvalue()]).features.kwargs_data
    _t, gh, gw = data["video"][0]["video_grid_thw"].tolist()  # type: ignore[index,union-attr]
    assert gh > gw


def test_frames_follow_the_image_rgb_and_orientation_rules() -> None:
    """A transparent frame is composited onto white (as an image is), not blackened; a JPEG
    frame with EXIF orientation 6 is turned upright."""
    from media.pictures import to_rgb

    clear = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    half = Image.new("RGBA", (32, 32), (200, 10, 10, 128))
    clip = load_video([clear, half, png_bytes(half), clear], LIMITS)
    assert np.asarray(clip.frames[0]).min() == 255
    assert np.array_equal(np.asarray(clip.frames[1]), np.asarray(to_rgb(half)))
    assert np.array_equal(np.asarray(clip.frames[2]), np.asarray(to_rgb(half)))
    pal = Image.new("P", (32, 32), 0)
    pal.putpalette([0, 0, 0, 200, 10, 10])
    dots = [pal.copy() for _ in range(4)]
    for k, d in enumerate(dots):
        d.putpixel((k, k), 1)
    gif = io.BytesIO()
    dots[0].save(gif, "GIF", save_all=True, append_images=dots[1:], transparency=0, disposal=2)
    for f in load_video(gif.getvalue(), LIMITS).frames:  # index 0 is transparent: white
        assert (np.asarray(f) == 255).all(axis=2).sum() == 32 * 32 - 1

    exif = Image.Exif()
    exif[0x0112] = 6
    jpegs = []
    for f in synthetic_frames(4, 96, 64):
        b = io.BytesIO()
        f.save(b, "JPEG", exif=exif.tobytes())
        jpegs.append(b.getvalue())
    clip = load_video(jpegs, LIMITS)
    assert {f.size for f in clip.frames} == {(64, 96)}


@pytest.mark.parametrize("spec", ["tiny", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_a_prompt_ending_with_a_long_video_decodes_where_generate_does(spec: str) -> None:
    """Qwen2.5-VL spaces a video's temporal positions by its timing: three rows of a 64x64
    video reach past the one token after them, so the largest position is inside the video.
    ``generate`` continues from the prompt's last position + 1 (not the largest + 1); decoding
    from the largest went astray from the second token on."""
    bundle = load_model(spec, device="cpu")
    ev = Renderer(bundle, max_image_pixels=4096 * 4096).render(
        "tail", prompt="What <video>", videos=[synthetic_frames(6, 64, 64, seed=511)]
    )
    (ph,) = ev.features.mm_placeholders["video"]
    assert ev.features.mm_metadata["video"][0]["video_grid_thw"][0] == 3  # type: ignore[index]
    data = ev.features.kwargs_data["video"][0]  # type: ignore[index]
    (out,) = encode_items(bundle, [(data["pixel_values_videos"], data["video_grid_thw"])])  # type: ignore[index]
    meta = ev.features.mm_metadata["video"][0]  # type: ignore[index]
    items = [item_embedding("video", ph.offset, ph.length, out, meta, ph.is_embed)]  # type: ignore[arg-type]
    ids, pv, grid = monolithic_inputs(ev)
    want = generate_monolithic(
        bundle, ids, pv, grid, 10, ignore_eos=True, **monolithic_video_inputs(ev)
    )
    assert generate_from_embeddings(bundle, ev.token_ids, items, 10, ignore_eos=True) == want
