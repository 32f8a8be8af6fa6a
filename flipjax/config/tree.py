"""The rest of the tree (the store, the server, the cluster) and `FlipjaxConfig`, which nests
every concern. Field names are unique across the tree, so keyword options map onto it one to
one (`FlipjaxConfig.build`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from flipjax.config.engine import CacheConfig, EngineConfig, LayoutConfig, ModelOptions
from flipjax.config.option import option
from flipjax.config.speculative import SpeculativeConfig
from flipjax.runtime.hybrid import check_interval

# vLLM has none; 16 MiB holds any prompt the context fits.
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
# vLLM's OpenAI server has none; OpenAI's API refuses n above 128.
DEFAULT_MAX_N = 16
# vLLM has none. Schemas within the spec bounds compile in well under a second; this is for a
# compile slowed by a loaded machine or by a grammar the bounds do not catch.
DEFAULT_GRAMMAR_TIMEOUT_S = 30.0
HEARTBEAT_S = 10  # a lost process is known within this (the coordinator's heartbeat timeout)


@dataclass(frozen=True)
class StoreConfig:
    """The KV store behind the device: host RAM, a disk folder, a shared Redis tier."""

    store_dir: str | None = option(
        "~/.cache/flipjax/store", "disk tier of the KV store ('none': host RAM only)"
    )
    host_cache_gb: float = option(4.0, "host RAM the store may use, in GiB")
    disk_cache_gb: float = option(32.0, "disk the store may use, in GiB")
    disk_min_free_gb: float = option(
        0.0, "free space the disk tier leaves on its file system, evicting to keep it"
    )
    remote_store: str | None = option(
        None,
        "a Redis server that servers of this model share, beneath host and disk; its entries "
        "are signed with --store-secret, without which it is not used",
        metavar="redis://HOST:PORT/DB",
    )
    store_secret: str | None = option(
        None,
        "the secret (16 bytes or more) the servers sharing --remote-store sign and verify its "
        "entries with (default: $FLIPJAX_STORE_SECRET, which keeps it out of `ps`)",
        env="FLIPJAX_STORE_SECRET",
        secret=True,
    )
    store_root: str | None = option(
        None,
        "the folder every storage backend a request attaches must lie under (default: "
        "--store-dir's parent)",
        metavar="DIR",
    )

    def __post_init__(self) -> None:
        if self.store_dir == "none":
            object.__setattr__(self, "store_dir", None)
        for name in ("host_cache_gb", "disk_cache_gb", "disk_min_free_gb"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name}: must be 0 or more, got {getattr(self, name)}")


@dataclass(frozen=True)
class ServeConfig:
    """The HTTP server: where it listens, who may do what, how much one request may ask."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    log_level: str = option("info", "debug, info, warning or error")
    served_model_name: tuple[str, ...] | None = option(
        None,
        "the names requests may use; responses carry the first (default: --model as given)",
        metavar="NAME",
    )
    reasoning_parser: str | None = option(
        None,
        "split <think>...</think> out of chat answers into reasoning_content",
        choices=("qwen3",),
    )
    any_whitespace: bool = option(
        True,
        "structured JSON output without free whitespace between tokens",
        flag="--disable-any-whitespace",
        negate=True,
    )
    api_key: str | None = option(None, "Bearer key the inference routes require", secret=True)
    admin_api_key: str | None = option(
        None,
        "Bearer key for the admin routes (flips, storage backends, cache flushes); without one "
        "they are disabled",
        secret=True,
    )
    allow_insecure_admin: bool = option(
        False, "enable the admin routes without a key (only where every client is trusted)"
    )
    allowed_hosts: tuple[str, ...] | None = option(
        None,
        "Host and Origin names the admin routes answer to ('*': any; default: localhost, "
        "127.0.0.1, ::1 and --host)",
        metavar="NAME",
    )
    max_n: int = option(DEFAULT_MAX_N, "most choices (n, best_of) one request may ask for")
    max_request_bytes: int = option(
        DEFAULT_MAX_REQUEST_BYTES, "largest request body; a larger one is a 413 before it is parsed"
    )
    grammar_timeout_s: float = option(
        DEFAULT_GRAMMAR_TIMEOUT_S,
        "how long a request waits for its structured-output grammar to compile; past it the "
        "request is a 400 (the compile finishes, and is cached, on its own threads)",
    )

    def __post_init__(self) -> None:
        for name in ("max_n", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if not 0 < self.grammar_timeout_s < float("inf"):
            raise ValueError(f"grammar_timeout_s: must be positive, got {self.grammar_timeout_s}")


@dataclass(frozen=True)
class DistributedConfig:
    """A cluster of processes (named after `jax.distributed.initialize`'s arguments)."""

    coordinator_address: str | None = option(
        None, "process 0's address; every process passes the same one", metavar="HOST:PORT"
    )
    num_processes: int | None = option(None, "processes in the cluster")
    process_id: int | None = option(None, "this process's rank; 0 serves HTTP")
    heartbeat_timeout_s: int = option(HEARTBEAT_S, "how soon a lost process is noticed")


@dataclass(frozen=True)
class FlipjaxConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        if self.cache.gdn_checkpoint_interval is not None:
            check_interval(self.cache.gdn_checkpoint_interval, self.engine.page_size)
        if self.speculative.draft_tokens and self.engine.kv_cache_dtype != "auto":
            # A rejected draft's K/V can grow an 8-bit page's scale, which re-rounds the
            # accepted tokens beside it: the tokens would differ from decoding without drafts.
            raise ValueError(
                f"speculative_algorithm: needs the model's KV dtype; --kv-cache-dtype "
                f"{self.engine.kv_cache_dtype} is refused with it"
            )

    @property
    def num_slots(self) -> int:
        """GDN slots in the pool: the engine's, and with speculation K more per running
        request (a verify step keeps the state after each of its positions)."""
        ec = self.engine
        return ec.slots + self.speculative.draft_tokens * ec.max_running_requests

    @classmethod
    def build(cls, **options: Any) -> FlipjaxConfig:
        """The default tree with `options` (field names of any concern) set."""
        return cls().replace(**options)

    def replace(self, **options: Any) -> FlipjaxConfig:
        """This tree with `options` set; an unknown name is a TypeError naming it."""
        owners = _owners()
        unknown = sorted(set(options) - set(owners))
        if unknown:
            raise TypeError(f"{unknown[0]}: not a flipjax option (see FlipjaxConfig)")
        changes: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            changes.setdefault(owners[name], {})[name] = value
        concerns = {c: dataclasses.replace(getattr(self, c), **kw) for c, kw in changes.items()}
        return dataclasses.replace(self, **concerns)

    def facts(self, *concerns: str) -> dict[str, Any]:
        """The named concerns (all by default) as flat field -> value, secrets masked: what the
        server logs at start, and what every process of a cluster must agree on."""
        names = concerns or tuple(f.name for f in dataclasses.fields(self))
        out: dict[str, Any] = {}
        for concern in names:
            part = getattr(self, concern)
            for f in dataclasses.fields(part):
                value = getattr(part, f.name)
                masked = f.metadata.get("secret") and value is not None
                out[f.name] = "<set>" if masked else value
        return out


def _owners() -> dict[str, str]:
    """Every option's name -> the concern it belongs to."""
    owners: dict[str, str] = {}
    for concern in dataclasses.fields(FlipjaxConfig):
        for f in dataclasses.fields(concern.default_factory()):  # type: ignore[misc]
            if f.name in owners:
                raise AssertionError(f"{f.name}: in {owners[f.name]} and {concern.name}")
            owners[f.name] = concern.name
    return owners
