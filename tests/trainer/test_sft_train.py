"""SFT from the user's side: configs, prompt masking through the trainer's loader, a short
training run followed by scripts/eval_sft.py and scripts/generate.py, batched generation.

The full run that reaches the exact-match bar takes minutes; it is measured by hand (see
configs/debug_sft.toml), not here.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import re
import subprocess

import pytest
import torch

from models.llama import LLAMA2_FLAVORS, Transformer
from models.llama.generation import generate
from scripts import eval_sft
from tests.helpers import read_metrics, run_script, run_train
from trainer.config import build_config
from trainer.data.loader import IGNORE_INDEX, build_dataloader
from trainer.data.sft import load_sft_rows, reference_answer
from trainer.data.tokenizer import Tokenizer
from trainer.inference import chat_prompt
from trainer.trainer import sft_options

SFT = "configs/debug_sft.toml"


def run_command(script: str, *args: str) -> subprocess.CompletedProcess:
    return run_script(f"scripts/{script}", list(args), timeout=300)


def exact_match(proc: subprocess.CompletedProcess) -> float:
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"exact_match=(\d\.\d+)", last)
    assert m, proc.stdout[-2000:]
    return float(m.group(1))


def reply_similarity(proc: subprocess.CompletedProcess) -> float:
    """Mean character similarity (difflib ratio) of the shown answers to their references."""
    pairs = re.findall(r"^(?:ok |BAD) .* -> ('.*'|\".*\") \(reference ('.*'|\".*\")\)$", proc.stdout, flags=re.M)
    assert pairs, proc.stdout[-2000:]
    ratios = [difflib.SequenceMatcher(None, ast.literal_eval(a), ast.literal_eval(r)).ratio() for a, r in pairs]
    return sum(ratios) / len(ratios)


def test_loader_trains_on_replies_only():
    """Through the config and the trainer's loader: every trained label run is one reply + EOS."""
    cfg = build_config(["--config", SFT, "--training.seq_len", "128", "--training.batch_size", "2"])
    tok = Tokenizer(cfg.model.tokenizer_path)
    options = sft_options(cfg)
    replies = {reference_answer(r, options) for r in load_sft_rows(cfg.data.path, options)}
    loader = build_dataloader(
        kind=cfg.data.kind, path=cfg.data.path, tokenizer=tok, seq_len=cfg.training.seq_len,
        batch_size=cfg.training.batch_size, dp_rank=0, dp_degree=1, seed=cfg.training.seed,
        data_format=cfg.data.format, sft_options=options,
    )
    batch = next(iter(loader))
    assert {"position_ids", "document_ids"} <= set(batch), "packing is on in debug_sft.toml"
    runs = 0
    for inputs, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        t = 0
        while t < len(labels):
            if labels[t] == IGNORE_INDEX:
                t += 1
                continue
            start = t
            while t < len(labels) and labels[t] != IGNORE_INDEX:
                t += 1
            run = labels[start:t]
            # predicted from the last prompt token, "]" of [/INST]; ends with EOS
            assert tok.decode(inputs[max(0, start - 3): start + 1]).endswith("[/INST]")
            assert run[-1] == tok.eos_id and tok.eos_id not in run[:-1]
            assert tok.decode(run[:-1]).strip() in replies
            runs += 1
    assert runs >= 2 * cfg.training.batch_size  # several packed samples per row


def test_batched_generation_equals_one_by_one():
    """Left padding with restarted positions and a padding document changes no row's answer."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(LLAMA2_FLAVORS["debug"], n_layers=1)).eval()
    with torch.no_grad():
        model.init_weights()
    prompts = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 3, 3, 8]]
    batched = generate(model, prompts, max_new_tokens=6, eos_id=2)
    alone = [generate(model, [p], max_new_tokens=6, eos_id=2)[0] for p in prompts]
    assert batched == alone and all(len(o) == 6 for o in batched)


@pytest.mark.slow
def test_7b_sft_config_dry_run():
    proc = run_train(["--config", "configs/7b_sft_fp8.toml", "--job.dry_run", "true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "6,738,415,616" in proc.stdout and "float8 tensorwise" in proc.stdout
    assert "compile           block" in proc.stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["--data.eval_path", "nope/eval.jsonl"], "nope/eval.jsonl"),
    (["--data.eval_path", ""], "data.eval_path is not set"),
    (["--training.stepz", "3"], "unknown config key training.stepz"),
])
def test_eval_bad_input_is_one_line(capsys, argv, message):
    assert eval_sft.main(["--config", SFT, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.slow
def test_short_sft_run_then_eval_and_generate(tmp_path):
    dump = str(tmp_path)
    proc = run_train(["--config", SFT, "--job.dump_folder", dump, "--training.steps", "30",
                      "--training.seq_len", "128", "--training.batch_size", "4", "--metrics.log_freq", "10",
                      "--checkpoint.interval", "15", "--checkpoint.export_final", "true",
                      "--metrics.enable_tensorboard", "false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    loss = {r["step"]: r["loss"] for r in rows}
    assert loss[30] < loss[1] / 2, loss
    # 528 samples packed into 30 x 4 rows of 128; the synthetic tasks all fit, none cut or dropped.
    assert (rows[-1]["data/samples"], rows[-1]["data/truncated"], rows[-1]["data/dropped"]) == (528, 0, 0)
    # debug_sft.toml validates on data/sft/eval.jsonl at the last step. After 30 steps about half
    # the reply tokens are right (0.5253 bf16, 0.5231 float32 on AVX2, measured 2026-12-01) but no
    # whole reply yet: exact match needs the config's 1000 steps (0.9250, measured by hand).
    assert rows[-1]["step"] == 30 and rows[-1]["validation/accuracy"] >= 0.45, rows[-1]

    trained = run_command("eval_sft.py", "--config", SFT, "--job.dump_folder", dump, "--max_samples", "24",
                         "--show", "24")
    assert f"weights: {tmp_path}/checkpoints/step-30" in trained.stdout
    untrained = run_command("eval_sft.py", "--config", SFT, "--job.dump_folder", dump, "--max_samples", "24",
                           "--show", "24", "--checkpoint.enable", "false")
    assert "untrained" in untrained.stdout
    # No whole reply is right after 30 steps, but the replies are already nearer the references
    # than the untrained model's (similarity 0.26 against 0.11, bf16, measured 2026-12-01).
    assert exact_match(trained) <= 0.25 and exact_match(untrained) == 0.0
    assert reply_similarity(trained) >= reply_similarity(untrained) + 0.1

    export = tmp_path / "checkpoints" / "final" / "model.safetensors"
    gen = run_command("generate.py", "--config", SFT, "--weights", str(export), "--max_new_tokens", "8",
                     "--prompt", "Copy the words: cat dog", "--temperature", "0.7", "--top_p", "0.9")
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert f"weights: {export}" in gen.stderr
    assert gen.stdout.startswith("### [INST] Copy the words: cat dog [/INST]\n")


def test_chat_prompt_is_the_training_template():
    tok = Tokenizer("data/tokenizer.model")
    ids = chat_prompt(tok, "Copy the words: cat dog", system="Be brief.")
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nCopy the words: cat dog [/INST]"
