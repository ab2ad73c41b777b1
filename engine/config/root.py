"""The whole system's config, and the shared fields that fill its sections."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from engine.config.base import DEFAULT_MAX_STEPS, DEFAULT_SEQ_LEN, BaseConfig
from engine.config.evaluation import EvalConfig
from engine.config.inference import (
    LORA_RANKS,
    SLOTS_PER_LINEAGE,
    InferenceConfig,
    LoraServingConfig,
)
from engine.config.model import ModelConfig
from engine.config.orchestrator import OrchestratorConfig
from engine.config.pools import SharedPoolsConfig
from engine.config.run import RunConfig, StorageConfig
from engine.config.sft import SftConfig
from engine.config.trainer import TrainerConfig
from engine.config.wandb import WandbConfig
from engine.config.watchdog import WatchdogConfig

#: shared field → the section fields it fills. One value, stated once, reaches every pool.
SHARED_FIELDS: dict[str, tuple[str, ...]] = {
    "model.name": ("trainer.model", "inference.model", "orchestrator.model"),
    "seq_len": ("trainer.seq_len", "orchestrator.seq_len", "inference.max_model_len"),
    "max_steps": ("trainer.max_steps", "orchestrator.max_steps"),
}


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def shared_copies(config: BaseConfig, shared: str) -> list[str]:
    """The section fields of shared field `shared` that hold its value: copies of it, not
    choices of their own (a config read back from its `--dry-run` JSON states them all)."""
    if shared not in SHARED_FIELDS:
        return []
    value = _get(config, shared)
    return [target for target in SHARED_FIELDS[shared] if _get(config, target) == value]


def _fill(obj: Any, dotted: str, value: Any) -> None:
    """Set a field without marking it as set by the user, so a later override of the shared
    field still reaches it."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, leaf, value)
    obj.model_fields_set.discard(leaf)


def _explicit(root: BaseConfig, dotted: str) -> bool:
    """Whether the user (file or flag) set `dotted`, as opposed to a default."""
    obj: Any = root
    *parents, leaf = dotted.split(".")
    for part in parents:
        if part not in obj.model_fields_set:
            return False
        obj = getattr(obj, part)
    return leaf in obj.model_fields_set


class PrimeflowConfig(BaseConfig):
    """Everything one primeflow run needs; every command takes this config."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = ModelConfig()
    storage: StorageConfig = StorageConfig()
    seq_len: Annotated[
        int,
        Field(
            ge=16,
            description="Shared: fills trainer.seq_len, orchestrator.seq_len and "
            "inference.max_model_len.",
        ),
    ] = DEFAULT_SEQ_LEN
    max_steps: Annotated[
        int, Field(ge=1, description="Shared: RL steps for trainer and orchestrator.")
    ] = DEFAULT_MAX_STEPS
    trainer: TrainerConfig = TrainerConfig()
    inference: InferenceConfig = InferenceConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    eval: EvalConfig = EvalConfig()
    sft: SftConfig = SftConfig()
    wandb: WandbConfig = WandbConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    pools: SharedPoolsConfig = SharedPoolsConfig()

    @model_validator(mode="after")
    def _fill_shared_fields(self) -> PrimeflowConfig:
        for shared, targets in SHARED_FIELDS.items():
            value = _get(self, shared)
            stated = _explicit(self, shared)
            for target in targets:
                current = _get(self, target)
                if not _explicit(self, target):
                    _fill(self, target, value)
                elif stated and current != value:
                    raise ValueError(
                        f"{target} = {current!r} conflicts with the shared {shared} = {value!r}; "
                        "set only one of them"
                    )
        return self

    @model_validator(mode="after")
    def _serve_the_adapters_trained(self) -> PrimeflowConfig:
        """A LoRA run's servers load its adapters: their rank and layers must fit."""
        lora = self.trainer.lora
        if lora is None:
            return self
        serving = self.inference.lora
        if serving is None:
            rank = next(r for r in LORA_RANKS if r >= lora.rank)
            loras = SLOTS_PER_LINEAGE * (self.pools.tenants if self.pools.name else 1)
            serving = LoraServingConfig(
                max_rank=rank,
                max_loras=loras,
                max_cpu_loras=2 * loras,
                target_modules=list(lora.target_modules),
            )
            _fill(self, "inference.lora", serving)
        if lora.rank > serving.max_rank:
            raise ValueError(
                f"trainer.lora.rank = {lora.rank} exceeds inference.lora.max_rank = "
                f"{serving.max_rank}: the servers could not load the adapters"
            )
        unserved = sorted(set(lora.target_modules) - set(serving.target_modules))
        if unserved:
            raise ValueError(
                f"trainer.lora.target_modules {unserved} are not in inference.lora.target_modules"
            )
        return self

    @model_validator(mode="after")
    def _adapters_need_one_api_server(self) -> PrimeflowConfig:
        """Checked again here: `inference.lora` may have been filled from `trainer.lora` above."""
        self.inference.check_api_servers()
        return self

    @model_validator(mode="after")
    def _tenants_train_adapters(self) -> PrimeflowConfig:
        """Tenants share one base model in memory: only adapters can differ between them."""
        pools = self.pools
        if pools.name is None:
            return self
        if self.trainer.lora is None:
            raise ValueError(
                f"pools.name = {pools.name!r} shares pools between LoRA runs: set trainer.lora "
                "(a full-weight run gets pools of its own: leave pools.name unset)"
            )
        if self.sft.enabled and self.sft.full_weights:
            raise ValueError(
                f"sft.full_weights = true gives this run a base model of its own, but a "
                f"tenant of pools.name = {pools.name!r} trains its adapter on the pools' model: "
                "warm the base up before the pools start, or leave pools.name unset"
            )
        if pools.heartbeat_s >= pools.lease_s:
            raise ValueError(
                f"pools.heartbeat_s = {pools.heartbeat_s:g} must be shorter than pools.lease_s = "
                f"{pools.lease_s:g}, or a live tenant's lease would lapse"
            )
        return self
