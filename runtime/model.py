"""Model loading for every supported family (:mod:`schemas.families`): a tiny seeded spec
(``tiny``, ``tiny-qwen2.5-vl``, ``tiny-qwen3-vl``: random weights, CPU-friendly) or a local
checkpoint of a supported ``model_type`` (offline). Any other ``model_type`` is refused with a
:class:`ModelLoadError` listing the supported ones.

``FAMILY_CLASSES`` maps each ``model_type`` to its transformers classes; nothing else names them.

``load_model`` returns a ``ModelBundle`` holding the transformers model, the PIL image processor
(no torchvision needed), the tokenizer, the special token ids and a content fingerprint. The
fingerprint names the weights, not the runtime: it is the same on CPU (fp32) and GPU (bf16), so
embedding-store keys agree across devices of one deployment.

``load_render_info`` gives the renderer what it needs (processor, tokenizer, ids, fingerprint)
without moving weights onto a device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
from transformers import (
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from runtime.errors import ModelLoadError
from runtime.model_spec import checkpoint_dir as _checkpoint_dir
from runtime.model_spec import model_family as model_family
from runtime.tokenizer import BYTE_VOCAB, EOS_TOKEN, SPECIAL_TOKENS, build_tiny_tokenizer
from schemas.families import FAMILIES, INSTANT_SPEC, TINY_SPECS, ModelFamily

TINY = "tiny"
TINY_SEED = 20240917


__all__ = [
    "FAMILY_CLASSES",
    "ModelBundle",
    "ModelLoadError",
    "RenderInfo",
    "load_model",
    "placeholder_ids",
]


@dataclass(frozen=True, slots=True)
class FamilyClasses:
    """The transformers classes of one model family."""

    config: type[PretrainedConfig]
    model: type[PreTrainedModel]
    image_processor: type[Qwen2VLImageProcessorPil]


# All three families use the Qwen2-VL patching rules (the PIL processor needs no torchvision);
# Qwen3-VL's checkpoints only change the patch size (16) and the normalisation.
FAMILY_CLASSES: dict[str, FamilyClasses] = {
    "qwen2_vl": FamilyClasses(
        Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil
    ),
    "qwen2_5_vl": FamilyClasses(
        Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil
    ),
    "qwen3_vl": FamilyClasses(
        Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen2VLImageProcessorPil
    ),
    "qwen3_vl_moe": FamilyClasses(
        Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, Qwen2VLImageProcessorPil
    ),
}
if set(FAMILY_CLASSES) != set(FAMILIES):
    raise AssertionError("FAMILY_CLASSES and schemas.families.FAMILIES must list the same types")


@dataclass(frozen=True, slots=True)
class RenderInfo:
    """Everything the renderer needs; no weights."""

    model_name: str
    family: ModelFamily
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
    context_length: int
    """The text model's ``max_position_embeddings``: prompt + generated tokens fit in it."""

    @property
    def instant(self) -> bool:
        """The instant engine (``EPD_MODEL=instant``): the tiny model's shapes, no compute."""
        return self.model_name == INSTANT_SPEC


@dataclass(frozen=True, slots=True)
class ModelBundle(RenderInfo):
    """A loaded model of a supported family: its render info (identity, processor, tokenizer,
    special ids, limits), and the weights with where and how they run."""

    model: Any  # the family's *ForConditionalGeneration (FAMILY_CLASSES); None: instant
    config: Any  # the family's config class
    device: torch.device
    dtype: torch.dtype

    def render_info(self) -> RenderInfo:
        """The renderer's view of this bundle: its :class:`RenderInfo` fields, no weights."""
        return RenderInfo(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RenderInfo)})


def placeholder_ids(info: RenderInfo | ModelBundle) -> dict[str, int]:
    """modality -> the id of the token its placeholder repeats, for the modalities the family
    runs (which token that is, is the family table's fact: ``ModelFamily.placeholder_tokens``).

    The one lookup of the pad ids: the renderer lays prompts out with them, and the prefill
    compute checks placeholders and builds ``mm_token_type_ids`` from them. The ids are the
    config's (what the model embeds); loading checks the tokenizer agrees
    (:func:`_check_placeholder_tokens`)."""
    by_modality = {"image": info.image_token_id, "video": info.video_token_id}
    return {m: by_modality[m] for m in info.family.placeholder_tokens}


def text_config(cfg: Any) -> Any:
    """The text sub-config (typed loosely: transformers annotates it as dict | config | None)."""
    return cfg.text_config


def vision_config(cfg: Any) -> Any:
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
# tiny models


def _tiny_ids() -> dict[str, int]:
    return {t: BYTE_VOCAB + i for i, t in enumerate(SPECIAL_TOKENS)}


def _tiny_text(rope_dim: int, mrope_section: list[int], **extra: Any) -> dict[str, Any]:
    """The tiny text config shared by the families: 2 layers, hidden 64, byte-level vocab."""
    ids = _tiny_ids()
    if sum(mrope_section) != rope_dim // 2:
        raise ModelLoadError("tiny config: mrope_section must sum to head_dim / 2")
    return {
        "vocab_size": BYTE_VOCAB + len(SPECIAL_TOKENS),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        # Qwen2-VL's own context: a 12 MP photo under the public processor config is ~15.5k
        # placeholder tokens, so the tiny models take it end to end too.
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": mrope_section,
        },
        "bos_token_id": ids[EOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[EOS_TOKEN],
        **extra,
    }


def _tiny_top() -> dict[str, Any]:
    ids = _tiny_ids()
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
    }


def _tiny_qwen2_vl() -> Qwen2VLConfig:
    """2 vision blocks (full attention), 2 text layers, hidden 64."""
    return Qwen2VLConfig(
        # text: hidden 64 / 4 heads = head_dim 16; M-RoPE sections sum to head_dim / 2
        text_config=_tiny_text(16, [2, 3, 3]),
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
        **_tiny_top(),
    )


def _tiny_qwen2_5_vl() -> Qwen2_5_VLConfig:
    """Qwen2-VL's sizes plus window attention: block 0 attends within 56x56-pixel windows (2x2
    merged tokens), block 1 is a full-attention block; any image above 56x56 spans windows."""
    return Qwen2_5_VLConfig(
        text_config=_tiny_text(16, [2, 3, 3]),
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        },
        **_tiny_top(),
    )


_TINY_QWEN3_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0, 1],
}


def _tiny_qwen3_vl() -> Qwen3VLConfig:
    """3 vision blocks with deepstack taps after blocks 0 and 1 (so the first two LLM layers
    receive visual features), learned 8x8 position grid, patch 16; interleaved M-RoPE."""
    return Qwen3VLConfig(
        text_config=_tiny_text(16, [4, 2, 2], head_dim=16),
        vision_config=dict(_TINY_QWEN3_VISION),
        **_tiny_top(),
    )


def _tiny_qwen3_vl_moe() -> Qwen3VLMoeConfig:
    """Qwen3-VL's tiny vision tower and a mixture-of-experts text model: 4 experts, 2 per token,
    in every layer."""
    return Qwen3VLMoeConfig(
        text_config=_tiny_text(
            16,
            [4, 2, 2],
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
        ),
        vision_config=dict(_TINY_QWEN3_VISION),
        **_tiny_top(),
    )


_TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen2_vl": _tiny_qwen2_vl,
    "qwen2_5_vl": _tiny_qwen2_5_vl,
    "qwen3_vl": _tiny_qwen3_vl,
    "qwen3_vl_moe": _tiny_qwen3_vl_moe,
}
# Small images keep the tiny models cheap: 4 patches up to 256 patches.
_TINY_PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_vl_moe": 16}


def tiny_config(model_type: str = "qwen2_vl") -> Any:
    """The seeded tiny config of a family (``model_type``)."""
    return _TINY_CONFIGS[model_type]()


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
                if p.ndim > 3:  # the conv patch embedding: fan-in is all input dims
                    fan_in = int(torch.tensor(p.shape[1:]).prod())
                # 3-d: fused expert weights (experts, out, in); fan-in is the last dim.
                vals = torch.randn(p.shape, generator=gen) * (1.0 / fan_in**0.5)
            p.copy_(vals.to(p.dtype))


def _build_tiny_model(model_type: str = "qwen2_vl") -> tuple[Any, Any]:
    cfg = tiny_config(model_type)
    model = FAMILY_CLASSES[model_type].model(cfg)
    model.set_attn_implementation("sdpa")  # fixed, not whatever this host would pick
    model.float()
    _seed_weights(model, TINY_SEED)
    return model, cfg


def tiny_image_processor(model_type: str = "qwen2_vl") -> Qwen2VLImageProcessorPil:
    """A tiny model's processor: merge 2, temporal 2, 2x2 to 16x16 patches per image."""
    patch = _TINY_PATCH[model_type]
    unit = patch * 2  # one merged token
    return Qwen2VLImageProcessorPil(
        min_pixels=(2 * unit) ** 2,
        max_pixels=(8 * unit) ** 2,
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
    )


# ---------------------------------------------------------------------------------------------
# fingerprints


def _config_bytes(cfg: Any) -> bytes:
    d = cfg.to_dict()
    # Runtime choices that do not change the function the weights compute.
    for k in ("_attn_implementation_autoset", "transformers_version", "dtype", "torch_dtype"):
        d.pop(k, None)
    return json.dumps(d, sort_keys=True, default=str).encode()


def state_dict_fingerprint(model: torch.nn.Module, cfg: Any) -> str:
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


def _special_ids(tokenizer: PreTrainedTokenizerBase, cfg: Any) -> dict[str, int]:
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


def _check_placeholder_tokens(
    fam: ModelFamily, tokenizer: PreTrainedTokenizerBase, ids: dict[str, int]
) -> None:
    """The tokenizer spells each placeholder token (the family table's) with the config's id: a
    checkpoint whose tokenizer and config disagree would render prompts the model misreads."""
    config_ids = {"image": ids["image_token_id"], "video": ids["video_token_id"]}
    for modality, token in fam.placeholder_tokens.items():
        got = tokenizer.convert_tokens_to_ids(token)
        if got != config_ids[modality]:
            raise ModelLoadError(
                f"the tokenizer's {token} is id {got}, the config's {modality} token id is "
                f"{config_ids[modality]}"
            )


def _check_processor(proc: Qwen2VLImageProcessorPil, cfg: Any) -> int:
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


@dataclass(slots=True)
class _Loaded:
    family: ModelFamily
    name: str
    config: Any
    tokenizer: PreTrainedTokenizerBase
    processor: Qwen2VLImageProcessorPil
    fingerprint: str
    model: Any = None


def _load(spec: str, *, weights: bool, dtype: torch.dtype) -> _Loaded:
    """The pieces of ``spec``; ``weights``: also the model (checkpoints: in ``dtype``)."""
    fam = model_family(spec)
    classes = FAMILY_CLASSES[fam.model_type]
    if spec == INSTANT_SPEC:
        return _instant()
    if spec in TINY_SPECS:
        # Rebuilt even for render info: the fingerprint is over the weights (cheap here).
        model, cfg = _build_tiny_model(fam.model_type)
        fp = state_dict_fingerprint(model, cfg)  # before any cast: device-independent identity
        return _Loaded(
            fam,
            spec if spec != "tiny-qwen2-vl" else TINY,
            cfg,
            build_tiny_tokenizer(),
            tiny_image_processor(fam.model_type),
            fp,
            model,
        )
    path = _checkpoint_dir(spec)
    what = f"{fam.display_name} checkpoint {path}"
    # Any failure inside transformers (missing or mismatched weights, bad config values) is a
    # load error naming the checkpoint, never a traceback from deep inside the library.
    try:
        cfg = classes.config.from_pretrained(path, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        proc = classes.image_processor.from_pretrained(path, local_files_only=True)
        model = None
        if weights:
            model = classes.model.from_pretrained(
                path, dtype=dtype, local_files_only=True, attn_implementation="sdpa"
            )
            cfg = model.config
    except Exception as e:  # see above: every failure is a load error
        raise ModelLoadError(f"cannot load {what}: {type(e).__name__}: {e}") from e
    return _Loaded(fam, str(path), cfg, tok, proc, checkpoint_fingerprint(path), model)


def _instant() -> _Loaded:
    """The instant engine's pieces: the tiny Qwen2-VL's config, tokenizer and processor, no
    weights; a fingerprint of its own (over the config), so its zero embeddings never meet a
    real model's in a shared store."""
    cfg = tiny_config("qwen2_vl")
    h = blake3.blake3(b"epd-instant-v1\0")
    h.update(_config_bytes(cfg))
    return _Loaded(
        FAMILIES["qwen2_vl"],
        INSTANT_SPEC,
        cfg,
        build_tiny_tokenizer(),
        tiny_image_processor("qwen2_vl"),
        h.hexdigest(),
    )


def load_render_info(spec: str = TINY) -> RenderInfo:
    """Processor, tokenizer, ids and fingerprint for ``spec`` without placing weights on a device.

    For a tiny spec the random weights are rebuilt on CPU (cheap) to compute the fingerprint.
    """
    ld = _load(spec, weights=False, dtype=torch.float32)
    ids = _special_ids(ld.tokenizer, ld.config)
    _check_placeholder_tokens(ld.family, ld.tokenizer, ids)
    return RenderInfo(
        model_name=ld.name,
        family=ld.family,
        fingerprint=ld.fingerprint,
        image_processor=ld.processor,
        tokenizer=ld.tokenizer,
        merge_size=_check_processor(ld.processor, ld.config),
        vocab_size=int(text_config(ld.config).vocab_size),
        context_length=int(text_config(ld.config).max_position_embeddings),
        **ids,
    )


def _placed(model: Any, spec: str, ids: dict[str, int], dev: torch.device, dt: torch.dtype) -> Any:
    """The weights on ``dev`` in ``dt``, in eval mode, with generate()'s ids set."""
    # transformers' decorated .to() confuses mypy; it returns the model itself.
    model = model.to(device=dev, dtype=dt)
    model.eval()
    # generate() reads its defaults from here. A real checkpoint keeps its own eos list (the
    # oracle passes stop ids explicitly anyway); pad must be set to silence generate's warning.
    if spec in TINY_SPECS:
        model.generation_config.eos_token_id = ids["eos_token_id"]
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = ids["eos_token_id"]
    return model


def load_model(
    spec: str = TINY,
    *,
    device: str | torch.device = "auto",
    dtype: torch.dtype | None = None,
    weights: bool = True,
) -> ModelBundle:
    """Load a tiny spec (seeded random weights) or a local checkpoint directory (offline) of a
    supported family; :class:`ModelLoadError` for anything else.

    ``device``: "auto" means CUDA when present, else CPU. ``dtype``: None means bf16 on GPU,
    fp32 on CPU. ``weights`` False: no model on the device (``model`` None), only what a worker
    that hands the compute to another engine (``EPD_ENGINE=vllm``) reads: processor,
    tokenizer, config, ids and the fingerprint.
    """
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dt = dtype or default_dtype(dev)
    ld = _load(spec, weights=weights, dtype=dt)
    ids = _special_ids(ld.tokenizer, ld.config)
    _check_placeholder_tokens(ld.family, ld.tokenizer, ids)
    placed = weights and ld.model is not None
    model = _placed(ld.model, spec, ids, dev, dt) if placed else None
    return ModelBundle(
        model_name=ld.name,
        family=ld.family,
        model=model,
        image_processor=ld.processor,
        tokenizer=ld.tokenizer,
        config=ld.config,
        device=dev,
        dtype=dt,
        fingerprint=ld.fingerprint,
        merge_size=_check_processor(ld.processor, ld.config),
        vocab_size=int(text_config(ld.config).vocab_size),
        context_length=int(text_config(ld.config).max_position_embeddings),
        **ids,
    )
