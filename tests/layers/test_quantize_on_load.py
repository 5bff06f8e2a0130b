"""--quantization int8 / w8a8 / int4 on a float checkpoint quantize each tensor as it streams in
(``prequantized.QuantizeOnLoad``): the linears hold quantized parameters from construction (no
float32 copy of them is ever allocated), and the result equals quantizing after loading exactly,
for the engine's model and for fused and tensor-parallel layers."""

import pytest
import torch

from pagedllm.layers import cpu_kernels
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import QUANTIZATION_CONFIGS, get_quantization_config, int4
from pagedllm.layers.quantization.prequantized import for_checkpoint
from tests.layers.test_tp_shards import tp_rank

pytestmark = pytest.mark.skipif(cpu_kernels.cpu_ops() is None, reason="the C++ CPU kernels could not be built here")

# The parameter each method's linears hold from construction: (dtype, its shape for [out, in]).
LOADING_WEIGHT = {
    "int8": (torch.int8, lambda n, k: (n, k)),
    "w8a8": (torch.int8, lambda n, k: (n, k)),
    "int4": (torch.uint8, lambda n, k: (n, k // 2)),  # two nibbles per byte
}


def _logits(model) -> torch.Tensor:
    from tests.models.test_models_vs_hf import bind_caches, run_step

    ids = torch.tensor([5, 17, 42, 99, 7, 300, 2])
    (out,) = run_step(model, bind_caches(model), [(ids, 0, len(ids), [0, 1])])
    return out


def _quantized_state(model) -> dict[str, torch.Tensor]:
    """The decoder layers' parameters and buffers (scales and zeros are non-persistent buffers)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {name: t for name, t in tensors if ".layers." in name and t is not None}


@pytest.mark.parametrize("method", ["int8", "w8a8", "int4"])
def test_a_float_checkpoint_is_quantized_as_it_loads(llama_model_dir, monkeypatch, method):
    """Each quantizer is per row (int8) or per row and group of inputs (int4), so quantizing a
    fused layer's shards one by one gives the same codes and scales as the whole weight: the
    weights and logits equal the quantize-after-loading path exactly."""
    from pagedllm.config import EngineArgs
    from pagedllm.models import loader

    config = EngineArgs(model=str(llama_model_dir), quantization=method).create_engine_config()
    arch = config.model_config.arch
    built = loader.build_model(arch, torch.float32, "cpu", for_checkpoint(get_quantization_config(method)))
    dtype, shape = LOADING_WEIGHT[method]
    linears = [m for m in built.modules() if hasattr(m, "quant_method") and hasattr(m, "output_sizes")]
    assert len(linears) == 8  # 2 layers x (qkv, o, gate_up, down); the LM head is not among them
    for m in linears:
        assert m.weight.dtype == dtype and m.weight.shape == shape(sum(m.output_sizes), m.input_size)

    kw = dict(dtype=torch.float32, device=torch.device("cpu"), quantization=method)
    built_with = []
    real_build = loader.build_model
    monkeypatch.setattr(loader, "build_model", lambda *a: built_with.append(a[3]) or real_build(*a))
    streamed_model = loader.load_model(str(llama_model_dir), arch, **kw)
    assert [type(c).__name__ for c in built_with] == ["QuantizeOnLoad"]
    monkeypatch.setattr(QUANTIZATION_CONFIGS[method], "quantize_on_load", None)  # quantize after loading
    after_model = loader.load_model(str(llama_model_dir), arch, **kw)
    streamed, after = _quantized_state(streamed_model), _quantized_state(after_model)
    assert streamed.keys() == after.keys()
    assert {"weight_scale", *(("weight_zero",) if method == "int4" else ())} <= {n.split(".")[-1] for n in streamed}
    for name, t in streamed.items():
        assert torch.equal(t, after[name]), name
    assert torch.equal(_logits(streamed_model), _logits(after_model))


def _int4_layers(on_load: bool):
    """qkv (q 64, k 32, v 32 outputs of 64 inputs), gate_up (2 x 48 of 96), down (48 of 128)."""
    config = for_checkpoint(int4.Int4Config()) if on_load else int4.Int4Config()
    return [
        (QKVParallelLinear(64, 16, 4, 2, quant_config=config), ["q", "k", "v"]),
        (MergedColumnParallelLinear(96, [48, 48], quant_config=config), [0, 1]),
        (RowParallelLinear(128, 48, quant_config=config), [None]),
    ]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_int4_fused_and_sharded_layers_equal_quantizing_after_loading(tp_size):
    """Each rank quantizes the full checkpoint tensor with its shard's group size, so its cut
    (rows of a column-parallel layer, whole groups of a row-parallel one) equals quantizing the
    rank's own shard after loading."""
    gen = torch.Generator().manual_seed(0)
    full = {
        0: [torch.randn(n, 64, generator=gen) for n in (64, 32, 32)],
        1: [torch.randn(48, 96, generator=gen) for _ in range(2)],
        2: [torch.randn(48, 128, generator=gen)],
    }
    for rank in range(tp_size):
        with tp_rank(rank, tp_size):
            streamed, after = _int4_layers(on_load=True), _int4_layers(on_load=False)
        for index, ((s_layer, shards), (a_layer, _)) in enumerate(zip(streamed, after)):
            assert s_layer.weight.dtype == torch.uint8 and a_layer.weight.dtype == torch.float32
            for shard, tensor in zip(shards, full[index]):
                for layer in (s_layer, a_layer):
                    layer.weight.weight_loader(layer.weight, tensor, shard)
            for layer in (s_layer, a_layer):
                layer.quant_method.process_weights_after_loading(layer)
            assert isinstance(s_layer.quant_method, int4.Int4LinearMethod)
            assert s_layer.quant_method.group_size == a_layer.quant_method.group_size
            for name in ("weight", "weight_scale", "weight_zero"):
                assert torch.equal(getattr(s_layer, name), getattr(a_layer, name)), (rank, index, name)
            x = torch.randn(3, s_layer.input_size, generator=gen)
            assert torch.equal(s_layer(x), a_layer(x))
