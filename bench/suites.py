"""``inferlb bench SUITE [options]``: every benchmark by name, with one way to parse its options, record its
command and run it.

A suite is a module of this package with ``add_arguments(parser)`` (its options) and ``run(args) -> int`` (the
exit status); `SUITES` is the table of them. The runner sets ``args.command``, the command line a report records.
Modules are imported only when their suite runs or shows its help, so listing the suites imports none of them.
``python -m inferlb.bench.NAME [options]`` runs the same suite through `script`. The old form of the
routing-quality benchmark, ``inferlb bench --mode des|live ...`` (no suite named), runs ``quality``.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Protocol, cast

__all__ = ["SUITES", "Suite", "SuiteModule", "main", "run_suite", "script"]

PROG = "inferlb bench"


@dataclass(frozen=True, slots=True)
class Suite:
    """One benchmark: its name on the command line, which is also its module's under ``inferlb.bench``, and one
    line of help."""

    name: str
    summary: str

    @property
    def module(self) -> str:
        return f"inferlb.bench.{self.name}"


class SuiteModule(Protocol):
    """What a suite's module provides."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


SUITES: Mapping[str, Suite] = MappingProxyType(
    {
        suite.name: suite
        for suite in (
            Suite("quality", "routing quality on real traces: every contender, simulated or live"),
            Suite("hop", "what the picker hop costs: inferlb beside Envoy alone and a do-nothing picker"),
            Suite("helperthreads", "the picker's helper threads under SCHED_BATCH against the normal policy"),
            Suite("pick", "what a pick costs per preset and pool size, and what the metrics scraper costs"),
            Suite("sim", "what the emulator costs, and how fast the simulator replays a trace"),
            Suite("shift", "how fast traffic leaves a server that turns 5x slower"),
            Suite("external", "the gateway under guidellm, beside the servers' and Envoy's figures"),
            Suite("resilience", "what faults cost the clients: picker and server kills, span flood, soak"),
            Suite("membership", "servers that join (slow start), leave (drain) and die under load, per source"),
            Suite("bodycost", "what the worst request bodies cost the picker's parser"),
            Suite("experiments", "A/B tests between policies: false verdicts, power, grey releases that roll back"),
            Suite("conformance", "an Endpoint Picker against the protocol: over ext_proc, and through real Envoy"),
            Suite(
                "kvevents",
                "the servers' KV events against the picker's guess: hit rate and TTFT, one picker and replicas",
            ),
            Suite("peercheck", "the peer routers' simulator models against the live peers, on one trace window"),
            Suite("dynamocheck", "the model of Dynamo's KV router against the real router, on common simulated runs"),
            Suite(
                "replicas",
                "pickers sharing state through Redis: against one picker and unshared ones (live, simulated), "
                "1 and 2 workers, tenant quotas, the exchange's CPU",
            ),
        )
    }
)


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the suite ``argv`` names (default: the command line's) with the rest of ``argv`` as its options."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if _old_quality_form(argv):
        argv = ["quality", *argv]
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run one benchmark suite. `%(prog)s SUITE --help` shows a suite's options.",
        epilog="suites:\n" + "\n".join(f"  {s.name:<12} {s.summary}" for s in SUITES.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("suite", choices=SUITES, metavar="SUITE", help="one of: " + ", ".join(SUITES))
    parser.add_argument("options", nargs=argparse.REMAINDER, metavar="OPTIONS", help="the suite's options")
    if not argv:
        parser.error("name a suite: " + ", ".join(SUITES))
    chosen = parser.parse_args(argv)
    suite = SUITES[chosen.suite]
    module = importlib.import_module(suite.module)
    return run_suite(module, chosen.options, f"{prog} {suite.name}")


def run_suite(module: ModuleType, argv: Sequence[str], prog: str) -> int:
    """Parse ``argv`` with the options of the suite in ``module`` and run it; ``prog`` + ``argv`` is the command
    its report records."""
    suite = cast(SuiteModule, module)
    parser = argparse.ArgumentParser(
        prog=prog, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    suite.add_arguments(parser)
    args = parser.parse_args(argv)
    args.command = " ".join([prog, *map(shlex.quote, argv)])
    return int(suite.run(args))


def script(module: ModuleType) -> int:
    """``python -m inferlb.bench.NAME [options]``: the suite in ``module`` (the running ``__main__``), on the
    command line's options."""
    name = module.__spec__.name if module.__spec__ is not None else module.__name__
    return run_suite(module, sys.argv[1:], f"python -m {name}")


def _old_quality_form(argv: Sequence[str]) -> bool:
    """``inferlb bench --mode des ...``: options first, one of them ``--mode``, and no suite named."""
    return (
        bool(argv)
        and argv[0].startswith("-")
        and argv[0] not in ("-h", "--help")
        and any(a == "--mode" or a.startswith("--mode=") for a in argv)
    )
