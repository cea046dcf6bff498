"""`elmo serve`'s command line on real processes: ``--model [NAME=]DIR`` (names, the default model, duplicates), the
bearer token taken from ELMO_AUTH_TOKEN (by the server and by the clients), and TLS flags that only go together.
A bad command line must end in exit 2 with one `elmo serve: error:` line and no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from elmo.service.server import _model_specs

from elmo.client import EmbedderClient, RemoteError
from elmo.runtime import Embedder
from elmo.v1 import embedder_pb2 as pb
from tests.conftest import REPO
from tests.serve_process import AUTH_ENV, ServeProcess, clean_env, serve_until_exit

TOKEN = "env-s3cret"


def test_model_specs_split_name_and_directory(tmp_path: Path) -> None:
    sweep = tmp_path / "runs" / "lr=0.1"  # an existing directory whose path holds '=' is a directory, not NAME=DIR
    sweep.mkdir(parents=True)
    specs = _model_specs(["news=/models/a", "/models/b", str(sweep), "x=y=/z", f"swept={sweep}"])
    assert specs == [
        ("news", Path("/models/a")),
        ("", Path("/models/b")),
        ("", sweep),
        ("x", Path("y=/z")),
        ("swept", sweep),
    ]


def reported_name(model: Path) -> str:
    """The name a model directory reports (onnx.json, else the directory's name): its name without NAME=."""
    return Embedder(model, intra_op_threads=1).info.name


def _bad_command_lines(model: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    """case -> (arguments, the one error line expected)."""
    name = reported_name(model) if model.is_dir() else "?"
    missing_cert, missing_key = tmp / "no-cert.pem", tmp / "no-key.pem"
    return {
        "duplicate NAME": (
            ["--model", f"a={model}", "--model", f"a={model}"],
            "elmo serve: error: two models are named 'a': give one another name with --model NAME=DIR",
        ),
        "duplicate implicit name": (
            ["--model", str(model), "--model", str(model)],  # both report the same name
            f"elmo serve: error: two models are named '{name}': give one another name with --model NAME=DIR",
        ),
        "NAME=DIR that does not exist": (
            ["--model", f"a={tmp / 'nowhere'}"],
            f"elmo serve: error: {tmp / 'nowhere'}: model directory not found",
        ),
        "--tls-cert without --tls-key": (
            ["--model", str(model), "--tls-cert", str(missing_cert)],
            "elmo serve: error: --tls-cert and --tls-key go together",
        ),
        "--tls-key without --tls-cert": (
            ["--model", str(model), "--tls-key", str(missing_key)],
            "elmo serve: error: --tls-cert and --tls-key go together",
        ),
        "--model-alias without a target": (
            ["--model", str(model), "--model-alias", "text-embedding-3-small"],
            "elmo serve: error: --model-alias text-embedding-3-small: expected NAME=MODEL or NAME=MODEL:TASK",
        ),
        "--model-alias to a model not served": (
            ["--model", str(model), "--model-alias", "ada=nope"],
            f"elmo serve: error: --model-alias ada=nope: no served model is named 'nope' (serving: {name})",
        ),
        "--background-nice out of range": (
            ["--model", str(model), "--background-nice", "20"],
            "elmo serve: error: limit --background-nice must be in 0..19 (got 20)",
        ),
        "--auth-token empty (an unset variable)": (
            ["--model", str(model), "--auth-token", ""],
            "elmo serve: error: --auth-token is empty (an unset variable?): give a token, or leave it out to serve "
            "open",
        ),
        "--admin-token blank": (
            ["--model", str(model), "--admin-token", "  "],
            "elmo serve: error: --admin-token is empty (an unset variable?): give a token, or leave it out to serve "
            "without the admin API",
        ),
        "TLS files missing": (
            ["--model", str(model), "--tls-cert", str(missing_cert), "--tls-key", str(missing_key)],
            f"elmo serve: error: {missing_cert}: TLS file not found",
        ),
    }


CASES = list(_bad_command_lines(Path("m"), Path("t")))


@pytest.mark.parametrize("case", CASES)
def test_bad_command_line_is_one_error_line_and_exit_2(tiny_model_dir: Path, tmp_path: Path, case: str) -> None:
    args, expected = _bad_command_lines(tiny_model_dir, tmp_path)[case]
    finished = serve_until_exit(args, tmp_path / "serve")
    assert finished.returncode == 2, finished.stderr
    assert finished.error_lines() == [expected], finished.stderr
    assert "Traceback" not in finished.stderr


@pytest.fixture(scope="module")
def env_token_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Two models, one named and one not; the token only in the environment (no --auth-token)."""
    workdir = tmp_path_factory.mktemp("env_token_server")
    args = ["--model", f"first={tiny_model_dir}", "--model", str(tiny_model_dir)]
    with ServeProcess(args, workdir, env={AUTH_ENV: TOKEN}) as server:
        yield server.wait_serving()
        server.sigterm()
        assert server.wait(30) == 0


def test_named_and_unnamed_models_the_first_is_the_default(
    env_token_server: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(AUTH_ENV, raising=False)
    runtime = Embedder(tiny_model_dir, intra_op_threads=1)
    with EmbedderClient(env_token_server, auth_token=TOKEN, timeout=30) as client:
        name = runtime.info.name
        assert client.list_models() == ["first", name]  # NAME=DIR, then the name the model reports
        request = pb.EmbedRequest(inputs=[pb.Input(tokens=pb.Tokens(tokens=["which", "model"]))])
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        assert client.stub.Embed(request, timeout=30, metadata=metadata).model == "first"
        (expected,) = runtime.embed_tokens([["same", "weights"]])
        for model in ("first", name):
            (result,) = client.embed([["same", "weights"]], model=model)
            assert result.layers.tobytes() == expected.tobytes()
        assert client.model_info(name).name == name


def test_server_takes_the_token_from_the_environment(env_token_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTH_ENV, raising=False)
    with EmbedderClient(env_token_server, timeout=30) as anonymous:
        with pytest.raises(RemoteError) as info:
            anonymous.embed(["no token"])
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and "missing" in info.value.details
    with EmbedderClient(env_token_server, auth_token="wrong", timeout=30) as wrong:
        with pytest.raises(RemoteError) as info:
            wrong.list_models()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and info.value.details == "invalid bearer token"
    with EmbedderClient(env_token_server, auth_token=TOKEN, timeout=30) as right:
        assert right.embed(["with the token"])[0].tokens == ["with", "the", "token"]


def _elmo_embed(target: str, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "elmo.cli",
        "embed",
        "--server",
        target,
        "--timeout-s",
        "30",
        *flags,
        "hello world",
    ]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, env=clean_env(env))


def test_clients_take_the_token_from_the_environment(env_token_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTH_ENV, TOKEN)
    with EmbedderClient(env_token_server, timeout=30) as from_env:
        assert from_env.embed(["from env"])[0].tokens == ["from", "env"]
    # `elmo embed`, as a user runs it: the token from the environment, and a flag that wins over it.
    done = _elmo_embed(env_token_server, env={AUTH_ENV: TOKEN})
    assert done.returncode == 0, done.stderr
    assert "'hello world': 2 tokens ['hello', 'world']" in done.stdout
    done = _elmo_embed(env_token_server, env={})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("elmo embed: error: UNAUTHENTICATED: missing")
    done = _elmo_embed(env_token_server, "--auth-token", TOKEN, env={AUTH_ENV: "stale"})
    assert done.returncode == 0, done.stderr
    done = _elmo_embed(env_token_server, "--auth-token", "stale", env={AUTH_ENV: TOKEN})
    assert done.returncode == 2 and "invalid bearer token" in done.stderr


def test_auth_token_flag_wins_over_the_environment(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_model_dir), "--auth-token", "from-flag"]
    with ServeProcess(args, tmp_path, env={AUTH_ENV: "from-env"}) as server:
        target = server.wait_serving()
        with EmbedderClient(target, auth_token="from-flag", timeout=30) as flag:
            assert flag.list_models() == [reported_name(tiny_model_dir)]
        with EmbedderClient(target, auth_token="from-env", timeout=30) as env:
            with pytest.raises(RemoteError) as info:
                env.list_models()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        server.sigterm()
        assert server.wait(30) == 0


TAKEN = [("--port", ""), ("--http-port", " for HTTP"), ("--metrics-port", " for metrics")]


@pytest.mark.parametrize(("flag", "what"), TAKEN)
def test_a_taken_port_is_one_error_line_and_exit_2(tiny_model_dir: Path, tmp_path: Path, flag: str, what: str) -> None:
    """Before the fix gRPC's core printed its own `E... add_port.cc` line first (and a taken metrics port ended in a
    traceback after the server had started): the whole of stderr must be the one line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # a free port, then held: nothing else can listen there now
        taken.listen()
        port = taken.getsockname()[1]
        finished = serve_until_exit(["--model", str(tiny_model_dir), flag, str(port)], tmp_path / "serve")
    assert finished.returncode == 2, finished.stderr
    expected = f"elmo serve: error: cannot listen{what} on 127.0.0.1:{port}: the port is in use (stop what listens "
    expected += "there or pick another port)"
    assert finished.stderr.splitlines() == [expected]


def test_an_empty_token_in_the_environment_is_refused_and_a_plaintext_admin_token_warned(monkeypatch, caplog):
    from elmo.service.server import TlsFiles, token_from, warn_plaintext_admin

    from elmo.errors import ConfigError

    monkeypatch.setenv(AUTH_ENV, "")
    with pytest.raises(ConfigError, match=r"\$ELMO_AUTH_TOKEN is empty \(an unset variable\?\)"):
        token_from(None, AUTH_ENV, "--auth-token")
    monkeypatch.delenv(AUTH_ENV)
    assert token_from(None, AUTH_ENV, "--auth-token") is None and token_from("t", AUTH_ENV, "--auth-token") == "t"
    with caplog.at_level("WARNING", logger="service.server"):
        warn_plaintext_admin("127.0.0.1", "admin", None)  # loopback: nothing to say
        warn_plaintext_admin("0.0.0.0", "admin", TlsFiles(Path("c"), Path("k")))  # TLS: nothing to say
        assert caplog.records == []
        warn_plaintext_admin("0.0.0.0", "admin", None)
    (record,) = caplog.records
    assert "--admin-token on 0.0.0.0 over plaintext" in record.getMessage()


def test_a_server_open_to_the_network_without_a_token_says_so(caplog):
    from elmo.service.server import warn_open_to_the_network

    with caplog.at_level("WARNING", logger="service.server"):
        warn_open_to_the_network("127.0.0.1", None)  # this machine only: nothing to say
        warn_open_to_the_network("0.0.0.0", "a-token")  # a token: nothing to say
        assert caplog.records == []
        warn_open_to_the_network("0.0.0.0", None)
    (record,) = caplog.records
    assert "listening on 0.0.0.0 with no --auth-token" in record.getMessage()


def test_an_empty_token_variable_is_named_as_the_variable(tiny_model_dir: Path, tmp_path: Path) -> None:
    """ELMO_AUTH_TOKEN reaches the flag through the configuration (elmo.flags); an empty one is refused by its name."""
    finished = serve_until_exit(["--model", str(tiny_model_dir)], tmp_path / "serve", env={AUTH_ENV: ""})
    assert finished.returncode == 2
    assert finished.error_lines() == [
        "elmo serve: error: $ELMO_AUTH_TOKEN is empty (an unset variable?): give a token, or leave it out to serve open"
    ]
