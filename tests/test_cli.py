"""The command line: `nfjax serve` (and `python serve.py`) and `nfjax generate` take the same engine flags, and
the README's commands name flags that exist."""
import argparse
import re
from pathlib import Path

import pytest

from nfjax import cli
from nfjax.engine.builder import add_engine_args

ROOT = Path(__file__).resolve().parent.parent


def _engine_flags() -> set[str]:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return {s for a in p._actions for s in a.option_strings} - {"-h", "--help"}


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _listed_flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))


def _engine_section(text: str) -> str:
    """The `engine:` group of a --help text (up to the next group or the end)."""
    m = re.search(r"^engine:\n(.*?)(?=^\S|\Z)", text, re.M | re.S)
    assert m, text
    return m.group(1)


def test_serve_and_generate_list_the_same_engine_flags(capsys):
    flags = _engine_flags()
    assert {"--plan", "--strategies", "--model", "--tp", "--page-size", "--token-buckets", "--engine-config"} <= flags
    serve = _engine_section(_help(capsys, "serve"))
    generate = _engine_section(_help(capsys, "generate"))
    assert _listed_flags(serve) == _listed_flags(generate) == flags


def test_serve_py_takes_the_same_flags_as_nfjax_serve(capsys):
    import serve as serve_py
    with pytest.raises(SystemExit):
        serve_py.main(["--help"])
    ours = _listed_flags(capsys.readouterr().out)
    assert ours == _listed_flags(_help(capsys, "serve"))
    assert _engine_flags() <= ours


def _readme_commands() -> list[tuple[str, str]]:
    """(command, the rest of the line) for every `nfjax CMD ...` / `python serve.py ...` line of the README's
    code blocks (comments after `#` dropped: they are prose)."""
    out, block = [], False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            block = not block
            continue
        if not block:
            continue
        for m in re.finditer(r"(?:^|&& |\$ )(nfjax (\w[\w-]*)|python serve\.py)(.*)", line):
            rest = m.group(3).split("  #")[0]
            out.append(("serve" if m.group(1) == "python serve.py" else m.group(2), rest))
    return out


def test_readme_commands_name_flags_that_exist(capsys):
    cmds = _readme_commands()
    assert {c for c, _ in cmds} >= {"generate", "serve", "convert"}, cmds
    for cmd, rest in cmds:
        known = _listed_flags(_help(capsys, cmd))
        unknown = _listed_flags(rest) - known
        assert not unknown, (cmd, rest, unknown)


def test_generate_max_tokens_beyond_the_context_is_an_error(capsys):
    # one token bucket: the check reads the context the engine was built with, whatever its buckets (one compiles
    # in about a third of the time of the default three)
    code = cli.main(["generate", "--max-model-len", "64", "--token-buckets", "16", "--max-tokens", "60",
                     "--temperature", "0", "a prompt of some length"])
    err = capsys.readouterr().err
    assert code == 2 and "--max-tokens 60" in err and "context holds 64" in err and "Traceback" not in err


def test_generate_length_check_counts_prompt_tokens():
    from nfjax.commands.generate import _check_fits
    from nfjax.errors import UserError
    from nfjax.tokenizer import load_tokenizer
    tok = load_tokenizer(ROOT / "nfjax" / "assets" / "tiny")       # the shipped model's byte-level tokenizer
    n = len(tok.encode("abcd"))
    _check_fits(64, tok, [[1, 2, 3], "abcd"], 64 - n)             # both fit exactly
    with pytest.raises(UserError, match=f"prompt 2 has {n + 1} tokens.*at most {63 - n}"):
        _check_fits(64, tok, [[1, 2, 3], "abcde"], 64 - n)
