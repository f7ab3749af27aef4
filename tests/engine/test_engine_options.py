"""EngineOptions is the one declaration of the engine's options: EngineConfig.build takes exactly its
fields, `dsv4 serve` has one flag per option that declares flags (its help and default), ServerSettings
is one, and what an option refuses it refuses both as a keyword and as a flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dsv4_engine import options
from dsv4_engine.engine_config import EngineConfig
from dsv4_engine.options import EngineOptions
from dsv4_engine.server.args import ServerSettings, build_parser, parse


def _spec(f: dataclasses.Field) -> options.Spec:  # type: ignore[type-arg]
    return f.metadata["spec"]


def test_every_flagged_option_is_a_serve_flag_with_its_help_and_default() -> None:
    actions = {a.dest: a for a in build_parser()._actions}
    flagged = [f for f in dataclasses.fields(EngineOptions) if _spec(f).flags]
    assert {f.name for f in flagged} >= {"page_size", "max_model_len", "enforce_eager", "tp_size", "ep_size"}
    for f in flagged:
        action = actions[f.name]
        assert action.help == _spec(f).help and action.default == f.default, f.name
        assert set(_spec(f).flags) <= set(action.option_strings), f.name
    assert "--no-enforce-eager" in actions["enforce_eager"].option_strings
    assert isinstance(actions["enforce_eager"], argparse.BooleanOptionalAction)
    assert not {"kernels", "prewarm"} & actions.keys()  # library-only options


def test_server_settings_are_engine_options_and_pass_on_only_what_was_set() -> None:
    assert issubclass(ServerSettings, EngineOptions)
    defaults = {f.name: f.default for f in dataclasses.fields(EngineOptions)}
    assert {n: getattr(ServerSettings(model="m"), n) for n in defaults} == defaults
    s = parse(["--model", "m", "--page-size", "64", "--no-enforce-eager", "--ep-size", "1"])
    assert s.engine_kwargs() == {"page_size": 64, "enforce_eager": False}
    extra = dataclasses.replace(s, extra_engine_kwargs={"kernels": False, "future_option": 1})
    assert extra.engine_kwargs() == {
        "page_size": 64,
        "enforce_eager": False,
        "kernels": False,
        "future_option": 1,
    }
    assert options.split(extra.engine_kwargs()) == (
        {"page_size": 64, "enforce_eager": False, "kernels": False},
        {"future_option": 1},
    )


def test_engine_config_takes_every_option_by_name() -> None:
    every = {f.name: f.default for f in dataclasses.fields(EngineOptions)}
    cfg = EngineConfig.build("/ckpt", "float32", "cpu", max_position_embeddings=4096, **every)
    assert cfg.page_size == options.DEFAULT_PAGE_SIZE and cfg.max_num_seqs == options.DEFAULT_MAX_NUM_SEQS
    with pytest.raises(TypeError):
        EngineConfig.build("/ckpt", "float32", "cpu", max_position_embeddings=4096, no_such_option=1)


@pytest.mark.parametrize(
    "name", [f.name for f in dataclasses.fields(EngineOptions) if _spec(f).minimum is not None]
)
def test_an_option_below_its_least_value_is_refused_as_keyword_and_as_flag(name: str) -> None:
    least = _spec(next(f for f in dataclasses.fields(EngineOptions) if f.name == name)).minimum
    assert least is not None
    with pytest.raises(ValueError, match=rf"{name} must be >= {least}"):
        EngineOptions(**{name: least - 1}).check()
    flag = options.flags()[name]
    with pytest.raises(SystemExit):
        parse(["--model", "m", flag, str(least - 1)])
