"""Talking to a server's control routes (reload, adapters, pause), and how that fails."""

from __future__ import annotations

import ssl
from functools import cache

import httpx

from engine.local_checkpoints import DamagedCheckpointError, checkpoint_step


class ReloadError(RuntimeError):
    """A checkpoint could not be swapped in; the servers still serve the previous weights."""


class ServerDiedError(ReloadError):
    """A server of the pool is not running: no reload succeeds until the pool is restarted,
    so one is not retried against it."""


class BrokenVersionError(ReloadError):
    """The policy version's files or delta chain do not verify (`DamagedCheckpointError`):
    no server was touched, and no reload of it can succeed until it is written again."""


class ServedWeightsMismatchError(RuntimeError):
    """A verified reload found served parameters that differ from the checkpoint: a bug, and
    never retried (see `InferenceConfig.verify_reloads`)."""


def unloadable(location: str, exc: OSError | ValueError) -> ReloadError:
    """What a reload raises when `location`'s folders could not be made ready (fetched,
    verified, checked against the served model): `BrokenVersionError` when they are damaged."""
    kind = BrokenVersionError if isinstance(exc, DamagedCheckpointError) else ReloadError
    return kind(f"cannot reload {location}: {exc}")


def named_version(location: str, version: int | None) -> int:
    """`version`, else the step in `location`'s `step_NNNNNN` name (`ReloadError` if none)."""
    if version is not None:
        return version
    step = checkpoint_step(location)
    if step is None:
        raise ReloadError(f"no version given and none in the name of {location}")
    return step


@cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every control client. httpx builds one per client by default,
    reading the CA bundle: ~25 ms, once per server on a reload's critical path, where the
    control routes are plain HTTP on loopback anyway."""
    return ssl.create_default_context()


def control_client(base_url: str, api_key: str, timeout_s: float) -> httpx.Client:
    """An HTTP client for a server's control routes (loopback + key, see `guard`)."""
    return httpx.Client(
        base_url=base_url,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=timeout_s,
        verify=_tls(),
    )


def pause_generation(http: httpx.Client) -> None:
    """Pause a server's generation with its requests kept as they are (their KV too: a reload
    resets it once, after its load, the same on every vLLM release)."""
    expect_ok(http.post("/pause", params={"mode": "keep", "clear_cache": "false"}), "pause")


def expect_ok(response: httpx.Response, what: str) -> None:
    """Raise `ReloadError` with vLLM's own message when a control call did not succeed."""
    if response.status_code == 200:
        return
    try:
        message = response.json().get("error", response.text)
        if isinstance(message, dict):
            message = message.get("message", message)
    except ValueError:
        message = response.text
    message = " ".join(str(message).split())
    raise ReloadError(f"{what} answered {response.status_code}: {message}")
