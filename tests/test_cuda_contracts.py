"""The private aten ops the trainer calls on CUDA, run on fake CUDA tensors under a contract.

From scratch teaches; on CUDA the trainer runs what torch runs on CUDA. Where it calls a private aten
op itself (context parallel's flash and memory-efficient attention blocks and their backwards, the
experts' grouped GEMM, expert parallel's all-to-all), this CPU build of torch can only run the op's
meta kernel, which checks almost none of what the CUDA kernel enforces or silently relies on. The
`Contract` below checks each call against those preconditions, each cited to torch 2.13's source:

  FA   aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp: mha_fwd, mha_bwd,
       mha_varlen_bwd
  AB   aten/src/ATen/native/transformers/cuda/attention_backward.cu: _flash_attention_backward,
       _efficient_attention_backward
  EF   aten/src/ATen/native/transformers/cuda/attention.cu: _efficient_attention_forward;
       mem_eff_attention/kernels/cutlassF.h and cutlassB.h (dtype × capability);
       mem_eff_attention/kernel_backward.h: check_supported (the log-sum-exp's strides)
  SDP  aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: check_flash_attention_hardware_support,
       check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89, check_head_dim_size_mem_efficient
  GMM  aten/src/ATen/native/GroupedMMUtils.h: _grouped_mm_validate_inputs,
       check_valid_strides_and_return_transposed, _grouped_mm_fallback (offs.cpu(): a host wait);
       aten/src/ATen/native/cuda/GroupedBlas.cpp: _grouped_mm_cuda (fast path: SM 9.x, 10.x, bf16)
  NCCL torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: check_gpu_single_tensor, alltoall_base;
       c10d/Utils.hpp: checkSplitSizes
  RING torch/distributed/tensor/experimental/_context_parallel/_attention.py (installed 2.13):
       how torch's own ring attention calls these ops (K/V contiguous, the log-sum-exp made
       contiguous, cum_seq and the rng state passed as the forward returned them)

Each test below also re-makes a call the trainer once made, and shows the contract refusing it."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

from titanlite._compat.torch_tools import FakeTensorMode, TorchDispatchMode

aten = torch.ops.aten
H100, A100, RTX4090, T4 = (9, 0), (8, 0), (8, 9), (7, 5)
B200, RTX5090, MI300X = (10, 0), (12, 0), (9, 4)  # MI300X under ROCm reports 9.4


class Broken(AssertionError):
    """A call torch's CUDA kernel would refuse, or read wrongly."""


def need(condition: bool, rule: str) -> None:
    if not condition:
        raise Broken(rule)


def _named(func, args, kwargs) -> dict:
    """The call's arguments by their schema names, defaults filled in (the dispatcher drops
    trailing arguments equal to their defaults, is_causal=False among them)."""
    schema = func._schema.arguments
    defaults = {a.name: a.default_value for a in schema if a.has_default_value()}
    return {**defaults, **dict(zip([a.name for a in schema], args)), **kwargs}


def _on_cuda(*tensors) -> bool:
    return all(t.device.type == "cuda" for t in tensors if isinstance(t, torch.Tensor))


def _flash_common(a: dict, capability, rocm: bool, backward: bool) -> None:
    q, k, v = a["query"], a["key"], a["value"]
    need(not rocm and (8, 0) <= capability <= (12, 1), "SDP: flash runs on NVIDIA sm80..sm121")
    need(_on_cuda(q, k, v), "FA: q, k, v must be on CUDA")
    need(q.dtype in (torch.float16, torch.bfloat16), "FA: fp16 and bf16 only")
    need(k.dtype == v.dtype == q.dtype, "FA: query, key and value must have the same dtype")
    need(all(t.stride(-1) == 1 for t in (q, k, v)), "FA: contiguous last dimension")
    D = q.shape[-1]
    need(D % 8 == 0 and D <= 256, "FA: head_size a multiple of 8, at most 256")
    need(q.shape[1] % k.shape[1] == 0, "FA: key/value heads must divide query heads")
    need(k.shape == v.shape, "FA: k and v of one shape")
    need(not a.get("is_causal") or q.shape[2] == k.shape[2], "SDP: causal needs Tq == Tk")
    if backward and ((8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)):
        need(not 192 < D <= 224, "SDP: no flash training with 192 < head_dim <= 224 on sm86-89")


def flash_forward(a, capability, rocm):
    _flash_common(a, capability, rocm, backward=False)


def flash_backward(a, capability, rocm):
    _flash_common(a, capability, rocm, backward=True)
    q, lse = a["query"], a["logsumexp"]
    need(
        a["cum_seq_q"] is None and a["cum_seq_k"] is None,
        "AB: a defined cum_seq (even torch.empty(0)) takes mha_varlen_bwd, which wants int32 "
        "offsets and packed 3-D inputs: pass the forward's own, None",
    )
    need(lse.dtype == torch.float32, "FA: softmax_lse is read as fp32")
    need(tuple(lse.shape) == tuple(q.shape[:3]), "FA: softmax_lse is [B, H, Tq]")
    need(
        lse.is_contiguous(),
        "FA/RING: mha_bwd reads softmax_lse through its data pointer as a contiguous [B, H, Tq], "
        "unchecked ('Need to make logsumexp contiguous, otherwise there will be numerical error')",
    )
    for name in ("out", "grad_out"):
        need(a[name].dtype == q.dtype and a[name].stride(-1) == 1, f"FA: {name} like q")
    need(a["max_q"] == q.shape[2] and a["max_k"] == a["key"].shape[2], "AB: max_q, max_k")
    seed, offset = a["philox_seed"], a["philox_offset"]
    need(
        seed.dtype == torch.uint64 and tuple(seed.shape) == (2,) and offset.dtype == torch.uint64,
        "FA: philox_seed/offset as the forward returned them (rng_state uint64[2], unused)",
    )


def _efficient_common(a, capability, rocm):
    q, k, v = a["query"], a["key"], a["value"]
    need(not rocm and (5, 0) <= capability <= (12, 1), "SDP: efficient runs on NVIDIA sm50..121")
    need(_on_cuda(q, k, v), "EF: q, k, v must be CUDA tensors")
    bf16_ok = capability >= (8, 0)
    need(
        q.dtype in (torch.float16, torch.float32) or (q.dtype == torch.bfloat16 and bf16_ok),
        "EF: cutlassF/B: fp16, fp32 on sm50+, bf16 on sm80+ (else 'no kernel found to launch')",
    )
    need(k.dtype == v.dtype == q.dtype, "EF: one dtype")
    need(q.shape[1] == k.shape[1] == v.shape[1], "EF: same heads: no native GQA in 2.13")
    need(all(t.stride(-1) == 1 for t in (q, k, v)), "EF: last dimension must be contiguous")
    if capability >= (8, 0):
        alignment = 4 if q.dtype == torch.float32 else 8
    else:
        alignment = 1 if q.dtype == torch.float32 else 8
    need(q.shape[-1] % alignment == 0, "SDP: head_dim divisible by the kernel's alignment")
    need(a.get("attn_bias") is None, "EF: no bias here")


def efficient_forward(a, capability, rocm):
    _efficient_common(a, capability, rocm)
    need(a["compute_log_sumexp"], "RING: CP merges by the log-sum-exp: compute_log_sumexp=True")


def efficient_backward(a, capability, rocm):
    _efficient_common(a, capability, rocm)
    q, lse = a["query"], a["logsumexp"]
    B, H, T = q.shape[:3]
    need(lse.dtype == torch.float32, "EF: the log-sum-exp is read as fp32, unchecked")
    need(
        tuple(lse.shape) == (B, H, math.ceil(T / 32) * 32),
        "EF: the forward's log-sum-exp, padded to a multiple of 32 rows, which the backward reads",
    )
    need(lse.stride(-1) == 1, "EF: last-dim stride 1 assumed")
    need(H <= 1 or lse.stride(1) % 8 == 0, "EF: 'LSE is not correctly aligned (strideH)'")
    need(B <= 1 or lse.stride(0) % 8 == 0, "EF: 'LSE is not correctly aligned (strideB)'")
    need(list(a["grad_input_mask"])[3] is False, "EF: no bias gradient without a bias")
    for name in ("philox_seed", "philox_offset"):
        t = a[name]
        need(t.dtype == torch.int64 and t.dim() == 0, f"EF: {name} as the forward returned it")


def _strides_ok(t: torch.Tensor) -> bool:
    step = 16 // t.element_size()
    if t.stride(-1) == 1:
        return t.stride(-2) >= max(1, t.shape[-1]) and t.stride(-2) % step == 0
    return t.stride(-2) == 1 and t.stride(-1) >= max(1, t.shape[-2]) and t.stride(-1) % step == 0


def grouped_mm(a, capability, rocm):
    x, w, offs = a["self"], a["mat2"], a["offs"]
    need(
        not rocm and capability[0] in (9, 10),
        "GMM: only SM 9.x/10.x run the grouped kernel; elsewhere _grouped_mm_fallback reads "
        "offs on the host (offs.cpu(), .item() per group): a wait per call",
    )
    need(x.dtype == w.dtype == torch.bfloat16, "GMM: the fast path is bf16 in and out")
    need(_on_cuda(x, w, offs), "GMM: offs is read on the device by the fast path")
    need(offs is not None and offs.dim() == 1 and offs.dtype == torch.int32, "GMM: offs int32 1-D")
    need(x.dim() == 2 and w.dim() == 3 and x.shape[-1] == w.shape[-2], "GMM: 2d x 3d, contraction")
    need(offs.shape[0] == w.shape[0] < 1024, "GMM: one end per group, fewer than 1024 groups")
    need(_strides_ok(x) and _strides_ok(w), "GMM: 'strides should be multiple of 16 bytes'")


def all_to_all(a, capability, rocm, group_size):
    t = a["input"]
    need(
        t.device.type == "cuda" and t.layout == torch.strided,
        "NCCL: 'Tensors must be CUDA and dense'",
    )
    for name, rows in (("input_split_sizes", t.shape[0]), ("output_split_sizes", None)):
        sizes = a[name]
        if sizes is None or len(sizes) == 0:
            need(t.shape[0] % group_size == 0, "NCCL: dim 0 must divide equally across the group")
            continue
        need(all(isinstance(s, int) for s in sizes), f"NCCL: {name}: host integers")
        need(len(sizes) == group_size, "NCCL: 'Number of tensor splits not equal to group size'")
        need(rows is None or sum(sizes) == rows, "NCCL: 'Split sizes doesn't match total dim 0'")


def same_device_index(a, capability, rocm):
    tensors = [a.get("self"), a.get("index"), a.get("source")]
    tensors += [i for i in (a.get("indices") or []) if isinstance(i, torch.Tensor)]
    need(
        len({t.device for t in tensors if isinstance(t, torch.Tensor)}) == 1,
        "indices on the device of what they index: a host index is copied up on every call, "
        "and index_copy_ refuses one",
    )


class Contract(TorchDispatchMode):
    """Checks each call of the ops it knows, as a GPU with `capability` (ROCm if `rocm`) would."""

    def __init__(self, capability, rocm=False, group_size=1):
        super().__init__()
        self.capability, self.rocm, self.group_size, self.calls = capability, rocm, group_size, []
        self.rules = {
            aten._scaled_dot_product_flash_attention.default: flash_forward,
            aten._scaled_dot_product_flash_attention_backward.default: flash_backward,
            aten._scaled_dot_product_efficient_attention.default: efficient_forward,
            aten._scaled_dot_product_efficient_attention_backward.default: efficient_backward,
            aten._grouped_mm.default: grouped_mm,
            aten.index.Tensor: same_device_index,
            aten.index_copy.default: same_device_index,
            torch.ops._c10d_functional.all_to_all_single.default: lambda a, c, r: all_to_all(
                a, c, r, self.group_size
            ),
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.rules:
            named = _named(func, args, kwargs)
            self.rules[func](named, self.capability, self.rocm)
            self.calls.append((func.__name__, named))
        return func(*args, **kwargs)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def _getitem(t: torch.Tensor, key):
    """Python indexing through the dispatcher's own ops (narrow, select, aten.index): a CPU build
    of torch cannot index a fake CUDA tensor from Python (its indexing sets a CUDA device guard
    first, as `.contiguous()` does), while the ops it stands for run fine under FakeTensorMode."""
    key = key if isinstance(key, tuple) else (key,)
    if Ellipsis in key:
        at = key.index(Ellipsis)
        rest = len(key) - 1 - sum(k is None for k in key)
        key = key[:at] + (slice(None),) * (t.dim() - rest) + key[at + 1 :]
    dim = 0
    for k in key:
        if k is None:
            t, dim = t.unsqueeze(dim), dim + 1
        elif isinstance(k, int):
            t = t.select(dim, k)
        elif isinstance(k, slice):
            start, stop, step = k.indices(t.shape[dim])
            assert step == 1, "strided slices are not needed here"
            t, dim = t.narrow(dim, start, stop - start), dim + 1
        else:
            t, dim = aten.index.Tensor(t, [None] * dim + [k]), dim + 1
    return t


def _to(t: torch.Tensor, *args, **kwargs):
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    device, dtype = device or t.device, dtype or t.dtype
    if device == t.device and dtype == t.dtype:
        return t
    return aten._to_copy.default(t, dtype=dtype, device=device, non_blocking=non_blocking)


@pytest.fixture
def gpu(monkeypatch):
    """`gpu(capability, rocm=False)`: this process sees one such GPU; returns a FakeTensorMode
    in which CUDA tensors have shapes, dtypes and strides but no bytes."""
    from torch._subclasses.fake_tensor import FakeTensor

    monkeypatch.setattr(FakeTensor, "__getitem__", _getitem, raising=False)
    monkeypatch.setattr(
        FakeTensor, "__setitem__", lambda t, k, v: aten.copy_(_getitem(t, k), v), raising=False
    )
    # .to() and .contiguous() set a device guard too; what they do is a copy, or nothing
    monkeypatch.setattr(FakeTensor, "to", _to, raising=False)
    monkeypatch.setattr(
        FakeTensor,
        "contiguous",
        lambda t, memory_format=torch.contiguous_format: (
            t
            if t.is_contiguous(memory_format=memory_format)
            else t.clone(memory_format=memory_format)
        ),
        raising=False,
    )

    def make(capability, rocm=False):
        props = SimpleNamespace(major=capability[0], minor=capability[1], name="virtual")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.version, "hip", "6.4" if rocm else None)
        return FakeTensorMode(allow_non_fake_inputs=True)

    return make


# ----- context parallel: each block's kernel, forward and backward ---------------------------


def _cp_attention(fake, contract, dtype, head_dim, layout="zigzag", heads=(8, 2)):
    """ContextAttention forward and backward on one rank (a group of one), fake CUDA tensors."""
    from titanlite.distributed.context_parallel import ContextAttention, ContextParallel

    with fake:
        q = torch.randn(2, heads[0], 64, head_dim, device="cuda", dtype=dtype)
        k, v = (torch.randn(2, heads[1], 64, head_dim, device="cuda", dtype=dtype) for _ in "kv")
        cp, ctx = ContextParallel(None, 1, 0, layout), SimpleNamespace()
        ctx.save_for_backward = lambda *t: setattr(ctx, "saved_tensors", t)
        with contract:
            out = ContextAttention.forward(ctx, q, k, v, cp)
            grads = ContextAttention.backward(ctx, torch.randn_like(out))
    return out, grads, ctx.kind


@pytest.mark.parametrize(
    "capability, dtype, head_dim, rocm, kernel",
    [
        (H100, torch.bfloat16, 64, False, "cuda_flash"),
        (A100, torch.float16, 128, False, "cuda_flash"),
        (RTX4090, torch.bfloat16, 256, False, "cuda_flash"),  # > 224: sm89 trains it
        (RTX4090, torch.bfloat16, 208, False, "cuda_efficient"),  # (192, 224]: not on sm89
        (A100, torch.float32, 64, False, "cuda_efficient"),  # flash takes no fp32
        (T4, torch.float16, 64, False, "cuda_efficient"),  # no flash before sm80
        (H100, torch.float32, 36, False, "cuda_efficient"),  # fp32 rows: 4-aligned
        (H100, torch.bfloat16, 36, False, "math"),  # bf16 rows of 36 align for neither kernel
        (MI300X, torch.bfloat16, 64, True, "math"),
    ],
)
def test_every_cp_block_call_keeps_torchs_cuda_contract(
    gpu, capability, dtype, head_dim, rocm, kernel
):
    contract = Contract(capability, rocm)
    out, (dq, dk, dv, _), chosen = _cp_attention(gpu(capability, rocm), contract, dtype, head_dim)
    assert chosen == kernel
    assert dq.dtype == dk.dtype == dv.dtype == dtype and dk.shape == (2, 2, 64, head_dim)
    fused = [n for n in contract.names() if "dot_product" in n]
    if kernel == "math":
        assert fused == []
        return
    forward = [a for n, a in contract.calls if "dot_product" in n and "backward" not in n]
    backward = [a for n, a in contract.calls if "backward" in n]
    # zig-zag on one rank: three blocks (chunk 0 on itself, 1 on 0, 1 on itself), each computed
    # once forward and once backward, with the same causal flag both ways
    assert [a["is_causal"] for a in forward] == [True, False, True]
    assert [a["is_causal"] for a in backward] == [True, False, True]
    # GQA: flash takes the 2 K/V heads as they are; the efficient kernel gets them repeated
    heads = {a["key"].shape[1] for a in forward + backward}
    assert heads == ({2} if kernel == "cuda_flash" else {8})


def test_the_contract_refuses_the_calls_the_cp_backward_once_made(gpu):
    """Re-made as the trainer made them before: cum_seq_q/k as torch.empty(0), and a zig-zag
    slice of the merged log-sum-exp handed over as it is (strided): both refused."""
    fake, contract = gpu(H100), Contract(H100)
    with fake:
        q = torch.randn(2, 8, 64, 64, device="cuda", dtype=torch.bfloat16)
        k = v = torch.randn(2, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
        out, lse, *_, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        merged = torch.randn(2, 8, 128, device="cuda")  # this rank's two chunks
        right = dict(scale=0.125)
        with contract:  # the right call passes
            aten._scaled_dot_product_flash_attention_backward(
                out, q, k, v, out, lse, None, None, 64, 64, 0.0, True, seed, offset, **right
            )
        empty = torch.empty(0, device="cuda")
        with pytest.raises(Broken, match="defined cum_seq"), contract:
            aten._scaled_dot_product_flash_attention_backward(
                out, q, k, v, out, lse, empty, empty, 64, 64, 0.0, True, seed, offset, **right
            )
        strided = merged[:, :, 64:]  # a zig-zag rank's second chunk
        assert not strided.is_contiguous()
        with pytest.raises(Broken, match="contiguous"), contract:
            aten._scaled_dot_product_flash_attention_backward(
                out, q, k, v, out, strided, None, None, 64, 64, 0.0, True, seed, offset, **right
            )


def test_the_cp_kernel_is_decided_from_the_gpus_capability_when_the_trainer_builds_it(gpu):
    """apply_cp decides the kernel once, from the device's facts: an H100 in bf16 gets flash (a
    kernel chosen without the capability would be math), fp32 the efficient kernel."""
    from titanlite.distributed.context_parallel import apply_cp
    from titanlite.models.llama import ModelArgs, Transformer

    gpu(H100)
    mesh = SimpleNamespace(get_group=lambda: None, size=lambda: 1, get_local_rank=lambda: 0)
    with torch.device("meta"):
        model = Transformer(ModelArgs.preset("debug"))
    cuda = torch.device("cuda", 0)
    assert apply_cp(model, mesh, device=cuda, dtype=torch.bfloat16).kernel == "cuda_flash"
    assert model.layers["0"].attention.context_parallel.kernel == "cuda_flash"
    assert apply_cp(model, mesh, device=cuda, dtype=torch.float32).kernel == "cuda_efficient"


# ----- the experts' grouped GEMM, and expert parallel's exchange --------------------------------


@contextlib.contextmanager
def _default_dtype(dtype):  # fake parameters are made in their dtype (Module.to cannot swap them)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize(
    "capability, rocm, grouped",
    [(H100, False, True), (B200, False, True), (A100, False, False), (RTX5090, False, False)]
    + [(MI300X, True, False)],
)
def test_the_experts_call_the_grouped_gemm_only_where_torch_runs_its_kernel(
    gpu, capability, rocm, grouped
):
    """A bf16 MoE layer's experts on fake CUDA rows: on SM 9.x/10.x the grouped GEMM, its call
    within torch's contract (int32 ends on the device, 16-byte rows); elsewhere the loop, which
    needs the group sizes on the host (refused here: fake tensors hold no values, as a GPU's
    tensors are not on the host)."""
    from titanlite.models.moe import Experts

    fake, contract = gpu(capability, rocm), Contract(capability, rocm)
    with fake:
        with torch.device("cuda"), _default_dtype(torch.bfloat16):
            experts = Experts(4, 64, 96)
        x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
        counts = torch.tensor([10, 10, 20, 0]).to("cuda")  # 40 rows, expert 3 gets none
        # no autograd: its engine would look for a CUDA stream this build does not have
        with contract, torch.no_grad():
            if grouped:
                out = experts(x, counts)
                assert out.shape == (40, 64) and contract.names() == ["_grouped_mm.default"] * 3
            else:
                with pytest.raises(DataDependentOutputException):  # a host read: a wait
                    experts(x, counts)
                assert "_grouped_mm.default" not in contract.names()


def test_expert_parallel_sends_device_tensors_and_indexes_with_device_indices(gpu, monkeypatch):
    """Expert parallel on 2 fake ranks, fake CUDA tokens: its count exchange and token exchanges
    send CUDA tensors with host-integer split sizes (NCCL), and the index that regroups arrived
    rows by expert is on the device. The one host read (the split sizes) is answered with a
    table that adds up, as the device would answer it."""
    import torch.distributed as dist

    from titanlite._compat.torch_tools import fake_process_group
    from titanlite.distributed.expert_parallel import ExpertDispatch
    from titanlite.models.moe import Experts

    class TwoOfFour(torch.nn.Module):  # this rank's 2 experts of 4 (a DTensor's shape: all 4)
        def __init__(self):
            super().__init__()
            self.local = Experts(2, 64, 96)
            self.w_gate = SimpleNamespace(shape=(4, 96, 64))

        def forward(self, x, counts, sizes=None):
            return self.local(x, counts, sizes)

    fake, contract = gpu(H100), Contract(H100, group_size=2)
    # [2 ranks sent + 2 ranks received][2 local experts], 16 choices each way
    monkeypatch.setattr(torch._subclasses.FakeTensor, "tolist", lambda t: [[4, 4]] * 4)
    fake_process_group(2)
    try:
        with fake:
            with torch.device("cuda"), _default_dtype(torch.bfloat16):
                experts = TwoOfFour()
            tokens = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
            weights = torch.rand(8, 2, device="cuda")
            chosen = torch.randint(0, 4, (8, 2), device="cuda")
            with contract, torch.no_grad():
                out = ExpertDispatch(dist.group.WORLD, 2)(tokens, weights, chosen, experts)
        assert out.shape == tokens.shape
        assert contract.names().count("all_to_all_single.default") == 3  # counts, out, back
        assert "index.Tensor" in contract.names() and "index_copy.default" in contract.names()
    finally:
        dist.destroy_process_group()
