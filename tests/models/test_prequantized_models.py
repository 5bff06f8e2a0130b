"""Pre-quantized checkpoints end to end: a tiny llama whose linears our packer quantized
(``tests/quant_checkpoints.py``) loads through ``LLM(...)`` from its config.json alone, and its
greedy output and logits are checked against transformers running the float checkpoint of the
exact dequantized weights (the oracle). Then the bad inputs: each a ValueError naming the file or
tensor and what is supported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.layers.quantization.bitsandbytes import CodebookInt4Method
from pagedllm.layers.quantization.int4 import load_int4_table_gemm
from tests import quant_checkpoints as qc
from tests.engine_checks import assert_idle_and_intact
from tests.layers.test_prequantized import FORMATS, ct

PROMPTS = [[1, 5, 9, 33, 100, 7], [200, 3, 3, 47], [11, 12, 13, 14, 15, 16, 17, 18]]
TOKENS = 10
# Max relative logits error per position, ||ours - hf|| / ||hf||, on PROMPTS[0] + its greedy
# continuation, against transformers on the exact dequantized weights. Formats stored as int8 per
# channel load their rows as they are (measured 0: the same GEMM result to float rounding).
# Requantized ones (FP8, 4-bit) move each weight by up to half an int8 step of its row; W8A8 adds
# per-token int8 activations. Measured on this random-weight model (flat logits, so far above a
# real model's): fp8 16x32 blocks 0.030, nf4 + double quant 0.040, compressed-tensors W8A8 0.037.
# Bounds: 2x those.
REL_BOUND = {"exact": 1e-4, "requantized": 0.08, "w8a8": 0.08}
# Flat logits make near-ties common: a requantized model may take transformers' runner-up where
# its top two are this close (log-probabilities), and is only compared up to there.
NEAR_TIE = 0.15


@pytest.fixture(scope="module")
def quantized(llama_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """fmt -> (quantized dir, oracle dir), written once per module."""
    root = tmp_path_factory.mktemp("prequantized")
    cache: dict[str, tuple[Path, Path]] = {}

    def make(fmt: str) -> tuple[Path, Path]:
        if fmt not in cache:
            config, pack, _ = FORMATS[fmt]
            cache[fmt] = (root / fmt, qc.write_checkpoint(llama_model_dir, root / fmt, config, pack))
        return cache[fmt]

    return make


def _hf(oracle: Path, seq: list[int]) -> tuple[torch.Tensor, list[tuple[list[int], torch.Tensor]]]:
    """Transformers' logits over ``seq`` and, per prompt, its greedy tokens with each step's logprobs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(oracle))
    greedy = []
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0]
        for p in PROMPTS:
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
            steps = torch.log_softmax(torch.cat(out.scores).float(), dim=-1)
            greedy.append((out.sequences[0, len(p) :].tolist(), steps))
    return logits, greedy


def _agree_until_a_near_tie(ours: list[int], theirs: list[int], logprobs: torch.Tensor) -> bool:
    """True when the tokens are identical; at a first difference the token taken must be within
    NEAR_TIE of transformers' best (its runner-up, or a third as close: then False, the
    continuations no longer compare)."""
    for step, (a, b) in enumerate(zip(theirs, ours)):
        if a != b:
            gap = float(logprobs[step].max() - logprobs[step][b])
            assert gap < NEAR_TIE, f"step {step}: took {b}, {gap:.3f} below transformers' best: not a near-tie"
            return False
    return True


@pytest.mark.parametrize(
    "fmt", ["fp8-block", "ct-w8a8", "ct-w8a16-packed", "ct-w8a16-group-asym", "bnb-int8", "bnb-nf4-nested"]
)
def test_greedy_and_logits_match_transformers_on_the_dequantized_weights(fmt: str, quantized) -> None:
    from benchmarks.w8a8_accuracy import teacher_forced_logits

    qdir, oracle = quantized(fmt)
    llm = LLM(str(qdir), kv_cache_memory=0.05)
    assert llm.llm_engine.config.model_config.quantization == FORMATS[fmt][0]["quant_method"]  # from config.json
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    if fmt == "bnb-nf4-nested" and load_int4_table_gemm() is not None:
        # NF4 stays 4-bit on the int4 kernel with its code table, and the C++ decode stack runs it (method 8).
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model.model
        layer = model.layers[0].mlp.gate_up_proj
        assert isinstance(layer.quant_method, CodebookInt4Method) and layer.weight.dtype == torch.uint8
        stack = model.decode_stack()
        assert stack is not None and set(stack.methods) == {8}
    seq = PROMPTS[0] + ours[0]
    got = teacher_forced_logits(llm, seq)
    assert_idle_and_intact(llm)
    want, hf_greedy = _hf(oracle, seq)
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    exact = FORMATS[fmt][2] and fmt != "ct-w8a8"
    print(f"{fmt}: max relative logits error {rel:.5f}")
    assert rel < REL_BOUND["w8a8" if fmt == "ct-w8a8" else "exact" if exact else "requantized"]
    if exact:
        assert ours == [tokens for tokens, _ in hf_greedy]
    else:
        identical = sum(_agree_until_a_near_tie(o, t, lp) for o, (t, lp) in zip(ours, hf_greedy))
        print(f"{fmt}: {identical} of {len(PROMPTS)} greedy continuations identical")
        assert identical >= 1


def _error(model: Path, **kw) -> str:
    with pytest.raises(ValueError) as e:
        EngineArgs(model=str(model), **kw).create_engine_config()
    return str(e.value)


def _with_config(src: Path, dst: Path, quantization_config: dict) -> Path:
    qc.write_checkpoint(src, dst, quantization_config, FORMATS["fp8-block"][1])
    return dst


def test_config_errors_name_the_method_and_what_is_supported(quantized, llama_model_dir: Path, tmp_path) -> None:
    fp8_dir, _ = quantized("fp8-block")
    msg = _error(fp8_dir, quantization="int8")
    assert "quantization='int8' disagrees" in msg and "quant_method 'fp8'" in msg
    assert EngineArgs(model=str(fp8_dir), quantization="fp8").create_engine_config().model_config.quantization == "fp8"
    msg = _error(llama_model_dir, quantization="bitsandbytes")
    assert "no quantization_config" in msg
    with pytest.raises(ValueError, match=r"load_format='dummy' cannot fill the layers of a pre-quantized \(fp8\)"):
        LLM(str(fp8_dir), load_format="dummy", kv_cache_memory=0.05)
    msg = _error(_with_config(llama_model_dir, tmp_path / "hqq", {"quant_method": "hqq"}))
    assert "quant_method 'hqq' is not supported; supported: awq, gptq, fp8, compressed-tensors, bitsandbytes" in msg


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            ct(
                "pack-quantized",
                {"type": "int", "strategy": "group", "group_size": 32, "num_bits": 4},
                {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
            ),
            "4-bit int weights with quantized activations \\(W4A8\\) are not supported",
        ),
        (
            ct("int-quantized", {"type": "int", "strategy": "channel", "num_bits": 2}),
            "2-bit int weights are not supported",
        ),
        (
            ct("int-quantized", {"type": "int", "strategy": "tensor_group"}),
            "strategy 'tensor_group' is not supported; supported: channel",
        ),
        (ct("marlin-24", {"type": "int", "strategy": "channel"}), "format 'marlin-24' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"},
            "'int4' is not supported; supported: nf4, fp4",
        ),
    ],
)
def test_unsupported_schemes_fail_at_load(llama_model_dir: Path, tmp_path, config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(_with_config(llama_model_dir, tmp_path / "m", config)), kv_cache_memory=0.05)


def test_a_scale_of_the_wrong_shape_names_the_tensor(quantized, tmp_path) -> None:
    fp8_dir, _ = quantized("fp8-block")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in fp8_dir.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=rf"{name} has shape \(4, 1\); a weight of shape \(64, 128\) in blocks of \(16, 32\) needs \(4, 4\)",
    ):
        LLM(str(bad), kv_cache_memory=0.05)
    del tensors[name]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"incomplete quantized layers .*down_proj \(has only weight\)"):
        LLM(str(bad), kv_cache_memory=0.05)
    config = json.loads((bad / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"


@pytest.mark.parametrize(("kind", "double_quant"), [("nf4", True), ("fp4", False)])
def test_transformers_own_4bit_checkpoint_stays_4bit_with_its_greedy_tokens(
    kind: str, double_quant: bool, llama_model_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint as transformers writes it (``BitsAndBytesConfig`` quantizing at load on CPU,
    then ``save_pretrained``: its key names, quant-state JSON and config fields) loads its
    linears 4-bit, with transformers' greedy tokens on the same layers dequantized by bitsandbytes."""
    functional = pytest.importorskip("bitsandbytes.functional")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=kind,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.float32,
    )
    quantized = AutoModelForCausalLM.from_pretrained(
        llama_model_dir, quantization_config=config, device_map="cpu", dtype=torch.float32
    )
    out = tmp_path / f"bnb-{kind}"
    quantized.save_pretrained(out)
    for f in llama_model_dir.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    reference = AutoModelForCausalLM.from_pretrained(llama_model_dir, dtype=torch.float32)
    state = reference.state_dict()
    for name, module in quantized.named_modules():
        if type(module).__name__ == "Linear4bit":
            state[f"{name}.weight"] = functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
    reference.load_state_dict(state)
    llm = LLM(str(out), kv_cache_memory=0.05)
    layer = llm.llm_engine.engine_core.executor.worker.model_runner.model.model.layers[0].self_attn.qkv_proj
    if load_int4_table_gemm() is not None:
        assert isinstance(layer.quant_method, CodebookInt4Method) and layer.weight.dtype == torch.uint8
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, got in zip(PROMPTS, outs):
        ids = torch.tensor([prompt])  # an explicit mask: the tiny model's pad id may occur in a prompt
        want = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False
        )
        assert list(got.outputs[0].token_ids) == want[0, len(prompt) :].tolist()
    assert_idle_and_intact(llm)
