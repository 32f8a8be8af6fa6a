"""Speculative decoding over the store and sessions: a long prompt prefilled in chunks, a
session checkpoint taken after a speculating turn, and a branch seeded from the store (whose
pages carry no draft K/V) all continue with the tokens of a straight run without drafts."""

from __future__ import annotations

from flipjax import Engine, SamplingParams
from flipjax.engine.loader import model_fingerprint
from flipjax.model.config import ModelConfig
from flipjax.model.shipped import resolve
from store.open import open_checkpoints, open_store
from tests.support.pool_checks import assert_pools_returned
from tests.support.speculation import MODEL, PROMPTS, plain, speculative

GRID, N, K = 16, 40, 24  # GDN grid; tokens straight through; tokens before the checkpoint
PARAMS = SamplingParams(temperature=0.8, seed=5, max_tokens=N)


def test_chunks_a_checkpoint_and_a_branch_from_the_store_keep_every_token(tmp_path):
    long_prompt = "\n\n".join(PROMPTS * 8)  # several prefill chunks of 256 tokens
    straight = plain(overlap=False)
    want_long = straight.generate([long_prompt], max_new_tokens=24)[0].token_ids
    [want] = [o.token_ids for o in straight.generate([PROMPTS[3]], sampling=PARAMS)]

    bridge, identity = open_store(
        ModelConfig.from_hf(resolve(MODEL)),
        model_fingerprint(MODEL),
        "float32",
        16,
        GRID,
        64 << 20,
        str(tmp_path),
        1 << 30,
    )
    book = open_checkpoints(bridge, identity, str(tmp_path))
    engine: Engine = speculative(
        3, prefix_store=bridge, checkpoints=book, gdn_checkpoint_interval=GRID
    )
    assert engine.generate([long_prompt], max_new_tokens=24)[0].token_ids == want_long
    rid = engine.add_request(PROMPTS[3], PARAMS.replace(max_tokens=K), session_id="s")
    while engine.has_unfinished():
        engine.step()
    summary = engine.checkpoint(session_id="s")
    assert summary["generated_tokens"] == K
    engine.flush_prefix_cache()  # the branch is seeded from the store
    branch = engine.branch(summary["checkpoint_id"], max_new_tokens=N - K)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})
    assert want[:K] + done[branch].token_ids == want
    assert engine.stats().prefix.get("hits_host", 0) >= 1
    assert engine.stats().speculative.accepted > 0
    assert rid not in done  # the turn finished before the checkpoint
    assert_pools_returned(engine)
