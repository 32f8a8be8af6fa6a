"""Prompts more than one test module sends."""

from __future__ import annotations

STORE_PROMPT = "".join(chr(97 + (i * 7) % 26) for i in range(90))  # 90 tokens: two 32-token grids
