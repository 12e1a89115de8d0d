"""The names both sides check: run ids, metric, operation and layer names, pod names.

One definition for the client, which refuses a bad name before it sends it (``init()``, the
encoder's NAME records, the run id it derives from a launcher's variables), and for the
exporter, which refuses it again in a HELLO or a NAME record it receives (a client is not
trusted), and reads Kubernetes names from the node's pod directory. Every name is at most
:data:`MAX_NAME_CHARS` characters of a fixed alphabet: no quotes, spaces or control
characters, so it is safe as a Prometheus label value and in a log line.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = [
    "MAX_NAME_CHARS",
    "valid_metric_name",
    "valid_name",
    "valid_namespace",
    "valid_pod",
    "valid_run_id",
]

_DNS_LABEL_RE: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_DNS_SUBDOMAIN_RE: Final = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z"
)


def valid_namespace(value: str) -> bool:
    """A Kubernetes namespace name: an RFC 1123 DNS label (1-63 of ``a-z 0-9 -``)."""
    return isinstance(value, str) and _DNS_LABEL_RE.match(value) is not None


def valid_pod(value: str) -> bool:
    """A Kubernetes pod name: an RFC 1123 DNS subdomain (1-253 of ``a-z 0-9 - .``)."""
    return (
        isinstance(value, str) and len(value) <= 253 and _DNS_SUBDOMAIN_RE.match(value) is not None
    )


MAX_NAME_CHARS: Final = 128
"""Longest run id or custom metric name accepted (characters)."""
_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/\-]*\Z")
_LABEL_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/\-]*\Z")
_RUN_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+\-]*\Z")


def valid_metric_name(name: object) -> bool:
    """Whether ``name`` may be a custom metric name.

    Rule: 1 to :data:`MAX_NAME_CHARS` characters, a letter or ``_`` first, then letters, digits
    and ``_ . : / -``. Quotes, spaces, newlines and other control characters are refused.
    """
    return (
        type(name) is str and 0 < len(name) <= MAX_NAME_CHARS and _NAME_RE.match(name) is not None
    )


def valid_name(name: object) -> bool:
    """Whether ``name`` may travel in a NAME record.

    It may be a custom metric name, an operation name, or a layer's module path, which may
    start with a digit (``nn.Sequential`` children are ``0``, ``1``, ...): 1 to
    :data:`MAX_NAME_CHARS` of letters, digits and ``_ . : / -``.
    """
    return (
        type(name) is str and 0 < len(name) <= MAX_NAME_CHARS and _LABEL_RE.match(name) is not None
    )


def valid_run_id(run: object) -> bool:
    """Whether ``run`` may be a run id: 1 to 128 of letters, digits and ``_ . : @ + -``."""
    return type(run) is str and 0 < len(run) <= MAX_NAME_CHARS and _RUN_RE.match(run) is not None
