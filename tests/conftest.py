import getpass
import os
import signal
import tempfile

import pytest

# 8 simulated CPU devices for the sharding tests; must be set before JAX initialises.
# LLVM optimisation level 1 instead of the default: the suite mostly compiles small programs once,
# and the fast tier took 14:13 instead of 16:23 (user time -15%) with no test slower than noise;
# level 0 made the tests that compute 2-5x slower. Subprocesses inherit both flags.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for every test and every `python -m launch...` subprocess they
# start (inherited through the environment): the suite compiles the same tiny models again and
# again, in-process and in dozens of subprocesses. The key is the program and its compile
# options, so a changed program compiles afresh.
# No size limit for JAX to enforce: with one, every write takes a lock shared by all processes and
# reads the access time of every entry, so writes slow down as the cache grows (a write into a
# 1,000-entry cache: 122 ms with a limit, 1 ms without; the suite writes thousands; CI's run took
# 70 min with the limit, 29 min before the cache). Instead, the first process of a session trims.
CACHE_DIR = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"fibjax-test-jax-cache-{getpass.getuser()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
CACHE_LIMIT_BYTES, CACHE_KEEP_BYTES = 2 * 1024**3, 1024**3


def _trim_cache(directory: str) -> None:
    """Delete the least recently written entries once the cache passes its limit."""
    try:
        entries = [(st.st_mtime, st.st_size, e.path) for e in os.scandir(directory) if e.is_file() for st in (e.stat(),)]
    except FileNotFoundError:
        return
    total = sum(size for _, size, _ in entries)
    if total <= CACHE_LIMIT_BYTES:
        return
    for _, size, path in sorted(entries):
        if total <= CACHE_KEEP_BYTES:
            break
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        total -= size


if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller (or a run without -n), once
    _trim_cache(CACHE_DIR)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The embedded corpus prepared at the tiny model's vocabulary (tests.helpers.TINY_VOCAB),
    once per test module, as each module had it before it moved here."""
    from fibjax.data import prepare_default
    from tests.helpers import TINY_VOCAB

    out = tmp_path_factory.mktemp("data") / "embedded"
    prepare_default(out, vocab_size=TINY_VOCAB)
    return out


@pytest.fixture(scope="session")
def manual_documents() -> list[str]:
    """Real English text every clone has: Python's reference manual (the embedded corpus) cut
    into ~700 documents of three consecutive paragraphs each, so the data tests can build
    corpora of any shape (held-out by hash, a separate validation file, several sources) without
    ../shared."""
    from fibjax.data.sources import embedded_documents

    paragraphs = [p.strip() for doc in embedded_documents() for p in doc.split("\n\n") if p.strip()]
    return ["\n\n".join(paragraphs[i : i + 3]) for i in range(0, len(paragraphs), 3)]


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """An xdist worker ignores SIGINT once its tests are done. The controller ends a worker by
    closing its channel, and execnet, when the worker has not returned 5 s later, sends it SIGINT
    (execnet/gateway_base.py, _terminate_execution). On 2 busy cores a worker's last seconds (the
    summary hooks, pytest's final garbage collection over every compiled JAX program) outlast
    that, and the KeyboardInterrupt lands wherever the worker is: most often in JAX's gc callback,
    which prints a PytestUnraisableExceptionWarning traceback after the results. A worker still
    running after 15 s is ended by execnet with os._exit all the same."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
