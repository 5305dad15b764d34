"""The machine facts every benchmark records: the CPU's vector ISA beside its model name."""

from dualpath.bench.hardware import cpu_vector_isa, hardware_info, machine_line

X86_AVX2 = [
    "processor\t: 0\n",
    "model name\t: AMD EPYC\n",
    "flags\t\t: fpu sse sse2 avx avx2 fma\n",
]
X86_AVX512 = ["model name\t: Intel(R) Xeon(R) Processor\n", "flags\t: avx avx2 avx512f avx512bw\n"]
ARM = ["processor\t: 0\n", "Features\t: fp asimd evtstrm sve\n"]


def test_the_widest_vector_extension_is_named() -> None:
    assert cpu_vector_isa(X86_AVX2) == "avx2"
    assert cpu_vector_isa(X86_AVX512) == "avx512f"
    assert cpu_vector_isa(ARM) == "sve"


def test_no_flags_name_no_isa() -> None:
    assert cpu_vector_isa([]) is None
    assert cpu_vector_isa(["model name\t: avx2 in a name is not a flag\n"]) is None


def test_every_result_records_it() -> None:
    facts = hardware_info(torch="2.13.0")
    assert "cpu_vector_isa" in facts and facts["torch"] == "2.13.0"


def test_the_summary_names_the_machine() -> None:
    line = machine_line({"cpu_model": "AMD EPYC", "cpu_count": 2, "cpu_vector_isa": "avx2"})
    assert line == "Machine: AMD EPYC, 2 cores, vector ISA avx2"
    assert "vector ISA unknown" in machine_line({"cpu_model": "x", "cpu_count": 1})
    assert machine_line(None) == ""
