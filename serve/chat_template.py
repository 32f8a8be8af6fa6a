"""Chat templates: the checkpoint's own (`tokenizer_config.json`), or a plain default.

Templates are rendered in a sandboxed jinja2 environment, since a checkpoint is untrusted
input. The default (used by the tiny model and checkpoints without a template) writes each
message as `role: content` on its own line and ends with `assistant: `.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def load_template(model_dir: str | None) -> str:
    """The checkpoint's `chat_template` if it has one, else the plain default."""
    if model_dir is None:
        return DEFAULT_TEMPLATE
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return DEFAULT_TEMPLATE
    with open(path) as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template or DEFAULT_TEMPLATE


class ChatTemplate:
    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(source)

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        return self._template.render(messages=list(messages), add_generation_prompt=True)
