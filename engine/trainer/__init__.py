"""The trainer pool: FSDP2 SFT and RL training of Hugging Face causal LMs (docs/training.md).

One concern per module: `packing` and `batching` shape the data, `attention` keeps packed
samples apart, `logprobs` and `loss` hold the math, `schedule` the learning rate, `model` loads
and shards, `checkpoint` saves and resumes, `worker` runs the loop under torchrun and `pool`
launches it. Nothing here imports Prefect.
"""
