"""bench/gateway_load.py runs end to end on the embedded runtime (figures printed, never
asserted)."""

from __future__ import annotations

import pytest

from bench.gateway_load import gateway_e2e, hot_path, print_tables
from gateway.settings import GatewaySettings
from tests.conftest import _require_binaries


@pytest.mark.integration
def test_gateway_e2e_folds_every_record_posted_and_reports_its_figures(capsys):
    _require_binaries()
    # Past the default limits of a gateway for one address, in records and in requests: the
    # benchmark configures its own gateway (its address a relay), or it would see 429s.
    records, per_request = 3000, 100
    defaults = GatewaySettings.model_fields
    assert records > defaults["record_limit_burst"].default
    assert records // per_request > defaults["rate_limit_burst"].default
    e2e = gateway_e2e(records, connections=2, per_request=per_request)
    hot = [hot_path(10, repeat=5)]
    print_tables(e2e, hot)
    out = capsys.readouterr().out
    assert e2e["records"] == 3000 and e2e["gateway_e2e_records_per_second"] > 0
    assert set(e2e["cpu_us_per_record"]) == {"gateway", "aggregator", "broker", "redis",
                                             "clients"}
    assert "first POST → last record folded in Redis" in out
