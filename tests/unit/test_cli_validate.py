"""``epd validate`` and ``epd vllm split``: exit codes, output, settings and flags."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epd.commands import validate as validate_cmd
from epd.commands import vllm as vllm_cmd
from runtime.settings import get_settings
from tests.unit.test_vllm_wire import make_render


@pytest.fixture(autouse=True)
def clean_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Settings come from a known environment, re-read for every test."""
    for var in (
        "EPD_EC_SECRET",
        "EPD_VALIDATION_MODE",
        "EPD_SPATIAL_MERGE_SIZE",
        "EPD_EC_NAMESPACE",
    ):
        monkeypatch.delenv(var, raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="epd")
    sub = parser.add_subparsers()
    validate_cmd.register(sub)
    vllm_cmd.register(sub)
    args = parser.parse_args(list(argv))
    return int(args.func(args))


def write(tmp_path: Path, name: str, obj: Any) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


def split(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    render = write(tmp_path, "render.json", make_render())
    capsys.readouterr()
    assert run("vllm", "split", render, *flags) == 0
    return json.loads(capsys.readouterr().out)


def test_validate_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path, "r.json", make_render(omit_empty_modality=False))
    assert run("validate", f) == 0
    assert capsys.readouterr().out.strip() == "ok"


def test_validate_rejects_with_rule_modality_item(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    req = make_render(omit_empty_modality=False)
    req["features"]["kwargs_data"]["image"][1] = None  # metadata-only, no EC params
    f = write(tmp_path, "r.json", req)
    for mode in ("strict", "vllm"):
        assert run("validate", "--mode", mode, f) == 1
        err = capsys.readouterr().err
        assert "rule=ec-transfer-required" in err
        assert "modality=image" in err and "item=1" in err


def test_validate_modes_differ_on_both_none_slot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    req = make_render(image_meta=False)
    req["features"]["kwargs_data"]["image"][0] = None  # processor-cache hit in vLLM terms
    f = write(tmp_path, "r.json", req)
    assert run("validate", "--mode", "vllm", f) == 0
    assert run("validate", f) == 1  # strict is the default
    assert "rule=ec-transfer-required" in capsys.readouterr().err


def test_validate_mode_from_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    req = make_render(image_meta=False)
    req["features"]["kwargs_data"]["image"][0] = None
    f = write(tmp_path, "r.json", req)
    monkeypatch.setenv("EPD_VALIDATION_MODE", "vllm")
    get_settings.cache_clear()
    assert run("validate", f) == 0
    assert run("validate", "--mode", "strict", f) == 1


def test_validate_exit_2_on_unreadable_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert run("validate", str(bad)) == 2
    assert run("validate", str(tmp_path / "missing.json")) == 2
    assert "cannot read JSON" in capsys.readouterr().err


def test_validate_reads_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        "sys.stdin", io.StringIO(json.dumps({"token_ids": [1, 2], "sampling_params": {}}))
    )
    assert run("validate", "-") == 0
    monkeypatch.setattr(
        "sys.stdin", io.StringIO(json.dumps({"token_ids": [-1], "sampling_params": {}}))
    )
    assert run("validate", "-") == 1
    assert "rule=token-ids" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("[]"))
    assert run("validate", "-") == 1  # readable JSON, wrong shape: a rejection
    assert "rule=request-shape" in capsys.readouterr().err


def test_validate_merge_size_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path, "r.json", make_render(omit_empty_modality=False))
    assert run("validate", "--merge-size", "1", f) == 1
    assert "rule=grid-consistency" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "-2", "x"])
def test_validate_merge_size_must_be_positive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    f = write(tmp_path, "r.json", make_render(omit_empty_modality=False))
    with pytest.raises(SystemExit) as ei:
        run("validate", "--merge-size", bad, f)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--merge-size" in err and "Traceback" not in err


def test_split_then_validate_prefill_both_modes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EPD_EC_SECRET", "cli-secret")
    get_settings.cache_clear()
    out = split(tmp_path, capsys)
    assert len(out["encode"]) == 3
    assert all(e["sampling_params"]["max_tokens"] == 1 for e in out["encode"])
    pre = write(tmp_path, "prefill.json", out["prefill"])
    assert out["prefill"]["features"]["kwargs_data"] is None
    for mode in ("strict", "vllm"):
        assert run("validate", "--mode", mode, pre) == 0
    # A different key fails the signature check; so does a tampered entry.
    assert run("validate", "--secret", "other", pre) == 1
    assert "rule=ec-signature" in capsys.readouterr().err
    tampered = out["prefill"]
    tampered["ec_transfer_params"]["img-a"]["key"] = "ec:other-model:img-a"
    assert run("validate", write(tmp_path, "t.json", tampered)) == 1
    assert "rule=ec-signature" in capsys.readouterr().err
    # Pointing an item at another item's embeddings: the signature binds label and key.
    tampered["ec_transfer_params"]["img-a"]["key"] = "ec:tiny:img-b"
    assert run("validate", write(tmp_path, "t2.json", tampered)) == 1
    assert "rule=ec-signature modality=image item=0" in capsys.readouterr().err
    # Unsigned, the key's hash must be the item's own label.
    monkeypatch.delenv("EPD_EC_SECRET")
    get_settings.cache_clear()
    assert run("validate", write(tmp_path, "t3.json", tampered)) == 1
    assert "rule=ec-key modality=image item=0" in capsys.readouterr().err


def test_split_with_given_ec_params(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    params = {"img-a": {"x": 1}, "img-b": {"x": 2}, "vid-a": {"x": 3}}
    out = split(tmp_path, capsys, "--ec-transfer-params", json.dumps(params))
    assert out["prefill"]["ec_transfer_params"] == params
    assert out["encode"][0]["ec_transfer_params"] == {"img-a": {"x": 1}}
    pfile = write(tmp_path, "params.json", params)
    out2 = split(tmp_path, capsys, "--ec-transfer-params", "@" + pfile)
    assert out2["prefill"]["ec_transfer_params"] == params


def test_split_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = split(
        tmp_path,
        capsys,
        "--namespace",
        "tenant",
        "--store",
        "shm://x",
        "--model-fingerprint",
        "fp9",
        "--secret",
        "k",
    )
    e = out["prefill"]["ec_transfer_params"]["vid-a"]
    assert (e["key"], e["store"]) == ("tenant:fp9:vid-a", "shm://x")
    pre = write(tmp_path, "p.json", out["prefill"])
    assert run("validate", "--secret", "k", "--namespace", "tenant", pre) == 0
    assert run("validate", "--secret", "k", pre) == 1
    assert "rule=ec-namespace" in capsys.readouterr().err


def test_split_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("nope")
    assert run("vllm", "split", str(bad)) == 2
    good = write(tmp_path, "r.json", make_render())
    assert run("vllm", "split", good, "--ec-transfer-params", "{broken") == 2
    assert run("vllm", "split", good, "--ec-transfer-params", "[1]") == 2
    broken = make_render()
    broken["features"]["kwargs_data"]["video"][0] = "!!"
    assert run("vllm", "split", write(tmp_path, "b.json", broken)) == 1
    err = capsys.readouterr().err
    assert "rule=tensor" in err and "modality=video" in err and "item=0" in err
