"""`titanlite train --help`: every config section and `--section.key` override, with its default
and the comment written beside the field in titanlite/config.py.

Generated from the Config dataclasses, so a new key appears in the help the moment it exists.
The comments are read from the source once (tokenize keeps them; the dataclasses do not): a
field's trailing comment, else the comment lines just above it.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize

from ... import config as config_module


def field_comments(cls) -> dict[str, str]:
    """{field name: its comment} for one dataclass, from its source."""
    source = inspect.getsource(cls)
    # tokenize tells a comment from a "#" inside a string (a regex, a prompt)
    comment_on = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    comments, above = {}, []
    for number, line in enumerate(source.splitlines(), start=1):
        field = re.match(r"    (\w+)\s*:", line)
        if line.strip().startswith("#"):
            above.append(comment_on[number])
        elif field:
            trailing = comment_on.get(number)
            if trailing or above:
                comments[field.group(1)] = trailing or " ".join(above)
            above = []
        else:  # a blank line or the class line: comments above it belong to nothing here
            above = []
    return comments


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _shown(value) -> str:
    """The default as one would type it after the flag."""
    if value is None or isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and (not value or value != value.strip() or " " in value):
        return repr(value)  # "The " must not print as a bare word that hides its space
    return str(value)


_COLUMN = 44  # where the descriptions start


def overrides_help(width: int = 100) -> str:
    """The help text listing every section, key, default and comment."""
    cfg = config_module.Config()
    out = ["sections and their overrides (--section.key VALUE; default, then what it does):"]
    for section in dataclasses.fields(cfg):
        cls = type(getattr(cfg, section.name))
        comments = field_comments(cls)
        out.append(f"\n  [{section.name}]")
        for f in dataclasses.fields(cls):
            flag = f"--{section.name}.{f.name} {_shown(_default(f))}"
            words = comments.get(f.name, "")
            choices = f.metadata.get("choices", ())
            if choices and not all(c in words for c in choices):
                words = "; ".join(filter(None, (words, "one of " + ", ".join(choices))))
            elif not words and "pattern" in f.metadata:
                words = f.metadata["pattern"][1]
            elif not words and "range" in f.metadata:
                words = f.metadata["range"].describe()
            lead = (
                f"    {flag:<{_COLUMN - 5}} "
                if len(flag) < _COLUMN - 5
                else f"    {flag}\n{' ' * _COLUMN}"
            )
            body = textwrap.wrap(words, width=max(30, width - _COLUMN)) or [""]
            out.append((lead + ("\n" + " " * _COLUMN).join(body)).rstrip())
    return "\n".join(out)


# Options that only act when another is on: (those options, is it on?, the setting that turns it on).
DEPENDS_ON = (
    (
        ("checkpoint.every", "checkpoint.mode", "checkpoint.keep_latest_k", "checkpoint.resume"),
        lambda c: c.checkpoint.enable,
        "--checkpoint.enable true",
    ),
    (
        ("float8.recipe", "float8.min_dim", "float8.emulate", "float8.fsdp_all_gather"),
        lambda c: c.float8.enable,
        "--float8.enable true",
    ),
    (
        ("activation_checkpoint.every",),
        lambda c: c.activation_checkpoint.mode == "selective",
        "--activation_checkpoint.mode selective",
    ),
    (
        ("compile.scope", "compile.fallback", "compile.backend"),
        lambda c: c.compile.enable is not False,
        "--compile.enable true",
    ),
    (
        (
            "fault.rank",
            "fault.step",
            "fault.once",
            "fault.attempts",
            "fault.step_gap",
            "fault.during",
        ),
        lambda c: c.fault.kind != "none",
        "--fault.kind exception, kill, hang or slow",
    ),
    (("fault.slow_s",), lambda c: c.fault.kind in ("none", "slow"), "--fault.kind slow"),
    (
        ("profile.memory", "profile.trace_dir"),
        lambda c: bool(c.profile.steps),
        "--profile.steps, e.g. 5-8",
    ),
    (("eval.batches",), lambda c: c.eval.every > 0, "--eval.every N"),
    (
        ("parallel.pp_schedule", "parallel.pp_microbatches", "parallel.pp_stages_per_rank"),
        lambda c: c.parallel.pp > 1,
        "--parallel.pp 2 or more",
    ),
    (
        ("parallel.sequence_parallel", "parallel.loss_parallel"),
        lambda c: c.parallel.tp > 1,
        "--parallel.tp 2 or more",
    ),
    (
        (
            "model.experts_per_token",
            "model.n_shared_experts",
            "model.moe_every",
            "model.expert_hidden_dim",
            "model.moe_router",
            "model.moe_balance",
            "model.moe_aux_loss_coef",
            "model.moe_bias_update",
            "model.moe_capacity_factor",
        ),
        # A published start (a Mixtral) sets them, and HuggingFaceStart refuses one it disagrees with.
        lambda c: c.model.n_experts > 0 or bool(c.checkpoint.initial_load_path),
        "--model.n_experts 2 or more",
    ),
    (
        ("parallel.cp_layout", "parallel.cp_method"),
        lambda c: c.parallel.cp > 1,
        "--parallel.cp 2 or more",
    ),
    (
        ("model.attention",),
        lambda c: c.data.document_mask,
        "--data.document_mask true",
    ),
    (
        tuple(
            f"fault_tolerance.{key}"
            for key in (
                "replica_id",
                "group_size",
                "min_replica_size",
                "semi_sync_method",
                "process_group",
                "process_group_timeout_ms",
            )
        ),
        lambda c: c.fault_tolerance.enable,
        "--fault_tolerance.enable true",
    ),
    (
        ("fault_tolerance.sync_steps",),
        lambda c: c.fault_tolerance.enable and c.fault_tolerance.semi_sync_method != "none",
        "--fault_tolerance.enable true --fault_tolerance.semi_sync_method diloco or local_sgd",
    ),
)


def without_effect(cfg) -> list[str]:
    """One line for each option set away from its default that `cfg` leaves without effect
    (`--checkpoint.every 2` without `--checkpoint.enable true` saves nothing)."""
    default, lines = config_module.Config(), []
    for keys, on, switch in DEPENDS_ON:
        if on(cfg):
            continue
        for key in keys:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            if value != getattr(getattr(default, section), name):
                lines.append(f"--{key} {_shown(value)} has no effect without {switch}")
    return lines
