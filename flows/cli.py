"""The `primeflow` command: one subcommand per stage or pool, all sharing one config.

Exit status: 0 done, 1 the work failed, 2 bad config or usage (one line on stderr, no
traceback).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from importlib.metadata import version

from engine.config import ConfigError, PrimeflowConfig, load_config
from engine.preflight import STAGES, preflight
from flows.deploy import DeployError
from flows.server import ServerError

EXIT_FAILED = 1
EXIT_USAGE = 2


ConfigRunner = Callable[[PrimeflowConfig, list[str]], int]
PlainRunner = Callable[[list[str], bool], int]


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help and what it runs.

    Config commands get the resolved config (`--dry-run` is handled for them: it prints the
    config); plain commands parse their own arguments and are told whether this is a dry run.
    """

    help: str
    run: ConfigRunner | None = None
    run_plain: PlainRunner | None = None


def _flow_runner(name: str) -> ConfigRunner:
    """Run flow `name` of `flows` against the local Prefect server (or PREFECT_API_URL)."""

    def run(config: PrimeflowConfig, argv: list[str]) -> int:
        from flows import server, summary

        api_url = server.ensure_api_url()
        print(f"Prefect UI: {api_url.removesuffix('/api')}", flush=True)
        from flows.evaluate import evaluate
        from flows.pipeline import post_train, rl, sft
        from tasks.results import result_storage

        flow = {"post-train": post_train, "sft": sft, "rl": rl, "evaluate": evaluate}[name]
        # Results (small dataclasses, `engine.results`) persist as JSON beside the runs;
        # nothing is pickled to storage.
        flow = flow.with_options(
            result_storage=result_storage(config.storage),
            result_serializer="json",
            persist_result=True,
        )
        try:
            state = flow(config=config, return_state=True)
            if state.is_cancelling() or state.is_cancelled():
                print(f"primeflow: the {name} flow run was cancelled", file=sys.stderr)
                return EXIT_FAILED
            result = state.result()
        except Exception as exc:
            print(f"primeflow: the {name} flow failed: {exc}", file=sys.stderr)
            return EXIT_FAILED
        ui_url = f"{api_url.removesuffix('/api')}/runs/flow-run/{state.state_details.flow_run_id}"
        if name == "post-train":
            print(
                summary.render(
                    result,
                    k=config.eval.rollouts_per_example,
                    temperature=config.eval.sampling.temperature,
                    ui_url=ui_url,
                )
            )
        else:
            print(json.dumps(asdict(result), indent=2, default=str))
            print(f"Prefect: {ui_url}")
        return 0

    return run


def _inference(config: PrimeflowConfig, argv: list[str]) -> int:
    from engine.inference.serve import serve_forever

    return serve_forever(config)


def _trainer(config: PrimeflowConfig, argv: list[str]) -> int:
    from engine.trainer.pool import run_trainer

    return run_trainer(config, "rl")


def _reproduce(argv: list[str], dry_run: bool) -> int:
    from flows.reproduce import main as reproduce_main

    def run_command(name: str, config: PrimeflowConfig) -> int:
        runner = COMMANDS[name].run
        assert runner is not None
        return runner(config, [])

    return reproduce_main(argv, dry_run, run_command)


def _deploy(argv: list[str], dry_run: bool) -> int:
    from flows.deploy import main as deploy_main

    return deploy_main(argv, dry_run)


def _pools(argv: list[str], dry_run: bool) -> int:
    """`pools up @ config.toml ...` (foreground), `pools down --name N`, `pools status --name N`."""
    from engine.tenancy import supervisor

    if argv[:1] == ["up"]:
        return _pools_up(argv[1:], dry_run)
    parser = argparse.ArgumentParser(prog="primeflow pools", description=_pools.__doc__)
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--name", required=True, help="the shared pools' pools.name")
    args = parser.parse_args(argv)
    if args.action == "status":
        print(json.dumps(supervisor.status_of(args.name), indent=2, default=str))
        return 0
    killed = supervisor.stop_running(args.name)
    if killed is None:
        print(f"no shared pools named {args.name!r} are running")
    else:
        print(f"shared pools {args.name!r} stopped" + (f" (killed {killed})" if killed else ""))
    return 0


def _pools_up(argv: list[str], dry_run: bool) -> int:
    """Run the `pools` flow in the foreground until Ctrl-C, SIGTERM or `pools down`."""
    from flows import server

    config = load_config(argv, prog="primeflow pools up")
    check_machine(config, (), dry_run=dry_run)  # a missing base model: one line, before Prefect
    if dry_run:
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    api_url = server.ensure_api_url()
    print(f"Prefect UI: {api_url.removesuffix('/api')}", flush=True)
    from flows.pools import shared_pools  # Prefect after ensure_api_url: no ephemeral server

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        shared_pools(config=config)
    except KeyboardInterrupt:
        print(f"shared pools {config.pools.name!r} stopped")
    except Exception as exc:
        print(f"primeflow pools up: the pools flow failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _server(argv: list[str], dry_run: bool) -> int:
    from flows import server

    parser = argparse.ArgumentParser(prog="primeflow server", description=server.__doc__)
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("--host", default=server.DEFAULT_HOST, help="bind address (loopback)")
    parser.add_argument("--port", type=int, default=server.DEFAULT_PORT)
    args = parser.parse_args(argv)
    home = server.prefect_home()
    if dry_run:
        plan = {"action": args.action, "prefect_home": str(home), "host": args.host}
        print(json.dumps(plan | {"port": args.port}, indent=2))
        return 0
    if args.action == "start":
        state = server.start(home, host=args.host, port=args.port)
        print(f"Prefect server running: UI {state.ui_url}  API {state.api_url}  (home {home})")
    elif args.action == "stop":
        print("stopped" if server.stop(home) else "no server was running for " + str(home))
    else:
        print(json.dumps(server.status(home), indent=2))
    return 0


#: The stages each command runs (what preflight checks for it).
COMMAND_STAGES = {"pipeline": STAGES, "sft": ("sft",), "rl": ("rl",), "eval": ("eval",)}


def check_machine(config: PrimeflowConfig, stages: Collection[str], *, dry_run: bool) -> None:
    """`ConfigError` (one line) for what this machine lacks for `stages`: found before any pool
    starts (a dry run needs neither the shared pools it names up nor the model hub)."""
    problems = preflight(config, stages, dry_run=dry_run)
    if problems:
        raise ConfigError("; ".join(problems))


COMMANDS: dict[str, Command] = {
    "pipeline": Command(
        "SFT warm-up → async RL → evaluation (the main job)", run=_flow_runner("post-train")
    ),
    "sft": Command("the SFT warm-up stage alone", run=_flow_runner("sft")),
    "rl": Command("the async RL stage alone", run=_flow_runner("rl")),
    "eval": Command(
        "evaluate a checkpoint (eval.checkpoint_step; default the newest) on eval splits",
        run=_flow_runner("evaluate"),
    ),
    "inference": Command("run an inference pool in the foreground", run=_inference),
    "trainer": Command("run the RL trainer pool in the foreground", run=_trainer),
    "pools": Command(
        "up | down | status shared pools that train many LoRA runs at once", run_plain=_pools
    ),
    "server": Command("start | stop | status the local Prefect server", run_plain=_server),
    "deploy": Command("create the work pool and the deployments", run_plain=_deploy),
    "reproduce": Command("re-run a run from its manifest URI", run_plain=_reproduce),
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
        if command.run_plain is not None:
            return command.run_plain(rest, dry_run)
        assert command.run is not None
        config = load_config(rest, prog=f"primeflow {name}")
        check_machine(config, COMMAND_STAGES.get(name, ()), dry_run=dry_run)
        if dry_run:
            print(json.dumps(config.model_dump(mode="json"), indent=2))
            return 0
        return command.run(config, rest)
    except ConfigError as exc:
        print(f"primeflow {name}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ServerError, DeployError) as exc:
        print(f"primeflow {name}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
