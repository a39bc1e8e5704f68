"""Config: TOML + dotted overrides, and one clear line for each kind of bad input."""

import pytest

from titanlite import TitanliteError
from titanlite.config import Config, load_config


def test_toml_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[training]\nsteps = 7\nbatch_size = 3\n[optimizer]\nlr = 1e-2\n")
    cfg = load_config(f, ["--training.steps", "9", "--training.deterministic", "--model.dim=32"])
    assert (cfg.training.steps, cfg.training.batch_size, cfg.optimizer.lr) == (9, 3, 1e-2)
    assert cfg.training.deterministic is True and cfg.model.dim == 32
    assert load_config(None, {"training.seed": 5}).training.seed == 5


def test_shipped_configs_load():
    for name in ("debug", "small"):
        assert isinstance(load_config(f"configs/{name}.toml"), Config)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--training.step", "5"],
            r"unknown config key 'training.step'.*did you mean: training.steps",
        ),
        (["--training.lr", "1"], r"did you mean: optimizer.lr"),
        (["--nosuch.key", "1"], r"unknown config key 'nosuch.key'.*sections are"),
        (["--training.steps", "ten"], r"training.steps must be an integer, got 'ten'"),
        (["--training.steps", "1.5"], r"must be an integer"),
        (["--training.deterministic", "maybe"], r"must be true or false"),
        (["--training.steps", "0"], r"training.steps must be positive"),
        (["--training.batch_size", "-2"], r"training.batch_size must be between 1 and 1048576"),
        (["--training.seq_len", "0"], r"training.seq_len must be between 1 and 1048576"),
        (["--scheduler.decay", "cosin"], r"did you mean: cosine"),
        (["--data.val_fraction", "1.5"], r"between 0 and 1"),
        (["stray"], r"unexpected argument 'stray'"),
    ],
)
def test_bad_overrides(overrides, message):
    with pytest.raises(TitanliteError, match=message) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(TitanliteError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps=1")
    with pytest.raises(TitanliteError, match="not valid TOML"):
        load_config(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("[training]\nstesp = 3\n")
    with pytest.raises(TitanliteError, match=r"typo.toml.*did you mean: training.steps"):
        load_config(typo)


# Fields that no value of the right type can make wrong: booleans aside (a wrong word such as
# "maybe" is refused by type), free paths and names checked where they are used (a dataset
# path when the corpus is read, a checkpoint when it is loaded, output folders by
# titanlite.paths). A new field must either declare a range/choices/pattern or join this list.
NO_BAD_VALUE = {
    "data.path",
    "data.tokenizer",
    "data.data_dir",
    "checkpoint.folder",
    "checkpoint.load",
    "checkpoint.initial_load_path",
    "profile.trace_dir",
}

PATTERN_BAD = {
    "data.dataset": ["", "imagenet", "file:"],
    "training.device": ["gpu", "cuda:x"],
    "eval.prompt": [""],
    "metrics.log_dir": [""],
    "metrics.run_name": ["a/b", ".."],
    "compile.backend": ["", "in ductor", "-O3"],
    "profile.steps": ["five", "5-", "-8", "5-8-9"],
}


def _bad_values(key: str, f) -> list:
    """Values that the field's declaration must refuse."""
    import math

    meta = f.metadata
    tp = str(f.type)
    if "range" in meta:
        r = meta["range"]
        lo = r.lo if r.lo_open else r.lo - (1 if "int" in tp else 1e-3)
        bad = [v for v in (lo, -1e9) if v not in r.also]
        if r.hi != math.inf:
            bad.append(r.hi if r.hi_open else r.hi + (1 if "int" in tp else 1e-3))
        if "float" in tp:
            bad += [math.nan, math.inf]
        return [int(v) if "int" in tp else v for v in bad]
    if "choices" in meta:
        return ["nosuch"]
    if "pattern" in meta:
        assert key in PATTERN_BAD, f"{key} has a pattern: add values it must refuse to PATTERN_BAD"
        return PATTERN_BAD[key]
    if "bool" in tp:
        return ["maybe"]
    assert key in NO_BAD_VALUE, (
        f"{key} declares no range, choices or pattern: declare one "
        f"beside the field in titanlite/config.py, or list it in NO_BAD_VALUE"
    )
    return []


def _all_fields():
    import dataclasses

    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory):
            yield f"{section.name}.{f.name}", f


@pytest.mark.parametrize("key, f", list(_all_fields()), ids=[k for k, _ in _all_fields()])
def test_every_field_refuses_its_bad_values_in_one_line(key, f):
    """Every key of every section: an out-of-range, non-finite or wrong-choice value is refused
    by the config check, in one line that names the key and shows a valid value."""
    if key in NO_BAD_VALUE:
        assert not f.metadata and "bool" not in str(f.type)
        load_config(None, {key: "anything"})  # really anything goes here
        return
    bad = _bad_values(key, f)
    assert bad
    for value in bad:
        with pytest.raises(TitanliteError) as e:
            load_config(None, {key: value})
        msg = str(e.value)
        assert "\n" not in msg and key in msg, msg
        if "range" in f.metadata or "choices" in f.metadata or "pattern" in f.metadata:
            assert "e.g. --" + key in msg, msg  # the fix: a value that works
    # and the default (or None) passes
    load_config(None, {})


def test_python_api_values_are_checked_too():
    cfg = Config()
    cfg.optimizer.lr = float("nan")
    with pytest.raises(TitanliteError, match=r"optimizer.lr must be a finite number positive"):
        cfg.validate()
    cfg = Config()
    cfg.training.steps = "5"
    with pytest.raises(TitanliteError, match=r"training.steps must be an integer, got '5' \(str\)"):
        cfg.validate()


def test_declared_choices_match_the_code_they_guard():
    from titanlite.data.tokenizer import MIN_VOCAB_SIZE
    from titanlite.models.llama import PRESETS

    fields = dict(_all_fields())
    assert set(fields["model.preset"].metadata["choices"]) == set(PRESETS)
    assert fields["data.vocab_size"].metadata["range"].lo == MIN_VOCAB_SIZE


def test_tiny_and_odd_but_valid_values_pass():
    cfg = load_config(
        None,
        {
            "scheduler.min_lr_ratio": 0,
            "optimizer.beta1": 0,
            "parallel.dp_shard": -1,
            "training.device": "cuda:1",
            "training.threads": "none",
            "metrics.run_name": "my-run.2",
        },
    )
    assert cfg.scheduler.min_lr_ratio == 0 and cfg.training.threads is None


def test_with_overrides_returns_an_edited_copy_and_leaves_the_original():
    cfg = Config()
    copy = cfg.with_overrides(
        {"training.steps": 7, "metrics.run_name": "x"}, source="ladder overrides"
    )
    assert (copy.training.steps, copy.metrics.run_name) == (7, "x")
    assert (cfg.training.steps, cfg.metrics.run_name) == (
        Config().training.steps,
        Config().metrics.run_name,
    )
    copy.optimizer.lr = 1.0
    assert cfg.optimizer.lr != 1.0  # sections are copies too, not shared
    with pytest.raises(TitanliteError, match="ladder overrides"):
        cfg.with_overrides({"training.nosuchkey": 1}, source="ladder overrides")
