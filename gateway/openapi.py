"""The gateway's OpenAPI 3.1 document, written out by hand (served at /openapi.json and committed
as docs/gateway-openapi.json; tests/gateway/test_openapi.py checks the two agree)."""

from __future__ import annotations

import json

from gateway.checks import HTTP_STATUS

__all__ = ["REASONS", "openapi_document", "openapi_text"]

#: Every machine reason an error answer may carry, by HTTP status.
REASONS: dict[int, list[str]] = {
    status: [reason.value for reason, s in HTTP_STATUS.items() if s == status]
    for status in sorted(set(HTTP_STATUS.values()))}

_TEXT = {
    400: "A record is unusable, or the aggregator would not fold it (norms outside the study's "
         "bounds, created outside the replay window), or the request holds one record id twice "
         "(`duplicate_record`); `error` names the first check a record failed.",
    401: "The study requires a device credential (`Authorization: IPDP-Credential <token>`, "
         "docs/security.md) and the request has none, a malformed one, or one whose issuer key "
         "the gateway does not pin (IPDP_TRUSTED_CREDENTIAL_KEYS).",
    403: "The credential is expired or for another study, or a record id is not one of its "
         "slots (or uses one twice).",
    404: "No study with this id on the studies topic.",
    409: "The study is closed and accepts no more records.",
    413: "The body is longer than IPDP_GATEWAY_MAX_BODY_BYTES, or holds more records than "
         "this client may send at once (IPDP_GATEWAY_RECORD_LIMIT_BURST; a relay's: "
         "IPDP_GATEWAY_RELAY_RECORD_LIMIT_BURST).",
    415: "Content-Type is neither application/octet-stream nor application/json.",
    429: "Too many requests or records from this client (IPDP_GATEWAY_RATE_LIMIT_PER_S, "
         "IPDP_GATEWAY_RECORD_LIMIT_PER_S); retry after Retry-After seconds.",
    503: "Kafka did not acknowledge the records (or the gateway is not ready yet); nothing was "
         "accepted. Retry the same bytes: the record id makes a retry harmless.",
}


def _error(status: int) -> dict:
    return {"description": _TEXT[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


_STUDY_ID = {"name": "study_id", "in": "path", "required": True, "schema": {"type": "string"},
             "description": "The study's id (its key on the studies topic)."}


def openapi_document() -> dict:
    """The OpenAPI document of every route the gateway serves."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ipdp gateway",
            "version": "1",
            "description": "HTTP ingest of perturbed records (docs/wire-format.md: version 1, "
                           "or version 3 for a two-server study). "
                           "A 202 means Kafka acknowledged every record of the request with "
                           "acks=all (records of concurrent requests share Kafka messages).",
        },
        "paths": {
            "/studies/{study_id}/records": {"post": {
                "operationId": "postRecords",
                "summary": "Submit one or more perturbed records of one study.",
                "parameters": [_STUDY_ID],
                # Optional: only studies that require credentials ask for one.
                "security": [{}, {"deviceCredential": []}],
                "requestBody": {"required": True, "content": {
                    "application/octet-stream": {"schema": {
                        "type": "string", "format": "binary",
                        "description": "k ≥ 1 records of the study's d, concatenated: "
                                       "version 1 (k · (48 + 16·d) bytes), or for a "
                                       "two-server study version 3 (k · (100 + 16·L) bytes, "
                                       "L = d(d+3)/2)."}},
                    "application/json": {"schema": {
                        "$ref": "#/components/schemas/Records",
                        "description": "Version-1 records only: a two-server study refuses "
                                       "the JSON form (415), which holds q̃ and p̃ in clear."}},
                }},
                "responses": {
                    "202": {"description": "Kafka acknowledged every record.",
                            "content": {"application/json": {"schema": {
                                "$ref": "#/components/schemas/Accepted"}}}},
                    **{str(s): _error(s) for s in (400, 401, 403, 404, 409, 413, 415, 429,
                                                          503)},
                },
            }},
            "/studies/{study_id}": {"get": {
                "operationId": "getStudy",
                "summary": "The study's current studies-topic message, byte for byte.",
                "parameters": [_STUDY_ID],
                "responses": {
                    "200": {"description": "The latest value of the study's key on the studies "
                                           "topic (a signed envelope once studies are signed).",
                            "content": {"application/json": {"schema": {"type": "object"}}}},
                    "404": _error(404),
                    "503": _error(503),
                },
            }},
            "/healthz": {"get": {
                "operationId": "healthz", "summary": "The process is up.",
                "responses": {"200": {"description": "Up.", "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Status"}}}}},
            }},
            "/readyz": {"get": {
                "operationId": "readyz",
                "summary": "Kafka producer connected and the studies topic read.",
                "responses": {
                    "200": {"description": "Ready.", "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/Status"}}}},
                    "503": _error(503),
                },
            }},
            "/metrics": {"get": {
                "operationId": "metrics", "summary": "Prometheus metrics.",
                "responses": {"200": {"description": "Prometheus text format.",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}}},
            }},
            "/openapi.json": {"get": {
                "operationId": "openapi", "summary": "This document.",
                "responses": {"200": {"description": "OpenAPI 3.1.", "content": {
                    "application/json": {"schema": {"type": "object"}}}}},
            }},
        },
        "components": {"securitySchemes": {"deviceCredential": {
            "type": "http", "scheme": "IPDP-Credential",
            "description": "A device credential of the study (`ipdp credentials issue`, "
                           "docs/wire-format.md): `Authorization: IPDP-Credential <token>`, the "
                           "token unpadded base64url. Required by studies that require "
                           "credentials; the records' ids must be its slots."}}, "schemas": {
            "Record": {
                "type": "object", "additionalProperties": False,
                "required": ["record_id", "created_ms", "q", "p"],
                "properties": {
                    "record_id": {"type": "string", "pattern": "^[0-9a-fA-F]{32}$",
                                  "description": "16 random bytes, hex."},
                    "created_ms": {"type": "integer", "minimum": -(2**63),
                                   "maximum": 2**63 - 1},
                    "q": {"type": "array", "minItems": 1, "items": {"type": "number"},
                          "description": "q̃, d values."},
                    "p": {"type": "array", "minItems": 1, "items": {"type": "number"},
                          "description": "p̃, d values."},
                },
            },
            "Records": {
                "type": "object", "additionalProperties": False, "required": ["records"],
                "properties": {"records": {"type": "array", "minItems": 1,
                                           "items": {"$ref": "#/components/schemas/Record"}}},
            },
            "Accepted": {
                "type": "object", "required": ["accepted"],
                "properties": {"accepted": {"type": "integer", "minimum": 1}},
            },
            "Status": {"type": "object", "required": ["status"],
                       "properties": {"status": {"type": "string"}}},
            "Error": {
                "type": "object", "required": ["error", "detail"],
                "properties": {
                    "error": {"type": "string",
                              "enum": sorted({r for rs in REASONS.values() for r in rs})},
                    "detail": {"type": "string"},
                },
            },
        }},
    }


def openapi_text() -> str:
    """The document as committed in docs/gateway-openapi.json."""
    return json.dumps(openapi_document(), indent=2, ensure_ascii=False) + "\n"
