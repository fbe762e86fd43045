"""schemathesis fuzzes every route of the OpenAPI document against a real gateway on the real
broker: never a 5xx other than the documented 503, every refusal has the JSON error shape."""

from __future__ import annotations

import uuid

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.openapi import REASONS, openapi_document
from ipdp.kafka_io import ensure_topics
from ipdp.settings import TopicSettings
from tests.gateway.conftest import running_gateway
from tests.pipeline import create

schema = schemathesis.openapi.from_dict(openapi_document())
STUDY = "fuzz-1"


def refusals_are_json_errors(ctx, response, case) -> None:
    """No 5xx but 503; a 4xx or 503 is ``{"error": <documented reason>, "detail": str}``."""
    status = response.status_code
    assert status < 500 or status == 503, f"server error {status}: {response.text[:200]}"
    if status >= 400:
        body = response.json()
        assert set(body) == {"error", "detail"}, body
        assert body["error"] in REASONS[status], body
        assert isinstance(body["detail"], str)


CHECKS = [refusals_are_json_errors, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_gateway(runtime):
    """One gateway for the module, with one open study of d = 2 on private topics."""
    kafka = runtime.kafka_settings()
    suffix = uuid.uuid4().hex[:12]
    topics = TopicSettings(records=f"ipdp.records.{suffix}", models=f"ipdp.models.{suffix}",
                           dead_letter=f"ipdp.dead-letter.{suffix}",
                           studies=f"ipdp.studies.{suffix}")
    ensure_topics(kafka, topics)
    create(kafka, runtime.redis_settings(), topics, study_id=STUDY, d=2, n=1000, epsilon=1.0,
           delta=0.01)
    with running_gateway(kafka, topics, max_body_bytes=64 * 1024) as url:
        yield url


@schema.parametrize()
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_gateway_survives_fuzzing(case, fuzz_gateway):
    response = case.call(base_url=fuzz_gateway)
    case.validate_response(response, checks=CHECKS)
    if "study_id" in (case.path_parameters or {}):
        # The same request for the real, open study, so the body checks run too.
        case.path_parameters["study_id"] = STUDY
        response = case.call(base_url=fuzz_gateway)
        case.validate_response(response, checks=CHECKS)
