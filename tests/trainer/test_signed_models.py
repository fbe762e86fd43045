"""Signed models: a subscriber that pins the trainer's key never shows anyone else's model."""

from __future__ import annotations

import json

from ipdp.cli.main import main
from ipdp.kafka_io import kafka_producer
from ipdp.metrics import EVERY_METRIC
from ipdp.model_message import ModelMessage, PrivacyReport, model_value, parse_model_value
from ipdp.settings import TrustSettings
from ipdp.signing import TrustedKeys, generate_key_files
from ipdp.study import Study
from ipdp.subscriber import ModelSubscriber
from trainer.service import Trainer
from trainer.settings import TrainerSettings

STUDY = Study(study_id="signed-models", d=4, n=10_000, epsilon=1.0, delta=0.01)


def _model(round_no: int, w=(0.3, 0.4, 0.0, 0.0)) -> ModelMessage:
    return ModelMessage(
        study_id=STUDY.study_id, round=round_no, n=STUDY.n, d=STUDY.d, loss=STUDY.loss,
        weights=list(w), constraint_active=False,
        privacy=PrivacyReport.from_calibration(STUDY.calibration),
        round_closed_ms=1, published_ms=2)


def test_a_signed_model_says_its_guarantee_is_privacy_not_robustness_and_verifies(tmp_path):
    key = generate_key_files(tmp_path / "trainer")
    got = parse_model_value(model_value(_model(1), key), TrustedKeys([key.private.public_key()]))
    assert got.privacy.guarantee.startswith("privacy, not robustness")
    assert "Bounded influence" in got.privacy.guarantee


def test_forged_models_on_the_models_topic_are_dropped_and_counted(
        kafka_settings, redis_settings, env_topics, tmp_path, capsys):
    topics = env_topics
    generate_key_files(tmp_path / "trainer")
    stranger = generate_key_files(tmp_path / "stranger")
    trainer = Trainer(kafka_settings, redis_settings, topics,
                      TrainerSettings(signing_key=f"{tmp_path / 'trainer'}.key"), TrustSettings())
    try:
        trainer.publish(_model(1))
    finally:
        trainer.producer.close()
    genuine = _model(1)
    tampered = json.loads(model_value(genuine, trainer.signing_key))
    tampered["model"] = tampered["model"].replace('"weights":[0.3,', '"weights":[9.3,')
    producer = kafka_producer(kafka_settings)
    try:
        for round_no, value in (
                (2, model_value(_model(2, (1.0, 0, 0, 0)))),                 # unsigned
                (3, model_value(_model(3, (1.0, 0, 0, 0)), stranger)),       # another key
                (1, json.dumps(tampered).encode())):                         # altered weights
            producer.send(topics.models, key=f"{STUDY.study_id}:{round_no}".encode(),
                          value=value).get(timeout=30)
    finally:
        producer.close()

    before = EVERY_METRIC.get_sample_value("ipdp_models_refused_total") or 0
    sub = ModelSubscriber(kafka_settings, topics, trusted_keys=[f"{tmp_path / 'trainer'}.pub"])
    got = list(sub)
    assert got == [genuine]
    assert sub.refused == 3 and sub.invalid == 0
    assert EVERY_METRIC.get_sample_value("ipdp_models_refused_total") == before + 3
    # Without a pinned key every well-formed model is shown (the CLI says so in its log).
    assert [m.round for m in ModelSubscriber(kafka_settings, topics, trusted_keys=[])] == \
        [1, 2, 3]

    capsys.readouterr()
    assert main(["models", "--json", "--trust", f"{tmp_path / 'trainer'}.pub"]) == 0
    out = capsys.readouterr()
    assert [ModelMessage.model_validate_json(line) for line in out.out.splitlines()] == [genuine]
    assert "3 model message(s) refused: signature" in out.err
