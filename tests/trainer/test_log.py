"""trainer/log.py: messages from rank 0 only unless per rank, warnings once, library warnings routed."""

import os
import subprocess
import sys
from collections import Counter

import pytest
import torch.distributed as dist

from tests.helpers import ROOT, run_train
from trainer import log


@pytest.fixture
def rank(monkeypatch):
    """Pretend to be rank N of a 2-process launch before the process group exists."""
    assert not dist.is_initialized()
    monkeypatch.setattr(log, "_warned", set())

    def become(n: int) -> None:
        monkeypatch.setenv("RANK", str(n))
        monkeypatch.setenv("WORLD_SIZE", "2")

    return become


def test_rank_zero_speaks_other_ranks_stay_quiet(rank, capsys):
    rank(1)
    log.info("step 1")
    log.warn("slow setting")
    assert capsys.readouterr() == ("", "")
    rank(0)
    log.info("step 1")
    log.warn("slow setting")
    assert capsys.readouterr() == ("step 1\n", "warning: slow setting\n")


def test_every_rank_message_names_its_rank(rank, capsys):
    rank(1)
    log.warn("this rank's disk is full", every_rank=True)
    log.info("this rank's shard", every_rank=True)
    assert capsys.readouterr() == ("rank 1: this rank's shard\n", "warning: rank 1: this rank's disk is full\n")


def test_one_process_prints_without_rank_prefix(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    log.info("checkpoint saved", every_rank=True)
    assert capsys.readouterr().out == "checkpoint saved\n"


def test_warn_once_dedupes_by_message(rank, capsys):
    rank(0)
    for _ in range(3):
        log.warn("dropping long samples", once=True)
        log.warn("another problem", once=True)
    log.warn("dropping long samples")  # without once: always printed
    assert capsys.readouterr().err.splitlines() == [
        "warning: dropping long samples", "warning: another problem", "warning: dropping long samples",
    ]


_LIBRARY = """
import logging, warnings
from trainer.log import route_library_warnings
route_library_warnings()
route_library_warnings()  # twice changes nothing
warnings.simplefilter("always")
for _ in range(2):
    warnings.warn("float8 says", UserWarning)
    logging.getLogger("float8.linear").warning("logged by float8")
    logging.getLogger("torch.distributed.tensor").warning("torch says")
logging.getLogger("torch.distributed.tensor").error("torch failed")
"""


@pytest.mark.slow
@pytest.mark.parametrize("rank_env", ["0", "1"])
def test_library_warnings_once_from_rank_zero(rank_env):
    env = {**os.environ, "RANK": rank_env, "WORLD_SIZE": "2"}
    proc = subprocess.run([sys.executable, "-c", _LIBRARY], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    if rank_env == "0":
        said = [line for line in lines if "float8 says" in line]
        assert len(said) == 1 and said[0].startswith("warning: ") and "UserWarning: float8 says" in said[0]
        assert lines.count("warning: logged by float8") == 1
        assert len([line for line in lines if line.endswith("torch says")]) == 2  # torch's own format, as before
    else:
        assert not [line for line in lines if "says" in line or "logged by" in line]
    assert len([line for line in lines if line.endswith("torch failed")]) == 1  # errors on every rank


@pytest.mark.slow
def test_two_process_run_prints_each_warning_once(tmp_path):
    # Float8 eager with layers filtered out: two advisor warnings; TP=2 clips a 2-D sharded grad
    # norm, for which torch logs a warning of its own on each rank.
    result = run_train([
        "--float8.enabled", "true", "--float8.filter_fqns", "output,w2", "--training.steps", "1",
        "--parallelism.tensor_parallel_degree", "2", "--metrics.enable_tensorboard", "false",
        "--job.dump_folder", str(tmp_path),
    ], nproc=2)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert any("compile.mode = 'none'" in w for w in warnings), result.stderr
    assert any("float8.filter_fqns keeps" in w for w in warnings), result.stderr
    assert [w for w, n in Counter(warnings).items() if n > 1] == []
    output = result.stdout.splitlines()
    assert [line for line, n in Counter(output).items() if n > 1] == []
    assert len([line for line in output if line.startswith("step      1/1  loss")]) == 1
    assert len([line for line in output if line.startswith("run debug")]) == 1
    # torch's redistribution advice (one message in torch 2.11-2.13, two distinct ones in 2.14), each once:
    # counted from the message on, so a rank's raw log line with its own prefix counts as a repeat.
    advice = Counter(line[line.index("While redistributing"):] for line in result.stderr.splitlines()
                     if "While redistributing" in line)
    assert [a for a, n in advice.items() if n > 1] == [], result.stderr
