"""The environment tests' tokenizer and scripted policy, reused to play misbehaving envs."""

from tests.unit.envs.conftest import generator, hf_tokenizer, policy

__all__ = ["generator", "hf_tokenizer", "policy"]
