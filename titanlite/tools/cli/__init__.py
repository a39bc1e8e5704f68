"""The `titanlite` command line: the top of the house.

    commands      `titanlite train | peaks | export-hf | export-checkpoint | doctor | progress`
    config_help   `--help`'s sections and keys, and the notes on settings that have no effect
    doctor        `titanlite doctor`: the self-check of this machine's device, a report to attach

May import the core and every other tool sub-package; nothing imports it but `python -m titanlite`
(and `titanlite`, the script pyproject.toml installs)."""
