"""The run manifest: enough to re-run a run, and never a credential."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from storage.layout import RunLayout
from storage.manifest import (
    REDACTED,
    is_secret_key,
    read_manifest,
    scrub_command,
    write_manifest,
)
from storage.store import ObjectStore

AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"


def test_manifest_records_how_the_run_started(memory_store: ObjectStore) -> None:
    config = {"model": {"name": "tiny"}, "sampling": {"max_tokens": 128, "temperature": 1.0}}
    written = write_manifest(
        memory_store,
        config=config,
        seeds={"trainer": 0, "orchestrator": 1},
        parent_run="sft-001",
        command=["primeflow", "rl", "@", "configs/reverse_text/rl.toml"],
    )
    manifest = read_manifest(memory_store)
    assert manifest == written
    assert manifest["config"] == config
    assert manifest["seeds"] == {"trainer": 0, "orchestrator": 1}
    assert manifest["parent_run"] == "sft-001"
    assert manifest["run_uri"] == memory_store.url()
    assert manifest["command"][-1] == "configs/reverse_text/rl.toml"
    assert {"torch", "transformers", "pyarrow", "fsspec"} <= manifest["packages"].keys()
    assert re.fullmatch(r"\d+\.\d+\.\d+", manifest["python"])
    assert manifest["hostname"]
    assert re.fullmatch(r"[0-9a-f]{40}", manifest["code"]["commit"])
    assert isinstance(manifest["code"]["dirty"], bool)


def test_manifest_without_git_still_gets_written(
    memory_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "")  # no git binary to be found
    manifest = write_manifest(memory_store, config={}, seeds={}, parent_run=None, command=None)
    assert manifest["code"] is None
    assert read_manifest(memory_store)["command"] is None


def test_no_credential_reaches_the_manifest(
    memory_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", AWS_KEY_ID)
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    config = {
        "wandb": {"project": "rl", "api_key": "wandb-key-0123456789"},
        "storage": {
            "uri": "s3://bucket/runs",
            "aws_secret_access_key": "literal-secret-999",
            "endpoint": f"http://{AWS_KEY_ID}:{AWS_SECRET}@minio:9000",
        },
        "inference": {"apiKey": "sk-local-123456", "api_key_var": "OPENAI_API_KEY"},
        "db": [{"password": "hunter2hunter2"}],
        "credentials_file": "/home/me/.aws/credentials",
        "sampling": {"max_tokens": 512},
        "model": {"tokenizer": "Qwen/Qwen3-0.6B"},
        "notes": f"copied from a shell where the key was {AWS_SECRET}",
    }
    command = [
        "primeflow",
        "rl",
        "--wandb.api-key",
        "wandb-key-0123456789",
        "--inference.token=tok-abcdef123456",
        "--trainer.optim.lr",
        "1e-5",
        f"--storage.endpoint=http://{AWS_KEY_ID}@minio",
    ]
    write_manifest(
        memory_store, config=config, seeds={"trainer": 7}, parent_run=None, command=command
    )
    raw = memory_store.read_bytes(RunLayout.MANIFEST).decode()
    for secret in [
        AWS_SECRET,
        AWS_KEY_ID,
        "wandb-key-0123456789",
        "literal-secret-999",
        "sk-local-123456",
        "hunter2hunter2",
        "tok-abcdef123456",
        "/home/me/.aws/credentials",
    ]:
        assert secret not in raw
    manifest = read_manifest(memory_store)
    assert manifest["config"]["wandb"] == {"project": "rl", "api_key": REDACTED}
    assert manifest["config"]["storage"]["endpoint"] == f"http://{REDACTED}:{REDACTED}@minio:9000"
    assert manifest["config"]["inference"]["api_key_var"] == "OPENAI_API_KEY"
    assert manifest["config"]["sampling"] == {"max_tokens": 512}
    assert manifest["config"]["model"] == {"tokenizer": "Qwen/Qwen3-0.6B"}
    assert manifest["command"] == [
        "primeflow",
        "rl",
        "--wandb.api-key",
        REDACTED,
        f"--inference.token={REDACTED}",
        "--trainer.optim.lr",
        "1e-5",
        f"--storage.endpoint=http://{REDACTED}@minio",
    ]


def test_an_existing_manifest_is_kept(memory_store: ObjectStore) -> None:
    write_manifest(memory_store, config={"a": 1}, seeds={}, parent_run=None, command=None)
    with pytest.raises(FileExistsError, match=r"manifest\.json exists"):
        write_manifest(memory_store, config={"a": 2}, seeds={}, parent_run=None, command=None)
    assert read_manifest(memory_store)["config"] == {"a": 1}
    write_manifest(
        memory_store, config={"a": 2}, seeds={}, parent_run=None, command=None, overwrite=True
    )
    assert read_manifest(memory_store)["config"] == {"a": 2}


@pytest.mark.parametrize(
    "name",
    ["api_key", "apiKey", "hf_token", "AWS_SECRET_ACCESS_KEY", "password", "client_secret", "key"],
)
def test_secret_key_names(name: str) -> None:
    assert is_secret_key(name)


@pytest.mark.parametrize(
    "name", ["max_tokens", "tokenizer", "keep_last", "api_key_var", "monkey", "seq_len"]
)
def test_ordinary_key_names(name: str) -> None:
    assert not is_secret_key(name)


@given(st.text(st.sampled_from("abc_-."), max_size=6), st.sampled_from(["password", "secret"]))
def test_names_holding_a_secret_word_are_secret(prefix: str, word: str) -> None:
    assert is_secret_key(f"{prefix}_{word}")


def test_scrub_command_leaves_ordinary_flags() -> None:
    command = ["primeflow", "--max-tokens", "64", "--run.name=x"]
    assert scrub_command(command, secrets=set()) == command
