"""The CPU-class logic on every class, from a given /proc/cpuinfo (the seam: a class this machine
is not of needs no such CPU): the flags env.json records, the oneDNN row's bf16 hardware, and
the scope of the guide's claim stated for a CPU feature. Nothing here reads this machine's CPU,
so each test holds, and can fail, on every CPU class. What oneDNN's bf16 setting *does* on each
class is measured, not read from flags: test_tuning_guide fakes those effects per class and runs
the AVX2 class for real (ONEDNN_MAX_CPU_ISA=AVX2)."""
from __future__ import annotations

import pytest

from conftest import compose_cfg
from speedbench.analysis import claims
from speedbench.measure import env
from speedbench.techniques import onednn_precision

# One line of each class as Linux prints it (flags trimmed to the ones that tell them apart).
CPUINFO = {
    "avx2": ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B12\n"
             "flags\t\t: fpu sse4_2 fma f16c avx avx2 sha_ni\n"),
    "avx512_bf16": ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14\n"
                    "flags\t\t: fpu sse4_2 fma f16c avx avx2 avx512f avx512dq avx512bw avx512vl"
                    " avx512_vnni avx512_bf16 avx512_vbmi2\n"),
    "amx": ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum"
            " 8481C CPU @ 2.70GHz\nflags\t\t: fpu sse4_2 fma f16c avx avx2 avx_vnni avx512f"
            " avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n"),
    "arm_bf16": ("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes asimdhp"
                 " sve i8mm bf16 sve2\nCPU implementer\t: 0x41\n"),
    "no_flags": "processor\t: 0\nmodel name\t: QEMU Virtual CPU\n",
}
FLAGS = {
    "avx2": ["sse4_2", "fma", "f16c", "avx", "avx2"],
    "avx512_bf16": ["sse4_2", "fma", "f16c", "avx", "avx2", "avx512f", "avx512bw", "avx512vl",
                    "avx512_vnni", "avx512_bf16"],
    "amx": ["sse4_2", "fma", "f16c", "avx", "avx2", "avx_vnni", "avx512f", "avx512bw",
            "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
            "amx_int8"],
    "arm_bf16": ["asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm"],
    "no_flags": None,
}
BF16_HW = {"avx2": "none", "avx512_bf16": "avx512_bf16", "amx": "amx_bf16",
           "arm_bf16": "bf16", "no_flags": "none"}


@pytest.mark.parametrize("cpu", sorted(CPUINFO))
def test_env_records_the_flags_of_each_cpu_class(cpu):
    assert env.cpu_flags(CPUINFO[cpu]) == FLAGS[cpu]


@pytest.mark.parametrize("cpu", sorted(CPUINFO))
def test_the_onednn_row_names_the_bf16_hardware_of_each_class(cpu, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO[cpu])
    assert onednn_precision.bf16_hardware(str(info)) == BF16_HW[cpu]


def _onednn_claim() -> dict:
    """The guide's claim for oneDNN's bf16 math, as its experiment states it."""
    cfg = compose_cfg("device=cpu", experiment="onednn_precision")
    (claim,) = [dict(c) for c in cfg.claims if c.get("cpu_flags")]
    return {**claim, "cpu_flags": list(claim["cpu_flags"])}


@pytest.mark.parametrize("cpu, in_scope", [
    ("amx", True),            # its benchmark's class: judged
    ("avx512_bf16", False),   # AVX-512 bf16 alone keeps fp32 math (measured on an EPYC)
    ("avx2", False), ("arm_bf16", False),
])
def test_the_guides_amx_claim_is_judged_on_amx_cpus_only(cpu, in_scope):
    claim = _onednn_claim()
    assert claim["cpu_flags"] == ["amx_bf16"]
    scope = claims.out_of_scope(claim, "cpu", {"cpu_flags": env.cpu_flags(CPUINFO[cpu])})
    if in_scope:
        assert scope is None
    else:  # one flag: said as one, not "has neither"
        assert scope == ("n/a: the claim is stated for CPUs with amx_bf16; this CPU does not "
                         "have it")


def test_a_claim_on_an_unknown_cpu_is_judged_and_on_a_gpu_is_n_a():
    claim = _onednn_claim()
    assert claims.out_of_scope(claim, "cpu", {}) is None  # env.json without cpu_flags: judged
    no_flags = env.cpu_flags(CPUINFO["no_flags"])  # a cpuinfo without a flags line
    assert claims.out_of_scope(claim, "cpu", {"cpu_flags": no_flags}) is None
    assert claims.out_of_scope(claim, "cuda:0", {"cpu_flags": FLAGS["amx"]}) \
        == "n/a: the claim is stated for CPUs with amx_bf16; this run is on cuda:0"


def test_a_claim_of_several_features_names_what_the_cpu_lacks():
    three = {"kind": "faster", "cpu_flags": ["amx_bf16", "avx512_bf16", "bf16"]}
    assert claims.out_of_scope(three, "cpu", {"cpu_flags": FLAGS["avx2"]}) \
        == ("n/a: the claim is stated for CPUs with amx_bf16 or avx512_bf16 or bf16; this CPU "
            "has none of them")
    assert claims.out_of_scope(three, "cpu", {"cpu_flags": FLAGS["arm_bf16"]}) is None
