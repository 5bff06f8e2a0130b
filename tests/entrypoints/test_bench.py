"""``pagedllm bench ...`` end to end on the tiny llama with tiny sizes: each command prints a table
and a JSON line whose keys are there and whose numbers are positive. Speed is not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.entrypoints.bench import latency, machine
from pagedllm.entrypoints.bench.datasets import long_prompt_mix_requests
from pagedllm.entrypoints.cli import main

from .openai.conftest import RemoteServer


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    with RemoteServer(model_dir, ["--served-model-name", "tiny"]) as srv:
        yield srv


def run_bench(capsys, tmp_path: Path, *argv: str) -> dict:
    out_json = tmp_path / "report.json"
    assert main(["bench", *argv, "--output-json", str(out_json)]) == 0
    stdout = capsys.readouterr().out
    last = json.loads(stdout.strip().splitlines()[-1])
    assert json.loads(out_json.read_text()) == last
    return last


def test_throughput(capsys, tmp_path, model_dir):
    report = run_bench(
        capsys,
        tmp_path,
        "throughput",
        "--model",
        str(model_dir),
        "--num-requests",
        "6",
        "--prompt-len",
        "8",
        "24",
        "--output-len",
        "2",
        "6",
        "--max-num-seqs",
        "4",
    )
    (paged,) = report["results"]
    assert paged["system"] == "pagedllm" and paged["requests"] == 6
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s"):
        assert paged[key] > 0


def test_throughput_prefix_dataset_hits_cache(capsys, tmp_path, model_dir):
    report = run_bench(
        capsys,
        tmp_path,
        "throughput",
        "--model",
        str(model_dir),
        "--dataset",
        "prefix",
        "--num-requests",
        "4",
        "--prefix-len",
        "48",
        "--prompt-len",
        "2",
        "4",
        "--output-len",
        "2",
        "2",
        "--max-num-seqs",
        "1",
    )
    assert "from the prefix cache" in report["results"][0]["note"]
    assert report["results"][0]["prompt_tokens"] >= 4 * 50


def latency_args(model_dir: Path, *batch_sizes: str, prefill_len: str = "24") -> list[str]:
    """``bench latency`` on the tiny model with the smallest sizes that still time every figure."""
    return [
        "latency",
        "--model",
        str(model_dir),
        "--batch-sizes",
        *batch_sizes,
        "--decode-steps",
        "2",
        "--warmup-steps",
        "1",
        "--prefill-len",
        prefill_len,
        "--prefill-iters",
        "1",
        "--limits-copy-mib",
        "8",
        "--limits-gemm-n",
        "128",
    ]


def test_latency(capsys, tmp_path, model_dir):
    report = run_bench(capsys, tmp_path, *latency_args(model_dir, "1", "3"))
    assert report["machine"]["copy_gbps"] > 0 and report["machine"]["gemm_gflops"] > 0
    figures = [(r["figure"], r["batch"]) for r in report["results"]]
    assert figures == [("prefill", 1), ("decode", 1), ("decode", 3)]
    for r in report["results"]:
        for key in ("seconds", "tokens_per_s", "gbps", "gflops", "floor_tokens_per_s", "x_floor", "model_s"):
            assert r[key] > 0, key
        assert 0 <= r["engine_overhead"] < 1


def test_latency_decode_batch_whose_prompts_prefill_over_several_steps(capsys, tmp_path, model_dir):
    """The first requests decode while the later prompts still prefill (8 x 48 tokens in steps of
    ~80): their max_tokens count those steps, so none finishes before the timed steps end."""
    args = latency_args(model_dir, "8", prefill_len="16")
    report = run_bench(capsys, tmp_path, *args, "--decode-prompt-len", "48", "--max-num-batched-tokens", "64")
    decode = [r for r in report["results"] if r["figure"] == "decode"]
    assert [(r["batch"], r["tokens"]) for r in decode] == [(8, 8)] and decode[0]["seconds"] > 0


def test_latency_rounds_report_the_median_round(capsys, tmp_path, model_dir):
    report = run_bench(capsys, tmp_path, *latency_args(model_dir, "2", prefill_len="16"), "--rounds", "3")
    assert [(r["figure"], r["batch"]) for r in report["results"]] == [("prefill", 1), ("decode", 2)]
    assert any("median of 3 rounds" in note for note in report["notes"])


def test_median_over_rounds_keeps_one_runs_measurement():
    def m(system: str, batch: int, seconds: float) -> latency.Measurement:
        return latency.Measurement(system, "decode", batch, batch, seconds, 1, 1, 1.0, seconds * 2, seconds)

    rounds = [
        [m("pagedllm", 1, 3.0), m("llama.cpp", 1, 1.0)],
        [m("pagedllm", 1, 1.0), m("llama.cpp", 1, 2.0)],
        [m("pagedllm", 1, 2.0), m("llama.cpp", 1, 9.0)],
        [m("pagedllm", 1, 5.0), m("llama.cpp", 1, 4.0)],
    ]
    picked = {r.system: r for r in latency.median_over_rounds(rounds)}
    # Four rounds: the lower middle, whose engine timings come with it.
    assert (picked["pagedllm"].seconds, picked["pagedllm"].core_s) == (2.0, 4.0)
    assert picked["llama.cpp"].seconds == 2.0


def test_latency_rejects_zero_rounds(capsys, model_dir):
    assert main(["bench", "latency", "--model", str(model_dir), "--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err


def test_prefix(capsys, tmp_path, model_dir):
    report = run_bench(
        capsys,
        tmp_path,
        "prefix",
        "--model",
        str(model_dir),
        "--num-requests",
        "4",
        "--prefix-len",
        "48",
        "--prompt-len",
        "2",
        "4",
        "--output-len",
        "1",
        "2",
        "--wave-size",
        "2",
        "--cached-prefix-len",
        "64",
        "--probe-suffix-len",
        "4",
        "--iters",
        "1",
    )
    on, off = report["results"]
    assert on["prefix_caching"] and not off["prefix_caching"]
    assert on["workload"]["hit_rate"] > 0 and off["workload"]["hit_rate"] == 0
    assert on["probe"]["cached_tokens"] >= 48 and off["probe"]["cached_tokens"] == 0
    assert report["cached_prefix_ttft_speedup"] > 0 and on["workload"]["ttft_s"]["median"] > 0


def test_serve(capsys, tmp_path, model_dir, server):
    report = run_bench(
        capsys,
        tmp_path,
        "serve",
        "--base-url",
        server.url,
        "--model",
        str(model_dir),
        "--dataset",
        "long-prompts-mix",
        "--num-requests",
        "5",
        "--prompt-len",
        "4",
        "8",
        "--output-len",
        "3",
        "5",
        "--long-prompt-len",
        "64",
        "96",
        "--long-output-len",
        "2",
        "2",
        "--long-fraction",
        "0.4",
        "--request-rate",
        "50",
        "--max-concurrency",
        "3",
    )
    assert report["model"] == "tiny" and report["completed"] == 5 and report["failed"] == 0
    assert report["short_outputs"] == 0
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(report[key]) == {"mean", "median", "p90", "p99"} and report[key]["median"] > 0
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0


def test_serve_counts_failures(capsys, tmp_path, server):
    report = run_bench(
        capsys,
        tmp_path,
        "serve",
        "--base-url",
        server.url,
        "--served-model-name",
        "nope",
        "--vocab-size",
        "512",
        "--num-requests",
        "2",
        "--prompt-len",
        "4",
        "4",
        "--output-len",
        "2",
        "2",
        "--num-warmups",
        "0",
    )
    assert report["failed"] == 2 and report["completed"] == 0 and report["errors"]


def test_long_prompt_mix_spreads_long_prompts():
    reqs = long_prompt_mix_requests(16, (4, 8), (100, 120), (5, 6), (1, 1), 0.25, 500, seed=3)
    longs = [i for i, r in enumerate(reqs) if len(r.prompt_token_ids) >= 100]
    assert longs == [3, 7, 11, 15] and all(reqs[i].output_len == 1 for i in longs)
    assert reqs == long_prompt_mix_requests(16, (4, 8), (100, 120), (5, 6), (1, 1), 0.25, 500, seed=3)


@pytest.mark.parametrize("native", [False, True])
def test_gemm_probe_dtypes_for_16_bit_models(monkeypatch, native):
    """A 16-bit model's packed linears compute in float32, so the probe takes the better of its
    dtype and float32; a 16-bit dtype without native dot products is not probed at all."""
    import torch

    from pagedllm import cpu_info

    monkeypatch.setattr(cpu_info, "native_16_bit", lambda name: native)
    assert machine._gemm_dtypes(torch.float32) == [torch.float32]
    expected = [torch.bfloat16, torch.float32] if native else [torch.float32]
    assert machine._gemm_dtypes(torch.bfloat16) == expected
    limits = machine.measure_limits(torch.float16, copy_mib=8, gemm_n=128, repeats=1)
    assert limits.gemm_gflops > 0


def test_cost_model_matches_smollm_anchor():
    from pagedllm.entrypoints.bench.common import SMOLLM_135M_SHAPE

    cost = machine.model_cost(SMOLLM_135M_SHAPE, "float32")
    assert cost.weight_bytes == pytest.approx(538e6, rel=0.01)  # the "538 MB per step"
    nbytes, flops = machine.decode_cost(cost, [32] * 64)
    assert flops > 2 * cost.params * 64 and nbytes > cost.weight_bytes


def test_gguf_export_names_and_rope_permutation(model_dir):
    pytest.importorskip("gguf")
    import torch

    from pagedllm.entrypoints.bench import baselines, gguf_export
    from pagedllm.entrypoints.bench.common import read_hf_config

    config = read_hf_config(model_dir)
    state = baselines.load_hf_model(model_dir, True, 0).state_dict()
    names = dict(gguf_export.gguf_tensors(state, config))
    assert {"token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight"} <= set(names)
    q = state["model.layers.0.self_attn.q_proj.weight"].numpy()
    head_dim = q.shape[0] // config["num_attention_heads"]
    assert (names["blk.0.attn_q.weight"][1] == q[head_dim // 2]).all()  # row 1 = first row of the 2nd half
    assert torch.equal(torch.from_numpy(names["blk.0.attn_v.weight"]), state["model.layers.0.self_attn.v_proj.weight"])


def test_gguf_matches_hf_logits_in_llama_cpp(model_dir, tmp_path):
    """The llama.cpp baseline computes the same function as the HF one (skipped without llama.cpp)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import torch

    from pagedllm.entrypoints.bench import baselines, gguf_export, llama_cpp
    from pagedllm.entrypoints.bench.common import read_hf_config

    config = read_hf_config(model_dir)
    hf = baselines.load_hf_model(model_dir, True, 0)
    path = gguf_export.write_gguf(hf.state_dict(), config, tmp_path / "tiny.gguf")
    prompt = list(range(20, 60))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1].numpy()
    llm = llama_cpp.LlamaCpp(path, 1, 64, 64)
    try:
        llm.decode(llama_cpp.prompt_entries(prompt, 0))
        got = llm.last_logits(config["vocab_size"])
    finally:
        llm.close()
    assert abs(got - expected).max() < 1e-2 * abs(expected).max()  # llama.cpp keeps K/V in f16


def test_dummy_model_dir_and_help(tmp_path, capsys):
    from pagedllm.entrypoints.bench.common import model_limits

    assert main(["bench", "dummy-model", str(tmp_path / "smol")]) == 0
    assert model_limits(tmp_path / "smol") == (49152, 2048)
    assert (tmp_path / "smol" / "tokenizer.json").exists()
    for command in ("throughput", "latency", "serve", "prefix"):
        with pytest.raises(SystemExit) as exc:
            main(["bench", command, "--help"])
        assert exc.value.code == 0
    assert "--llama-cpp-baseline" in capsys.readouterr().out


def test_old_offline_throughput_command_maps_to_bench():
    from benchmarks.offline_throughput import translate

    assert translate(["--num-requests", "4", "--hf-batch-size", "8"]) == [
        "bench",
        "throughput",
        "--hf-baseline",
        "--num-requests",
        "4",
        "--hf-batch-sizes",
        "8",
    ]
    assert translate(["--skip-hf"]) == ["bench", "throughput"]


def test_latency_on_a_gguf_file_against_its_own_file_in_llama_cpp(capsys, tmp_path, model_dir):
    """``--model FILE.gguf``: the shapes from the file's header, pagedllm on the file's default
    method, llama.cpp (when installed) and transformers on the very same file."""
    pytest.importorskip("gguf")
    from pagedllm.entrypoints.bench import baselines, gguf_export, llama_cpp
    from pagedllm.entrypoints.bench.common import BenchModel, read_hf_config

    config = read_hf_config(model_dir)
    path = gguf_export.write_gguf(baselines.load_hf_model(model_dir, True, 0).state_dict(), config, tmp_path / "t.gguf")
    from_file = read_hf_config(path)
    assert from_file == {key: config.get(key, from_file[key]) for key in from_file}
    with llama_cpp.gguf_for(BenchModel(path, "auto", False, "t"), 0) as served:
        assert served == path  # llama.cpp runs the file itself, not a conversion
    baselines_flags = ["--hf-baseline", *(["--llama-cpp-baseline"] if llama_cpp.available() else [])]
    report = run_bench(capsys, tmp_path, *latency_args(path, "1"), *baselines_flags)
    weights = {r["system"]: r["weights"] for r in report["results"]}
    assert weights["pagedllm"] == "gguf, head float32" and weights["hf"] == "float32"  # the file's method, an F32 head
    if llama_cpp.available():
        assert weights["llama.cpp"] == "the file's own"
