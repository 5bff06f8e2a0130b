"""CustomOp dispatch: one implementation chosen on the first call by device and dtype, the CPU
kernels equal to the torch reference, and forcing the reference works."""

import pytest
import torch

from pagedllm.layers import cpu_kernels
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention.backends.torch_sdpa import KVCacheWrite, TorchAttentionBackend
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary import get_rope
from pagedllm.model_arch import RopeConfig

needs_kernels = pytest.mark.skipif(cpu_kernels.cpu_ops() is None, reason="the C++ kernels could not be built here")


def norm():
    op = RMSNorm(64, 1e-5)
    with torch.no_grad():
        op.weight.uniform_(0.5, 1.5)
    return op


def norm_inputs(dtype):
    return torch.randn(5, 64, dtype=dtype) * 3, torch.randn(5, 64, dtype=dtype)


# (op factory, inputs factory): each call gets fresh inputs (some kernels work in place).
CASES = {
    "rms_norm": (norm, lambda dtype: norm_inputs(dtype)[:1]),
    "fused_add_rms_norm": (norm, norm_inputs),
    "silu_and_mul": (SiluAndMul, lambda dtype: (torch.randn(5, 2 * 48, dtype=dtype) * 4,)),
    "rope": (
        lambda: get_rope(16, 64, RopeConfig(), torch.float32),
        lambda dtype: (torch.tensor([0, 3, 63, 7]), torch.randn(4, 4 * 16), torch.randn(4, 2 * 16)),
    ),
    "kv_write": (
        KVCacheWrite,
        lambda dtype: (
            torch.zeros(2, 3, 4, 2, 8, dtype=dtype),
            torch.randn(5, 16, dtype=dtype),
            torch.randn(5, 16, dtype=dtype),
            torch.tensor([0, 4, 11, 6, 1]),
        ),
    ),
}


def run(op, inputs):
    out = op(*inputs)
    return inputs[0] if out is None else out  # the KV write fills its cache


def seeded(make_inputs, dtype=torch.float32):
    torch.manual_seed(0)
    return make_inputs(dtype)


@needs_kernels
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_kernel_matches_native(name):
    make_op, make_inputs = CASES[name]
    op, ref = make_op(), make_op().force_native()
    if isinstance(op, RMSNorm):
        ref.weight = op.weight
    got, want = run(op, seeded(make_inputs)), run(ref, seeded(make_inputs))
    assert op.forward_method == op.forward_cpu and ref.forward_method == ref.forward_native
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "kv_write"])
def test_other_dtypes_take_the_native_path(name):
    make_op, make_inputs = CASES[name]
    op = make_op()
    run(op, seeded(make_inputs, torch.bfloat16))
    assert op.forward_method == op.forward_native


def test_dispatch_happens_once(monkeypatch):
    op, calls = SiluAndMul(), []
    choose = op.dispatch
    monkeypatch.setattr(op, "dispatch", lambda x: calls.append(x.dtype) or choose(x))
    assert op.forward_method is None
    for _ in range(3):
        op(torch.randn(2, 8))
    assert calls == [torch.float32] and op.forward_method is not None


def test_kernels_off_means_native(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    cpu_kernels.build_cpu_library.cache_clear()
    try:
        op = SiluAndMul()
        op(torch.randn(2, 8))
        assert op.forward_method == op.forward_native
    finally:
        cpu_kernels.build_cpu_library.cache_clear()


def test_backend_without_kernels_forces_the_native_write():
    backend = TorchAttentionBackend(use_cpu_kernels=False)
    assert backend.write_kv.forward_method == backend.write_kv.forward_native


def test_every_op_in_the_models_is_a_custom_op():
    for op in (RMSNorm(8), SiluAndMul(), get_rope(8, 16, RopeConfig(), torch.float32), KVCacheWrite()):
        assert isinstance(op, CustomOp) and type(op).forward_native is not CustomOp.forward_native
