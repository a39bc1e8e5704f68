"""The core in the order the notebooks teach it, with statement counts: README's "Reading the package".

    python -m titanlite.tools.course.reading_order            # print the table
    python -m titanlite.tools.course.reading_order --readme   # rewrite README.md's table in place

The counts are read from the files, never typed: tests/test_core_size.py fails if README's table
differs from what this prints, or if a core module is missing from the order. A statement is a
logical line (tokenize's NEWLINE token): the same however the code is wrapped, and a comment is
none, so the table rewards neither packing lines nor dropping the comments that say why.
"""

from __future__ import annotations

import io
import sys
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2]  # titanlite/
START, END = "<!-- reading-order:start -->", "<!-- reading-order:end -->"

# (where it is taught, what the files are for, the files in reading order)
READING_ORDER = [
    (
        "00",
        "the machine: device, dtypes, peaks for MFU, memory, device-dependent defaults",
        ["hardware.py", "peaks.py", "memory.py", "device_policy.py"],
    ),
    (
        "01",
        "a run: config, one validation, the model, the data, the loop and what watches it",
        [
            "config.py",
            "config_fields.py",
            "preflight.py",
            "models/llama.py",
            "models/layers.py",
            "models/rope.py",
            "data/corpus.py",
            "data/tokenizer.py",
            "data/sampler.py",
            "data/pipeline.py",
            "data/_cache.py",
            "optimizer.py",
            "train.py",
            "watchers.py",
            "metrics.py",
            "evaluate.py",
            "_ui.py",
        ],
    ),
    (
        "02",
        "gradient accumulation, global-token loss; host-to-device copies",
        ["efficiency/accumulation.py", "data/transfer.py"],
    ),
    ("03", "mixed precision", ["efficiency/mixed_precision.py"]),
    ("04", "activation checkpointing", ["efficiency/activation_checkpoint.py"]),
    (
        "05",
        "torch.compile, and the trial that decides whether it can run here",
        ["efficiency/compile.py", "efficiency/compile_trial.py"],
    ),
    (
        "06",
        "FP8 (and the torchao internals it and the 8-/4-bit AdamW touch)",
        ["efficiency/fp8.py", "_compat/torchao_internals.py"],
    ),
    ("07", "joining a job; data parallel", ["distributed/env.py", "distributed/ddp.py"]),
    ("08", "FSDP2 (ZeRO-3)", ["distributed/fsdp.py"]),
    ("09", "tensor, sequence and loss parallel", ["distributed/tensor_parallel.py"]),
    ("10", "pipeline parallel", ["distributed/pipeline.py", "distributed/pipeline_schedules.py"]),
    (
        "11",
        "the rank grid, the ordered chain of apply_*, and run.json: what the run built",
        ["distributed/mesh.py", "distributed/parallelize.py", "run_record.py"],
    ),
    (
        "12",
        "distributed checkpoints, balanced I/O, resume, the final weights",
        [
            "resilience/checkpoint.py",
            "resilience/async_saves.py",
            "resilience/checkpoint_files.py",
            "resilience/staging.py",
            "resilience/balanced_io.py",
            "resilience/train_state.py",
            "resilience/resume.py",
            "weights.py",
        ],
    ),
    ("13", "injected faults", ["resilience/faults.py"]),
    (
        "17",
        "context parallel: ring attention across the ranks",
        ["distributed/context_parallel.py", "distributed/attention_block.py"],
    ),
    (
        "18",
        "mixture of experts: routing, balance, experts split over ranks",
        ["models/moe.py", "distributed/expert_parallel.py"],
    ),
    (
        "20",
        "Muon on the hidden matrices and AdamW on the rest; its update gathered under FSDP",
        ["muon.py"],
    ),
    (
        "21",
        "document masks: SDPA's boolean or FlexAttention's BlockMask, and where flex trains",
        ["models/masked_attention.py", "models/flex.py"],
    ),
    (
        "22",
        "per-step fault tolerance (torchft): replica groups, the quorum, healing from a peer, DiLoCo",
        ["resilience/fault_tolerance.py", "resilience/fault_tolerance_config.py"],
    ),
    (
        "all",
        "one-line errors, output paths, torch internals in one place, package files",
        [
            "errors.py",
            "paths.py",
            "_compat/torch_internals.py",
            "__init__.py",
            "data/__init__.py",
            "models/__init__.py",
            "efficiency/__init__.py",
            "distributed/__init__.py",
            "resilience/__init__.py",
            "_compat/__init__.py",
        ],
    ),
]


def core_files() -> set[str]:
    """Every module of the core: the package minus tools/, labs/, the __main__ entry and the torch and
    torchao internals only the tools use (_compat/torch_tools.py, _compat/torchao_tools.py)."""
    tools_only = ("__main__.py", "_compat/torch_tools.py", "_compat/torchao_tools.py")
    return {
        rel
        for p in PACKAGE.rglob("*.py")
        if (rel := p.relative_to(PACKAGE).as_posix()).split("/")[0] not in ("tools", "labs")
        and rel not in tools_only
    }


def statements(rel: str) -> int:
    """Logical lines of a core file (tokenize's NEWLINE tokens)."""
    tokens = tokenize.generate_tokens(io.StringIO((PACKAGE / rel).read_text()).readline)
    return sum(1 for t in tokens if t.type == tokenize.NEWLINE)


def table() -> str:
    rows = ["| notebook | what | files (statements) | statements |", "|---|---|---|---|"]
    for notebook, what, files in READING_ORDER:
        listed = ", ".join(f"`{f}` ({statements(f)})" for f in files)
        rows.append(f"| {notebook} | {what} | {listed} | {sum(map(statements, files)):,} |")
    every = [f for *_, files in READING_ORDER for f in files]
    total = f"**{sum(map(statements, every)):,}**"
    rows.append(f"| | **the core** | {len(every)} files | {total} |")
    return "\n".join(rows)


def readme_block(readme: str) -> str:
    return readme[readme.index(START) + len(START) : readme.index(END)].strip()


def with_table(readme: str) -> str:
    """README's text with the table between its markers replaced by today's."""
    return (
        readme[: readme.index(START) + len(START)]
        + "\n"
        + table()
        + "\n"
        + readme[readme.index(END) :]
    )


def main(argv: list[str]) -> int:
    if "--readme" in argv:
        path = PACKAGE.parent / "README.md"
        path.write_text(with_table(path.read_text()))
        print(f"updated {path}")
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
