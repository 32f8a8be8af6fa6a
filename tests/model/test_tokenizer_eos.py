"""A checkpoint's end-of-sequence token is the one transformers' tokenizer names, so a greedy
`generate_until` ends where lm-eval's transformers backend cuts it (issue #35, item 6).

lm-eval's HF backend adds the tokenizer's EOS text to the stop strings and stops when a window of
the newest tokens, decoded with special tokens kept, contains one of them. A checkpoint whose
`config.json` names no EOS still has one in transformers: the tokenizer files name it, or
`Qwen2Tokenizer` (what `AutoTokenizer` builds for qwen3_next) defaults to `<|endoftext|>`.
"""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text
from lm_eval.models.utils_hf import stop_sequences_criteria
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from flipjax import Engine, SamplingParams
from flipjax.model.tokenizer import load_tokenizer
from tests.support.hf_oracle import make_checkpoint
from tests.support.tokenizers import byte_tokenizer

PROMPT = "Q: What is two plus two?\nA:"
MAX_TOKENS = 12
EOT, IM_END = "<|endoftext|>", "<|im_end|>"


def lm_eval_hf_cut(model, folder: str, until: list[str]) -> str:
    """What lm-eval's `HFLM.generate_until` answers, built from its own parts (HFLM itself
    needs `accelerate`): the EOS text joins `until`, generation stops on lm-eval's criteria,
    and the decoded continuation is cut at the first stop string."""
    tok = AutoTokenizer.from_pretrained(folder)
    until = handle_stop_sequences(
        list(until), eos=tok.decode(tok.eos_token_id, skip_special_tokens=False)
    )
    ctx = torch.tensor([tok.encode(PROMPT, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(
            input_ids=ctx,
            max_length=ctx.shape[1] + MAX_TOKENS,
            stopping_criteria=stop_sequences_criteria(tok, until, ctx.shape[1], 1),
            pad_token_id=tok.pad_token_id,
            do_sample=False,
        )
    return postprocess_generated_text(tok.decode(out[0, ctx.shape[1] :].tolist()), until, None)


def test_generation_ends_where_lm_evals_transformers_backend_cuts_it(tmp_path):
    folder = str(tmp_path)
    model = make_checkpoint(folder, seed=7, vocab_size=257)
    byte_tokenizer(f"{folder}/tokenizer.json")
    prompt = load_tokenizer(folder, None).encode(PROMPT)
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    greedy = greedy[0, len(prompt) :].tolist()
    # The special token takes the id of a token greedy decoding emits a few steps in (one the
    # prompt does not use), as a trained tokenizer's `<|endoftext|>` is a token the model emits.
    newline = load_tokenizer(folder, None).encode("\n")[0]
    step = next(
        k
        for k in range(3, MAX_TOKENS - 2)
        if greedy[k] not in prompt + greedy[:k] and newline not in greedy[: k + 1]
    )
    byte_tokenizer(f"{folder}/tokenizer.json", specials={greedy[step]: EOT})
    assert load_tokenizer(folder, None).encode(PROMPT) == prompt

    want = lm_eval_hf_cut(model, folder, ["\n"])
    engine = Engine.from_pretrained(folder, dtype="float32", max_running_requests=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["\n"])
    out = engine.generate([PROMPT], sampling=params)[0]
    assert out.text == want
    assert out.token_ids == greedy[: step + 1] and out.finish_reason == "stop"


CASES = {
    "no tokenizer_config.json": {},
    "a chat template only": {"tokenizer_config.json": {"chat_template": "{{ messages }}"}},
    "eos_token": {"tokenizer_config.json": {"eos_token": IM_END}},
    "eos_token as an AddedToken": {
        "tokenizer_config.json": {
            "eos_token": {"__type": "AddedToken", "content": IM_END, "special": True}
        }
    },
    "eos_token null": {"tokenizer_config.json": {"eos_token": None}},
    "another tokenizer class": {"tokenizer_config.json": {"tokenizer_class": "TokenizersBackend"}},
    "Qwen2TokenizerFast": {"tokenizer_config.json": {"tokenizer_class": "Qwen2TokenizerFast"}},
    "special_tokens_map.json first": {
        "special_tokens_map.json": {"eos_token": IM_END},
        "tokenizer_config.json": {"eos_token": EOT},
    },
    "a token not in the vocabulary": {"tokenizer_config.json": {"eos_token": "<|absent|>"}},
}


@pytest.mark.parametrize("files", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("config_eos", [None, 65])
def test_eos_is_the_one_transformers_names(tmp_path, files, config_eos):
    """config.json's EOS, or else the one transformers' tokenizer names (where that one is
    outside the vocabulary, transformers appends it past what the model can emit: none)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    byte_tokenizer(str(tmp_path / "tokenizer.json"), specials={3: EOT, 9: IM_END})
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    hf = AutoTokenizer.from_pretrained(str(tmp_path)).eos_token_id
    vocab = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size()
    want = config_eos if config_eos is not None else hf if hf is not None and hf < vocab else None
    assert load_tokenizer(str(tmp_path), config_eos).eos_token_id == want


def test_generation_stops_on_every_eos_the_generation_config_lists(tmp_path):
    """A Qwen3-Next instruct checkpoint lists two EOS ids in generation_config.json; generation
    ends on either, as transformers' `generate` (the oracle, reading the same folder) ends."""
    folder = str(tmp_path)
    model = make_checkpoint(folder, seed=7, vocab_size=257)
    byte_tokenizer(f"{folder}/tokenizer.json")
    prompt = load_tokenizer(folder, None).encode(PROMPT)
    with torch.no_grad():
        free = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    free = free[0, len(prompt) :].tolist()
    other = next(free[k] for k in range(3, MAX_TOKENS) if free[k] not in free[:k])
    unused = next(i for i in range(257) if i not in prompt + free)
    with open(f"{folder}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": [unused, other], "do_sample": False}, f)

    oracle = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = oracle.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    want = want[0, len(prompt) :].tolist()
    assert want[-1] == other and len(want) < MAX_TOKENS  # transformers stopped on it
    engine = Engine.from_pretrained(folder, dtype="float32", max_running_requests=2)
    assert engine.info.tokenizer.eos_token_ids == {unused, other}
    out = engine.generate([prompt], sampling=SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert out[0].token_ids == want and out[0].finish_reason == "stop"
    ignoring = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert engine.generate([prompt], sampling=ignoring)[0].token_ids == free
