"""A trainer that dies as if SIGKILLed at a chosen point of publishing a round.

    python -m tests.trainer.faulty_trainer before|after

``before``: the round is solved, nothing is published. ``after``: the model is on the models
topic, Redis has not been told. Either way the process exits with status 137 and no cleanup, as
a SIGKILL would (tests/system/test_failures.py). Settings come from IPDP_* like the real role.
"""

from __future__ import annotations

import logging
import os
import sys

from ipdp.process import setup_logging
from ipdp.settings import KafkaSettings, RedisSettings, TopicSettings
from trainer.service import Trainer
from trainer.settings import TrainerSettings

log = logging.getLogger("faulty_trainer")


class FaultyTrainer(Trainer):
    """Crashes before or after the real publish."""

    def __init__(self, where: str, *args) -> None:
        super().__init__(*args)
        self.where = where

    def publish(self, message) -> None:
        if self.where == "before":
            _crash(f"study {message.study_id} round {message.round} solved, not published")
        super().publish(message)
        _crash(f"study {message.study_id} round {message.round} published, not acknowledged")


def _crash(where: str) -> None:
    log.error("fault injection: exiting with 137 (%s)", where)
    os._exit(137)


if __name__ == "__main__":
    setup_logging()
    where = sys.argv[1]
    if where not in ("before", "after"):
        sys.exit("usage: python -m tests.trainer.faulty_trainer before|after")
    trainer = FaultyTrainer(where, KafkaSettings(), RedisSettings(), TopicSettings(),
                            TrainerSettings())
    trainer.run(idle_exit_s=2)
