"""Where a quantized weight's scales sit in the parameter tree: beside a `Linear`'s `kernel` as
`scale`, beside the experts' stacked `<proj>` as `<proj>_scale`."""

from __future__ import annotations

_KERNEL, _LINEAR_SCALE, _STACK_SCALE = ".kernel", ".scale", "_scale"


def scale_name(weight: str) -> str:
    """The scales' parameter name of the weight `weight`."""
    if weight.endswith(_KERNEL):
        return weight.removesuffix(_KERNEL) + _LINEAR_SCALE
    return weight + _STACK_SCALE


def weight_name(name: str) -> str | None:
    """The weight whose scales `name` is, or None if it is no weight's scales."""
    if name.endswith(_LINEAR_SCALE):
        return name.removesuffix(_LINEAR_SCALE) + _KERNEL
    if name.endswith(_STACK_SCALE):
        return name.removesuffix(_STACK_SCALE)
    return None
