"""Session checkpoints on the offline engine: a branch continues byte for byte where the
straight-through run went, across a flip and a restart; every refusal names its reason and
changes nothing; pins hold against eviction until the checkpoint is deleted."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from flipjax import Engine, FlipjaxConfig, SamplingParams
from flipjax.model.tiny import TINY_SEED, tiny_config, tiny_model
from flipjax.model.tokenizer import ByteTokenizer
from store.checkpoints import CheckpointError
from store.entry import Kind
from store.manifest import FORMAT_VERSION, Manifest, ManifestError
from store.open import open_checkpoints, open_store
from tests.support.internals import parts
from tests.support.pool_checks import assert_pools_returned

PS, GRID = 8, 16
PROMPT = [(i * 13 + 7) % 256 for i in range(45)]
N, K = 24, 10  # tokens straight through; tokens before the checkpoint
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=N),
    "seeded": SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=N),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model(jnp.float32)


def make(model, folder, host_mb: float = 64, layout: str | None = None, disk: bool = True):
    """An engine over a store (host RAM, and disk in `folder`) with a checkpoint book."""
    bridge, identity = open_store(
        tiny_config(),
        f"tiny-seed-{TINY_SEED}",
        "float32",
        PS,
        GRID,
        int(host_mb * 2**20),
        str(folder) if disk else None,
        2**30,
    )
    book = open_checkpoints(bridge, identity, str(folder) if disk else None)
    config = FlipjaxConfig.build(
        dtype="float32",
        page_size=PS,
        max_prefill_tokens=64,
        num_pages=256,
        max_running_requests=4,
        prefetch_wait_s=30,  # a restored prefix is always read, however loaded the machine
        layout=layout,
    )
    return Engine(
        model, ByteTokenizer(), config, name="tiny", prefix_store=bridge, checkpoints=book
    )


def run(engine: Engine, request_id: str) -> list[int]:
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                return out.token_ids


@pytest.fixture(scope="module")
def straight(model):
    """Straight-through token ids per sampling, from an engine with no cache or store; run
    twice to prove the reference is itself deterministic (A vs A)."""
    config = FlipjaxConfig.build(
        dtype="float32", page_size=PS, max_prefill_tokens=64, prefix_cache=False
    )
    plain = Engine(model, ByteTokenizer(), config, name="tiny")
    found = {}
    for name, params in SAMPLINGS.items():
        a, b = (plain.generate([PROMPT], sampling=params)[0].token_ids for _ in range(2))
        assert a == b, f"{name}: the straight-through run is not deterministic"
        found[name] = a
    return found


def checkpoint_after_k(engine: Engine, params: SamplingParams, session: str) -> dict:
    rid = engine.add_request(PROMPT, params.replace(max_tokens=K), session_id=session)
    run(engine, rid)
    return engine.checkpoint(session_id=session)


@pytest.mark.parametrize("name", SAMPLINGS)
def test_a_branch_continues_byte_for_byte(model, straight, tmp_path, name):
    engine = make(model, tmp_path)
    summary = checkpoint_after_k(engine, SAMPLINGS[name], "s")
    assert summary["requested_position"] == len(PROMPT) + K == 55
    assert summary["position"] == 48, "snapped down to the grid"
    assert summary["generated_tokens"] == K
    engine.flush_prefix_cache()  # the seed must come from the store
    rid = engine.branch(summary["checkpoint_id"], max_new_tokens=N - K)
    assert straight[name][:K] + run(engine, rid) == straight[name]
    assert engine.stats().prefix.get("hits_host", 0) >= 1
    assert_pools_returned(engine)


def test_a_quiesced_request_is_checkpointed_mid_generation_and_resumes(model, straight, tmp_path):
    engine = make(model, tmp_path)
    rid = engine.add_request(PROMPT, SAMPLINGS["seeded"])
    while len(engine.progress(rid).new_ids) < 7:
        engine.step()
    with pytest.raises(CheckpointError, match="still generating"):
        engine.checkpoint(request_id=rid)
    summary = engine.checkpoint(request_id=rid, quiesce=True)
    # A decode step run ahead may have had its token in flight: the checkpoint holds it too.
    k = summary["generated_tokens"]
    assert k == len(engine.progress(rid).new_ids) in (7, 8) and summary["position"] == 48
    assert run(engine, rid) == straight["seeded"], "the checkpointed request resumed unchanged"
    branch = engine.branch(summary["checkpoint_id"], max_new_tokens=N - k)
    assert straight["seeded"][:k] + run(engine, branch) == straight["seeded"]


def test_an_unseeded_request_branches_with_its_rng_state(model, tmp_path):
    """No seed given: the engine drew one, and the checkpoint must carry it. The drawn seed
    differs per run, so EOS is ignored: a draw that ends early must not end the test early."""
    engine = make(model, tmp_path)
    params = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True)
    rid = engine.add_request(PROMPT, params)
    while len(engine.progress(rid).new_ids) < K:
        engine.step()
    summary = engine.checkpoint(request_id=rid, quiesce=True)
    k = summary["generated_tokens"]  # K, or K + 1 with a token in flight
    original = run(engine, rid)
    branch = engine.branch(summary["checkpoint_id"], max_new_tokens=N - k)
    assert len(original) == N and original[:k] + run(engine, branch) == original


def test_a_branch_across_a_flip_and_a_restart(model, straight, tmp_path):
    engine = make(model, tmp_path, layout="single")
    summary = checkpoint_after_k(engine, SAMPLINGS["seeded"], "s")
    engine.flip("tp:2")
    rid = engine.branch(summary["checkpoint_id"], max_new_tokens=N - K)
    assert straight["seeded"][:K] + run(engine, rid) == straight["seeded"]
    parts(engine).prefix_store.store.close()

    restarted = make(model, tmp_path)  # new store objects and book over the same folder
    assert [c["checkpoint_id"] for c in restarted.list_checkpoints()] == [summary["checkpoint_id"]]
    rid = restarted.branch(summary["checkpoint_id"], max_new_tokens=N - K)
    assert straight["seeded"][:K] + run(restarted, rid) == straight["seeded"]
    assert restarted.stats().prefix.get("hits_disk", 0) == 1


def test_refusals_name_their_reason_and_change_nothing(model, tmp_path):
    engine = make(model, tmp_path)
    params = SAMPLINGS["greedy"]
    rid = engine.add_request(PROMPT[:12], params.replace(max_tokens=2), session_id="short")
    run(engine, rid)
    with pytest.raises(CheckpointError, match="snaps to 0"):
        engine.checkpoint(session_id="short")
    with pytest.raises(CheckpointError, match="exactly one"):
        engine.checkpoint()
    with pytest.raises(KeyError, match="not a session"):
        engine.checkpoint(session_id="nobody")
    checkpoint_after_k(engine, params, "s")
    with pytest.raises(CheckpointError, match="position: 99"):
        engine.checkpoint(session_id="s", position=99)
    with pytest.raises(KeyError, match="not a checkpoint"):
        engine.branch("0" * 32)
    config = FlipjaxConfig.build(dtype="float32", page_size=PS)
    no_book = Engine(model, ByteTokenizer(), config, name="tiny")
    with pytest.raises(CheckpointError, match="no store"):
        no_book.branch("0" * 32)
    assert len(engine.list_checkpoints()) == 1 and not engine.has_unfinished()


@pytest.mark.parametrize("lost", ["page", "anchor"])
def test_a_missing_reference_refuses_the_branch_and_seeds_nothing(model, tmp_path, lost):
    engine = make(model, tmp_path)
    summary = checkpoint_after_k(engine, SAMPLINGS["greedy"], "s")
    refs = parts(engine).sessions.book.references(summary["checkpoint_id"])
    key, kind = refs[1] if lost == "page" else refs[-1]
    assert kind == (Kind.KV_PAGE if lost == "page" else Kind.GDN_ANCHOR)
    assert parts(engine).prefix_store.store.delete(key, kind)
    free = engine.stats().pools["pages_free"]
    what = "page 1" if lost == "page" else "GDN anchor"
    with pytest.raises(CheckpointError, match=f"its {what} .* is not in the store"):
        engine.branch(summary["checkpoint_id"])
    assert not engine.has_unfinished() and engine.stats().pools["pages_free"] == free


def test_pins_hold_against_eviction_until_the_checkpoint_is_deleted(model, straight, tmp_path):
    # A host tier of about 40 entries and no disk: eviction pressure is real.
    engine = make(model, tmp_path, host_mb=0.5, disk=False)
    summary = checkpoint_after_k(engine, SAMPLINGS["greedy"], "s")
    cid, store = summary["checkpoint_id"], parts(engine).prefix_store.store
    refs = parts(engine).sessions.book.references(cid)
    assert all(store.pinned(key, kind) == 1 for key, kind in refs)
    flood = [[(k * 31 + i) % 256 for i in range(120)] for k in range(12)]
    engine.generate(flood, max_new_tokens=4)
    assert store.host.counters["evictions"] > 0
    assert all(store.where(key, kind) == "host" for key, kind in refs)
    engine.flush_prefix_cache()
    rid = engine.branch(cid, max_new_tokens=N - K)
    assert straight["greedy"][:K] + run(engine, rid) == straight["greedy"]

    engine.delete_checkpoint(cid)
    assert all(store.pinned(key, kind) == 0 for key, kind in refs)
    assert not engine.list_checkpoints()
    with pytest.raises(KeyError, match="not a checkpoint"):
        engine.delete_checkpoint(cid)
    engine.generate([[k] + f for k, f in enumerate(flood)], max_new_tokens=4)
    assert any(store.where(key, kind) is None for key, kind in refs), "unpinned, evictable"


def test_manifests_are_deterministic_versioned_and_layout_free():
    m = Manifest("ab" * 32, (1, 2, 3, 4), 2, 2, ("cd" * 32,), "cd" * 32, {"temperature": 0.0}, 5)
    again = Manifest.from_bytes(m.to_bytes())
    assert again == m and again.to_bytes() == m.to_bytes()
    assert again.checkpoint_id == m.checkpoint_id and len(m.checkpoint_id) == 32
    assert m.step == 2 and m.requested_position == 4
    text = m.to_bytes().decode()
    assert not any(word in text for word in ("device", "rank", "stage", "tp", "layout"))
    future = m.to_bytes().replace(b'"version":1', b'"version":2')
    with pytest.raises(ManifestError, match="format version 2 is not supported"):
        Manifest.from_bytes(future)
    assert FORMAT_VERSION == 1
    with pytest.raises(ManifestError, match="made for model"):
        Manifest.from_bytes(m.to_bytes(), model="ef" * 32)
    with pytest.raises(ManifestError, match="do not match"):
        Manifest.from_bytes(m.to_bytes().replace(b'"step":2', b'"step":3'))
