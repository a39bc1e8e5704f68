"""Notebook 19's lab: the same model under XLA (JAX) and its SPMD partitioner, and the hardware
landscape measured against our own numbers.

    jax = host_devices(8)                      # 8 XLA devices on this CPU, as a TPU slice's 8 chips
    params = params_of(model)                  # a titanlite model's weights, as jax arrays
    logits = forward(params, tokens, model.args)   # = model(tokens), checked to 1e-5
    steps = train_steps(params, batches, args, layout="fsdp")   # losses, and XLA's collectives

XLA has no DTensor: a layout is *annotations* (a `Mesh` of devices with named axes, and for each
array a `PartitionSpec` naming which axis splits which dimension). The partitioner then decides
the collectives and writes them into the compiled program, where we read them back
(`collectives`). jax is an extra (`pip install -e '.[tpu]'`): the core never imports it.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import TitanliteError
from ..tools.measure.comm import bus_factor  # 2(n−1)/n for an all-reduce: notebook 09's counter's

# ----- eight XLA devices on the host ------------------------------------------------------------


def host_devices(n: int = 8):
    """jax with `n` host-platform devices (XLA's way to stand in for n chips, as Google's "How to
    Scale Your Model" sets up its exercises). The flag is read when jax starts its CPU backend, so
    it must be set before the first jax call in this process."""
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never look for a TPU or GPU plugin here
    try:
        import jax
    except ImportError:
        raise TitanliteError(
            "notebook 19 needs jax (CPU, about 100 MB): run  pip install -e '.[tpu]'  then restart "
            "the kernel"
        ) from None
    jax.config.update("jax_enable_x64", False)
    if len(jax.devices()) < n:
        raise TitanliteError(
            f"jax started with {len(jax.devices())} device(s), not {n}: it had started before "
            f"host_devices() set XLA_FLAGS; restart the kernel and call host_devices({n}) first"
        )
    return jax


# ----- the same model in jax.numpy --------------------------------------------------------------


def params_of(model) -> dict:
    """The model's weights as float32 jax arrays, by state-dict name (a tied output weight is the
    embedding: one array, as in torch, so training updates it once)."""
    import jax.numpy as jnp

    out = {k: jnp.asarray(v.detach().float().cpu().numpy()) for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        del out["output.weight"]
    return out


def rope_tables(args) -> tuple:
    """The rotary cos/sin tables, models/rope.py's own (constants, not weights: never trained)."""
    from ..models.rope import rope_cache

    cos, sin = rope_cache(args)
    return cos.numpy(), sin.numpy()


def rms_norm(x, weight, eps):
    import jax.numpy as jnp

    return x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


def rope(x, cos, sin):
    """models/rope.py's rotation: x·cos + roll(x, d/2)·(−sin | sin)."""
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    signed_sin = jnp.concatenate([-sin[..., :half], sin[..., half:]], axis=-1)
    return x * cos + jnp.roll(x, half, axis=-1) * signed_sin


def attention(p, prefix, x, cos, sin, args):
    """Causal grouped-query attention, written out (no fused kernel: XLA fuses what it can)."""
    import jax
    import jax.numpy as jnp

    B, T, _ = x.shape
    hd = args.head_dim

    def heads(name):  # torch's Linear computes x @ W.T; [B, T, h·hd] -> [B, h, T, hd]
        return (x @ p[f"{prefix}.{name}.weight"].T).reshape(B, T, -1, hd).transpose(0, 2, 1, 3)

    q, k, v = heads("q_proj"), heads("k_proj"), heads("v_proj")
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    groups = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(B, T, -1)
    return out @ p[f"{prefix}.o_proj.weight"].T


def feed_forward(p: dict, prefix: str, x):
    """SwiGLU: down(silu(gate(x)) · up(x))."""
    import jax

    gate = jax.nn.silu(x @ p[f"{prefix}.gate_proj.weight"].T)
    return (gate * (x @ p[f"{prefix}.up_proj.weight"].T)) @ p[f"{prefix}.down_proj.weight"].T


def forward(p: dict, tokens, args):
    """tokens [B, T] -> logits [B, T, vocab]: models/llama.py's Transformer, in jax.numpy."""

    T = tokens.shape[1]
    cos, sin = (table[:T] for table in rope_tables(args))
    h = p["tok_embeddings.weight"][tokens]
    for i in range(args.n_layers):
        b = f"layers.{i}"
        a = rms_norm(h, p[f"{b}.attention_norm.weight"], args.norm_eps)
        h = h + attention(p, f"{b}.attention", a, cos, sin, args)
        f = rms_norm(h, p[f"{b}.ffn_norm.weight"], args.norm_eps)
        h = h + feed_forward(p, f"{b}.feed_forward", f)
    h = rms_norm(h, p["norm.weight"], args.norm_eps)
    return h @ p.get("output.weight", p["tok_embeddings.weight"]).T


def loss_fn(p: dict, tokens, targets, args):
    """Mean next-token cross-entropy, as the trainer's (every target real here)."""
    import jax
    import jax.numpy as jnp

    logits = forward(p, tokens, args)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# ----- what XLA makes of it ---------------------------------------------------------------------


def compile_report(fn, *args) -> dict:
    """jit `fn`: the first call's time (trace + compile + run) against later calls', and the
    optimised HLO's op count and fusions (each fusion is one kernel XLA generated)."""
    import jax

    jitted = jax.jit(fn)
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    first = time.perf_counter() - start
    later = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        later.append(time.perf_counter() - start)
    before = jitted.lower(*args).as_text(dialect="hlo")
    after = jitted.lower(*args).compile().as_text()
    return {
        "first_call_s": first,
        "later_call_s": float(np.median(later)),
        "ops_before": _op_count(before),
        "ops_after": _op_count(after, entry_only=True),
        "fusions": len(re.findall(r"^\s*(?:ROOT )?%?\S+ = \S+ fusion\(", after, flags=re.M)),
        "hlo": after,
    }


def _op_count(hlo: str, entry_only: bool = False) -> int:
    """Instructions in the HLO module (or only its ENTRY computation: after fusion, what runs)."""
    if entry_only:
        hlo = hlo[hlo.index("ENTRY") :]
        hlo = hlo[: hlo.index("\n}\n") if "\n}\n" in hlo else len(hlo)]
    return len(re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = ", hlo, flags=re.M))


def describe_fusion(hlo: str) -> str:
    """One fused kernel of an optimised HLO module, said whole in one line: its name, its output
    shape (layout dropped), XLA's kind of fusion, how many arrays it reads, and the operations
    fused into it (from the computation it calls). The first fusion of two or more operations."""
    fusions = re.findall(
        r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) fusion\((.*?)\), kind=(\w+), calls=%?([\w.\-]+)",
        hlo,
        flags=re.M,
    )
    if not fusions:
        return "no fusion in this program"
    described = []
    for name, shape, operands, kind, called in fusions:
        body = re.search(rf"^%?{re.escape(called)} \(.*?\{{\n(.*?)^\}}", hlo, flags=re.M | re.S)
        ops = re.findall(r"= .+? ([a-z][\w\-]*)\(", body.group(1)) if body else []
        # parameters, constants and bitcasts move or name data; the rest is the kernel's work
        ops = [op for op in ops if op not in ("parameter", "constant", "bitcast")]
        ops = list(dict.fromkeys(ops))
        # operands: split at the commas outside shapes' [..] and layouts' {..}
        inputs = len(re.findall(r"[^,\[\]{}]+(?:[\[{][^\]}]*[\]}][^,\[\]{}]*)*", operands))
        shape = re.sub(r"\{[^}]*\}", "", shape)
        described.append(
            (len(ops), f"{name}: {shape}, {kind}, reads {inputs} array(s), fuses {', '.join(ops)}")
        )
    return next((text for count, text in described if count >= 2), described[0][1])


# ----- SPMD: layouts as annotations -------------------------------------------------------------

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # Megatron: split the outputs
ROW = ("o_proj", "down_proj")  # ... and split the inputs of the matmul after them


def spec_of(layout: str, name: str, shape: tuple, n: int) -> tuple:
    """The PartitionSpec (as a tuple: one mesh axis or None per dimension; () = whole on every
    device) of weight `name` of `shape`, or of the token batch (name "batch"), in `layout` on a
    mesh with axes ("data", "model") of `n` devices along the split axis: dp (weights whole,
    batch split), fsdp (2-D weights split on their first dimension too, where it divides, and
    gathered when used), tp (Megatron: column Linears split their outputs, row Linears their
    inputs; the batch whole), 2d (dp over "data" × tp over "model")."""
    if name == "batch":
        return () if layout == "tp" else ("data", None)
    kind = name.split(".")[-2] if name.count(".") >= 2 else ""
    if layout == "fsdp" and len(shape) == 2 and shape[0] % n == 0:
        return ("data", None)
    if layout in ("tp", "2d") and kind in COLUMN:
        return ("model", None)  # W [out, in]: each device a slice of the outputs
    if layout in ("tp", "2d") and kind in ROW:
        return (None, "model")  # each device a slice of the inputs: partial sums, then summed
    return ()


def layout_specs(p: dict, layout: str, n: int) -> tuple[dict, object]:
    """`spec_of` for every weight of `p` and for the batch, as jax PartitionSpecs."""
    from jax.sharding import PartitionSpec as P

    specs = {name: P(*spec_of(layout, name, w.shape, n)) for name, w in p.items()}
    return specs, P(*spec_of(layout, "batch", (), n))


def mesh_for(layout: str, n: int):
    """The device mesh a layout runs on: (n, 1) for dp/fsdp, (1, n) for tp, (2, n/2) for 2d."""
    import jax
    from jax.sharding import Mesh

    shape = {"one": (1, 1), "dp": (n, 1), "fsdp": (n, 1), "tp": (1, n), "2d": (2, n // 2)}[layout]
    devices = np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape)
    return Mesh(devices, ("data", "model"))


def sgd_step(args, lr: float):
    def step(p, x, y):
        import jax

        loss, grads = jax.value_and_grad(loss_fn)(p, x, y, args)
        return {k: w - lr * grads[k] for k, w in p.items()}, loss

    return step


def train_steps(p: dict, batches: list, args, layout: str, n: int = 8, lr: float = 0.1) -> dict:
    """A few SGD steps of the whole model with `layout` on `n` devices: the losses, and the
    collectives XLA inserted into the compiled step (read from its HLO)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = mesh_for(layout, n)
    specs, batch = layout_specs(p, layout, n) if layout != "one" else ({k: P() for k in p}, P())
    weights = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    data = NamedSharding(mesh, batch)
    step = jax.jit(
        sgd_step(args, lr),
        in_shardings=(weights, data, data),
        out_shardings=(weights, NamedSharding(mesh, P())),
    )
    p = jax.device_put(p, weights)
    hlo = step.lower(p, *[jax.device_put(t, data) for t in batches[0]]).compile().as_text()
    losses = []
    for x, y in batches:
        p, loss = step(p, jax.device_put(x, data), jax.device_put(y, data))
        losses.append(float(loss))
    return {"layout": layout, "losses": losses, "collectives": collectives(hlo), "hlo": hlo}


_COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "pred": 1}


def collectives(hlo: str) -> dict:
    """The collectives in a compiled HLO module: {op: {"calls", "bytes"}}, bytes as comm.py's
    CommCounter counts them (S: the whole tensor: an all-gather's output, a reduce-scatter's
    input = its output × the group's size, an all-reduce's tensor), summed over the module."""
    out: dict = {}
    pattern = rf"= (.+?) ({'|'.join(_COLLECTIVE_OPS)})(?:-start)?\((.*)$"
    for line in hlo.splitlines():
        m = re.search(pattern, line)
        if not m or "-done" in line:
            continue
        result, op, rest = m.groups()
        size = sum(
            _DTYPE_BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", result)
        )
        if op == "reduce-scatter":
            size *= _group_size(rest)
        entry = out.setdefault(op.replace("-", "_"), {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += size
    return out


def _group_size(attrs: str) -> int:
    """Ranks per replica group: `replica_groups={{0,1,2,3},...}` or the iota form `[2,4]<=[8]`."""
    if m := re.search(r"replica_groups=\{\{([\d,]+)\}", attrs):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs):
        return int(m.group(2))
    return 1


def ring_all_reduce_shard_map(x, n: int):
    """A data-parallel all-reduce written by hand with `shard_map`: each device holds one slice
    of `x` (its gradient); a ring of n−1 `ppermute`s passes the slices on and adds them up, the
    naive ring (notebook 07's from-scratch DDP sends 1/n of it per step: a reduce-scatter then an
    all-gather). Returns both results, the hand-written and `psum`'s, and their compiled HLO."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(local):
        total, passing = local, local
        for _ in range(n - 1):
            passing = jax.lax.ppermute(passing, "data", perm=ring)  # to the next device
            total = total + passing
        return total

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # jax < 0.6
        from jax.experimental.shard_map import shard_map
    by_hand = jax.jit(shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    library = jax.jit(
        shard_map(
            lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )
    )
    x = jnp.asarray(x)
    return {
        "by_hand": np.asarray(by_hand(x)),
        "psum": np.asarray(library(x)),
        "by_hand_hlo": by_hand.lower(x).compile().as_text(),
        "psum_hlo": library.lower(x).compile().as_text(),
    }


# ----- the same layouts in torch: DTensor's collectives, counted --------------------------------


def torch_collectives(model_args, layout: str, n: int, tokens) -> dict:
    """One forward and backward of titanlite's model with `layout` over a fake group of `n`
    ranks (no data moves: the collectives are dispatched, and counted, as on real ranks):
    notebook 09's CommCounter on the same layouts XLA partitioned."""
    import torch

    from .._compat.torch_tools import fake_process_group
    from ..distributed.fsdp import apply_fsdp
    from ..distributed.tensor_parallel import apply_tp
    from ..models.llama import build_model
    from ..tools.measure.comm import CommCounter

    if torch.distributed.is_initialized():
        raise TitanliteError("torch_collectives() starts its own fake group: call it alone")
    fake_process_group(n)
    try:
        # (replicate, shard, model): DDP is FSDP2 replicating over "data" without sharding (HSDP
        # with a shard group of one, how torch's `replicate` is built); TP splits over "model".
        shape = {"dp": (n, 1, 1), "fsdp": (1, n, 1), "tp": (1, 1, n), "2d": (2, 1, n // 2)}[layout]
        mesh = torch.distributed.device_mesh.init_device_mesh(
            "cpu", shape, mesh_dim_names=("data", "shard", "model")
        )
        model = build_model(model_args, "cpu")
        if layout in ("tp", "2d"):
            apply_tp(model, mesh["model"], sequence_parallel=False, loss_parallel=False)
        if layout != "tp":
            model = apply_fsdp(model, mesh["shard"] if layout == "fsdp" else mesh["data", "shard"])
        # FSDP2 warns that the root returns a view (the logits): nothing here writes into them.
        with CommCounter() as counter, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            logits = model(tokens)
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
            logits.float().sum().backward()
        return {
            op: {"calls": s["calls"], "bytes": s["bytes"]} for op, s in counter.summary().items()
        }
    finally:
        torch.distributed.destroy_process_group()


# ----- the hardware landscape: datasheet figures, each with its source --------------------------

_NV_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_NV_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
_NV_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_NV_HGX = "https://www.nvidia.com/en-us/data-center/hgx/"
_NV_NVL72 = "https://www.nvidia.com/en-us/data-center/gb200-nvl72/"
_AMD_300 = "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"
_AMD_325 = "https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html"
_TPU = "https://cloud.google.com/tpu/docs/{}"
_TRN2 = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trainium2.html"
_GAUDI3 = "https://www.intel.com/content/www/us/en/content-details/817486/intel-gaudi-3-ai-accelerator-white-paper.html"
_APPLE = "https://www.apple.com/macbook-pro/specs/"
_SCALING_BOOK = "https://jax-ml.github.io/scaling-book/tpus/"

# Per chip: dense (no 2:4 sparsity) peaks in TFLOP/s, memory in GB (Google prints GiB for v5p and
# Ironwood: their figure as printed), memory bandwidth and interconnect in GB/s. The interconnect
# is the vendor's per-chip figure for all its links, **both directions together** (NVIDIA's 900 GB/s
# for H100 is 450 each way; Google's "bidirectional ICI bandwidth per chip" is the same count).
# None: not published. Each row's note says what was derived from the page and how.
ACCELERATORS = [
    # name, bf16, fp8, memory GB, memory GB/s, link GB/s, link, source, note
    ("NVIDIA A100 SXM 80GB", 312, None, 80, 2039, 600, "NVLink 3", _NV_A100, ""),
    ("NVIDIA H100 SXM", 989.5, 1979, 80, 3350, 900, "NVLink 4", _NV_H100, ""),
    ("NVIDIA H200 SXM", 989.5, 1979, 141, 4800, 900, "NVLink 4", _NV_H200, ""),
    (
        "NVIDIA B200",
        2250,
        4500,
        180,
        7750,
        1800,
        "NVLink 5",
        _NV_HGX,
        "HGX B200, 8 GPUs: its figures ÷ 8, the tensor ones printed with sparsity so halved too "
        "(bf16 36 PFLOPS → 2,250; fp8 72 → 4,500); memory 1.4 TB ÷ 8 ≈ 180 GB (the part is sold "
        "as B200 180GB); bandwidth 62 TB/s ÷ 8 = 7,750 GB/s; NVLink 1.8 TB/s per GPU",
    ),
    ("AMD MI300X", 1307.4, 2614.9, 192, 5300, 896, "Infinity Fabric", _AMD_300, ""),
    ("AMD MI325X", 1307.4, 2614.9, 256, 6000, 896, "Infinity Fabric", _AMD_325, ""),
    (
        "Google TPU v5e",
        197,
        None,
        16,
        819,
        400,
        "ICI, 2-D torus",
        _TPU.format("v5e"),
        "int8 393 TOPS, no fp8 listed; ICI 400 GB/s per chip both ways (an older version of the "
        "page printed 1,600 Gbps, one way)",
    ),
    (
        "Google TPU v5p",
        459,
        459,
        95,
        2765,
        1200,
        "ICI, 3-D torus",
        _TPU.format("v5p"),
        "fp8 listed at the bf16 rate (no speed-up over bf16); ICI 1,200 GB/s per chip both ways, "
        "over its six links",
    ),
    (
        "Google TPU v6e (Trillium)",
        918,
        918,
        32,
        1638,
        800,
        "ICI, 2-D torus",
        _TPU.format("v6e"),
        "fp8 918 (listed at the bf16 rate, on Google's TPU7x page); int8 1,836 TOPS; ICI 800 GB/s "
        "per chip both ways",
    ),
    (
        "Google TPU7x (Ironwood)",
        2307,
        4614,
        192,
        7380,
        1200,
        "ICI, 3-D torus",
        _TPU.format("tpu7x"),
        "the TPU7x page's table: bf16 2,307, fp8 4,614, 192 GiB, 7,380 GB/s, ICI 1,200 GB/s per "
        "chip both ways",
    ),
    (
        "AWS Trainium2",
        667,
        1299,
        96,
        2900,
        1280,
        "NeuronLink-v3",
        _TRN2,
        "NeuronLink-v3: 1.28 TB/s per chip (AWS does not say whether that counts one direction "
        "or both: shown as printed)",
    ),
    (
        "Intel Gaudi 3",
        1835,
        1835,
        128,
        3700,
        1200,
        "24 × 200 GbE",
        _GAUDI3,
        "fp8 at the bf16 rate; 24 × 200 Gb/s = 600 GB/s each way",
    ),
    (
        "Apple M4 Max",
        None,
        None,
        128,
        546,
        None,
        "none (one chip)",
        _APPLE,
        "memory and its bandwidth only: Apple publishes no TFLOP/s",
    ),
]
FIELDS = (
    "name",
    "bf16_tflops",
    "fp8_tflops",
    "memory_gb",
    "memory_gbps",
    "link_gbps",
    "link",
    "source",
    "note",
)


def accelerators() -> list[dict]:
    """ACCELERATORS as dicts, with each chip's ridge point (FLOPs per byte) in bf16: derived from
    two datasheet figures, so a prediction, not a measurement."""
    rows = []
    for row in ACCELERATORS:
        r = dict(zip(FIELDS, row))
        r["ridge_bf16"] = ridge(r["bf16_tflops"], r["memory_gbps"])
        rows.append(r)
    return rows


def ridge(tflops: float | None, gbps: float | None) -> float | None:
    """The roofline's ridge point: FLOPs per byte above which the peak, not memory, bounds a
    kernel (peak / bandwidth)."""
    return tflops * 1e12 / (gbps * 1e9) if tflops and gbps else None


_VENDOR_COLOURS = {
    "NVIDIA": "tab:green",
    "AMD": "tab:red",
    "Google": "tab:blue",
    "AWS": "tab:orange",
    "Intel": "tab:purple",
    "Apple": "tab:gray",
}
_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))


def roof_styles(names: list[str]) -> dict:
    """{name: (colour, linestyle)}: one colour per vendor (the name's first word), its chips told
    apart by line style, so no two roofs are drawn alike (matplotlib's default cycle repeats
    after ten lines)."""
    seen: dict[str, int] = {}
    styles = {}
    for name in names:
        vendor = name.split()[0]
        k = seen.get(vendor, 0)
        seen[vendor] = k + 1
        styles[name] = (_VENDOR_COLOURS.get(vendor, "tab:brown"), _LINESTYLES[k % len(_LINESTYLES)])
    return styles


def duration(seconds: float) -> str:
    """A time with three significant figures in the unit that keeps it readable: '17.6 ms',
    '179 s', '12.0 µs' (not '178726.41 ms')."""
    if seconds <= 0:
        return f"{seconds:g} s"
    seconds = float(f"{seconds:.3g}")  # rounded first: 0.9999996 s is "1.00 s", not "1,000 ms"
    units = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))
    unit, scale = next(((u, s) for u, s in units if seconds >= s), units[-1])
    value = seconds / scale
    decimals = max(0, 2 - int(np.floor(np.log10(value))))
    return f"{value:,.{decimals}f} {unit}"


def step_cost(model_args, batch: int, seq_len: int, weight_bytes: int = 2) -> dict:
    """One training step's FLOPs (the trainer's count: 6·N per token plus attention) and a stated
    model of its memory traffic, **predicted, not measured**: each weight read three times (forward,
    the two backward matmuls) in `weight_bytes`, the fp32 gradient written and read, AdamW reading
    the fp32 weight, gradient and both moments and writing back three of them; the activations
    the backward needs written once and read once."""
    from ..models.llama import count
    from ..tools.predict.activation_memory import activation_memory_estimate

    flops_per_token, n = count(model_args, seq_len)
    tokens = batch * seq_len
    activations = activation_memory_estimate(model_args, batch, seq_len, weight_bytes, "none")
    traffic = n * (3 * weight_bytes + 2 * 4 + 7 * 4) + 2 * activations
    return {"flops": flops_per_token * tokens, "bytes": traffic, "params": n, "tokens": tokens}


def predicted_step(cost: dict, tflops: float | None, gbps: float | None) -> dict | None:
    """The roofline's bound for a whole step on one chip, **predicted**: time ≥ max(FLOPs/peak,
    bytes/bandwidth); the MFU bound is the compute time over that."""
    if not tflops or not gbps:
        return None
    compute = cost["flops"] / (tflops * 1e12)
    memory = cost["bytes"] / (gbps * 1e9)
    time_s = max(compute, memory)
    return {
        "time_s": time_s,
        "mfu_bound": compute / time_s,
        "bound": "compute" if compute >= memory else "memory",
    }


# ----- the wires: all-reduce measured, an α–β model fitted ---------------------------------------


def bus_bandwidth(nbytes: int, seconds: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: algbw = S / t, busbw = algbw · 2(n−1)/n (what
    each rank's link carried, comparable across n)."""
    return nbytes / seconds * bus_factor("all_reduce", n)


def all_reduce_times(sizes: list[int], reps: int = 5) -> list[dict]:
    """Run on every rank of a job (launch_function): the median time of an all-reduce of each
    size (bytes of float32), the slowest rank's (an all-reduce ends when the last rank has it)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    rows = []
    for size in sizes:
        x = torch.ones(max(1, size // 4))
        dist.all_reduce(x)  # warm-up: the first call sets up buffers
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        t = torch.tensor([float(np.median(times))], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append({"ranks": n, "bytes": x.numel() * 4, "seconds": t.item()})
    for r in rows:
        r["busbw"] = bus_bandwidth(r["bytes"], r["seconds"], n)
    return rows


def fit_alpha_beta(rows: list[dict]) -> dict:
    """Fit the ring all-reduce model t = 2(n−1)·α + 2(n−1)/n · S / B to measured `rows` of one n:
    α the latency of one step of the ring, B the link's bandwidth (bytes/s). Least squares in
    *relative* error (times span orders of magnitude: plain least squares would fit only the
    largest messages), with α, 1/B ≥ 0 (a negative one is fitted as 0 and the other refitted)."""
    n = rows[0]["ranks"]
    x = np.array([r["bytes"] for r in rows], dtype=float) * bus_factor("all_reduce", n)
    t = np.array([r["seconds"] for r in rows])
    design = np.stack([np.ones_like(x), x], axis=1) / t[:, None]  # each row divided by its t
    (intercept, slope), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if slope <= 0:  # no bandwidth term: all latency
        intercept, slope = float(np.mean(t)), 0.0
    elif intercept < 0:  # no latency term: the slope alone, in relative error
        intercept, slope = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    predicted = intercept + slope * x
    return {
        "ranks": n,
        "alpha_s": float(intercept / (2 * (n - 1))),
        "bandwidth": 1 / slope if slope > 0 else float("inf"),
        "worst_error": float(np.max(np.abs(predicted - t) / t)),
    }


def ring_all_reduce_time(nbytes: float, n: int, alpha_s: float, bandwidth: float) -> float:
    """The α–β model's ring all-reduce: 2(n−1) steps, each one latency and S/n bytes."""
    return 2 * (n - 1) * alpha_s + bus_factor("all_reduce", n) * nbytes / bandwidth


def alpha_beta_check(rows: list[dict], fit: dict) -> dict:
    """What the fitted α–β model does and does not account for in the measured `rows`:

    - `log_rms`: its typical miss, the root-mean-square of log(predicted / measured), a measure
      it was *not* fitted in, beside the same for each of its terms alone, each at its best
      (latency only: one constant time; bandwidth only: time ∝ S): if the model explains the
      curve's two regimes it must beat both;
    - `knee_bytes`: the message size n·α·B where its two terms are equal (latency below it,
      bandwidth above); inside the measured sizes when both regimes were measured;
    - `median_miss`, `worst_miss`: |predicted − measured| / measured;
    - `busbw_peak_bytes`, `busbw_drop`: where the measured bus bandwidth is highest, and how much
      lower it is at the largest message. The model's busbw only rises with S: a drop (messages
      leaving the CPU's caches) is what it cannot describe."""
    n = fit["ranks"]
    size = np.array([r["bytes"] for r in rows], dtype=float)
    t = np.array([r["seconds"] for r in rows])
    predicted = np.array(
        [ring_all_reduce_time(s, n, fit["alpha_s"], fit["bandwidth"]) for s in size]
    )
    miss = np.abs(predicted - t) / t
    busbw = np.array([r["busbw"] for r in rows])
    return {
        "log_rms": float(np.sqrt(np.mean(np.log(predicted / t) ** 2))),
        "log_rms_latency_only": float(np.std(np.log(t))),
        "log_rms_bandwidth_only": float(np.std(np.log(t) - np.log(size))),
        "knee_bytes": n * fit["alpha_s"] * fit["bandwidth"],
        "median_miss": float(np.median(miss)),
        "worst_miss": float(np.max(miss)),
        "busbw_peak_bytes": int(size[np.argmax(busbw)]),
        "busbw_drop": float(1 - busbw[-1] / busbw.max()),
    }


def torus_all_reduce_time(nbytes: float, axes: tuple, alpha_s: float, bandwidth: float) -> float:
    """The α–β model on a torus, axis by axis: a ring reduce-scatter along each axis in turn (the
    data left to reduce shrinks by that axis's length each time), then all-gathers back the same
    way. `bandwidth` is what one chip sends along one axis. One axis is the plain ring."""
    t, left = 0.0, float(nbytes)
    for k in axes:
        t += (k - 1) * alpha_s + (k - 1) / k * left / bandwidth
        left /= k
    return 2 * t


@dataclass(frozen=True)
class Link:
    """An interconnect for the all-reduce prediction. `bandwidth`: bytes/s one rank sends per ring
    step (one direction); `alpha_s`: an assumed latency per step (no datasheet prints one: an order
    of magnitude); `max_ranks`: the most ranks the link joins (None: a network, no limit); `torus`:
    for a torus, the slice shape (axis lengths) used at each n, and only those n are predicted."""

    name: str
    alpha_s: float
    bandwidth: float
    max_ranks: int | None
    source: str
    torus: dict | None = None

    def all_reduce_time(self, nbytes: float, n: int) -> float | None:
        """The α–β model's all-reduce of `nbytes` over `n` ranks, or None where this link does
        not join n ranks."""
        if self.torus is not None:
            axes = self.torus.get(n)
            if axes is None:
                return None
            return torus_all_reduce_time(nbytes, axes, self.alpha_s, self.bandwidth)
        if self.max_ranks is not None and n > self.max_ranks:
            return None
        return ring_all_reduce_time(nbytes, n, self.alpha_s, self.bandwidth)


# One direction per GPU/chip, from the table's both-ways figures (halved). A ring all-reduce along
# one torus axis uses only that axis's two links: each ~90 GB/s one way on v5p (scaling-book,
# "How to Think About TPUs"), 180 GB/s with the ring run both ways round its wrap-around, which a
# slice has only on an axis of whole 4×4×4 cubes. Google's 1,200 GB/s counts all six links both
# ways; the axes one after the other, as modelled, never use more than one axis's pair at a time.
LINKS = [
    Link(
        "NVLink 4 / NVSwitch, HGX H100",
        1e-6,
        450e9,
        8,
        _NV_H100 + " (900 GB/s both ways; 8 GPUs in an HGX H100's NVLink domain)",
    ),
    Link(
        "NVLink 5 / NVSwitch, GB200 NVL72",
        1e-6,
        900e9,
        72,
        _NV_NVL72 + " (72 GPUs in one NVLink domain, 1.8 TB/s per GPU both ways)",
    ),
    Link(
        "PCIe Gen5 x16, inside one host",
        3e-6,
        64e9,
        8,
        "PCI-SIG PCIe 5.0: 32 GT/s × 16 lanes ≈ 64 GB/s each way; PCIe stays in its host (8 GPUs)",
    ),
    Link(
        "InfiniBand NDR, one 400G NIC per GPU",
        5e-6,
        50e9,
        None,
        "NVIDIA ConnectX-7: 400 Gb/s each way (InfiniBand NDR, or 400G RoCE)",
    ),
    Link(
        "TPU v5p ICI, torus axis by axis",
        1e-6,
        2 * 90e9,
        None,
        f"{_SCALING_BOOK} (~90 GB/s one way per link; a ring both ways round an axis's "
        f"wrap-around: 180 GB/s) and {_TPU.format('v5p')} (1,200 GB/s per chip, all six links "
        f"both ways). n = 8: one axis of 8; 64: a 4×4×4 cube; 512: 8×8×8",
        torus={8: (8,), 64: (4, 4, 4), 512: (8, 8, 8)},
    ),
]
