"""Every fault a user met, by name, with the exit code and the first line it must give.

A row runs the case the cheapest way that still shows it: `train.main` in this process for what
is refused before the model is built, the library call that refuses it for input checks, and
train.py in a subprocess (tests/wrappers/train_crash.py to force a failure) for what happens in the loop.
The subprocess cases also check what must survive them: the checkpoint of the last completed
step, metrics.jsonl of whole lines only, no traceback on the console, an exit within seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import train
from tests.helpers import ROOT, run_train, write_lock
from trainer.errors import UserError

SMALL = [
    "--model.n_layers", "1", "--training.seq_len", "32", "--training.batch_size", "2",
    "--metrics.enable_tensorboard", "false", "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1", "--validation.enable", "false",
    # Runs of a few steps: the warmup of configs/debug.toml (10) would add a warning before the line checked.
    "--lr_scheduler.warmup_steps", "0",
]
# A hang is a run that does not exit: a run of a few steps here takes seconds.
HANG_S = 120


@dataclass(frozen=True)
class Case:
    exit_code: int
    first_line: str  # a regex for the first line on stderr
    run: Callable[[Path, pytest.FixtureRequest], tuple[int, str]]  # -> (exit code, stderr)


def in_process(argv_of: Callable[[Path], list[str]],
               setup: Callable[[Path], object] | None = None) -> Callable[..., tuple[int, str]]:
    """train.main(argv) in this process, after `setup`: for what is refused before any process group or model."""

    def run(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[int, str]:
        capsys = request.getfixturevalue("capsys")
        if setup is not None:
            setup(tmp_path)
        code = train.main(argv_of(tmp_path))
        return code, capsys.readouterr().err

    return run


def call(check: Callable[[Path], None]) -> Callable[..., tuple[int, str]]:
    """A library call that refuses an input: its UserError as train.py would print it."""

    def run(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[int, str]:
        capsys = request.getfixturevalue("capsys")
        try:
            check(tmp_path)
        except UserError as e:
            return e.exit_code, f"error: {e}\n"
        return 0, capsys.readouterr().err

    return run


def subprocess_run(args_of: Callable[[Path, pytest.FixtureRequest], list[str]], crash: str = "",
                   then: Callable[[Path, subprocess.CompletedProcess], None] | None = None):
    """train.py (tests/wrappers/train_crash.py with CRASH) in a subprocess; `then` checks what it left behind."""

    def run(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[int, str]:
        args = args_of(tmp_path, request)
        env = {"CRASH": crash} if crash else None
        proc = run_train(args, timeout=HANG_S, env=env, script="tests/wrappers/train_crash.py" if crash else "train.py")
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert len([line for line in proc.stderr.splitlines() if line.startswith("error:")]) <= 1, proc.stderr
        if then is not None:
            then(tmp_path, proc)
        return proc.returncode, proc.stderr

    return run


# -- setups --------------------------------------------------------------------------------------


def live_lock(folder: Path) -> Path:
    """A lock held by a live process that is not this one (the test runner's parent)."""
    return write_lock(folder, os.getppid())


def dump_args(tmp_path: Path, *more: str) -> list[str]:
    return ["--job.dump_folder", str(tmp_path / "run"), *SMALL, *more]


def whole_lines(tmp_path: Path) -> list[int]:
    """Steps in metrics.jsonl, which must hold whole lines of strict JSON only."""
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert text == "" or text.endswith("\n"), text[-200:]
    return [json.loads(line)["step"] for line in text.splitlines()]


def saved_step(step: int) -> Callable[[Path, subprocess.CompletedProcess], None]:
    def check(tmp_path: Path, proc: subprocess.CompletedProcess) -> None:
        assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [f"step-{step}"]
        assert whole_lines(tmp_path) == list(range(1, step))
        assert "Traceback" in (tmp_path / "run" / "crash.log").read_text()
    return check


def nothing_saved(tmp_path: Path, proc: subprocess.CompletedProcess) -> None:
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert whole_lines(tmp_path) == [1]


CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "100", "--training.steps", "4"]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> Path:
    """A finished 1-step run whose checkpoints live outside its dump folder: <root>/shared."""
    root = tmp_path_factory.mktemp("run_a")
    proc = run_train(["--job.dump_folder", str(root / "a"), *SMALL, "--checkpoint.enable", "true",
                      "--checkpoint.folder", str(root / "shared"), "--training.steps", "1"], timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def other_run_args(tmp_path: Path, request: pytest.FixtureRequest) -> list[str]:
    root = request.getfixturevalue("run_a")
    return dump_args(tmp_path, "--checkpoint.enable", "true", "--checkpoint.folder", str(root / "shared"),
                     "--training.steps", "2")


def other_tokenizer_args(tmp_path: Path, request: pytest.FixtureRequest) -> list[str]:
    from scripts.train_tokenizer import train as train_tokenizer

    root = request.getfixturevalue("run_a")
    (tmp_path / "small.model").write_bytes(train_tokenizer([str(ROOT / "data" / "heldout")], 1000))
    # The same run, restarted: a copy of its dump folder (so the module's run stays as it was).
    shutil.copytree(root / "a", tmp_path / "run")
    return dump_args(tmp_path, "--checkpoint.enable", "true", "--checkpoint.folder", str(root / "shared"),
                     "--training.steps", "2", "--model.tokenizer_path", str(tmp_path / "small.model"))


def tiny_args():
    from models.llama import LLAMA2_FLAVORS

    return LLAMA2_FLAVORS["debug"]


def hf_weights(tmp_path: Path, edit: Callable[[dict[str, torch.Tensor], Path], None]) -> None:
    from models.llama import Transformer
    from trainer.checkpoint.initial_weights import load_full_state_dict

    args = tiny_args()
    with torch.device("meta"):
        shapes = Transformer(args).state_dict()
    sd = {k: torch.full(v.shape, 0.02) for k, v in shapes.items()}
    edit(sd, tmp_path / "hf")
    load_full_state_dict(str(tmp_path / "hf"), "hf", args)


def int_weights(sd: dict[str, torch.Tensor], folder: Path) -> None:
    from models.llama.weight_files import write_weights

    write_weights("hf", {k: v.to(torch.int32) for k, v in sd.items()}, tiny_args(), folder)


def stray_file(sd: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    from models.llama.weight_files import write_weights

    write_weights("hf", sd, tiny_args(), folder)
    layer = {k: v for k, v in load_file(folder / "model.safetensors").items() if ".layers.3." in k}
    save_file(layer, folder / "zz-old.safetensors")


@contextlib.contextmanager
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def nan_initial_weights(tmp_path: Path) -> None:
    from models.llama import Transformer
    from models.llama.weight_files import write_weights
    from trainer.checkpoint.initial_weights import load_initial_weights

    args = tiny_args()
    model = Transformer(args)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd["layers.2.ffn_norm.weight"][0] = float("nan")
    write_weights("torch", sd, args, tmp_path / "w.safetensors")
    with one_rank_group():
        load_initial_weights(model, args, str(tmp_path / "w.safetensors"), "torch", 0, 1)


def pretrain_loader(path: Path | str, option: str = "data.path", seq_len: int = 32, **kw):
    from trainer.data.loader import build_dataloader
    from trainer.data.tokenizer import Tokenizer

    loader = build_dataloader(kind="pretrain", path=str(path), tokenizer=Tokenizer(str(ROOT / "data" / "tokenizer.model")),
                              seq_len=seq_len, batch_size=2, dp_rank=0, dp_degree=1, seed=0, option=option, **kw)
    return next(iter(loader))


def short_corpus(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("a corpus of one short line\n")
    pretrain_loader(tmp_path / "tiny.txt", seq_len=256)


def bad_held_out_row(tmp_path: Path) -> None:
    (tmp_path / "val.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    pretrain_loader(tmp_path / "val.jsonl", option="validation.path")


def long_sft_prompts(tmp_path: Path) -> None:
    from trainer.data.loader import build_dataloader
    from trainer.data.sft import SFTOptions
    from trainer.data.tokenizer import Tokenizer

    rows = [{"instruction": "Copy " + "red cat " * 60, "input": "", "output": "owl"}] * 24
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loader = build_dataloader(kind="sft", path=str(tmp_path / "sft.jsonl"), tokenizer=Tokenizer(str(ROOT / "data" / "tokenizer.model")),
                              seq_len=64, batch_size=2, dp_rank=0, dp_degree=1, seed=0, sft_options=SFTOptions(),
                              verbose=True)
    next(iter(loader))


def mixture_toml(second: str) -> Callable[[Path], object]:
    """A config of two sources, the shipped corpus' first file and `second` (a source table's body)."""
    first = f'path = "{ROOT}/data/corpus/train-00000.jsonl"\nweight = 0.7\nname = "web"\n'
    return lambda t: (t / "mix.toml").write_text(f"[[data.sources]]\n{first}[[data.sources]]\n{second}\n")


def mixture_loader(tmp_path: Path, second: Path) -> None:
    from trainer.config import SourceConfig

    pretrain_loader("", sources=[SourceConfig(path=str(ROOT / "data" / "corpus"), weight=0.7),
                                 SourceConfig(path=str(second), weight=0.3, name="code")])


def library_warnings(tmp_path: Path) -> None:
    import logging

    import datasets  # noqa: F401 (installs its own log handler)

    from trainer import log

    log.route_library_warnings()
    logging.getLogger("torch.distributed.tensor._redistribute").warning("While redistributing from S(0) to R,\n"
                                                                          "2 all-gathers will run")
    logging.getLogger("datasets.builder").warning("Repo card metadata block was not found")


def one_line_each(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[int, str]:
    code, stderr = call(library_warnings)(tmp_path, request)
    assert stderr.splitlines()[1:] == ["warning: Repo card metadata block was not found"], stderr
    return code, stderr


# -- round 4 (issue 35) --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deleted_dump(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A run (TensorBoard on) whose dump folder is deleted once step 2 is recorded; its checkpoints
    (every step) live outside the dump folder, in <root>/ckpt."""
    root = tmp_path_factory.mktemp("deleted_dump")
    args = ["--job.dump_folder", str(root / "run"), *SMALL, "--metrics.enable_tensorboard", "true",
            "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.folder", str(root / "ckpt"),
            "--training.steps", "4"]
    return root, run_train(args, timeout=HANG_S, env={"CRASH": "delete_dump:2"}, script="tests/wrappers/train_crash.py")


def dump_deleted(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[int, str]:
    root, proc = request.getfixturevalue("deleted_dump")
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr[-3000:]
    # Saved where the checkpoint folder still exists; its own lock released; no step past the deletion.
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["step-1", "step-2"], proc.stdout[-2000:]
    assert not (root / "run").exists()
    return proc.returncode, proc.stderr


def rollback(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[int, str]:
    """checkpoint.load_step = 1 in a folder holding step-1 and step-2 and the metrics of steps 1-2, on a changed corpus."""
    root, _ = request.getfixturevalue("deleted_dump")
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    (tmp_path / "run").mkdir()
    metrics = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2))
    (tmp_path / "run" / "metrics.jsonl").write_text(metrics)
    replaced = {p.name: p.read_bytes() for p in (root / "ckpt" / "step-2").iterdir() if p.is_file()}
    proc = run_train(dump_args(tmp_path, "--checkpoint.enable", "true", "--checkpoint.folder", str(tmp_path / "ckpt"),
                               "--checkpoint.load_step", "1", "--checkpoint.resume_from_other_run", "true",
                               "--training.steps", "2", "--data.path", str(ROOT / "data" / "corpus" / "train-00000.jsonl")),
                    timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The resume is also on a corpus of one of the checkpoint's two files: said once.
    assert proc.stderr.count("warning: the training data changed since checkpoint") == 1, proc.stderr
    kept = tmp_path / "ckpt" / "previous-1" / "step-2"
    assert {p.name: p.read_bytes() for p in kept.iterdir() if p.is_file()} == replaced
    assert (tmp_path / "run" / "previous-1" / "metrics.jsonl").read_text() == metrics
    assert whole_lines(tmp_path) == [1, 2] and (tmp_path / "ckpt" / "step-2").is_dir()
    return proc.returncode, proc.stderr


def debug_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None] = lambda sd: None) -> Path:
    """The debug flavour's weights as one safetensors file, after `edit`."""
    from models.llama import Transformer
    from models.llama.weight_files import write_weights

    args = tiny_args()
    sd = {k: v.detach().clone() for k, v in Transformer(args).state_dict().items()}
    edit(sd)
    folder.mkdir(parents=True, exist_ok=True)
    write_weights("torch", sd, args, folder / "w.safetensors")
    return folder / "w.safetensors"


def nan_in_layer_1(sd: dict[str, torch.Tensor]) -> None:
    sd["layers.1.attention_norm.weight"][3] = float("nan")


def generate_model(argv: list[str]):
    from trainer import inference

    parser = argparse.ArgumentParser()
    inference.add_model_flags(parser)
    opts, cfg = inference.parse(parser, argv)
    return inference.load_model(cfg, opts.weights, torch.device("cpu"), torch.float32)


def larger_flavour_than_the_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer import inference

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the weights were checked")

    monkeypatch.setattr(inference, "Transformer", built)
    weights = debug_weights(tmp_path)
    # Deeper than the weights (the same check as a 7B would meet, without building 7B's shapes on meta).
    inference.load_model(train_config("--model.n_layers", "6"), str(weights), torch.device("cpu"), torch.float32)


def train_config(*argv: str):
    from trainer.config import build_config

    return build_config(list(argv))


def with_monkeypatch(check: Callable[[Path, pytest.MonkeyPatch], None]) -> Callable[..., tuple[int, str]]:
    def run(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[int, str]:
        return call(lambda t: check(t, request.getfixturevalue("monkeypatch")))(tmp_path, request)
    return run


def command(main_of: Callable[[Path], Callable[[], int | None]]) -> Callable[..., tuple[int, str]]:
    """A script's main as its `__main__` runs it (trainer.cli.run_command): exit code and stderr."""

    def run(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[int, str]:
        from trainer.cli import run_command

        capsys = request.getfixturevalue("capsys")
        code = run_command(main_of(tmp_path))
        return code, capsys.readouterr().err

    return run


def convert_nan_weights(tmp_path: Path) -> Callable[[], int]:
    from scripts import convert_weights

    src = debug_weights(tmp_path, nan_in_layer_1)
    return lambda: convert_weights.main(["--from", "torch", "--to", "hf", "--flavor", "debug", str(src),
                                         str(tmp_path / "hf")])


def out_is_a_file(tmp_path: Path) -> None:
    """What every script that writes results into --out calls first (trainer/run_folder.py)."""
    from trainer.run_folder import keep_earlier_results

    (tmp_path / "out").write_text("not a folder")
    keep_earlier_results(tmp_path / "out", ["loss_compare.json"])


def failing_thread(tmp_path: Path) -> Callable[[], int]:
    import threading

    def main() -> int:
        def write() -> None:
            raise OSError(28, "No space left on device")

        worker = threading.Thread(target=write, name="tb-writer")
        worker.start()
        worker.join()
        return 0

    return main


def ctrl_c(tmp_path: Path) -> Callable[[], int]:
    def main() -> int:
        raise KeyboardInterrupt

    return main


def warmup_notes(tmp_path: Path) -> None:
    from trainer.config import notes
    from trainer.log import warn

    for note in notes(train_config("--training.steps", "3")):
        warn(note)


def untrained_generation(tmp_path: Path) -> None:
    from trainer import inference

    inference.load_model(train_config("--model.n_layers", "1", "--checkpoint.enable", "false"), None,
                         torch.device("cpu"), torch.float32)


def signal_during_startup(tmp_path: Path, signum: int) -> tuple[int, str]:
    """train.py signalled once it holds its dump folder's lock, before its loop: the lock must go with it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "train.py", *dump_args(tmp_path, "--training.steps", "1")], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / "run" / ".lock"
    deadline = time.monotonic() + HANG_S
    while not lock.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=HANG_S)
    assert not lock.exists(), stderr
    assert "Traceback" not in stderr, stderr
    return proc.returncode, stderr


def checkpoint_around(tmp_path: Path) -> Path:
    (tmp_path / "ckpt" / "step-1").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-1" / "checksums.json").write_text("{}")
    return tmp_path


TABLE: dict[str, Case] = {
    # -- round 4 (issue 35) -------------------------------------------------------------------------
    "dump folder deleted mid-run": Case(
        2, r"^error: job\.dump_folder '.*/run' was deleted or replaced during the run \(noticed after step 2\): its "
           r"metrics\.jsonl, config\.toml and \.lock are gone; checkpoint of step 2 saved$", dump_deleted),
    "rollback moves the later checkpoints and metrics aside": Case(
        0, r"^warning: checkpoint\.load_step = 1: the newer checkpoints \(2\) of the run being replaced were moved "
           r"to .*/ckpt/previous-1$", rollback),
    "generate.py with a deeper model than its weights": Case(
        2, r"^error: --weights: .*/w\.safetensors: missing key 'layers\.4\.[a-z_.0-9]+' \(and \d+ more\)$",
        with_monkeypatch(larger_flavour_than_the_weights)),
    "SIGTERM or SIGHUP during start-up": Case(
        130, r"^error: stopped by signal SIGHUP before the run started; nothing was saved$",
        lambda t, r: signal_during_startup(t, signal.SIGHUP)),
    "dump folder inside a checkpoint": Case(
        2, r"^error: job\.dump_folder '.*/ckpt/step-1/run' lies in the checkpoint .*/ckpt/step-1: files written there",
        in_process(lambda t: [*SMALL, "--training.steps", "1", "--job.dump_folder", str(t / "ckpt/step-1/run")],
                   setup=checkpoint_around)),
    "dump folder inside a live run's checkpoint folder": Case(
        2, r"^error: job\.dump_folder '.*/shared/run' lies in .*/shared, which is in use by another run",
        in_process(lambda t: [*SMALL, "--training.steps", "1", "--job.dump_folder", str(t / "shared/run")],
                   setup=lambda t: live_lock(t / "shared"))),
    "NaN weights in convert_weights.py": Case(
        2, r"^error: .*/w\.safetensors holds 1 NaN or infinite weights \(the first in 'layers\.1\.attention_norm\.weight'\)",
        command(convert_nan_weights)),
    "NaN weights in generate.py": Case(
        2, r"^error: weights .*/w\.safetensors holds 1 NaN or infinite weights",
        call(lambda t: generate_model(["--weights", str(debug_weights(t, nan_in_layer_1))]))),
    "prompt longer than max_seq_len": Case(
        2, r"^error: prompt 2 is 9 tokens, but the model attends to at most max_seq_len = 8, so nothing could be generated",
        call(lambda t: __import__("trainer.inference").inference.check_prompt_lengths([[1, 2], list(range(9))], 8))),
    "NaN temperature": Case(
        2, r"^error: need 0 < --top_p <= 1, a finite --temperature >= 0",
        command(lambda t: lambda: __import__("scripts.generate").generate.main(["--prompt", "x", "--temperature", "nan"]))),
    "a script's --out is a file": Case(
        2, r"^error: --out '.*/out' is not a writable folder \(FileExistsError", call(out_is_a_file)),
    "loss_compare.py --precisions ''": Case(
        2, r"^error: --precisions needs at least one of bf16",
        call(lambda t: __import__("scripts.loss_compare").loss_compare.parse_args(
            ["--config", "configs/debug.toml", "--out", str(t), "--precisions", ""]))),
    "train_tokenizer.py on whitespace-only rows": Case(
        2, r"^error: .*/ws\.txt hold no text to train a tokenizer on",
        command(lambda t: (t / "ws.txt").write_text("  \n\t\n") and (lambda: __import__("scripts.train_tokenizer").train_tokenizer.main(
            [str(t / "ws.txt"), "--out", str(t / "x.model")])))),
    "an exception in a library's thread": Case(
        1, r"^error: unexpected ThreadFailure: in thread tb-writer: OSError: \[Errno 28\] No space left on device "
           r"\(traceback in .*f8trainer-\d+-crash\.log\)$", command(failing_thread)),
    "Ctrl-C in a script": Case(130, r"^error: interrupted \(Ctrl-C\)$", command(ctrl_c)),
    "compile.backend typo": Case(
        2, r"^error: compile\.backend = 'inductr' is not a torch\.compile backend \(did you mean 'inductor'\?\)",
        call(lambda t: train_config("--compile.mode", "block", "--compile.backend", "inductr"))),
    "dump folder is the current folder": Case(
        2, r"^error: job\.dump_folder '.*' is the current folder or holds it: a fresh run moves config\.toml",
        in_process(lambda t: [*SMALL, "--training.steps", "1", "--job.dump_folder", str(Path.cwd())])),
    "profiling steps past the end": Case(
        2, r"^error: profiling\.steps \[5\] lie past training\.steps = 4",
        call(lambda t: train_config("--profiling.enable", "true", "--profiling.steps", "[5]", "--training.steps", "4"))),
    "warmup longer than the run is a warning": Case(
        0, r"^warning: lr_scheduler\.warmup_steps = 10 is not below training\.steps = 3: the run ends before",
        call(warmup_notes)),
    "generation with untrained weights warns": Case(
        0, r"^warning: no weights .*: generating with the untrained initialisation", call(untrained_generation)),
    # -- round 3 -------------------------------------------------------------------------------
    "crash in the loop saves the completed step": Case(
        1, r"^error: unexpected RuntimeError: forced failure while recording step 3 \(after step 3: checkpoint of "
           r"step 3 saved; traceback in .*/run/crash\.log\)$",
        subprocess_run(lambda t, r: dump_args(t, *CKPT), crash="record:3", then=saved_step(3))),
    "crash in the middle of a step saves nothing": Case(
        1, r"^error: unexpected RuntimeError: forced failure in forward pass 2 \(after step 1: no checkpoint saved "
           r"\(it failed in the middle of a step\); no complete checkpoint exists yet; traceback in .*\)$",
        subprocess_run(lambda t, r: dump_args(t, *CKPT), crash="forward:2", then=nothing_saved)),
    "full disk under metrics.jsonl": Case(
        1, r"^error: unexpected OSError: \[Errno 28\] No space left on device \(after step 3: checkpoint of step 3 "
           r"saved; traceback in .*\)$",
        subprocess_run(lambda t, r: dump_args(t, *CKPT), crash="disk_full:3", then=saved_step(3))),
    "checkpoint folder of a live run": Case(
        2, r"^error: checkpoint\.folder '.*/shared' is in use by another run \(pid \d+ on .*\); wait for it, use "
           r"another checkpoint\.folder, or delete .*/shared/\.lock if that run is gone$",
        in_process(lambda t: dump_args(t, "--checkpoint.enable", "true", "--checkpoint.folder", str(t / "shared")),
                   setup=lambda t: live_lock(t / "shared"))),
    "checkpoint folder inside a live run's dump folder": Case(
        2, r"^error: checkpoint\.folder '.*/other/checkpoints' lies in .*/other, which is in use by another run",
        in_process(lambda t: dump_args(t, "--checkpoint.enable", "true", "--checkpoint.folder",
                                       str(t / "other" / "checkpoints")),
                   setup=lambda t: live_lock(t / "other"))),
    "own checkpoint folder taken by another live run": Case(
        2, r"^error: checkpoint\.folder '.*/run/checkpoints' is in use by another run",
        in_process(lambda t: dump_args(t, "--checkpoint.enable", "true"),
                   setup=lambda t: live_lock(t / "run" / "checkpoints"))),
    "a new run finds another run's checkpoints": Case(
        2, r"^error: checkpoint\.folder '.*/shared' holds checkpoints of another run: step-1 was written by run "
           r"[0-9a-f]{12} of job\.dump_folder '.*/a', and this is a new run in '.*/run'; set "
           r"checkpoint\.resume_from_other_run = true to continue from it, or use another checkpoint\.folder$",
        subprocess_run(other_run_args)),
    "integer HF weights": Case(
        2, r"^error: checkpoint\.initial_load_path: .*/hf/model\.safetensors: '[a-z_.0-9]+' is int32, not a "
           r"weight dtype \(float32, bfloat16, float16, float64\)$",
        call(lambda t: hf_weights(t, int_weights))),
    "a stray safetensors file in an HF folder": Case(
        2, r"^error: checkpoint\.initial_load_path: .*/hf: 'model\.layers\.3\.[a-z_.]+' is in both "
           r"model\.safetensors and zz-old\.safetensors; remove the file that does not belong to the model$",
        call(lambda t: hf_weights(t, stray_file))),
    "another tokenizer on resume": Case(
        2, r"^error: checkpoint .*/shared/step-1 was trained with another tokenizer \(data/tokenizer\.model: 2048 "
           r"pieces, sha256 [0-9a-f]{16}\) than model\.tokenizer_path .*/small\.model \(1000 pieces, sha256 "
           r"[0-9a-f]{16}\); set model\.tokenizer_path to the tokenizer it was trained with$",
        subprocess_run(other_tokenizer_args)),
    "empty --config=": Case(
        2, r"^error: --config is empty \(an unset shell variable\?\); give a config file, or leave --config out "
           r"for the default configs/debug\.toml$",
        in_process(lambda t: ["--config="])),
    'empty --config ""': Case(2, r"^error: --config is empty", in_process(lambda t: ["--config", ""])),
    "long SFT prompts cut": Case(
        0, r"^warning: 24 of 24 SFT samples of data .*/sft\.jsonl will be cut to their newest 64 tokens and 0 "
           r"dropped to fit training\.seq_len = 64 .*: most samples lose part of their prompt",
        call(long_sft_prompts)),
    "data.path glob matching nothing": Case(
        2, r"^error: data\.path glob .*/\*\.jsonl matches no data files \(\.jsonl, \.json, \.parquet, \.txt\)$",
        call(lambda t: pretrain_loader(t / "*.jsonl"))),
    "corpus shorter than one sequence": Case(
        2, r"^error: data .*/tiny\.txt holds \d+ tokens, fewer than one sequence of seq_len \+ 1 = 257",
        call(short_corpus)),
    "bad held-out row names validation.path": Case(
        2, r"^error: validation\.path .*/val\.jsonl:2: field 'text' must be a string, got int$",
        call(bad_held_out_row)),
    "NaN initial weights": Case(
        2, r"^error: checkpoint\.initial_load_path .*/w\.safetensors holds 1 NaN or infinite weights \(the first in "
           r"'layers\.2\.ffn_norm\.weight'\): these weights are damaged or diverged",
        call(nan_initial_weights)),
    "mixture source weight not positive": Case(
        2, r"^error: data\.sources\[1\] \(code\): weight must be positive, got 0\.0$",
        in_process(lambda t: ["--config", str(t / "mix.toml")],
                   setup=mixture_toml(f'path = "{ROOT}/data/corpus/train-00001.jsonl"\nweight = 0\nname = "code"'))),
    "mixture source names clash": Case(
        2, r"^error: data\.sources\[1\] \(web\): name 'web' clashes with data\.sources\[0\]; give each source a "
           r"distinct name$",
        in_process(lambda t: ["--config", str(t / "mix.toml")],
                   setup=mixture_toml(f'path = "{ROOT}/data/heldout"\nweight = 1\nname = "web"'))),
    "mixture source missing": Case(
        2, r"^error: data\.sources\[1\] \(code\) not found: .*/code\.jsonl$",
        call(lambda t: mixture_loader(t, t / "code.jsonl"))),
    "mixture source empty": Case(
        2, r"^error: data\.sources\[1\] \(code\) .*/code\.jsonl is empty$",
        call(lambda t: ((t / "code.jsonl").write_text(""), mixture_loader(t, t / "code.jsonl")))),
    "library log lines come as our one-line warnings": Case(
        0, r"^warning: While redistributing from S\(0\) to R, 2 all-gathers will run$", one_line_each),
    # -- earlier rounds (cheap ones) -----------------------------------------------------------------
    "dump folder of a live run": Case(
        2, r"^error: job\.dump_folder '.*/run' is in use by another run",
        in_process(dump_args, setup=lambda t: live_lock(t / "run"))),
    "dump folder is a file": Case(
        2, r"^error: job\.dump_folder '.*/run' is not a writable folder \(FileExistsError",
        in_process(dump_args, setup=lambda t: (t / "run").write_text("x"))),
    "misspelt key": Case(2, r"^error: unknown config key training\.bach_size \(did you mean 'batch_size'\?\)",
                         in_process(lambda t: ["--training.bach_size", "3"])),
    "config file not found": Case(2, r"^error: config file not found: nope\.toml$",
                                  in_process(lambda t: ["--config", "nope.toml"])),
    "seq_len beyond the flavour": Case(
        2, r"^error: training\.seq_len = 4096 exceeds the max_seq_len 2048 of model\.flavor 'debug'",
        in_process(lambda t: dump_args(t, "--training.seq_len", "4096"))),
    "misspelt choice": Case(2, r"^error: float8\.scaling = 'rowise' is not one of tensorwise, rowwise, rowwise_gw_hp, "
                               r"blockwise \(did you mean 'rowwise'\?\)$", in_process(lambda t: ["--float8.scaling", "rowise"])),
    "NaN learning rate": Case(2, r"^error: --optimizer\.lr must be a finite number, got nan$",
                              in_process(lambda t: ["--optimizer.lr", "nan"])),
    "tensor parallel degree beyond the world": Case(
        2, r"^error: parallelism\.tensor_parallel_degree = 2 does not divide the world size 1$",
        in_process(lambda t: dump_args(t, "--parallelism.tensor_parallel_degree", "2"))),
    "data.path not found": Case(2, r"^error: data\.path not found: .*/nope\.jsonl$",
                                call(lambda t: pretrain_loader(t / "nope.jsonl"))),
    "validation without a path": Case(2, r"^error: validation\.enable = true needs validation\.path",
                                      in_process(lambda t: ["--validation.enable", "true", "--validation.path", ""])),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TABLE))
def test_fault(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    case = TABLE[name]
    code, stderr = case.run(tmp_path, request)
    first = stderr.splitlines()[0] if stderr.strip() else ""
    assert (code, bool(re.search(case.first_line, first))) == (case.exit_code, True), (
        f"{name}: exit {code}, first line {first!r}\n{stderr[-3000:]}")


def test_sighup_asks_the_loop_to_stop_like_sigterm() -> None:
    from trainer.data.exchange import LocalExchange
    from trainer.train_state import StopRequest

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    request = StopRequest(LocalExchange().all_gather, saving=True)
    try:
        request.install()
        os.kill(os.getpid(), signal.SIGHUP)  # a closed terminal: by default it ends the process, unsaved
        assert request.requested
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_a_crash_log_the_full_disk_refuses_leaves_no_empty_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.crash import crash_log

    write_text = Path.write_text

    def full_disk(path: Path, text: str, *args, **kwargs) -> int:
        if path.parent == tmp_path:
            write_text(path, "")  # opened, then the disk is full: an empty file is left
            raise OSError(28, "No space left on device")
        return write_text(path, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    where = Path(crash_log(str(tmp_path), 0, RuntimeError("the failure")))
    assert not (tmp_path / "crash.log").exists()
    assert where.parent != tmp_path and "RuntimeError: the failure" in where.read_text()
    where.unlink()


@pytest.mark.timeout(60)
def test_a_recursive_data_glob_does_not_follow_links_back_up_the_tree(tmp_path: Path) -> None:
    from trainer.data.source import DataSource

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "rows.jsonl").write_text('{"text": "one row"}\n')
    # Two links back up: a glob that follows them walks 2^depth paths, for ever in practice.
    (tmp_path / "a" / "up").symlink_to(tmp_path, target_is_directory=True)
    (tmp_path / "a" / "b" / "top").symlink_to(tmp_path, target_is_directory=True)
    assert DataSource(f"{tmp_path}/**/*.jsonl").files == [f"{tmp_path}/a/b/rows.jsonl"]
