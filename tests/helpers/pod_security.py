"""The Pod Security Standards, as Pod Security admission checks a pod spec (offline).

Each rule of the ``baseline`` and ``restricted`` levels as kubernetes.io's Pod Security
Standards page lists them (policy version ``latest``, Kubernetes 1.29 to 1.37), checked on a
pod spec the way the admission plugin reads it: every container, init container and ephemeral
container; the pod-level ``securityContext`` as the default a container-level field overrides.
:func:`violations` returns one line per violated check, named as the admission plugin names
it in its warning (``hostPath volumes``, ``allowPrivilegeEscalation != false`` ...), so a
message can be compared with what ``kubectl`` prints on a real cluster.
"""

from __future__ import annotations

from typing import Any

LEVELS = ("privileged", "baseline", "restricted")

BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES = frozenset(
    {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
)
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        *spec.get("initContainers", []),
        *spec.get("containers", []),
        *spec.get("ephemeralContainers", []),
    ]


def _sc(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("securityContext") or {}


def baseline(spec: dict[str, Any], annotations: dict[str, str] | None = None) -> list[str]:
    """The ``baseline`` checks ``spec`` fails (empty: it passes)."""
    out: list[str] = []
    pod = _sc(spec)
    cs = _containers(spec)
    if (pod.get("windowsOptions") or {}).get("hostProcess") or any(
        (_sc(c).get("windowsOptions") or {}).get("hostProcess") for c in cs
    ):
        out.append("hostProcess")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"host namespaces ({field}=true)")
    for c in cs:
        name = c["name"]
        sc = _sc(c)
        if sc.get("privileged"):
            out.append(f"privileged (container {name!r})")
        extra = set((sc.get("capabilities") or {}).get("add", [])) - BASELINE_CAPABILITIES
        if extra:
            out.append(f"non-default capabilities (container {name!r}: {sorted(extra)})")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"hostPort (container {name!r})")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"procMount (container {name!r})")
    for v in spec.get("volumes", []):
        if "hostPath" in v and v["hostPath"] is not None:
            out.append(f"hostPath volumes ({v['name']!r})")
    for where in (pod, *map(_sc, cs)):
        profile = (where.get("appArmorProfile") or {}).get("type")
        if profile not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"forbidden AppArmor profile ({profile})")
        se = where.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append("seLinuxOptions")
        if (where.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append("seccompProfile (Unconfined)")
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            out.append(f"forbidden AppArmor profile ({value})")
    for s in pod.get("sysctls", []):
        if s["name"] not in SAFE_SYSCTLS:
            out.append(f"forbidden sysctls ({s['name']})")
    return out


def restricted(spec: dict[str, Any], annotations: dict[str, str] | None = None) -> list[str]:
    """The ``restricted`` checks ``spec`` fails, the baseline ones included."""
    out = baseline(spec, annotations)
    pod = _sc(spec)
    cs = _containers(spec)
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"restricted volume types ({v['name']!r}: {sorted(kinds)})")
    for c in cs:
        name = c["name"]
        sc = _sc(c)
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"allowPrivilegeEscalation != false (container {name!r})")
        non_root = sc.get("runAsNonRoot", pod.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"runAsNonRoot != true (container {name!r})")
        if sc.get("runAsUser", pod.get("runAsUser")) == 0:
            out.append(f"runAsUser=0 (container {name!r})")
        seccomp = (sc.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"seccompProfile (container {name!r} must be RuntimeDefault or Localhost)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"unrestricted capabilities (container {name!r} must drop ALL)")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"unrestricted capabilities (container {name!r} adds {caps['add']})")
    if pod.get("runAsUser") == 0:
        out.append("runAsUser=0 (pod)")
    return out


def violations(
    level: str, spec: dict[str, Any], annotations: dict[str, str] | None = None
) -> list[str]:
    """What Pod Security admission at ``level`` (``privileged``, ``baseline``,
    ``restricted``) would refuse ``spec`` for; empty when it admits it."""
    if level == "privileged":
        return []
    if level == "baseline":
        return baseline(spec, annotations)
    if level == "restricted":
        return restricted(spec, annotations)
    raise ValueError(f"unknown Pod Security level {level!r}: one of {LEVELS}")
