"""The control plane (scheduler, KV-cache bookkeeping, requests, configs) imports no torch.

The engine core runs these modules in a process that should not pay for (or depend on) torch,
and they are unit-tested without a model. Checked in a fresh interpreter where importing torch
or numpy fails.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

TORCH_FREE_MODULES = [
    "pagedllm.core.scheduler",
    "pagedllm.core.request_queue",
    "pagedllm.core.sched_output",
    "pagedllm.core.step_plan",
    "pagedllm.core.step_result",
    "pagedllm.spec_decode.adaptive",
    "pagedllm.kv_cache.manager",
    "pagedllm.request",
    "pagedllm.sampling_params",
    "pagedllm.config",
    "pagedllm.config.choices",
    "pagedllm.config.options",
    "pagedllm.config.model",
    "pagedllm.config.cache",
    "pagedllm.config.scheduler",
    "pagedllm.config.parallel",
    "pagedllm.config.device",
    "pagedllm.config.speculative",
    "pagedllm.config.structured_outputs",
    "pagedllm.config.lora",
    "pagedllm.lora.request",
    "pagedllm.lora.peft_files",
    "pagedllm.config.frontend",
    "pagedllm.config.engine",
    "pagedllm.envs",
    "pagedllm.cpu_info",
    "pagedllm.model_arch",
    "pagedllm.hf_config",
    "pagedllm.gguf_config",
    "pagedllm.gguf_metadata",
    "pagedllm.structured_output.backend",
    "pagedllm.structured_output.compiler",
    "pagedllm.structured_output.request",
    "pagedllm.structured_output.manager",
]
BLOCKED = ["torch", "numpy"]


def test_control_plane_imports_without_torch_or_numpy() -> None:
    script = textwrap.dedent(f"""
        import importlib, sys
        for name in {BLOCKED!r}:
            sys.modules[name] = None  # any `import {{name}}` now raises ImportError
        for module in {TORCH_FREE_MODULES!r}:
            importlib.import_module(module)
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r}
                        and sys.modules[m] is not None)
        assert not leaked, leaked
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
