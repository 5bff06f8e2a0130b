"""EngineArgs -> EngineConfig: impossible settings fail at start-up with a message that says what
to change, and the resulting config is frozen. No model forward is run."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.models.registry import supported_architectures


def _config(model_dir, **kwargs) -> EngineConfig:
    kwargs.setdefault("device", "cpu")
    return EngineArgs(model=str(model_dir), **kwargs).create_engine_config()


def test_defaults_resolve(llama_model_dir):
    config = _config(llama_model_dir)
    mc = config.model_config
    assert mc.max_model_len == mc.arch.max_position_embeddings == 512
    assert mc.dtype == "float32"  # dtype auto on CPU
    assert (config.device, config.scheduler_config.policy, mc.load_format) == ("cpu", "fcfs", "auto")
    assert config.scheduler_config.max_model_len == mc.max_model_len
    assert config.cache_config.block_size == 16
    assert config.blocks_per_max_len_request() == 32


def test_step_budget_default_depends_on_the_workload(llama_model_dir):
    def budget(usage_context, **kwargs):
        args = EngineArgs(model=str(llama_model_dir), device="cpu", **kwargs)
        return args.create_engine_config(usage_context).scheduler_config.max_num_batched_tokens

    assert budget("llm") == 2048  # offline batches: throughput
    assert budget("serve") == 128  # a CPU server: short chunks keep every stream's tokens flowing
    assert budget("serve", max_num_batched_tokens=1024) == 1024  # an explicit budget always wins
    with pytest.raises(ValueError, match="usage_context must be one of"):
        EngineArgs(model=str(llama_model_dir), device="cpu").create_engine_config("server")


@pytest.mark.parametrize(
    "dtype, resolved",
    [
        ("auto", "float32"),
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("half", "float16"),
        ("bf16", "bfloat16"),
        ("float", "float32"),
        ("fp16", "float16"),
        ("fp32", "float32"),
        ("float16", "float16"),
    ],
)
def test_dtype(llama_model_dir, dtype, resolved):
    assert _config(llama_model_dir, dtype=dtype).model_config.dtype == resolved


def test_max_model_len_above_max_position_embeddings(llama_model_dir):
    assert _config(llama_model_dir, max_model_len=512).model_config.max_model_len == 512
    with pytest.raises(ValueError, match=r"max_model_len=513.*max_position_embeddings=512"):
        _config(llama_model_dir, max_model_len=513)


def test_kv_cache_memory_too_small(llama_model_dir):
    # Tiny llama: 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes x 16 tokens = 8 KiB a block;
    # max_model_len=512 needs 32 blocks plus the null block.
    block = 8192 / (1 << 30)
    assert _config(llama_model_dir, max_model_len=512, kv_cache_memory=33 * block).kv_bytes_per_block() == 8192
    with pytest.raises(ValueError, match="raise kv_cache_memory or lower max_model_len") as err:
        _config(llama_model_dir, max_model_len=512, kv_cache_memory=32 * block)
    assert "holds 32 blocks" in str(err.value) and "needs 33 blocks" in str(err.value)
    # Lowering max_model_len, as the message suggests, makes the same budget enough.
    assert _config(llama_model_dir, max_model_len=496, kv_cache_memory=32 * block)


def test_kv_budget_check_agrees_with_the_engine(llama_model_dir):
    """What the config accepts, the engine can start with (the worker also counts the null block)."""
    from pagedllm import LLM

    llm = LLM(str(llama_model_dir), device="cpu", max_model_len=512, kv_cache_memory=33 * 8192 / (1 << 30))
    assert llm.llm_engine.engine_core.num_blocks == 33
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize(
    "kv_cache_dtype,dtype,resolved",
    [
        ("auto", "float32", "float32"),
        ("bf16", "float32", "bfloat16"),
        ("half", "float32", "float16"),
        ("auto", "bfloat16", "bfloat16"),
        ("bfloat16", "bfloat16", "bfloat16"),
    ],
)
def test_kv_cache_dtype(llama_model_dir, kv_cache_dtype, dtype, resolved):
    """A 16-bit cache under a float32 model halves a block's bytes: twice the blocks in one budget."""
    config = _config(llama_model_dir, kv_cache_dtype=kv_cache_dtype, dtype=dtype, max_model_len=512)
    assert config.cache_config.kv_cache_dtype == resolved
    # Tiny llama: 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 16 tokens, times the cache's bytes.
    assert config.kv_bytes_per_block() == 2 * 2 * 16 * 2 * 16 * (4 if resolved == "float32" else 2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, float32, bfloat16, float16"),
        ({"kv_cache_dtype": "float16", "dtype": "bfloat16"}, "supported for float32 models only"),
        ({"kv_cache_dtype": "float32", "dtype": "float16"}, "supported for float32 models only"),
    ],
)
def test_kv_cache_dtype_errors(llama_model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _config(llama_model_dir, **kwargs)


def test_kv_cache_dtype_on_cuda_is_the_models():
    from pagedllm.config.cache import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("auto", "bfloat16", "cuda") == "bfloat16"
    with pytest.raises(ValueError, match="on cuda the KV cache holds the model's dtype"):
        resolve_kv_cache_dtype("float16", "float32", "cuda")


def test_unknown_architecture(llama_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(llama_model_dir, model_dir)
    path = model_dir / "config.json"
    hf = json.loads(path.read_text())
    hf["architectures"] = ["FancyNewForCausalLM"]
    path.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as err:
        _config(model_dir)
    assert "supported" in str(err.value)
    assert "LlamaForCausalLM" in supported_architectures()
    assert all(name in str(err.value) for name in supported_architectures())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dtype": "float8"}, "dtype must be one of"),
        ({"load_format": "pt"}, "load_format must be one of"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of"),
        ({"device": "tpu"}, "device must be"),
        ({"block_size": 12}, "block_size must be a multiple of 8"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"max_model_len": 0}, "max_model_len must be a positive integer"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens must be a positive integer"),
        ({"kv_cache_memory": 0}, "kv_cache_memory must be > 0"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be an integer >= 0"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"tensor_parallel_size": 3}, r"tensor_parallel_size=3 cannot split .* valid sizes: \[1, 2, 4\]"),
        ({"pipeline_parallel_size": 3}, "pipeline_parallel_size=3 exceeds the model.s 2 layers"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be a positive integer"),
        ({"attention_backend": "flash"}, "attention_backend must be one of auto, torch, triton"),
        ({"quantization": "int3"}, "quantization must be None"),
        ({"structured_outputs_backend": "outlines"}, "structured_outputs_backend must be one of"),
        ({"max_logprobs": -2}, r"max_logprobs must be -1 \(no cap\) or an integer >= 0"),
    ],
)
def test_bad_values(llama_model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _config(llama_model_dir, **kwargs)


def test_missing_model_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="is not a local directory") as err:
        _config(missing)
    assert str(missing) in str(err.value)


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        _config(tmp_path)


def test_configs_are_frozen(llama_model_dir):
    config = _config(llama_model_dir)
    for obj, name in [
        (config, "device"),
        (config.model_config, "max_model_len"),
        (config.cache_config, "block_size"),
        (config.scheduler_config, "max_num_seqs"),
        (config.parallel_config, "tensor_parallel_size"),
    ]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 1)


def test_a_config_without_architectures_takes_its_model_types_causal_lm(llama_model_dir, tmp_path):
    """A GGUF-loaded model's config saved as it is has no "architectures": model_type names the class."""
    model_dir = tmp_path / "model"
    shutil.copytree(llama_model_dir, model_dir)
    path = model_dir / "config.json"
    hf = json.loads(path.read_text())
    del hf["architectures"]
    path.write_text(json.dumps(hf))
    assert _config(model_dir).model_config.arch.architecture == "LlamaForCausalLM"
    path.write_text(json.dumps({**hf, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"no 'architectures' entry .* add e.g. \"architectures\""):
        _config(model_dir)


def test_config_is_torch_free_to_build(llama_model_dir):
    import subprocess
    import sys

    code = (
        "import sys; from pagedllm.config import EngineArgs; "
        f"EngineArgs(model={str(llama_model_dir)!r}, device='cpu').create_engine_config(); "
        "assert 'torch' not in sys.modules, 'config imported torch'; "
        "assert not [m for m in sys.modules if m.startswith('pagedllm.demo')], 'config imported the demo'; "
        "assert not {'transformers', 'tokenizers'} & set(sys.modules), 'config imported transformers'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_model_is_an_error_here_the_entrypoints_fill_in_the_demo():
    """Config creation never builds or trains the demo model (LLM() and `serve` do, before it)."""
    with pytest.raises(ValueError, match="no model given"):
        EngineArgs(device="cpu").create_engine_config()


# ------------------------------------------------------------------ the CPU KV pool: one default, one check
def test_cpu_kv_pool_default_is_resolved_in_the_config(llama_model_dir):
    from pagedllm.config import DEFAULT_CPU_KV_CACHE_GIB, GiB

    assert _config(llama_model_dir).cache_config.kv_cache_memory_bytes == int(DEFAULT_CPU_KV_CACHE_GIB * GiB)
    assert _config(llama_model_dir, kv_cache_memory=0.5).cache_config.kv_cache_memory_bytes == GiB // 2
    # CUDA sizes its pool from the free memory after profiling: no fixed default there.
    assert _config(llama_model_dir, device="cuda").cache_config.kv_cache_memory_bytes is None


def test_the_default_goes_through_the_one_check_and_the_worker_uses_it(llama_model_dir, monkeypatch):
    from pagedllm import LLM
    from pagedllm.config import cache

    monkeypatch.setattr(cache, "DEFAULT_CPU_KV_CACHE_GIB", 32 * 8192 / (1 << 30))  # 32 blocks: one short
    with pytest.raises(ValueError, match="raise kv_cache_memory or lower max_model_len"):
        _config(llama_model_dir, max_model_len=512)
    monkeypatch.setattr(cache, "DEFAULT_CPU_KV_CACHE_GIB", 40 * 8192 / (1 << 30))
    llm = LLM(str(llama_model_dir), device="cpu", max_model_len=512, max_num_seqs=4)
    assert llm.llm_engine.engine_core.num_blocks == 40  # the worker sized the pool from the resolved value


def test_num_gpu_blocks_override_skips_the_memory_check(llama_model_dir):
    config = _config(llama_model_dir, kv_cache_memory=8192 / (1 << 30), num_gpu_blocks_override=40)
    assert config.cache_config.num_gpu_blocks_override == 40


def test_prompt_lookup_defaults_are_defined_once(llama_model_dir):
    """SpeculativeConfig's defaults are the builder's for {"method": "ngram"} (2..4)."""
    from pagedllm.config import SpeculativeConfig

    built = _config(llama_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    plain = SpeculativeConfig("ngram", 3)
    assert (built.speculative_config.prompt_lookup_min, built.speculative_config.prompt_lookup_max) == (2, 4)
    assert built.speculative_config == plain


def test_max_logprobs_default_cap_and_flag(llama_model_dir):
    """vLLM's default (20) and -1 = no cap (the whole vocabulary); a `serve --max-logprobs` flag."""
    from pagedllm.entrypoints.cli import build_parser

    assert _config(llama_model_dir).model_config.max_logprobs == 20
    assert _config(llama_model_dir, max_logprobs=3).model_config.logprobs_cap == 3
    no_cap = _config(llama_model_dir, max_logprobs=-1).model_config
    assert no_cap.max_logprobs == -1 and no_cap.logprobs_cap == no_cap.arch.vocab_size
    assert build_parser().parse_args(["serve", "--max-logprobs", "7"]).max_logprobs == 7


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"tensor_parallel_size": 2, "enable_lora": True}, "--tensor-parallel-size 1 with --enable-lora"),
        ({"runner": "pooling", "enable_lora": True}, "drop --enable-lora"),
        ({"runner": "pooling", "speculative_config": {"method": "ngram"}}, "drop --speculative-config"),
    ],
)
def test_options_that_do_not_combine_name_what_to_drop(llama_model_dir, kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        EngineArgs(model=str(llama_model_dir), **kwargs).create_engine_config()
