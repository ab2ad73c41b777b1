"""Credentials that must never appear in anything a run writes: set them, run, scan for them.

The values are fake but shaped like real ones, so a scrubber that matches on shape is tested too.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIAFAKEACCESSKEY0001",
    "AWS_SECRET_ACCESS_KEY": "fake/secret+access/key/0123456789abcdef",
    "AWS_SESSION_TOKEN": "FAKESESSIONTOKEN-abcdefghijklmnop",
    "HF_TOKEN": "hf_fakehubtoken0123456789",
    "WANDB_API_KEY": "fakewandbkey0123456789abcdef012345678901",
    "GOOGLE_APPLICATION_CREDENTIALS": "/secret/fake-gcp-credentials.json",
}
API_KEY = "inference-api-key-that-must-not-leak"
SECRETS = [*FAKE_ENV.values(), API_KEY]


def leaks_in_files(files: Iterable[Path], root: Path) -> list[str]:
    """One line per (file, secret) where the file's bytes hold the secret."""
    return [
        f"{path.relative_to(root)} holds {secret[:6]}..."
        for path in files
        for secret in SECRETS
        if secret.encode() in path.read_bytes()
    ]


def leaks_in_text(text: str, where: str) -> list[str]:
    return [f"{where} holds {secret[:6]}..." for secret in SECRETS if secret in text]
