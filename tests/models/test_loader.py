"""load_model: safetensors checks (missing / unexpected / malformed), dummy weights, dtypes."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.demo.tiny import build_tiny_model
from pagedllm.hf_config import load_hf_config, normalize_hf_config
from pagedllm.layers.attention import Attention
from pagedllm.layers.cpu_gemm_kernels import load_cpu_gemm, unpack_weight
from pagedllm.models.loader import load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("loader") / "llama", "llama", seed=1)


@pytest.fixture(scope="module")
def config(llama_dir):
    return normalize_hf_config(load_hf_config(llama_dir))


def with_tensors(src, dst, edit):
    """A copy of checkpoint ``src`` in ``dst`` whose tensors went through ``edit(dict)``."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def load(path, config, **kw):
    return load_model(str(path), config, dtype=kw.pop("dtype", torch.float32), device=CPU, **kw)


def test_loads_every_parameter(llama_dir, config):
    model = load(llama_dir, config)
    tensors = load_file(llama_dir / "model.safetensors")
    torch.testing.assert_close(
        _dense(model.model.layers[1].self_attn.qkv_proj.weight),
        torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]),
    )
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_missing_weight_is_named(llama_dir, config, tmp_path):
    path = with_tensors(llama_dir, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing parameters \(1\): model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load(path, config)


def test_unexpected_weight_is_named(llama_dir, config, tmp_path):
    def add(tensors):
        tensors["model.layers.0.mlp.experts.weight"] = torch.zeros(2)
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # benign, ignored

    path = with_tensors(llama_dir, tmp_path / "m", add)
    with pytest.raises(ValueError, match=r"unexpected checkpoint tensors \(1\): model\.layers\.0\.mlp\.experts"):
        load(path, config)


def test_benign_buffers_are_ignored(llama_dir, config, tmp_path):
    path = with_tensors(
        llama_dir, tmp_path / "m", lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)})
    )
    load(path, config)


def test_wrong_shape_is_a_value_error(llama_dir, config, tmp_path):
    path = with_tensors(llama_dir, tmp_path / "m", lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape \(65,\)"):
        load(path, config)


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    src = build_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    config = normalize_hf_config(load_hf_config(src))
    path = with_tensors(
        src, tmp_path / "m", lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()})
    )
    for p in (src, path):
        model = load(p, config)
        # Same values; on CPU the head holds its own GEMM-layout copy (see layers/quantization/unquantized.py).
        assert torch.equal(_dense(model.lm_head.weight), model.model.embed_tokens.weight)


def _dense(w):
    """The [out, in] values of a weight in any CPU GEMM layout (see layers/quantization/unquantized.py)."""
    if w.dim() == 3:
        return unpack_weight(w)
    return w.to_dense() if w.layout == torch._mkldnn else w


def test_cpu_weights_get_the_gemm_layout_after_loading(llama_dir, config, monkeypatch):
    model = load(llama_dir, config)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    if load_cpu_gemm() is not None:  # our kernel's packed [out / 16, in, 16]
        assert qkv.shape == (qkv.shape[0], 64, 16)
    assert model.model.embed_tokens.weight.is_contiguous()  # lookups need the plain table
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "0")
    load_cpu_gemm.cache_clear()
    onednn = load(llama_dir, config).model.layers[0].self_attn.qkv_proj.weight
    if torch.backends.mkldnn.is_available():
        assert onednn.layout == torch._mkldnn
    assert torch.equal(_dense(onednn), _dense(qkv))
    monkeypatch.setenv("PAGEDLLM_ONEDNN", "0")
    plain = load(llama_dir, config).model.layers[0].self_attn.qkv_proj.weight
    assert plain.t().is_contiguous() and not plain.is_contiguous()  # the column-major fallback
    assert torch.equal(plain, _dense(qkv))
    load_cpu_gemm.cache_clear()  # monkeypatch restores the env after the test; the next load rebuilds the cache


def test_no_safetensors_suggests_dummy(llama_dir, config, tmp_path):
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"no \*\.safetensors in .*load_format='dummy'"):
        load(tmp_path, config)
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_model(None, config, dtype=torch.float32, device=CPU)


def test_index_naming_absent_shard(llama_dir, config, tmp_path):
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": "gone.safetensors"}}')
    with pytest.raises(ValueError, match="gone.safetensors"):
        load(tmp_path, config)


def test_unknown_load_format(config):
    with pytest.raises(ValueError, match="unknown load_format 'pt'; choose one of: auto, safetensors, gguf, dummy"):
        load_model(None, config, load_format="pt", dtype=torch.float32, device=CPU)


def run_prompt(model, ids):
    from pagedllm.layers.attention.metadata import build_common_metadata
    from pagedllm.layers.attention.selector import get_attn_backend

    backend = get_attn_backend("cpu")
    for m in model.modules():
        if isinstance(m, Attention):
            dtype = next(model.parameters()).dtype
            m.bind_kv_cache(torch.zeros(2, 8, 4, m.num_kv_heads, m.head_dim, dtype=dtype), backend)
    common = build_common_metadata([len(ids)], [0], [[5, 2, 7, 1]], 4)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), backend.build_metadata(common)))


def test_dummy_weights_need_no_files(config):
    model = load_model(None, config, load_format="dummy", dtype=torch.float32, device=CPU, seed=1)
    again = load_model(None, config, load_format="dummy", dtype=torch.float32, device=CPU, seed=1)
    other = load_model(None, config, load_format="dummy", dtype=torch.float32, device=CPU, seed=2)
    params, same, different = ({n: _dense(p) for n, p in m.named_parameters()} for m in (model, again, other))
    assert all(torch.equal(p, same[n]) for n, p in params.items())
    assert not torch.equal(params["lm_head.weight"], different["lm_head.weight"])
    assert torch.equal(params["model.norm.weight"], torch.ones(config.hidden_size))
    w = params["model.layers.0.mlp.gate_up_proj.weight"]
    assert abs(w.std().item() - config.hidden_size**-0.5) < 0.01
    logits = run_prompt(model, torch.arange(12))
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_bfloat16(llama_dir, config):
    ref = load(llama_dir, config)
    model = load(llama_dir, config, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32  # restored after the build
    ids = torch.arange(12) * 7
    logits, expected = run_prompt(model, ids), run_prompt(ref, ids)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0.05)


def test_non_float_dtype_rejected(config):
    with pytest.raises(ValueError, match="floating-point"):
        load_model(None, config, load_format="dummy", dtype=torch.int8, device=CPU)


@pytest.mark.parametrize("dtype,path", [(torch.float32, "forward_cpu"), (torch.bfloat16, "forward_native")])
def test_model_ops_take_the_cpu_kernels_in_float32(llama_dir, config, dtype, path, monkeypatch):
    from pagedllm.layers.cpu_kernels import cpu_ops
    from pagedllm.layers.custom_op import CustomOp

    if cpu_ops() is None:
        pytest.skip("the C++ kernels could not be built here")
    # The modules themselves: a 12-token prompt is row-wise, which the decode stack would take.
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_STACK", "0")
    model = load(llama_dir, config, dtype=dtype)
    run_prompt(model, torch.arange(12))
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    assert len(ops) == 3 * config.num_hidden_layers + 2  # two norms and SiLU a layer, the final norm, RoPE
    assert all(op.forward_method == getattr(op, path) for op in ops), [type(op).__name__ for op in ops]
