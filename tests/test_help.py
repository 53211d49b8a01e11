"""Every flag of every command line says what it does in --help, and says
its default once."""
import argparse
import importlib
from pathlib import Path

import pytest

from llmc_py.cli import DefaultsHelpFormatter

# the module of each command line that has build_parser()
COMMANDS = {"train": "train.cli", "sample": "sample", "eval": "eval", "summary": "summary",
            "bench": "bench.cli", "convert": "convert", "inspect": "inspect", "plot": "plot",
            "compare": "compare", "data": "data.prepare"}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_a_help_that_states_its_default_once(command):
    parser = importlib.import_module(f"llmc_py.{COMMANDS[command]}").build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{command} {name} has no help"
        if action.help is argparse.SUPPRESS:   # an internal flag, hidden on purpose
            continue
        shown = formatter._get_help_string(action) % vars(action)
        assert shown.count("(default") <= 1, f"{command} {name}: {shown}"


def test_formatter_adds_a_default_only_where_there_is_one_to_add():
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--n", type=int, default=3, help="count")
    p.add_argument("--said", default=None, help="a file (default: the usual one)")
    p.add_argument("--none", default=None, help="a file")
    p.add_argument("--empty", default="", help="text")
    text = " ".join(p.format_help().split())
    assert "count (default: 3)" in text
    assert "(default: the usual one)" in text and text.count("(default") == 2


def test_readme_names_the_plot_extra_as_the_error_does():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "pip install matplotlib" not in readme
    assert 'pip install "llmc_py[plot]"' in readme
