"""The ``inferlb`` command line: errors that say how to fix the input, envoy-config output, and ``inferlb sim``'s
start-up faults, served by the command as its own process."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from inferlb.cli import main
from inferlb.procs import ManagedProcess, find_tool, free_port, http_ok
from inferlb.stack import READY_TIMEOUT_S, start_sim


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "picker.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param("pool: {endpoints: []}\n", "pool.endpoints must be a non-empty list", id="no-endpoints"),
        pytest.param("pool: {endpoints: [{address: 'gpu-1:8000'}]}\n", "pool.endpoints[0].address", id="hostname"),
        pytest.param(
            "policy: fastest\npool: {endpoints: [{address: '10.0.0.1:80'}]}\n", "policy must be a preset", id="policy"
        ),
        pytest.param("pool: [\n", "not valid YAML", id="yaml"),
        pytest.param(  # PyYAML raised ValueError for it: the message named neither the file nor YAML
            "policy: 2024-13-01\npool: {endpoints: [{address: '10.0.0.1:80'}]}\n",
            "picker.yaml: not valid YAML: a value that cannot be read (month must be in 1..12)",
            id="yaml-date",
        ),
        pytest.param(
            "admin: 0.0.0.0:9003\npool: {endpoints: [{address: '10.0.0.1:80'}]}\n",
            "admin: '0.0.0.0:9003' is reachable beyond this host",
            id="admin-beyond-loopback-without-token",
        ),
    ],
)
@pytest.mark.parametrize("command", ["serve", "envoy-config"])
def test_bad_config_exits_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str, command: str
) -> None:
    assert main([command, "--config", str(write(tmp_path, text))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferlb: error: ") and words in err


def test_serve_refuses_an_admin_token_it_cannot_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = f"admin_auth: {{token_file: {tmp_path / 'absent'}}}\npool: {{endpoints: [{{address: '10.0.0.1:80'}}]}}\n"
    assert main(["serve", "--config", str(write(tmp_path, text))]) == 2
    assert "admin_auth.token_file: cannot read" in capsys.readouterr().err


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", str(tmp_path / "absent.yaml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_envoy_config_writes_a_bootstrap(tmp_path: Path) -> None:
    config = write(tmp_path, "listen: 127.0.0.1:9100\npool: {endpoints: [{address: '10.0.0.1:80'}]}\n")
    out = tmp_path / "envoy.yaml"
    code = main(
        ["envoy-config", "--config", str(config), "--listen", "127.0.0.1:8081", "--fail-closed", "--out", str(out)]
    )
    assert code == 0
    doc = yaml.safe_load(out.read_text())
    listener = doc["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == 8081
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["http_filters"][0]["typed_config"]["failure_mode_allow"] is False


def test_serve_rejects_a_bad_listen_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "pool: {endpoints: [{address: '10.0.0.1:80'}]}\n")
    assert main(["serve", "--config", str(config), "--listen", "picker:9002"]) == 2
    assert "not a literal IP address" in capsys.readouterr().err


def test_the_example_config_renders(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "deploy" / "picker.example.yaml"
    out = tmp_path / "envoy.yaml"
    assert main(["envoy-config", "--config", str(example), "--out", str(out)]) == 0
    assert "fd00::14" in out.read_text()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        pytest.param(["--listen", "localhost:80"], "bad server address 'localhost:80'", id="hostname"),
        pytest.param(["--base-port", "65535", "--replicas", "2"], "runs past port 65535", id="port-range"),
        pytest.param(["--base-port", "9000", "--replicas", "0"], "--replicas must be >= 1", id="replicas"),
        pytest.param(["--listen", "127.0.0.1:9", "--profile", "tpu"], "unknown profile 'tpu'", id="profile"),
        pytest.param(["--listen", "127.0.0.1:9", "--time-scale", "0"], "time_scale", id="scale"),
        pytest.param(["--listen", "127.0.0.1:9", "--fault", "3:hang=true"], "index must be in 0..0", id="fault-index"),
        pytest.param(["--listen", "127.0.0.1:9", "--fault", "0:melt=1"], "'melt' is not one of", id="fault-key"),
        pytest.param(["--listen", "127.0.0.1:9", "--fault", "0:slowdown=-2"], "slowdown must be", id="fault-value"),
        pytest.param(["--listen", "127.0.0.1:9", "--fault", "slowdown=2"], "expected INDEX:key=value", id="shape"),
    ],
)
def test_sim_refuses_bad_arguments_with_a_message(
    capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    assert main(["sim", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferlb: error: ") and words in err, err


def test_sim_reports_a_busy_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["sim", "--listen", f"127.0.0.1:{port}"]) == 2
    assert f"cannot bind 127.0.0.1:{port}" in capsys.readouterr().err


# --- inferlb sim --fault, end to end --------------------------------------------------------------------------------

COMPLETION = {"model": "demo-model", "prompt": "hello there", "max_tokens": 4}


def _complete(address: str, timeout: float = 10.0) -> int:
    return httpx.post(f"http://{address}/v1/completions", json=COMPLETION, timeout=timeout).status_code


@pytest.fixture(scope="module")
def faulty_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """One ``inferlb sim`` process, three servers: 0 refuses every request, 1 hangs, 2 is healthy."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    args = ("--model", "demo-model", "--time-scale", "50", "--fault", "0:error_rate=1", "--fault", "1:hang=true")
    process = start_sim(addresses, log, *args)
    try:
        yield addresses
    finally:
        process.stop()


def test_sim_fault_error_rate_fails_requests_on_that_server_only(faulty_fleet: list[str]) -> None:
    refusing, _, healthy = faulty_fleet
    assert [_complete(refusing) for _ in range(3)] == [500, 500, 500]
    assert _complete(healthy) == 200
    assert httpx.get(f"http://{refusing}/health", timeout=5).status_code == 200  # up, but every request fails


def test_sim_fault_hang_stalls_requests_on_that_server_only(faulty_fleet: list[str]) -> None:
    _, hung, healthy = faulty_fleet
    with pytest.raises(httpx.ReadTimeout):
        _complete(hung, timeout=1.0)
    assert _complete(healthy) == 200
    assert httpx.get(f"http://{hung}/health", timeout=5).status_code == 200  # the HTTP server still answers


def test_sim_fault_crash_restarts_the_server_cold(tmp_path: Path) -> None:
    """Server 0 crashes at start-up, so it answers 503 for its cold start (2 s at time scale 1), then serves."""
    crashed, healthy = (f"127.0.0.1:{free_port()}" for _ in range(2))
    argv = [find_tool("inferlb"), "sim", "--model", "demo-model", "--listen", crashed, "--listen", healthy]
    argv += ["--fault", "0:crash=true,cold_start_s=2"]
    process = ManagedProcess("emulated servers", argv, tmp_path / "sim.log").start()
    try:
        process.wait_ready(http_ok(f"http://{healthy}/health"), READY_TIMEOUT_S, f"serving on {healthy}")
        seen: list[int] = []  # /health, polled until ready
        refused: list[int] = []  # a completion sent after each 503 (the last may land after the cold start)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not seen or seen[-1] != 200:
            assert time.monotonic() < deadline, f"{crashed} still not ready; /health answered {seen[-5:]}"
            seen.append(httpx.get(f"http://{crashed}/health", timeout=5).status_code)
            if seen[-1] == 503:
                refused.append(_complete(crashed))
            time.sleep(0.02)
        assert seen[0] == 503, "the crashed server was ready at once"
        assert set(seen) == {503, 200}
        assert refused[0] == 503 and set(refused) <= {503, 200}
        assert _complete(crashed) == 200
        assert "crashed; ready again in 2.0 s" in process.log_tail()
    finally:
        process.stop()


def test_serve_names_the_admin_api_whose_port_is_busy_and_stops_cleanly(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        text = (
            f"listen: 127.0.0.1:{free_port()}\nadmin: 127.0.0.1:{port}\n"
            "signals: {scrape_metrics: false}\npool: {endpoints: [{address: '10.0.0.1:80'}]}\n"
        )
        done = subprocess.run(
            [find_tool("inferlb"), "serve", "--config", str(write(tmp_path, text))],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"admin API: cannot bind 127.0.0.1:{port}" in done.stderr
    # The gRPC server it had started is stopped before the loop closes (it printed a traceback at exit).
    assert "Event loop is closed" not in done.stderr and "Traceback" not in done.stderr, done.stderr
