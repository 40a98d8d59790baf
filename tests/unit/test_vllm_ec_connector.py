"""The EC connector's vLLM-free logic: its settings, its keys and signed entries, the checks a
consumer makes before trusting an entry, and the framing between vLLM's encoder cache and our
store values. (Store I/O: test_vllm_ec_store.py; vLLM's interface: test_vllm_ec_interface.py.)
"""

from __future__ import annotations

import pytest
import torch

from epd_vllm_ec.entries import NO_ENTRY, item_key, signed_entry, verify_entry
from epd_vllm_ec.framing import FramingError, check_loaded, store_value, vllm_output
from epd_vllm_ec.settings import ConnectorConfigError, ConnectorSettings, connector_settings
from runtime.stores.base import pack_tensors
from schemas.families import DEEPSTACK, EMBEDS
from schemas.keys import embedding_key
from schemas.signing import make_ec_transfer

STORE = "redis://127.0.0.1:6379/14?key_prefix=t:"
SECRET_ENV = {"EPD_EC_SECRET": "s3cret-for-tests"}
NOW = 1_800_000_000_000
GOOD = {"store_url": STORE, "model_fingerprint": "qwen-abc123"}


def settings(**extra: object) -> ConnectorSettings:
    return connector_settings({**GOOD, **extra}, SECRET_ENV)


# --- settings ------------------------------------------------------------------------------


def test_settings_read_every_key_and_take_the_secret_from_the_named_variable() -> None:
    s = connector_settings(
        {
            **GOOD,
            "namespace": "tenant1",
            "secret_env": "MY_EC_KEY",
            "ttl_s": 30,
            "max_item_bytes": 1024,
            "io_timeout_s": 2.5,
            "deepstack_levels": 3,
        },
        {"MY_EC_KEY": "k" * 32},
    )
    assert (s.store_url, s.model_fingerprint, s.namespace) == (STORE, "qwen-abc123", "tenant1")
    assert (s.secret, s.ttl_s, s.max_item_bytes, s.io_timeout_s) == (b"k" * 32, 30.0, 1024, 2.5)
    assert s.deepstack_levels == 3
    d = settings()
    assert (d.namespace, d.ttl_s, d.deepstack_levels, d.secret) == (
        "ec",
        600.0,
        None,
        b"s3cret-for-tests",
    )


@pytest.mark.parametrize(
    ("extra", "env", "says"),
    [
        ({"model_fingerprint": "m"}, SECRET_ENV, "'store_url'"),
        ({"store_url": STORE}, SECRET_ENV, "'model_fingerprint'"),
        ({**GOOD, "store_url": "local://x"}, SECRET_ENV, "another process can read"),
        ({**GOOD, "store_url": "cuda://x"}, SECRET_ENV, "another process can read"),
        ({**GOOD, "stor_url": STORE}, SECRET_ENV, "unknown ec_connector_extra_config"),
        ({**GOOD, "secret": "inline"}, SECRET_ENV, "never written inline"),
        (GOOD, {}, "set EPD_EC_SECRET"),
        ({**GOOD, "secret_env": "OTHER"}, SECRET_ENV, "set OTHER"),
        (GOOD, {"EPD_EC_SECRET": "change-me"}, "a placeholder or shorter than 16"),
        (GOOD, {"EPD_EC_SECRET": "short-secret"}, "a placeholder or shorter than 16"),
        ({**GOOD, "ttl_s": 0}, SECRET_ENV, "ttl_s must be a positive"),
        ({**GOOD, "ttl_s": True}, SECRET_ENV, "ttl_s must be a positive"),
        ({**GOOD, "io_timeout_s": "5"}, SECRET_ENV, "io_timeout_s must be a positive"),
        ({**GOOD, "deepstack_levels": -1}, SECRET_ENV, "deepstack_levels"),
        ({**GOOD, "namespace": "a:b"}, SECRET_ENV, "must not hold ':'"),
        ({**GOOD, "model_fingerprint": "m:1"}, SECRET_ENV, "must not hold ':'"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(
    extra: dict[str, object], env: dict[str, str], says: str
) -> None:
    with pytest.raises(ConnectorConfigError, match=says):
        connector_settings(extra, env)


def test_a_refused_store_url_hides_its_password() -> None:
    with pytest.raises(ConnectorConfigError) as err:
        connector_settings({**GOOD, "store_url": "local://user:hunter2@host"}, SECRET_ENV)
    assert "hunter2" not in str(err.value)


# --- keys and entries ----------------------------------------------------------------------


def test_the_key_is_our_encode_workers_key() -> None:
    assert (
        item_key(settings(), "h1")
        == embedding_key("ec", "qwen-abc123", "h1")
        == ("ec:qwen-abc123:h1")
    )


def test_a_producers_entry_verifies_at_a_consumer_in_both_request_shapes() -> None:
    s = settings()
    entry = signed_entry(s, STORE, "h1", NOW + 60_000)
    assert entry["key"] == "ec:qwen-abc123:h1" and entry["signature"]
    for params in ({"h1": entry}, {"ec_items": [entry]}):
        verdict = verify_entry(params, "h1", s, STORE, NOW)
        assert verdict.trusted and verdict.key == "ec:qwen-abc123:h1", verdict


def test_an_entry_our_split_signs_for_a_key_under_another_hash_verifies() -> None:
    # `epd vllm split` keys the store by our own content hash while vLLM labels the item with
    # its mm_hash: the signature binds the two.
    ec = make_ec_transfer(
        mm_hash="vllm-label",
        store=STORE,
        key="ec:qwen-abc123:our-content-hash",
        expires_ms=NOW + 1000,
        secret=b"s3cret-for-tests",
    )
    entry = {f: getattr(ec, f) for f in ("mm_hash", "store", "key", "expires_ms", "signature")}
    verdict = verify_entry({"vllm-label": entry}, "vllm-label", settings(), STORE, NOW)
    assert verdict.key == "ec:qwen-abc123:our-content-hash"


def _refusal(entry: dict[str, object], mm_hash: str = "h1", store: str = STORE) -> str:
    verdict = verify_entry({mm_hash: entry}, mm_hash, settings(), store, NOW)
    assert not verdict.trusted and verdict.key is None
    return verdict.rule


def test_forged_foreign_mismatched_and_expired_entries_are_refused() -> None:
    s = settings()
    good = signed_entry(s, STORE, "h1", NOW + 60_000)
    assert _refusal({**good, "signature": "0" * 64}) == "ec-signature"
    # Another secret signed it.
    other = connector_settings({**GOOD}, {"EPD_EC_SECRET": "not-ours-" + "x" * 16})
    assert _refusal(signed_entry(other, STORE, "h1", NOW + 60_000)) == "ec-signature"
    # Signed by us for another store: this consumer reads its own store only.
    assert _refusal(good, store="redis://elsewhere:6379/0") == "ec-store"
    # Another model's embeddings (a key outside our fingerprint), signed or not.
    wrong_model = connector_settings({**GOOD, "model_fingerprint": "other"}, SECRET_ENV)
    assert _refusal(signed_entry(wrong_model, STORE, "h1", NOW + 60_000)) == "ec-key"
    # The signed fields edited: the key pointed at another item.
    assert _refusal({**good, "key": "ec:qwen-abc123:h2"}) == "ec-signature"
    # The entry filed under another item's hash.
    assert _refusal(good, mm_hash="h2") == "ec-entry"
    assert _refusal(signed_entry(s, STORE, "h1", NOW)) == "ec-expired"
    # An entry bound to one request of our pipeline is not replayable into vLLM.
    bound = make_ec_transfer(
        mm_hash="h1",
        store=STORE,
        key="ec:qwen-abc123:h1",
        expires_ms=NOW + 1000,
        secret=b"s3cret-for-tests",
        request_id="r1",
    )
    assert _refusal({"mm_hash": "h1", **_fields(bound)}) == "ec-signature"
    assert _refusal({"key": "ec:qwen-abc123:h1"}) == "ec-entry"  # unsigned


def _fields(ec: object) -> dict[str, object]:
    return {f: getattr(ec, f) for f in ("store", "key", "expires_ms", "signature")}


def test_no_entry_means_local_encoding_not_a_refusal() -> None:
    s = settings()
    assert verify_entry(None, "h1", s, STORE, NOW) is NO_ENTRY
    assert verify_entry({"h2": signed_entry(s, STORE, "h2", NOW + 1)}, "h1", s, STORE, NOW) is (
        NO_ENTRY
    )
    assert verify_entry(["h1"], "h1", s, STORE, NOW).rule == "ec-entry"  # type: ignore[arg-type]


# --- framing -------------------------------------------------------------------------------


def test_a_single_output_is_stored_as_itself() -> None:
    out = torch.randn(5, 8).to(torch.bfloat16)
    value = store_value(out, 0)
    assert isinstance(value, torch.Tensor) and torch.equal(value, out)
    assert torch.equal(vllm_output(value, "k"), out)


def test_deepstack_is_split_into_our_entry_and_joined_back_in_vllms_order() -> None:
    tokens, hidden, levels = 4, 6, 3
    embeds = torch.randn(tokens, hidden)
    deepstack = torch.randn(levels, tokens, hidden)
    # vLLM's layout: [hidden | deepstack_0 | ... ] along the width (Qwen3_VisionTransformer).
    vllm = torch.cat([embeds, *deepstack], dim=1)
    value = store_value(vllm, levels)
    assert isinstance(value, dict)
    assert torch.equal(value[EMBEDS], embeds) and torch.equal(value[DEEPSTACK], deepstack)
    packed = torch.frombuffer(pack_tensors(value), dtype=torch.uint8)
    assert torch.equal(vllm_output(packed, "k"), vllm)
    with pytest.raises(FramingError, match="does not split"):
        store_value(torch.randn(tokens, 7), levels)
    with pytest.raises(FramingError, match=r"\(tokens, width\)"):
        store_value(torch.randn(7), 0)


def test_values_that_are_not_encoder_outputs_are_refused() -> None:
    with pytest.raises(FramingError, match="not an encoder output"):
        vllm_output(torch.zeros(2, 2, 2), "k")
    stray = torch.frombuffer(pack_tensors({"pixel_values": torch.zeros(2, 3)}), dtype=torch.uint8)
    with pytest.raises(FramingError, match="members"):
        vllm_output(stray, "k")
    wrong = pack_tensors({EMBEDS: torch.zeros(2, 3), DEEPSTACK: torch.zeros(1, 3, 3)})
    with pytest.raises(FramingError, match="does not match"):
        vllm_output(torch.frombuffer(wrong, dtype=torch.uint8), "k")


def test_a_loaded_output_must_fit_its_placeholder_and_the_size_bound() -> None:
    out = torch.zeros(4, 8)
    check_loaded(out, "k", 4, 128)
    with pytest.raises(FramingError, match="needs 5"):
        check_loaded(out, "k", 5, 128)
    with pytest.raises(FramingError, match="max_item_bytes"):
        check_loaded(out, "k", 4, 127)
