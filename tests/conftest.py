from __future__ import annotations

import fcntl
import logging
import os
import random
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]

# Hypothesis' per-example deadline (200 ms) is a timing threshold: on a loaded 2-core CI machine it failed a correct
# property test (tests/text/test_overflow.py, 406 ms for one example). Properties are checked, not timed.
settings.register_profile("elmo", deadline=None)
settings.load_profile("elmo")
SHARED_REFERENCE = REPO.parent / "shared" / "reference"
BILM_TF_FIXTURE = SHARED_REFERENCE / "bilm-tf-fixture"


def in_ci() -> bool:
    """The environment variable CI is set (GitHub Actions, GitLab and most CI systems set CI=true)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """Tests that run ``elmo.cli.main`` in process configure logging (a handler on the sys.stderr of that moment,
    pytest's capture); the capture closes after the test, and a later test's log record met a closed file
    ("--- Logging error ---" in CI's output). Each test leaves the root logger as it found it."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if type(handler) is logging.StreamHandler and handler not in before:  # pytest's own are subclasses
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def bilm_tf_fixture() -> Path:
    """The bilm-tf reference files. Missing: a skip on a developer's machine, a failure in CI (where a skip would
    silently drop the reference comparisons)."""
    if not (BILM_TF_FIXTURE / "lm_weights.hdf5").is_file():
        message = f"../shared/reference/bilm-tf-fixture is not beside the repo ({BILM_TF_FIXTURE})"
        if in_ci():
            pytest.fail(f"{message}; CI is set, so the reference tests must run, not skip", pytrace=False)
        pytest.skip(message)
    return BILM_TF_FIXTURE


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weights model directory: config.json + model.safetensors + model.onnx + onnx.json, the export
    verified against PyTorch (a second or two). Clips of 0.5 with N(0, 0.3) weights keep the clips active while
    the float32 recurrence stays within the 1e-5 export tolerance. Treat it as read-only: it is shared."""
    from elmo.bench.random_model import write_random_model

    directory = tmp_path_factory.mktemp("tiny_model")
    return write_random_model(directory, "tiny", seed=0, scale=0.3, export=True, cell_clip=0.5, proj_clip=0.5)


@pytest.fixture(scope="session")
def brown_corpus(tmp_path_factory) -> Path:
    """A real Brown-only LM corpus from `elmo data fetch --sources brown` (train/valid/test, vocab, heldout)."""
    from tests.lm_fixtures import build_brown_corpus

    return build_brown_corpus(tmp_path_factory.mktemp("brown_corpus"))


@pytest.fixture(scope="session")
def trained_tiny_lm(tmp_path_factory, brown_corpus) -> Path:
    """The CI-sized training run (tiny config, a few hundred steps on a slice of Brown). Read-only: shared."""
    from elmo.cli import main
    from tests.lm_fixtures import write_train_config

    work = tmp_path_factory.mktemp("tiny_lm")
    config = write_train_config(work / "train.json", brown_corpus)
    assert main(["train", "--config", str(config), "--out", str(work / "model")]) == 0
    return work / "model"


# -- the two tiers: `make check` (the inner loop: ruff + `pytest -m "not slow"`) and `make test` (everything; CI) ----
# A test is slow when it needs one of SLOW_FIXTURES (expensive set-up, paid by whichever test asks first) or when its
# node id starts with an entry of SLOW ("path.py" for a whole file, "path.py::test" for a function and all its
# parameters, "path.py::test[param]" for one case). A test file may also say @pytest.mark.slow itself.
#
# How SLOW was chosen (issue 30, 2 cores, the machine busy with other people's work throughout, so every figure is
# high): one full run, `.venv/bin/python -m pytest -q -p no:cacheprovider --durations=0` (18 min, 1,059 s in tests),
# gave each test's set-up + call + teardown. In went whole files whose cost is one module fixture or that need what
# `make check` must not (Chromium; .venv-clients through `served`), the README's pipeline and user-file runs, Ray,
# torchrun and training runs, then every single test whose call took 2 s or more. A second pass timed the fast tier
# itself the same way (`pytest -m "not slow" --durations=0`: 140 s in tests, `make check` 3:00) and moved its next
# biggest (module fixtures that had shifted onto the next test, the `elmo serve` CLI file) until `make check` took
# about 1.5 minutes. The seconds beside each entry are from those runs.
# How to refresh it: rerun the full command above into a file, then `.venv/bin/python -m tests.test_tiers FILE`
# lists the slowest files and tests with their tier and the fast tier's total (keep it near 80 s), and time
# `make check` (under 3 minutes on 2 cores). tests/test_tiers.py checks that every entry still names a collected
# test and that every folder of tests/ keeps tests in the fast tier.
SLOW_FIXTURES = frozenset(
    {
        "served",  # tests/test_readme_commands.py: `make serve` as written (builds .venv-serve; ports 50051/8080/9090)
        "trained_tiny_lm",  # the CI-sized training run: 28-33 s of set-up
        "brown_corpus",  # `elmo data fetch --sources brown`: 8 s of set-up, then short trainings on it
        "trained_pipeline",  # tests/spacy: a real `spacy train` of the toy tagger: 4-5 s of set-up
    }
)
SLOW: tuple[str, ...] = (
    # seconds: set-up + call + teardown in the run each entry was chosen from (2 busy cores)
    "tests/test_readme_pipeline.py",  # 203: the README's pipeline block, fetch to served model
    "tests/test_readme_commands.py::test_readme_batch_and_mix_commands_run_on_a_users_files",  # 95
    "tests/export/test_published_shape.py",  # 91: published-size weights up to 400 tokens
    "tests/train/test_adapt.py",  # 96: four adaptations
    "tests/test_dockerfile.py::test_every_pip_install_resolves_for_the_image",  # 43: pip resolves the image's installs
    "tests/test_gpu_train.py",  # 42: the module's rehearsal fixture packs the corpus and wheels (23 s)
    # tests/service/test_fuzz.py: its random tier marks itself slow; the fixed tier is fast
    "tests/service/test_fuzz.py::test_a_stream_cut_by_an_oversized_message_leaves_the_server_up",  # a child server
    "tests/batch/test_recovery.py::test_ray_job_killed_mid_way_resumes_without_recomputing",  # 31: a Ray cluster
    "tests/batch/test_job.py::test_ray_engine_matches_local",  # 28: a Ray cluster
    "tests/batch/test_ray_cluster.py",  # 75: a 3-node Ray cluster started with `ray start`, a node and a driver killed
    "tests/batch/test_job.py::test_sigkill_mid_run_then_resume_equals_uninterrupted",  # 13: two formats
    "tests/test_bench_serving.py",  # 23: load generators against live servers
    "tests/test_bench_generators.py",  # 8: wrk and h2load (`make test` installs them, `make check` not) on a server
    "tests/train/test_ddp.py",  # 23: two-process torchrun steps
    "tests/train/test_loop.py::test_two_process_data_parallel_with_torchrun",  # 10
    "tests/train/test_loop.py::test_resume_continues_exactly",  # 7.5
    "tests/train/test_corpus.py::test_fetch_with_a_relative_out_keeps_pip_packages_in_its_raw_folder",  # 10: pip
    "tests/test_client.py::test_node_client_from_the_proto_alone_gets_the_same_vectors",  # 6: needs node and npm
    "tests/test_gpu_check.py",  # 7: the GPU machine's tooling, checked here without a GPU
    "tests/export/test_quantize.py::test_u8_weights_pass_on_avx2_kernels_where_s8_weights_saturate",  # 4.5: 2 exports
    "tests/test_gpu_wheels.py",  # 6: likewise
    "tests/test_tiers.py::test_every_worker_draws_from_the_seed_the_session_printed",  # 9: a pytest run on 2 workers
    "tests/test_bench_agreement.py",  # 9: each engine against float64
    "tests/export/test_fp16.py",  # 5 besides the trained model's test (trained_tiny_lm)
    # single tests of 2 s or more (the call itself, not a module fixture's set-up that the next test would pay)
    "tests/test_bench.py::test_synthetic_text_is_deterministic_and_text_like",  # 4.4
    "tests/service/test_http.py::test_http_and_grpc_clients_mixed_under_load_see_no_errors",  # 4.1
    "tests/export/test_onnx_export.py::test_a_checkpoint_stored_in_fp16_exports_half_the_bytes_exactly",  # 3.5
    "tests/export/test_onnx_export.py::test_the_user_can_set_the_bound",  # 3.1
    "tests/export/test_onnx_export.py::test_fp16_export_reports_its_own_error",  # 2.3
    "tests/batch/test_job.py::test_scan_streams_and_shards_cover_the_file",  # 3.2
    "tests/batch/test_job.py::test_batch_job_imports_no_torch",  # 2.7
    "tests/test_healthcheck_real.py",  # 2.9 (tests/test_healthcheck.py stays)
    "tests/service/test_lifecycle.py::test_drain_grace_expiry_cancels_the_rpc_still_running_and_exits_0",  # 2.6
    "tests/runtime/test_tasks.py::test_serving_half_imports_no_torch",  # 2.5
    "tests/importers/test_allennlp.py::test_import_export_embed_file_reproduces_the_reference",  # 2.2
    # the second pass: `make check` timed with --durations=0 on the tiers above, 2:59 with the machine busy; these
    # came next (all of them at 2 s or more on that run, or a module fixture of that size)
    "tests/importers/test_allennlp.py::test_exported_onnx_matches_the_numpy_reference",  # 9.5: exports each shape
    "tests/importers/test_allennlp.py::test_exported_warm_state_reproduces_bilm_tf_carried_states",  # 2.3
    "tests/importers/test_allennlp.py::test_runtime_gives_a_sentence_the_same_vectors_in_any_batch",  # 3.7
    "tests/service/test_server_cli.py",  # 14.6: 18 `elmo serve` processes (test_server.py stays)
    "tests/test_layout.py::test_the_wheel_puts_only_elmo_into_site_packages",  # 4.0: builds the wheel
    "tests/test_readme_commands.py::test_taken_readme_ports_skip_only_the_served_tests[1]",  # 4.7 ([None] stays)
    "tests/batch/test_recovery.py::test_job_rides_out_a_drain_and_a_restart_on_the_same_port",  # 2.2
    "tests/test_bench.py::test_bench_writes_where_it_is_run_and_never_overwrites_unasked",  # 2.0
    # the third pass (issue 31/32 added 35 fast tests; `make check` 2:50 on a quiet machine): --durations=20 of the
    # fast tier, every call of 2 s or more
    "tests/train/test_threads.py::test_the_cli_sets_the_policy_before_torch_loads",  # 8.9
    "tests/train/test_threads.py::test_the_users_own_setting_reaches_libgomp",  # 3.2 each
    "tests/export/test_warnings.py::test_the_export_command_prints_no_warning",  # 5.3
    "tests/test_readme_commands.py::test_taken_readme_ports_skip_only_the_served_tests[None]",  # 3.7
    "tests/mix/test_cli.py::test_report_writes_table_and_plots",  # 2.8
    "tests/test_layout.py::test_the_serving_side_imports_no_torch[elmo.features]",  # 2.7
    "tests/service/test_server.py::test_sigterm_drains_in_flight_stream_and_refuses_new_calls",  # 2.2
    "tests/service/test_server.py::test_sigterm_with_a_shutdown_delay_leaves_the_rotation_while_still_answering",
    "tests/mix/test_cli.py::test_train_tagging_stores_a_servable_task",  # 2.2
    # the fourth pass (issues 38/39 added ~70 fast tests): their calls of 2 s or more
    "tests/service/test_second_user.py",  # 6: an import + export, then `elmo serve` as nobody
    "tests/service/test_grpc_door.py",  # 8.4: two `elmo serve` processes, 2,054 silent calls each
    "tests/importers/test_manylangs.py::test_a_wrong_graph_fails_verification_on_this_fixture",  # 2.8: two exports
    "tests/service/test_cancellation.py::test_openai_dimensions_are_checked_against_the_version_that_embeds_them",
    # the fifth pass (issue 41, the spaCy component): its calls of 2 s or more, each a fresh interpreter
    "tests/spacy/test_component.py::test_to_disk_and_load_by_reference_from_another_folder",  # 5.3
    "tests/spacy/test_component.py::test_add_pipe_by_entry_point_without_importing_the_package",  # 4.0
    "tests/spacy/test_component.py::test_the_component_runs_where_torch_cannot_be_imported",  # 3.0
    "tests/spacy/test_component.py::test_a_server_failure_mid_pipe_keeps_the_documents_already_processed",  # 2.4
    "tests/test_readme_commands.py::test_docs_spacy_commands_run_in_order",  # 32: docs/how-to/spacy.md, fetch to export
    "tests/test_readme_commands.py::test_readme_spacy_blocks_run_as_written",  # 9: two interpreters on models/default
    # needed, whatever their time: Chromium, which `make test` installs
    "tests/service/test_page.py",
    "tests/service/test_page_token.py",
)

# The fuzzers' random tier (tests/service/test_fuzz.py) draws from one seed per test session, printed in the session's
# header and in any failure; ELMO_FUZZ_SEED=N replays a run.
FUZZ_SEED = int(os.environ.get("ELMO_FUZZ_SEED") or random.SystemRandom().randrange(2**32))


def pytest_sessionstart(session: pytest.Session) -> None:
    """The seed on the first line of every run, `-q` (make test, CI) included, where pytest prints no header."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not is_worker(session.config):
        reporter.write_line(f"fuzz seed: {FUZZ_SEED} (random tier; ELMO_FUZZ_SEED={FUZZ_SEED} replays it)")


# -- one worker per core (`make test`: pytest-xdist, `--dist loadfile`) ---------------------------------------------
# Each worker is a pytest session of its own that imports this file: it takes the seed the session printed (above)
# instead of drawing one, and is handed whole test files, slow-tier files first, so that the longest files start
# early and the short ones fill in at the end instead of one worker finishing a long file alone.
def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: called only where the plugin runs
def pytest_configure_node(node) -> None:
    node.workerinput["elmo_fuzz_seed"] = FUZZ_SEED


def pytest_configure(config: pytest.Config) -> None:
    global FUZZ_SEED
    if is_worker(config):
        FUZZ_SEED = int(config.workerinput["elmo_fuzz_seed"])


def slow_files_first(items: list[pytest.Item], tiers: dict[str, bool]) -> list[pytest.Item]:
    """``items`` with the test files holding a slow-tier test first, each file's tests in their own order."""
    slow_files = {nodeid.split("::")[0] for nodeid, slow in tiers.items() if slow}
    return sorted(items, key=lambda item: item.nodeid.split("::")[0] not in slow_files)


def repeated_ids(items: list[pytest.Item]) -> list[str]:
    """The node ids that more than one of ``items`` has: the workers are handed tests by id."""
    counts = Counter(item.nodeid for item in items)
    return sorted(nodeid for nodeid, count in counts.items() if count > 1)


MAKE_SERVE_HELD = "TESTS_MAKE_SERVE_HELD"  # set while a test module holds the lock below, for the pytest it runs


@pytest.fixture(scope="module")
def make_serve_ports() -> Iterator[None]:
    """Held by a test module that runs `make serve` as written (its fixed ports 50051/8080/9090, the checkout's
    .venv-serve) while it runs: a machine-wide lock, so two workers, or two test sessions, take turns. A pytest that
    such a module runs itself (with the variable MAKE_SERVE_HELD) is inside its turn and takes no lock."""
    if os.environ.get(MAKE_SERVE_HELD):
        yield
        return
    with (
        (Path(tempfile.gettempdir()) / "elmo-tests-make-serve.lock").open("a") as lock,
        pytest.MonkeyPatch.context() as env,
    ):
        fcntl.flock(lock, fcntl.LOCK_EX)
        env.setenv(MAKE_SERVE_HELD, str(os.getpid()))
        yield


COLLECTED_TIERS = pytest.StashKey[dict[str, bool]]()  # every collected node id -> slow?, before any -m deselection


def is_slow(nodeid: str, fixturenames: Iterable[str] = (), slow: Iterable[str] = SLOW) -> bool:
    """Whether the test ``nodeid`` (rootdir-relative, as pytest writes it) belongs to the slow tier."""
    if SLOW_FIXTURES.intersection(fixturenames):
        return True
    return any(nodeid == entry or nodeid.startswith((f"{entry}::", f"{entry}[")) for entry in slow)


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects anything
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = {}
    for item in items:
        if is_slow(item.nodeid, item.fixturenames):
            item.add_marker(pytest.mark.slow)
        tiers[item.nodeid] = item.get_closest_marker("slow") is not None  # a test file's own @pytest.mark.slow too
    config.stash[COLLECTED_TIERS] = tiers
    if repeated := repeated_ids(items):
        raise pytest.UsageError(f"tests share a node id (pytest-xdist would run only one of each): {repeated}")
    if is_worker(config):
        items[:] = slow_files_first(items, tiers)
