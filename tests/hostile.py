"""The hostile studies-topic values a writer of the topic can send (docs/security.md).

Each entry is (name, value from the study owner's key, the MalformedValue reason a reader
gives). Values carry SECRET_MARK where a content can carry it, so a test can check that no log
line or error quotes the value.
"""

from __future__ import annotations

import base64
import json

from ipdp.signing import SigningKey
from ipdp.study import Study, signed_bytes

SECRET_MARK = "s3cr3t-c0ntent"
PARAMS = {"d": 4, "n": 2_000, "epsilon": 1.0, "delta": 0.01}


def bad_signature() -> str:
    return base64.b64encode(bytes(64)).decode()


def signed_text(owner: SigningKey, study_id: str = "evil", **changes) -> bytes:
    """A study envelope signed by ``owner`` whose text holds ``changes`` (numbers as JSON text)."""
    fields = json.loads(Study(study_id=study_id, **PARAMS).canonical_text)
    fields.update({k: f"@{k}@" for k in changes})
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    for k, v in changes.items():
        text = text.replace(f'"@{k}@"', v if isinstance(v, str) else repr(v))
    kid, sig = owner.sign(signed_bytes("open", text))
    return json.dumps({"format": 2, "study": text, "status": "open", "key_id": kid,
                       "signature": sig}).encode()


HOSTILE_STUDY_VALUES = [
    ("deep_nesting", lambda owner: b"[" * 100_000 + b"]" * 100_000, "too_deep"),
    ("huge", lambda owner: b'{"format": 2, "study": "' + SECRET_MARK.encode() * 80_000 + b'"}',
     "too_large"),
    ("epsilon_1e-308", lambda owner: signed_text(owner, epsilon=1e-308), "invalid"),
    ("invalid_utf8", lambda owner: b'{"format": 2, "study": "\xff\xfe' + SECRET_MARK.encode()
     + b'"}', "not_utf8"),
    ("number_1e999", lambda owner: signed_text(owner, epsilon="1e999"), "number"),
    ("not_an_object", lambda owner: json.dumps([SECRET_MARK, 2]).encode(), "not_object"),
    ("not_json", lambda owner: b'{"format": 2, ' + SECRET_MARK.encode(), "not_json"),
    ("study_text_not_an_object", lambda owner: json.dumps(
        {"format": 2, "study": json.dumps([SECRET_MARK]), "status": "open", "key_id": "",
         "signature": ""}).encode(), "not_object"),
]
