"""The project's own files agree with each other: dependencies, README commands, CI."""

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
CONDA_TO_PYPI = {"pytorch": "torch"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_names_the_same_packages_as_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {_name(d) for d in deps}
    listed = set()
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"\s*-\s+([A-Za-z][\w.\-]*)", line)
        if m and m.group(1) not in ("python", "pip", "conda-forge", "-e"):
            listed.add(CONDA_TO_PYPI.get(m.group(1).lower(), m.group(1).lower()))
    listed.discard("pip:")
    assert listed == wanted, (
        f"only in environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"
    )


def test_readme_gives_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", readme, re.S).group(1)
    commands = [
        line for line in block.splitlines() if line.strip() and not line.strip().startswith("#")
    ]
    assert len(commands) == 2, commands
    test_command = commands[1].split("#")[0].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command.split("&&")[-1].strip() in ci


def test_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["titanlite"] == "titanlite.tools.cli.commands:main"


def test_license_is_an_spdx_string_setuptools_reads_without_a_deprecation_warning():
    """A license *table* made `pip install -e .` print the same deprecation warning three times."""
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)
    # first to accept SPDX strings
    assert "setuptools>=77" in project["build-system"]["requires"][0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert not [w for w in caught if "license" in str(w.message).lower()], [
        str(w.message) for w in caught
    ]


def test_make_lab_starts_jupyterlab_with_the_news_pop_up_turned_off():
    """JupyterLab 4 asks "Would you like to get notified about official Jupyter news?" while
    fetchNews is "none" (its default): a pop-up over the first plots. `make lab` points
    JupyterLab's app settings at configs/jupyterlab, whose overrides.json says "false". Read back
    here by the function JupyterLab's settings API serves them with, against this venv's schema."""
    import tempfile

    from jupyterlab.commands import get_app_dir
    from jupyterlab_server.settings_utils import get_settings

    makefile = (ROOT / "Makefile").read_text()
    folder = re.search(r'--LabApp\.app_settings_dir=\$\(CURDIR\)/([^"\s]+)', makefile).group(1)
    recipe = re.search(r"^lab:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "$(LAB_ARGS)" in next(line for line in recipe.splitlines() if "jupyter lab" in line)
    with tempfile.TemporaryDirectory() as no_user_settings:
        settings, _ = get_settings(
            str(ROOT / folder),
            str(Path(get_app_dir()) / "schemas"),
            no_user_settings,
            "@jupyterlab/apputils-extension:notification",
        )
    # Overrides become the schema's defaults; with no user setting, the defaults are what applies.
    assert settings["settings"] == {}
    assert settings["schema"]["properties"]["fetchNews"]["default"] == "false"
    assert settings["schema"]["properties"]["checkForUpdates"]["default"] is False
    with tempfile.TemporaryDirectory() as empty:  # and the check can fail: the default asks
        default, _ = get_settings(
            empty,
            str(Path(get_app_dir()) / "schemas"),
            empty,
            "@jupyterlab/apputils-extension:notification",
        )
    assert default["schema"]["properties"]["fetchNews"]["default"] == "none"
