"""The two test tiers: `make check` (ruff + `pytest -m "not slow"`, the inner loop) and `make test` (everything, what
CI runs, with the 25 slowest listed). tests/conftest.py marks the slow tier (SLOW, SLOW_FIXTURES) and says how the
list was chosen.

Run as a module on a `pytest --durations=0` log, it prints what refreshing SLOW needs: the files and tests that took
longest, each with its tier, and the fast tier's total:

    .venv/bin/python -m pytest -q -p no:cacheprovider --durations=0 > /tmp/durations.log
    .venv/bin/python -m tests.test_tiers /tmp/durations.log
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import COLLECTED_TIERS, REPO, SLOW, SLOW_FIXTURES, is_slow, repeated_ids, slow_files_first

TESTS = REPO / "tests"


# -- which tests are slow -----------------------------------------------------------------------------------------
def test_an_entry_names_a_file_a_function_with_all_its_cases_or_one_case() -> None:
    slow = ("tests/a/test_x.py", "tests/test_y.py::test_big", "tests/test_y.py::test_case[2]")
    assert is_slow("tests/a/test_x.py::test_anything", slow=slow)
    assert is_slow("tests/a/test_x.py::TestGroup::test_one[p]", slow=slow)
    assert is_slow("tests/test_y.py::test_big", slow=slow)
    assert is_slow("tests/test_y.py::test_big[cpu-1]", slow=slow)
    assert is_slow("tests/test_y.py::test_case[2]", slow=slow)
    assert not is_slow("tests/test_y.py::test_case[1]", slow=slow)
    assert not is_slow("tests/test_y.py::test_big_other", slow=slow)  # a prefix of a name is not the name
    assert not is_slow("tests/a/test_x2.py::test_anything", slow=slow)
    assert not is_slow("tests/test_y.py::test_small", slow=slow)


@pytest.mark.parametrize("fixture", sorted(SLOW_FIXTURES))
def test_a_test_that_needs_a_slow_fixture_is_slow(fixture) -> None:
    assert is_slow("tests/test_y.py::test_small", ["tmp_path", fixture], slow=())
    assert not is_slow("tests/test_y.py::test_small", ["tmp_path", "tiny_model_dir"], slow=())


def whole_suite_tiers(request: pytest.FixtureRequest) -> dict[str, bool]:
    """This session's collected node ids -> slow?, when it collected every test folder (`make check`, `make test`,
    plain `pytest`); a run of a few files cannot say what the whole suite's tiers are, so the test skips there."""
    tiers = request.config.stash.get(COLLECTED_TIERS, {})
    on_disk = {path.parent for path in TESTS.rglob("test_*.py")}
    collected = {(REPO / nodeid.split("::")[0]).parent for nodeid in tiers}
    if not on_disk <= collected:
        pytest.skip("checks the whole suite's tiers: run it with every test folder collected (make check, make test)")
    return tiers


def test_every_slow_entry_still_names_a_collected_test(request) -> None:
    tiers = whole_suite_tiers(request)
    stale = [entry for entry in SLOW if not any(is_slow(nodeid, slow=(entry,)) for nodeid in tiers)]
    assert not stale, f"SLOW in tests/conftest.py names tests that no longer exist (renamed or moved?): {stale}"


def test_every_test_folder_keeps_tests_in_the_fast_tier(request) -> None:
    """`make check` must still try each part of the code: no folder of tests/ is slow as a whole."""
    tiers = whole_suite_tiers(request)
    fast: dict[Path, int] = defaultdict(int)
    for nodeid, slow in tiers.items():
        fast[(REPO / nodeid.split("::")[0]).parent] += not slow
    empty = sorted(str(folder.relative_to(REPO)) for folder, count in fast.items() if count == 0)
    assert not empty, f"no fast test left in {empty}: take one of their tests out of SLOW in tests/conftest.py"
    assert sum(not slow for slow in tiers.values()) > sum(tiers.values()), "the slow tier outgrew the fast one"


# -- how the tiers are run ----------------------------------------------------------------------------------------
def make_dry_run(target: str) -> list[str]:
    """The commands `make -n TARGET` would run, one per line."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MAKE") and key != "MFLAGS"}
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", target], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def pytest_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if " -m pytest" in line]


# one worker per core this process may run on (what `nproc` counts), whole files each, in tests/conftest.py's order
WORKERS = f"-n {len(os.sched_getaffinity(0))} --dist loadfile --no-loadscope-reorder"


def test_make_check_runs_ruff_and_the_fast_tier_without_clients_or_chromium() -> None:
    lines = make_dry_run("check")
    assert ".venv/bin/ruff check ." in lines
    assert pytest_lines(lines) == [f'.venv/bin/python -m pytest -q -m "not slow" {WORKERS}'], lines
    assert not [line for line in lines if "venv-clients" in line or "chromium" in line], lines


def test_make_test_runs_every_test_and_lists_the_slowest() -> None:
    lines = make_dry_run("test")
    assert ".venv/bin/ruff check ." in lines
    (command,) = pytest_lines(lines)
    assert f" {WORKERS} " in command and "--durations=25" in command.split(), command
    assert " -m " not in command.replace(" -m pytest", ""), command
    assert (REPO / ".ci" / "run").read_text().strip().splitlines()[-1] == "make test"  # CI: the full suite


def test_every_worker_draws_from_the_seed_the_session_printed(tmp_path) -> None:
    """Each pytest-xdist worker imports tests/conftest.py afresh: the fuzz seed it draws from must still be the one
    printed on the session's first line, or ELMO_FUZZ_SEED=N would not replay a failure."""
    env = {key: value for key, value in os.environ.items() if key != "ELMO_FUZZ_SEED"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "tests/worker_seed_probe.py"],
        cwd=REPO,
        env={**env, "TESTS_SEED_PROBE_OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    printed = re.search(r"^fuzz seed: (\d+) ", done.stdout, flags=re.MULTILINE)
    assert printed, done.stdout
    drawn = {path.name: path.read_text() for path in tmp_path.iterdir()}
    assert len(drawn) == 4 and {name.split("-")[0] for name in drawn} == {"gw0", "gw1"}, drawn
    assert set(drawn.values()) == {printed.group(1)}, (printed.group(0), drawn)


def test_a_repeated_node_id_is_found() -> None:
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in ("a.py::x", "a.py::y", "b.py::x", "a.py::x", "a.py::x")]
    assert repeated_ids(items) == ["a.py::x"]
    assert repeated_ids(items[:3]) == []


def test_workers_take_the_files_holding_slow_tests_first() -> None:
    tiers = {"a.py::x": False, "a.py::v": False, "b.py::y": False, "b.py::z": True, "c.py::w": False, "d.py::u": True}
    ordered = [item.nodeid for item in slow_files_first([SimpleNamespace(nodeid=nodeid) for nodeid in tiers], tiers)]
    assert ordered == ["b.py::y", "b.py::z", "d.py::u", "a.py::x", "a.py::v", "c.py::w"]


def test_the_slow_marker_is_registered_and_markers_are_strict() -> None:
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(marker.startswith("slow:") for marker in options["markers"])
    assert "--strict-markers" in options["addopts"].split()  # a misspelt `@pytest.mark.slwo` is an error


# -- refreshing SLOW from a --durations=0 log ---------------------------------------------------------------------
DURATION_LINE = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S.*?)\s*$")


def seconds_per_test(log_text: str) -> dict[str, float]:
    """Set-up + call + teardown per node id, from pytest's `--durations` lines."""
    seconds: dict[str, float] = defaultdict(float)
    for line in log_text.splitlines():
        match = DURATION_LINE.match(line)
        if match:
            seconds[match[3]] += float(match[1])
    return dict(seconds)


def file_seconds(seconds: dict[str, float]) -> dict[str, float]:
    per_file: dict[str, float] = defaultdict(float)
    for nodeid, value in seconds.items():
        per_file[nodeid.split("::")[0]] += value
    return dict(per_file)


def test_durations_lines_add_up_per_test_and_per_file() -> None:
    log = (
        "============================= slowest durations ==============================\n"
        "61.20s setup    tests/train/test_loop.py::test_trains\n"
        "2.50s call     tests/train/test_loop.py::test_trains\n"
        "0.30s teardown tests/train/test_loop.py::test_trains\n"
        "1.00s call     tests/test_y.py::test_case[a b]\n"
        "0.01s call     tests/train/test_loop.py::test_resumes\n"
        "(12 durations < 0.005s hidden.  Use -vv to show these durations.)\n"
        "5 passed in 65.01s (0:01:05)\n"
    )
    seconds = seconds_per_test(log)
    assert seconds == pytest.approx(
        {
            "tests/train/test_loop.py::test_trains": 64.0,
            "tests/test_y.py::test_case[a b]": 1.0,
            "tests/train/test_loop.py::test_resumes": 0.01,
        }
    )
    assert file_seconds(seconds) == pytest.approx({"tests/train/test_loop.py": 64.01, "tests/test_y.py": 1.0})


def slow_node_ids() -> set[str]:
    """The node ids `pytest -m slow` collects now (SLOW_FIXTURES need the collection: a log does not name them)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return {line for line in done.stdout.splitlines() if "::" in line}


def main(log_path: str, top: int = 40) -> None:
    seconds = seconds_per_test(Path(log_path).read_text(errors="replace"))
    slow = slow_node_ids()
    tier = {nodeid: "slow" if nodeid in slow else "fast" for nodeid in seconds}
    print(f"{'seconds':>8}  file (its slow tests / all its tests)")
    for path, value in sorted(file_seconds(seconds).items(), key=lambda item: -item[1])[:top]:
        tests = [nodeid for nodeid in seconds if nodeid.split("::")[0] == path]
        print(f"{value:8.1f}  {path} ({sum(tier[n] == 'slow' for n in tests)}/{len(tests)})")
    print(f"\n{'seconds':>8}  tier  test")
    for nodeid, value in sorted(seconds.items(), key=lambda item: -item[1])[:top]:
        print(f"{value:8.1f}  {tier[nodeid]}  {nodeid}")
    fast = sum(value for nodeid, value in seconds.items() if tier[nodeid] == "fast")
    print(f"\nfast tier: {fast:.0f} s of {sum(seconds.values()):.0f} s in tests (set-up + call + teardown)")


if __name__ == "__main__":
    main(*sys.argv[1:2])
