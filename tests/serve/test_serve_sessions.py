"""Session checkpoints over HTTP: a session built with the openai client is checkpointed, the
server restarts over the same store directory, and a branch continues byte for byte where the
offline engine's straight-through run went; rewind, listing, deletion and refusals too."""

from __future__ import annotations

import json
import os

import httpx
import openai

from flipjax import Engine, SamplingParams
from tests.support.http import HTTP
from tests.support.servers import SMALL, start_server, stop_server

PROMPT = "".join(chr(97 + (i * 5) % 26) for i in range(50))  # 50 tokens
N, K = 20, 9  # straight-through tokens; tokens before the checkpoint
SEEDED = dict(temperature=0.9, top_k=40, seed=3)


def post(base: str, route: str, body: dict) -> httpx.Response:
    return HTTP.post(f"{base}{route}", json=body, timeout=120)


def branch_ids(base: str, body: dict) -> list[int]:
    r = post(base, "/session_branch", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_checkpoint_restart_branch_rewind(tmp_path):
    straight = Engine.from_pretrained("tiny").generate(
        [PROMPT], sampling=SamplingParams(max_tokens=N, **SEEDED)
    )[0]
    flags = ("--store-dir", str(tmp_path / "store"), "--gdn-checkpoint-interval", "32", *SMALL)
    with open(tmp_path / "a.txt", "w") as log:
        proc, base = start_server(log, *flags)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
        turn = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=K,
            temperature=0.9,
            seed=3,
            extra_body={"session_id": "s", "top_k": 40},
        )
        first = turn.choices[0].model_extra["token_ids"]
        assert first == straight.token_ids[:K]
        r = post(base, "/session_checkpoint", {"session_id": "s"})
        assert r.status_code == 200, r.text
        summary = r.json()
        assert (summary["requested_position"], summary["position"]) == (len(PROMPT) + K, 32)
        cid = summary["checkpoint_id"]

        r = post(base, "/session_checkpoint", {"session_id": "s", "position": 20})
        assert r.status_code == 400 and r.json()["error"]["param"] == "position"
        r = post(base, "/session_checkpoint", {"session_id": "nobody"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"
        r = post(base, "/session_checkpoint", {"session_id": "s", "request_id": "x"})
        assert r.status_code == 400
        r = post(base, "/session_branch", {"checkpoint_id": "0" * 32})
        assert r.status_code == 404 and r.json()["error"]["param"] == "checkpoint_id"
    finally:
        stop_server(proc)

    # A foreign model's manifest in the folder is left unused, never parsed into a checkpoint.
    folder = next((tmp_path / "store").glob("*/manifests"))
    mine = json.loads((folder / f"{cid}.json").read_bytes())
    (folder / f"{'f' * 32}.json").write_text(json.dumps({**mine, "model": "ee" * 32}))

    with open(tmp_path / "b.txt", "w") as log:
        proc, base = start_server(log, *flags)
    try:
        listed = HTTP.get(f"{base}/session_checkpoints", timeout=30).json()["data"]
        assert [c["checkpoint_id"] for c in listed] == [cid]
        rest = branch_ids(base, {"checkpoint_id": cid, "max_tokens": N - K})
        assert first + rest == straight.token_ids, "the branch left the straight-through path"
        streamed = HTTP.post(
            f"{base}/session_branch",
            timeout=120,
            json={"checkpoint_id": cid, "max_tokens": N - K, "stream": True},
        )
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in streamed.text.splitlines()
            if line.startswith("data: {")
        )
        assert text == Engine.from_pretrained("tiny").info.tokenizer.decode(rest)

        # Rewind: a new session continues from the checkpoint as a branch with that prompt does.
        r = post(base, "/session_rewind", {"session_id": "t", "checkpoint_id": cid})
        assert r.status_code == 200, r.text
        body = {"model": "tiny", "prompt": " next", "max_tokens": 6, "temperature": 0}
        r = post(base, "/v1/completions", {**body, "session_id": "t"})
        via_session = r.json()["choices"][0]["token_ids"]
        via_branch = branch_ids(
            base, {"checkpoint_id": cid, "prompt": " next", "max_tokens": 6, "temperature": 0}
        )
        assert via_session == via_branch

        # A chat session renders the whole conversation each turn; the earlier turns come back
        # from the prefix cache.
        chat = {"model": "tiny", "max_tokens": 4, "temperature": 0, "session_id": "c"}
        one = post(
            base,
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": "first turn " * 8}]},
        ).json()
        two = post(
            base,
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": "second"}]},
        ).json()
        assert two["usage"]["prompt_tokens"] > one["usage"]["total_tokens"]
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32

        assert HTTP.delete(f"{base}/session_checkpoint/{cid}", timeout=30).status_code == 200
        assert HTTP.delete(f"{base}/session_checkpoint/{cid}", timeout=30).status_code == 404
        assert HTTP.get(f"{base}/session_checkpoints", timeout=30).json()["data"] == []
    finally:
        stop_server(proc)
    assert os.path.exists(folder / f"{'f' * 32}.json"), "an unreadable manifest stays in place"
