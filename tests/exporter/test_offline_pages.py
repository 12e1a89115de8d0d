"""Every page the exporter links to works offline: no CDN, no dead link."""

from __future__ import annotations

import re

from ..conftest import InProcessExporter


def test_status_page_links_answer_and_nothing_loads_from_another_host(
    exporter: InProcessExporter,
) -> None:
    page = exporter.client.get("/")
    assert page.status_code == 200
    links = re.findall(r'(?:href|src)="([^"]+)"', page.text)
    assert "/openapi.json" in links and "/metrics" in links
    for link in links:
        assert link.startswith("/"), f"status page refers to another host: {link}"
        r = exporter.client.get(link)
        assert r.status_code == 200, link
        # A linked page must not pull scripts or styles from a CDN (blank when offline).
        assert not re.search(r'(?:src|href)="https?://', r.text), link
    assert exporter.client.get("/openapi.json").json()["info"]["title"] == "trainmon exporter"


def test_no_swagger_page_that_would_be_blank_offline(exporter: InProcessExporter) -> None:
    assert exporter.client.get("/docs").status_code == 404
    assert exporter.client.get("/redoc").status_code == 404
