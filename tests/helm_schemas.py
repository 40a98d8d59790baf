"""Offline validation of rendered Kubernetes manifests against the official schemas.

The schemas are the ones the projects publish, fetched from the Go module proxy by
``tools/install-tools.sh k8s-schemas`` into ``.tools/schemas/``:

- Kubernetes' OpenAPI v3 spec (``api/openapi-spec/v3/*.json`` of the ``k8s.io/kubernetes``
  module), one document per group/version, each holding every schema its kinds reference;
- KEDA's CustomResourceDefinitions (``config/crd/bases/`` of ``github.com/kedacore/keda/v2``),
  whose ``openAPIV3Schema`` is what the API server checks a ScaledObject against.

- the parameters KEDA's kafka scaler declares (the ``keda:"name=..."`` struct tags of
  ``pkg/scalers/kafka_scaler.go`` in the same module): the CRD types a trigger's metadata only
  as a map of strings, so a misspelt ``lagTreshold`` would pass it and be ignored by KEDA.

Each object is validated against the schema of its ``apiVersion``/``kind`` (found by the
spec's ``x-kubernetes-group-version-kind``) with ``jsonschema_rs``. Strict, as ``kubectl``'s
server-side field validation is: an object schema that lists its properties gets
``additionalProperties: false`` (unless it preserves unknown fields), so a misspelt or
misplaced field is an error instead of being dropped. A CRD's ``metadata`` is only
``type: object``; it is checked against the core ObjectMeta schema instead.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema_rs
import yaml

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / ".tools"
INSTALL_SCRIPT = ROOT / "tools" / "install-tools.sh"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
# Schema keywords whose values are schemas, and those whose values are lists or maps of them.
_ONE = ("items", "additionalProperties", "not")
_MANY = ("allOf", "anyOf", "oneOf")


def pinned(name: str) -> str:
    """A version pinned in tools/install-tools.sh (``HELM_VERSION`` and the like): the one home
    of the tool versions, read back so the tests and the script cannot disagree."""
    match = re.search(rf"^{name}=(\S+)$", INSTALL_SCRIPT.read_text(), flags=re.M)
    if match is None:
        raise LookupError(f"{INSTALL_SCRIPT} pins no {name}")
    return match.group(1)


def kubernetes_dir() -> Path:
    return TOOLS / "schemas" / f"kubernetes-{pinned('KUBERNETES_VERSION')}"


def keda_dir() -> Path:
    return TOOLS / "schemas" / f"keda-{pinned('KEDA_VERSION')}"


def strict(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema with ``properties`` and no word on
    other keys refuses them (``additionalProperties: false``)."""
    schema = copy.deepcopy(schema)
    _close(schema)
    return schema


def strict_all(schemas: dict[str, Any]) -> dict[str, Any]:
    """:func:`strict` applied to each schema of a ``components.schemas`` map."""
    return {name: strict(schema) for name, schema in schemas.items()}


def _close(node: Any) -> None:
    if not isinstance(node, dict):
        return
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        node["additionalProperties"] = False
    for sub in node.get("properties", {}).values():
        _close(sub)
    for key in _ONE:
        _close(node.get(key))
    for key in _MANY:
        for sub in node.get(key, []):
            _close(sub)


TAG = re.compile(r'`keda:"([^"]+)"`')


@dataclass(frozen=True)
class TriggerParam:
    """One parameter of a KEDA scaler, as its ``keda:"..."`` struct tag declares it."""

    name: str
    in_metadata: bool  # read from the trigger's metadata (not only from authParams)
    from_env: bool  # may come as ``<name>FromEnv``, the name of a container env variable
    required: bool  # neither optional nor defaulted
    allowed: tuple[str, ...]  # an enum's values; empty: any string


def trigger_params(source: str) -> dict[str, TriggerParam]:
    """The parameters a KEDA scaler's Go source declares, by name."""
    out = {}
    for tag in TAG.findall(source):
        fields = [f.strip() for f in tag.split(",")]
        pairs = dict(f.split("=", 1) for f in fields if "=" in f)
        order = pairs.get("order", "").split(";")
        out[pairs["name"]] = TriggerParam(
            name=pairs["name"],
            in_metadata="triggerMetadata" in order,
            from_env="resolvedEnv" in order,
            required="optional" not in fields and "default" not in pairs,
            allowed=tuple(pairs["enum"].split(";")) if "enum" in pairs else (),
        )
    return out


def metadata_problems(params: dict[str, TriggerParam], metadata: dict[str, Any]) -> list[str]:
    """What is wrong with one trigger's metadata for a scaler of ``params``."""
    known = {p.name for p in params.values() if p.in_metadata}
    known |= {f"{p.name}FromEnv" for p in params.values() if p.in_metadata and p.from_env}
    out = [f"unknown parameter {k!r}" for k in sorted(set(metadata) - known)]
    for p in params.values():
        if p.required and p.in_metadata and p.name not in metadata:
            if not (p.from_env and f"{p.name}FromEnv" in metadata):
                out.append(f"missing required parameter {p.name!r}")
        if p.allowed and p.name in metadata and metadata[p.name] not in p.allowed:
            out.append(f"{p.name}={metadata[p.name]!r} is not one of {list(p.allowed)}")
    return out


@dataclass(frozen=True)
class Problem:
    """One reason an object is invalid: which object, where in it, and what is wrong."""

    obj: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.obj} at {self.path or '/'}: {self.message}"


class ManifestValidator:
    """Validates Kubernetes objects (dicts) against the Kubernetes spec and KEDA's CRDs."""

    def __init__(self, kubernetes: Path, keda: Path) -> None:
        for folder in (kubernetes, keda):
            if not folder.is_dir():
                raise FileNotFoundError(f"{folder} is missing: run tools/install-tools.sh")
        self.kubernetes = kubernetes
        self.keda = keda
        # Compiling a group's schemas takes a while; each kind's validator is built once.
        self._validators: dict[tuple[str, str], Any] = {}

    def _validator(self, api_version: str, kind: str) -> Any:
        key = (api_version, kind)
        if key not in self._validators:
            self._validators[key] = self._build(api_version, kind)
        return self._validators[key]

    def _build(self, api_version: str, kind: str) -> Any:
        group, _, version = api_version.rpartition("/")
        crd = self._crd_schema(group, version, kind)
        if crd is not None:
            return jsonschema_rs.Draft4Validator(crd)
        name = f"api__{version}" if not group else f"apis__{group}__{version}"
        path = self.kubernetes / f"{name}_openapi.json"
        if not path.exists():
            raise LookupError(f"no Kubernetes schema for {api_version} (no {path.name})")
        schemas = json.loads(path.read_text())["components"]["schemas"]
        want = {"group": group, "version": version, "kind": kind}
        found = [
            n for n, s in schemas.items() if want in s.get("x-kubernetes-group-version-kind", [])
        ]
        if not found:
            raise LookupError(f"{path.name} defines no {kind}")
        root = {"components": {"schemas": strict_all(schemas)}}
        return jsonschema_rs.Draft4Validator({**root, "$ref": f"#/components/schemas/{found[0]}"})

    def _crd_schema(self, group: str, version: str, kind: str) -> dict[str, Any] | None:
        for path in sorted(self.keda.glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            spec = crd["spec"]
            if spec["group"] != group or spec["names"]["kind"] != kind:
                continue
            for v in spec["versions"]:
                if v["name"] == version:
                    schema: dict[str, Any] = strict(v["schema"]["openAPIV3Schema"])
                    # The CRD says only `type: object` of metadata: take the core ObjectMeta
                    # (and the core schemas it refers to).
                    core = json.loads((self.kubernetes / "api__v1_openapi.json").read_text())
                    schema["components"] = {"schemas": strict_all(core["components"]["schemas"])}
                    schema["properties"]["metadata"] = {
                        "$ref": f"#/components/schemas/{OBJECT_META}"
                    }
                    return schema
            raise LookupError(f"{path.name} has no version {version} of {kind}")
        return None

    def problems(self, objects: Iterable[dict[str, Any]]) -> list[Problem]:
        """Every schema violation of ``objects`` (empty: all valid). An object of a kind no
        schema covers is a problem too: nothing goes unchecked."""
        out: list[Problem] = []
        for obj in objects:
            label = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
            try:
                validator = self._validator(str(obj.get("apiVersion")), str(obj.get("kind")))
            except LookupError as exc:
                out.append(Problem(label, "", str(exc)))
                continue
            for error in validator.iter_errors(obj):
                path = "/".join(str(p) for p in error.instance_path)
                out.append(Problem(label, path, error.message))
            out += self._trigger_problems(label, obj)
        return out

    def _trigger_problems(self, label: str, obj: dict[str, Any]) -> list[Problem]:
        """The kafka triggers of a ScaledObject against the kafka scaler's parameters."""
        if obj.get("kind") != "ScaledObject":
            return []
        params = trigger_params((self.keda / "kafka_scaler.go").read_text())
        out = []
        for i, trigger in enumerate(obj.get("spec", {}).get("triggers", [])):
            if trigger.get("type") != "kafka":
                continue
            for message in metadata_problems(params, trigger.get("metadata", {})):
                out.append(Problem(label, f"spec/triggers/{i}/metadata", message))
        return out


def load_manifests(text: str) -> list[dict[str, Any]]:
    """The objects of a multi-document YAML stream (``helm template``'s output)."""
    return [doc for doc in yaml.safe_load_all(text) if doc]


def default_validator() -> ManifestValidator:
    """The validator over the pinned schemas in ``.tools/schemas`` (FileNotFoundError when
    ``tools/install-tools.sh k8s-schemas`` has not run)."""
    return ManifestValidator(kubernetes_dir(), keda_dir())


def main(argv: list[str]) -> int:
    """``python -m tests.helm_schemas [FILE...]``: validate rendered manifests (``-`` or none:
    standard input, e.g. piped from ``helm template``); one line per problem, exit 1 if any."""
    import sys

    texts = [sys.stdin.read() if a == "-" else Path(a).read_text() for a in argv or ["-"]]
    objects = [o for text in texts for o in load_manifests(text)]
    problems = default_validator().problems(objects)
    for problem in problems:
        print(problem)
    versions = f"Kubernetes {pinned('KUBERNETES_VERSION')}, KEDA {pinned('KEDA_VERSION')}"
    kinds = ", ".join(sorted({str(o.get("kind")) for o in objects}))
    print(f"{len(objects)} objects ({kinds}): {len(problems)} problems against {versions}")
    return 1 if problems or not objects else 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
