"""What a client needs to know about one server of the pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Endpoint:
    """One server: where it listens, the model name it serves, and the policy it serves now.

    `policy_version` is updated by the pool during a reload, before the server resumes
    generation, so a request stamped with it never ran on an older policy than the stamp says.
    """

    index: int
    base_url: str
    model: str
    policy_version: int = 0
