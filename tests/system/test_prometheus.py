"""A real Prometheus, with compose/'s scrape configuration, scraping the real processes.

The configuration is compose/prometheus/prometheus.yml with only the targets (Docker DNS names
→ this test's loopback ports) and the intervals (→ 1 s) rewritten; job names stay. The
ingestion rate and the folded total are then read back through Prometheus's HTTP API, and every
query of compose's Grafana dashboard must return a series (Grafana itself is not available
here: its panels' queries run against the real Prometheus instead).
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
from producer.gateway_client import GatewayClient
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


#: Grafana's variables in the dashboard's queries, and what a Prometheus query puts there.
GRAFANA_VARIABLES = {"$__range": "1h", "$__rate_interval": "1m", "$study": ".*"}
#: The panels' study: three features (one of whose ranges the CSV's values overstep) → y.
PANELS_SCHEMA = {"features": [{"name": "a", "min": 0, "max": 5}, {"name": "b", "min": 0, "max": 2},
                              {"name": "c", "min": -1, "max": 3}],
                 "target": {"name": "y", "min": 0, "max": 3}, "intercept": True}
DASHBOARD = PROMETHEUS_YML.parents[1] / "grafana" / "dashboards" / "ipdp.json"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) of every target of every panel, Grafana's variables filled in."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            out.append((panel["title"], expr))
    return out


#: What a family's samples may add to its name (counters, histograms, their creation time).
SAMPLE_SUFFIXES = ("", "_total", "_created", "_bucket", "_sum", "_count")


def exported_sample_names(role: str) -> set[str]:
    """Every sample name the role's registry may serve (its families' names with each suffix)."""
    from ipdp.metrics import role_registry

    return {family.name + suffix for family in role_registry(role).collect()
            for suffix in SAMPLE_SUFFIXES}


def test_every_dashboard_query_returns_a_series_and_each_role_serves_only_its_own_metrics(
        runtime, kafka_settings, redis_settings, topics, tmp_path):
    prometheus_binary = require_tool("prometheus", "tests/system/test_prometheus.py (a real "
                                     "Prometheus server)")
    # A schema study fed from a CSV, some of whose values lie outside their ranges: the load
    # generator counts what its devices clip.
    study = create(kafka_settings, redis_settings, topics, study_id="prom-panels", n=200,
                   epsilon=1.0, delta=0.01, schema=PANELS_SCHEMA)
    data = tmp_path / "panels.csv"
    data.write_text("a,b,c,y\n" + "".join(f"{i % 7},{i % 3},{i % 5 - 1},{i % 4}\n"
                                          for i in range(50)))
    gateway_port = free_port()
    env = ps.service_env(runtime, topics, IPDP_GATEWAY_PORT=str(gateway_port))
    url = f"http://127.0.0.1:{gateway_port}"
    with ps.pipeline(runtime, topics, tmp_path, group=f"agg-{topics.records}") as children:
        # The gateway with its default limits; the load generator sends faster than its rate
        # limit, so some requests are refused and sent again, until it is stopped.
        children["gateway"] = ps.start(["gateway"], env, tmp_path, "gateway")
        try:
            with GatewayClient(url, timeout_s=5) as client:
                client.wait_ready(60, alive=lambda: children["gateway"].proc.poll() is None)
            children["loadgen"] = ps.start(
                ["loadgen", "--via", url, "--study", study.study_id, "--devices", "100000",
                 "--rate", "40", "--no-progress", "--dataset", f"csv:{data}", "--reuse-rows"],
                env, tmp_path, "loadgen")
            prom_port = free_port()
            ports = {"aggregator": children["aggregator"].port,
                     "trainer": children["trainer"].port, "gateway": gateway_port,
                     "loadgen": children["loadgen"].port, "prometheus": prom_port}
            prom = Prometheus(prometheus_binary, scrape_config_for(ports), tmp_path / "prom",
                              prom_port)
            try:
                wait_for(prom.ready, 60, "Prometheus to be ready")

                def alive_and(expr: str):
                    def check() -> bool:
                        for child in children.values():
                            child.check_alive()
                        return bool(prom.query(expr))
                    return check

                for job in ports:
                    wait_for(alive_and(f'up{{job="{job}"}} == 1'), 60,
                             f"Prometheus to scrape the {job}")
                wait_for(alive_and("ipdp_models_published_total > 0"),
                         GROUP_JOIN_TIMEOUT_S + 90, "a model published through the gateway")
                wait_for(alive_and('ipdp_gateway_refusals_total{reason="rate_limited"} > 0'), 60,
                         "the gateway to refuse the load generator's excess")
                for title, expr in dashboard_queries():
                    # A rate needs two scrapes of a series: wait for them, then it must hold.
                    wait_for(alive_and(expr), 30, f"panel {title!r}: a series for {expr}")
                # Column a's 6s lie above its range's 5; column b's values all lie inside.
                clipped = 'ipdp_loadgen_values_clipped_total{study="prom-panels", column="%s"}'
                assert prom.scalar(clipped % "a") > 0 and prom.scalar(clipped % "b") == 0
                for job in ("aggregator", "trainer", "gateway", "loadgen"):
                    served = {r["metric"]["__name__"] for r in prom.query(
                        f'group by (__name__) ({{job="{job}", __name__=~"ipdp_.+"}})')}
                    assert served, job
                    foreign = served - exported_sample_names(job)
                    assert not foreign, f"the {job} serves other roles' metrics: {foreign}"
            finally:
                prom.stop()
        finally:
            for name in ("loadgen", "gateway"):
                if name in children:
                    ps.stop(children.pop(name))
