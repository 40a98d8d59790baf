"""One set of Prometheus series per registry, shared by every component that asks for it.

Several consume loops (or workers) in one process then share their series instead of
registering the same names twice; without a registry a component gets private, unregistered
series (tests).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

M = TypeVar("M")

_SETS: weakref.WeakKeyDictionary[CollectorRegistry, dict[Any, Any]] = weakref.WeakKeyDictionary()


def per_registry(
    factory: Callable[[CollectorRegistry | None], M], registry: CollectorRegistry | None
) -> M:
    """``factory(registry)``, made once per (registry, factory); a fresh private set for None."""
    if registry is None:
        return factory(None)
    sets = _SETS.setdefault(registry, {})
    if factory not in sets:
        sets[factory] = factory(registry)
    return sets[factory]  # type: ignore[no-any-return]
