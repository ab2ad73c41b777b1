"""A verifiers v1 taskset whose tasks need a container: primeflow must refuse it."""

from __future__ import annotations

import verifiers.v1 as vf


class BoxedTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    NEEDS_CONTAINER = True


class BoxedTaskset(vf.Taskset[BoxedTask, vf.TasksetConfig]):
    def load(self):
        yield BoxedTask(vf.TaskData(idx=0, prompt="ls /"), self.config.task)


__all__ = ["BoxedTaskset"]
