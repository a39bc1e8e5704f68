"""Config: TOML + dotted overrides, and one clear line for each kind of bad input."""
import pytest

from titanlite import TitanliteError
from titanlite.config import Config, load_config


def test_toml_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[training]\nsteps = 7\nbatch_size = 3\n[optimizer]\nlr = 1e-2\n')
    cfg = load_config(f, ["--training.steps", "9", "--training.deterministic", "--model.dim=32"])
    assert (cfg.training.steps, cfg.training.batch_size, cfg.optimizer.lr) == (9, 3, 1e-2)
    assert cfg.training.deterministic is True and cfg.model.dim == 32
    assert load_config(None, {"training.seed": 5}).training.seed == 5


def test_shipped_configs_load():
    for name in ("debug", "small"):
        assert isinstance(load_config(f"configs/{name}.toml"), Config)


@pytest.mark.parametrize("overrides, message", [
    (["--training.step", "5"], r"unknown config key 'training.step'.*did you mean: training.steps"),
    (["--training.lr", "1"], r"did you mean: optimizer.lr"),
    (["--nosuch.key", "1"], r"unknown config key 'nosuch.key'.*sections are"),
    (["--training.steps", "ten"], r"training.steps must be an integer, got 'ten'"),
    (["--training.steps", "1.5"], r"must be an integer"),
    (["--training.deterministic", "maybe"], r"must be true or false"),
    (["--training.steps", "0"], r"training.steps must be positive"),
    (["--training.batch_size", "-2"], r"training.batch_size must be positive"),
    (["--training.seq_len", "0"], r"training.seq_len must be positive"),
    (["--scheduler.decay", "cosin"], r"did you mean: cosine"),
    (["--data.val_fraction", "1.5"], r"between 0 and 1"),
    (["stray"], r"unexpected argument 'stray'"),
])
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
