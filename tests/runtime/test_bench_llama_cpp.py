"""llama.cpp as the engine benchmark's peer: its rates are read from its own output, and a
machine that cannot build it gets the reason, never a number."""

from __future__ import annotations

import pytest

from flipjax.benchmarks import llama_cpp

# Output of `llama-batched-bench --output-format jsonl` (llama-cpp-python 0.3.36's llama.cpp)
# on the `--moe` bench checkpoint, two threads; the log lines it prints around them are skipped.
OUTPUT = """\
main: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0
{"n_kv_max": 8192, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 64, "pl": 1, \
"n_kv": 192, "t_pp": 0.225740, "speed_pp": 567.023987, "t_tg": 0.743914, "speed_tg": 86.031448, \
"t": 0.969654, "speed": 198.008774}
{"n_kv_max": 8192, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 64, "pl": 32, \
"n_kv": 6144, "t_pp": 6.928333, "speed_pp": 591.195618, "t_tg": 6.990575, "speed_tg": 292.965881, \
"t": 13.918907, "speed": 441.413971}
"""


def test_the_rates_per_batch_are_its_prompt_and_generation_speeds():
    rates = llama_cpp.parse_batched_bench(OUTPUT)
    assert sorted(rates) == [1, 32]
    assert rates[1] == llama_cpp.PeerRates(prefill_tok_s=567.023987, decode_tok_s=86.031448)
    assert rates[32] == llama_cpp.PeerRates(prefill_tok_s=591.195618, decode_tok_s=292.965881)


@pytest.mark.parametrize(
    "text,match",
    [
        ('{"pl": 1, "speed_pp": 5.0}', "unreadable row .*speed_tg"),
        ('{"pl": 1, "speed_pp": 5.0, "speed_tg": ', "unreadable row"),
        ("main: nothing ran\n", "no result rows"),
    ],
)
def test_output_it_cannot_read_is_refused_by_name(text, match):
    with pytest.raises(ValueError, match=match):
        llama_cpp.parse_batched_bench(text)


def test_without_a_compiler_the_run_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv(llama_cpp.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no cmake, no compiler, nothing downloaded
    with pytest.raises(llama_cpp.Unavailable, match="needs cmake"):
        llama_cpp.prepare_llama_cpp(tmp_path, threads=2)
    assert [p.name for p in (tmp_path / "cache").rglob("*")] == [llama_cpp.VERSION]
