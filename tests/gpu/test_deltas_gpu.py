"""Policy deltas decoded and applied on the GPU, where a server applies them: bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.unit.storage.test_deltas import check_base_plus_delta

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_base_plus_delta_on_the_gpu_is_the_new_tensor_bit_for_bit(dtype: torch.dtype) -> None:
    check_base_plus_delta(dtype, "cuda")
