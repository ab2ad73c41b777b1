"""`primeflow inference`: run the pool in the foreground until Ctrl-C or SIGTERM.

For using the policy by hand (curl, an OpenAI client, an eval harness) and for checking that a
config's servers start. Logs and the pool record go to `<run>/logs/`; for a remote run root
they are written locally first and uploaded when the pool stops.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TextIO

from engine.config import PrimeflowConfig
from engine.inference.pool import InferencePool, InferencePoolError
from engine.run import logs_dir, run_store
from storage.layout import RunLayout

EXIT_OK = 0
EXIT_START_FAILED = 1


def upload_logs(config: PrimeflowConfig, log_dir: Path) -> None:
    """Copy the pool's logs into `<run>/logs/` when the run root is not this machine's disk."""
    store = run_store(config)
    if store.protocol == "file":
        return
    for path in sorted(log_dir.glob("inference*")):
        store.upload_file(path, f"{RunLayout.LOGS}/{path.name}")


def serve_forever(config: PrimeflowConfig, out: TextIO = sys.stdout) -> int:
    """Start the pool, print its endpoints, block until SIGINT/SIGTERM, stop it; exit status."""
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    log_dir = logs_dir(config)
    pool = InferencePool.for_run(config, log_dir)
    try:
        try:
            pool.start()
        except InferencePoolError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_START_FAILED
        for endpoint in pool.endpoints:
            print(f"server {endpoint.index}: {endpoint.base_url}/v1", file=out)
        print(f"model: {pool.model_name}", file=out)
        if config.inference.api_key is None:
            print(f"api key (generated for this run): {pool.api_key}", file=out)
        print(f"logs: {log_dir}", file=out)
        print("serving; Ctrl-C to stop", file=out, flush=True)
        stop.wait()
        return EXIT_OK
    finally:
        pool.stop()
        upload_logs(config, log_dir)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
