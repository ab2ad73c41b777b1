"""A verifiers v1 taskset for tests: repeat a word; rewarded by the task's `@vf.reward`."""

from __future__ import annotations

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    word: str


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def repeated(self, task: EchoData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.word)

    @vf.metric
    async def reply_length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class EchoConfig(vf.TasksetConfig):
    words: list[str] = ["red", "green", "blue"]


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        for index, word in enumerate(self.config.words):
            data = EchoData(idx=index, prompt=f"Repeat: {word}", system_prompt="Echo.", word=word)
            yield EchoTask(data, self.config.task)


__all__ = ["EchoTaskset"]
