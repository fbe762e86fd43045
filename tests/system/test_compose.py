"""compose/ is consistent with the code: settings names, metrics ports, topics, dashboard, Kafka's
users and ACLs, the TLS proxy.

No Docker engine runs here, so the deployment is checked rather than started: the IPDP_*
variables against ipdp/settings.py, the Prometheus targets against the services' metrics ports,
the dashboard's expressions against ipdp/metrics.py, the commands against the `ipdp` parser,
Kafka's listeners, SCRAM users and ACLs against docs/operations.md's table, the proxy's network,
ports and nginx configuration against the gateway's settings, the compose file with
`docker-compose config` (Compose specification) and the Prometheus configuration with
`promtool check config`. The nginx configuration itself runs in tests/system/test_proxy.py.

A two-server study's helper is a deployment of its own (compose/helper/): its file, its edge's
nginx configuration and the leader's two-server file are checked the same way, and the setup
block of docs/operations.md that makes its secrets and certificate is run. The helper's edge
itself runs in tests/helper/test_tls_edge.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import ssl
import subprocess
from pathlib import Path

import pytest
import yaml

from ipdp.settings import TopicSettings
from scripts.ops_tables import metric_rows, series_names, settings_env_names, settings_models
from tests.tooling import require_tool

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
PROMETHEUS_YML = COMPOSE_DIR / "prometheus" / "prometheus.yml"
DASHBOARDS = COMPOSE_DIR / "grafana" / "dashboards"
PROVISIONING = COMPOSE_DIR / "grafana" / "provisioning"
IPDP_IMAGE = "ipdp:local"
NGINX_CONF = COMPOSE_DIR / "nginx" / "ipdp.conf"
OPERATIONS = REPO / "docs" / "operations.md"
HELPER_DIR = COMPOSE_DIR / "helper"
HELPER_COMPOSE_FILE = HELPER_DIR / "docker-compose.yml"
HELPER_NGINX_CONF = HELPER_DIR / "nginx" / "helper.conf"
TWO_SERVER_FILE = COMPOSE_DIR / "docker-compose.two-server.yml"
#: compose/helper/.env for the tests: a study owner's public key line (any 32 bytes, base64).
HELPER_TEST_ENV = {"HELPER_REDIS_PASSWORD": "compose-test-helper-redis",
                   "TRUSTED_STUDY_KEYS": "Thb9QZZP/gnHSodYIHKPsGvP21stP0I6fUdIryddqAM="}
TEST_ENV = {"REDIS_PASSWORD": "compose-test-redis", "GRAFANA_ADMIN_PASSWORD": "compose-test-gf",
            **{f"KAFKA_{role}_PASSWORD": f"compose-test-{role.lower()}" for role in
               ("AGGREGATOR", "TRAINER", "GATEWAY", "DEVICES", "OPERATOR", "MODELS")}}
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


def _interpolate(value: str, env: dict[str, str] = TEST_ENV) -> str:
    """Compose's ${VAR:-default} / ${VAR:?err} with ``env``, defaults otherwise."""
    def sub(m: re.Match) -> str:
        if m[1] in env:
            return env[m[1]]
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


def test_the_image_holds_every_package_pyproject_installs():
    """`pip install .` in the image needs every package pyproject.toml lists: the Dockerfile
    copies each, and its .dockerignore lets each into the build context."""
    import tomllib

    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]
    copied = {source for line in re.findall(r"^COPY (.+)$", (COMPOSE_DIR / "Dockerfile")
                                            .read_text(), re.MULTILINE)
              for source in shlex.split(line)[:-1]}
    admitted = set(re.findall(r"^!(\S+?)/?$", (COMPOSE_DIR / "Dockerfile.dockerignore")
                              .read_text(), re.MULTILINE))
    for top in {package.split(".")[0] for package in packages}:
        assert top in copied, f"the Dockerfile does not copy {top}/, which pyproject installs"
    for source in copied:
        assert source in admitted, f".dockerignore keeps {source} out of the build context"


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
        lines = [ln for ln in script.splitlines()
                 if ln.strip().startswith("topics ") and f'--topic "$${var}"' in ln]
        assert len(lines) == 1 and "--create --if-not-exists" in lines[0], field
        assert ("cleanup.policy=compact" in lines[0]) == (field == "studies"), field
        if field == "records":
            assert '--partitions "$$IPDP_TOPIC_RECORDS_PARTITIONS"' in lines[0]
    for name, service in _ipdp_services(compose).items():
        topic_env = {k: v for k, v in _env(service).items() if k.startswith("IPDP_TOPIC_")}
        created = {k: v for k, v in env.items() if k.startswith("IPDP_TOPIC_")}
        assert topic_env == created, f"{name} reads other topic names than kafka-init creates"
    assert _env(compose["services"]["kafka"])["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    for name in _ipdp_services(compose):
        assert compose["services"][name]["depends_on"]["kafka-init"]["condition"] == \
            "service_completed_successfully", name


def test_kafka_is_a_single_kraft_node_and_redis_persists_every_write_behind_a_password(compose):
    kafka = _env(compose["services"]["kafka"])
    assert compose["services"]["kafka"]["image"].startswith("apache/kafka:")
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert kafka["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@localhost:9093"
    assert "SASL://kafka:9092" in kafka["KAFKA_ADVERTISED_LISTENERS"]
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


def _listeners(kafka: dict[str, str]) -> dict[str, tuple[str, str]]:
    """listener name → (host it binds, security protocol)."""
    protocols = dict(item.split(":") for item in kafka["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
                     .split(","))
    out = {}
    for listener in kafka["KAFKA_LISTENERS"].split(","):
        name, address = listener.split("://")
        out[name] = (address.rsplit(":", 1)[0], protocols[name])
    return out


def _kafka_init_script(compose: dict) -> str:
    return "\n".join(compose["services"]["kafka-init"]["command"])


def _acls_in_operations() -> set[tuple[str, str, str, str]]:
    """(principal, operation, resource type, name) of docs/operations.md's ACL table."""
    text = OPERATIONS.read_text()
    table = text[text.index("| principal | role | topic permissions | group permissions |"):]
    acls = set()
    for row in table.splitlines()[2:]:
        if not row.startswith("|"):
            break
        principal, _, topics, groups = (c.strip() for c in row.strip("|").split("|"))
        principal = principal.strip("`")
        for kind, cell in (("topic", topics), ("group", groups)):
            for grant in re.findall(r"([A-Z][\w, ]*?) `([\w.-]+)`", cell):
                for operation in grant[0].split(","):
                    acls.add((principal, operation.strip(), kind, grant[1]))
    return acls


def test_kafka_authenticates_every_client_and_allows_each_role_what_operations_lists(compose):
    kafka = _env(compose["services"]["kafka"])
    # Nothing is allowed without an ACL; only the broker's own principal is a super user.
    assert kafka["KAFKA_AUTHORIZER_CLASS_NAME"].endswith("StandardAuthorizer")
    assert kafka["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    assert kafka["KAFKA_SUPER_USERS"] == "User:ANONYMOUS"
    assert kafka["KAFKA_SASL_ENABLED_MECHANISMS"] == "SCRAM-SHA-512"
    # Unauthenticated listeners (ANONYMOUS) on the container's loopback only; every other one
    # authenticates with SASL.
    listeners = _listeners(kafka)
    for name, (host, protocol) in listeners.items():
        assert protocol.startswith("SASL_") or host == "localhost", (name, host, protocol)
    assert listeners["SASL"] == ("", "SASL_PLAINTEXT")
    jaas = (COMPOSE_DIR / "kafka" / "broker_jaas.conf").read_text()
    assert "ScramLoginModule required;" in jaas
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in compose["services"]["kafka"]["volumes"]
                  if v.startswith("./"))
    assert kafka["KAFKA_OPTS"] == \
        f"-Djava.security.auth.login.config={mounts['./kafka/broker_jaas.conf']}"
    # kafka-init reaches the loopback listener by sharing the broker's network.
    init = compose["services"]["kafka-init"]
    assert init["network_mode"] == "service:kafka"
    script = _kafka_init_script(compose)
    host, _ = listeners["INTERNAL"]
    assert f"b={host}:9091" in script and "localhost:9091" in kafka["KAFKA_ADVERTISED_LISTENERS"]

    # One SCRAM user per ipdp service, each with the password kafka-init gives that user.
    users = dict(re.findall(r'^user (\S+) "\$\$(\w+)"$', script, re.MULTILINE))
    init_env = _env(init)
    principals = {}
    for name, service in _ipdp_services(compose).items():
        env = _env(service)
        assert env["IPDP_KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT", name
        assert env["IPDP_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512", name
        user = env["IPDP_KAFKA_SASL_USERNAME"]
        assert user in users, f"{name} logs in as {user}, whom kafka-init does not create"
        assert env["IPDP_KAFKA_SASL_PASSWORD"] == init_env[users[user]], name
        assert env["IPDP_KAFKA_SASL_PASSWORD"].startswith(f"${{{users[user]}:?"), name
        principals[name] = user
    assert len(set(users.values())) == len(users), "two users share a password"
    expected = {"aggregator": "ipdp-aggregator", "trainer": "ipdp-trainer",
                "gateway": "ipdp-gateway", "models": "ipdp-models", "loadgen": "ipdp-devices",
                "study-init": "ipdp-operator"}
    assert principals == expected

    # The ACLs kafka-init creates are exactly docs/operations.md's table.
    names = {f"IPDP_TOPIC_{f.upper()}": str(info.default)
             for f, info in TopicSettings.model_fields.items()}
    names["IPDP_AGGREGATOR_GROUP"] = init_env["IPDP_AGGREGATOR_GROUP"]
    assert _env(compose["services"]["aggregator"])["IPDP_AGGREGATOR_GROUP"] == \
        init_env["IPDP_AGGREGATOR_GROUP"]
    created = set()
    for line in re.findall(r"^allow (.+)$", script, re.MULTILINE):
        words = shlex.split(line.replace("$$", "$"))
        principal, rest = words[0], words[1:]
        operations = [rest[i + 1] for i, w in enumerate(rest) if w == "--operation"]
        kind = next(w[2:] for w in rest if w in ("--topic", "--group"))
        resource = names[rest[rest.index(f"--{kind}") + 1].lstrip("$")]
        created |= {(principal, op, kind, resource) for op in operations}
    assert created == _acls_in_operations()


def test_the_gateway_is_reached_only_through_the_tls_proxy_which_names_each_device(compose):
    services = compose["services"]
    proxy, gateway = services["proxy"], services["gateway"]
    assert proxy["image"].startswith("nginx:"), "nginx's official image"
    assert "ports" not in gateway, "the gateway's port is published"
    assert [p for p in proxy["ports"]] == ["443:443"]
    # Every other published port is this machine's only.
    for name, service in services.items():
        if name != "proxy":
            for port in service.get("ports", []):
                assert str(port).startswith("127.0.0.1:"), (name, port)
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in proxy["volumes"])
    assert mounts["./nginx/ipdp.conf"] == "/etc/nginx/conf.d/default.conf"
    assert mounts["./nginx/certs"] == "/etc/nginx/certs"

    # The proxy alone with the gateway on the edge network, at the address the gateway trusts.
    env = {k: _interpolate(v) for k, v in _env(gateway).items()}
    address = _interpolate(proxy["networks"]["edge"]["ipv4_address"])
    assert env["IPDP_GATEWAY_TRUSTED_PROXIES"] == address
    subnet = _interpolate(compose["networks"]["edge"]["ipam"]["config"][0]["subnet"])
    import ipaddress

    assert ipaddress.ip_address(address) in ipaddress.ip_network(subnet)
    assert set(proxy["networks"]) == {"edge"}
    assert set(gateway["networks"]) == {"default", "edge"}
    on_edge = {n for n, s in services.items() if "edge" in (s.get("networks") or [])}
    assert on_edge == {"proxy", "gateway"}

    # The gateway's limits are on.
    assert float(env["IPDP_GATEWAY_RATE_LIMIT_PER_S"]) > 0

    # The proxy's configuration: TLS to the gateway's port, the device's address in a header it
    # replaces, /metrics denied, and the gateway's own limits applied first.
    conf = NGINX_CONF.read_text()
    assert f"server gateway:{env['IPDP_GATEWAY_PORT']};" in conf
    assert re.search(r"^\s*listen 443 ssl;$", conf, re.MULTILINE)
    assert len(re.findall(r"^\s*listen\b", conf, re.MULTILINE)) == 1, "a plain-HTTP listener"
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in conf
    assert "$proxy_add_x_forwarded_for" not in conf
    assert re.search(r"location \^~ /metrics \{\s*deny all;\s*\}", conf)
    body = re.search(r"client_max_body_size\s+(\d+)m;", conf)
    assert int(body[1]) << 20 == int(env["IPDP_GATEWAY_MAX_BODY_BYTES"])
    assert re.search(r"^\s*limit_conn ipdp_connections_per_client \d+;", conf, re.MULTILINE)
    header_timeout = re.search(r"client_header_timeout\s+(\d+)s;", conf)
    assert float(header_timeout[1]) == float(env["IPDP_GATEWAY_HEADER_TIMEOUT_S"])
    read_timeout = re.search(r"proxy_read_timeout\s+(\d+)s;", conf)
    assert float(read_timeout[1]) > float(env["IPDP_GATEWAY_KAFKA_TIMEOUT_S"])


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


def _served() -> dict[str, set[str]]:
    """Per sample name a role's /metrics may serve (suffixes included), its metric's labels."""
    from ipdp.metrics import role_registry

    labels = {name: set(re.findall(r"`(\w+)`", text)) for name, _, text, _ in metric_rows()}
    out: dict[str, set[str]] = {}
    for role in ("aggregator", "trainer", "gateway", "loadgen"):
        for family in role_registry(role).collect():
            own = labels.get(family.name, labels.get(f"{family.name}_total", set()))
            for suffix in ("", "_total", "_bucket", "_sum", "_count"):
                out[family.name + suffix] = own
    return out


def test_the_dashboard_uses_only_exported_metrics_and_shows_what_an_operator_needs():
    exported = series_names()  # series name → metric name (histogram suffixes included)
    served = _served()
    shown = set()
    for path, dash in _dashboards():
        exprs = _exprs(dash)
        assert exprs, path
        for expr in exprs:
            for name in re.findall(r"\bipdp_\w+", expr):
                assert name in exported, f"{path.name}: {name} is not exported by ipdp/metrics.py"
                assert name in served, f"{path.name}: no role serves {name} on /metrics"
                shown.add(exported[name])
    all_exprs = "\n".join(e for _, d in _dashboards() for e in _exprs(d))
    for metric in ("ipdp_records_folded_total", "ipdp_records_dead_lettered_total",
                   "ipdp_round_progress_ratio", "ipdp_fold_seconds", "ipdp_consumer_lag_records",
                   "ipdp_models_published_total"):
        assert metric in shown, f"the dashboard does not show {metric}"
    assert "by (reason)" in all_exprs
    for q in ("0.5", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(ipdp_fold_seconds_bucket" in all_exprs


def test_the_dashboard_has_a_study_selector_that_every_per_study_query_uses():
    served = _served()
    for path, dash in _dashboards():
        (variable,) = [v for v in dash["templating"]["list"] if v["name"] == "study"]
        assert variable["type"] == "query" and variable["query"]["query"] == "label_values(study)"
        assert variable["includeAll"] and variable["multi"] and variable["allValue"] == ".*"
        for expr in _exprs(dash):
            for name, selector in re.findall(r"\b(ipdp_\w+)(\{[^}]*\})?", expr):
                if "study" in served[name]:
                    assert 'study=~"$study"' in selector, f"{path.name}: {expr} ignores $study"
    titles = {p["title"] for _, d in _dashboards() for p in d["panels"]}
    assert {"Values clipped (load generator)", "Models whose norm constraint binds"} <= titles


def test_the_metric_check_fails_on_a_metric_no_role_serves(monkeypatch):
    """The check above fails on a panel metric that ipdp/metrics.py defines but no role's
    /metrics serves (here: one taken out of what the roles serve)."""
    served = _served()
    del served["ipdp_records_folded_total"]
    monkeypatch.setattr(f"{__name__}._served", lambda: served)
    with pytest.raises(AssertionError, match="no role serves ipdp_records_folded_total"):
        test_the_dashboard_uses_only_exported_metrics_and_shows_what_an_operator_needs()


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


# --------------------------------------------------------------------------- the helper's deployment


@pytest.fixture(scope="module")
def helper_compose() -> dict:
    return yaml.safe_load(HELPER_COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def two_server() -> dict:
    return yaml.safe_load(TWO_SERVER_FILE.read_text())


def _ignored_by_git(path: Path) -> bool:
    binary = require_tool("git", "asking which files the repository ignores")
    return subprocess.run([binary, "-C", str(REPO), "check-ignore", "-q", str(path)],
                          check=False).returncode == 0


def test_the_helper_is_a_deployment_of_its_own_with_its_own_persistent_redis(helper_compose):
    from ipdp.cli.main import build_parser

    services = helper_compose["services"]
    assert set(services) == {"redis", "helper", "proxy"}, "the helper's file runs the leader's"
    helper = services["helper"]
    assert helper["image"] == IPDP_IMAGE
    assert (HELPER_DIR / helper["build"]["context"]).resolve() == REPO
    assert helper["build"]["dockerfile"] == "compose/Dockerfile"
    assert helper["command"] == ["helper", "run"]
    assert callable(build_parser().parse_args(helper["command"]).func)
    env = _env(helper)
    assert env["IPDP_HELPER_HOST"] == "0.0.0.0"
    # Nothing of the leader's domain: no Kafka, no topics, not the leader's Redis settings.
    assert not [k for k in env if k.startswith(("IPDP_REDIS_", "IPDP_KAFKA_", "IPDP_TOPIC_"))]
    assert env["IPDP_HELPER_REDIS_URL"] == "redis://redis:6379/0"
    assert helper["depends_on"]["redis"]["condition"] == "service_healthy"
    redis = services["redis"]
    argv = shlex.split(redis["command"][-1])
    for flag, value in (("--appendonly", "yes"), ("--appendfsync", "always"),
                        ("--requirepass", "$$REDIS_PASSWORD")):
        assert argv[argv.index(flag) + 1] == value, flag
    password_ref = _env(redis)["REDIS_PASSWORD"]
    assert password_ref.startswith("${HELPER_REDIS_PASSWORD:?")
    assert env["IPDP_HELPER_REDIS_PASSWORD"] == password_ref
    assert env["IPDP_TRUSTED_STUDY_KEYS"].startswith("${TRUSTED_STUDY_KEYS:?")
    # The helper forgets record ids no later than the leader does (the leader's compose file).
    leader = _env(yaml.safe_load(COMPOSE_FILE.read_text())["services"]["aggregator"])
    for helper_name, leader_name in (("IPDP_HELPER_REPLAY_WINDOW_S",
                                      "IPDP_AGGREGATOR_REPLAY_WINDOW_S"),
                                     ("IPDP_HELPER_MAX_FUTURE_SKEW_S",
                                      "IPDP_AGGREGATOR_MAX_FUTURE_SKEW_S")):
        assert int(env[helper_name]) <= int(leader[leader_name]), helper_name


def test_the_helpers_key_and_the_leader_token_are_secrets_the_repository_never_holds(
        helper_compose, two_server):
    helper_env = _env(helper_compose["services"]["helper"])
    assert helper_env["IPDP_HELPER_KEY_FILE"] == "/run/secrets/helper_key"
    assert helper_env["IPDP_HELPER_LEADER_TOKEN_FILE"] == "/run/secrets/leader_token"
    assert "IPDP_HELPER_LEADER_TOKEN" not in helper_env
    # The leader's file gives its aggregator and trainer the token and the helper's CA, and
    # nothing else; the main file alone (one-server studies) names neither.
    assert set(two_server["services"]) == {"aggregator", "trainer"}
    for name in ("aggregator", "trainer"):
        assert _env(two_server["services"][name]) == {
            "IPDP_HELPER_LEADER_TOKEN_FILE": "/run/secrets/helper_leader_token",
            "IPDP_HELPER_CA_FILE": "/run/secrets/helper_ca"}, name
    assert "IPDP_HELPER_" not in COMPOSE_FILE.read_text()
    for compose, base in ((helper_compose, HELPER_DIR), (two_server, COMPOSE_DIR)):
        files = {name: base / spec["file"] for name, spec in compose["secrets"].items()}
        for path in files.values():
            assert _ignored_by_git(path), f"{path} could be committed"
        for name, service in compose["services"].items():
            mounted = {f"/run/secrets/{secret}" for secret in service.get("secrets", [])}
            named = {v for k, v in _env(service).items() if v.startswith("/run/secrets/")}
            assert named == mounted and set(service.get("secrets", [])) <= set(files), name
    for path in (HELPER_DIR / ".env", HELPER_DIR / "certs" / "tls.key", COMPOSE_DIR / ".env",
                 COMPOSE_DIR / "nginx" / "certs" / "tls.key"):
        assert _ignored_by_git(path), f"{path} could be committed"


def test_each_domains_environment_reads_its_secret_files(helper_compose, two_server, compose,
                                                          monkeypatch, tmp_path):
    """Every settings model accepts the helper's environment and the leader's merged one, with
    the secrets where compose mounts them (here: files of the test's own)."""
    token = "compose-test-leader-token"
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for name in ("leader_token", "helper_leader_token", "helper_key", "helper_ca"):
        (secrets / name).write_text(f"{token}\n")

    def environment(env: dict[str, str], compose_env: dict[str, str]) -> None:
        for key in [k for k in os.environ if k.startswith("IPDP_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, _interpolate(value, compose_env).replace(
                "/run/secrets/", f"{secrets}/"))
        for model in settings_models():
            model()

    from helper.settings import HelperSettings
    from ipdp.settings import LeaderTokenSettings

    environment(_env(helper_compose["services"]["helper"]), HELPER_TEST_ENV)
    helper = HelperSettings()
    assert helper.leader_token.get_secret_value() == token
    assert helper.key_file == f"{secrets}/helper_key"
    assert helper.redis_password.get_secret_value() == HELPER_TEST_ENV["HELPER_REDIS_PASSWORD"]
    for name in ("aggregator", "trainer"):
        environment({**_env(compose["services"][name]), **_env(two_server["services"][name])},
                    TEST_ENV)
        leader = LeaderTokenSettings()
        assert leader.leader_token.get_secret_value() == token, name
        assert leader.ca_file == f"{secrets}/helper_ca", name


def test_the_helpers_edge_is_its_only_published_port_and_holds_to_the_helpers_limits(
        helper_compose):
    from aggregator.settings import AggregatorSettings

    services = helper_compose["services"]
    proxy, helper = services["proxy"], services["helper"]
    assert proxy["image"].startswith("nginx:"), "nginx's official image"
    assert proxy["ports"] == ["443:443"]
    assert [name for name, service in services.items() if "ports" in service] == ["proxy"]
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in proxy["volumes"])
    assert mounts == {"../nginx/nginx.conf": "/etc/nginx/nginx.conf",
                      "./nginx/helper.conf": "/etc/nginx/conf.d/default.conf",
                      "./certs": "/etc/nginx/certs"}
    assert (HELPER_DIR / "../nginx/nginx.conf").resolve() == COMPOSE_DIR / "nginx" / "nginx.conf"
    assert set(proxy["networks"]) == {"edge"}
    assert set(helper["networks"]) == {"default", "edge"}
    assert "networks" not in services["redis"], "the helper's Redis is on the edge network"

    env = _env(helper)
    conf = HELPER_NGINX_CONF.read_text()
    assert re.findall(r"^\s*server (\S+);$", conf, re.MULTILINE) == \
        [f"helper:{env['IPDP_HELPER_PORT']}"]
    assert re.findall(r"^\s*listen\b.*$", conf, re.MULTILINE) == ["    listen 443 ssl;"]
    assert "ssl_certificate     /etc/nginx/certs/tls.crt;" in conf
    assert "ssl_certificate_key /etc/nginx/certs/tls.key;" in conf
    assert re.search(r"location \^~ /metrics \{\s*deny all;\s*\}", conf)
    body = re.search(r"client_max_body_size\s+(\d+)m;", conf)
    assert int(body[1]) << 20 == int(env["IPDP_HELPER_MAX_BODY_BYTES"])
    read_timeout = re.search(r"proxy_read_timeout\s+(\d+)s;", conf)
    assert float(read_timeout[1]) > AggregatorSettings.model_fields["helper_timeout_s"].default


def _tls_handshake(server: ssl.SSLContext, client: ssl.SSLContext, hostname: str) -> None:
    """One TLS handshake between the two contexts over a socket pair; raises the client's
    error."""
    import socket
    import threading

    client_end, server_end = socket.socketpair()

    def serve() -> None:
        try:
            with server.wrap_socket(server_end, server_side=True) as tls:
                tls.sendall(b"ok")
        except (ssl.SSLError, OSError):
            pass  # the client's side says why

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client.wrap_socket(client_end, server_hostname=hostname) as tls:
            assert tls.recv(2) == b"ok"
    finally:
        client_end.close()
        thread.join(timeout=10)


def test_the_documented_helper_setup_makes_every_file_the_helper_deployment_mounts(
        helper_compose, tmp_path):
    """docs/operations.md's setup block, run as written in a copy of compose/helper, makes the
    secrets (private to their owner), a key pair the helper loads and a certificate the leader,
    pinning it as its CA (IPDP_HELPER_CA_FILE), accepts for the helper's name only."""
    import shutil
    import sys

    from ipdp.sealing import load_helper_key

    require_tool("openssl", "making the helper edge's certificate")
    block = re.search(r"<!-- compose/helper: setup -->\s*```sh\n(.*?)```", OPERATIONS.read_text(),
                      re.DOTALL)[1]
    shutil.copytree(HELPER_DIR, tmp_path / "compose" / "helper")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IPDP_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # this ipdp
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    here = tmp_path / "compose" / "helper"
    for spec in helper_compose["secrets"].values():
        path = here / spec["file"]
        assert path.stat().st_mode & 0o077 == 0, f"{spec['file']} is readable by others"
    key = load_helper_key(str(here / "secrets" / "helper.key"))
    assert (here / "secrets" / "helper.pub").read_text().strip() == key.public_b64
    assert re.fullmatch(r"[0-9a-f]{64}\n", (here / "secrets" / "leader-token").read_text())
    cert, tls_key = here / "certs" / "tls.crt", here / "certs" / "tls.key"
    assert tls_key.stat().st_mode & 0o077 == 0
    assert (here / ".env").read_text() == (HELPER_DIR / ".env.example").read_text()

    host = re.search(r"^HELPER_HOST=(\S+)", block, re.MULTILINE)[1]
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, tls_key)
    leader = ssl.create_default_context(cafile=str(cert))
    _tls_handshake(server, leader, host)
    with pytest.raises(ssl.SSLCertVerificationError):
        _tls_handshake(server, leader, f"not-{host}")
    with pytest.raises(ssl.SSLCertVerificationError):
        _tls_handshake(server, ssl.create_default_context(), host)  # the system's trust store


# --------------------------------------------------------------------------- real tools


def _compose_config(tmp_path: Path, files: list[Path], env: dict[str, str],
                    *args: str) -> subprocess.CompletedProcess:
    """`docker-compose config` of ``files`` (the first one's directory is the project's) with
    ``env`` and no .env file."""
    binary = require_tool("docker-compose", "validating the compose files")
    empty_env = tmp_path / "empty.env"
    empty_env.write_text("")
    clean = {k: v for k, v in os.environ.items() if k not in TEST_ENV and k not in HELPER_TEST_ENV}
    return subprocess.run([binary, "--env-file", str(empty_env), "--project-directory",
                           str(files[0].parent), *[a for f in files for a in ("-f", str(f))],
                           "config", *args], env={**clean, **env}, check=False,
                          capture_output=True, text=True, timeout=120)


def _requires_each(tmp_path: Path, files: list[Path], env: dict[str, str]) -> None:
    """The files are valid with ``env``, and refused, naming it, without any one of it."""
    ok = _compose_config(tmp_path, files, env, "-q")
    assert ok.returncode == 0, ok.stderr
    services = _compose_config(tmp_path, files, env, "--services")
    assert services.returncode == 0, services.stderr
    assert set(services.stdout.split()) == set(yaml.safe_load(files[0].read_text())["services"])
    for secret in env:  # each password is required on its own
        missing = _compose_config(tmp_path, files, {k: v for k, v in env.items() if k != secret},
                                  "-q")
        assert missing.returncode != 0, secret
        assert secret in missing.stderr, secret


def test_docker_compose_config_accepts_the_file_and_requires_the_passwords(tmp_path):
    _requires_each(tmp_path, [COMPOSE_FILE], TEST_ENV)


def test_docker_compose_config_accepts_the_helpers_file_and_requires_its_settings(tmp_path):
    _requires_each(tmp_path, [HELPER_COMPOSE_FILE], HELPER_TEST_ENV)
    merged = yaml.safe_load(_compose_config(tmp_path, [HELPER_COMPOSE_FILE], HELPER_TEST_ENV)
                            .stdout)
    assert {name: Path(spec["file"]) for name, spec in merged["secrets"].items()} == {
        "helper_key": HELPER_DIR / "secrets" / "helper.key",
        "leader_token": HELPER_DIR / "secrets" / "leader-token"}


def test_docker_compose_config_merges_the_two_server_file_over_the_leaders(tmp_path):
    files = [COMPOSE_FILE, TWO_SERVER_FILE]
    _requires_each(tmp_path, files, TEST_ENV)
    done = _compose_config(tmp_path, files, TEST_ENV)
    merged, alone = yaml.safe_load(done.stdout), yaml.safe_load(
        _compose_config(tmp_path, [COMPOSE_FILE], TEST_ENV).stdout)
    assert {name: Path(spec["file"]) for name, spec in merged["secrets"].items()} == {
        "helper_leader_token": COMPOSE_DIR / "secrets" / "helper-leader-token",
        "helper_ca": COMPOSE_DIR / "secrets" / "helper-ca.crt"}
    assert set(merged["services"]) == set(alone["services"])
    for name, service in merged["services"].items():
        if name in ("aggregator", "trainer"):
            assert {s["source"] for s in service["secrets"]} == {"helper_leader_token",
                                                                "helper_ca"}, name
            env = service["environment"]
            assert env["IPDP_HELPER_LEADER_TOKEN_FILE"] == "/run/secrets/helper_leader_token"
            assert env["IPDP_HELPER_CA_FILE"] == "/run/secrets/helper_ca"
            # The main file's settings stay: the merge adds, it replaces nothing.
            assert {k: v for k, v in env.items() if not k.startswith("IPDP_HELPER_")} == \
                alone["services"][name]["environment"], name


def test_promtool_accepts_the_prometheus_configuration():
    binary = require_tool("promtool", "validating compose/prometheus/prometheus.yml")
    result = subprocess.run([binary, "check", "config", str(PROMETHEUS_YML)],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
