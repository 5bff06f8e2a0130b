"""BERT / RoBERTa / XLM-R encoders against Hugging Face's ``last_hidden_state`` on tiny random models.

Several sequences of different lengths run as ONE flat batch (the runner's layout, built with
``build_flat_batch``); HF runs each sequence alone, so no padding mask is involved on its side.
"""

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedllm.hf_config import load_hf_config, normalize_hf_config
from pagedllm.layers.attention import Attention
from pagedllm.models.loader import load_model
from pagedllm.worker.flat_batch import build_flat_batch

CPU = torch.device("cpu")
ATOL = RTOL = 1e-4
ARCHES = ("bert", "roberta", "xlm-roberta")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    "Embeddings map each text to one vector; similar texts get similar vectors.",
    "a b c",
]

_LOADED: dict = {}


def load_case(arch, tiny_encoder_dir):
    """(checkpoint dir, normalised config, our model, HF model, tokenizer), once per session."""
    if arch not in _LOADED:
        path = tiny_encoder_dir(arch, seed=3)
        config = normalize_hf_config(load_hf_config(path))
        ours = load_model(str(path), config, dtype=torch.float32, device=CPU)
        hf = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        _LOADED[arch] = (path, config, ours, hf, transformers.AutoTokenizer.from_pretrained(path))
    return _LOADED[arch]


@pytest.fixture(scope="module", params=ARCHES)
def case(request, tiny_encoder_dir):
    return load_case(request.param, tiny_encoder_dir)


def run_flat(model, seqs):
    """Our hidden states for whole sequences in one flat batch, split back per sequence."""
    # Encoders keep no KV cache: the block tables only satisfy the helper's shape.
    ids, positions, metadata = build_flat_batch(seqs, [0] * len(seqs), [[0]] * len(seqs), 1 << 20, CPU)
    with torch.no_grad():
        return model(ids, positions, metadata).split([len(s) for s in seqs])


def hf_hidden(hf, seq):
    with torch.no_grad():
        return hf(torch.tensor([seq])).last_hidden_state[0]


def test_config_normalised(case):
    _, config, _, hf, tok = case
    assert config.encoder_only
    assert config.num_key_value_heads == config.num_attention_heads == 4
    assert config.head_dim == 16 and config.hidden_act == "gelu"
    roberta = config.architecture != "BertModel"
    assert config.position_offset == (tok.pad_token_id + 1 if roberta else 0) == (2 if roberta else 0)
    assert config.type_vocab_size == (1 if roberta else 2)
    assert hf.config.max_position_embeddings == 128 + config.position_offset
    assert config.max_position_embeddings == 128  # the usable length


def test_mixed_lengths_in_one_batch_match_hf(case):
    _, config, ours, hf, tok = case
    seqs = [tok(t)["input_ids"] for t in TEXTS]
    assert len({len(s) for s in seqs}) == len(seqs)
    gen = torch.Generator().manual_seed(0)
    seqs.append(torch.randint(0, config.vocab_size, (37,), generator=gen).tolist())  # any ids at all
    for got, seq in zip(run_flat(ours, seqs), seqs):
        assert got.shape == (len(seq), config.hidden_size)
        torch.testing.assert_close(got, hf_hidden(hf, seq), atol=ATOL, rtol=RTOL)


def test_equal_lengths_and_longest_sequence_match_hf(case):
    """The one-call path for equal lengths; the last usable position (RoBERTa's offset table end)."""
    _, config, ours, hf, _ = case
    gen = torch.Generator().manual_seed(1)
    for lengths in ([9, 9, 9], [config.max_position_embeddings, 1]):
        seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
        for got, seq in zip(run_flat(ours, seqs), seqs):
            torch.testing.assert_close(got, hf_hidden(hf, seq), atol=ATOL, rtol=RTOL)


def test_pad_tokens_inside_a_sequence_match_hf(case):
    """RoBERTa gives pad tokens the padding position and does not count them (HF's position ids)."""
    _, _, ours, hf, tok = case
    seqs = [tok(t)["input_ids"] for t in TEXTS[:2]]
    seqs[0][3:3] = [tok.pad_token_id] * 2
    seqs[1].append(tok.pad_token_id)
    for got, seq in zip(run_flat(ours, seqs), seqs):
        torch.testing.assert_close(got, hf_hidden(hf, seq), atol=ATOL, rtol=RTOL)


def test_no_kv_cache_layers_and_no_lm_head(case):
    _, _, ours, _, _ = case
    assert not any(isinstance(m, Attention) for m in ours.modules())
    assert not hasattr(ours, "compute_logits")
    assert not any("pooler" in name for name, _ in ours.named_parameters())


@pytest.mark.parametrize("kw", [{"dtype": torch.bfloat16}, {"quantization": "int8"}], ids=["bf16", "int8"])
def test_other_formats_stay_close(tiny_encoder_dir, kw):
    """The encoder's layers take the same dtype / quantization paths as the decoders'."""
    path, config, ours, _, tok = load_case("bert", tiny_encoder_dir)
    model = load_model(str(path), config, device=CPU, **{"dtype": torch.float32, **kw})
    seqs = [tok(t)["input_ids"] for t in TEXTS]
    for got, want in zip(run_flat(model, seqs), run_flat(ours, seqs)):
        assert got.dtype == kw.get("dtype", torch.float32)
        torch.testing.assert_close(got.float(), want, atol=0.15, rtol=0.05)


def test_sentence_transformers_files(bert_model_dir):
    modules = json.loads((bert_model_dir / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    pooling = json.loads((bert_model_dir / "1_Pooling" / "config.json").read_text())
    assert pooling["word_embedding_dimension"] == 64
    assert pooling["pooling_mode_mean_tokens"] is True
    assert not any(pooling[k] for k in ("pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_lasttoken"))
    assert not pooling["pooling_mode_mean_sqrt_len_tokens"]


def test_tokenizer_adds_cls_and_sep(bert_model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(bert_model_dir)
    ids = tok("hello world")["input_ids"]
    assert tok.convert_ids_to_tokens([ids[0], ids[-1]]) == ["[CLS]", "[SEP]"] and tok.pad_token_id == 0


def rewrite(src, dst, edit):
    """A copy of checkpoint ``src`` in ``dst`` whose tensors went through ``edit(dict) -> dict``."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return dst


def test_task_model_checkpoint_loads(tiny_encoder_dir, tmp_path):
    """BertForMaskedLM-style names: a ``bert.`` prefix, an MLM head, saved index buffers and
    TF-era gamma/beta LayerNorm names; all load (or are skipped) and give the same states."""
    path, config, ours, hf, tok = load_case("bert", tiny_encoder_dir)

    def as_task_model(tensors):
        out = {f"bert.{name}": t for name, t in tensors.items()}
        out["bert.embeddings.LayerNorm.gamma"] = out.pop("bert.embeddings.LayerNorm.weight")
        out["bert.embeddings.LayerNorm.beta"] = out.pop("bert.embeddings.LayerNorm.bias")
        out["bert.embeddings.position_ids"] = torch.arange(128)[None]
        out["cls.predictions.bias"] = torch.zeros(config.vocab_size)
        out["cls.predictions.transform.dense.weight"] = torch.zeros(64, 64)
        return out

    task = load_model(str(rewrite(path, tmp_path / "m", as_task_model)), config, dtype=torch.float32, device=CPU)
    seqs = [tok(t)["input_ids"] for t in TEXTS]
    for got, want in zip(run_flat(task, seqs), run_flat(ours, seqs)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_unknown_and_missing_tensors_are_named(tiny_encoder_dir, tmp_path):
    path, config, *_ = load_case("bert", tiny_encoder_dir)

    def add(tensors):
        return {**tensors, "encoder.layer.0.attention.self.rotary.weight": torch.zeros(2)}

    with pytest.raises(
        ValueError, match=r"unexpected checkpoint tensors \(1\): encoder\.layer\.0\.attention\.self\.rotary"
    ):
        load_model(str(rewrite(path, tmp_path / "a", add)), config, dtype=torch.float32, device=CPU)

    def drop(tensors):
        return {k: v for k, v in tensors.items() if k != "encoder.layer.1.attention.self.key.bias"}

    with pytest.raises(
        ValueError, match=r"missing parameters \(1\): encoder\.layer\.1\.attention\.self\.qkv_proj\.bias"
    ):
        load_model(str(rewrite(path, tmp_path / "b", drop)), config, dtype=torch.float32, device=CPU)


def test_dummy_weights(tiny_encoder_dir):
    _, config, *_ = load_case("roberta", tiny_encoder_dir)
    model = load_model(None, config, load_format="dummy", dtype=torch.float32, device=CPU)
    assert torch.equal(model.embeddings.LayerNorm.weight, torch.ones(64))  # "LayerNorm" counts as a norm
    (hidden,) = run_flat(model, [list(range(10))])
    assert torch.isfinite(hidden).all() and hidden.std() > 0.1


def encoder_config(**overrides):
    hf = dict(
        architectures=["XLMRobertaModel"],
        model_type="xlm-roberta",
        vocab_size=250002,
        hidden_size=768,
        num_attention_heads=12,
        num_hidden_layers=12,
        intermediate_size=3072,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        max_position_embeddings=514,
        type_vocab_size=1,
        pad_token_id=1,
    )
    return {**hf, **overrides}


def test_normaliser_on_real_shaped_configs():
    xlmr = normalize_hf_config(encoder_config())
    assert (xlmr.max_position_embeddings, xlmr.position_offset, xlmr.head_dim) == (512, 2, 64)
    assert xlmr.encoder_only and xlmr.layer_norm_eps == 1e-5 and xlmr.num_key_value_heads == 12
    minilm = normalize_hf_config(
        encoder_config(architectures=["BertModel"], model_type="bert", hidden_size=384, max_position_embeddings=512)
    )
    assert (minilm.max_position_embeddings, minilm.position_offset, minilm.head_dim) == (512, 0, 32)
    llama = normalize_hf_config(
        dict(architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=8, num_attention_heads=2)
        | dict(num_hidden_layers=1, intermediate_size=16)
    )
    assert not llama.encoder_only


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key' is not supported"),
        ({"is_decoder": True}, "is_decoder=true"),
    ],
)
def test_normaliser_rejects_what_it_cannot_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        normalize_hf_config(encoder_config(**overrides))


def test_unsupported_activation_is_named():
    config = normalize_hf_config(encoder_config(hidden_act="quick_gelu", num_hidden_layers=1, vocab_size=10))
    with pytest.raises(ValueError, match="hidden_act='quick_gelu' is not supported; supported: gelu"):
        load_model(None, config, load_format="dummy", dtype=torch.float32, device=CPU)


def _tp_worker(rank, world_size, init_file, model_dir, seqs, out_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        config = normalize_hf_config(load_hf_config(model_dir))
        model = load_model(model_dir, config, dtype=torch.float32, device=CPU)
        assert model.encoder.layer[0].attention.self.attn.num_heads == 2  # really split
        outputs = run_flat(model, seqs)
        if rank == 0:
            torch.save(outputs, out_file)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_matches_hf(tiny_encoder_dir, tmp_path):
    """TP=2 over gloo: heads, the MLP and the vocabulary split; biases counted once."""
    import torch.multiprocessing as mp

    path, _, _, hf, tok = load_case("roberta", tiny_encoder_dir)
    seqs = [tok(t)["input_ids"] for t in TEXTS]
    out_file = tmp_path / "hidden.pt"
    args = (2, str(tmp_path / "init"), str(path), seqs, str(out_file))
    mp.start_processes(_tp_worker, args=args, nprocs=2, start_method="spawn")
    for got, seq in zip(torch.load(out_file), seqs):
        torch.testing.assert_close(got, hf_hidden(hf, seq), atol=ATOL, rtol=RTOL)
