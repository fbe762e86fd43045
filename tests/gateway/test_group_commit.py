"""The group commit on a real broker: concurrent one-record requests share Kafka messages, a bad
record among them gets its own 4xx, and a Kafka outage answers 503 to every waiting request."""

from __future__ import annotations

import threading

import numpy as np

from ipdp.embedded import EmbeddedRuntime
from ipdp.wire import RECORD_ID_BYTES, VALUES_OFFSET, record_size, split_container
from producer.gateway_client import GatewayAnswer, GatewayClient
from tests.gateway.conftest import running_gateway
from tests.gateway.test_gateway import D, created_at, known, records, scaled
from tests.pipeline import create, read_records


def concurrently(url: str, study_id: str, bodies: list[bytes]) -> list[GatewayAnswer]:
    """POST each body on its own connection, all released at once; the answers in order."""
    answers: list[GatewayAnswer | None] = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def post(i: int) -> None:
        with GatewayClient(url) as c:
            c.request("GET", "/healthz")  # connected before the barrier
            start.wait()
            answers[i] = c.post_records(study_id, bodies[i])

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(a is not None for a in answers)
    return answers


def on_topic(kafka, topic: str, expected: int):
    """The containers on ``topic`` and the records they hold."""
    messages = read_records(kafka, topic, expected=expected, timeout_s=10)
    return messages, [r for m in messages for r in split_container(m.value)]


def test_concurrent_single_record_requests_share_containers(kafka_settings, redis_settings,
                                                            topics):
    study = create(kafka_settings, redis_settings, topics, study_id="gc-share", d=D, n=1000,
                   epsilon=1.0, delta=0.01)
    sent = records(study, 40)
    # A linger far above the time 40 threads take to post: they land in few containers.
    with running_gateway(kafka_settings, topics, linger_ms=300) as url:
        known(url, study.study_id)
        answers = concurrently(url, study.study_id, sent)
    assert [(a.status, a.body) for a in answers] == [(202, {"accepted": 1})] * 40
    messages, got = on_topic(kafka_settings, topics.records, expected=40)
    assert sorted(got) == sorted(sent)  # each acknowledged record once, none lost
    assert len(messages) <= 10, f"{len(messages)} Kafka messages for 40 records"
    for m in messages:  # a container's key is its first record's id, its header the study
        assert m.key == split_container(m.value)[0][RECORD_ID_BYTES]
        assert dict(m.headers)["study"] == study.study_id.encode()


def test_a_bad_record_among_good_concurrent_ones_gets_its_own_4xx(kafka_settings,
                                                                  redis_settings, topics):
    study = create(kafka_settings, redis_settings, topics, study_id="gc-bad", d=D, n=1000,
                   epsilon=1.0, delta=0.01)
    good = records(study, 12, seed=3)
    nan = bytearray(records(study, 1, seed=4)[0])
    nan[VALUES_OFFSET:VALUES_OFFSET + 8] = np.float64("nan").tobytes()
    other = records("another-study", 1, seed=5)[0]
    too_long = scaled(records(study, 1, seed=6)[0], 100.0, 1.0)
    old = created_at(records(study, 1, seed=7)[0], 0)
    bodies = [*good[:4], too_long, *good[4:6], bytes(nan), *good[6:10], old, *good[10:], other]
    with running_gateway(kafka_settings, topics, linger_ms=300) as url:
        known(url, study.study_id)
        answers = concurrently(url, study.study_id, bodies)
    assert [(a.status, a.error) for a in answers] == (
        [(202, None)] * 4 + [(400, "norm_out_of_bounds")] + [(202, None)] * 2
        + [(400, "non_finite")] + [(202, None)] * 4 + [(400, "stale")] + [(202, None)] * 2
        + [(400, "study_mismatch")])
    _, got = on_topic(kafka_settings, topics.records, expected=12)
    assert sorted(got) == sorted(good)


def test_kafka_outage_answers_503_to_every_waiting_request_and_loses_nothing_acknowledged(
        tmp_path):
    with EmbeddedRuntime(tmp_path / "rt") as rt:
        kafka, topics = rt.kafka_settings(), rt.topics
        study = create(kafka, rt.redis_settings(), topics, study_id="gc-down", d=D, n=1000,
                       epsilon=1.0, delta=0.01)
        before = records(study, 8, seed=6)
        with running_gateway(kafka, topics, kafka_timeout_s=2.0, linger_ms=50) as url:
            known(url, study.study_id)
            acked = concurrently(url, study.study_id, before)
            assert [a.status for a in acked] == [202] * 8
            # Everything answered 202 is on the topic before the outage.
            _, got = on_topic(kafka, topics.records, expected=len(before))
            assert sorted(got) == sorted(before)
            rt.broker.stop()
            during = concurrently(url, study.study_id, records(study, 10, seed=7))
    assert [(a.status, a.error) for a in during] == [(503, "kafka_unavailable")] * 10
    assert all(sorted(a.body) == ["detail", "error"] for a in during)


def test_with_one_container_in_flight_the_next_waits_for_its_acknowledgement(kafka_settings,
                                                                            topics):
    """``containers_in_flight`` = 1: records that arrive, turn after turn, while a container of
    their study is unacknowledged wait for it and then go together, not in a container per
    loop turn."""
    import asyncio

    from gateway.batcher import GroupCommit
    from gateway.producer_process import ProducerProcess
    from ipdp.study import Study

    study = Study(study_id="gc-flight", d=D, n=1000, epsilon=1.0, delta=0.01)
    first, *rest = records(study, 4, seed=31)

    async def run(in_flight: int) -> None:
        producer = await ProducerProcess.start(kafka_settings, topics.records, {"linger_ms": 0},
                                               timeout_s=60)
        batcher = GroupCommit(topics.records, lambda: producer, linger_s=0.0,
                              max_message_bytes=1 << 20, kafka_timeout_s=10,
                              in_flight=in_flight)
        waits = batcher.enqueue(study.study_id, record_size(D), first)
        await asyncio.sleep(0)  # the first container goes at the next turn
        await asyncio.sleep(0)
        for record in rest:  # one per turn, while it awaits Kafka (a few ms)
            waits += batcher.enqueue(study.study_id, record_size(D), record)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*waits), 30)
        await producer.close(10)

    asyncio.run(run(1))
    messages, got = on_topic(kafka_settings, topics.records, expected=4)
    assert sorted(got) == sorted([first, *rest])
    # Without the limit each of the three would have had a container of its own.
    assert sorted(len(split_container(m.value)) for m in messages) == [1, 3]
