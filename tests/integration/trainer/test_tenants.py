"""The shared trainer (`engine.tenancy.shared_trainer`) against real rollouts on disk: one torchrun
process holds the tiny model once and trains several LoRA tenants, each exactly as a trainer of
its own would, while one tenant's bad data or lapsed lease touches nobody else.

The test plays the tenants' side itself (their requests and leases, their committed rollouts),
so no inference server is needed; `tests/integration/prefect/test_tenants.py` runs the whole
thing through `primeflow pools up` and `primeflow rl`.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import PrimeflowConfig, with_overrides
from engine.run import run_store
from engine.tenancy.files import TenantFiles
from engine.trainer.pool import TrainerPool
from engine.trainer.worker import run_stage
from storage.checkpoints import fetch_checkpoint, load_checkpoint_weights
from storage.commit import committed_steps, latest_committed_step
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.shards import write_rollouts
from tests.integration.trainer.conftest import make_config, rollout_rows, write_steps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
POOL = "it-trainer"
LORA = {"rank": 4, "alpha": 8.0}
POOLS = {"name": POOL, "tenants": 3, "lease_s": 3.0, "heartbeat_s": 0.5, "poll_s": 0.05}


def tenant_config(root: Path, model: Path, name: str, **overrides: Any) -> PrimeflowConfig:
    config = make_config(root, model, name, trainer={"lora": LORA}, pools=POOLS)
    return with_overrides(config, overrides)


def solo(config: PrimeflowConfig, name: str) -> PrimeflowConfig:
    """The same run on a trainer of its own, under another name."""
    return with_overrides(config, {"pools.name": None, "run.name": name})


def final_adapter(config: PrimeflowConfig) -> dict[str, torch.Tensor]:
    store = run_store(config)
    step = latest_committed_step(store, RunLayout.CHECKPOINTS)
    assert step == config.trainer.max_steps
    with tempfile.TemporaryDirectory() as tmp:
        return load_checkpoint_weights(fetch_checkpoint(store, step, Path(tmp) / "c"))


class Tenants:
    """The tenants' side: requests, leases renewed on a thread, the trainer's answers."""

    def __init__(self, pool: TrainerPool) -> None:
        self.pool = pool
        self.attempts: dict[str, str] = {}
        self.renewing: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True)
        self._thread.start()

    def request(self, config: PrimeflowConfig) -> None:
        name = config.run.name
        self.attempts[name] = TenantFiles(POOL, name).request(config)
        self.renewing.add(name)

    def _renew(self) -> None:
        while not self._stop.wait(0.3):
            for name in list(self.renewing):
                TenantFiles(POOL, name).renew(self.attempts[name])

    def state(self, name: str) -> dict[str, Any] | None:
        return TenantFiles(POOL, name).state(self.attempts[name])

    def wait_for(self, name: str, *statuses: str, timeout_s: float = 240) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.pool.poll() is None, self.pool.last_error()
            state = self.state(name)
            if state is not None and state["status"] in statuses:
                return state
            time.sleep(0.1)
        raise AssertionError(f"{name} never became {statuses}: {self.state(name)}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def shared_trainer(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Tenants]:
    monkeypatch.setenv("PRIMEFLOW_HOME", str(tmp_path / "home"))
    config = tenant_config(tmp_path, tiny_model_dir, "pools")
    pool = TrainerPool(config, "tenants", log_path=tmp_path / "trainer-tenants.log")
    pool.start()
    tenants = Tenants(pool)
    try:
        yield tenants
    finally:
        tenants.close()
        pool.stop()
    assert pool.poll() is not None


def test_tenants_train_as_alone_and_fail_alone(
    shared_trainer: Tenants, tmp_path: Path, tiny_model_dir: Path
) -> None:
    a = tenant_config(tmp_path, tiny_model_dir, "a", **{"run.seed": 1})
    b = tenant_config(tmp_path, tiny_model_dir, "b", **{"run.seed": 2, "trainer.optim.lr": 3e-3})
    bad = tenant_config(tmp_path, tiny_model_dir, "bad")
    for config in (a, b):
        write_steps(config, range(1, 4))
    bad_rows = rollout_rows(2)
    bad_rows[3]["token_ids"][1] = 10**6  # outside the vocabulary
    write_steps(bad, range(1, 2))
    write_rollouts(run_store(bad), 2, bad_rows)
    for config in (a, b, bad):
        shared_trainer.request(config)

    failed = shared_trainer.wait_for("bad", "failed")
    assert "step 2" in failed["error"] and "vocabulary" in failed["error"], failed
    for name in ("a", "b"):
        assert shared_trainer.wait_for(name, "finished")["step"] == 3

    # Each tenant trained exactly as on a trainer of its own: same losses, same adapter bits
    # (fp32 on CPU), although their steps interleaved on one model and "bad" failed among them.
    for config in (a, b):
        alone = solo(config, f"solo-{config.run.name}")
        write_steps(alone, range(1, 4))
        run_stage(alone, "rl")
        shared, own = read_metrics(run_store(config), "rl"), read_metrics(run_store(alone), "rl")
        assert [m["step"] for m in shared] == [1, 2, 3]
        assert [m["loss"] for m in shared] == [m["loss"] for m in own]
        want, have = final_adapter(alone), final_adapter(config)
        assert want.keys() == have.keys() and want
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=0, atol=0, msg=name)
    assert final_adapter(a).keys() == final_adapter(b).keys()
    assert any(not torch.equal(final_adapter(a)[k], final_adapter(b)[k]) for k in final_adapter(a))
    # The failed tenant keeps what it committed before its bad step.
    assert committed_steps(run_store(bad), RunLayout.CHECKPOINTS) == [1]


def test_a_tenant_whose_lease_lapses_is_let_go_and_resumes_exactly(
    shared_trainer: Tenants, tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = tenant_config(tmp_path, tiny_model_dir, "late", **{"run.seed": 1})
    write_steps(config, range(1, 2))
    shared_trainer.request(config)
    store = run_store(config)
    deadline = time.monotonic() + 120
    while latest_committed_step(store, RunLayout.CHECKPOINTS) != 1:
        assert time.monotonic() < deadline, shared_trainer.state("late")
        time.sleep(0.1)

    shared_trainer.renewing.discard("late")  # the tenant's process died
    released = shared_trainer.wait_for("late", "released", timeout_s=30)
    assert "lease" in released["error"] and released["step"] == 1, released

    # Later, the run comes back (a new attempt) with its remaining rollouts: it resumes from
    # its checkpoint and ends where a run that never stopped ends.
    write_steps(config, range(2, 4))
    shared_trainer.request(config)
    assert shared_trainer.wait_for("late", "finished")["step"] == 3
    assert [m["step"] for m in read_metrics(store, "rl")] == [1, 2, 3]
    alone = solo(config, "solo-late")
    write_steps(alone, range(1, 4))
    run_stage(alone, "rl")
    want, have = final_adapter(alone), final_adapter(config)
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=0, msg=name)
