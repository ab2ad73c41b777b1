"""One line that says why a vLLM server failed to start, read from its log.

vLLM's start-up failures end in long tracebacks from several processes; the user needs the
cause. The known causes are matched first (most specific wins); otherwise the last line that
names an error is returned, so the message is never empty.
"""

from __future__ import annotations

import re
import signal

#: (pattern in the log, what to tell the user). Checked in order.
KNOWN_CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"address already in use|Errno 98", re.IGNORECASE),
        "port already in use",
    ),
    (
        re.compile(
            r"out of memory|OutOfMemoryError|Cannot allocate memory|"
            r"Available memory on node .* is less than|No available memory for the cache blocks|"
            r"larger than the available KV cache memory|insufficient memory",
            re.IGNORECASE,
        ),
        "out of memory",
    ),
    (
        re.compile(
            r"Repo id must|is not a local folder and is not a valid model identifier|"
            r"Invalid repository ID or local directory|No such file or directory|"
            r"does not appear to have a file named config\.json|"
            r"We couldn't connect to 'https://huggingface\.co'",
            re.IGNORECASE,
        ),
        "model not found",
    ),
)
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b:?\s*(.*)")
_MAX_DETAIL = 300


def _detail(line: str) -> str:
    """The log line without vLLM's `(Process pid=N) LEVEL date [file:line]` prefix."""
    line = re.sub(r"^\(\w+ pid=\d+\)\s*", "", line.strip())
    line = re.sub(r"^(ERROR|WARNING|INFO|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*", "", line)
    return line[:_MAX_DETAIL]


def failure_cause(log_text: str, returncode: int | None = None) -> str:
    """The reason a server did not come up, in one line."""
    lines = [line for line in log_text.splitlines() if line.strip()]
    for pattern, cause in KNOWN_CAUSES:
        for line in reversed(lines):
            if pattern.search(line):
                return f"{cause}: {_detail(line)}"
    if returncode == -signal.SIGKILL:
        return "killed by SIGKILL (often the kernel's out-of-memory killer)"
    for line in reversed(lines):
        if _ERROR_LINE.search(line):
            return _detail(line)
    if lines:
        return f"exited with status {returncode}; last log line: {_detail(lines[-1])}"
    return f"exited with status {returncode} and wrote no log"
