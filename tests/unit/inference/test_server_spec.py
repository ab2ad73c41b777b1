"""What each server is started with: placement, memory, the key kept out of the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import PrimeflowConfig
from engine.config.inference import InferenceConfig
from engine.inference.pool import InferencePool
from engine.inference.server import ServerSpec


def spec(**overrides: object) -> ServerSpec:
    values: dict[str, object] = {
        "index": 0,
        "model": "/models/m",
        "served_name": "primeflow/tiny-qwen3",
        "host": "127.0.0.1",
        "port": 8001,
        "api_key": "k3y",
        "max_model_len": 2048,
        "dtype": "auto",
        "seed": 7,
        "logprobs_mode": "processed_logprobs",
        "device": "cpu",
        "kv_cache_gb": None,
        "gpu_memory_utilization": 0.9,
        "tensor_parallel_size": 1,
    }
    return ServerSpec(**{**values, **overrides})  # type: ignore[arg-type]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_cpu_server_arguments() -> None:
    argv = spec().argv()
    assert flag(argv, "--model") == "/models/m"
    assert flag(argv, "--served-model-name") == "primeflow/tiny-qwen3"
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "8001"
    assert flag(argv, "--max-model-len") == "2048" and flag(argv, "--seed") == "7"
    assert flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert flag(argv, "--kv-cache-memory-bytes") == str(2**30)  # 1 GiB, not a share of RAM
    assert flag(argv, "--worker-extension-cls").endswith("WeightReloadExtension")
    assert flag(argv, "--middleware").endswith("ControlRouteGuard")
    assert "--tensor-parallel-size" not in argv and "--gpu-memory-utilization" not in argv
    assert "k3y" not in argv  # other local users can read command lines


def test_gpu_server_arguments_and_devices() -> None:
    server = spec(device="cuda", tensor_parallel_size=2, gpu_ids=(2, 3), extra_args=("-O3",))
    argv = server.argv()
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert flag(argv, "--gpu-memory-utilization") == "0.9"
    assert "--kv-cache-memory-bytes" not in argv
    assert argv[-1] == "-O3"
    env = server.env({"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["VLLM_API_KEY"] == "k3y" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PATH"] == "/bin"


def test_cpu_core_binding() -> None:
    assert spec(cpu_cores="0-3").env({})["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in spec().env({})


def test_a_cpu_server_runs_its_worker_in_the_engine_process_unless_told_otherwise() -> None:
    assert spec().env({})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert (
        spec().env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    )
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in spec(device="cuda").env({})


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8001"),
        ("0.0.0.0", "http://127.0.0.1:8001"),
        ("::", "http://[::1]:8001"),
        ("::1", "http://[::1]:8001"),
    ],
)
def test_clients_reach_servers_on_loopback(host: str, url: str) -> None:
    assert spec(host=host).base_url == url


def test_pool_places_servers_on_their_own_gpus(tmp_path: Path) -> None:
    config = InferenceConfig(
        model="/models/m", num_servers=2, tensor_parallel_size=2, device="cuda", base_port=9000
    )
    pool = InferencePool(config, log_dir=tmp_path)
    first, second = pool.fleet.spec(0, "/models/m"), pool.fleet.spec(1, "/models/m")
    assert (first.gpu_ids, second.gpu_ids) == ((0, 1), (2, 3))
    assert (first.port, second.port) == (9000, 9001)
    explicit = config.model_copy(update={"gpu_ids": [4, 5, 6, 7]})
    assert InferencePool(explicit, log_dir=tmp_path).fleet.spec(1, "/m").gpu_ids == (6, 7)


def test_pool_generates_a_key_unless_one_is_set(tmp_path: Path) -> None:
    generated = InferencePool(InferenceConfig(model="m"), log_dir=tmp_path).api_key
    assert len(generated) >= 32
    assert generated != InferencePool(InferenceConfig(model="m"), log_dir=tmp_path).api_key
    given = InferenceConfig(model="m", api_key="mine")  # type: ignore[arg-type]
    assert InferencePool(given, log_dir=tmp_path).api_key == "mine"


def test_placement_lists_must_fit_the_pool() -> None:
    with pytest.raises(ValueError, match="gpu_ids lists 3 devices"):
        InferenceConfig(num_servers=2, gpu_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="one per server"):
        InferenceConfig(num_servers=2, cpu_cores=["0-3"])


def test_servers_share_a_gpu_only_where_their_devices_overlap() -> None:
    first = spec(device="cuda", gpu_ids=(0, 1))
    assert first.shares_gpu_with(spec(device="cuda", gpu_ids=(1, 2)))
    assert not first.shares_gpu_with(spec(device="cuda", gpu_ids=(2, 3)))
    assert not spec().shares_gpu_with(spec())  # CPU servers start together


def test_api_servers_only_when_asked_and_never_beside_adapters() -> None:
    assert "--api-server-count" not in spec().argv()  # one: vLLM's server module, as always
    assert flag(spec(api_servers=4).argv(), "--api-server-count") == "4"
    with pytest.raises(ValueError, match="api_servers = 2 with LoRA serving"):
        InferenceConfig(model="m", api_servers=2, lora={"max_rank": 8})


def test_a_lora_run_refuses_several_api_servers() -> None:
    """`inference.lora` is filled from `trainer.lora` after the inference section is checked."""
    with pytest.raises(ValueError, match="api_servers = 2 with LoRA serving"):
        PrimeflowConfig.model_validate(
            {
                "model": {"name": "m"},
                "trainer": {"lora": {"rank": 8}},
                "inference": {"api_servers": 2},
            }
        )
