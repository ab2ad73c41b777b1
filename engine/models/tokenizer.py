"""The policy's tokenizer, loaded one way for every process that renders or tokenizes its text.

The orchestrator renders the rollouts' prompts with it, the trainer tokenizes SFT data with it
and ships it in every checkpoint, preflight measures prompts with it. Three loaders once did
this with three sets of arguments: preflight ignored the model's revision, and the trainer's
swallowed the loading error, so SFT failed with "needs a tokenizer" instead of the cause.
`transformers` is imported on the call: the `primeflow` commands that load no model pay for
none of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config.model import ModelConfig
from engine.models.resolve import resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(
    name: str, model: ModelConfig, *, local_only: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer of `name` (a section's copy of `model.name`) at `model`'s revision.

    `local_only`: a hub model only from the local cache, never a lookup. Raises what
    `transformers` raises (OSError, ValueError) when it does not load.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        resolve_model(name),
        revision=model.revision,
        trust_remote_code=model.trust_remote_code,
        local_files_only=local_only,
    )
