"""The configuration tree: one field per option, the command line generated from it, keyword
options that map onto it one to one, and refusals that name the field."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import typing

import pytest

from flipjax.config.cli import add_arguments, parse
from flipjax.config.option import flag_of
from flipjax.config.tree import FlipjaxConfig
from tests.support.paths import REPO_ROOT


def concerns() -> list[tuple[str, type]]:
    return [(f.name, f.default_factory) for f in dataclasses.fields(FlipjaxConfig)]


def test_every_field_has_a_flag_with_help_in_its_concerns_group():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {a.dest: a for a in parser._actions}
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    for name, cls in concerns():
        for f in dataclasses.fields(cls):
            assert f.name in flags, f"{name}.{f.name} has no flag"
            assert flags[f.name].help, f"{flag_of(f)} has no help"
            assert flag_of(f) in flags[f.name].option_strings
            assert any(f.name in dests for dests in groups.values())
    assert len(groups) >= len(concerns()) + 2  # each concern's group beside argparse's own


def test_the_flags_users_know_parse_into_the_tree():
    # Each flag beside its value, as a user types them (a table that reads better packed).
    config = parse(
        [
            "--model",
            "tiny",
            "--dtype",
            "bfloat16",
            "--max-running-requests",
            "4",
            "--disable-overlap-schedule",
            "--no-warmup",
            "--disable-radix-cache",
            "--flip-memory-headroom",
            "1.5",
            "--prefetch-wait-ms",
            "5",
            "--arm",
            "tp:2",
            "--arm",
            "pp:5,3",
            "--store-dir",
            "none",
            "--served-model-name",
            "a",
            "b",
            "--allowed-hosts",
            "*",
            "--max-n",
            "3",
            "--process-id",
            "1",
        ],
        "test",
        None,
    )
    assert config.model.dtype == "bfloat16"
    assert config.engine.max_running_requests == 4 and config.engine.overlap is False
    assert config.layout.warmup is False and config.cache.prefix_cache is False
    assert config.layout.flip_memory_headroom == int(1.5 * 2**30)  # GiB on the command line
    assert config.cache.prefetch_wait_s == pytest.approx(0.005)  # milliseconds there
    assert config.layout.arm == ("tp:2", "pp:5,3")
    assert config.store.store_dir is None
    assert config.serve.served_model_name == ("a", "b")
    assert config.serve.allowed_hosts == ("*",) and config.serve.max_n == 3
    assert config.distributed.process_id == 1


def test_no_flags_give_the_default_tree():
    assert parse([], "test", None) == FlipjaxConfig()


def test_the_store_secret_defaults_to_its_environment_variable(monkeypatch):
    monkeypatch.setenv("FLIPJAX_STORE_SECRET", "s" * 32)
    assert parse([], "test", None).store.store_secret == "s" * 32


def test_keyword_options_map_onto_the_tree_one_to_one():
    config = FlipjaxConfig.build(num_pages=64, layout="tp:2", prefix_cache=False, max_n=2)
    assert config.engine.num_pages == 64 and config.layout.layout == "tp:2"
    assert config.cache.prefix_cache is False and config.serve.max_n == 2
    names = [f.name for _, cls in concerns() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)), "a field name is in two concerns"
    with pytest.raises(TypeError, match="num_page: not a flipjax option"):
        FlipjaxConfig.build(num_page=64)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"num_pages": 0}, "num_pages"),
        ({"max_running_requests": 8, "num_slots": 4}, "num_slots"),
        ({"prefetch_wait_s": -1.0}, "prefetch_wait_s"),
        ({"page_size": 16, "gdn_checkpoint_interval": 20}, "interval"),
        ({"phase_policy": "auto"}, "phase_policy"),
        ({"dtype": "int3"}, "dtype"),
        ({"max_n": 0}, "max_n"),
        ({"host_cache_gb": -1.0}, "host_cache_gb"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(options, field):
    with pytest.raises(ValueError, match=field):
        FlipjaxConfig.build(**options)


def test_the_command_line_refuses_a_bad_value_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["--phase-policy", "auto"], "test", None)
    assert exit_.value.code == 2
    assert "phase_policy: auto needs exactly one arm layout" in capsys.readouterr().err


def test_facts_mask_secrets_and_keep_the_rest():
    config = FlipjaxConfig.build(api_key="k" * 20, store_secret="s" * 32, num_pages=77)
    facts = config.facts()
    assert facts["api_key"] == "<set>" and facts["store_secret"] == "<set>"
    assert facts["admin_api_key"] is None and facts["num_pages"] == 77
    assert "k" * 20 not in repr(facts) and "s" * 32 not in repr(facts)
    assert set(config.facts("engine")) == {f.name for f in dataclasses.fields(config.engine)}


def test_every_field_is_typed_as_the_flag_parses_it():
    for _, cls in concerns():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.name in hints and f.metadata.get("help"), f.name


def test_the_command_line_loads_without_jax():
    """`--help` and the log set-up run before the server's modules load."""
    code = "import sys, flipjax.config.cli; print('jax' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "reading the command line imported jax"
