"""titanlite.tools.probe.cpu, titanlite.tools.probe.mps and titanlite.tools.measure.data_loading: facts about the host, measured."""

import pytest
import torch

import titanlite
from titanlite.tools.measure.data_loading import TokenizingDataset, host_to_device_gbps, loader_rate
from titanlite.tools.probe import cpu, mps


def _features(flags, cores=8):
    return cpu.CpuFeatures(
        capability="AVX512",
        flags=None if flags is None else frozenset(flags),
        cores=cores,
        threads=cores,
    )


def test_native_bf16_follows_the_flags_of_other_cpus():
    assert _features({"avx2", "avx512f"}).native_bf16 is False  # Skylake-SP
    assert _features({"avx512f", "avx512_bf16"}).native_bf16 is True  # Zen 4, Cooper Lake
    sapphire = _features({"avx512_bf16", "amx_bf16", "amx_tile"})
    assert sapphire.native_bf16 and sapphire.amx
    # Apple Silicon: unreadable
    assert _features(None).native_bf16 is None and not _features(None).amx


def test_bf16_verdict_is_a_function_of_the_measured_ratio():
    zen4 = _features({"avx512_bf16"})
    assert cpu.bf16_verdict(4.0, zen4).startswith("fast native bf16")
    assert cpu.bf16_verdict(0.1, _features({"avx2"})).startswith("slow bf16")
    assert cpu.bf16_verdict(1.1, zen4).startswith("bf16 about as fast")
    # less noise, finer verdict
    assert cpu.bf16_verdict(1.1, zen4, spread=0.05).startswith("fast native")
    assert "unknown" in cpu.bf16_verdict(1.0, _features(None))


def test_features_of_this_machine():
    f = cpu.cpu_features()
    assert f.capability == torch.backends.cpu.get_cpu_capability()
    assert (
        1 <= f.cores <= (__import__("os").cpu_count() or 1) and f.threads == torch.get_num_threads()
    )


def test_num_threads_restores_and_refuses_zero():
    before = torch.get_num_threads()
    with cpu.num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(titanlite.TitanliteError, match="threads must be >= 1"):
        with cpu.num_threads(0):
            pass


def test_thread_scaling_repeats_every_count_in_turns():
    seen = []
    samples = cpu.thread_scaling(
        lambda: seen.append(torch.get_num_threads()) or float(len(seen)), [1, 2], rounds=2
    )
    assert seen == [1, 2, 1, 2] and samples == {1: [1.0, 3.0], 2: [2.0, 4.0]}
    assert cpu.relative_spread([1.0, 3.0]) == 1.0 and cpu.relative_spread([5.0]) == 0.0
    rate = cpu.matmul_task(64, seconds=0.01)()
    assert rate > 0


@pytest.mark.slow
def test_torchrun_gives_each_worker_one_thread_unless_told():
    reports = cpu.torchrun_threads(2)
    assert [(r["rank"], r["OMP_NUM_THREADS"], r["torch_threads"]) for r in reports] == [
        (0, "1", 1),
        (1, "1", 1),
    ]
    assert all(r["torch_threads"] == 2 for r in cpu.torchrun_threads(2, omp_num_threads=2))


@pytest.mark.slow
def test_oversubscription_reports_every_layout():
    totals = cpu.oversubscription([(1, 1), (2, 1)], seconds=0.1, n=64)
    assert set(totals) == {(1, 1), (2, 1)} and all(v > 0 for v in totals.values())


def test_training_memory_formula_is_16_bytes_per_parameter_plus_activations():
    from titanlite.models.llama import ModelArgs

    args = ModelArgs.preset("debug", vocab_size=512)
    f = cpu.training_memory_formula(1000, args, batch=2, seq_len=16, vocab=512)
    assert f["weights"] + f["gradients"] + f["adam moments"] == 16 * 1000
    assert f["logits and loss"] == 3 * 4 * 2 * 16 * 512 and f["activations"] > 0
    assert f["total"] == sum(v for k, v in f.items() if k != "total")


def test_training_memory_needs_two_steps():
    from titanlite.config import Config

    cfg = Config()
    cfg.training.steps = 1
    with pytest.raises(titanlite.TitanliteError, match="steps >= 2"):
        cpu.training_memory(cfg)


def test_mps_rows_say_where_they_come_from():
    rows = mps.mps_support()
    assert [r.feature for r in rows] == [f for f, _ in mps._DOCUMENTED]
    expected = "measured here" if mps.mps_available() else mps.NOT_HERE
    assert all(r.source == expected and r.value for r in rows)


def test_loader_delivers_the_same_batches_with_workers_and_pinning_is_cuda_only():
    class Chars:  # a tokenizer stand-in with the one method the dataset calls
        def encode(self, text):
            return [ord(c) for c in text]

    data = TokenizingDataset(["hello", "world", "abc", "de"] * 4, Chars(), seq_len=4)
    assert data[3].tolist() == [100, 101, 0, 0]
    plain, workers = loader_rate(data, 0, batch_size=4), loader_rate(data, 2, batch_size=4)
    assert plain["checksum"] == workers["checksum"] and plain["batches_per_s"] > 0
    assert host_to_device_gbps(torch.device("cpu"), pinned=True) is None
    with pytest.raises(titanlite.TitanliteError, match="at least one text"):
        TokenizingDataset([], Chars(), 4)
