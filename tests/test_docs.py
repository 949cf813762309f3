"""The docs are true: every `lit3d` command in README.md and docs/*.md works, every relative link leads to a file,
and the strategy's argument table is the one its settings generate.

A command is a line of a ```bash block that starts with ``lit3d`` (after ``&&`` or ``VAR=value`` prefixes too), or an
inline code span ``lit3d COMMAND --...``. How each is checked:

- ``lit3d fit|validate|test|predict``: parsed by the LightningCLI with ``--print_config`` (all of them in one child
  process, which imports Lightning once); one with ``--trainer.fast_dev_run`` trains for real.
- ``lit3d plan``: runs (only parsed where marked ``# needs: ...``, as below); when the next fenced block after its
  block is a ```text block, that block shows the output of the block's last command, and every line of it (but
  ``...``) must be a line the command prints.
- ``lit3d calibrate|export|convert|generate|prepare``: parsed; run too unless marked ``# needs: ...`` (files the reader
  brings), at the end of the line or on a line of its own above it in the block.

After changing a strategy setting, regenerate docs/strategy-arguments.md's table:
``python tests/test_docs.py --write-argument-table``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import forked
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIGHTNING = ("fit", "validate", "test", "predict")
FUNCTIONS = ("calibrate", "export", "convert", "generate", "prepare")  # jsonargparse functions of `lit3d.cli.commands`
SHELL = ("bash", "sh", "shell", "console")
TABLE_START, TABLE_END = "<!-- generated: argument_table -->", "<!-- end generated -->"
ARGUMENT_TABLE = ROOT / "docs" / "strategy-arguments.md"
TEST_COMMAND = 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q'  # .ci/run greps the README for it

# The HuggingFace folders the docs' plans name (as the reader downloads them): their config.json, as published.
HF_FOLDERS = {
    "Llama-3.1-8B": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
}

# NOTE: linked already, written alongside these pages by its own author; an entry here stops mattering once it exists


@dataclass(frozen=True)
class Command:
    where: str  # page:line
    argv: tuple[str, ...]  # after `lit3d`
    needs: str | None = None  # `# needs: ...`: only the arguments are checked
    shown: str | None = None  # the output the docs show under it

    def __str__(self) -> str:
        return f"{self.where}: lit3d {shlex.join(self.argv)}"


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the first line, lines) of each fenced block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            language, start = lines[i][3:].strip(), i + 1
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            blocks.append((language, start + 1, lines[start:i]))
        i += 1
    return blocks


def block_commands(page: str, first_line: int, lines: list[str], variables: dict[str, str]) -> list[Command]:
    commands, needs, logical, start = [], None, "", first_line
    for number, line in enumerate(lines, first_line):
        if not logical:
            start = number
        if line.rstrip().endswith("\\"):
            logical += line.rstrip()[:-1] + " "
            continue
        logical, line = "", logical + line
        if re.fullmatch(r"\s*#\s*needs:.*", line):
            needs = line.split("needs:", 1)[1].strip()  # for the rest of the block
            continue
        trailing = re.search(r"\s#\s*needs:(.*)$", line)
        line = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: variables.get(m[1], m[0]), line)
        words = shlex.split(line, comments=True)
        if len(words) == 1 and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            name, value = words[0].split("=", 1)
            variables[name] = value
            continue
        pieces, piece = [], []
        for word in [*words, "&&"]:
            if word in ("&&", "||", ";"):
                pieces.append(piece)
                piece = []
            else:
                piece.append(word)
        for piece in pieces:
            while piece and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", piece[0]):  # VAR=value lit3d ...
                piece = piece[1:]
            if piece[:1] == ["lit3d"]:
                marked = trailing[1].strip() if trailing else needs
                commands.append(Command(f"{page}:{start}", tuple(piece[1:]), marked))
    return commands


def page_commands(path: Path) -> list[Command]:
    text, page, variables = path.read_text(), path.relative_to(ROOT).as_posix(), {}
    blocks, commands = fenced_blocks(text), []
    for index, (language, first_line, lines) in enumerate(blocks):
        if language not in SHELL:
            continue
        found = block_commands(page, first_line, lines, variables)
        after = blocks[index + 1] if index + 1 < len(blocks) else None
        if found and after and after[0] == "text":  # what the block's last command prints
            found[-1] = Command(found[-1].where, found[-1].argv, found[-1].needs, "\n".join(after[2]))
        commands += found
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for match in re.finditer(r"`(lit3d [a-z]+ --[^`]*)`", prose):
        line = text[: text.index(match[0])].count("\n") + 1
        commands.append(Command(f"{page}:{line}", tuple(shlex.split(match[1])[1:])))
    return commands


def all_commands() -> list[Command]:
    return [command for page in PAGES for command in page_commands(page)]


def argument_table_block(text: str) -> str:
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    return text[start:end].strip()


def test_the_readme_is_the_front_door_with_the_ci_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220, "the README is the front door: move the details to a page of docs/"
    assert TEST_COMMAND in readme.splitlines(), f".ci/run greps the README for this line: {TEST_COMMAND}"


def test_every_page_is_listed_and_every_command_is_one_lit3d_has():
    index, readme = (ROOT / "docs" / "index.md").read_text(), (ROOT / "README.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        if page.name != "index.md":
            assert f"]({page.name})" in index, f"docs/index.md does not link {page.name}"
            assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
    commands = all_commands()
    assert {c.where.split(":")[0] for c in commands} >= {"README.md", "docs/planner.md", "docs/launching.md"}
    known = {*LIGHTNING, "plan", *FUNCTIONS}
    assert not [str(c) for c in commands if c.argv[:1] and c.argv[0] not in known]


def test_every_relative_link_leads_to_a_file_and_its_heading():
    broken = []
    for page in PAGES:
        prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.exists() and linked.suffix == ".md":
                headings = re.findall(r"^#+\s+(.*)$", linked.read_text(), flags=re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
                if anchor not in slugs:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    for page in PAGES:  # repository files the commands name
        for language, _, lines in fenced_blocks(page.read_text()):
            if language in SHELL:
                for path in re.findall(r"(?<![\w/])((?:configs|examples|benchmarks)/[\w./-]+)", "\n".join(lines)):
                    if not (ROOT / path).exists():
                        broken.append(f"{page.relative_to(ROOT)}: {path} (no such file)")
    assert not broken, "\n".join(broken)


def test_the_argument_table_is_generated_from_the_strategy_settings():
    from lit3d.parallel.arguments import argument_table

    assert argument_table_block(ARGUMENT_TABLE.read_text()) == argument_table().strip(), (
        "docs/strategy-arguments.md's table is not what the strategy's settings say; regenerate it with "
        '`python tests/test_docs.py --write-argument-table` (it pastes the output of `python -c "from '
        'lit3d.parallel.arguments import argument_table; print(argument_table())"` between the markers)'
    )


@pytest.fixture(scope="module")
def lightning_commands_checked(tmp_path_factory):
    """Starts one child process that parses every Lightning command (``--print_config``) and runs the tiny ones, in a
    folder of its own (``configs`` linked in): call the returned function for its findings."""
    folder = tmp_path_factory.mktemp("lightning_commands")
    (folder / "configs").symlink_to(ROOT / "configs")
    commands = [c for c in all_commands() if c.argv[:1] and c.argv[0] in LIGHTNING]
    (folder / "commands.json").write_text(json.dumps([list(c.argv) for c in commands]))
    child = forked.start([sys.executable, __file__, "--check-lightning-commands", "commands.json", "results.json"],
                         cwd=folder, env=dict(os.environ), merge_output=True)  # fmt: skip

    def findings() -> list[tuple[Command, dict]]:
        assert child.wait(timeout=240) == 0, child.stdout()[-5000:]
        return list(zip(commands, json.loads((folder / "results.json").read_text())))

    yield findings
    child.kill()


def test_the_plans_in_the_docs_run_and_print_the_output_shown(lightning_commands_checked, tmp_path, monkeypatch):
    """NOTE: asks for `lightning_commands_checked` to start its child first: it parses while the plans run."""
    from lit3d.cli import main

    monkeypatch.chdir(tmp_path)  # `--map FILE` writes here
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # `--config configs/X.yaml`
    for folder, config in HF_FOLDERS.items():  # `--model FOLDER`: the planner reads its config.json alone
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(config, indent=2))
    plans = [c for c in all_commands() if c.argv[:1] == ("plan",)]
    assert len(plans) >= 5
    printed: dict[tuple[str, ...], str] = {}
    failures = []
    for command in plans:
        if command.needs is not None:  # what it reads is the reader's: parsed only
            _parse(command)
            continue
        if command.argv not in printed:
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    main(list(command.argv))
            except SystemExit as error:  # `--help` exits 0
                if error.code not in (0, None):
                    failures.append(f"{command}\n  failed: {error!r}\n{out.getvalue()[-2000:]}")
                    continue
            except Exception as error:
                failures.append(f"{command}\n  failed: {error!r}\n{out.getvalue()[-2000:]}")
                continue
            printed[command.argv] = out.getvalue()
        lines = {" ".join(line.split()) for line in printed[command.argv].splitlines()}
        missing = [line for line in (command.shown or "").splitlines() if line.strip() not in ("", "...")]
        missing = [line for line in missing if " ".join(line.split()) not in lines]
        if missing:
            failures.append(
                f"{command}\n  the docs show lines it no longer prints (update them from its output):\n"
                + "\n".join(f"    {line}" for line in missing)
            )
    assert not failures, "\n\n".join(failures)


def _parse(command: Command) -> None:
    """Parse ``command``'s arguments as its jsonargparse function's command line (nothing runs)."""
    from jsonargparse import CLI, capture_parser

    from lit3d.cli import _bare_flags_true
    from lit3d.cli import commands as functions

    parser = capture_parser(lambda: CLI(getattr(functions, command.argv[0]), args=[], as_positional=False))
    parser.parse_args(_bare_flags_true(list(command.argv[1:])))


def test_the_other_commands_in_the_docs_parse_and_those_without_needs_run(tmp_path, monkeypatch):
    from lit3d.cli import main

    monkeypatch.chdir(tmp_path)
    others = [c for c in all_commands() if c.argv[:1] and c.argv[0] in FUNCTIONS]
    assert others
    failures = []
    for command in others:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                _parse(command)
                if command.needs is None:
                    main(list(command.argv))
        except (SystemExit, Exception) as error:
            failures.append(f"{command}\n  failed: {error!r}\n{out.getvalue()[-2000:]}")
    assert not failures, "\n\n".join(failures)


def test_the_training_commands_in_the_docs_parse_and_the_tiny_ones_run(lightning_commands_checked):
    findings = lightning_commands_checked()
    assert len(findings) >= 10 and any(result["ran"] for _, result in findings)
    failures = [f"{command}\n  exit {result['code']}:\n{result['output']}" for command, result in findings
                if result["code"] != 0]  # fmt: skip
    assert not failures, "\n\n".join(failures)


def check_lightning_commands(commands: list[list[str]]) -> list[dict]:
    """In the child: each command through `lit3d.cli.make_cli`, with ``--print_config`` unless it asks for help or
    is a ``fast_dev_run`` (which trains a batch or two for real)."""
    from lit3d.cli import make_cli

    results = []
    for argv in commands:
        runs = any(a.startswith("--trainer.fast_dev_run") for a in argv)
        asks = any(a in ("--help", "--print_config") or a.endswith(".help") for a in argv)
        out, code = io.StringIO(), 0
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                make_cli(argv if runs or asks else [*argv, "--print_config"])
        except SystemExit as error:
            code = 0 if error.code is None else error.code if isinstance(error.code, int) else 1
            if code == 1 and not isinstance(error.code, int):  # `SystemExit("lit3d fit: error: ...")`
                out.write(str(error.code))
        except Exception:
            code = 1
            out.write(traceback.format_exc())
        results.append({"code": code, "ran": runs, "output": out.getvalue()[-3000:]})
    return results


def write_argument_table() -> None:
    from lit3d.parallel.arguments import argument_table

    text = ARGUMENT_TABLE.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    ARGUMENT_TABLE.write_text(f"{text[:start]}\n{argument_table().strip()}\n{text[end:]}")
    print(f"wrote the argument table into {ARGUMENT_TABLE.relative_to(ROOT)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-argument-table"]:
        write_argument_table()
    elif sys.argv[1:2] == ["--check-lightning-commands"]:
        given, written = Path(sys.argv[2]), Path(sys.argv[3])
        written.write_text(json.dumps(check_lightning_commands(json.loads(given.read_text()))))
    else:
        sys.exit(f"usage: python {Path(__file__).name} --write-argument-table")
