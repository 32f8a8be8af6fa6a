"""How an engine's parts are built from its config and wired together: the allocator and the
pools, the device prefix cache, the scheduler, the model runner, the layouts, prefix reuse,
the request table, the stepper and the overlap of decode steps, and sessions.

`Parts` is the engine's inside. Only `flipjax.engine` reaches into it (and the test-support
module the tests document), so what the engine exposes stays its narrow API.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from flipjax.config.engine import LayoutConfig
from flipjax.config.tree import FlipjaxConfig
from flipjax.engine.caches import Caches
from flipjax.engine.draft_head import split_draft_head
from flipjax.engine.drafter_memory import drafter_footprint
from flipjax.engine.overlap import Overlap
from flipjax.engine.pool_resize import PoolResize
from flipjax.engine.prefix_reuse import PrefixReuse
from flipjax.engine.radix_cache import RadixCache
from flipjax.engine.reference import ContiguousForward
from flipjax.engine.requests import Requests
from flipjax.engine.scheduler import Scheduler
from flipjax.engine.sessions import Sessions
from flipjax.engine.speculation import Speculation
from flipjax.engine.speculation_policy import SpeculationPolicy
from flipjax.engine.step import Stepper
from flipjax.model.config import ModelConfig
from flipjax.model.dtypes import parse_dtype
from flipjax.model.mtp import Qwen3NextMTP
from flipjax.model.quantize import quantize_draft_head, quantize_model
from flipjax.model.qwen3_next import Qwen3NextForCausalLM
from flipjax.model.tokenizer import Tokenizer
from flipjax.runtime import multihost
from flipjax.runtime.allocator import Allocator
from flipjax.runtime.cache import kv_page_dtype
from flipjax.runtime.drafter import Drafter
from flipjax.runtime.model_runner import ModelRunner
from flipjax.runtime.placement import Placement, single_device
from flipjax.runtime.runner_shape import RunnerShape
from sharding.auto_layout import AUTO, choose
from sharding.budgets import BudgetError, device_budgets, parse_size
from sharding.flip import Layouts
from sharding.layout import placement_for
from sharding.ledger import overdraft
from sharding.pool_sizing import DEFAULT_NUM_PAGES, Footprint, pool_pages
from store.checkpoints import CheckpointBook
from store.prefix import PrefixStore

log = logging.getLogger("flipjax.engine")


@dataclass
class Parts:
    config: FlipjaxConfig
    graphdef: nnx.GraphDef
    gdn_interval: int
    max_model_len: int
    allocator: Allocator
    prefix_cache: RadixCache | None
    prefix_store: PrefixStore | None
    scheduler: Scheduler
    runner: ModelRunner
    layouts: Layouts
    reuse: PrefixReuse
    caches: Caches
    requests: Requests
    stepper: Stepper
    overlap: Overlap
    sessions: Sessions
    reference: ContiguousForward
    budgets: dict[int, int] | None  # per device id (`sharding.budgets`)


def assemble(
    model: Qwen3NextForCausalLM,
    tokenizer: Tokenizer,
    config: FlipjaxConfig,
    prefix_store: PrefixStore | None,
    checkpoints: CheckpointBook | None,
    draft_head: Qwen3NextMTP | None = None,
) -> Parts:
    cfg, dtype = model.cfg, parse_dtype(config.model.dtype)
    model, draft_head = split_draft_head(model, draft_head, config.speculative.draft_tokens)
    drafts_by = config.speculative.draft_quantization(config.model.quantization)
    if draft_head is not None:
        draft_head = quantize_draft_head(draft_head, drafts_by)
    graphdef, params = nnx.split(quantize_model(model, config.model.quantization))
    beside = drafter_footprint(cfg, draft_head, params, config.engine.page_size, drafts_by)
    config, placement, budgets, sizes, sizer = _sized(config, cfg, dtype, graphdef, params, beside)
    ec, cc, lc = config.engine, config.cache, config.layout
    interval = cc.gdn_interval(ec.page_size, prefix_store)
    _check_store_dtypes(config, prefix_store)
    allocator = Allocator(ec.num_pages, config.num_slots, ec.page_size)
    prefix_cache = None
    if cc.prefix_cache and ec.slots > ec.max_running_requests:
        states = ec.slots - ec.max_running_requests
        prefix_cache = RadixCache(allocator, interval, max_states=states)
    moves_state = prefix_cache is not None or prefix_store is not None
    scheduler = Scheduler(
        allocator,
        ec.max_running_requests,
        ec.max_prefill_tokens,
        chunk_grid=interval if moves_state else None,
        prefix_cache=prefix_cache,
        prefetch_wait_s=cc.prefetch_wait_s,
    )
    max_len = ec.model_len(cfg)
    shape = _runner_shape(config, cfg, dtype)
    runner = ModelRunner(graphdef, params, shape, placement)
    window = parse_size(lc.flip_window) if lc.flip_window is not None else None
    layouts = Layouts(
        runner,
        allocator,
        moves_state,
        headroom=lc.flip_memory_headroom,
        budgets=budgets,
        flip_window=window,
        pool_pages=sizer,
    )
    layouts.pools.sizes.update(sizes)
    layouts.pools.resizer = PoolResize(scheduler, prefix_cache)
    reuse = PrefixReuse(runner, scheduler, ec.page_size, interval, prefix_cache, prefix_store)
    scheduler.on_admit, scheduler.on_add = reuse.seed, reuse.prefetch
    speculation = None
    if draft_head is not None:
        if multihost.current().multi:
            raise ValueError("speculative decoding: runs in one process; this is a cluster")
        drafter = Drafter(
            cfg,
            draft_head,
            runner.parts,
            params,
            config.speculative.draft_tokens,
            ec.num_pages,
            ec.page_size,
            runner.kernels,
            runner.compiles,
            drafts_by,
        )
        policy = SpeculationPolicy(config.speculative.speculative_adaptive)
        speculation = Speculation(runner, drafter, allocator, max_len, policy, interval)
    stepper = Stepper(runner, scheduler, reuse, tokenizer, max_len, speculation)
    return Parts(
        config=config,
        graphdef=graphdef,
        gdn_interval=interval,
        max_model_len=max_len,
        allocator=allocator,
        prefix_cache=prefix_cache,
        prefix_store=prefix_store,
        scheduler=scheduler,
        runner=runner,
        layouts=layouts,
        reuse=reuse,
        caches=Caches(allocator, prefix_cache, reuse, moves_state),
        requests=Requests(tokenizer, cfg.vocab_size, max_len, scheduler),
        stepper=stepper,
        overlap=Overlap(stepper, scheduler, runner, ec.overlap, speculation),
        sessions=Sessions(checkpoints, interval),
        reference=ContiguousForward(graphdef, cfg, dtype),
        budgets=budgets,
    )


def page_dtype(config: FlipjaxConfig) -> str:
    """The name of the KV pages' dtype `config` asks for."""
    dtype = parse_dtype(config.model.dtype)
    return jnp.dtype(kv_page_dtype(config.engine.kv_cache_dtype, dtype)).name


def _check_store_dtypes(config: FlipjaxConfig, store: PrefixStore | None) -> None:
    """A store holds one model dtype's GDN states and one dtype's KV pages: another engine's
    pages are never served (or stored) here."""
    want = (config.model.dtype, page_dtype(config))
    if store is not None and tuple(store.dtypes) != want:
        raise ValueError(
            f"prefix_store: holds {store.dtypes[1]} KV pages of a {store.dtypes[0]} model; this "
            f"engine's are {want[1]} pages of a {want[0]} model (--dtype, --kv-cache-dtype)"
        )


def _runner_shape(config: FlipjaxConfig, cfg: ModelConfig, dtype: jnp.dtype) -> RunnerShape:
    ec = config.engine
    return RunnerShape(
        cfg,
        dtype,
        ec.page_size,
        ec.num_pages or DEFAULT_NUM_PAGES,
        config.num_slots,
        ec.model_len(cfg),
        ec.max_running_requests,
        ec.max_prefill_tokens,
        kv_page_dtype(ec.kv_cache_dtype, dtype),
        config.speculative.draft_tokens,
        ec.max_prefill_rows,
    )


def _sizer(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    shape: RunnerShape,
    budgets: dict[int, int] | None,
    cap: int | None,
    beside: Footprint | None,
) -> Callable[[Placement], int] | None:
    """Each layout's own pool size, for a flip to resize the pool to; None (one size for
    every layout) without budgets, or across processes, where a flip holds both layouts."""
    if budgets is None or multihost.current().multi:
        return None
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    return lambda p: pool_pages(graphdef, shapes, shape, [p], budgets, cap, beside=beside)


def _sized(
    config: FlipjaxConfig,
    cfg: ModelConfig,
    dtype: jnp.dtype,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    beside: Footprint | None,
) -> tuple[
    FlipjaxConfig,
    Placement,
    dict[int, int] | None,
    dict[str, int],
    Callable[[Placement], int] | None,
]:
    """The config with the pool's page count settled (`sharding.pool_sizing`), the live
    placement, the device budgets, each layout's pool (in one process with budgets, each
    layout gets what its devices hold; otherwise one size serves all) and what sizes a layout
    armed later (`_sizer`). BudgetError, before anything is placed, when the weights and
    pools (with the drafter's, `beside`) do not fit a budget."""
    ec, lc = config.engine, config.layout
    budgets = device_budgets(
        jax.devices(), lc.device_memory, lc.mem_fraction_static, jax.process_count()
    )
    shape = _runner_shape(config, cfg, dtype)
    # Across processes a flip holds both layouts at once (`sharding.flip`).
    both = multihost.current().multi
    if lc.layout == AUTO:
        lc = _auto(lc, cfg, graphdef, params, shape, budgets, ec.num_pages, both, beside)
        config = dataclasses.replace(config, layout=lc)
    placement = placement_for(lc.layout, cfg) if lc.layout is not None else single_device(cfg)
    placements = [placement, *(placement_for(layout, cfg) for layout in lc.arm)]
    sizer = _sizer(graphdef, params, shape, budgets, ec.num_pages, beside)  # `--num-pages`: a cap
    if sizer is None:
        pages = pool_pages(graphdef, params, shape, placements, budgets, ec.num_pages, both, beside)
        sizes = {p.name: pages for p in placements}
    else:
        sizes = {p.name: sizer(p) for p in placements}
        pages = sizes[placement.name]
    config = dataclasses.replace(config, engine=dataclasses.replace(ec, num_pages=pages))
    pools = shape.pools(pages)
    if (why := overdraft(placement, cfg, params, pools, budgets)) is not None:
        raise BudgetError(f"the engine does not fit its memory budget: {why}")
    return config, placement, budgets, sizes, sizer


def _auto(
    lc: LayoutConfig,
    cfg: ModelConfig,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    shape: RunnerShape,
    budgets: dict[int, int] | None,
    cap: int | None,
    both: bool,
    beside: Footprint | None,
) -> LayoutConfig:
    """`--layout auto` settled (`sharding.auto_layout`): the live layout and the armed ones,
    with the ladder logged."""

    def fits(placement: Placement) -> str | None:
        try:
            pool_pages(graphdef, params, shape, [placement], budgets, cap, both, beside)
        except BudgetError as err:
            return str(err)
        return None

    live, arm, ladder = choose(cfg, jax.devices(), budgets, lc.arm, fits)
    for rung in ladder:
        log.info("layout auto: %s", rung)
    return dataclasses.replace(lc, layout=live, arm=arm)
