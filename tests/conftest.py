"""Shared fixtures. The suite runs on MLX's reference BLAS: the batch-invariant configuration
the exactness gate is defined on (see specdec.blas)."""

from __future__ import annotations

import os

import pytest

from specdec.blas import ensure_blas

# Two workers share two cores: a server or bench the suite starts on OpenBLAS runs it on one
# thread, as this process's reference BLAS does. OpenBLAS's own threads busy-wait between
# calls, so at its default (a thread per core) it took the other worker's core for as long
# as it decoded (the bench smoke: 14.8 CPU-minutes in 8.9 minutes alone, 16 minutes beside
# the suite; 10.6 CPU-minutes in 9.5 minutes on one thread).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct, converted on first use, loaded once."""
    import specdec

    return specdec.load()


@pytest.fixture(scope="session")
def engine(embedded):
    from specdec.engine import Engine

    return Engine(embedded)


@pytest.fixture(scope="session")
def distilled(embedded):
    """The draft distilled for the embedded model, shipped in the package."""
    import specdec

    return specdec.load("default-draft")


@pytest.fixture(scope="session")
def engines(embedded, distilled):
    """Engines over the embedded model by draft kind: "distilled", "self", "none"."""
    from tests.exactness import make_engines

    return make_engines(embedded, distilled)


@pytest.fixture(scope="session")
def served_models(embedded, distilled):
    """The session's loaded models by the names `specdec serve` loads them under, for
    `tests.serverproc.serve_app` (an app built from serve flags, in process)."""
    from specdec.models import DEFAULT_DRAFT, DEFAULT_MODEL

    return {DEFAULT_MODEL: embedded, DEFAULT_DRAFT: distilled}


@pytest.fixture(scope="module")
def serve(request):
    """`serve(*flags, env=None)`: a real `specdec serve FLAGS` process on loopback
    (tests/serverproc.Server), stopped at the module's end. The embedded model is converted
    (once, `embedded`) before a server that serves it starts."""
    from tests.serverproc import Server

    started = []

    def start(*args, env=None):
        if "--model" not in args:
            request.getfixturevalue("embedded")
        started.append(Server(*args, env=env))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def server_args():
    """The flags of a module's `server` (a module overrides this fixture to set its own)."""
    return ()


@pytest.fixture(scope="module")
def server_env():
    """Variables set for a module's `server` (a module overrides this fixture)."""
    return None


@pytest.fixture(scope="module")
def server(serve, server_args, server_env):
    """The module's real server: `specdec serve` with `server_args` and `server_env`."""
    return serve(*server_args, env=server_env)


@pytest.fixture
def fake():
    """The stand-in engine of the in-process protocol tests (tests/fakeengine.py): scripted
    events, the requests it was given recorded."""
    from tests.fakeengine import FakeEngine

    return FakeEngine()


@pytest.fixture
def fake_app(fake):
    """The server app (every API, the error handlers, the guard) over `fake`."""
    from server.app import create_app
    from server.door import ServeConfig

    app = create_app(fake, ServeConfig())
    yield app
    app.state.door.close()


@pytest.fixture(scope="session")
def hf_tokenizer(embedded):
    return embedded.tokenizer


@pytest.fixture(scope="session")
def compiler(hf_tokenizer):
    """Grammar compiler for the tiny models' padded logits width (tests/tiny.py)."""
    from specdec.grammar import GrammarCompiler
    from tests.tiny import EOS, WIDTH

    return GrammarCompiler.for_hf_tokenizer(hf_tokenizer, n_vocab=WIDTH, eos_token_ids=list(EOS))


@pytest.fixture(scope="session")
def prompt(hf_tokenizer):
    """A short chat prompt for the tiny models."""
    return hf_tokenizer.encode("<|im_start|>user\nData please<|im_end|>\n<|im_start|>assistant\n",
                               add_special_tokens=False)


def pytest_configure(config):
    # Re-exec pytest without an OpenBLAS preload (the batch-invariant configuration), with
    # pytest's fd capture suspended so the new process writes to the real terminal.
    capman = config.pluginmanager.getplugin("capturemanager")
    ensure_blas("reference", before_exec=capman and capman.suspend_global_capture)


def pytest_report_header(config):
    from specdec import blas

    wanted = os.environ.get("SPECDEC_BLAS", "auto")
    return [f"specdec: BLAS {blas.active()} (SPECDEC_BLAS={wanted})"]


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the counts to the controller
        from tests import tally

        workeroutput["specdec_tally"] = tally.export()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    from tests import tally

    data = getattr(node, "workeroutput", {}).get("specdec_tally")
    if data:
        tally.merge(data)


def pytest_terminal_summary(terminalreporter):
    from tests import tally

    if tally.CELLS:
        terminalreporter.section("exactness (fast path vs oracle)")
        for name, (same, total) in sorted(tally.CELLS.items()):
            terminalreporter.write_line(f"{name}: {same}/{total} identical")
        for name, cuts in tally.CUTS.items():
            terminalreporter.write_line(f"grammar cuts, {name}: {cuts}")
        for name, (acc, prop) in sorted(tally.SOURCES.items()):
            terminalreporter.write_line(f"proposals accepted, {name}: {acc}/{prop}")
        for line in tally.NOTES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def tool_engines(tmp_path_factory):
    """Engines over a tiny model of each tool format (`tests.families.TOOL_FORMATS`, and
    "generic": a ChatML template that renders no calls), the model its own draft, made on
    first use: `tool_engines(key)`."""
    from specdec.engine import Engine
    from specdec.models import load
    from tests.families import CHATML, make_family, make_tool_family

    root = tmp_path_factory.mktemp("tool-engines")
    made: dict = {}

    def get(key: str):
        if key not in made:
            d = (make_family("qwen2.5", root / key, template=CHATML) if key == "generic"
                 else make_tool_family(key, root / key))
            m = load(str(d))
            made[key] = Engine(m, m)
        return made[key]
    yield get
    for e in made.values():
        e.close()


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server (`tests.pgserver.PgServer`) for this session; its
    `database()` is a new empty database's URL. Skips, saying why, where PostgreSQL's
    server binaries are not installed (`scripts/dev test` installs them as root)."""
    from tests.pgserver import PgServer

    bindir, why = PgServer.find()
    if bindir is None:
        pytest.skip(why)
    server = PgServer(bindir).start()
    yield server
    server.stop()


# -- scheduling: the longest files first ----------------------------------------------------
DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")
PER_TEST_S = 3.0  # a file's estimate, per test, where tests/durations.json does not know it


def pytest_collection_modifyitems(session, config, items):
    """Files in order of their measured seconds, longest first (tests/durations.json,
    written by `scripts/dev durations` from a run's JUnit XML); each file's own tests keep
    their order. The two workers take whole files (`--dist loadfile`, without xdist's
    reordering by test count): the long files start at once instead of ending the run on
    one worker while the other waits."""
    import json

    try:
        with open(DURATIONS) as f:
            known = json.load(f)
    except (OSError, ValueError):
        return
    counts: dict[str, int] = {}
    for item in items:
        counts[item.location[0]] = counts.get(item.location[0], 0) + 1
    weight = {path: known.get(path, PER_TEST_S * n) for path, n in counts.items()}
    first = {}
    for n, item in enumerate(items):
        first.setdefault(item.location[0], n)
    items.sort(key=lambda it: (-weight[it.location[0]], first[it.location[0]]))
