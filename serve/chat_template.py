"""Chat templates: the checkpoint's own (`tokenizer_config.json`), or a plain default.

Templates are rendered in a sandboxed jinja2 environment, since a checkpoint is untrusted
input, with the variables Qwen3's templates read: `messages`, `tools`,
`add_generation_prompt`, and any `chat_template_kwargs` (`enable_thinking`, ...). The default
(the tiny model's, and that of checkpoints without a template) writes each message as
`role: content` on its own line, describes the tools and the `<tool_call>` format first, writes
an assistant's calls as `<tool_call>` blocks, and ends with `assistant: `.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TEMPLATE = (
    "{% if tools %}system: You may call these tools. To call one, answer with <tool_call>"
    '{"name": <name>, "arguments": <object>}</tool_call>.\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    '{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
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
        self.source = source
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(source)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt. With `continue_final_message` the last message is left open for the
        model to continue: the text after its content (end-of-turn markers) is cut."""
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt"
            )
        text = self._template.render(
            messages=list(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        if continue_final_message:
            last = messages[-1].get("content") or ""
            end = text.rfind(last) if last else -1
            if end < 0:
                raise ValueError("continue_final_message: the template hides the last message")
            text = text[: end + len(last)]
        return text
