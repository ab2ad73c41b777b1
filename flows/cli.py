"""The `primeflow` command: one subcommand per stage or pool, all sharing one config.

Exit status: 0 done, 1 the work failed, 2 bad config or usage (one line on stderr, no
traceback), 3 the command's stage is not built yet.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version

from engine.config import ConfigError, PrimeflowConfig, load_config

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_BUILT = 3


class NotBuiltError(Exception):
    """The command exists, its stage does not yet; the message says what is missing."""


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, and what it does with a resolved config."""

    help: str
    run: Callable[[PrimeflowConfig, list[str]], int]
    takes_config: bool = True


def _not_built(what: str, issue: int) -> Callable[[PrimeflowConfig, list[str]], int]:
    def run(config: PrimeflowConfig, argv: list[str]) -> int:
        raise NotBuiltError(f"{what} is not built yet (issue #{issue}); --dry-run works already")

    return run


def _pipeline(config: PrimeflowConfig, argv: list[str]) -> int:
    """Runs as far as the built stages go, then says what is missing."""
    from engine.run import open_run

    run = open_run(config, command=["primeflow", "pipeline", *argv])
    print(f"run root:  {run.store.url()}")
    print(f"manifest:  {run.store.url(run.layout.MANIFEST)}")
    raise NotBuiltError(
        "the pipeline stops after creating the run: still missing are the inference pool (#3), "
        "the trainer pool (#4), the orchestrator and environments (#5), the Prefect flows (#6) "
        "and the reverse-text demo (#7)"
    )


COMMANDS: dict[str, Command] = {
    "pipeline": Command("SFT warm-up → async RL → evaluation (the main job)", _pipeline),
    "sft": Command("the SFT warm-up stage alone", _not_built("the SFT stage", 4)),
    "rl": Command("the async RL stage alone", _not_built("the RL stage", 5)),
    "eval": Command("evaluate a checkpoint on eval splits", _not_built("evaluation", 5)),
    "inference": Command("run an inference pool in the foreground", _not_built("the pool", 3)),
    "trainer": Command("run a trainer pool in the foreground", _not_built("the pool", 4)),
    "server": Command(
        "start | stop | status the local Prefect server",
        _not_built("the Prefect server command", 6),
        takes_config=False,
    ),
    "deploy": Command(
        "create the work pool and the deployments",
        _not_built("deployments", 6),
        takes_config=False,
    ),
    "reproduce": Command(
        "re-run a run from its manifest URI",
        _not_built("reproduce", 6),
        takes_config=False,
    ),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primeflow",
        description="Asynchronous RL post-training for language models, run as Prefect flows.",
        epilog=(
            "Config commands take `@ file.toml` (any number, composed left to right), dotted "
            "overrides such as --trainer.optim.lr 1e-5, and --dry-run to print the resolved "
            "config. `primeflow <command> --help` lists every field."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"primeflow {version('primeflow')}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, add_help=False)
    return parser


def _dry_run_plan(name: str, argv: list[str]) -> dict[str, object]:
    """What a command without a config would do, for --dry-run."""
    return {"command": name, "args": argv}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _top_parser()
    if not args or args[0] not in COMMANDS:
        if args and not args[0].startswith("-"):
            print(
                f"primeflow: unknown command {args[0]!r}; see `primeflow --help`", file=sys.stderr
            )
            return EXIT_USAGE
        parser.parse_args(args)
        parser.print_help()
        return EXIT_USAGE
    name, rest = args[0], args[1:]
    command = COMMANDS[name]
    dry_run = "--dry-run" in rest
    rest = [a for a in rest if a != "--dry-run"]
    try:
        if command.takes_config:
            config = load_config(rest, prog=f"primeflow {name}")
            if dry_run:
                print(json.dumps(config.model_dump(mode="json"), indent=2))
                return 0
            return command.run(config, rest)
        if dry_run:
            print(json.dumps(_dry_run_plan(name, rest), indent=2))
            return 0
        return command.run(PrimeflowConfig(), rest)
    except ConfigError as exc:
        print(f"primeflow {name}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NotBuiltError as exc:
        print(f"primeflow {name}: {exc}", file=sys.stderr)
        return EXIT_NOT_BUILT


if __name__ == "__main__":
    sys.exit(main())
