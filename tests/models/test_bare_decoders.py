"""Bare decoder bodies (HF ``LlamaModel`` / ``Qwen3Model`` ..., what ``AutoModel`` saves: no
``model.`` prefix, no LM head) against HF's ``last_hidden_state``, on the paged-attention path;
and ``*ForCausalLM`` checkpoints saved without the ``model.`` prefix."""

import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedllm.hf_config import load_hf_config, normalize_hf_config
from pagedllm.layers.attention.metadata import build_common_metadata
from pagedllm.model_arch import POOLING_ONLY_ARCHITECTURES, is_pooling_only
from pagedllm.models.loader import load_model
from tests.models.test_models_vs_hf import BLOCK, bind_caches, hf_logits, run_step

CPU = torch.device("cpu")
ATOL = RTOL = 1e-4
CASES = {"llama": "LlamaModel", "mistral": "MistralModel", "qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}
LENGTHS = (23, 6, 14)
TABLES = ([9, 2, 17, 4, 11, 20], [5, 13], [1, 30, 7, 8])


@pytest.fixture(scope="module", params=list(CASES))
def bare(request, tiny_model_dir):
    path = tiny_model_dir(request.param, bare=True, seed=4)
    config = normalize_hf_config(load_hf_config(path))
    ours = load_model(str(path), config, dtype=torch.float32, device=CPU)
    hf = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, config, ours, hf


def hidden_states(model, seqs):
    """Our final hidden states for whole prompts in one paged step, split per prompt."""
    backend = bind_caches(model)
    ids, positions = torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs])
    common = build_common_metadata([len(s) for s in seqs], [0] * len(seqs), list(TABLES[: len(seqs)]), BLOCK)
    with torch.no_grad():
        return model(ids, positions, backend.build_metadata(common)).split([len(s) for s in seqs])


def prompts(vocab_size):
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in LENGTHS]


def test_bare_checkpoint_layout(bare):
    arch, path, config, ours, _ = bare
    assert config.architecture == CASES[arch] and is_pooling_only(config.architecture)
    names = load_file(path / "model.safetensors")
    assert "embed_tokens.weight" in names and not any(n.startswith(("model.", "lm_head.")) for n in names)
    assert not hasattr(ours, "lm_head") and "lm_head.weight" not in dict(ours.named_parameters())


def test_hidden_states_match_hf(bare):
    _, _, config, ours, hf = bare
    seqs = prompts(config.vocab_size)
    for got, seq in zip(hidden_states(ours, seqs), seqs):
        with torch.no_grad():
            want = hf(seq[None]).last_hidden_state[0]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_no_logits_from_a_body(bare):
    _, _, config, ours, _ = bare
    with pytest.raises(ValueError, match=f"{config.architecture} has no LM head"):
        ours.compute_logits(torch.zeros(1, config.hidden_size))


def rewrite(src, dst, edit):
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return dst


def test_body_checkpoint_with_an_lm_head_loads(bare, tmp_path):
    """A head saved beside the body is not needed for pooling: it is skipped, not an error."""
    _, path, config, ours, _ = bare

    def add_head(tensors):
        return {**tensors, "lm_head.weight": tensors["embed_tokens.weight"].clone()}

    model = load_model(str(rewrite(path, tmp_path / "m", add_head)), config, dtype=torch.float32, device=CPU)
    seqs = prompts(config.vocab_size)[:1]
    torch.testing.assert_close(hidden_states(model, seqs)[0], hidden_states(ours, seqs)[0], atol=0, rtol=0)


def test_causal_lm_without_model_prefix_loads(tiny_model_dir, tmp_path):
    """A *ForCausalLM checkpoint whose body names lack ``model.`` (and the usual layout) both load."""
    path = tiny_model_dir("llama", seed=4)
    config = normalize_hf_config(load_hf_config(path))

    def strip(tensors):
        return {n.removeprefix("model."): t for n, t in tensors.items()}

    ours = load_model(str(rewrite(path, tmp_path / "m", strip)), config, dtype=torch.float32, device=CPU)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = prompts(config.vocab_size)[0]
    (logits,) = run_step(ours, bind_caches(ours), [(seq, 0, len(seq), TABLES[0])])
    torch.testing.assert_close(logits, hf_logits(hf, seq), atol=ATOL, rtol=RTOL)


def test_unknown_tensor_in_a_body_is_named(bare, tmp_path):
    _, path, config, *_ = bare

    def add(tensors):
        return {**tensors, "layers.0.mlp.experts.weight": torch.zeros(2)}

    with pytest.raises(ValueError, match=r"unexpected checkpoint tensors \(1\): layers\.0\.mlp\.experts\.weight"):
        load_model(str(rewrite(path, tmp_path / "m", add)), config, dtype=torch.float32, device=CPU)


def test_pooling_only_architectures():
    assert set(CASES.values()) | {"BertModel", "RobertaModel", "XLMRobertaModel"} == set(POOLING_ONLY_ARCHITECTURES)
    assert not is_pooling_only("LlamaForCausalLM")
