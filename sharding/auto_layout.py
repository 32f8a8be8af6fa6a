"""`--layout auto`: the layouts chosen by memory.

The live layout is a stage pipeline over the devices with budgets, its layers split in
proportion to the budgets (32:10:10 gives a 64-layer model 40, 12 and 12 layers; every stage
gets at least one). Unless `--arm` names layouts, the widest tensor-parallel layout that fits
the budgets is armed, for decode. Each candidate is a rung of the ladder, taken or refused
with the reason (a model that ties its head to the embedding cannot be cut into stages; a TP
width the heads cannot take; a device whose budget leaves no room for a page), and the
ladder is logged. Uneven TP (heads split by budget) is not offered: a `NamedSharding` splits
a dimension evenly, so where devices are unequal the pipeline (with TP inside a stage over
equal devices) carries the difference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flipjax.model.config import ModelConfig
from flipjax.runtime.placement import Placement
from sharding.budgets import BudgetError
from sharding.layout import LayoutError, placement_for

AUTO = "auto"


@dataclass(frozen=True)
class Rung:
    layout: str
    role: str  # "live" or "arm"
    taken: bool
    why: str

    def __str__(self) -> str:
        verdict = "taken" if self.taken else "refused"
        return f"{self.role} {self.layout}: {verdict} ({self.why})"


def proportional_split(layers: int, weights: Sequence[int]) -> tuple[int, ...]:
    """`layers` split in proportion to `weights` (largest remainder, ties to the earlier part),
    each part at least one layer."""
    if not 0 < len(weights) <= layers:
        raise LayoutError(f"layout auto: cannot split {layers} layers over {len(weights)} stages")
    total = sum(weights)
    shares = [layers * w / total for w in weights]
    parts = [max(1, int(s)) for s in shares]
    while sum(parts) > layers:  # the minimum of one took layers from the largest part
        parts[parts.index(max(parts))] -= 1
    order = sorted(range(len(weights)), key=lambda i: (-(shares[i] - int(shares[i])), i))
    for i in order[: layers - sum(parts)]:
        parts[i] += 1
    return tuple(parts)


def choose(
    cfg: ModelConfig,
    devices: Sequence[Any],
    budgets: Mapping[int, int] | None,
    arm: tuple[str, ...],
    fits: Callable[[Placement], str | None],
) -> tuple[str, tuple[str, ...], list[Rung]]:
    """(the live layout, the layouts to arm, the ladder). `fits` says why a placement does not
    fit the budgets (None when it does). BudgetError, naming every rung, when nothing fits."""
    ladder: list[Rung] = []
    chosen = [d for d in devices if budgets is None or d.id in budgets]
    weights = [1 if budgets is None else budgets[d.id] for d in chosen]
    n = min(len(chosen), cfg.num_hidden_layers)
    pp = "single"
    if n > 1:
        pp = "pp:" + ",".join(map(str, proportional_split(cfg.num_hidden_layers, weights[:n])))
    why = _refusal(pp, cfg, fits)
    split = "no budgets: equal stages" if budgets is None else "stages in proportion to budgets"
    ladder.append(Rung(pp, "live", why is None, why or split))
    live = pp if why is None else None
    if live is None or not arm:  # TP, widest first: the live layout, else the one armed
        role = "live" if live is None else "arm"
        for width in range(len(chosen), 1, -1):  # over the devices with budgets
            layout = f"tp:{width}"
            why = _refusal(layout, cfg, fits)
            ladder.append(Rung(layout, role, why is None, why or "the widest TP that fits"))
            if why is None:
                if role == "live":
                    live = layout
                else:
                    arm = (layout,)
                break
    if live is None:
        raise BudgetError("layout auto: no layout fits the budgets: " + "; ".join(map(str, ladder)))
    return live, arm, ladder


def _refusal(layout: str, cfg: ModelConfig, fits: Callable[[Placement], str | None]) -> str | None:
    try:
        placement = placement_for(layout, cfg)
    except LayoutError as err:
        return str(err)
    return fits(placement)
