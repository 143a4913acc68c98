"""The papers say what the code does: every `h3kit ...` command in a code block of README.md and docs/*.md
parses with the CLI (its subcommands, options, choices and defaults), every loopback URL uses the service's
default port unless the same page starts a server on another, and every relative link and `../` path names a
file a clone or the wheel has. Parsing only (tests/support/doc_commands.py): nothing is run."""

from __future__ import annotations

import re

import pytest

from h3kit.cli import main
from tests.support import doc_commands as dc

DOCS = dc.doc_files()


def service_port() -> int:
    start = main.get_command(None, "start")
    return next(p.default for p in start.params if p.name == "port")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_documented_command_parses(doc):
    found = dc.commands(doc)
    problems = [f"{doc.name}:{n}: {text}\n    {why}" for n, text in found for why in dc.check(main, text)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_in_inline_code_parses(doc):
    """The same for `h3kit ...` in inline code, where naming a group or an option in prose is no mistake."""
    problems = []
    for n, text in dc.inline_commands(doc):
        found = dc.check(main, text)
        if found and not dc.is_mention(text, found):
            problems += [f"{doc.name}:{n}: {text}\n    {why}" for why in found]
    assert not problems, "\n".join(problems)


def test_the_commands_are_found_and_a_wrong_one_is_caught():
    """The reader itself: it finds the README's commands, and each kind of mistake fails."""
    readme = dc.commands(dc.ROOT / "README.md")
    assert len(readme) >= 8 and any(t.startswith("h3kit models fetch $W/*.json") for _, t in readme)
    assert dc.check(main, "h3kit start --comfy-home DIR --devices 0,1 [--port 8189] [--device-type auto|npu]") == []
    assert dc.check(main, "h3kit start --comfy-home DIR --colour red")  # unknown option
    assert dc.check(main, "h3kit models --comfy-home DIR")  # a group without its subcommand
    assert dc.check(main, "h3kit models pull x.json")  # no such subcommand
    assert dc.check(main, "h3kit start --comfy-home DIR --device-type tpu")  # a choice the option refuses
    assert dc.check(main, "h3kit start --comfy-home DIR --port eighty")  # a value of the wrong type
    assert dc.check(main, "h3kit start --comfy-home DIR [--port 8188]")  # a default that is not the default
    assert dc.check(main, "h3kit stop --comfy-home DIR [--grace 10]") == []  # 10 is the float 10.0
    assert dc.check(main, "h3kit stop --comfy-home DIR [--grace 12]")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_loopback_urls_use_the_default_port_or_one_the_page_starts(doc):
    allowed = {service_port()} | dc.ports_given(doc)
    wrong = [(n, port) for n, port in dc.loopback_ports(doc) if port not in allowed]
    assert not wrong, f"{doc.name}: lines {wrong} name a port no server on this page listens on " \
                      f"(h3kit start's default is {service_port()})"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_name_files_a_clone_or_the_wheel_has(doc):
    broken = [(n, target) for n, target in dc.relative_links(doc) if not dc.carried(doc, target)]
    assert not broken, f"{doc.name}: {broken} (no such file in the checkout; a file beside it, outside the repository, is in no clone and no wheel)"


NUMBERS = {"three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


@pytest.mark.parametrize("doc", [dc.ROOT / "README.md", dc.ROOT / "docs" / "deployment.md"], ids=lambda p: p.name)
def test_n_commands_in_this_order_shows_n(doc):
    """"Eight commands, in this order" is followed by a block of eight h3kit commands."""
    text = doc.read_text(encoding="utf-8")
    m = next(re.finditer(r"\b(\w+) commands, in this order", text))
    after = text[:m.start()].count("\n") + 1
    block = next(lines for first, lines in dc.code_blocks(text) if first > after)
    shown = [ln for ln in block if ln.startswith("h3kit ")]
    assert len(shown) == NUMBERS[m.group(1).lower()], (m.group(0), shown)
