"""A study redefined on the studies topic cannot change what is folded (docs/security.md).

The attack: study s1 is registered (ε = 1); someone who can write the studies topic republishes
s1 with ε × 1000. Devices that believe the topic perturb with a thousandth of the noise; the
records' study hash then names the forged parameters, matches no registered study, and every
record is dead-lettered as ``study_mismatch``. Devices that pin the owner's key refuse the forged
study outright.
"""

from __future__ import annotations

import threading

import pytest

from aggregator.service import Aggregator
from aggregator.settings import AggregatorSettings
from ipdp import state
from ipdp.cli.main import main
from ipdp.errors import SignatureError
from ipdp.kafka_io import kafka_producer
from ipdp.metrics import EVERY_METRIC
from ipdp.redis_io import redis_client
from ipdp.settings import TrustSettings
from ipdp.signing import generate_key_files, parse_trusted_keys
from ipdp.state import create_study
from ipdp.study import Study, study_message
from producer.contributor import Contributor
from producer.studies import find_study
from tests.pipeline import services, total_stats, wait_for

PARAMS = {"d": 4, "n": 2_000, "epsilon": 1.0, "delta": 0.01}
DEVICES = 2_000


def _sample(name: str, labels: dict) -> float:
    return EVERY_METRIC.get_sample_value(name, labels) or 0.0


def _publish(kafka_settings, topics, study_id: str, value: bytes) -> None:
    producer = kafka_producer(kafka_settings)
    try:
        producer.send(topics.studies, key=study_id.encode(), value=value).get(timeout=30)
    finally:
        producer.close()


def _create(kafka_settings, redis_settings, topics, study: Study, key=None) -> None:
    producer = kafka_producer(kafka_settings)
    try:
        create_study(redis_client(redis_settings), producer, topics, study, key)
    finally:
        producer.close()


@pytest.mark.slow
def test_records_perturbed_under_a_forged_study_are_dead_lettered_never_folded(
        kafka_settings, redis_settings, env_topics, tmp_path, capsys):
    topics = env_topics
    study = Study(study_id="s1", **PARAMS)
    _create(kafka_settings, redis_settings, topics, study)
    forged = Study(study_id="s1", **{**PARAMS, "epsilon": PARAMS["epsilon"] * 500})
    _publish(kafka_settings, topics, "s1", study_message(forged, "open"))
    stranger = generate_key_files(tmp_path / "stranger")
    assert find_study("s1", kafka_settings, topics)[0] == forged  # what an unpinned device sees

    before = _sample("ipdp_records_dead_lettered_total", {"reason": "study_mismatch"})
    assert main(["loadgen", "--study", "s1", "--devices", str(DEVICES), "--no-progress"]) == 0
    # The same forgery signed by another key: a device that pins it gets the same treatment.
    _publish(kafka_settings, topics, "s1", study_message(forged, "open", stranger))
    assert main(["loadgen", "--study", "s1", "--devices", "10", "--no-progress",
                 "--trust", f"{tmp_path / 'stranger'}.pub"]) == 0
    r = redis_client(redis_settings)
    with services(kafka_settings, redis_settings, topics, trainer=False,
                  agg_settings=AggregatorSettings(group=f"agg-{topics.records}")):
        wait_for(lambda: state.rejected_counts(r, f"agg-{topics.records}", topics.records).get("study_mismatch", 0) == DEVICES + 10, 90,
                 "every forged record dead-lettered")
    assert total_stats(redis_settings, study)[2] == 0
    assert not r.exists(state.StudyKeys("s1").open)
    assert _sample("ipdp_records_dead_lettered_total",
                   {"reason": "study_mismatch"}) - before == DEVICES + 10
    capsys.readouterr()


def test_a_device_that_pins_the_owner_key_refuses_a_forged_study(
        kafka_settings, redis_settings, env_topics, tmp_path, capsys):
    topics = env_topics
    owner = generate_key_files(tmp_path / "owner")
    stranger = generate_key_files(tmp_path / "stranger")
    study = Study(study_id="s2", **PARAMS)
    _create(kafka_settings, redis_settings, topics, study, owner)
    pinned = parse_trusted_keys(f"{tmp_path / 'owner'}.pub")
    assert find_study("s2", kafka_settings, topics, trusted=pinned)[0] == study

    forged = Study(study_id="s2", **{**PARAMS, "epsilon": 500.0})
    for value in (study_message(forged, "open"), study_message(forged, "open", stranger)):
        _publish(kafka_settings, topics, "s2", value)
        before = _sample("ipdp_studies_refused_total", {"reader": "device"})
        with pytest.raises(SignatureError, match="signature"):
            Contributor.connect("s2", kafka_settings, topics, trusted_keys=[owner.public_b64])
        assert _sample("ipdp_studies_refused_total", {"reader": "device"}) == before + 1
        capsys.readouterr()
        assert main(["loadgen", "--study", "s2", "--devices", "5", "--no-progress",
                     "--trust", f"{tmp_path / 'owner'}.pub"]) == 2
        assert "signature" in capsys.readouterr().err


def test_an_aggregator_that_pins_keys_refuses_an_unsigned_study_and_counts_it(
        kafka_settings, redis_settings, env_topics, tmp_path):
    topics = env_topics
    owner = generate_key_files(tmp_path / "owner")
    unsigned = Study(study_id="u1", **PARAMS)
    signed = Study(study_id="s3", **PARAMS)
    _create(kafka_settings, redis_settings, topics, unsigned)
    _create(kafka_settings, redis_settings, topics, signed, owner)
    producer = kafka_producer(kafka_settings)
    try:
        for study in (unsigned, signed):
            c = Contributor(study, producer, topics.records, records_per_device=20)  # 20 devices
            c.submit_many([[0.1, 0.2, 0.0, 0.0]] * 20, [0.5] * 20)
            c.flush()
    finally:
        producer.close()
    before = _sample("ipdp_studies_refused_total", {"reader": "aggregator"})
    r = redis_client(redis_settings)
    agg = Aggregator(kafka_settings, redis_settings, topics,
                     AggregatorSettings(group=f"agg-{topics.records}"),
                     TrustSettings(trusted_study_keys=owner.public_b64))
    worker = threading.Thread(target=agg.run, daemon=True)
    worker.start()
    try:
        wait_for(lambda: state.rejected_counts(r, f"agg-{topics.records}", topics.records).get("untrusted_study", 0) == 20, 60,
                 "the unsigned study's records refused")
        wait_for(lambda: total_stats(redis_settings, signed)[2] == 20, 30,
                 "the signed study's records folded")
    finally:
        agg.stop_event.set()
        worker.join(timeout=30)
    assert total_stats(redis_settings, unsigned)[2] == 0
    assert _sample("ipdp_studies_refused_total", {"reader": "aggregator"}) >= before + 1
