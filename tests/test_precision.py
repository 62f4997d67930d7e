"""--precision auto: bf16 only where the hardware has it natively."""

import pytest
import torch

from runtime.precision import cpu_flags, resolve_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "avx512f", "avx512_bf16"}, "bf16"),
    ({"avx2", "amx_bf16", "amx_tile"}, "bf16"),
    ({"avx2", "avx512f"}, "fp32"),  # AVX-512 without its bf16 extension
    ({"avx2", "fma"}, "fp32"),
    (set(), "fp32"),  # unknown CPU (no /proc/cpuinfo)
])
def test_auto_takes_bf16_only_on_cpus_with_native_bf16(flags, expected):
    precision = resolve_precision("auto", CPU, flags)
    assert precision.name == expected and precision.reason.startswith("auto: ")
    assert precision.dtype == (torch.bfloat16 if expected == "bf16" else torch.float32)


def test_an_explicit_precision_is_kept_whatever_the_cpu():
    assert resolve_precision("bf16", CPU, set()).name == "bf16"
    assert resolve_precision("fp32", CPU, {"avx512_bf16"}).name == "fp32"
    with pytest.raises(ValueError, match="not one of auto, bf16, fp32"):
        resolve_precision("fp16", CPU, set())


def test_cpu_flags_reads_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512_bf16\nbugs\t: none\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


@pytest.mark.parametrize("flags, expected", [(set(), "fp32"), ({"amx_bf16"}, "bf16")])
def test_bench_and_eval_resolve_auto_the_same_way(flags, expected, monkeypatch):
    from bench.attention import AttentionBenchConfig
    from evaluation.run import EvalConfig
    from runtime import precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    bench = AttentionBenchConfig(dtype="auto")
    evaluation = EvalConfig(checkpoint="unused", precision="auto", passkey_trials=0)
    assert bench.dtype == evaluation.precision == expected
    assert bench.dtype_reason == evaluation.precision_reason == resolve_precision("auto", CPU, flags).reason
