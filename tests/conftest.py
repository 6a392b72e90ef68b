import os

import pytest

# Inductor's kernel cache is not safe to share between torch versions or CPU capabilities
# (ATEN_CPU_CAPABILITY): kernels compiled by another version gave wrong float8 results and
# aborted the process, and AVX512 kernels failed compiled float8 tests run as AVX2. Tests (and
# the torchrun children they start, which inherit the environment) keep one cache per pair.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    import torch

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}", f"torch-{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}"
    )

# Inductor compiles a process's kernels in a pool of fresh interpreters when it has 2+ cores:
# each imports torch (5 s, and 20-40 s of reading the CUDA libraries under torch 2.11's CUDA
# build) for a few 2 s compiler calls, on cores the other test worker needs. One thread
# compiles them in the process itself.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Without a GPU, Triton kernels (float8/kernels) run in Triton's interpreter on CPU tensors.
# Triton decides when it decorates, its own library functions too, so this must be set before
# anything imports triton (torch._dynamo does; `import torch` does not).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


# Under pytest-xdist each worker takes its share of the cores for torch's intra-op threads, so
# that busy workers do not oversubscribe them.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    # Every worker imports torch (~0.5 GB) and many tests start 2-4 training processes.
    return max(1, min(os.cpu_count() or 1, 8))


@pytest.fixture(autouse=True)
def _single_thread_env(monkeypatch):
    # Each test process (and its torchrun children) use few threads on the 2-core CI machine.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


@pytest.fixture
def fresh_dynamo():
    """Dynamo's code caches and counters emptied before a test that compiles: earlier tests in the same process
    (the suite in one process, -n 0) compiled the same float8 code objects, and past dynamo's recompile limit
    fullgraph=True fails; a test that counts the graphs it compiled starts from none."""
    import torch._dynamo

    torch._dynamo.reset()


# The module-scoped `losses` fixture of tests/trainer/distributed/test_parallel*.py (each module makes its own runs).
from tests.layout_runs import losses  # noqa: E402, F401
