import dataclasses
import re

import pytest

import train
from tests.helpers import ROOT, run_train
from trainer.config import (
    SECTIONS,
    Config,
    build_config,
    check_layout,
    choices_of,
    help_text,
    load_toml,
    to_toml,
)
from trainer.config.schema import field_types
from trainer.errors import UserError
from trainer.model_setup import model_args_for


def _write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_precedence_cli_over_toml_over_default(tmp_path):
    path = _write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.5\n")
    cfg = build_config(["--config", path, "--training.steps", "9", "--float8.filter_fqns", "output,wq"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == 0.5
    assert cfg.training.batch_size == Config().training.batch_size  # default
    assert cfg.float8.filter_fqns == ["output", "wq"]


def test_cli_value_types(tmp_path):
    path = _write(tmp_path, "")
    cfg = build_config([
        "--config", path, "--job.dry_run", "--float8.enabled=true", "--optimizer.betas", "[0.8, 0.9]",
        "--optimizer.eps", "1e-6", "--profiling.steps", "2,4", "--job.description", "hello world",
    ])
    assert cfg.job.dry_run is True and cfg.float8.enabled is True
    assert cfg.optimizer.betas == [0.8, 0.9] and cfg.optimizer.eps == 1e-6
    assert cfg.profiling.steps == [2, 4] and cfg.job.description == "hello world"


def test_resolved_config_round_trips(tmp_path):
    cfg = build_config(["--config", _write(tmp_path, ""), "--model.flavor", "7B", "--float8.enabled", "true"])
    path = _write(tmp_path, to_toml(cfg))
    again = build_config(["--config", path])
    assert again == cfg
    assert load_toml(path)["model"]["flavor"] == "7B"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--float8.scaling", "rowise"], "float8.scaling = 'rowise' is not one of tensorwise, rowwise, rowwise_gw_hp, blockwise (did you mean 'rowwise'?)"),
        (["--compile.mode", "fast"], "compile.mode = 'fast' is not one of none, block, model"),
        (["--training.bach_size", "3"], "unknown config key training.bach_size (did you mean 'batch_size'?)"),
        (["--trainng.steps", "3"], "unknown config section [trainng] (did you mean 'training'?)"),
        (["--training.steps", "0"], "training.steps must be positive, got 0"),
        (["--training.batch_size", "-2"], "training.batch_size must be positive, got -2"),
        (["--training.steps", "ten"], "--training.steps must be an integer, got 'ten'"),
        (["--float8.enabled", "maybe"], "--float8.enabled must be true or false, got 'maybe'"),
        (["--config", "missing.toml"], "config file not found: missing.toml"),
        (["--parallelism.data_parallel_shard_degree", "0"], "parallelism.data_parallel_shard_degree must be -1 or positive"),
        (["stray"], "unexpected argument 'stray'"),
        (["--optimizer.lr", "nan"], "--optimizer.lr must be a finite number, got nan"),
        (["--optimizer.weight_decay", "inf"], "--optimizer.weight_decay must be a finite number, got inf"),
        (["--training.seed", "99999999999999999999"], "--training.seed = 99999999999999999999 does not fit in 64 bits"),
        (["--compile.mode", "model", "--parallelism.tensor_parallel_degree", "2"],
         "compile.mode = 'model' does not work with tensor_parallel_degree > 1"),
        (["--model.name", "llama2"], "unknown config key model.name in the command line"),
        (["--optimizer.name", "AdamW"], "unknown config key optimizer.name"),
        # An unset shell variable: never the default config or folder in its place.
        (["--config="], "--config is empty (an unset shell variable?); give a config file, or leave --config out"),
        (["--config", ""], "--config is empty"),
        (["--job.dump_folder", ""], "job.dump_folder is empty (an unset shell variable?); give it a value"),
        (["--data.path="], "data.path is empty"),
    ],
)
def test_bad_input_is_one_user_error(args, message):
    with pytest.raises(UserError) as error:
        build_config(args)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_bad_input_exits_2_with_one_line():
    result = run_train(["--float8.scaling", "rowise"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "error: float8.scaling = 'rowise' is not one of tensorwise, rowwise, rowwise_gw_hp, blockwise (did you mean 'rowwise'?)"
    )


def test_layout_that_does_not_fit_the_model_heads():
    cfg = build_config(["--parallelism.tensor_parallel_degree", "3"])
    args = model_args_for(cfg, None, "cpu")
    with pytest.raises(UserError, match=r"tensor_parallel_degree = 3 must divide the number of heads \(8\)"):
        check_layout(cfg, 3, args.n_heads, args.n_kv_heads)


def test_removed_name_keys_are_unknown_in_toml(tmp_path):
    for section, key in (("model", "name"), ("optimizer", "name")):
        path = _write(tmp_path, f"[{section}]\n{key} = 'x'\n")
        with pytest.raises(UserError, match=rf"^unknown config key {section}\.{key}\b.* in {path}$"):
            build_config(["--config", path])


CHOICE_FIELDS = [
    (section, f.name, choices_of(tp))
    for section, cls in SECTIONS.items()
    for f, tp in ((f, field_types(cls)[f.name]) for f in dataclasses.fields(cls))
    if choices_of(tp)
]


@pytest.mark.parametrize(("section", "key", "choices"), CHOICE_FIELDS)
def test_choices_come_from_the_literal_type(section, key, choices):
    for value in choices:
        assert getattr(getattr(build_config([f"--{section}.{key}", value]), section), key) == value
    # 'bogus' may be close enough to a choice for a suggestion (float8.impl: 'ours').
    with pytest.raises(UserError, match=f"^{section}.{key} = 'bogus' is not one of {', '.join(choices)}"
                                        r"( \(did you mean '\w+'\?\))?$"):
        build_config([f"--{section}.{key}", "bogus"])
    assert f"--{section}.{key} {{{'|'.join(choices)}}}" in help_text()


def test_toml_type_errors_name_key(tmp_path):
    with pytest.raises(UserError, match=r"training.batch_size in .* must be an integer"):
        build_config(["--config", _write(tmp_path, "[training]\nbatch_size = '8'\n")])
    with pytest.raises(UserError, match=r"optimizer.lr in .* must be a finite number, got nan"):
        build_config(["--config", _write(tmp_path, "[optimizer]\nlr = nan\n")])
    with pytest.raises(UserError, match=r"'training' must be a \[section\] table"):
        build_config(["--config", _write(tmp_path, "training = 3\n")])


def test_layout_checks():
    cfg = Config()
    assert check_layout(cfg, 4, 8, 4) == (1, 4, 1)
    cfg.parallelism.tensor_parallel_degree = 2
    assert check_layout(cfg, 4, 8, 4) == (1, 2, 2)
    cfg.parallelism.data_parallel_shard_degree = 3
    with pytest.raises(UserError, match="does not match the world size 4"):
        check_layout(cfg, 4, 8, 4)
    cfg.parallelism.data_parallel_shard_degree = -1
    cfg.parallelism.tensor_parallel_degree = 4
    with pytest.raises(UserError, match="must divide the number of heads"):
        check_layout(cfg, 4, 8, 2)


def test_hsdp_layout_checks():
    cfg = build_config(["--parallelism.data_parallel_replicate_degree", "2"])
    layout = check_layout(cfg, 8, 8, 4)
    assert (layout, layout.dp, layout.world_size) == ((2, 4, 1), 8, 8)
    cfg = build_config(["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.tensor_parallel_degree", "2"])
    assert check_layout(cfg, 4, 8, 4) == (2, 1, 2)
    with pytest.raises(UserError, match=r"^parallelism.data_parallel_replicate_degree \(2\) x tensor_parallel_degree \(2\) "
                                        r"= 4 does not divide the world size 6$"):
        check_layout(cfg, 6, 8, 4)
    cfg = build_config(["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"])
    with pytest.raises(UserError, match=r"^parallelism.data_parallel_replicate_degree \(2\) x data_parallel_shard_degree "
                                        r"\(2\) x tensor_parallel_degree \(1\) = 4 does not match the world size 8$"):
        check_layout(cfg, 8, 8, 4)
    with pytest.raises(UserError, match=r"^parallelism.data_parallel_replicate_degree must be positive, got 0$"):
        build_config(["--parallelism.data_parallel_replicate_degree", "0"])


def test_help_lists_every_option(capsys):
    text = help_text()
    cfg = Config().to_dict()
    for section, values in cfg.items():
        for key in values:
            assert f"--{section}.{key}" in text
    with pytest.raises(SystemExit) as exit_:
        build_config(["--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == text


def test_dry_run_7b_plan(capsys):
    assert train.main(["--config", "configs/7b_bf16.toml", "--job.dry_run", "true"]) == 0
    out = capsys.readouterr().out
    assert "6,738,415,616" in out
    assert "46,086,512,640" in out  # 6N + 12 L d S at seq 4096
    assert "tokens per step   8,192 (batch 2 x seq 4096 x accum 1 x dp 1)" in out


def test_configuration_doc_lists_every_option_with_its_choices():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    sections = re.split(r"^## \[(\w+)\]$", doc, flags=re.M)
    rows = {name: body for name, body in zip(sections[1::2], sections[2::2])}
    for section, cls in SECTIONS.items():
        assert section in rows, f"## [{section}] missing from docs/configuration.md"
        for key, tp in field_types(cls).items():
            row = re.search(rf"^\| `{key}` \|(.*)$", rows[section], flags=re.M)
            assert row, f"{section}.{key} missing from docs/configuration.md"
            choices_cell = row.group(1).split("|")[1].strip()
            assert choices_cell == ", ".join(choices_of(tp) or ()), f"{section}.{key}: choices column"


SHIPPED_CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.toml"))


def test_every_shipped_config_is_checked():
    assert len(SHIPPED_CONFIGS) >= 6 and "configs/7b_sft_fp8.toml" in SHIPPED_CONFIGS


@pytest.mark.parametrize("path", SHIPPED_CONFIGS)
def test_shipped_configs_validate(path):
    cfg = build_config(["--config", path])
    assert cfg.model.flavor == ("debug" if "debug" in path else "7B")


def test_the_dry_run_plans_for_the_world_size_it_is_given():
    from trainer.dry_run import _planned_world_size

    assert _planned_world_size(build_config(["--job.dry_run_world_size", "8"])) == 8
    assert _planned_world_size(build_config([])) == 1
