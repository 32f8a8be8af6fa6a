"""Content keys: chained, layout-free, stable across processes, bound to model and salt."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from store.keys import (
    ModelIdentity,
    entry_name,
    page_keys,
    root_key,
    salted_root,
    weights_fingerprint,
)

CONFIG = {"hidden_size": 64, "num_hidden_layers": 4}
TOKENS = list(range(1000, 1000 + 50))


def identity(**changes) -> ModelIdentity:
    args = dict(config=CONFIG, weights="abc", kv_dtype="float32", page_size=16)
    return ModelIdentity.create(**{**args, **changes})


def test_only_full_pages_have_keys_and_they_chain():
    root = root_key(identity())
    keys = page_keys(root, TOKENS, 16)
    assert len(keys) == 3 and len(set(keys)) == 3
    # a prefix shares its keys; a change in page 2 changes page 2 and every later key
    assert page_keys(root, TOKENS[:32], 16) == keys[:2]
    changed = TOKENS[:20] + [7] + TOKENS[21:]
    other = page_keys(root, changed, 16)
    assert other[0] == keys[0] and other[1] != keys[1] and other[2] != keys[2]


def test_keys_are_stable_across_processes():
    here = [k.hex() for k in page_keys(root_key(identity(), "tenant-a"), TOKENS, 16)]
    code = (
        "from store.keys import ModelIdentity, page_keys, root_key\n"
        f"i = ModelIdentity.create(config={CONFIG!r}, weights='abc', kv_dtype='float32', "
        "page_size=16)\n"
        f"print(' '.join(k.hex() for k in page_keys(root_key(i, 'tenant-a'), {TOKENS!r}, 16)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == here


@pytest.mark.parametrize(
    "changes",
    [
        dict(weights="abd"),
        dict(kv_dtype="bfloat16"),
        dict(page_size=32),
        dict(config={**CONFIG, "hidden_size": 128}),
    ],
)
def test_model_identity_changes_every_key(changes):
    base = page_keys(root_key(identity()), TOKENS, 32)
    other = page_keys(root_key(identity(**changes)), TOKENS, 32)
    assert not set(base) & set(other)


def test_salt_separates_tenants():
    a = page_keys(root_key(identity(), "a"), TOKENS, 16)
    b = page_keys(root_key(identity(), "b"), TOKENS, 16)
    none = page_keys(root_key(identity()), TOKENS, 16)
    assert not set(a) & set(b) and not set(a) & set(none)


def test_weights_fingerprint_sees_values():
    w = {"a": np.arange(10000, dtype=np.float32), "b": np.ones((3, 3), np.float32)}
    same = {"b": np.ones((3, 3), np.float32), "a": np.arange(10000, dtype=np.float32)}
    assert weights_fingerprint(w) == weights_fingerprint(same)
    w2 = dict(w, a=w["a"] + 1)
    assert weights_fingerprint(w) != weights_fingerprint(w2)


def test_entry_names_and_bad_ids():
    key = page_keys(root_key(identity()), TOKENS, 16)[0]
    assert entry_name(key) == key.hex() and entry_name(key, gdn=True) == key.hex() + ".gdn"
    with pytest.raises(ValueError, match="token_ids"):
        page_keys(key, [-1] * 16, 16)
    with pytest.raises(ValueError, match="page_size"):
        identity(page_size=0)


def test_key_chains_hash_each_page_once_while_a_sequence_grows():
    from store.bridge import KeyChains

    root = root_key(ModelIdentity.create({"m": 1}, "w", "float32", 4))
    tokens = list(range(4 * 40))
    chains = KeyChains(4)
    for pages in range(1, 41):  # publish page by page, as a generating request does
        got = chains.keys(root, tokens, pages, resume=pages - 1)
        assert got == page_keys(root, tokens[: 4 * pages], 4)
    assert chains.hashed_pages == 40  # not 1 + 2 + ... + 40
    assert chains.keys(root, tokens, 40, resume=40) == page_keys(root, tokens, 4)
    assert chains.hashed_pages == 40  # an exact repeat is a hit
    salted = salted_root(root, "tenant-a")
    assert chains.keys(salted, tokens, 2, resume=1) == page_keys(salted, tokens[:8], 4)
    assert chains.hashed_pages == 42  # another root's chain is its own, never the cached one
    with pytest.raises(ValueError, match="uint32"):
        chains.keys(root, [-1] * 4, 1, resume=0)


def test_salted_roots_share_no_key():
    root = root_key(ModelIdentity.create({"m": 1}, "w", "float32", 4))
    tokens = list(range(8))
    roots = [root, salted_root(root, "a"), salted_root(root, "b"), salted_root(root, "")]
    assert salted_root(root, None) == root
    chains = [page_keys(r, tokens, 4) for r in roots]
    assert len({k for chain in chains for k in chain}) == 2 * len(roots)
