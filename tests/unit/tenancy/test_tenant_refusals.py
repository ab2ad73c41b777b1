"""A tenant the shared pools cannot train is refused before any flow run: exit 2, one line.

The pools' record is a real `pool.json` of a live supervisor (this process). `PREFECT_API_URL`
points at a closed loopback port, so a command that got as far as its flow would fail there
(exit 1), not with the refusal.
"""

# The cases keep one case per line.
# ruff: noqa: E501

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import PrimeflowConfig, load_config
from engine.tenancy.files import PoolRecord, lora_of
from flows.cli import main

TENANT = ["--pools.name", "p", "--trainer.lora.rank", "8", "--max-steps", "2"]


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PRIMEFLOW_HOME", str(tmp_path / "home"))
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{port}/api")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def pools_training(config: PrimeflowConfig, **changes: object) -> None:
    """Record running pools `p` that train what `config` asks for, but for `changes`."""
    record = {
        "name": "p",
        "status": "running",
        "supervisor_pid": os.getpid(),
        "model": str(config.trainer.model),
        "lora": lora_of(config),
        "tenants": 2,
        "servers": ["http://127.0.0.1:1"],
        "api_key": "secret",
        **changes,
    }
    PoolRecord(**record).write()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pools", "expected"),
    [
        pytest.param(None, r"pools\.name: no shared pools named 'p' are running on this host .*primeflow pools up.*", id="no-pools-up"),
        pytest.param(lambda config: {"model": "./other-base"}, r"pools\.name: this run cannot train on pools 'p': trainer\.model is '.+', the pools train '\./other-base'", id="other-base-model"),
        pytest.param(lambda config: {"lora": {**lora_of(config), "rank": 16}}, r"pools\.name: this run cannot train on pools 'p': trainer\.lora is \{.*'rank': 8.*\}, the pools' adapters are \{.*'rank': 16.*\}", id="other-rank"),
    ],
)  # fmt: skip
def test_a_misfit_tenant_exits_2_in_one_line_before_its_flow(
    pools: Callable[[PrimeflowConfig], dict[str, object]] | None,
    expected: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`pools`: what the running pools train other than the tenant asks (None: no pools)."""
    config = load_config(TENANT)
    if pools is not None:
        pools_training(config, **pools(config))
    assert main(["rl", *TENANT]) == 2
    out, err = capsys.readouterr()
    assert "Prefect UI" not in out  # the flow was never reached
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert re.fullmatch(rf"primeflow rl: {expected}", err.rstrip("\n")), err


def test_a_tenant_that_fits_gets_past_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    """It goes on to its flow, which fails here only because no Prefect server answers."""
    config = load_config(TENANT)
    pools_training(config)
    assert main(["rl", *TENANT]) == 1
    assert "pools.name" not in capsys.readouterr().err


def test_a_dry_run_does_not_need_the_pools_up(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rl", "--dry-run", *TENANT]) == 0
    assert '"pools"' in capsys.readouterr().out
