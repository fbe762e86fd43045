"""The committed OpenAPI document is the one the gateway serves."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.openapi import openapi_document, openapi_text

DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway-openapi.json"


def test_committed_openapi_document_is_current():
    assert DOC.read_text(encoding="utf-8") == openapi_text(), (
        "regenerate it: ipdp gateway --openapi > docs/gateway-openapi.json")


def test_openapi_document_is_valid_json_with_every_route():
    doc = json.loads(openapi_text())
    assert doc == openapi_document()
    assert set(doc["paths"]) == {"/studies/{study_id}/records", "/studies/{study_id}", "/healthz",
                                 "/readyz", "/metrics", "/openapi.json"}
