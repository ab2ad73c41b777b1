"""Run vLLM's OpenAI server so that it dies with the process that started it.

`python -m engine.inference.launch <fd> <vllm api_server args...>`

The pool keeps the write end of a pipe and hands the read end (`fd`) to this process. A thread
here blocks reading it; the read returns only when every write end is closed, which the kernel
does when the pool's process exits for any reason, SIGKILL included. The thread then ends this
process group (this process is its leader: the pool starts it with `start_new_session`), which
takes vLLM's engine and worker processes with it. `PR_SET_PDEATHSIG` would not do: it fires when
the *thread* that forked exits, and Prefect runs tasks in short-lived worker threads.

With `VLLM_CPU_OMP_THREADS_BIND` set to a core list (`inference.cpu_cores`), the whole server
(API process, engine core, worker) is bound to those cores, not only vLLM's OpenMP threads:
the trainer's cores then stay free of every vLLM process.

On a CPU build the engine-core process is forked from the API process, not spawned
(`fork_cpu_engine`): a spawned one imports vLLM again, ~6 of a server's ~15 s start on 2 cores.
"""

from __future__ import annotations

import os
import runpy
import shutil
import signal
import sys
import threading
import time

from engine.placement import bind_to_cores

VLLM_SERVER = "vllm.entrypoints.openai.api_server"
#: The flag for several API-server processes in front of one engine, which only `vllm serve`
#: honours (the server module above always runs one).
API_SERVER_COUNT = "--api-server-count"
#: A folder the pool made for this server alone and handed to vLLM for its ZMQ sockets (as
#: `VLLM_RPC_BASE_PATH` too); a variable of our own, so that only that folder is removed here.
RPC_DIR_ENV = "PRIMEFLOW_VLLM_RPC_DIR"
#: Time vLLM gets to shut down cleanly (free shared memory, join workers) before SIGKILL.
GRACE_S = 5.0


def end_group_when_closed(fd: int, grace_s: float = GRACE_S) -> None:
    """Block until the pipe's writers are gone, then SIGTERM and later SIGKILL our group.

    The pool that would have removed the server's socket folder is gone, so it is removed here."""
    while os.read(fd, 1):
        pass
    if RPC_DIR_ENV in os.environ:
        shutil.rmtree(os.environ[RPC_DIR_ENV], ignore_errors=True)
    group = os.getpgrp()
    os.killpg(group, signal.SIGTERM)
    time.sleep(grace_s)
    os.killpg(group, signal.SIGKILL)


def main(argv: list[str]) -> None:
    """Start the watchdog thread, then run vLLM's server module as `__main__` in this process."""
    if len(argv) < 2 or not argv[1].isdigit():
        raise SystemExit("usage: python -m engine.inference.launch <fd> <vllm args...>")
    fd = int(argv[1])
    cores = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if cores not in ("auto", "nobind"):
        bind_to_cores(cores, "inference.cpu_cores")
    threading.Thread(target=end_group_when_closed, args=(fd,), daemon=True).start()
    if "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:  # a method the user set is kept
        fork_cpu_engine()
    args = argv[2:]
    if any(arg.split("=")[0] == API_SERVER_COUNT for arg in args):
        serve(args)
    else:
        sys.argv = [VLLM_SERVER, *args]
        runpy.run_module(VLLM_SERVER, run_name="__main__", alter_sys=True)


def fork_cpu_engine() -> None:
    """Have a CPU build start its engine-core process with fork, which inherits the vLLM this
    process has imported, instead of spawn, which imports it again.

    vLLM's CPU platform sets spawn while it checks the config, out of general caution (no CPU
    reason is given; vLLM used as a library forks its engine core by default). Fork is unsafe
    only after CUDA is initialised, which a CPU build never does, so the method is set back to
    fork once that check has run, just before the engine core starts. GPU builds are untouched.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    check = platform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_then_fork(cls: type, vllm_config: object) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    platform.check_and_update_config = classmethod(check_then_fork)  # type: ignore[method-assign, assignment]


def serve(args: list[str]) -> None:
    """`vllm serve ARGS`, without vLLM's console entry: that one reads the installed package's
    version under the name `vllm`, which the CPU build (`vllm-cpu`) does not have."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()  # type: ignore[no-untyped-call]  # vLLM leaves it unannotated
    command = ServeSubcommand()
    top = FlexibleArgumentParser(prog="vllm")  # type: ignore[no-untyped-call]  # likewise
    parser = command.subparser_init(top.add_subparsers())
    parsed = parser.parse_args(args)
    command.validate(parsed)
    command.cmd(parsed)


if __name__ == "__main__":
    main(sys.argv)
