"""Qwen2-VL model loading: ``tiny`` (seeded random weights, CPU-friendly) or a local checkpoint.

``load_model`` returns a ``ModelBundle`` holding the transformers model, the PIL image processor
(no torchvision needed), the tokenizer, the special token ids and a content fingerprint. The
fingerprint names the weights, not the runtime: it is the same on CPU (fp32) and GPU (bf16), so
embedding-store keys agree across devices of one deployment.

``load_render_info`` gives the renderer what it needs (processor, tokenizer, ids, fingerprint)
without moving weights onto a device.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import blake3
import torch
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from runtime.tokenizer import BYTE_VOCAB, EOS_TOKEN, SPECIAL_TOKENS, build_tiny_tokenizer

TINY = "tiny"
TINY_SEED = 20240917
# Small images keep the tiny model cheap: 56x56 (4 patches) up to 224x224 (256 patches).
TINY_MIN_PIXELS = 56 * 56
TINY_MAX_PIXELS = 224 * 224


class ModelLoadError(RuntimeError):
    """A model spec that cannot be loaded (missing path, wrong architecture, bad device)."""


@dataclass(frozen=True, slots=True)
class RenderInfo:
    """Everything the renderer needs; no weights."""

    model_name: str
    fingerprint: str
    image_processor: Qwen2VLImageProcessorPil
    tokenizer: PreTrainedTokenizerBase
    image_token_id: int
    video_token_id: int
    vision_start_id: int
    vision_end_id: int
    eos_token_id: int
    merge_size: int
    vocab_size: int


@dataclass(slots=True)
class ModelBundle:
    """A loaded Qwen2-VL model with its processor, tokenizer and identity."""

    model_name: str
    model: Qwen2VLForConditionalGeneration
    image_processor: Qwen2VLImageProcessorPil
    tokenizer: PreTrainedTokenizerBase
    config: Qwen2VLConfig
    device: torch.device
    dtype: torch.dtype
    fingerprint: str
    image_token_id: int
    video_token_id: int
    vision_start_id: int
    vision_end_id: int
    eos_token_id: int
    merge_size: int

    def render_info(self) -> RenderInfo:
        """The renderer's view of this bundle."""
        return RenderInfo(
            model_name=self.model_name,
            fingerprint=self.fingerprint,
            image_processor=self.image_processor,
            tokenizer=self.tokenizer,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            vision_start_id=self.vision_start_id,
            vision_end_id=self.vision_end_id,
            eos_token_id=self.eos_token_id,
            merge_size=self.merge_size,
            vocab_size=int(text_config(self.config).vocab_size),
        )


def text_config(cfg: Qwen2VLConfig) -> Any:
    """The text sub-config (typed loosely: transformers annotates it as dict | config | None)."""
    return cfg.text_config


def vision_config(cfg: Qwen2VLConfig) -> Any:
    """The vision sub-config."""
    return cfg.vision_config


# ---------------------------------------------------------------------------------------------
# device and dtype


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` -> CUDA when present else CPU; ``cpu``/``cuda``/``cuda:N`` as given."""
    spec = spec.strip().lower() or "auto"
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError as e:
        raise ModelLoadError(f"invalid device {spec!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {spec!r} requested but CUDA is not available")
    return dev


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU, fp32 on CPU (CPU bf16 matmuls are slow and lossy)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


# ---------------------------------------------------------------------------------------------
# tiny model


def tiny_config() -> Qwen2VLConfig:
    """A small Qwen2-VL config: 2 vision blocks, 2 text layers, hidden 64, byte-level vocab."""
    ids = {t: BYTE_VOCAB + i for i, t in enumerate(SPECIAL_TOKENS)}
    head_dim = 16  # text: hidden 64 / 4 heads; M-RoPE sections must sum to head_dim / 2
    cfg = Qwen2VLConfig(
        text_config={
            "vocab_size": BYTE_VOCAB + len(SPECIAL_TOKENS),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
            "bos_token_id": ids[EOS_TOKEN],
            "eos_token_id": ids[EOS_TOKEN],
            "pad_token_id": ids[EOS_TOKEN],
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,  # 2 heads of 16: the axial vision rope needs head_dim % 4 == 0
            "hidden_size": 64,  # merger output == text hidden size
            "mlp_ratio": 2,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    if sum(text_config(cfg).rope_parameters["mrope_section"]) != head_dim // 2:
        raise ModelLoadError("tiny config: mrope_section must sum to head_dim / 2")
    return cfg


def _seed_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter from a generator seeded by (seed, parameter name).

    Keyed by name rather than by init order, so the weights do not depend on how transformers
    happens to initialise modules, and are identical in every process.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
            gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)
            leaf = name.rsplit(".", 1)[-1]
            is_norm = "norm" in name or name.startswith("model.visual.merger.ln_q")
            if is_norm and leaf == "weight":
                vals = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif leaf == "bias":
                vals = 0.02 * torch.randn(p.shape, generator=gen)
            else:
                # Larger than the usual 0.02 so the random model has peaked, position-sensitive
                # logits: greedy parity then really tests the rope positions.
                fan_in = p.shape[-1] if p.ndim > 1 else p.shape[0]
                if p.ndim > 2:  # the conv patch embedding: fan-in is all input dims
                    fan_in = int(torch.tensor(p.shape[1:]).prod())
                vals = torch.randn(p.shape, generator=gen) * (1.0 / fan_in**0.5)
            p.copy_(vals.to(p.dtype))


def _build_tiny_model() -> tuple[Qwen2VLForConditionalGeneration, Qwen2VLConfig]:
    cfg = tiny_config()
    cfg._attn_implementation = "sdpa"
    model = Qwen2VLForConditionalGeneration(cfg)
    model.float()
    _seed_weights(model, TINY_SEED)
    return model, cfg


def tiny_image_processor() -> Qwen2VLImageProcessorPil:
    """The tiny model's processor: patch 14, merge 2, temporal 2, 56x56..224x224 pixels."""
    return Qwen2VLImageProcessorPil(
        min_pixels=TINY_MIN_PIXELS,
        max_pixels=TINY_MAX_PIXELS,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    )


# ---------------------------------------------------------------------------------------------
# fingerprints


def _config_bytes(cfg: Qwen2VLConfig) -> bytes:
    d = cfg.to_dict()
    # Runtime choices that do not change the function the weights compute.
    for k in ("_attn_implementation_autoset", "transformers_version", "dtype", "torch_dtype"):
        d.pop(k, None)
    return json.dumps(d, sort_keys=True, default=str).encode()


def state_dict_fingerprint(model: torch.nn.Module, cfg: Qwen2VLConfig) -> str:
    """blake3 over the config and every tensor (name, dtype, shape, bytes), in name order."""
    h = blake3.blake3()
    h.update(b"epd-model-v1\0")
    h.update(_config_bytes(cfg))
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checkpoint_fingerprint(path: Path) -> str:
    """blake3 over a checkpoint's config and weight files' bytes (memory-mapped, multithreaded).

    Hashing the full bytes (not just the index) makes a fine-tune with identical shapes a
    different model, so its embeddings never collide with the base model's in a shared store.
    """
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(b"epd-checkpoint-v1\0")
    cfg_file = path / "config.json"
    if cfg_file.is_file():
        h.update(json.dumps(json.loads(cfg_file.read_text()), sort_keys=True).encode())
    weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not weights:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    for f in weights:
        h.update(f"\0{f.name}\0{f.stat().st_size}\0".encode())
        h.update_mmap(f)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# loading


def _special_ids(tokenizer: PreTrainedTokenizerBase, cfg: Qwen2VLConfig) -> dict[str, int]:
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = text_config(cfg).eos_token_id
        if isinstance(eos, list):
            eos = eos[0]
    if eos is None:
        raise ModelLoadError("the model has no eos token id")
    return {
        "image_token_id": int(cfg.image_token_id),
        "video_token_id": int(cfg.video_token_id),
        "vision_start_id": int(cfg.vision_start_token_id),
        "vision_end_id": int(cfg.vision_end_token_id),
        "eos_token_id": int(eos),
    }


def _check_processor(proc: Qwen2VLImageProcessorPil, cfg: Qwen2VLConfig) -> int:
    vc = vision_config(cfg)
    if (proc.patch_size, proc.merge_size, proc.temporal_patch_size) != (
        vc.patch_size,
        vc.spatial_merge_size,
        vc.temporal_patch_size,
    ):
        raise ModelLoadError(
            "image processor and vision config disagree on patch/merge/temporal size: "
            f"{(proc.patch_size, proc.merge_size, proc.temporal_patch_size)} vs "
            f"{(vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size)}"
        )
    return int(proc.merge_size)


def _checkpoint_dir(spec: str) -> Path:
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model {spec!r} is neither 'tiny' nor a local checkpoint directory")
    return path


def load_render_info(spec: str = TINY) -> RenderInfo:
    """Processor, tokenizer, ids and fingerprint for ``spec`` without placing weights on a device.

    For ``tiny`` the random weights are rebuilt on CPU (cheap) to compute the fingerprint.
    """
    if spec == TINY:
        model, cfg = _build_tiny_model()
        tok: PreTrainedTokenizerBase = build_tiny_tokenizer()
        proc = tiny_image_processor()
        fp = state_dict_fingerprint(model, cfg)
        name = TINY
    else:
        path = _checkpoint_dir(spec)
        cfg = Qwen2VLConfig.from_pretrained(path, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        proc = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
        fp = checkpoint_fingerprint(path)
        name = str(path)
    return RenderInfo(
        model_name=name,
        fingerprint=fp,
        image_processor=proc,
        tokenizer=tok,
        merge_size=_check_processor(proc, cfg),
        vocab_size=int(text_config(cfg).vocab_size),
        **_special_ids(tok, cfg),
    )


def load_model(
    spec: str = TINY, *, device: str | torch.device = "auto", dtype: torch.dtype | None = None
) -> ModelBundle:
    """Load ``tiny`` (seeded random weights) or a local Qwen2-VL checkpoint directory (offline).

    ``device``: None reads ``EPD_DEVICE`` ("auto": CUDA when present, else CPU). ``dtype``: None
    means bf16 on GPU, fp32 on CPU.
    """
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dt = dtype or default_dtype(dev)
    tok: PreTrainedTokenizerBase
    if spec == TINY:
        model, cfg = _build_tiny_model()
        fp = state_dict_fingerprint(model, cfg)  # before the cast: device-independent identity
        tok = build_tiny_tokenizer()
        proc = tiny_image_processor()
        name = TINY
    else:
        path = _checkpoint_dir(spec)
        fp = checkpoint_fingerprint(path)
        try:
            model = Qwen2VLForConditionalGeneration.from_pretrained(
                path, dtype=dt, local_files_only=True, attn_implementation="sdpa"
            )
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load Qwen2-VL checkpoint {path}: {e}") from e
        cfg = model.config
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        proc = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
        name = str(path)
    # transformers' decorated .to() confuses mypy; it returns the model itself.
    model = cast(Qwen2VLForConditionalGeneration, model.to(device=dev, dtype=dt))  # type: ignore[call-arg]
    model.eval()
    ids = _special_ids(tok, cfg)
    # generate() reads its defaults from here. A real checkpoint keeps its own eos list (the
    # oracle passes stop ids explicitly anyway); pad must be set to silence generate's warning.
    if spec == TINY:
        model.generation_config.eos_token_id = ids["eos_token_id"]
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = ids["eos_token_id"]
    return ModelBundle(
        model_name=name,
        model=model,
        image_processor=proc,
        tokenizer=tok,
        config=cfg,
        device=dev,
        dtype=dt,
        fingerprint=fp,
        merge_size=_check_processor(proc, cfg),
        **ids,
    )


def describe(bundle: ModelBundle) -> dict[str, Any]:
    """A JSON-friendly summary (for logs and ``/healthz``)."""
    return {
        "model": bundle.model_name,
        "fingerprint": bundle.fingerprint,
        "device": str(bundle.device),
        "dtype": str(bundle.dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in bundle.model.parameters()),
        "pid": os.getpid(),
    }
