"""The status vocabulary is one ``Literal`` (``schemas/statuses.py``): every other spelling is
derived from it, or (the client, which imports nothing of ours) tied to it here."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from frontend import client
from frontend.api.protocol import Accepted, RequestStatus
from schemas.status_record import _rank
from schemas.statuses import ACTIVE_STATUSES, STATUSES, TERMINAL_STATUSES, Status
from tests.unit.test_import_graph import PACKAGES

OURS = {*PACKAGES, "tests"}


def test_the_vocabulary_splits_into_active_and_terminal() -> None:
    assert set(STATUSES) == set(ACTIVE_STATUSES) | TERMINAL_STATUSES
    assert not set(ACTIVE_STATUSES) & TERMINAL_STATUSES
    assert get_args(Status) == STATUSES


def test_the_client_copy_is_the_contracts() -> None:
    assert client.TERMINAL == TERMINAL_STATUSES


def test_the_client_imports_nothing_of_ours() -> None:
    # Why it keeps a copy: users vendor frontend/client.py alone.
    tree = ast.parse(Path(client.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {name.split(".")[0] for name in names} & OURS


def test_the_api_schema_lists_every_status() -> None:
    for model in (Accepted, RequestStatus):
        assert model.model_json_schema()["properties"]["status"]["enum"] == list(STATUSES)


def test_a_record_ranks_statuses_in_pipeline_order() -> None:
    ranks = [_rank(s) for s in ACTIVE_STATUSES]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    assert {_rank(s) for s in TERMINAL_STATUSES} == {max(ranks) + 1}


def test_the_openai_response_status_table_maps_every_status() -> None:
    from frontend.api.openai_compat.views import RESPONSE_STATUS

    assert set(RESPONSE_STATUS) == set(STATUSES)
