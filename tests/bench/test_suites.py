"""bench/suites.py: every benchmark is a suite of `inferlb bench`, with its own options and help; the old
`inferlb bench --mode ...` form still runs routing quality; the product reaches the benchmarks only through the
one lazy hook in the CLI."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from inferlb.bench import suites
from inferlb.bench.suites import SUITES
from inferlb.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
# Scripts the suites start as child processes (or another venv's Python runs): not benchmarks of their own.
CHILD_PROCESSES = {
    "dynamolive",
    "faultload",
    "kubeapi",
    "loadgen",
    "metricsfarm",
    "noop_picker",
    "offline_tokenizer",
    "spanflood",
}


def _runs_as_script(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def test_every_runnable_bench_module_is_a_suite_or_a_child_process() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py") if _runs_as_script(p)}
    assert scripts - CHILD_PROCESSES == set(SUITES)


@pytest.mark.parametrize("name", list(SUITES))
def test_a_suite_module_has_add_arguments_and_run(name: str) -> None:
    module = importlib.import_module(SUITES[name].module)
    assert list(inspect.signature(module.add_arguments).parameters) == ["parser"]
    assert list(inspect.signature(module.run).parameters) == ["args"]


def test_bench_help_lists_every_suite(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: inferlb bench")
    for suite in SUITES.values():
        assert f"  {suite.name:<12} {suite.summary}" in shown


@pytest.mark.parametrize("name", list(SUITES))
def test_a_suites_help_shows_its_options(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", name, "--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"usage: inferlb bench {name} ") and "--out" in shown


def test_no_suite_or_an_unknown_one_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["nosuch"]):
        with pytest.raises(SystemExit) as exit_:
            suites.main(argv)
        assert exit_.value.code == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


def _capture_run(monkeypatch: pytest.MonkeyPatch, name: str) -> list[argparse.Namespace]:
    seen: list[argparse.Namespace] = []

    def run(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(importlib.import_module(SUITES[name].module), "run", run)
    return seen


def test_the_suite_gets_its_options_and_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture_run(monkeypatch, "hop")
    assert cli_main(["bench", "hop", "--quick", "--concurrency", "1", "16", "--out", "out dir"]) == 0
    (args,) = seen
    assert args.quick and args.concurrency == [1, 16] and args.out == Path("out dir")
    assert args.command == "inferlb bench hop --quick --concurrency 1 16 --out 'out dir'"


def test_the_old_mode_form_is_routing_quality(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture_run(monkeypatch, "quality")
    assert cli_main(["bench", "--mode", "des", "--trace", "t.jsonl", "--out", "o", "--quick"]) == 0
    assert cli_main(["bench", "--trace", "t.jsonl", "--mode=live", "--out", "o"]) == 0
    assert cli_main(["bench", "quality", "--mode", "des", "--trace", "t.jsonl", "--out", "o"]) == 0
    assert [a.mode for a in seen] == ["des", "live", "des"]
    assert seen[0].trace == ["t.jsonl"] and seen[0].out == Path("o") and seen[0].quick
    assert seen[0].command == "inferlb bench quality --mode des --trace t.jsonl --out o --quick"


def test_python_m_runs_the_same_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture_run(monkeypatch, "shift")
    module = importlib.import_module(SUITES["shift"].module)
    monkeypatch.setattr(sys, "argv", ["shift.py", "--policy", "round-robin"])
    assert suites.script(module) == 0
    assert seen[0].policy == "round-robin"
    assert seen[0].command == "python -m inferlb.bench.shift --policy round-robin"


def test_python_m_help_in_a_process_of_its_own() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "inferlb.bench.pick", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m inferlb.bench.pick")


def test_other_commands_never_import_the_benchmarks() -> None:
    code = (
        "import sys\n"
        "from inferlb.cli import main\n"
        "try:\n"
        "    main(['envoy-config', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('inferlb.bench')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
