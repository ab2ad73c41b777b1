"""What a client needs to know about one server of the pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Endpoint:
    """One server: where it listens, the model name it serves, and the policy it serves now.

    `policy_version` is updated by the pool during a reload, before the server resumes
    generation, so a request stamped with it never ran on an older policy than the stamp says.
    `policy_lineage` is that version's `lineage_id` (the trainer start that published it): a
    resumed trainer publishes its own version *n* after a dead one's, and only this tells their
    samples apart. Empty for the model a server started with and versions without one.
    """

    index: int
    base_url: str
    model: str
    policy_version: int = 0
    policy_lineage: str = ""

    def serve(self, version: int, meta: dict[str, object]) -> None:
        """Stamp requests from now on with `version`, whose commit meta is `meta`."""
        self.policy_version = version
        self.policy_lineage = str(meta.get("lineage_id") or "")
