"""The MTP head a speculating engine drafts with, split from the model its steps run."""

from __future__ import annotations

from flax import nnx

from flipjax.model.mtp import Qwen3NextMTP
from flipjax.model.qwen3_next import Qwen3NextForCausalLM


def split_draft_head(
    model: Qwen3NextForCausalLM, head: Qwen3NextMTP | None, draft_tokens: int
) -> tuple[Qwen3NextForCausalLM, Qwen3NextMTP | None]:
    """The model the steps run (never with its MTP head) and the head speculation drafts
    with: `head`, or the one `model` was built with; refused by name when speculation asks
    for a head there is none of."""
    own = getattr(model, "mtp", None)
    if own is not None:
        model = nnx.merge(*nnx.split(model))  # the caller's model keeps its head
        del model.mtp
    head = head if head is not None else own
    if not draft_tokens:
        return model, None
    if head is None:
        raise ValueError(
            "speculative_algorithm: MTP needs the checkpoint's MTP head (mtp.* tensors); this "
            "model has none"
        )
    return model, head
