"""``kvdoctor doctor``: describes the machine and exits 0 whatever it finds."""

import json

import pynvml
import pytest

from kvdoctor.cli import main
from kvdoctor.probes import machine


def _doctor_json(capsys, *extra):
    code = main(["doctor", "--json", *extra])
    return code, {item["name"]: item for item in json.loads(capsys.readouterr().out)["items"]}


def test_doctor_reports_every_capability_and_exits_0(capsys, tmp_path):
    code, items = _doctor_json(capsys, "--no-dump-test", "--disk-dir", str(tmp_path))
    assert code == 0
    assert set(items) == {"python", "torch", "transformers", "gpu/nvml", "py-spy", "disk tier", "model", "decode kernel",
                          "huge pages"}
    assert items["torch"]["data"]["version"]
    assert items["disk tier"]["data"]["dir"] == str(tmp_path) and items["disk tier"]["data"]["free"] > 0
    assert items["py-spy"]["data"]["path"].endswith("py-spy")
    assert items["model"]["data"]["name"] == "SmolLM2-135M-Instruct"
    kernel = items["decode kernel"]
    assert kernel["data"]["path"].endswith(".so") if kernel["ok"] else kernel["data"]["reason"]


def test_a_machine_without_a_compiler_is_told_why_decode_is_slower(capsys, monkeypatch, tmp_path):
    # GIVEN no C compiler and no kernel built yet
    from kvdoctor.engine.model import matvec

    monkeypatch.setenv("CC", str(tmp_path / "no-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    matvec.probe.cache_clear()
    try:
        # WHEN doctor runs THEN the kernel item says why it is not used, and how to fix it
        code, items = _doctor_json(capsys, "--no-dump-test")
    finally:
        matvec.probe.cache_clear()
    assert code == 0 and items["decode kernel"]["ok"] is False
    assert "no C compiler" in items["decode kernel"]["summary"] and "gcc" in items["decode kernel"]["fix"]


def test_huge_pages_switched_off_are_reported_with_the_fix(capsys, monkeypatch, tmp_path):
    # GIVEN transparent huge pages switched off in the kernel, then by kvdoctor's own switch
    from kvdoctor.engine.model import hugepages

    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "_SETTING", setting)
    monkeypatch.setattr(hugepages.sys, "platform", "linux")
    # WHEN doctor runs THEN the item says the weights stay on 4 KB pages and how to give them 2 MB ones
    code, items = _doctor_json(capsys, "--no-dump-test")
    assert code == 0 and items["huge pages"]["ok"] is False
    assert "never" in items["huge pages"]["summary"] and "madvise" in items["huge pages"]["fix"]
    monkeypatch.setenv("KVDOCTOR_HUGEPAGES", "0")
    _, items = _doctor_json(capsys, "--no-dump-test")
    assert items["huge pages"]["fix"] == "unset KVDOCTOR_HUGEPAGES"
    # AND where the kernel gives them, the item is ok
    setting.write_text("always [madvise] never\n")
    monkeypatch.delenv("KVDOCTOR_HUGEPAGES")
    _, items = _doctor_json(capsys, "--no-dump-test")
    assert items["huge pages"]["ok"] is (hasattr(hugepages.mmap, "MADV_HUGEPAGE"))


def test_missing_nvml_is_a_finding_not_a_traceback(capsys, monkeypatch):
    # GIVEN a machine without the NVML library
    def no_library():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    # WHEN doctor runs THEN it says so and still exits 0
    code, items = _doctor_json(capsys, "--no-dump-test")
    assert code == 0
    assert items["gpu/nvml"]["ok"] is None
    assert items["gpu/nvml"]["summary"] == "no NVML: NVML library not found (no NVIDIA driver on this machine)"


def test_an_inspection_that_crashes_is_reported_and_the_rest_still_run(capsys, monkeypatch):
    def broken(**_):
        raise RuntimeError("boom")

    monkeypatch.setitem(machine.INSPECTIONS, "torch", broken)
    code, items = _doctor_json(capsys, "--no-dump-test")
    assert code == 0
    assert items["torch"]["ok"] is False and "RuntimeError: boom" in items["torch"]["summary"]
    assert items["transformers"]["ok"] is True


def test_text_output_marks_each_item_and_tests_ptrace_with_a_real_dump(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[1]: line for line in out.splitlines() if line[:4].strip() in ("ok", "NO", "--")}
    assert "dump of a child process:" in lines["py-spy"]
    if machine.ptrace_status()["root"]:
        assert lines["py-spy"].lstrip().startswith("ok")


def test_unusable_disk_dir_is_reported_with_a_fix(capsys, tmp_path):
    code, items = _doctor_json(capsys, "--no-dump-test", "--disk-dir", str(tmp_path / "missing"))
    assert code == 0
    assert items["disk tier"]["ok"] is False and items["disk tier"]["fix"]


@pytest.mark.parametrize("argv", [["doctor", "--bogus"]])
def test_bad_flags_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
