"""`primeflow reproduce <manifest-uri>`: run a recorded run again, from its manifest alone.

A run's `manifest.json` holds its resolved config with every secret scrubbed, the command that
started it, the code revision and the package versions. Reproducing rebuilds the config from it,
gives the new run its own name (`<old>-repro-<n>`, or `--run.name`) so it never resumes or
overwrites the original, records the original as its parent, warns about what differs between
then and now (code, packages), and runs the same flow.

Scrubbed secrets cannot come back, and need not: the only one the config holds is the inference
pool's API key, which is generated afresh when unset.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any

from engine.config import ConfigError, PrimeflowConfig, with_overrides
from engine.config.run import StorageConfig
from engine.run import store_at
from storage.errors import ObjectNotFoundError, StorageError
from storage.layout import RunLayout
from storage.manifest import (
    REDACTED,
    code_revision,
    is_secret_key,
    package_versions,
    read_manifest,
)

#: The flows a manifest's `command` can name, and the `primeflow` command that runs each.
FLOW_COMMANDS = {"post-train": "pipeline", "sft": "sft", "rl": "rl"}
MAX_REPRODUCTIONS = 1000


def run_root(uri: str) -> str:
    """The run root of `uri`, which names either the manifest or the run root itself."""
    uri = uri.rstrip("/")
    suffix = f"/{RunLayout.MANIFEST}"
    return uri.removesuffix(suffix) if uri.endswith(suffix) else uri


def unscrub(value: Any) -> Any:
    """The recorded config with each scrubbed secret unset, so the run makes or reads its own."""
    if isinstance(value, Mapping):
        return {
            key: None if is_secret_key(key) and item == REDACTED else unscrub(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [unscrub(item) for item in value]
    return value


def scrubbed_strings(value: Any, path: str = "") -> list[str]:
    """Dotted keys whose values had an environment secret cut out of them (not restorable)."""
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in scrubbed_strings(v, f"{path}{k}.")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in scrubbed_strings(v, f"{path}{i}.")]
    return [path.rstrip(".")] if isinstance(value, str) and REDACTED in value else []


def next_run_name(config: PrimeflowConfig, old: str) -> str:
    """`<old>-repro-<n>` with the smallest n whose run root holds no manifest yet."""
    from engine.run import run_store

    for n in range(1, MAX_REPRODUCTIONS + 1):
        name = f"{old}-repro-{n}"
        candidate = with_overrides(config, {"run.name": name})
        if not run_store(candidate).exists(RunLayout.MANIFEST):
            return name
    raise ConfigError(f"{old} has been reproduced {MAX_REPRODUCTIONS} times; pass --run.name")


def recorded_config(manifest: Mapping[str, Any]) -> PrimeflowConfig:
    """The config a run recorded in its manifest, each scrubbed secret unset."""
    return PrimeflowConfig.model_validate(unscrub(manifest["config"]))


def rebuild_config(
    manifest: Mapping[str, Any],
    run_name: str | None,
    overrides: Mapping[str, Any] | None = None,
) -> PrimeflowConfig:
    """The recorded config under a new run name, with the recorded run as its parent, and
    `overrides` (dotted keys) applied."""
    recorded = manifest["config"]
    for path in scrubbed_strings(unscrub(recorded)):
        print(
            f"primeflow reproduce: warning: {path} held a secret that was scrubbed from the "
            "manifest; set it again if the run needs it",
            file=sys.stderr,
        )
    config = with_overrides(
        recorded_config(manifest), {"run.parent": manifest["run_uri"], **(overrides or {})}
    )
    name = run_name or next_run_name(config, config.run.name)
    return with_overrides(config, {"run.name": name})


def differences(manifest: Mapping[str, Any]) -> list[str]:
    """What differs between the recorded run's code and packages and this installation's."""
    found = []
    then, now = manifest.get("code") or {}, code_revision() or {}
    if then.get("commit") != now.get("commit"):
        found.append(f"code revision {then.get('commit')} then, {now.get('commit')} now")
    elif then.get("dirty") or now.get("dirty"):
        found.append("the checkout had local edits then or has them now")
    recorded, installed = manifest.get("packages") or {}, package_versions()
    for name in sorted(set(recorded) | set(installed)):
        if recorded.get(name) != installed.get(name):
            was, now_version = recorded.get(name, "absent"), installed.get(name, "absent")
            found.append(f"{name} {was} then, {now_version} now")
    return found


def flow_of(manifest: Mapping[str, Any]) -> str:
    """The flow that started the recorded run (`prefect <flow>`); post-train otherwise."""
    command = manifest.get("command") or []
    name = command[1] if len(command) > 1 and command[0] == "prefect" else "post-train"
    return name if name in FLOW_COMMANDS else "post-train"


#: Runs a `primeflow` command on a config (the command line's own runner, passed in by it).
CommandRunner = Callable[[str, PrimeflowConfig], int]


def main(argv: list[str], dry_run: bool, run_command: CommandRunner | None = None) -> int:
    """`primeflow reproduce`; `run_command` runs the recorded flow's command (unused by a dry
    run)."""
    parser = argparse.ArgumentParser(prog="primeflow reproduce", description=__doc__)
    parser.add_argument("manifest_uri", help="<run>/manifest.json or the run root (any store)")
    parser.add_argument("--run.name", dest="run_name", help="default: <old>-repro-<n>")
    parser.add_argument(
        "--storage.endpoint-url",
        dest="endpoint_url",
        help="the S3-compatible endpoint of the store the run is in (AWS_ENDPOINT_URL if unset); "
        "the reproduction uses it too",
    )
    parser.add_argument("--storage.region", dest="region", help="its region, likewise")
    args = parser.parse_args(argv)
    root = run_root(args.manifest_uri)
    given = {"endpoint_url": args.endpoint_url, "region": args.region}
    given = {key: value for key, value in given.items() if value is not None}
    try:
        manifest = read_manifest(store_at(root, StorageConfig(uri=root, **given)))
    except ObjectNotFoundError:
        print(f"primeflow reproduce: no manifest at {root}/{RunLayout.MANIFEST}", file=sys.stderr)
        return 1
    except (StorageError, ValueError) as exc:
        print(f"primeflow reproduce: cannot read {root}: {exc}", file=sys.stderr)
        return 1
    config = rebuild_config(
        manifest, args.run_name, {f"storage.{key}": value for key, value in given.items()}
    )
    for difference in differences(manifest):
        print(f"primeflow reproduce: warning: {difference}", file=sys.stderr)
    if dry_run:
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    assert run_command is not None, "a reproduction that runs needs the command runner"
    print(f"reproducing {manifest['run_uri']} as run {config.run.name}", flush=True)
    return run_command(FLOW_COMMANDS[flow_of(manifest)], config)
