"""`python -m flipjax.ckpt`: orbax checkpoint tools.

    convert HF_DIR OUT_DIR [--dtype bfloat16]   HF safetensors to an orbax checkpoint
    cast HF_DIR OUT_DIR --dtype bfloat16        a HF folder with its weights in another dtype
    inspect OUT_DIR                             tree, shapes, dtypes and bytes
    restore OUT_DIR --layout L [cluster flags]  restore into a layout, each process reading
                                                only its shards; says what each one holds

`Engine.from_pretrained` and `python -m flipjax.serve --model` accept either format.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flipjax.ckpt")
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="HF safetensors folder to orbax")
    convert.add_argument("hf_dir")
    convert.add_argument("out_dir")
    convert.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    cast = commands.add_parser("cast", help="HF folder to a HF folder of another dtype")
    cast.add_argument("hf_dir")
    cast.add_argument("out_dir")
    cast.add_argument("--dtype", required=True, choices=("bfloat16", "float32"))
    inspect = commands.add_parser("inspect", help="list a converted checkpoint")
    inspect.add_argument("out_dir")
    restore = commands.add_parser("restore", help="restore into a layout (one or many processes)")
    restore.add_argument("out_dir")
    restore.add_argument("--layout", default="single")
    from flipjax.config.cli import add_arguments

    add_arguments(restore, only=("distributed",))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "restore":
        return _restore(args)

    from flipjax.model import orbax_io as orbax_ckpt
    from flipjax.model.dtypes import parse_dtype

    if args.command == "convert":
        written = orbax_ckpt.convert(args.hf_dir, args.out_dir, parse_dtype(args.dtype))
        print(f"wrote {args.out_dir}: {written / 2**20:.1f} MiB of {args.dtype} parameters")
        return
    if args.command == "cast":
        from flipjax.model.hf_cast import cast

        try:
            written = cast(args.hf_dir, args.out_dir, parse_dtype(args.dtype))
        except (ValueError, OSError) as e:  # WeightsError is a ValueError
            raise SystemExit(f"python -m flipjax.ckpt cast: error: {e}") from e
        print(f"wrote {args.out_dir}: {written / 2**20:.1f} MiB of {args.dtype} tensors")
        return
    rows = orbax_ckpt.inspect(args.out_dir)
    width = max(len(name) for name, *_ in rows)
    for name, shape, dtype, nbytes in rows:
        print(f"{name:<{width}}  {str(list(shape)):<18} {dtype:<9} {nbytes:>12,d}")
    total = sum(r[3] for r in rows)
    print(f"{len(rows)} arrays, {total:,d} bytes ({total / 2**20:.1f} MiB)")


def _restore(args: argparse.Namespace) -> None:
    from flipjax.config.cli import from_namespace
    from flipjax.runtime import multihost

    dc = from_namespace(args).distributed
    cluster = multihost.initialize(
        dc.coordinator_address, dc.num_processes, dc.process_id, dc.heartbeat_timeout_s
    )
    import jax

    from flipjax.model import orbax_io
    from flipjax.model.config import ModelConfig
    from sharding.layout import placement_for

    cfg = ModelConfig.from_hf(args.out_dir)
    dtype = orbax_io.checkpoint_dtype(args.out_dir)
    _, abstract = orbax_io.abstract_params(cfg, dtype)
    shardings = placement_for(args.layout, cfg).param_shardings(abstract)
    params = orbax_io.restore_params(args.out_dir, cfg, abstract, shardings)
    leaves = jax.tree.leaves(params)
    total = sum(x.nbytes for x in leaves)
    local = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    print(
        f"process {cluster.process_id} of {cluster.num_processes}: restored {len(leaves)} arrays "
        f"into {args.layout}; its {jax.local_device_count()} devices hold {local / 2**20:.1f} "
        f"MiB of the {total / 2**20:.1f} MiB checkpoint"
    )


if __name__ == "__main__":
    main()
