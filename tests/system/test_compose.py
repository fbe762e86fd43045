"""compose/ is consistent with the code: settings names, metrics ports, topics, dashboard.

No Docker engine runs here, so the deployment is checked rather than started: the IPDP_*
variables against ipdp/settings.py, the Prometheus targets against the services' metrics ports,
the dashboard's expressions against ipdp/metrics.py, the commands against the `ipdp` parser,
the compose file with `docker-compose config` (Compose specification) and the Prometheus
configuration with `promtool check config`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from ipdp.settings import TopicSettings
from scripts.ops_tables import series_names, settings_env_names, settings_models
from tests.tooling import require_tool

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
PROMETHEUS_YML = COMPOSE_DIR / "prometheus" / "prometheus.yml"
DASHBOARDS = COMPOSE_DIR / "grafana" / "dashboards"
PROVISIONING = COMPOSE_DIR / "grafana" / "provisioning"
IPDP_IMAGE = "ipdp:local"
TEST_ENV = {"REDIS_PASSWORD": "compose-test-redis", "GRAFANA_ADMIN_PASSWORD": "compose-test-gf"}
_INTERP = re.compile(r"\$\{(\w+)(?::?[-?][^}]*)?\}")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def prometheus() -> dict:
    return yaml.safe_load(PROMETHEUS_YML.read_text())


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: str(v) for k, v in env.items()}


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} / ${VAR:?err} with TEST_ENV, defaults otherwise."""
    def sub(m: re.Match) -> str:
        if m[1] in TEST_ENV:
            return TEST_ENV[m[1]]
        text = m[0]
        return text[text.index(":-") + 2:-1] if ":-" in text else ""
    return _INTERP.sub(sub, value)


def _ipdp_services(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if s.get("image") == IPDP_IMAGE}


def _metrics_ports(compose: dict) -> dict[str, int]:
    ports = {}
    for name, service in _ipdp_services(compose).items():
        # The gateway serves its metrics on its own HTTP port.
        env = _env(service)
        port = int(env.get("IPDP_METRICS_PORT") or env.get("IPDP_GATEWAY_PORT") or "0")
        if port:
            ports[name] = port
    return ports


# --------------------------------------------------------------------------- settings


def test_every_ipdp_variable_in_compose_is_a_setting_the_code_reads():
    known = settings_env_names()
    used = set()
    for path in COMPOSE_DIR.rglob("*"):  # the compose file, Dockerfile, configs, .env.example
        if path.is_file():
            used |= set(re.findall(r"\bIPDP_[A-Z0-9_]+\b(?!\*)",  # IPDP_X_* is a family
                                   path.read_text(errors="replace")))
    assert used, "compose/ sets no IPDP_* variable at all"
    assert used <= known, f"not read by any model in ipdp/settings.py: {sorted(used - known)}"


def test_each_services_environment_is_valid_for_the_settings_models(compose, monkeypatch):
    """Values too: every settings model accepts each ipdp service's environment."""
    for name, service in _ipdp_services(compose).items():
        for key in [k for k in os.environ if k.startswith("IPDP_")]:
            monkeypatch.delenv(key)
        for key, value in _env(service).items():
            monkeypatch.setenv(key, _interpolate(value))
        for model in settings_models():
            model()  # raises a ValidationError naming the bad variable
        assert _env(service)["IPDP_KAFKA_BOOTSTRAP"] == "kafka:9092", name


def test_the_ipdp_services_are_built_from_one_dockerfile_and_run_real_commands(compose):
    from ipdp.cli.main import build_parser

    services = _ipdp_services(compose)
    assert {"aggregator", "trainer", "models", "loadgen"} <= set(services)
    parser = build_parser()
    for name, service in services.items():
        assert service["build"] == {"context": "..", "dockerfile": "compose/Dockerfile"}, name
        argv = [_interpolate(str(a)) for a in service["command"]]
        args = parser.parse_args(argv)  # SystemExit on an unknown command or flag
        assert callable(args.func), name
    assert services["aggregator"]["command"] == ["aggregator", "run"]
    assert services["trainer"]["command"] == ["trainer", "run"]
    assert services["models"]["command"] == ["models", "--follow"]
    assert services["gateway"]["command"] == ["gateway"]
    assert services["loadgen"]["profiles"] == ["load"]
    # The demo study is valid, and the load generator contributes to it.
    from ipdp.cli.common import study_from_args

    init_args = parser.parse_args([_interpolate(str(a)) for a in services["study-init"]["command"]])
    load_args = parser.parse_args([_interpolate(str(a)) for a in services["loadgen"]["command"]])
    assert study_from_args(init_args).study_id == load_args.study
    assert "profiles" not in services["aggregator"]


def test_dockerfile_is_python_slim_and_copies_only_what_exists():
    text = (COMPOSE_DIR / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\s*$", text, re.MULTILINE)
    assert re.search(r"^RUN pip install \.", text, re.MULTILINE)
    assert re.search(r'^ENTRYPOINT \["ipdp"\]', text, re.MULTILINE)
    for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE):
        for src in shlex.split(line)[:-1]:
            assert (REPO / src).exists(), f"Dockerfile copies {src}, which is not in the repo"


# --------------------------------------------------------------------------- backends


def test_topics_are_created_once_with_the_settings_defaults(compose):
    init = compose["services"]["kafka-init"]
    assert init["image"].startswith("apache/kafka:")
    env = _env(init)
    defaults = TopicSettings.model_construct()
    for field, info in TopicSettings.model_fields.items():
        assert env[f"IPDP_TOPIC_{field.upper()}"] == str(info.default), field
        assert getattr(defaults, field) == info.default
    script = "\n".join(init["command"])
    for field in ("records", "models", "dead_letter", "studies"):
        var = f"IPDP_TOPIC_{field.upper()}"
        lines = [ln for ln in script.splitlines() if f'--topic "$${var}"' in ln]
        assert len(lines) == 1 and "--create --if-not-exists" in lines[0], field
        assert ("cleanup.policy=compact" in lines[0]) == (field == "studies"), field
        if field == "records":
            assert '--partitions "$$IPDP_TOPIC_RECORDS_PARTITIONS"' in lines[0]
    for name, service in _ipdp_services(compose).items():
        topic_env = {k: v for k, v in _env(service).items() if k.startswith("IPDP_TOPIC_")}
        assert topic_env == env, f"{name} reads other topic names than kafka-init creates"
    assert _env(compose["services"]["kafka"])["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    for name in _ipdp_services(compose):
        assert compose["services"][name]["depends_on"]["kafka-init"]["condition"] == \
            "service_completed_successfully", name


def test_kafka_is_a_single_kraft_node_and_redis_persists_every_write_behind_a_password(compose):
    kafka = _env(compose["services"]["kafka"])
    assert compose["services"]["kafka"]["image"].startswith("apache/kafka:")
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert kafka["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093"
    assert "PLAINTEXT://kafka:9092" in kafka["KAFKA_ADVERTISED_LISTENERS"]
    # Producers send requests up to max_request_size; the broker must accept them.
    from ipdp.kafka_io import PRODUCER_DEFAULTS

    assert int(kafka["KAFKA_MESSAGE_MAX_BYTES"]) >= PRODUCER_DEFAULTS["max_request_size"]

    redis = compose["services"]["redis"]
    argv = shlex.split(redis["command"][-1])
    for flag, value in (("--appendonly", "yes"), ("--appendfsync", "always"),
                        ("--requirepass", "$$REDIS_PASSWORD")):
        assert argv[argv.index(flag) + 1] == value, flag
    password_ref = _env(redis)["REDIS_PASSWORD"]
    assert password_ref.startswith("${REDIS_PASSWORD:?")
    for name, service in _ipdp_services(compose).items():
        env = _env(service)
        assert env["IPDP_REDIS_PASSWORD"] == password_ref, name
        assert env["IPDP_REDIS_URL"] == "redis://redis:6379/0", name


# --------------------------------------------------------------------------- metrics


def test_every_metrics_port_is_a_prometheus_target_and_every_ipdp_job_a_service(
        compose, prometheus):
    ports = _metrics_ports(compose)
    assert set(ports) == {"aggregator", "trainer", "loadgen", "gateway"}
    assert len(set(ports.values())) == len(ports)
    for name in ports:
        env = _env(compose["services"][name])
        assert "0.0.0.0" in (env["IPDP_METRICS_HOST"], env.get("IPDP_GATEWAY_HOST")), name
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert set(jobs) - {"prometheus"} == set(ports)
    for name, port in ports.items():
        job = jobs[name]
        targets = set()
        for sd in job.get("dns_sd_configs", []):
            targets |= {(host, sd["port"]) for host in sd["names"]}
        for sc in job.get("static_configs", []):
            targets |= {(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in sc["targets"]}
        assert targets == {(name, port)}, f"job {name} scrapes {targets}, the service serves " \
                                          f"{name}:{port}"


def _dashboards() -> list[tuple[Path, dict]]:
    files = sorted(DASHBOARDS.glob("*.json"))
    assert files, "no Grafana dashboard in compose/grafana/dashboards"
    return [(f, json.loads(f.read_text())) for f in files]


def _exprs(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "expr" and isinstance(v, str)] + \
            [e for k, v in node.items() if k != "expr" for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def test_the_dashboard_uses_only_exported_metrics_and_shows_what_an_operator_needs():
    exported = series_names()  # series name → metric name (histogram suffixes included)
    shown = set()
    for path, dash in _dashboards():
        exprs = _exprs(dash)
        assert exprs, path
        for expr in exprs:
            for name in re.findall(r"\bipdp_\w+", expr):
                assert name in exported, f"{path.name}: {name} is not exported by ipdp/metrics.py"
                shown.add(exported[name])
    all_exprs = "\n".join(e for _, d in _dashboards() for e in _exprs(d))
    for metric in ("ipdp_records_folded_total", "ipdp_records_dead_lettered_total",
                   "ipdp_round_progress_ratio", "ipdp_fold_seconds", "ipdp_consumer_lag_records",
                   "ipdp_models_published_total"):
        assert metric in shown, f"the dashboard does not show {metric}"
    assert "by (reason)" in all_exprs
    for q in ("0.5", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(ipdp_fold_seconds_bucket" in all_exprs


def test_grafana_is_provisioned_with_the_prometheus_datasource_and_the_dashboard(compose):
    sources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    for path, dash in _dashboards():
        # A row panel only groups the panels below it: no query, no datasource.
        uids = {ds.get("uid") for panel in dash["panels"] if panel["type"] != "row" for ds in
                [panel.get("datasource", {})] + [t.get("datasource", {}) for t in panel["targets"]]}
        assert uids == {source["uid"]}, path.name
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "ipdp.yml").read_text())
    (provider,) = providers["providers"]
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    prom_mounts = dict(v.split(":")[:2] for v in compose["services"]["prometheus"]["volumes"])
    assert prom_mounts["./prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"


# --------------------------------------------------------------------------- real tools


def test_docker_compose_config_accepts_the_file_and_requires_the_passwords(tmp_path):
    binary = require_tool("docker-compose", "validating compose/docker-compose.yml")
    empty_env = tmp_path / "empty.env"
    empty_env.write_text("")
    base = [binary, "--env-file", str(empty_env), "--project-directory", str(COMPOSE_DIR),
            "-f", str(COMPOSE_FILE)]
    clean = {k: v for k, v in os.environ.items() if k not in TEST_ENV}
    ok = subprocess.run([*base, "config", "-q"], env={**clean, **TEST_ENV}, check=False,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    services = subprocess.run([*base, "config", "--services"], env={**clean, **TEST_ENV}, check=False,
                              capture_output=True, text=True, timeout=120)
    assert services.returncode == 0, services.stderr
    assert set(services.stdout.split()) == set(yaml.safe_load(COMPOSE_FILE.read_text())
                                               ["services"])
    missing = subprocess.run([*base, "config", "-q"], env=clean, check=False, capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode != 0
    assert "REDIS_PASSWORD" in missing.stderr


def test_promtool_accepts_the_prometheus_configuration():
    binary = require_tool("promtool", "validating compose/prometheus/prometheus.yml")
    result = subprocess.run([binary, "check", "config", str(PROMETHEUS_YML)],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
