"""How many threads torch's CPU kernels use in this process.

torch's default is one per core, and its OpenMP threads spin for a while after every parallel
op before they sleep. A process that runs no model on the CPU (the API, a worker whose model is
on a GPU or is the instant engine) still checks, sums and copies tensors of a megabyte on each
request, and each of those ops then costs milliseconds of CPU in spinning threads: a finite-check
of a 224² image's ``pixel_values`` measured 0.2 ms of CPU with one thread and 5 ms with two on a
2-core machine. vLLM's workers set one thread for the same reason. A model that computes on the
CPU keeps torch's default, which its matmuls need.
"""

from __future__ import annotations

from runtime.settings import Settings
from schemas.families import INSTANT_SPEC


def torch_threads(settings: Settings, *, model_on_cpu: bool) -> int | None:
    """Threads for this process (``EPD_TORCH_THREADS`` where set); ``None``: torch's default."""
    if settings.torch_threads is not None:
        return settings.torch_threads
    return None if model_on_cpu else 1


def computes_on_cpu(settings: Settings) -> bool:
    """Whether a worker's model computes on the CPU: a model with weights (not the instant
    engine, not vLLM instances that hold them) on a CPU device (``EPD_DEVICE``)."""
    if settings.model == INSTANT_SPEC or settings.engine == "vllm":
        return False
    from runtime.model import resolve_device

    return resolve_device(settings.device).type == "cpu"


def apply_torch_threads(settings: Settings, *, model_on_cpu: bool) -> int:
    """Set torch's intra-op threads for this process by :func:`torch_threads`; the count in
    force afterwards."""
    import torch

    wanted = torch_threads(settings, model_on_cpu=model_on_cpu)
    if wanted is not None and torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return int(torch.get_num_threads())
