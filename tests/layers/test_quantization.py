"""The weight-format registry and how layers get their methods from it."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.embedding import ParallelLMHead
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import (
    QUANTIZATION_CONFIGS,
    QUANTIZATION_METHODS,
    LinearMethodBase,
    QuantizationConfig,
    building_with,
    current_quant_config,
    get_quantization_config,
)
from pagedllm.layers.quantization.checkpoint import CHECKPOINT_FORMATS
from pagedllm.layers.quantization.int8 import Int8Config, Int8LinearMethod
from pagedllm.layers.quantization.int8_groups import GroupedInt8HeadMethod
from pagedllm.layers.quantization.unquantized import UnquantizedConfig, UnquantizedLinearMethod

_MINIMAL_CHECKPOINT_CONFIGS = {
    "awq": {"bits": 4, "group_size": 32},
    "gptq": {"bits": 4, "group_size": 32},
    "fp8": {"weight_block_size": [128, 128]},
    "compressed-tensors": {
        "format": "int-quantized",
        "config_groups": {
            "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}
        },
    },
    "bitsandbytes": {"load_in_8bit": True},
}


def _checkpoint_config(name):
    """A minimal ``quantization_config`` each checkpoint format accepts (None for the others)."""
    if name not in CHECKPOINT_FORMATS:
        return None
    return {"quant_method": name, **_MINIMAL_CHECKPOINT_CONFIGS[name]}


@pytest.mark.parametrize("name", QUANTIZATION_METHODS)
def test_each_name_builds_its_config_with_fresh_methods(name):
    config = get_quantization_config(name, _checkpoint_config(name))
    assert config.name == name
    assert name in CHECKPOINT_FORMATS or isinstance(config, QUANTIZATION_CONFIGS[name])
    for get in (config.get_linear_method, config.get_lm_head_method):
        first, second = get(), get()
        assert isinstance(first, LinearMethodBase) and first is not second  # per-layer state


def test_none_is_unquantized_and_unknown_names_are_value_errors():
    assert isinstance(get_quantization_config(None), UnquantizedConfig)
    with pytest.raises(ValueError, match="quantization must be None or one of int8, w8a8, int4, .*; got 'int3'"):
        get_quantization_config("int3")


@pytest.mark.parametrize("name", sorted(CHECKPOINT_FORMATS))
def test_a_checkpoint_format_needs_its_quantization_config(name):
    for config in (None, {"quant_method": "other", "bits": 4}):
        with pytest.raises(ValueError, match=f"no quantization_config with quant_method '{name}'"):
            get_quantization_config(name, config)


def test_layers_take_the_method_of_the_model_being_built():
    assert isinstance(current_quant_config(), UnquantizedConfig)
    with building_with(Int8Config()):
        linear, row, head = ColumnParallelLinear(8, 16), RowParallelLinear(16, 8), ParallelLMHead(32, 8)
    assert isinstance(linear.quant_method, Int8LinearMethod) and isinstance(row.quant_method, Int8LinearMethod)
    assert isinstance(head.quant_method, GroupedInt8HeadMethod)  # the head in int8 groups of 32
    assert isinstance(ColumnParallelLinear(8, 16).quant_method, UnquantizedLinearMethod)


def test_the_build_context_is_restored_on_error():
    with pytest.raises(RuntimeError), building_with(Int8Config()):
        raise RuntimeError("model constructor failed")
    assert isinstance(current_quant_config(), UnquantizedConfig)


class Halved(QuantizationConfig):
    """A toy format plugged in from outside: stores W / 2 and doubles it back in apply."""

    name = "halved"

    class Method(UnquantizedLinearMethod):
        def process_weights_after_loading(self, layer):
            layer.weight.data.mul_(0.5)

        def apply(self, layer, x, bias=None):
            return F.linear(x, layer.weight * 2, bias)

    def get_linear_method(self):
        return self.Method()

    def get_lm_head_method(self):
        return UnquantizedLinearMethod()


def test_a_new_format_plugs_in_as_a_config():
    layer = ColumnParallelLinear(4, 6, bias=True, quant_config=Halved())
    w, b, x = torch.randn(6, 4), torch.randn(6), torch.randn(3, 4)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    layer.quant_method.process_weights_after_loading(layer)
    torch.testing.assert_close(layer.weight.data, w / 2)
    torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_processing_twice_is_harmless():
    layer = ColumnParallelLinear(8, 32)
    w = torch.randn(32, 8)
    layer.weight.data.copy_(w)
    x = torch.randn(2, 8)
    for _ in range(2):
        layer.quant_method.process_weights_after_loading(layer)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-4, atol=1e-4)
