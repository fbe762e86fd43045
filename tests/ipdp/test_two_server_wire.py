"""Wire version 3 (ipdp.two_server_wire, docs/wire-format.md "Two-server records: the message"):
the layout, a batch's round trip, the refusals, and what a record shows the leader: a uniform
share and a sealed part that opens only with the helper's key under the record's header."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from scipy.stats import chisquare

from ipdp.fixed_point import combine, decode, fold
from ipdp.sealing import HelperKey, SealError, open_share
from ipdp.study import Study
from ipdp.two_server_wire import (
    TwoServerLayout,
    decode_two_server_batch,
    two_server_record_size,
)
from ipdp.wire import RejectReason, decode_batch
from producer.contributor import perturb_records

HELPER = HelperKey(X25519PrivateKey.from_private_bytes(bytes(range(1, 33))))


def two_server_study(d: int = 14, n: int = 2000, key: HelperKey = HELPER) -> Study:
    return Study(study_id="two-wire", d=d, n=n, epsilon=1.0, delta=0.01,
                 two_server={"helper_id": "helper-a", "helper_url": "https://helper.example.org",
                             "helper_key": key.public_b64})


def rows(k: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(k, d))
    x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    return x, np.clip(x @ np.linspace(-0.5, 0.5, d), -1, 1)


def helper_shares(batch, key: HelperKey = HELPER) -> np.ndarray:
    return np.stack([np.frombuffer(open_share(key.private, s, h.tobytes()), "<u8")
                     for s, h in zip(batch.sealed, batch.header, strict=True)])


def test_a_record_at_d14_is_2004_bytes_in_the_documented_order():
    layout = TwoServerLayout(14)
    assert (layout.entries, layout.leader, layout.sealed, layout.proof_length) == (
        119, slice(48, 1000), slice(1000, 2000), slice(2000, 2004))
    assert two_server_record_size(14) == 2004


def test_a_batch_decodes_to_its_header_columns_and_its_shares_sum_to_the_records():
    study = two_server_study()
    x, y = rows(50, 14, seed=1)
    rng = np.random.default_rng(2)
    ids, values = perturb_records(study, x, y, rng, grid_generator=rng, random_bytes=rng.bytes)
    assert {len(v) for v in values} == {2004}
    batch, rejects = decode_two_server_batch(values, 14)
    assert rejects == [] and len(batch) == 50
    assert np.array_equal(batch.record_id, ids)
    assert (batch.study_hash == np.frombuffer(study.hash, np.uint8)).all()
    assert all(v[:1] == b"\x03" and v[-4:] == bytes(4) for v in values)
    total = combine(fold(batch.leader), fold(helper_shares(batch)))
    a, b = decode(total, study.encoding)
    # The same devices again (same seeds): what the shares reconstruct is what they encoded.
    rng = np.random.default_rng(2)
    from ipdp.losses import clip, encode
    from ipdp.two_server import perturb_two_server
    q, p = clip(*encode("squared", x, y), study.lam, study.p_bound)
    q_tilde, p_hat = perturb_two_server(q, p, study.two_server_calibration, rng, rng)
    h = study.encoding.step
    assert np.abs(a - q_tilde.T @ q_tilde).max() <= 50 * (h + 1e-12)
    assert np.abs(b - p_hat.sum(axis=0)).max() <= 50 * h


def test_each_malformed_record_is_refused_with_its_reason():
    study = two_server_study(d=3)
    x, y = rows(6, 3, seed=3)
    _, values = perturb_records(study, x, y, np.random.default_rng(4))
    good = values[0]
    layout = TwoServerLayout(3)

    def altered(offset: int, byte: int) -> bytes:
        out = bytearray(good)
        out[offset] = byte
        return bytes(out)

    bad = [altered(0, 1), altered(2, 9), altered(4, 4), altered(layout.proof_length.start, 1),
           good[:-1], None]
    batch, rejects = decode_two_server_batch([good, *bad], 3)
    assert batch.index.tolist() == [0]
    assert [(i, e.reason) for i, e in rejects] == [
        (1, RejectReason.UNSUPPORTED_VERSION), (2, RejectReason.UNDECODABLE),
        (3, RejectReason.UNDECODABLE), (4, RejectReason.UNDECODABLE),
        (5, RejectReason.UNDECODABLE), (6, RejectReason.UNDECODABLE)]
    assert "proof" in rejects[3][1].detail


def test_the_sealed_share_opens_only_with_the_helper_key_and_only_under_its_header():
    study = two_server_study(d=4)
    x, y = rows(3, 4, seed=5)
    _, values = perturb_records(study, x, y, np.random.default_rng(6))
    batch, _ = decode_two_server_batch(values, 4)
    stranger = HelperKey(X25519PrivateKey.generate())
    for sealed, header in zip(batch.sealed, batch.header, strict=True):
        with pytest.raises(SealError):
            open_share(stranger.private, sealed, header.tobytes())
        moved = bytearray(header.tobytes())
        moved[40] ^= 1  # another creation time
        with pytest.raises(SealError):
            open_share(HELPER.private, sealed, bytes(moved))
    opened = helper_shares(batch)
    # The helper share is nowhere in the message in clear.
    for value, share in zip(values, opened, strict=True):
        assert share.tobytes() not in value


def test_the_leader_share_bytes_are_uniform_while_the_records_values_are_not():
    """χ² on the byte histogram of 2,000 records' leader shares (1.9 million bytes at d = 14)
    against uniform; the same test on the records' fixed-point values must fail, so the test
    can tell."""
    study = two_server_study()
    x, y = rows(2000, 14, seed=7)
    _, values = perturb_records(study, x, y, np.random.default_rng(8))
    batch, _ = decode_two_server_batch(values, 14)
    leader_bytes = batch.leader.view(np.uint8).ravel()
    assert chisquare(np.bincount(leader_bytes, minlength=256)).pvalue > 1e-4
    plain = combine(batch.leader, helper_shares(batch)).view(np.uint8).ravel()
    assert chisquare(np.bincount(plain, minlength=256)).pvalue < 1e-12


def test_version_3_is_refused_by_the_version_1_decoder_as_unsupported_version():
    """The leader's fold of version-3 records is not built: the gateway and the aggregator
    (both decode with ipdp.wire.decode_batch) refuse them."""
    for d in (1, 2, 14, 30):
        study = two_server_study(d=d, n=1000)
        x, y = rows(2, d, seed=d)
        _, values = perturb_records(study, x, y, np.random.default_rng(d))
        batches, rejects = decode_batch(values)
        assert batches == []
        assert [e.reason for _, e in rejects] == [RejectReason.UNSUPPORTED_VERSION] * 2
