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
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainmon_exporter.settings import Settings, environment_names

from ..conftest import ROOT, child_env, free_port, require_tool, wait_for
from ..helpers import pod_security
from ..helpers.cardinality import BUDGET
from ..helpers.checkout import tracked
from ..helpers.kustomize import K8S, container, kubectl, rendered, the

SCHEMAS = Path(__file__).with_name("schemas") / "prometheus-operator-v0.93.0"
OVERLAYS = sorted(
    p.parent.relative_to(K8S) for p in tracked("overlays/*/kustomization.yaml", under=K8S)
)
EXAMPLES = sorted(
    p.parent.relative_to(K8S) for p in tracked("examples/*/kustomization.yaml", under=K8S)
)
WATCHDOG = Path("base/watchdog")
"""The Watchdog's PrometheusRule, which no overlay includes (its stacks ship their own)."""
KUSTOMIZATIONS = [*OVERLAYS, *EXAMPLES, WATCHDOG]
K8S_VERSIONS = ["1.29.0", "latest"]
CRD_FILES = {
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}
CUSTOM_KINDS = {*CRD_FILES, "PyTorchJob"}
CLUSTER_SCOPED = {"Namespace", "CSIDriver"}


def generator() -> Any:
    spec = importlib.util.spec_from_file_location("build_k8s", K8S / "build.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_no_overlay_ships_a_second_watchdog() -> None:
    """kube-prometheus and kube-prometheus-stack have a Watchdog of their own (general.rules):
    no overlay renders trainmon's, which base/watchdog holds for a Prometheus without one."""
    for path in OVERLAYS:
        text = json.dumps([o for o in rendered(path) if o["kind"] == "PrometheusRule"])
        assert '"Watchdog"' not in text, path
    (rule,) = rendered(WATCHDOG)
    assert rule["kind"] == "PrometheusRule"
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert alerts == ["Watchdog"]
    source = ROOT / "deploy" / "prometheus" / "trainmon.watchdog.alerts.yml"
    assert rule["spec"]["groups"] == yaml.safe_load(source.read_text())["groups"]


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
        namespaced = [o for o in objs if o["kind"] not in CLUSTER_SCOPED]
        assert {o["metadata"].get("namespace") for o in namespaced} == {"trainmon-system"}


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
        "CSIDriver",
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


def extracted_rules(tmp: Path, *paths: Path) -> dict[str, Path]:
    """Write each PrometheusRule ``paths`` render as a rule file named like its source.

    Returns ``{source file name: extracted path}``.
    """
    gen = generator()
    by_object = {gen.rule_object_name(p): p.name for p in [*gen.rule_files(), gen.WATCHDOG]}
    tmp.mkdir(parents=True, exist_ok=True)
    out = {}
    for obj in (o for path in paths for o in rendered(path)):
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
    files = extracted_rules(tmp_path / "rules", Path("overlays/daemonset"), WATCHDOG)
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
    c = container(spec, "exporter")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert env(c)["TRAINMON_LISTEN"]["value"].endswith(f":{ports['metrics']}")
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["socket-dir"]["hostPath"] == {
        "path": "/run/trainmon",
        "type": "DirectoryOrCreate",
    }
    assert spec["volumes"][0]["name"] == "socket-dir"  # what the kubelet re-enactment mounts
    # The kubelet's pod log directory, read-only, where the exporter is told to look.
    assert volumes["pod-logs"]["hostPath"] == {"path": "/var/log/pods", "type": "DirectoryOrCreate"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["pod-logs"]["readOnly"] is True
    assert env(c)["TRAINMON_KUBELET_POD_LOGS_DIR"]["value"] == mounts["pod-logs"]["mountPath"]

    assert volumes["state-dir"]["hostPath"] == {
        "path": "/var/lib/trainmon",
        "type": "DirectoryOrCreate",
    }
    assert env(c)["TRAINMON_STATE_FILE"]["value"] == "/var/lib/trainmon/state.json"


# --------------------------------------------------------------------------- Pod Security


def training_pods() -> list[tuple[str, dict[str, Any]]]:
    """``(where, pod spec)`` of every rendered pod that runs a trainer (not the DaemonSet)."""
    pods = [
        (where, spec)
        for where, spec in pod_specs()
        if any("TRAINMON_RUN" in env(c) for c in spec["containers"])
    ]
    assert len(pods) == len(EXAMPLES) + 1, pods  # the PyTorchJob has two replica types
    return pods


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_every_training_pod_passes_pod_security(level: str) -> None:
    """Every rendered training pod, the DaemonSet's trainers and the sidecar's alike, is
    admitted by Pod Security at ``baseline`` and ``restricted``: the socket comes from the
    CSI driver, not a hostPath."""
    for where, spec in training_pods():
        assert pod_security.violations(level, spec) == [], where


def test_the_pod_security_check_refuses_the_hostpath_socket() -> None:
    """The check can fail: a training pod that mounts /run/trainmon as a hostPath, as they did
    before the CSI driver, is refused at ``baseline``, and so is the node DaemonSet's pod."""
    for where, spec in training_pods():
        old = copy.deepcopy(spec)
        for v in old["volumes"]:
            if v["name"] == "trainmon" and "csi" in v:
                v.pop("csi")
                v["hostPath"] = {"path": "/run/trainmon", "type": "DirectoryOrCreate"}
                break
        else:
            continue  # the sidecar pod: an emptyDir
        assert pod_security.violations("baseline", old) == ["hostPath volumes ('trainmon')"], where
    ds = the(rendered(Path("overlays/daemonset")), "DaemonSet")["spec"]["template"]["spec"]
    refused = pod_security.violations("baseline", ds)
    assert "host namespaces (hostPID=true)" in refused
    assert "hostPath volumes ('socket-dir')" in refused
    assert "privileged (container 'csi-node')" in refused


def test_each_namespace_admits_the_pods_rendered_into_it() -> None:
    """An overlay's namespace enforces a Pod Security level that admits its own pods."""
    for path in OVERLAYS:
        objs = rendered(path)
        (ns,) = [o for o in objs if o["kind"] == "Namespace"]
        level = ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
        for ds in [o for o in objs if o["kind"] == "DaemonSet"]:
            spec = ds["spec"]["template"]["spec"]
            assert pod_security.violations(level, spec) == [], (path, level)


def test_training_pods_mount_the_socket_through_the_csi_driver() -> None:
    """Every training pod of the DaemonSet mode mounts the CSI driver's inline volume,
    read-only, where TRAINMON_SOCKET points; the driver is the one the DaemonSet's node plugin
    serves and registers, and it is declared for inline ephemeral volumes only."""
    from trainmon_exporter import csi

    objs = rendered(Path("overlays/daemonset"))
    driver = the(objs, "CSIDriver")
    assert driver["metadata"]["name"] == csi.DRIVER_NAME
    assert driver["spec"]["volumeLifecycleModes"] == ["Ephemeral"]
    assert driver["spec"]["attachRequired"] is False
    assert driver["spec"]["podInfoOnMount"] is True
    assert driver["spec"]["fsGroupPolicy"] == "None"  # the kubelet never chowns the socket
    ds = the(objs, "DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in ds["volumes"]}
    plugin = container(ds, "csi-node")
    args = dict(a.removeprefix("--").split("=", 1) for a in plugin["args"])
    exporter_dir = str(Path(env(container(ds, "exporter"))["TRAINMON_SOCKET"]["value"]).parent)
    mounts = {m["mountPath"]: m for m in plugin["volumeMounts"]}
    # it binds what the exporter's socket directory is on the node
    assert volumes[mounts[args["socket-dir"]]["name"]] == volumes["socket-dir"]
    assert args["socket-dir"] == exporter_dir
    # its binds reach the host and the pods: the kubelet's pods directory, Bidirectional
    pods = mounts[args["pods-dir"]]
    assert volumes[pods["name"]]["hostPath"]["path"] == args["pods-dir"] == "/var/lib/kubelet/pods"
    assert pods["mountPropagation"] == "Bidirectional"
    assert plugin["securityContext"]["privileged"] is True  # Bidirectional needs it
    assert env(plugin)["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # the registrar tells the kubelet where the plugin's socket is on the node
    registrar = container(ds, "node-driver-registrar")
    reg = dict(a.removeprefix("--").split("=", 1) for a in registrar["args"])
    endpoint = Path(args["endpoint"].removeprefix("unix://"))
    assert reg["csi-address"] == str(endpoint)
    plugin_dir = {m["mountPath"]: m["name"] for m in plugin["volumeMounts"]}[str(endpoint.parent)]
    on_node = Path(volumes[plugin_dir]["hostPath"]["path"]) / endpoint.name
    assert reg["kubelet-registration-path"] == str(on_node)
    assert on_node.parent.name == csi.DRIVER_NAME
    reg_mounts = {m["mountPath"]: m["name"] for m in registrar["volumeMounts"]}
    assert volumes[reg_mounts["/registration"]]["hostPath"]["path"] == (
        "/var/lib/kubelet/plugins_registry"
    )
    seen = 0
    for where, spec in training_pods():
        vols = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            if "TRAINMON_SOCKET" not in env(c) or is_exporter_image(c["image"]):
                continue
            sock = env(c)["TRAINMON_SOCKET"]["value"]
            (m,) = [m for m in c["volumeMounts"] if sock.startswith(m["mountPath"] + "/")]
            if "csi" not in vols[m["name"]]:
                assert "emptyDir" in vols[m["name"]], where  # the sidecar variant
                continue
            seen += 1
            assert vols[m["name"]]["csi"] == {"driver": csi.DRIVER_NAME, "readOnly": True}, where
            assert m.get("readOnly") is True, where
            assert str(Path(sock).parent) == m["mountPath"] and Path(sock).name == "trainmon.sock"
    assert seen == len(training_pods()) - 1  # all but the sidecar's


def test_the_admission_policy_is_valid_and_adds_what_the_examples_write_by_hand() -> None:
    """deploy/kubernetes/admission: the MutatingAdmissionPolicy and its binding validate
    strictly against the Kubernetes release that has v1 of them; the pod they add to is the
    one the example's pod template writes by hand (the same driver, mount path, socket,
    exporter uid, socket group and downward-API variables), and a misspelt field fails. Its CEL
    runs only in an API server (1.36 or newer): not here."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -r requirements-dev.txt")
    from trainmon_exporter import csi

    objs = rendered(Path("admission"))
    assert {o["kind"] for o in objs} == {
        "MutatingAdmissionPolicy",
        "MutatingAdmissionPolicyBinding",
    }
    for o in objs:
        kv.validate(o, kv.latest_version(), strict=True)
    policy = the(objs, "MutatingAdmissionPolicy")
    binding = the(objs, "MutatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["matchResources"]["objectSelector"] == {
        "matchLabels": {"trainmon/socket": "node"}
    }
    assert policy["spec"]["failurePolicy"] == "Ignore"  # never stops a pod from starting
    (mutation,) = policy["spec"]["mutations"]
    cel = mutation["applyConfiguration"]["expression"]
    job = dict(pod_specs())["examples/torchrun-job:Job/llm-pretrain"]
    trainer = container(job, "trainer")
    vol = {v["name"]: v for v in job["volumes"]}["trainmon"]
    mount = next(m for m in trainer["volumeMounts"] if m["name"] == "trainmon")
    assert vol["csi"]["driver"] == csi.DRIVER_NAME and f'driver: "{csi.DRIVER_NAME}"' in cel
    assert f'mountPath: "{mount["mountPath"]}", readOnly: true' in cel
    for name in ("TRAINMON_SOCKET", "TRAINMON_EXPORTER_UID"):
        assert f'name: "{name}", value: "{env(trainer)[name]["value"]}"' in cel, name
    for name in ("POD_NAMESPACE", "POD_NAME"):
        path = env(trainer)[name]["valueFrom"]["fieldRef"]["fieldPath"]
        assert re.search(rf'name: "{name}",.*?fieldPath: "{re.escape(path)}"', cel, re.S), name
    ds = the(rendered(Path("overlays/daemonset")), "DaemonSet")["spec"]["template"]["spec"]
    group = ds["securityContext"]["runAsGroup"]
    assert job["securityContext"]["supplementalGroups"] == [group]
    groups = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}["groups"]
    assert f"[{group}]" in groups and f"g != {group}" in groups
    broken = copy.deepcopy(policy)
    broken["spec"]["mutation"] = broken["spec"].pop("mutations")
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, kv.latest_version(), strict=True)


def test_the_daemonset_runs_on_every_gpu_node_whatever_taints_it() -> None:
    """A node agent: an ``Exists`` toleration without key matches every taint (as
    node-exporter's), and the priority class dcgm-exporter runs with."""
    for path, ds in objects("DaemonSet"):
        spec = ds["spec"]["template"]["spec"]
        assert {"operator": "Exists"} in spec["tolerations"], path
        assert spec["priorityClassName"] == "system-node-critical", path


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels and matchExpressions) selects ``labels``."""
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def admits(
    policy: dict[str, Any],
    to_pod: tuple[str, dict[str, str]],
    source: tuple[str, dict[str, str], dict[str, str]],
    port: int,
    protocol: str = "TCP",
) -> bool | None:
    """NetworkPolicy's ingress semantics for the fields the manifests use: whether ``policy``
    admits ``source`` ``(namespace, namespace labels, pod labels)`` to ``port`` of
    ``to_pod`` ``(namespace, pod labels)``; None when the policy does not select that pod."""
    pod_ns, pod_labels = to_pod
    if policy["metadata"].get("namespace", pod_ns) != pod_ns:
        return None
    spec = policy["spec"]
    if not _selects(spec["podSelector"], pod_labels) or "Ingress" not in spec["policyTypes"]:
        return None
    src_ns, src_ns_labels, src_labels = source
    for rule in spec.get("ingress", []):
        peers_ok = "from" not in rule or any(
            (
                _selects(peer["namespaceSelector"], src_ns_labels)
                if "namespaceSelector" in peer
                else src_ns == pod_ns
            )
            and _selects(peer.get("podSelector", {}), src_labels)
            for peer in rule["from"]
        )
        ports_ok = "ports" not in rule or any(
            p.get("protocol", "TCP") == protocol
            and ("port" not in p or p["port"] <= port <= p.get("endPort", p["port"]))
            for p in rule["ports"]
        )
        if peers_ok and ports_ok:
            return True
    return False


SCRAPER_PODS = {
    "prometheus (kube-prometheus)": {
        "app.kubernetes.io/name": "prometheus",
        "app.kubernetes.io/managed-by": "prometheus-operator",
        "prometheus": "k8s",
    },
    "prometheus-agent (kube-prometheus-stack agentMode)": {
        "app.kubernetes.io/name": "prometheus-agent",
        "app.kubernetes.io/instance": "kube-prometheus-stack-prometheus",
        "operator.prometheus.io/name": "kube-prometheus-stack-prometheus",
    },
    "vmagent": {
        "app.kubernetes.io/name": "vmagent",
        "app.kubernetes.io/instance": "example-vmagent",
        "managed-by": "vm-operator",
    },
    "alloy": {"app.kubernetes.io/name": "alloy", "app.kubernetes.io/instance": "alloy"},
    "otel collector (operator)": {
        "app.kubernetes.io/component": "opentelemetry-collector",
        "app.kubernetes.io/name": "otel-collector",
        "app.kubernetes.io/managed-by": "opentelemetry-operator",
    },
    "otel collector (chart)": {"app.kubernetes.io/name": "opentelemetry-collector"},
    "labelled by the platform team": {"app": "datadog-agent", "trainmon/scraper": "true"},
}
NOT_SCRAPERS = {
    "grafana": {"app.kubernetes.io/name": "grafana"},
    "a trainer": {"batch.kubernetes.io/job-name": "llm-pretrain"},
    "the exporter itself": {"app.kubernetes.io/name": "trainmon-exporter"},
    "a scraper label with another value": {"trainmon/scraper": "false"},
}


def test_only_scrapers_reach_the_exporters_port() -> None:
    """In every overlay with the DaemonSet, one NetworkPolicy selects its pods and admits
    every shipped scraper kind (server and agent mode Prometheus, vmagent, Alloy, an
    OpenTelemetry Collector) and pods labelled ``trainmon/scraper: "true"``, from any
    namespace, on the metrics port only; nothing else."""
    monitoring = ("monitoring", {"kubernetes.io/metadata.name": "monitoring"})
    for path in OVERLAYS:
        objs = rendered(path)
        for ds in [o for o in objs if o["kind"] == "DaemonSet"]:
            pod = (ds["metadata"]["namespace"], ds["spec"]["template"]["metadata"]["labels"])
            c = container(ds["spec"]["template"]["spec"], "exporter")
            port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
            policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
            verdicts = [admits(p, pod, (*monitoring, {}), port) for p in policies]
            assert [v for v in verdicts if v is not None] == [False], (path, verdicts)
            (policy,) = [p for p, v in zip(policies, verdicts, strict=True) if v is not None]
            for name, labels in SCRAPER_PODS.items():
                assert admits(policy, pod, (*monitoring, labels), port), (path, name)
                assert admits(policy, pod, ("ml-team", {}, labels), port), (path, name)
                assert not admits(policy, pod, (*monitoring, labels), 22), (path, name)
                assert not admits(policy, pod, (*monitoring, labels), port, "UDP"), (path, name)
            for name, labels in NOT_SCRAPERS.items():
                assert not admits(policy, pod, (*monitoring, labels), port), (path, name)


def test_the_sidecars_policy_admits_scrapers_and_keeps_the_jobs_own_traffic() -> None:
    """The sidecar example's NetworkPolicy: scrapers reach the sidecar's port, other pods of
    the namespace do not; the job's own pods still reach each other on every other port
    (torchrun's rendezvous among them), pods of other namespaces on none."""
    objs = rendered(Path("examples/torchrun-job-sidecar"))
    policy = the(objs, "NetworkPolicy")
    job = the(objs, "Job")["spec"]["template"]
    pod = ("ml-team", job["metadata"]["labels"])
    sidecar = container(job["spec"], "trainmon")
    port = next(p["containerPort"] for p in sidecar["ports"] if p["name"] == "trainmon")
    trainer = container(job["spec"], "trainer")
    rendezvous = next(p["containerPort"] for p in trainer["ports"])
    peer = ("ml-team", {}, job["metadata"]["labels"])
    for name, labels in SCRAPER_PODS.items():
        assert admits(policy, pod, ("monitoring", {}, labels), port), name
    assert not admits(policy, pod, peer, port)  # its own namespace reads no status page
    assert admits(policy, pod, peer, rendezvous) and admits(policy, pod, peer, 40000, "UDP")
    assert not admits(policy, pod, ("other-team", {}, job["metadata"]["labels"]), rendezvous)
    for name, labels in NOT_SCRAPERS.items():
        assert not admits(policy, pod, ("monitoring", {}, labels), port), name
    # one list of scrapers for both policies (build.py's SCRAPERS)
    node = the(rendered(Path("overlays/daemonset")), "NetworkPolicy")
    assert policy["spec"]["ingress"][0]["from"] == node["spec"]["ingress"][0]["from"]


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


def test_a_peak_set_in_a_pod_is_the_peak_of_the_only_gpu_it_may_run_on() -> None:
    """An exporter that cannot see the GPU (the sidecar) is told its peak: the pod must then be
    pinned to one GPU model (GPU feature discovery's ``nvidia.com/gpu.product``), and the peak
    must be that model's dense peak for the client's dtype (bf16, the default) in
    trainmon_exporter.peaks. A pod that may land on another GPU would be judged against the
    wrong peak."""
    from trainmon_exporter import peaks

    seen = 0
    for where, spec in pod_specs():
        for c in exporter_containers_of(spec):
            value = env(c).get("TRAINMON_PEAK_FLOPS", {}).get("value")
            if value is None:
                continue
            seen += 1
            product = spec.get("nodeSelector", {}).get("nvidia.com/gpu.product")
            assert product, f"{where}: TRAINMON_PEAK_FLOPS without a pinned GPU product"
            model = peaks.find_model(product.replace("-", " "), None)
            assert model is not None, (where, product)
            assert float(value) == model.dense["bf16"], (where, product, value)
    assert seen == 1  # the sidecar example


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
    c = container(spec, "exporter")
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
    p = container(plain["DaemonSet"]["spec"]["template"]["spec"], "exporter")
    for probed in (c, p):
        probed.pop("readinessProbe")
        probed.pop("livenessProbe")
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


class CsiPlugin:
    """The DaemonSet's ``csi-node`` container run here as the kubelet sees it: its command and
    arguments, with the node's paths under ``base``, in a mount namespace of its own (the
    node's mount namespace for it: what it mounts is visible to whoever enters it, and gone
    with it), its gRPC socket where the registrar tells the kubelet to call it."""

    def __init__(self, ds: dict[str, Any], base: Path, socket_dir: Path) -> None:
        plugin = container(ds, "csi-node")
        args = dict(a.removeprefix("--").split("=", 1) for a in plugin["args"])
        self.pods = base / "kubelet" / "pods"
        self.pods.mkdir(parents=True)
        self.endpoint = base / "kubelet" / "plugins" / "csi.sock"
        argv = [
            *[sys.executable, "-m", "trainmon_exporter.csi"],
            f"--endpoint=unix://{self.endpoint}",
            f"--socket-dir={socket_dir}",
            f"--pods-dir={self.pods}",
            *[
                f"--{k}={v}"
                for k, v in args.items()
                if k not in ("endpoint", "socket-dir", "pods-dir")
            ],
        ]
        assert plugin["command"] == ["trainmon-csi-node"]
        unshare = ["unshare", "--mount", "--propagation", "private", "--"]
        self.proc = subprocess.Popen(
            [*unshare, *argv], env=child_env(NODE_NAME="node-1"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        wait_for(lambda: self.endpoint.is_socket() or self.proc.poll() is not None, timeout=30)
        assert self.proc.poll() is None, self.proc.communicate()[0]
        import grpc

        from trainmon_exporter import csi

        self.m = csi.messages()
        self.channel = grpc.insecure_channel(f"unix://{self.endpoint}")

    def call(self, service: str, method: str) -> Any:
        request, response = f"{method}Request", f"{method}Response"
        return self.channel.unary_unary(
            f"/csi.v1.{service}/{method}",
            request_serializer=self.m[request].SerializeToString,
            response_deserializer=self.m[response].FromString,
        )

    def publish(self, pod_uid: str, namespace: str, pod: str) -> Path:
        """NodePublishVolume as the kubelet calls it for the pod's inline volume ``trainmon``:
        the parent directory made first (0750), the volume handle and context it sends."""
        import hashlib

        parent = self.pods / pod_uid / "volumes" / "kubernetes.io~csi" / "trainmon"
        parent.mkdir(parents=True, mode=0o750, exist_ok=True)
        target = parent / "mount"
        req = self.m["NodePublishVolumeRequest"](
            volume_id="csi-" + hashlib.sha256(f"{pod_uid}trainmon".encode()).hexdigest(),
            target_path=str(target),
            readonly=True,
        )
        req.volume_capability.mount.SetInParent()
        req.volume_capability.access_mode.mode = 1  # SINGLE_NODE_WRITER
        req.volume_context.update(
            {
                "csi.storage.k8s.io/ephemeral": "true",
                "csi.storage.k8s.io/pod.name": pod,
                "csi.storage.k8s.io/pod.namespace": namespace,
                "csi.storage.k8s.io/pod.uid": pod_uid,
                "csi.storage.k8s.io/serviceAccount.name": "default",
            }
        )
        self.call("Node", "NodePublishVolume")(req, timeout=10)
        return target

    def unpublish(self, target: Path) -> None:
        req = self.m["NodeUnpublishVolumeRequest"](volume_id="csi-x", target_path=str(target))
        self.call("Node", "NodeUnpublishVolume")(req, timeout=10)

    def mounts(self) -> str:
        return Path(f"/proc/{self.proc.pid}/mountinfo").read_text()

    def on_node(self, argv: list[str]) -> list[str]:
        """``argv`` run in the plugin's mount namespace (the node's, where the kubelet is)."""
        return ["nsenter", f"--mount=/proc/{self.proc.pid}/ns/mnt", "--", *argv]

    def in_container(self, target: Path, mount_path: str) -> Callable[[list[str]], list[str]]:
        """What the container runtime does with the published volume: a container's own mount
        namespace and ``/run``, the target bind-mounted read-only at the volumeMount's
        ``mountPath``; returns the argv prefix that runs a command in such a container."""
        script = (
            'mount -t tmpfs -o mode=0755 tmpfs /run && mkdir -p "$1" '
            '&& mount --bind -o ro "$0" "$1" && shift && exec "$@"'
        )

        def run(argv: list[str]) -> list[str]:
            private = ["unshare", "--mount", "--propagation", "private", "--"]
            return self.on_node([*private, "sh", "-c", script, str(target), mount_path, *argv])

        assert mount_path.startswith("/run/")  # the container's own /run, not the host's
        return run

    def stop(self) -> str:
        self.channel.close()
        self.proc.terminate()
        try:
            return self.proc.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.communicate()[0]


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
    and a process outside the socket's group is refused.

    With the DaemonSet, the trainer's pod mounts the CSI driver's volume: the DaemonSet's node
    plugin runs here with its own arguments, the kubelet's calls are made over its gRPC
    socket (registration, then NodePublishVolume for the pod), and the trainer connects
    through the published path in the node's mount namespace. The mount is read-only to
    every user; NodeUnpublishVolume removes it, after which the path leads nowhere.
    """
    _need_root_and_setpriv()
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("needs unshare and nsenter (util-linux)")
    specs = dict(pod_specs())
    ex_spec, tr_spec = specs[exporter_pod], specs[trainer_pod]
    exporter = next(
        c for c in containers(ex_spec) if is_exporter_image(c["image"]) and "command" not in c
    )
    trainer = next(c for c in tr_spec["containers"] if "TRAINMON_RUN" in env(c))
    trainer_volume = {v["name"]: v for v in tr_spec["volumes"]}["trainmon"]
    with _kubelet_mount(ex_spec, "socket") as mount:
        for init in ex_spec.get("initContainers", []):
            if init["name"] == "socket-dir":  # the DaemonSet's socket-dir preparation
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
        ex_env["TRAINMON_STATE_FILE"] = f"{mount}/state.json"  # not the host's /var/lib
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
        plugin: CsiPlugin | None = None
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
            trainer_sock, inside = sock, (lambda argv: argv)
            if "csi" in trainer_volume:
                # The trainer's pod: its volume published by the DaemonSet's plugin.
                plugin = CsiPlugin(ex_spec, mount.parent, mount)
                info = plugin.call("Identity", "GetPluginInfo")(
                    plugin.m["GetPluginInfoRequest"](), timeout=10
                )
                assert info.name == trainer_volume["csi"]["driver"]  # what the registrar reads
                node = plugin.call("Node", "NodeGetInfo")(
                    plugin.m["NodeGetInfoRequest"](), timeout=10
                )
                assert node.node_id == "node-1"  # the kubelet's check on registration
                target = plugin.publish("0d8e1f2a-pod-uid", "ml-team", "llm-pretrain-0-abcde")
                assert plugin.publish("0d8e1f2a-pod-uid", "ml-team", "llm-pretrain-0-abcde") == (
                    target
                )  # the kubelet retries: idempotent
                tr_mount = next(m for m in trainer["volumeMounts"] if m["name"] == "trainmon")
                assert f" {target} " in plugin.mounts()
                trainer_sock = env(trainer)["TRAINMON_SOCKET"]["value"]
                inside = plugin.in_container(target, tr_mount["mountPath"])
            tr_uid, tr_gid, tr_groups = _identity(tr_spec, trainer)
            assert tr_uid not in (0, uid), "the trainer must be another, non-root user"
            ok = subprocess.run(
                inside(
                    _runs_as(
                        tr_uid, tr_gid, tr_groups, [sys.executable, "-c", TRAINER, trainer_sock]
                    )
                ),
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
                inside(_runs_as(tr_uid, tr_gid, [], [sys.executable, "-c", TRAINER, trainer_sock])),
                capture_output=True,
                text=True,
                timeout=60,
                env=child_env(),
                check=False,
            )
            assert outsider.returncode == 0 and outsider.stdout.split() != ["dropped", "0"], (
                outsider.stdout + outsider.stderr
            )
            if plugin is not None:
                # Read-only for everyone, root included: nothing can be planted beside the socket
                # or replace it, in the pod or on the node.
                for argv in (
                    inside(["touch", f"{Path(trainer_sock).parent}/planted"]),
                    inside(["rm", "-f", trainer_sock]),
                    plugin.on_node(["touch", f"{target}/planted"]),
                ):
                    rw = subprocess.run(argv, capture_output=True, text=True, check=False)
                    assert rw.returncode != 0 and "Read-only file system" in rw.stderr, rw
                plugin.unpublish(target)
                plugin.unpublish(target)  # idempotent: the kubelet retries
                assert f" {target} " not in plugin.mounts() and not target.exists()
                left = subprocess.run(
                    plugin.on_node(["ls", "-A", str(target.parent)]), capture_output=True, text=True
                )
                assert left.returncode == 0 and left.stdout == "", left  # nothing left behind
                assert Path(sock).is_socket()  # the exporter's own socket is untouched
        finally:
            if plugin is not None:
                print(plugin.stop()[-2000:])
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
