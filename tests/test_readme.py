"""The README's commands run as written: every `python ...` line of its ```bash blocks
parses with the flags its CLI has today (fast), and runs to exit code 0 in a fresh
directory, in the order the README gives them (slow). ```text blocks are for commands
that are not meant to run here."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import cli_env

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def bash_commands(text: str) -> list[list[str]]:
    """argv of every `python ...` line in the ```bash blocks of `text`, in order (a
    trailing backslash joins a line to the next)."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] == "python":
                out.append(argv)
    return out


def parse_as_cli(argv: list[str]) -> None:
    """Parse `argv` (`python -m engine.X ...`) as its CLI does, without running it;
    raises (SystemExit, UsageError, ConfigError) on a flag or value the CLI refuses."""
    from engine.cli import args as train_args
    from engine.cli import generate, plan

    assert argv[1] == "-m", argv
    module, rest = argv[2], argv[3:]
    if module == "engine.train":
        train_args.parse(rest, auto=True)
    elif module == "engine.plan":
        plan.build_parser().parse_args(rest)
    elif module == "engine.generate":
        generate.build_parser().parse_args(rest)
    elif module == "engine.launch":
        assert "--" in rest, argv
        train_args.parse(rest[rest.index("--") + 1:])
    elif module == "pytest":
        pass
    else:
        raise AssertionError(f"no parser known for {module}")


def engine_commands() -> list[list[str]]:
    return [a for a in bash_commands(README.read_text())
            if len(a) > 2 and a[1] == "-m" and a[2].startswith("engine.")]


def test_bash_blocks_are_found():
    text = "```bash\npip install x\npython -m engine.train --a 1 \\\n  --b 2\n```\n" \
           "```text\npython -m engine.convert x\n```\n"
    assert bash_commands(text) == [["python", "-m", "engine.train", "--a", "1", "--b", "2"]]


def test_readme_engine_commands_parse():
    commands = engine_commands()
    assert {a[2] for a in commands} >= {"engine.train", "engine.plan"}
    for argv in commands:
        parse_as_cli(argv)


def test_a_flag_that_does_not_exist_is_refused():
    from engine.cli.args import UsageError
    with pytest.raises((SystemExit, UsageError)):
        parse_as_cli(["python", "-m", "engine.train", "--layout", "fsdp4xtp2",
                      "--no-such-flag"])


def test_readme_is_short_and_states_no_load():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "load average" not in text.lower()


@pytest.mark.slow
def test_readme_commands_run(tmp_path):
    """Every `python` command of the README's bash blocks, but installing and the test
    suite itself, in one fresh directory in order (a checkpoint written by one is read
    by the next)."""
    env = cli_env(PYTHONPATH=str(ROOT))
    for argv in bash_commands(README.read_text()):
        if argv[1:3] == ["-m", "pytest"]:
            continue
        if argv[1].endswith(".py"):
            argv = [argv[0], str(ROOT / argv[1]), *argv[2:]]
        r = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, f"{shlex.join(argv)}\n{r.stderr[-2000:]}"


def test_the_switch_table_in_the_docs_is_the_one_the_code_describes():
    """docs/parallelism.md's switch table is `engine.cli.args.switch_table()`, the same
    descriptions `--help` prints (regenerate it with
    `python -c "from engine.cli.args import switch_table; print(switch_table())"`)."""
    from engine.cli.args import switch_table

    text = (ROOT / "docs" / "parallelism.md").read_text()
    block = re.search(r"<!-- switches:begin -->\n(.*?)\n<!-- switches:end -->", text, re.S)
    assert block and block.group(1) == switch_table()
