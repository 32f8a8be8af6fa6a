"""The configuration tree: one frozen dataclass per concern (model, engine, cache, layout,
store, serve, distributed), nested in `FlipjaxConfig`.

It sits between the engine and the layers it assembles: the engine and the server read it,
and it imports only what validates it (`flipjax.runtime.hybrid`). The command line is generated
from its fields (`flipjax.config.cli`), so a flag, its type, default and help live in one place.
"""
