"""The aggregator's stateless record checks called directly (aggregator/validate.py): containers
split into rows with their partitions, offsets, indices and header blocks, in poll order; what
is refused, with the exact reason and detail a dead letter carries; and the checks of
:class:`Validator` (study lookup outcomes, time window edges, norms, credentials). Pure unit
tests: no broker, no Redis."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from aggregator.batch import NOT_IN_CONTAINER, Polled, Refused
from aggregator.credentials import CredentialCheck
from aggregator.validate import Validator, ValidRows, split_containers
from ipdp.credentials import (
    credential_id,
    credentials_header,
    issue_credential,
    slot_record_ids,
)
from ipdp.sealing import HelperKey
from ipdp.signing import SigningKey, TrustedKeys
from ipdp.study import Study
from ipdp.wire import (
    CONTAINER_HEADER_SIZE,
    MalformedRecord,
    RejectReason,
    encode_batch,
    encode_container,
    study_headers,
)

D = 3
NOW_MS = 1_700_000_000_000
WINDOW_S = 3600
SKEW_S = 60
MAX_BYTES = 4096
MALFORMED = "malformed container: count, length or reserved bytes do not add up"
STUDY = Study(study_id="checks", d=D, n=1000, epsilon=1.0, delta=0.01)


def records(k: int, study: Study = STUDY, created_ms=NOW_MS, scale: float = 1.0,
            ids: np.ndarray | None = None) -> list[bytes]:
    """k version-1 records of ``study`` with norms inside its bounds (times ``scale``)."""
    q = np.full((k, study.d), 0.1 * scale) + np.arange(k)[:, None] * 1e-3
    p = np.full((k, study.d), 0.2 * scale)
    ids = (np.arange(16 * k) % 251).astype(np.uint8).reshape(k, 16) if ids is None else ids
    return encode_batch(study.hash, ids, np.broadcast_to(np.asarray(created_ms, np.int64), k),
                        q, p)


def polled(values: list, headers: list | None = None, partition: int = 0) -> Polled:
    """A poll of ``values`` at offsets 10, 11, …"""
    return Polled(np.full(len(values), partition, np.int64),
                  np.arange(10, 10 + len(values), dtype=np.int64), list(values), headers=headers)


def refusals(refused: Refused) -> list[tuple[int, int | None, str, str]]:
    """(offset, container index, reason, detail) of each refusal."""
    return [(r.message.offset, r.index, r.reason.value, r.detail) for r in refused]


# --- split_containers ---------------------------------------------------------------------


def test_a_poll_without_containers_is_returned_as_it_is():
    poll = polled(records(3))
    rows, refused = split_containers(poll, MAX_BYTES)
    assert rows is poll
    assert len(refused) == 0


def test_containers_and_plain_records_split_in_poll_order_with_their_header_blocks():
    r = records(7)
    heads = [b"h-plain-0", b"h-container-1", b"h-plain-2", b"h-container-3"]
    values = [r[0], encode_container(r[1:4]), r[4], encode_container(r[5:7])]
    rows, refused = split_containers(polled(values, heads, partition=4), MAX_BYTES)
    assert len(refused) == 0
    assert rows.values == r
    assert rows.partition.tolist() == [4] * 7
    assert rows.offset.tolist() == [10, 11, 11, 11, 12, 13, 13]
    assert rows.index.tolist() == [NOT_IN_CONTAINER, 0, 1, 2, NOT_IN_CONTAINER, 0, 1]
    assert rows.headers == [heads[0], heads[1], heads[1], heads[1], heads[2], heads[3],
                            heads[3]]


def test_a_poll_without_headers_splits_into_rows_without_headers():
    r = records(3)
    rows, refused = split_containers(polled([r[0], encode_container(r[1:])]), MAX_BYTES)
    assert len(refused) == 0
    assert rows.values == r
    assert rows.headers is None


def test_a_container_of_one_record_is_that_record_at_index_zero():
    r = records(2)
    rows, _ = split_containers(polled([encode_container(r[:1]), r[1]], [b"a", b"b"]),
                               MAX_BYTES)
    assert rows.values == r
    assert rows.index.tolist() == [0, NOT_IN_CONTAINER]
    assert rows.offset.tolist() == [10, 11]
    assert rows.headers == [b"a", b"b"]


def test_a_container_of_exactly_max_message_bytes_is_split_one_byte_less_is_refused():
    container = encode_container(records(4))
    size = len(container)
    rows, refused = split_containers(polled([container]), size)
    assert len(rows) == 4 and len(refused) == 0
    rows, refused = split_containers(polled([container]), size - 1)
    assert len(rows) == 0
    assert refusals(refused) == [
        (10, None, "oversized", f"container of {size} bytes exceeds {size - 1}")]
    assert refused.records.values == [container]


@pytest.mark.parametrize("bad", ["oversized", "malformed"])
def test_a_refused_container_leaves_the_rows_after_it_split(bad):
    r = records(5)
    small = encode_container(r[1:3])
    first = (encode_container(records(20)) if bad == "oversized"
             else small[:-1])  # one byte short: the lengths do not add up
    values = [r[0], first, small, r[3], encode_container(r[4:])]
    rows, refused = split_containers(polled(values, [b"0", b"1", b"2", b"3", b"4"]),
                                     len(small) + 100)
    assert rows.values == [r[0], r[1], r[2], r[3], r[4]]
    assert rows.offset.tolist() == [10, 12, 12, 13, 14]
    assert rows.index.tolist() == [NOT_IN_CONTAINER, 0, 1, NOT_IN_CONTAINER, 0]
    assert rows.headers == [b"0", b"2", b"2", b"3", b"4"]
    detail = (f"container of {len(first)} bytes exceeds {len(small) + 100}"
              if bad == "oversized" else MALFORMED)
    assert refusals(refused) == [(11, None, bad if bad == "oversized" else "undecodable",
                                  detail)]
    assert refused.records.headers == [b"1"]


def test_a_malformed_container_is_refused_whole_as_undecodable_with_why():
    r = records(2)
    bad = bytearray(encode_container(r))
    bad[1] = 7  # a reserved byte
    rows, refused = split_containers(polled([bytes(bad), r[0]]), MAX_BYTES)
    assert rows.values == [r[0]]
    assert refusals(refused) == [(10, None, "undecodable", MALFORMED)]


def test_a_lone_version_two_byte_is_a_malformed_container_wherever_it_stands():
    """A one-byte value ``2`` is a container's first byte without the rest, also as the last
    value of a poll; any other one-byte value is left to the record decoder."""
    for values, where in (([b"\x02"], 10), ([b"\x05", b"\x02"], 11),
                          ([b"\x02", b"\x05"], 10), ([b"\x02", b""], 10)):
        rows, refused = split_containers(polled(values), MAX_BYTES)
        assert refusals(refused) == [(where, None, "undecodable", MALFORMED)], values
        assert rows.values == [v for v in values if v != b"\x02"]
    for values in ([b"\x07"], [b"\x07", b""]):
        rows, refused = split_containers(polled(values), MAX_BYTES)
        assert rows.values == values and len(refused) == 0


def test_an_empty_value_before_a_container_is_not_taken_for_one():
    r = records(2)
    rows, refused = split_containers(polled([b"", encode_container(r), b""]), MAX_BYTES)
    assert len(refused) == 0
    assert rows.values == [b"", *r, b""]
    assert rows.index.tolist() == [NOT_IN_CONTAINER, 0, 1, NOT_IN_CONTAINER]


def test_a_tombstone_in_the_poll_does_not_hide_its_containers():
    r = records(3)
    rows, refused = split_containers(polled([None, encode_container(r), b"\x02"]), MAX_BYTES)
    assert rows.values == [None, *r]
    assert rows.index.tolist() == [NOT_IN_CONTAINER, 0, 1, 2]
    assert refusals(refused) == [(12, None, "undecodable", MALFORMED)]


def test_a_container_header_alone_is_malformed():
    rows, refused = split_containers(
        polled([encode_container(records(1))[:CONTAINER_HEADER_SIZE]]), MAX_BYTES)
    assert len(rows) == 0
    assert refusals(refused) == [(10, None, "undecodable", MALFORMED)]


# --- ValidRows ----------------------------------------------------------------------------


def test_valid_rows_take_keeps_the_study_and_each_columns_selected_rows():
    rows = ValidRows(STUDY, np.array([3, 5, 8]), np.array([b"a" * 16, b"b" * 16, b"c" * 16]),
                     np.arange(9.0).reshape(3, 3), -np.arange(9.0).reshape(3, 3))
    kept = rows.take(np.array([True, False, True]))
    assert kept.study is STUDY
    assert kept.row.tolist() == [3, 8]
    assert kept.record_id.tolist() == [b"a" * 16, b"c" * 16]
    assert kept.q.tolist() == [[0, 1, 2], [6, 7, 8]]
    assert kept.p.tolist() == [[0, -1, -2], [-6, -7, -8]]


# --- Validator ----------------------------------------------------------------------------


def validator(**kw) -> Validator:
    return Validator(replay_window_s=WINDOW_S, max_future_skew_s=SKEW_S,
                     max_message_bytes=MAX_BYTES, **kw)


def check(v: Validator, poll: Polled, studies: dict, registered: dict | None = None
          ) -> tuple[Refused, list[ValidRows]]:
    """Split, decode and validate ``poll`` at NOW_MS, as the fold does."""
    rows, _ = split_containers(poll, MAX_BYTES)
    return v.validate(rows, v.decode(rows), studies, registered or {}, NOW_MS)


def test_decoding_a_poll_where_nothing_decodes_names_no_study():
    decoded = validator().decode(polled([b"\x01", None]))
    assert decoded.batches == []
    assert decoded.study_hashes == []
    assert [r for _, r, _ in decoded.undecoded] == [RejectReason.UNDECODABLE] * 2


def test_the_time_window_admits_its_edges_and_refuses_a_millisecond_past_them():
    oldest, latest = NOW_MS - WINDOW_S * 1000, NOW_MS + SKEW_S * 1000
    values = records(4, created_ms=[oldest - 1, oldest, latest, latest + 1])
    refused, valid = check(validator(), polled(values), {STUDY.hash: STUDY})
    assert refusals(refused) == [(10, None, "stale", "created before the replay window"),
                                 (13, None, "future", "created too far in the future")]
    assert [v.row.tolist() for v in valid] == [[1, 2]]


def test_valid_rows_carry_the_study_and_the_rows_decoded_columns_in_row_order():
    r = records(4)
    values = [r[0], encode_container(r[1:3]), r[3]]
    refused, valid = check(validator(), polled(values), {STUDY.hash: STUDY})
    assert len(refused) == 0
    (one,) = valid
    assert one.study is STUDY
    assert one.row.tolist() == [0, 1, 2, 3]
    assert one.record_id.tolist() == np.arange(64).reshape(4, 16).tolist()
    assert np.allclose(one.q[:, 0], 0.1 + np.arange(4) * 1e-3)
    assert np.allclose(one.p, 0.2)


def test_studies_of_other_dimensions_interleaved_pass_each_in_row_order():
    other = Study(study_id="other", d=2, n=1000, epsilon=1.0, delta=0.01)
    mine, theirs = records(3), records(3, study=other)
    wrong_d = encode_batch(STUDY.hash, np.zeros((1, 16), np.uint8), np.array([NOW_MS]),
                           np.full((1, 2), 0.1), np.full((1, 2), 0.2))
    values = [theirs[0], mine[0], wrong_d[0], mine[1], theirs[1], theirs[2], mine[2]]
    refused, valid = check(validator(), polled(values),
                           {STUDY.hash: STUDY, other.hash: other})
    assert refusals(refused) == [
        (12, None, "wrong_dimension", "record has d=2, study checks has d=3")]
    by_study = {v.study.study_id: v for v in valid}
    assert by_study["checks"].row.tolist() == [1, 3, 6]
    assert by_study["checks"].record_id.tolist() == np.arange(48).reshape(3, 16).tolist()
    assert by_study["other"].row.tolist() == [0, 4, 5]
    assert by_study["other"].q.shape == (3, 2)


def test_norms_are_checked_when_the_decoder_gave_none():
    """A RecordBatch without the decoder's squared norms is checked on norms computed from its
    q̃ and p̃ (ipdp.wire.squared_norms)."""
    v = validator()
    values = records(2) + records(1, scale=100.0, ids=np.full((1, 16), 9, np.uint8))
    rows, _ = split_containers(polled(values), MAX_BYTES)
    decoded = v.decode(rows)
    bare = dataclasses.replace(decoded, batches=[
        dataclasses.replace(b, sq_q=None, sq_p=None) for b in decoded.batches])
    for given in (decoded, bare):
        refused, valid = v.validate(rows, given, {STUDY.hash: STUDY}, {}, NOW_MS)
        assert [(r.reason.value, r.message.offset) for r in refused] == [
            ("norm_out_of_bounds", 12)]
        assert refused.causes[0][1] == f"‖q̃‖ exceeds {STUDY.norm_bounds.q_high:.4g}"
        assert [x.row.tolist() for x in valid] == [[0, 1]]


def test_a_study_that_does_not_verify_refuses_its_rows_with_the_lookups_reason():
    untrusted = MalformedRecord(RejectReason.UNTRUSTED_STUDY, "signature does not verify")
    refused, valid = check(validator(), polled(records(2)), {STUDY.hash: untrusted})
    assert valid == []
    assert refusals(refused) == [(10, None, "untrusted_study", "signature does not verify"),
                                 (11, None, "untrusted_study", "signature does not verify")]


def test_rows_matching_no_study_are_a_mismatch_only_under_a_registered_studys_header():
    values = records(3)
    heads = [study_headers("checks"), study_headers("gone"), None]
    refused, valid = check(validator(), polled(values, heads), {STUDY.hash: None},
                              registered={"checks": True, "gone": False})
    assert valid == []
    h = STUDY.hash.hex()
    mismatch = (f"hash {h} is not study checks's: the record was perturbed under other "
                "parameters than the registered ones")
    assert refusals(refused) == [(10, None, "study_mismatch", mismatch),
                                 (11, None, "unknown_study", f"no study has hash {h}"),
                                 (12, None, "unknown_study", f"no study has hash {h}")]


def test_version_one_records_of_a_two_server_study_are_refused_as_the_wrong_version():
    two = Study(study_id="two", d=D, n=1000, epsilon=1.0, delta=0.01,
                two_server={"helper_id": "helper-a", "helper_url": "http://127.0.0.1:9",
                            "helper_key": HelperKey(X25519PrivateKey.generate()).public_b64})
    refused, valid = check(validator(), polled(records(2, study=two)), {two.hash: two})
    assert valid == []
    detail = ("study two is a two-server study: its records are version 3 "
              "(aggregator/two_server.py)")
    assert refusals(refused) == [(10, None, "unsupported_version", detail),
                                 (11, None, "unsupported_version", detail)]


CREDENTIALED = Study(study_id="cred", d=D, n=1000, epsilon=1.0, delta=0.01,
                     require_credentials=True)


def credentialed(key: SigningKey) -> tuple[list[bytes], list]:
    """Three records of CREDENTIALED: a credential's slot, one without a credential, one under
    the same credential but another record id."""
    token = issue_credential(key, CREDENTIALED.hash, NOW_MS - 1000, NOW_MS + 60_000)
    slot = slot_record_ids(credential_id(token), 1)
    values = records(2, study=CREDENTIALED, ids=np.concatenate(
        [slot, np.full((1, 16), 9, np.uint8)]))
    header = [credentials_header([(token, 1)])]
    return [values[0], values[1], values[1]], [header, None, header]


def test_a_credentialed_study_folds_only_the_rows_its_trusted_credentials_admit():
    issuer = SigningKey(Ed25519PrivateKey.generate())
    values, heads = credentialed(issuer)
    trusted = CredentialCheck(TrustedKeys([issuer.private.public_key()]),
                              replay_window_s=WINDOW_S, max_future_skew_s=SKEW_S)
    refused, valid = check(validator(credentials=trusted), polled(values, heads),
                              {CREDENTIALED.hash: CREDENTIALED})
    assert [x.row.tolist() for x in valid] == [[0]]
    assert [(r.message.offset, r.reason.value) for r in refused] == [
        (11, "credential_missing"), (12, "credential_bad_slot")]


def test_without_credential_keys_a_credentialed_study_folds_nothing():
    """The default credential check trusts no issuer: every credential is untrusted."""
    values, heads = credentialed(SigningKey(Ed25519PrivateKey.generate()))
    refused, valid = check(validator(), polled(values, heads),
                              {CREDENTIALED.hash: CREDENTIALED})
    assert valid == []
    assert [(r.message.offset, r.reason.value) for r in refused] == [
        (10, "credential_untrusted"), (11, "credential_missing"), (12, "credential_untrusted")]


def test_the_study_headers_to_look_up_are_those_of_rows_whose_hash_names_no_study():
    # The fold looks these names up before validating: only rows whose hash is unknown count,
    # and a row without a study header names nothing.
    other = Study(study_id="other", d=D, n=500, epsilon=1.0, delta=0.01)
    values = records(2) + records(2, study=other)
    heads = [study_headers("lost-a"), None, study_headers("known"), study_headers("known-too")]
    rows, _ = split_containers(polled(values, heads), MAX_BYTES)
    v = validator()
    decoded = v.decode(rows)
    assert v.unmatched_headers(rows, decoded, {STUDY.hash: None, other.hash: other}) == {"lost-a"}
    assert v.unmatched_headers(rows, decoded, {STUDY.hash: STUDY, other.hash: other}) == set()
    assert v.unmatched_headers(rows, decoded, {STUDY.hash: None, other.hash: None}) == \
        {"lost-a", "known", "known-too"}


def test_a_poll_of_only_wrong_dimension_records_passes_nothing():
    wrong_d = encode_batch(STUDY.hash, np.zeros((2, 16), np.uint8), np.array([NOW_MS] * 2),
                           np.full((2, 2), 0.1), np.full((2, 2), 0.2))
    refused, valid = check(validator(), polled(wrong_d), {STUDY.hash: STUDY})
    assert valid == []
    assert [r[2] for r in refusals(refused)] == ["wrong_dimension"] * 2


def test_a_poll_of_only_empty_values_holds_no_container():
    poll = polled([b"", b""])
    rows, refused = split_containers(poll, MAX_BYTES)
    assert rows is poll and len(refused) == 0
