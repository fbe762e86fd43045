"""A real Prometheus, with compose/'s scrape configuration, scraping the real processes.

The configuration is compose/prometheus/prometheus.yml with only the targets (Docker DNS names
→ this test's loopback ports) and the intervals (→ 1 s) rewritten; job names stay. The
ingestion rate and the folded total are then read back through Prometheus's HTTP API.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from ipdp.embedded import free_port
from tests import proc_services as ps
from tests.pipeline import GROUP_JOIN_TIMEOUT_S, contribute, create, wait_for
from tests.tooling import require_tool

PROMETHEUS_YML = Path(__file__).resolve().parents[2] / "compose" / "prometheus" / \
    "prometheus.yml"
SD_KEYS = ("dns_sd_configs", "static_configs", "file_sd_configs")


def scrape_config_for(ports: dict[str, int]) -> dict:
    """compose's Prometheus config, each job pointed at 127.0.0.1:ports[job], every 1 s."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert set(ports) == jobs, f"compose's Prometheus jobs are {sorted(jobs)}"
    for job in config["scrape_configs"]:
        for key in SD_KEYS:
            job.pop(key, None)
        job["static_configs"] = [{"targets": [f"127.0.0.1:{ports[job['job_name']]}"]}]
        if "scrape_interval" in job:
            job["scrape_interval"] = "1s"
        job.pop("scrape_timeout", None)
    return config


class Prometheus:
    def __init__(self, binary: str, config: dict, directory: Path, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        directory.mkdir(parents=True, exist_ok=True)
        cfg = directory / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = directory / "prometheus.log"
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={cfg}", f"--storage.tsdb.path={directory / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True)

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({self.proc.returncode}):\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def query(self, expr: str) -> list[dict]:
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        """The value of a one-element instant vector; None while it is empty."""
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def test_prometheus_with_the_compose_scrape_config_sees_the_ingestion_rate_and_total(
        runtime, kafka_settings, redis_settings, topics, tmp_path):
    prometheus_binary = require_tool("prometheus", "tests/system/test_prometheus.py (a real "
                                     "Prometheus server)")
    study = create(kafka_settings, redis_settings, topics, study_id="prom", d=4, n=400,
                   epsilon=1.0, delta=0.01)
    with ps.pipeline(runtime, topics, tmp_path, group=f"agg-{topics.records}") as children:
        prom_port = free_port()
        ports = {"aggregator": children["aggregator"].port, "trainer": children["trainer"].port,
                 "loadgen": free_port(), "gateway": free_port(),  # no load generator, no gateway
                 "prometheus": prom_port}
        prom = Prometheus(prometheus_binary, scrape_config_for(ports), tmp_path / "prom",
                          prom_port)
        try:
            wait_for(prom.ready, 60, "Prometheus to be ready")
            for job in ("aggregator", "trainer", "prometheus"):
                wait_for(lambda job=job: prom.scalar(f'up{{job="{job}"}}') == 1, 30,
                         f"Prometheus to scrape the {job}")

            def folded_in_prometheus() -> float | None:
                for child in children.values():
                    child.check_alive()
                return prom.scalar("sum(ipdp_records_folded_total)")

            # Two phases, each seen by Prometheus: the counter has moved between two scrapes,
            # so its rate is positive whatever the machine's speed.
            contribute(study, kafka_settings, topics, 300, seed=21)
            wait_for(lambda: folded_in_prometheus() == 300, GROUP_JOIN_TIMEOUT_S + 30,
                     "Prometheus to see 300 records folded")
            contribute(study, kafka_settings, topics, 300, seed=22)
            wait_for(lambda: folded_in_prometheus() == 600, 60,
                     "Prometheus to see 600 records folded")

            rate = prom.scalar("sum(rate(ipdp_records_folded_total[5m]))")
            increase = prom.scalar('sum(increase(ipdp_records_folded_total{study="prom"}[5m]))')
            assert rate is not None and rate > 0
            assert increase is not None and increase > 0
            assert prom.scalar("sum(ipdp_records_folded_total)") == 600
            assert prom.scalar('ipdp_records_folded_total{job="aggregator",study="prom"}') == 600
            # The aggregator's own /metrics and Redis's exact counter agree with Prometheus.
            own = children["aggregator"].scrape()
            assert ps.value(own, "ipdp_records_folded_total", study="prom") == 600
            from ipdp.redis_io import redis_client
            from ipdp.state import StudyKeys

            assert redis_client(redis_settings).hget(StudyKeys("prom").counts, "folded") == b"600"
            # 600 records at n = 400: one model, seen through Prometheus too.
            wait_for(lambda: prom.scalar(
                'sum(ipdp_models_published_total{job="trainer",study="prom"})') == 1, 60,
                "Prometheus to see the published model")
            assert prom.scalar('ipdp_round_progress_ratio{study="prom"}') == 0.5
            assert prom.scalar('up{job="loadgen"}') == 0
        finally:
            prom.stop()
