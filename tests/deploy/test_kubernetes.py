"""deploy/kubernetes, checked offline (no cluster here): rendered, schema-valid, rules tested.

- ``kubectl kustomize`` renders every overlay and example (Debian's ``kubernetes-client``
  1.20, whose kustomize is v2.0.3, as well as current kubectl releases).
- Every built-in object validates against the Kubernetes OpenAPI schemas of the oldest
  supported release (1.29: native sidecars) and of the newest that ``kubernetes-validate``
  knows, strictly (an unknown field fails). Every PodMonitor and PrometheusRule validates
  with ``check-jsonschema`` against prometheus-operator's own CRD schemas (vendored under
  tests/deploy/schemas/), made strict the same way. The PyTorchJob's pod templates validate
  as core PodTemplateSpecs, and its spec against the fields of the training operator's v1
  API (``PYTORCHJOB_V1``, strict).
- The generated PrometheusRules and dashboard ConfigMaps are what deploy/kubernetes/build.py
  builds; the rule groups in the rendered overlays pass ``promtool check rules`` and every
  promtool unit test in tests/rules/, run against rule files extracted from the rendered
  PrometheusRules instead of deploy/prometheus/.
- The manifests agree with each other and with the exporter: socket paths, setting names, the
  scrape job the alerts expect, a run id that survives pod restarts, and a socket a non-root
  trainer can reach with the permissions the manifests set (run for real when root).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainmon_exporter.settings import Settings, environment_names

from ..conftest import ROOT, child_env, free_port, require_tool, wait_for
from ..helpers.cardinality import BUDGET
from ..helpers.checkout import tracked

K8S = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).with_name("schemas") / "prometheus-operator-v0.93.0"
OVERLAYS = sorted(
    p.parent.relative_to(K8S) for p in tracked("overlays/*/kustomization.yaml", under=K8S)
)
EXAMPLES = sorted(
    p.parent.relative_to(K8S) for p in tracked("examples/*/kustomization.yaml", under=K8S)
)
KUSTOMIZATIONS = [*OVERLAYS, *EXAMPLES]
K8S_VERSIONS = ["1.29.0", "latest"]
CRD_FILES = {
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}
CUSTOM_KINDS = {*CRD_FILES, "PyTorchJob"}


def generator() -> Any:
    spec = importlib.util.spec_from_file_location("build_k8s", K8S / "build.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kubectl() -> str:
    return require_tool("kubectl", "kubernetes-client")


@functools.cache
def rendered(path: Path) -> tuple[dict[str, Any], ...]:
    """The objects ``kubectl kustomize deploy/kubernetes/<path>`` prints."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, f"kubectl kustomize {path}: {out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def objects(kind: str | None = None) -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in KUSTOMIZATIONS:
        for obj in rendered(path):
            if kind is None or obj["kind"] == kind:
                yield path, obj


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, pod spec)`` of every workload and custom resource with pod templates."""
    for path, obj in objects():
        name = f"{path}:{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ("DaemonSet", "Job"):
            yield name, obj["spec"]["template"]["spec"]
        elif obj["kind"] == "PyTorchJob":
            for rtype, rs in obj["spec"]["pytorchReplicaSpecs"].items():
                yield f"{name}/{rtype}", rs["template"]["spec"]


def is_exporter_image(image: str) -> bool:
    """``[registry/…/]trainmon-exporter[:tag]``."""
    return image.rsplit("/", 1)[-1].split(":")[0] == "trainmon-exporter"


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


# --------------------------------------------------------------------------- generation


def test_committed_objects_are_what_the_generator_builds() -> None:
    for path, text in generator().render().items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} is stale: run python deploy/kubernetes/build.py"
        )


def test_one_prometheusrule_per_rule_file_with_its_groups_unchanged() -> None:
    gen = generator()
    sources = {gen.rule_object_name(p): p for p in gen.rule_files()}
    assert {"trainmon-rules", "trainmon-alerts"} <= set(sources)
    for path in OVERLAYS:
        rules = {o["metadata"]["name"]: o for o in rendered(path) if o["kind"] == "PrometheusRule"}
        assert set(rules) == set(sources), path
        for name, obj in rules.items():
            assert obj["spec"]["groups"] == yaml.safe_load(sources[name].read_text())["groups"]


def test_dashboards_are_configmaps_the_grafana_sidecar_loads() -> None:
    files = {
        p.name: p.read_text() for p in tracked("*.json", under=ROOT / "deploy/grafana/dashboards")
    }
    for path in OVERLAYS:
        maps = [o for o in rendered(path) if o["kind"] == "ConfigMap"]
        got = {k: v for m in maps for k, v in m["data"].items()}
        assert got == files, path
        for m in maps:
            assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
            size = len(json.dumps(m).encode())
            assert size < 256 * 1024, f"{m['metadata']['name']}: {size} B, over kubectl apply's cap"


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=str)
def test_kustomize_renders(path: Path) -> None:
    objs = rendered(path)
    assert objs
    for o in objs:
        assert o["apiVersion"] and o["kind"] and o["metadata"]["name"], o
    if path in OVERLAYS:
        assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {
            "trainmon-system"
        }


def test_every_overlay_renders_the_same_daemonset_selector() -> None:
    """Kubernetes never lets a DaemonSet's spec.selector change: switching overlays, or
    renaming a release, must apply over the objects already there. Every overlay that has
    the DaemonSet renders the base's selector, and the pod template still carries it."""
    base = yaml.safe_load((K8S / "base" / "exporter" / "daemonset.yaml").read_text())
    selectors = {}
    for path in OVERLAYS:
        for obj in rendered(path):
            if obj["kind"] == "DaemonSet":
                selectors[str(path)] = obj["spec"]["selector"]
                labels = obj["spec"]["template"]["metadata"]["labels"]
                assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items(), path
    assert len(selectors) >= 2, selectors  # the premise: more than one overlay has it
    for where, selector in selectors.items():
        assert selector == base["spec"]["selector"], where


def test_kube_prometheus_stack_overlay_labels_monitors_and_rules_with_the_release() -> None:
    """Its Prometheus selects PodMonitors and PrometheusRules by ``release``: every one the
    overlay renders carries it (a rule file added without its entry in release-label.yaml
    fails here)."""
    objs = rendered(Path("overlays/kube-prometheus-stack"))
    selected = [o for o in objs if o["kind"] in CRD_FILES]
    assert {o["kind"] for o in selected} == set(CRD_FILES)
    for o in selected:
        assert o["metadata"]["labels"].get("release") == "kube-prometheus-stack", o["metadata"]
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    assert "release" not in json.dumps(ds["spec"]), "the release label must stay off the pods"


PROMETHEUS_K8S = {"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"}
"""kube-prometheus's Prometheus identity (manifests/prometheus-serviceAccount.yaml), which its
own Roles let list pods only in default, kube-system and monitoring."""


def _can(objs: tuple[dict[str, Any], ...], who: dict[str, str], ns: str, verb: str) -> bool:
    """Whether the Roles and RoleBindings among ``objs`` let ``who`` ``verb`` pods in ``ns``
    (RBAC's rule: a RoleBinding in ``ns`` naming the subject, whose Role in ``ns`` has a rule
    for the core group, resource pods and the verb)."""
    roles = {
        o["metadata"]["name"]: o
        for o in objs
        if o["kind"] == "Role" and o["metadata"].get("namespace") == ns
    }
    for rb in objs:
        if rb["kind"] != "RoleBinding" or rb["metadata"].get("namespace") != ns:
            continue
        if who not in rb["subjects"] or rb["roleRef"]["kind"] != "Role":
            continue
        role = roles.get(rb["roleRef"]["name"])
        for rule in (role or {}).get("rules", []):
            if (
                "" in rule["apiGroups"]
                and {"pods", "*"} & set(rule["resources"])
                and {verb, "*"} & set(rule["verbs"])
            ):
                return True
    return False


def test_kube_prometheus_overlay_lets_its_prometheus_discover_the_exporters() -> None:
    """kube-prometheus's Prometheus may get, list and watch pods in the DaemonSet's namespace
    (what its PodMonitor's discovery needs), nothing more, and only that ServiceAccount."""
    objs = rendered(Path("overlays/kube-prometheus"))
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    ns = ds["metadata"]["namespace"]
    for verb in ("get", "list", "watch"):
        assert _can(objs, PROMETHEUS_K8S, ns, verb), verb
    for verb in ("create", "delete", "update", "patch"):
        assert not _can(objs, PROMETHEUS_K8S, ns, verb), verb
    someone = {**PROMETHEUS_K8S, "namespace": ns}
    assert not _can(objs, someone, ns, "list")  # the subject keeps its own namespace
    # the check can fail: the DaemonSet overlay alone grants nothing
    assert not _can(rendered(Path("overlays/daemonset")), PROMETHEUS_K8S, ns, "list")


def test_the_access_for_training_namespaces_takes_the_namespace_kubectl_gives() -> None:
    """base/prometheus-k8s-access, applied with ``kubectl apply -n <training namespace> -k``
    for the sidecar variant: no namespace of its own, so -n places it."""
    objs = rendered(Path("base/prometheus-k8s-access"))
    assert {o["kind"] for o in objs} == {"Role", "RoleBinding"}
    assert all("namespace" not in o["metadata"] for o in objs)
    placed = tuple({**o, "metadata": {**o["metadata"], "namespace": "ml-team"}} for o in objs)
    assert _can(placed, PROMETHEUS_K8S, "ml-team", "list")


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_validate_against_kubernetes_schemas(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -r requirements-dev.txt")
    version = kv.latest_version() if version == "latest" else version
    seen = set()
    for path, obj in objects():
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{path}: {obj['kind']}/{obj['metadata']['name']} on {version}: {exc}")
        seen.add(obj["kind"])
    assert {
        "DaemonSet",
        "Job",
        "Service",
        "ServiceAccount",
        "ConfigMap",
        "Namespace",
        "NetworkPolicy",
    } <= seen


def test_pytorchjob_pod_templates_validate_as_pod_templates() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -r requirements-dev.txt")
    jobs = [o for _, o in objects("PyTorchJob")]
    assert jobs
    for job in jobs:
        for rtype, rs in job["spec"]["pytorchReplicaSpecs"].items():
            template = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{job['metadata']['name']}-{rtype.lower()}"},
                "template": rs["template"],
            }
            kv.validate(template, kv.latest_version(), strict=True)
            # the training operator finds its container by this name
            assert [c["name"] for c in rs["template"]["spec"]["containers"]] == ["pytorch"]


PYTORCHJOB_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["pytorchReplicaSpecs"],
            "properties": {
                "runPolicy": {"type": "object"},
                "elasticPolicy": {"type": "object"},
                "nprocPerNode": {"type": "string"},
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "minProperties": 1,
                    "propertyNames": {"enum": ["Master", "Worker"]},
                    "additionalProperties": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["template"],
                        "properties": {
                            "replicas": {"type": "integer", "minimum": 0},
                            "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
                            "template": {"type": "object"},
                        },
                    },
                },
            },
        },
    },
}
"""The fields of the training operator's ``kubeflow.org/v1`` PyTorchJob spec (its API types:
``PyTorchJobSpec``, ``ReplicaSpec``) that a job may set, strictly: a misspelt field or replica
type fails here instead of being dropped by the API server. The pod templates are checked
against the Kubernetes schemas above."""


def test_pytorchjob_spec_has_only_fields_of_the_v1_api() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="pip install -r requirements-dev.txt")
    jobs = [o for _, o in objects("PyTorchJob")]
    assert jobs
    for job in jobs:
        jsonschema.validate(job, PYTORCHJOB_V1)
    broken = json.loads(json.dumps(jobs[0]))
    broken["spec"]["pytorchReplicaSpecs"]["Workers"] = broken["spec"]["pytorchReplicaSpecs"].pop(
        "Worker"
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, PYTORCHJOB_V1)


def strict_schema(node: Any) -> Any:
    """A CRD's openAPIV3Schema as the API server applies it with strict field validation.

    Objects with ``properties`` (and no ``x-kubernetes-preserve-unknown-fields``) refuse
    other keys; Go's ``^(?i)…`` patterns become ``(?i)^…`` (Python accepts flags only first).
    """
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items()}
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    pattern = out.get("pattern")
    if isinstance(pattern, str) and "(?i)" in pattern and not pattern.startswith("(?i)"):
        out["pattern"] = "(?i)" + pattern.replace("(?i)", "")
    return out


def crd_schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((SCHEMAS / CRD_FILES[kind]).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict_schema(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    schema["$schema"] = "http://json-schema.org/draft-07/schema#"
    props = schema["properties"]
    props["apiVersion"] = {"const": f"{crd['spec']['group']}/v1"}
    props["kind"] = {"const": kind}
    # metadata is {type: object} in the CRD: the API server checks it, so check names here
    props["metadata"] = {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}},
    }
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return schema


def check_jsonschema(schema: dict[str, Any], docs: list[dict[str, Any]], tmp: Path) -> str:
    """Run check-jsonschema on ``docs``; returns its output, fails the test on rc != 0."""
    exe = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("check-jsonschema not installed (pip install -r requirements-dev.txt)")
    tmp.mkdir(parents=True, exist_ok=True)
    schema_file = tmp / "schema.json"
    schema_file.write_text(json.dumps(schema))
    files = []
    for i, d in enumerate(docs):
        f = tmp / f"{i:02d}-{d['kind']}-{d['metadata']['name']}.yaml"
        f.write_text(yaml.safe_dump(d))
        files.append(str(f))
    out = subprocess.run(
        [exe, "--regex-variant", "python", "--schemafile", str(schema_file), *files],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return f"rc={out.returncode}\n{out.stdout}{out.stderr}"


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_custom_resources_validate_against_the_operator_crds(kind: str, tmp_path: Path) -> None:
    docs = [o for _, o in objects(kind)]
    assert docs, f"no {kind} rendered"
    out = check_jsonschema(crd_schema(kind), docs, tmp_path)
    assert out.startswith("rc=0"), out


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda pm: pm["spec"]["podMetricsEndpoints"][0].update(port=9478), "is not of type"),
        (lambda pm: pm["spec"]["podMetricsEndpoints"][0].update(interval="15 s"), "match"),
        (lambda pm: pm["spec"].update(podMetricEndpoints=[]), "Additional properties"),
    ],
    ids=["numeric port", "bad duration", "misspelt field"],
)
def test_the_crd_check_rejects_a_broken_podmonitor(change: Any, error: str, tmp_path: Path) -> None:
    """The schema check can fail: a PodMonitor with each mistake is rejected."""
    pm = copy.deepcopy(next(o for _, o in objects("PodMonitor")))
    change(pm)
    out = check_jsonschema(crd_schema("PodMonitor"), [pm], tmp_path)
    assert out.startswith("rc=1") and error in out, out


# --------------------------------------------------------------------------- rules


def extracted_rules(tmp: Path, overlay: Path) -> dict[str, Path]:
    """Write each rendered PrometheusRule's groups as a rule file named like its source.

    Returns ``{source file name: extracted path}``.
    """
    gen = generator()
    by_object = {gen.rule_object_name(p): p.name for p in gen.rule_files()}
    tmp.mkdir(parents=True, exist_ok=True)
    out = {}
    for obj in rendered(overlay):
        if obj["kind"] == "PrometheusRule":
            source = by_object[obj["metadata"]["name"]]
            path = tmp / source
            path.write_text(yaml.safe_dump({"groups": obj["spec"]["groups"]}, sort_keys=False))
            out[source] = path
    return out


@pytest.mark.parametrize("overlay", OVERLAYS, ids=str)
def test_prometheusrule_groups_pass_promtool(overlay: Path, tmp_path: Path) -> None:
    promtool = require_tool("promtool", "prometheus")
    files = extracted_rules(tmp_path, overlay)
    out = subprocess.run(
        [promtool, "check", "rules", *map(str, files.values())],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


UNIT_TESTS = [p.name for p in tracked("*_test.yml", under=ROOT / "tests" / "rules")]


@pytest.mark.parametrize("name", UNIT_TESTS)
def test_promtool_unit_tests_pass_on_the_rendered_rules(name: str, tmp_path: Path) -> None:
    """tests/rules/<name>, its rule_files swapped for the rendered PrometheusRules' groups."""
    promtool = require_tool("promtool", "prometheus")
    files = extracted_rules(tmp_path / "rules", Path("overlays/daemonset"))
    text = (ROOT / "tests" / "rules" / name).read_text()
    # The paths are swapped in the text: a YAML round trip would rewrite values such as
    # "0x20" (promtool's "0, 20 times") as the hex integer 32.
    for rf in yaml.safe_load(text)["rule_files"]:
        source = Path(rf).name
        assert source in files, f"{name} tests {rf}, which no PrometheusRule carries"
        assert text.count(rf) == 1, f"{rf} must appear once in {name}"
        text = text.replace(rf, str(files[source]))
    test_file = tmp_path / name
    test_file.write_text(text)
    out = subprocess.run(
        [promtool, "test", "rules", str(test_file)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_podmonitors_give_the_job_the_alerts_expect() -> None:
    jobs_in_rules = set()
    for p in generator().rule_files():
        jobs_in_rules |= set(re.findall(r'\bjob="([^"]+)"', p.read_text()))
    assert jobs_in_rules, "the rules no longer name a job: drop this test's premise"
    pms = [o for _, o in objects("PodMonitor")]
    assert len({o["metadata"]["name"] for o in pms}) == 2  # the DaemonSet's and the sidecars'
    for pm in pms:
        for ep in pm["spec"]["podMetricsEndpoints"]:
            set_job = [r["replacement"] for r in ep["relabelings"] if r["targetLabel"] == "job"]
            assert set_job and set(set_job) <= jobs_in_rules, (pm["metadata"]["name"], set_job)


# --------------------------------------------------------------------------- agreement


def exporter_containers_of(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for c in containers(spec):
        if is_exporter_image(str(c["image"])) and "command" not in c:
            yield c


def exporter_containers() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for where, spec in pod_specs():
        for c in exporter_containers_of(spec):
            yield where, spec, c


def test_every_trainmon_variable_in_the_manifests_is_a_real_setting() -> None:
    known = environment_names()
    used = {
        name
        for _, spec in pod_specs()
        for c in containers(spec)
        for name in env(c)
        if name.startswith("TRAINMON_")
    }
    assert used and not used - known, f"unknown: {sorted(used - known)}"


def test_trainers_and_exporters_share_one_socket() -> None:
    for where, spec in pod_specs():
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        paths = set()
        for c in containers(spec):
            sock = env(c).get("TRAINMON_SOCKET", {}).get("value")
            if sock is None:
                continue
            mounts = [m for m in c["volumeMounts"] if sock.startswith(m["mountPath"] + "/")]
            assert mounts, (where, c["name"], sock)
            vol = volumes[mounts[0]["name"]]
            paths.add((sock, json.dumps(vol.get("hostPath") or {"pod": vol["name"]})))
        assert len(paths) == 1, (where, paths)
        sock, _ = paths.pop()
        if "emptyDir" in json.dumps(volumes):
            # an emptyDir is 0777: the socket must sit in a directory the exporter creates
            assert sock == "/run/trainmon/ingest/trainmon.sock", where
        else:
            assert sock == "/run/trainmon/trainmon.sock", where


def test_trainers_send_only_to_the_exporters_uid() -> None:
    """Every trainer container of the shipped examples sets TRAINMON_EXPORTER_UID to the uid
    its exporter runs as, so a listener planted first on the socket path gets nothing."""
    exporter_uids = {
        str(
            c.get("securityContext", {}).get(
                "runAsUser", spec.get("securityContext", {}).get("runAsUser")
            )
        )
        for _, spec, c in exporter_containers()
    }
    assert exporter_uids == {"65532"}, exporter_uids
    trainers = [
        (where, c)
        for where, spec in pod_specs()
        for c in containers(spec)
        if not is_exporter_image(str(c["image"])) and "TRAINMON_SOCKET" in env(c)
    ]
    assert trainers
    for where, c in trainers:
        assert env(c).get("TRAINMON_EXPORTER_UID", {}).get("value") == "65532", (where, c["name"])


def test_the_run_id_comes_from_the_job_and_the_namespace_and_pod_from_the_pod() -> None:
    """TRAINMON_RUN is built from the namespace and the job's name label; POD_NAMESPACE and
    POD_NAME are the pod's own (downward API), which the client sends."""
    seen = 0
    for where, spec in pod_specs():
        for c in spec["containers"]:
            e = env(c)
            if "TRAINMON_RUN" not in e:
                continue
            seen += 1
            refs = re.findall(r"\$\(([A-Z_]+)\)", e["TRAINMON_RUN"]["value"])
            paths = [e[r]["valueFrom"]["fieldRef"]["fieldPath"] for r in refs]
            assert "metadata.namespace" in paths, where
            job = [p for p in paths if p != "metadata.namespace"]
            assert len(job) == 1 and re.fullmatch(
                r"metadata\.labels\['(batch\.kubernetes\.io|training\.kubeflow\.org)/job-name'\]",
                job[0],
            ), (where, job)
            for name, path in (
                ("POD_NAMESPACE", "metadata.namespace"),
                ("POD_NAME", "metadata.name"),
            ):
                assert e[name]["valueFrom"]["fieldRef"]["fieldPath"] == path, (where, name)
    assert seen == len(EXAMPLES) + 1  # the PyTorchJob has two replica types


def test_the_node_exporters_monitor_honors_the_trainers_namespace_the_sidecars_does_not() -> None:
    """The DaemonSet's PodMonitor keeps the namespace a trainer reports (the exporter keys runs
    by it, with its own namespace for trainers that report none); the sidecars' keeps the pod's
    own, from service discovery, and drops what the trainer reported."""
    seen = set()
    for path, pm in objects("PodMonitor"):
        name = pm["metadata"]["name"]
        seen.add(name)
        for ep in pm["spec"]["podMetricsEndpoints"]:
            if name == "trainmon-exporter":
                assert ep.get("honorLabels") is True, path
            else:
                assert not ep.get("honorLabels"), path
                drops = [r for r in ep["metricRelabelings"] if r["action"] == "labeldrop"]
                assert [d["regex"] for d in drops] == ["exported_(namespace|pod)"], path
    assert seen == {"trainmon-exporter", "trainmon-sidecar"}
    for where, spec in pod_specs():
        for c in exporter_containers_of(spec):
            if "DaemonSet" in where:
                ref = env(c)["TRAINMON_DEFAULT_NAMESPACE"]["valueFrom"]["fieldRef"]
                assert ref["fieldPath"] == "metadata.namespace", where


def test_no_label_a_trainer_sends_is_a_target_label_but_namespace_and_pod() -> None:
    """With honorLabels a scraped label beats the target's: the exporter's labels must not
    include one Prometheus or the operator sets, but the two the trainer is meant to set."""
    from trainmon_exporter.catalog import ALL, OPTIONAL_LABELS

    target = {"job", "instance", "container", "endpoint", "node", "service", "namespace", "pod"}
    for f in ALL:
        assert not (set(f.labels) & target) - set(OPTIONAL_LABELS), f.name


def test_daemonset_shape() -> None:
    (ds,) = [o for _, o in objects("DaemonSet")][:1]
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["nodeSelector"] and spec["tolerations"]
    (c,) = spec["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert env(c)["TRAINMON_LISTEN"]["value"].endswith(f":{ports['metrics']}")
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    for vol in spec["volumes"]:
        assert vol["hostPath"] == {"path": "/run/trainmon", "type": "DirectoryOrCreate"}


def test_the_daemonset_runs_on_every_gpu_node_whatever_taints_it() -> None:
    """A node agent: an ``Exists`` toleration without key matches every taint (as
    node-exporter's), and the priority class dcgm-exporter runs with."""
    for path, ds in objects("DaemonSet"):
        spec = ds["spec"]["template"]["spec"]
        assert {"operator": "Exists"} in spec["tolerations"], path
        assert spec["priorityClassName"] == "system-node-critical", path


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector with matchLabels only (what the manifests use) selects."""
    assert set(selector) <= {"matchLabels"}, selector
    wanted: dict[str, str] = selector.get("matchLabels", {})
    return wanted.items() <= labels.items()


def test_only_prometheus_reaches_the_exporters_port() -> None:
    """In every overlay with the DaemonSet, one NetworkPolicy selects its pods, restricts
    ingress, and admits only pods labelled as prometheus-operator labels Prometheus pods
    (any namespace) on the exporter's metrics port, TCP."""
    prometheus_pod = {
        "app.kubernetes.io/name": "prometheus",
        "app.kubernetes.io/managed-by": "prometheus-operator",
        "prometheus": "k8s",
    }
    grafana_pod = {"app.kubernetes.io/name": "grafana"}
    for path in OVERLAYS:
        objs = rendered(path)
        for ds in [o for o in objs if o["kind"] == "DaemonSet"]:
            pod = ds["spec"]["template"]["metadata"]["labels"]
            (c,) = ds["spec"]["template"]["spec"]["containers"]
            port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
            policies = [
                o
                for o in objs
                if o["kind"] == "NetworkPolicy" and _selects(o["spec"]["podSelector"], pod)
            ]
            assert len(policies) == 1, (path, policies)
            spec = policies[0]["spec"]
            assert "Ingress" in spec["policyTypes"]
            (rule,) = spec["ingress"]
            assert rule["ports"] == [{"port": port, "protocol": "TCP"}]
            (peer,) = rule["from"]
            assert peer["namespaceSelector"] == {}  # Prometheus runs in its own namespace
            assert _selects(peer["podSelector"], prometheus_pod)
            assert not _selects(peer["podSelector"], grafana_pod)
            assert not _selects(peer["podSelector"], pod)


def test_the_exporter_image_is_registry_qualified_and_named_in_the_kustomizations() -> None:
    """Every rendered exporter container (init containers included) runs one image: a
    registry-qualified name, tagged with this release's version. The manifests name it
    ``trainmon-exporter`` only, so kustomize's ``images:`` is where it is set."""
    from trainmon_exporter import __version__

    images = {
        c["image"]
        for _, spec in pod_specs()
        for c in containers(spec)
        if is_exporter_image(c["image"])
    }
    assert len(images) == 1, images
    (image,) = images
    name, tag = image.rsplit(":", 1)
    registry = name.split("/")[0]
    assert "/" in name and ("." in registry or ":" in registry), f"{image}: no registry"
    assert tag == __version__, image
    for path in tracked("**/*.yaml", under=K8S):
        for found in re.findall(r"^\s*(?:- )?image:\s*(\S+)", path.read_text(), re.M):
            if is_exporter_image(found):
                assert found == "trainmon-exporter", f"{path}: {found} (set it in images:)"


def test_sidecars_are_native_and_scraped_by_port_name() -> None:
    pm = next(o for _, o in objects("PodMonitor") if o["metadata"]["name"] == "trainmon-sidecar")
    port = pm["spec"]["podMetricsEndpoints"][0]["port"]
    selector = pm["spec"]["selector"]["matchLabels"]
    found = 0
    for path, job in objects("Job"):
        template = job["spec"]["template"]
        side = [c for c in template["spec"].get("initContainers", []) if "trainmon" in c["image"]]
        if not side:
            continue
        found += 1
        (c,) = side
        assert c["restartPolicy"] == "Always", path  # a native sidecar: the Job can complete
        assert port in {p["name"] for p in c["ports"]}
        assert selector.items() <= template["metadata"]["labels"].items()
        assert env(c)["TRAINMON_COLLECTORS__GPU"]["value"] == "false"  # the sidecar has no GPU
        assert "fsGroup" in template["spec"]["securityContext"]
    assert found == 1


def test_sample_limits_leave_room_for_a_full_node() -> None:
    """8 GPUs and 8 ranks, one of them exporting max_layers layers, fit under sampleLimit."""
    node = 8 * (BUDGET["rank"] + BUDGET["GPU"]) + BUDGET["node"] + 128 * BUDGET["layer"]
    pm = next(o for _, o in objects("PodMonitor") if o["metadata"]["name"] == "trainmon-exporter")
    assert node < pm["spec"]["sampleLimit"], node


def test_each_exporter_sends_at_most_what_its_podmonitor_accepts() -> None:
    """The scrape's sampleLimit and the exporter's scrape_sample_limit are one value.

    Every exporter container a PodMonitor selects, in any rendered overlay or example, is
    told the PodMonitor's sampleLimit, so it sheds series instead of sending a scrape
    Prometheus refuses; both come from build.py's SAMPLE_LIMITS.
    """
    limits = generator().SAMPLE_LIMITS
    monitors = {o["metadata"]["name"]: o["spec"] for _, o in objects("PodMonitor")}
    assert {name: m["sampleLimit"] for name, m in monitors.items()} == {
        "trainmon-exporter": limits["exporter"],
        "trainmon-sidecar": limits["sidecar"],
    }
    checked = set()
    for path, obj in objects():
        template = (obj.get("spec") or {}).get("template")
        if not isinstance(template, dict) or "spec" not in template:
            continue
        labels = template.get("metadata", {}).get("labels", {})
        for name, m in monitors.items():
            if not m["selector"]["matchLabels"].items() <= labels.items():
                continue
            for c in containers(template["spec"]):
                if is_exporter_image(c["image"]) and "command" not in c:
                    value = env(c)["TRAINMON_SCRAPE_SAMPLE_LIMIT"]["value"]
                    assert int(value) == m["sampleLimit"], (path, name)
                    checked.add(name)
    assert checked == set(monitors)


def test_the_exporters_default_is_the_node_exporters_limit() -> None:
    """An exporter started without the setting (Compose, Slurm) uses the node's value."""
    assert Settings().scrape_sample_limit == generator().SAMPLE_LIMITS["exporter"]


def test_the_tls_overlay_is_the_daemonset_overlay_with_https_and_basic_auth() -> None:
    """overlays/daemonset-tls changes only what HTTPS with basic auth needs: the web
    configuration file from a Secret the pod's group reads, probes that need no credentials
    and a PodMonitor that scrapes over TLS with a password (its scrape for real:
    tests/integration/test_tls_scrape.py)."""
    plain = {o["kind"]: o for o in copy.deepcopy(rendered(Path("overlays/daemonset")))}
    tls = {o["kind"]: o for o in copy.deepcopy(rendered(Path("overlays/daemonset-tls")))}
    assert set(plain) == set(tls)
    spec = tls["DaemonSet"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    web = Path(env(c)["TRAINMON_WEB_CONFIG_FILE"]["value"])
    secrets = {v["name"]: v for v in spec["volumes"] if "secret" in v}
    mounts = [m for m in c["volumeMounts"] if m["name"] in secrets]
    assert {m["mountPath"]: secrets[m["name"]]["secret"]["secretName"] for m in mounts} == {
        str(web.parent): "trainmon-exporter-web",
        "/etc/trainmon/tls": "trainmon-exporter-tls",  # the paths docs/exporter.md's web.yml names
    }
    for m in mounts:
        assert m["readOnly"] is True
        assert secrets[m["name"]]["secret"]["defaultMode"] == 0o440
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"] == {"port": "metrics"} and "httpGet" not in c[probe]
    endpoint = tls["PodMonitor"]["spec"]["podMetricsEndpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "trainmon-scrape", "key": "ca.crt"}
    assert endpoint["tlsConfig"]["serverName"] == "trainmon-exporter"
    assert endpoint["basicAuth"]["password"] == {"name": "trainmon-scrape", "key": "password"}
    # Everything else as in overlays/daemonset.
    for key in ("scheme", "tlsConfig", "basicAuth"):
        endpoint.pop(key)
    c["env"].remove({"name": "TRAINMON_WEB_CONFIG_FILE", "value": str(web)})
    for m in mounts:
        c["volumeMounts"].remove(m)
        spec["volumes"].remove(secrets[m["name"]])
    spec["securityContext"].pop("fsGroup")
    (p,) = plain["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    for container in (c, p):
        container.pop("readinessProbe")
        container.pop("livenessProbe")
    assert tls == plain


# --------------------------------------------------------------------------- permissions


def _runs_as(uid: int, gid: int, groups: list[int], argv: list[str], **kw: Any) -> Any:
    setpriv = shutil.which("setpriv")
    assert setpriv
    group_arg = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    cmd = [setpriv, f"--reuid={uid}", f"--regid={gid}", *group_arg, *argv]
    return cmd


def _need_root_and_setpriv() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: runs the exporter and a trainer as the manifests' uids")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    probe = subprocess.run(
        _runs_as(65532, 9478, [], [sys.executable, "-c", "import trainmon_exporter"]),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"this checkout's Python cannot run as another uid: {probe.stderr[-200:]}")


def _identity(spec: dict[str, Any], c: dict[str, Any]) -> tuple[int, int, list[int]]:
    """``(uid, gid, supplementary groups)`` a container runs with (pod and container level)."""
    sc = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
    groups = list(sc.get("supplementalGroups", []))
    if "fsGroup" in spec.get("securityContext", {}):
        groups.append(spec["securityContext"]["fsGroup"])
    return int(sc["runAsUser"]), int(sc.get("runAsGroup", sc["runAsUser"])), groups


def _init_container_argv(spec: dict[str, Any], init: dict[str, Any]) -> list[str]:
    """``setpriv`` argv running ``init``'s command with its uid, gid and exact capabilities.

    The container's capability set is the runtime's after ``drop: [ALL]`` and ``add``: that
    set becomes the bounding and inheritable set, so a root process keeps only those
    (permitted = effective = bounding set on exec); ``allowPrivilegeEscalation: false`` is
    ``no_new_privs``.
    """
    uid, gid, groups = _identity(spec, init)
    sc = init["securityContext"]
    caps = sc.get("capabilities", {})
    assert caps.get("drop") == ["ALL"], "the re-enactment knows only drop: [ALL] plus add"
    names = ",".join(f"+{c.lower()}" for c in caps.get("add", []))
    capset = f"-all,{names}" if names else "-all"
    argv: list[str] = _runs_as(
        uid, gid, groups, [f"--bounding-set={capset}", f"--inh-caps={capset}"]
    )
    if sc.get("allowPrivilegeEscalation") is False:
        argv.append("--no-new-privs")
    return argv


def _run_init_container(
    spec: dict[str, Any], init: dict[str, Any], mount: Path, command: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the init container's command (or ``command``) on ``mount`` as the pod runs it."""
    cmd = [c.replace("/run/trainmon", str(mount)) for c in (command or init["command"])]
    return subprocess.run(
        [*_init_container_argv(spec, init), *cmd],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def _socket_dir_init() -> tuple[dict[str, Any], dict[str, Any]]:
    spec = dict(pod_specs())["overlays/daemonset:DaemonSet/trainmon-exporter"]
    (init,) = [c for c in spec.get("initContainers", []) if c["name"] == "socket-dir"]
    return spec, init


@pytest.mark.parametrize("starts", [1, 2, 3])
def test_the_socket_dir_init_container_succeeds_on_every_start(starts: int) -> None:
    """The DaemonSet's pod restarted on a node: the hostPath directory kept from the last
    start (owned by the exporter) is prepared again with the init container's uid and
    exact capabilities, ending 0750 and owned by the exporter's uid and group each time."""
    _need_root_and_setpriv()
    spec, init = _socket_dir_init()
    exporter = spec["containers"][0]
    uid, gid, _ = _identity(spec, exporter)
    with _kubelet_mount(spec, "init") as mount:
        for start in range(starts):
            out = _run_init_container(spec, init, mount)
            assert out.returncode == 0, f"start {start + 1}: {out.stderr}"
            st = mount.stat()
            assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (uid, gid, 0o750), start + 1


def test_the_init_container_re_enactment_has_only_the_pods_capabilities() -> None:
    """The re-enactment can fail: a chmod of a directory another uid owns is refused with
    the pod's capability set, as on a real restart before the command took ownership first;
    and the process holds exactly the capabilities the manifest adds."""
    _need_root_and_setpriv()
    spec, init = _socket_dir_init()
    with _kubelet_mount(spec, "caps") as mount:
        os.chown(mount, 65532, 9478)
        old = ["sh", "-c", "chmod 0750 /run/trainmon && chown 65532:9478 /run/trainmon"]
        out = _run_init_container(spec, init, mount, old)
        assert out.returncode != 0 and "not permitted" in out.stderr, out
        status = _run_init_container(spec, init, mount, ["cat", "/proc/self/status"]).stdout
        caps = {k: int(v, 16) for k, v in re.findall(r"^(Cap\w+):\s+([0-9a-f]+)$", status, re.M)}
        bits = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3}  # linux/capability.h
        wanted = sum(1 << bits[c] for c in init["securityContext"]["capabilities"]["add"])
        assert caps["CapEff"] == caps["CapPrm"] == caps["CapBnd"] == wanted, caps


TRAINER = """
import sys, time, trainmon_client
run = trainmon_client.init(run="perm", rank=0, world_size=1, socket_path=sys.argv[1],
                           flush_interval=0.0)
run.log(0, loss=1.0)
run.finish()
print("dropped", sum(run.dropped.values()))
"""


@contextmanager
def _kubelet_mount(spec: dict[str, Any], name: str) -> Iterator[Path]:
    """The pod's socket volume as the kubelet makes it (:func:`_volume_as_kubelet_makes_it`),
    in a fresh directory ``/tmp/tmk8s-NAME-PID`` (0755), removed afterwards."""
    base = Path("/tmp") / f"tmk8s-{name}-{os.getpid()}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir()
    os.chmod(base, 0o755)
    try:
        mount = base / "run-trainmon"
        _volume_as_kubelet_makes_it(mount, spec)
        yield mount
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _volume_as_kubelet_makes_it(root: Path, spec: dict[str, Any]) -> None:
    """The mount point a new pod sees: hostPath DirectoryOrCreate (0755 root) or emptyDir."""
    root.mkdir()
    vol = spec["volumes"][0]
    if "hostPath" in vol:
        os.chmod(root, 0o755)
    else:  # emptyDir: 0777, with fsGroup group-owned and set-group-ID
        fs_group = spec["securityContext"].get("fsGroup")
        os.chown(root, 0, fs_group if fs_group is not None else 0)
        os.chmod(root, 0o2777 if fs_group is not None else 0o777)


@pytest.mark.parametrize(
    ("exporter_pod", "trainer_pod"),
    [
        (
            "overlays/daemonset:DaemonSet/trainmon-exporter",
            "examples/torchrun-job:Job/llm-pretrain",
        ),
        (
            "examples/torchrun-job-sidecar:Job/llm-pretrain",
            "examples/torchrun-job-sidecar:Job/llm-pretrain",
        ),
    ],
    ids=["daemonset", "sidecar"],
)
def test_a_non_root_trainer_reaches_the_socket_with_the_manifests_permissions(
    exporter_pod: str, trainer_pod: str
) -> None:
    """The directory as the kubelet creates it, the init container's command, the exporter
    and the trainer as the uids and groups of the manifests: the trainer's step arrives,
    and a process outside the socket's group is refused."""
    _need_root_and_setpriv()
    specs = dict(pod_specs())
    ex_spec, tr_spec = specs[exporter_pod], specs[trainer_pod]
    exporter = next(
        c for c in containers(ex_spec) if is_exporter_image(c["image"]) and "command" not in c
    )
    trainer = next(c for c in tr_spec["containers"] if "TRAINMON_RUN" in env(c))
    with _kubelet_mount(ex_spec, "socket") as mount:
        for init in ex_spec.get("initContainers", []):
            if "command" in init:  # the DaemonSet's socket-dir preparation
                out = _run_init_container(ex_spec, init, mount)
                assert out.returncode == 0, out.stderr
        sock = env(exporter)["TRAINMON_SOCKET"]["value"].replace("/run/trainmon", str(mount))
        port = free_port()
        ex_env = child_env(
            **{
                k: v["value"]
                for k, v in env(exporter).items()
                if "value" in v and k.startswith("TRAINMON_")
            }
        )
        ex_env.update(TRAINMON_SOCKET=sock, TRAINMON_LISTEN=f"127.0.0.1:{port}")
        ex_env["TRAINMON_COLLECTORS__GPU"] = "false"
        ex_env["TRAINMON_COLLECTORS__RANK_GPU"] = "false"
        uid, gid, groups = _identity(ex_spec, exporter)
        proc = subprocess.Popen(
            _runs_as(uid, gid, groups, [sys.executable, "-m", "trainmon_exporter"]),
            env=ex_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            import httpx2 as httpx

            def ready() -> bool:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                try:
                    return (
                        httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
                    )
                except httpx.HTTPError:
                    return False

            wait_for(ready, timeout=30)
            tr_uid, tr_gid, tr_groups = _identity(tr_spec, trainer)
            assert tr_uid not in (0, uid), "the trainer must be another, non-root user"
            ok = subprocess.run(
                _runs_as(tr_uid, tr_gid, tr_groups, [sys.executable, "-c", TRAINER, sock]),
                capture_output=True,
                text=True,
                timeout=60,
                env=child_env(),
                check=False,
            )
            assert ok.returncode == 0 and ok.stdout.split() == ["dropped", "0"], (
                ok.stdout + ok.stderr
            )

            def arrived() -> bool:
                runs = httpx.get(f"http://127.0.0.1:{port}/api/v1/runs", timeout=5).json()["runs"]
                return any(r["run"] == "perm" for r in runs)

            wait_for(arrived, timeout=10)
            outsider = subprocess.run(
                _runs_as(tr_uid, tr_gid, [], [sys.executable, "-c", TRAINER, sock]),
                capture_output=True,
                text=True,
                timeout=60,
                env=child_env(),
                check=False,
            )
            assert outsider.returncode == 0 and outsider.stdout.split() != ["dropped", "0"], (
                outsider.stdout + outsider.stderr
            )
        finally:
            proc.terminate()
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


# --------------------------------------------------------------------------- the cluster label

CLUSTER_LABEL = K8S / "cluster-label"


def test_the_cluster_label_is_an_external_label_of_either_stacks_prometheus(
    tmp_path: Path,
) -> None:
    """kube-prometheus-stack gets it from its values; kube-prometheus's Prometheus ``k8s`` from
    the merge patch, applied here with ``kubectl patch --local`` as the docs say to apply it."""
    values = yaml.safe_load((CLUSTER_LABEL / "kube-prometheus-stack-values.yaml").read_text())
    assert values == {
        "prometheus": {"prometheusSpec": {"externalLabels": {"cluster": "my-cluster"}}}
    }
    shipped = {  # as kube-prometheus's manifests/prometheus-prometheus.yaml has it
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "Prometheus",
        "metadata": {"name": "k8s", "namespace": "monitoring"},
        "spec": {"externalLabels": {}, "replicas": 2, "podMonitorSelector": {}},
    }
    prom = tmp_path / "prometheus-prometheus.yaml"
    prom.write_text(yaml.safe_dump(shipped))
    patch = CLUSTER_LABEL / "prometheus-k8s-patch.yaml"
    cmd = [kubectl(), "patch", "--local", "-f", str(prom), "--type", "merge", "-o", "yaml"]
    out = subprocess.run(
        [*cmd, "--patch-file", str(patch)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    spec = yaml.safe_load(out.stdout)["spec"]
    assert spec == {**shipped["spec"], "externalLabels": {"cluster": "my-cluster"}}
    # The label's name is the one every rule, route and dashboard keys a run by.
    rules = (ROOT / "deploy/prometheus/trainmon.rules.yml").read_text()
    assert "by (cluster, namespace, run)" in rules
    doc = (ROOT / "docs/scaling.md").read_text()
    for path in (
        "cluster-label/kube-prometheus-stack-values.yaml",
        "cluster-label/prometheus-k8s-patch.yaml",
    ):
        assert path in doc, path
