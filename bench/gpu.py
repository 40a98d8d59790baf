"""GPU benchmark: bf16 parity, encode throughput, store put/get, overhead share. CUDA only.

``python bench/gpu.py [--json FILE] [--quick] [--cpu-dry-run]`` or ``python -m bench gpu``.
Needs torch (a CUDA build), transformers 5.x, numpy, pillow, pydantic and blake3 (the repo's own
imports), redis-py for the redis:// column; no weights and no network: every model is built from
a config with random weights.

Sections, each wrapped so a failure is reported in its block and the rest still run:

- ``parity`` (first): tokens of the split path (vision tower -> embeddings -> prefill with
  embeddings -> greedy decode; :mod:`gpu_workers.compute`, the decode engine with a batch of
  one) vs ``model.generate`` (:mod:`gpu_workers.oracle`) in bf16, for the repo's tiny Qwen2-VL
  and a Qwen2-VL-2B-sized one, with two images encoded in one batched call and one per call.
  Reports exact match or the first divergent step, never hides one: ``mismatches`` names each
  failed comparison, its case, the step and the two tokens there.
- ``encode``: images/s of a Qwen2-VL-2B-sized vision tower (embed 1280, depth 32, 16 heads,
  out 1536, patch 14, merge 2), bf16, at 448² and 1024², batched vs one image per call, with
  each size's own allocation peak (the peak is reset before each).
- ``stores``: put/get of a 1369x1536 bf16 embedding made on the GPU: ``cuda://`` (same process
  and from another process over CUDA IPC), ``shm://`` and ``redis://`` (a ``redis-server`` this
  script starts when one is on PATH), each with the device<->host copies it implies.
- ``overhead``: pipeline overhead as a share of the GPU compute of one 1024² request (encode +
  prefill + 32 decode steps on the 2B-sized model), from the measured stage costs; each store
  uses its first leg with numbers (``leg`` says which).

Progress: each finished section is printed to stderr as one JSON line, and the whole document so
far is rewritten to ``--json`` (default ``$OUT/gpu.json`` when ``OUT`` is set). The final
document goes to stdout. Without CUDA the script prints ``{"skipped": "no CUDA"}`` and exits 0;
``--cpu-dry-run`` runs every section on CPU in fp32 with tiny sizes (a test of the script only:
its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repo's packages come from the tree
    sys.path.insert(0, str(ROOT))

from bench.gpu_stores import p50_ms, section_stores, sync  # noqa: E402

DEADLINE_S = 7 * 60
"""Sections that would start after this are skipped (the whole run must end within 8 min);
``--deadline-s`` sets another (the lent-device script gives a shorter one)."""

# Qwen2-VL-2B-Instruct's config.json (text and vision), for random-weight models of its size.
QWEN2VL_2B_TEXT: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    "eos_token_id": 151645,
    "bos_token_id": 151643,
    "pad_token_id": 151643,
}
QWEN2VL_2B_VISION: dict[str, Any] = {
    "depth": 32,
    "embed_dim": 1280,
    "hidden_size": 1536,
    "mlp_ratio": 4,
    "num_heads": 16,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


@dataclass(frozen=True, slots=True)
class Profile:
    """Where and how big: the GPU run, or the CPU dry run that only tests this script."""

    device: torch.device
    dtype: torch.dtype
    sides: tuple[int, ...]  # image sides for the encode section
    batch: dict[int, int]  # images per batched call, per side
    repeat: int
    big_model: bool  # the 2B-sized model (else the tiny config stands in)
    decode_steps: int
    store_repeat: int


def profile(cpu_dry_run: bool, quick: bool) -> Profile:
    if cpu_dry_run:
        return Profile(
            torch.device("cpu"), torch.float32, (56, 112), {56: 2, 112: 2}, 2, False, 4, 3
        )
    return Profile(
        torch.device("cuda"),
        torch.bfloat16,
        (448, 1024),
        {448: 16, 1024: 4},
        3 if quick else 10,
        True,
        32,
        20 if quick else 100,
    )


def timed(fn: Callable[[], Any], device: torch.device, repeat: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn`` (device work included), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


# --- models -----------------------------------------------------------------------------------


def tiny_bundle(prof: Profile) -> Any:
    from runtime.model import load_model

    return load_model("tiny", device=prof.device, dtype=prof.dtype)


def big_bundle(prof: Profile) -> Any:
    """A ModelBundle around a Qwen2-VL-2B-sized model with random weights (transformers' init)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from runtime.model import ModelBundle, text_config, tiny_image_processor
    from runtime.tokenizer import build_tiny_tokenizer
    from schemas.families import FAMILIES

    cfg = Qwen2VLConfig(
        text_config=QWEN2VL_2B_TEXT, vision_config=QWEN2VL_2B_VISION, tie_word_embeddings=True
    )
    with prof.device:
        model: Any = Qwen2VLForConditionalGeneration(cfg)
    model.set_attn_implementation("sdpa")
    peaked_init(model, seed=0)
    model = model.to(prof.dtype).eval()
    model.generation_config.eos_token_id = QWEN2VL_2B_TEXT["eos_token_id"]
    model.generation_config.pad_token_id = QWEN2VL_2B_TEXT["pad_token_id"]
    return ModelBundle(
        model_name="qwen2-vl-2b-sized-random",
        family=FAMILIES["qwen2_vl"],
        model=model,
        image_processor=tiny_image_processor(),
        tokenizer=build_tiny_tokenizer(),
        config=cfg,
        device=prof.device,
        dtype=prof.dtype,
        fingerprint="random",
        image_token_id=151655,
        video_token_id=151656,
        vision_start_id=151652,
        vision_end_id=151653,
        eos_token_id=151645,
        merge_size=2,
        vocab_size=int(text_config(cfg).vocab_size),
        context_length=int(text_config(cfg).max_position_embeddings),
    )


def peaked_init(model: torch.nn.Module, seed: int) -> None:
    """The tiny model's weight scheme (``runtime.model``), drawn on the model's device: weights
    ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1). transformers' default (std 0.02) gives a random
    model near-flat logits that greedy-decode one token forever, which would test nothing."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf == "weight":
                p.normal_(1.0, 0.1, generator=gen)
            elif leaf == "bias":
                p.normal_(0.0, 0.02, generator=gen)
            else:
                fan_in = p[0].numel() if p.ndim > 1 else p.shape[0]
                p.normal_(0.0, fan_in**-0.5, generator=gen)


def grid_of(side: int) -> torch.Tensor:
    """Qwen2-VL's grid for a square image: the side rounded to a multiple of 28, in patches."""
    cells = max(2, round(side / 28)) * 2
    return torch.tensor([1, cells, cells])


def pixels(grid: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=gen)


def prompt(bundle: Any, grids: list[torch.Tensor], seed: int) -> tuple[list[int], list[int]]:
    """Token ids with one placeholder run per grid between random text; the runs' offsets."""
    gen = torch.Generator().manual_seed(seed)
    # Plain text ids: the tiny model's bytes, or ids below the 2B vocabulary's special tokens.
    text_vocab = 256 if int(bundle.config.text_config.vocab_size) < 1000 else 150000
    ids: list[int] = torch.randint(0, text_vocab, (5,), generator=gen).tolist()
    offsets = []
    for g in grids:
        n = int(g.prod()) // bundle.merge_size**2
        ids.append(bundle.vision_start_id)
        offsets.append(len(ids))
        ids += [bundle.image_token_id] * n + [bundle.vision_end_id]
        ids += torch.randint(0, text_vocab, (4,), generator=gen).tolist()
    return ids, offsets


# --- sections ---------------------------------------------------------------------------------


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def parity_case(bundle: Any, sides: tuple[int, int], steps: int) -> dict[str, Any]:
    from gpu_workers.compute import ItemEmbedding, encode_images
    from gpu_workers.engine import generate_from_embeddings
    from gpu_workers.oracle import generate_monolithic

    grids = [grid_of(s) for s in sides]
    pvs = [pixels(g, seed=i) for i, g in enumerate(grids)]
    ids, offsets = prompt(bundle, grids, seed=1)
    want = generate_monolithic(
        bundle, ids, torch.cat(pvs), torch.stack(grids), steps, ignore_eos=True
    )
    batched = encode_images(bundle, list(zip(pvs, grids, strict=True)), to_cpu=False)
    separate = [
        encode_images(bundle, [(pv, g)], to_cpu=False)[0] for pv, g in zip(pvs, grids, strict=True)
    ]

    def split(embeds: list[torch.Tensor]) -> list[int]:
        items = [
            ItemEmbedding("image", o, e.shape[0], e, g)
            for o, e, g in zip(offsets, embeds, grids, strict=True)
        ]
        return generate_from_embeddings(bundle, ids, items, steps, ignore_eos=True)

    got_b, got_s = split(batched), split(separate)
    diff = max(
        float((b.float() - s.float()).abs().max()) for b, s in zip(batched, separate, strict=True)
    )
    return {
        "images": [list(map(int, g)) for g in grids],
        "prompt_tokens": len(ids),
        "steps": steps,
        "generate_tokens": want,
        "split_batched_tokens": got_b,
        "split_separate_tokens": got_s,
        "batched_matches_generate": got_b == want,
        "batched_first_divergent_step": first_divergence(got_b, want),
        "separate_matches_generate": got_s == want,
        "separate_first_divergent_step": first_divergence(got_s, want),
        "embeddings_batched_vs_separate_max_abs_diff": diff,
        "embeddings_batched_equal_separate": diff == 0.0,
    }


def section_parity(prof: Profile) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": str(prof.dtype).removeprefix("torch.")}
    tiny = tiny_bundle(prof)
    out["tiny"] = parity_case(tiny, (100, 224), steps=16)
    del tiny
    if prof.big_model:
        big = big_bundle(prof)
        out["qwen2_vl_2b_sized"] = parity_case(big, (448, 224), steps=16)
        del big
        torch.cuda.empty_cache()
    out |= parity_summary({k: v for k, v in out.items() if isinstance(v, dict)})
    return out


COMPARISONS = {
    "batched": "split path, both images encoded in one call, vs model.generate",
    "separate": "split path, each image encoded in its own call, vs model.generate",
}


def parity_summary(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``all_match`` and, for every comparison that failed, which one, in which case, the step
    where the tokens first differ and the two tokens there. In bf16 on a GPU one image per call
    may encode differently from a batch (other kernel shapes, other rounding): the embedding
    difference between the two encodings goes with each failure, to tell that from a bug."""
    mismatches: list[dict[str, Any]] = []
    for case, c in cases.items():
        want = c["generate_tokens"]
        for way, what in COMPARISONS.items():
            if c[f"{way}_matches_generate"]:
                continue
            step = c[f"{way}_first_divergent_step"]
            got = c[f"split_{way}_tokens"]
            mismatches.append(
                {
                    "case": case,
                    "comparison": f"{way}_vs_generate",
                    "what": what,
                    "first_divergent_step": step,
                    "generate_token": want[step] if step is not None and step < len(want) else None,
                    "split_token": got[step] if step is not None and step < len(got) else None,
                    "embeddings_batched_vs_separate_max_abs_diff": c[
                        "embeddings_batched_vs_separate_max_abs_diff"
                    ],
                }
            )
    return {"all_match": not mismatches, "mismatches": mismatches}


def vision_bundle(prof: Profile) -> Any:
    """What ``encode_items`` reads of a bundle, around a bare vision tower (no language model)."""
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    from runtime.model import tiny_config, vision_config
    from schemas.families import FAMILIES

    cfg = Qwen2VLConfig(vision_config=QWEN2VL_2B_VISION) if prof.big_model else tiny_config()
    vcfg = vision_config(cfg)
    torch.manual_seed(0)
    with prof.device:
        tower: Any = Qwen2VisionTransformerPretrainedModel(vcfg)
    tower.set_attn_implementation("sdpa")
    tower = tower.to(prof.dtype).eval()
    return SimpleNamespace(
        model=SimpleNamespace(model=SimpleNamespace(visual=tower)),
        device=prof.device,
        merge_size=2,
        family=FAMILIES["qwen2_vl"],
    )


class PeakMemory:
    """The device's allocation peak since the last ``reset`` (CUDA; nothing on the CPU).

    torch keeps one peak for the whole process: unless it is reset before each measurement,
    every figure is the largest allocation so far (the parity section's models)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)


def section_encode(prof: Profile) -> dict[str, Any]:
    from gpu_workers.compute import encode_items

    bundle = vision_bundle(prof)
    params = sum(p.numel() for p in bundle.model.model.visual.parameters())
    out: dict[str, Any] = {"tower_params": params, "dtype": str(prof.dtype).removeprefix("torch.")}
    memory = PeakMemory(prof.device)
    for side in prof.sides:
        g = grid_of(side)
        n = prof.batch[side]
        items = [(pixels(g, seed=i), g) for i in range(n)]
        memory.reset()  # this size's peak, not the largest since the process started

        def batched(items: list[Any] = items) -> Any:
            return encode_items(bundle, items, to_cpu=False)

        def one_by_one(items: list[Any] = items) -> Any:
            return [encode_items(bundle, [it], to_cpu=False) for it in items]

        tb = timed(batched, prof.device, prof.repeat)
        ts = timed(one_by_one, prof.device, prof.repeat)
        out[f"{side}px"] = {
            "grid": list(map(int, g)),
            "patches": int(g.prod()),
            "images_per_call": n,
            "batched_images_per_s": round(n / (p50_ms(tb) / 1e3), 2),
            "one_per_call_images_per_s": round(n / (p50_ms(ts) / 1e3), 2),
            "batched_ms_per_image": round(p50_ms(tb) / n, 4),
            "one_per_call_ms_per_image": round(p50_ms(ts) / n, 4),
        }
        peak = memory.peak_gib()
        if peak is not None:
            out[f"{side}px"]["peak_mem_gib"] = peak
    return out


def section_overhead(prof: Profile, doc: dict[str, Any], overhead_ms: float) -> dict[str, Any]:
    """GPU compute of one 1024² request on the 2B-sized model vs the pipeline's own costs."""
    from gpu_workers.compute import ItemEmbedding, encode_images, prefill
    from gpu_workers.engine import decode_alone
    from schemas.types import SamplingParams

    bundle = big_bundle(prof) if prof.big_model else tiny_bundle(prof)
    side = prof.sides[-1]
    g = grid_of(side)
    pv = pixels(g, seed=5)
    ids, offsets = prompt(bundle, [g], seed=6)
    holder: dict[str, Any] = {}

    def encode() -> None:
        holder["e"] = encode_images(bundle, [(pv, g)], to_cpu=False)[0]

    def run_prefill() -> None:
        item = ItemEmbedding("image", offsets[0], holder["e"].shape[0], holder["e"], g)
        holder["state"] = prefill(bundle, ids, [item])

    steps = SamplingParams(max_tokens=prof.decode_steps, ignore_eos=True)

    def decode() -> None:
        run_prefill()
        decode_alone(bundle, lambda: holder["state"], steps)

    enc = p50_ms(timed(encode, prof.device, prof.repeat))
    pre = p50_ms(timed(run_prefill, prof.device, prof.repeat))
    dec = round(p50_ms(timed(decode, prof.device, max(2, prof.repeat // 2))) - pre, 4)
    compute = enc + pre + dec
    out: dict[str, Any] = {
        "image": list(map(int, g)),
        "prompt_tokens": len(ids),
        "decode_steps": prof.decode_steps,
        "gpu_ms": {"encode": enc, "prefill": pre, "decode": dec, "total": round(compute, 4)},
        "pipeline_overhead_ms_assumed": overhead_ms,
    }
    out |= store_shares(doc.get("stores", {}), overhead_ms, compute)
    out["method"] = (
        "share = (pipeline_overhead_ms_assumed + embedding put + get) / (encode + prefill + "
        "decode), each a p50 measured here; pipeline_overhead_ms_assumed is the design's budget "
        "(5 ms) unless --pipeline-overhead-ms gives the measured one"
    )
    return out


STORE_LEGS = {
    "cuda": ("cuda_cross_process", "cuda_same_process"),
    "shm": ("shm",),
    "redis": ("redis",),
}
"""Per store, the ``stores`` legs that can stand for it, best first (a cross-process read is
what a prefill worker does; the same-process one stands in when that leg failed)."""


def measured(leg: Any) -> bool:
    return isinstance(leg, dict) and "get_p50_ms" in leg


def store_shares(stores: dict[str, Any], overhead_ms: float, compute_ms: float) -> dict[str, Any]:
    """``with_<store>_store``: overhead + the embedding's put + get against the GPU compute,
    from the first leg of each store that has numbers (a failed leg, which holds only its
    error, must not hide the one that ran); ``leg`` names the one used."""
    out: dict[str, Any] = {}
    cuda_put = (stores.get("cuda_same_process") or {}).get("put_p50_ms", 0.0)
    for name, candidates in STORE_LEGS.items():
        leg_name = next((c for c in candidates if measured(stores.get(c))), None)
        if leg_name is None:
            continue
        leg = stores[leg_name]
        # the cross-process cuda:// leg times only the get; its put is the same-process one
        total = overhead_ms + leg.get("put_p50_ms", cuda_put) + leg["get_p50_ms"]
        out[f"with_{name}_store"] = {
            "leg": leg_name,
            "overhead_ms": round(total, 4),
            "share_of_gpu_compute": round(total / compute_ms, 4),
        }
    return out


# --- driver -----------------------------------------------------------------------------------


def machine(prof: Profile) -> dict[str, Any]:
    import transformers

    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "device": str(prof.device),
    }
    if prof.device.type == "cuda":
        p = torch.cuda.get_device_properties(prof.device)
        facts |= {
            "gpu": p.name,
            "gpu_mem_gib": round(p.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "capability": f"{p.major}.{p.minor}",
        }
    return facts


def run(
    *,
    quick: bool = False,
    out: Path | None = None,
    cpu_dry_run: bool = False,
    json_path: Path | None = None,
    pipeline_overhead_ms: float = 5.0,
    deadline_s: float = DEADLINE_S,
) -> dict[str, Any]:
    """Every section; ``python -m bench gpu`` calls this (``out``: the folder for gpu.json)."""
    if not cpu_dry_run and not torch.cuda.is_available():
        return {"skipped": "no CUDA", "meets_budget": None}
    prof = profile(cpu_dry_run, quick)
    if json_path is None and out is not None:
        json_path = Path(out) / "gpu.json"
    t_start = time.perf_counter()
    doc: dict[str, Any] = {"machine": machine(prof), "cpu_dry_run": cpu_dry_run, "quick": quick}
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("parity", lambda: section_parity(prof)),
        ("encode", lambda: section_encode(prof)),
        ("stores", lambda: asyncio.run(section_stores(prof.device, prof.store_repeat))),
        ("overhead", lambda: section_overhead(prof, doc, pipeline_overhead_ms)),
    ]
    for name, fn in sections:
        if time.perf_counter() - t_start > deadline_s:
            doc[name] = {"skipped": f"time budget: {deadline_s:g} s spent before it started"}
        else:
            t0 = time.perf_counter()
            try:
                doc[name] = fn()
            except Exception as exc:  # one failure must not hide the other sections
                traceback.print_exc(file=sys.stderr)
                doc[name] = {"error": f"{type(exc).__name__}: {exc}"}
            doc[name]["wall_s"] = round(time.perf_counter() - t0, 2)
        print(json.dumps({"section": name, "result": doc[name]}), file=sys.stderr, flush=True)
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(doc, indent=2) + "\n")
    doc["wall_s"] = round(time.perf_counter() - t_start, 2)
    doc["meets_budget"] = None  # docs/design.md sets no GPU budgets: figures only
    if json_path is not None:
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="rewrite the document here as it grows (default: $OUT/gpu.json)",
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="tiny sizes on CPU, fp32: tests the script, its numbers mean nothing",
    )
    p.add_argument(
        "--pipeline-overhead-ms",
        type=float,
        default=5.0,
        help="the measured pipeline overhead (default: the 5 ms budget)",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=DEADLINE_S,
        help=f"skip the sections that would start after this many seconds (default {DEADLINE_S})",
    )
    args = p.parse_args(argv)
    path = args.json or (Path(os.environ["OUT"]) / "gpu.json" if os.environ.get("OUT") else None)
    doc = run(
        quick=args.quick,
        cpu_dry_run=args.cpu_dry_run,
        json_path=path,
        pipeline_overhead_ms=args.pipeline_overhead_ms,
        deadline_s=args.deadline_s,
    )
    print(json.dumps(doc), flush=True)  # one line: a captured tail keeps all of it
    return 0


if __name__ == "__main__":
    sys.exit(main())
