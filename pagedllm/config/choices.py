"""The names a setting may take: one torch-free table each.

The config validation and the generated CLI choices read these. Implementations that live
behind torch (the attention selector, the quantization methods, the weight loader, the tool-call
parsers, the model registry) keep their own tables keyed by the same names, and
``tests/test_config_choices.py`` fails when the two disagree.
"""

from __future__ import annotations

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
DTYPE_CHOICES = DTYPES + tuple(DTYPE_ALIASES)  # what --dtype / dtype= accept
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# --kv-cache-dtype (aliases as for --dtype): auto keeps K/V in the model's dtype.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPE_CHOICES = KV_CACHE_DTYPES + tuple(a for a, d in DTYPE_ALIASES.items() if d in KV_CACHE_DTYPES)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")  # models/loader.py reads this table
# Checkpoint formats: config.json's quantization_config.quant_method (layers/quantization/checkpoint.py,
# CHECKPOINT_FORMATS): awq and gptq on the int4 kernel, the others converted onto int8 / w8a8 at load.
CHECKPOINT_QUANT_METHODS = ("awq", "gptq", "fp8", "compressed-tensors", "bitsandbytes")
# layers/quantization/ (QUANTIZATION_CONFIGS, then the checkpoint formats)
QUANTIZATION_METHODS = ("int8", "w8a8", "int4", "w4a8", "gguf", *CHECKPOINT_QUANT_METHODS)
# No CUDA kernel (w8a8, w4a8), or not tried on a GPU yet (gguf: a GGUF file on CUDA loads dequantized);
# the others run Triton kernels on CUDA.
CPU_ONLY_QUANTIZATION = ("w8a8", "w4a8", "gguf")
SCHEDULING_POLICIES = ("fcfs", "priority")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # layers/attention/selector.py
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar",)  # structured_output/manager.py
SPECULATIVE_METHODS = ("ngram", "draft_model")  # the proposers in spec_decode/
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # entrypoints/openai/tool_parsers.py
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
USAGE_CONTEXTS = ("llm", "serve")  # offline batches, the OpenAI server
RUNNERS = ("auto", "generate", "pooling")  # what the model runner does with the hidden states
# vLLM's older --task spellings: each names a runner.
TASKS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling"}


def canonical_dtype(dtype: str) -> str:
    """``fp16`` -> ``float16`` etc.; other names unchanged (checked by the caller)."""
    return DTYPE_ALIASES.get(dtype, dtype)
