"""The layout plan at model load (CPU, meta tensors): presets, rejections with their reasons,
description errors, the JSON form, the CLI, and precompile(plan) + strict mode."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import cute_kernels
from cute_kernels import compile_cache
from cute_kernels.__main__ import main
from cute_kernels.compile_cache import KernelCache, StrictModeError
from cute_kernels.compress_c128 import CompressC128Key
from cute_kernels.deployment import (
    PRESETS,
    Compressor,
    Deployment,
    DeploymentError,
    Drafter,
    KvCache,
    KvInsert,
    load_deployment,
    plan,
)
from cute_kernels.kv_rope_insert import KERNELS as KV_KERNELS
from cute_kernels.kv_rope_insert import KvRopeInsertKey
from cute_kernels.layouts import C128_FORMATS, CacheFormat
from cute_kernels.stacked_kv_proj.interface import StackedKvProjKey
from cute_kernels.stacked_kv_proj.plan import StackedLayout, variants_for

ARCHS = ("sm_90a", "sm_100a")
TPS = (1, 2, 4, 8)
QWEN3 = {"qwen3-4b": 2560, "qwen3-8b": 4096, "qwen3-14b": 5120}
CLI = [sys.executable, "-m", "cute_kernels", "plan"]


def _errors(p, op: str) -> list[str | None]:
    return [case.error for case in p.ops()[op]]


# -- every preset at every TP, on both archs ------------------------------------------------------


def test_presets_are_the_specs_deployments():
    assert set(PRESETS) == {"deepseek-v4-flash", "deepseek-v4.1-flash"} | {
        f"{model}-{kind}" for model in QWEN3 for kind in ("dspark", "dflash")}
    assert all(p.tp == 1 and p.arch is None and p.summary for p in PRESETS.values())


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4.1-flash"])
def test_deepseek_preset_plans(name, arch, tp):
    p = plan(name, arch=arch, tp=tp)
    assert p.arch == arch and p.deployment.tp == tp
    mxfp8 = name == "deepseek-v4.1-flash" and arch == "sm_100a"  # vLLM's choice, "auto"
    packed = CacheFormat.V41_MXFP8 if mxfp8 else CacheFormat.V4_PACKED
    # KV insert: 3 formats x blocks 32/64/256, all served; one compile per format.
    cases = p.ops()["kv_rope_insert"]
    assert [c.case.split(" [")[0] for c in cases] == (
        ["k_cache uint8"] * 3 + ["k_cache bfloat16"] * 3 + ["k_cache float8_e4m3fn"] * 3)
    assert [c.case.split(", ")[1].rstrip("]").split(" ")[0] for c in cases] == [
        "32", "64", "256"] * 3
    assert all(c.supported for c in cases)
    assert p.keys()["kv_rope_insert"] == [
        KvRopeInsertKey(fmt, arch) for fmt in (packed, CacheFormat.BF16, CacheFormat.FP8)]
    # C128 at kv blocks 2 and 64 for each format (bf16 norm weight); the C4 layers are not this
    # kernel's (block 4 x 2048 state), and the V4.1 record is not a C128 format.
    c128 = p.ops()["compress_c128"]
    assert len(c128) == 7
    c128_errors = _errors(p, "compress_c128")
    if mxfp8:
        assert all(e.startswith("k_cache: expected record width 584") for e in c128_errors[:2])
        served = [CacheFormat.BF16, CacheFormat.FP8]
    else:
        served = list(C128_FORMATS)
        assert c128_errors[:2] == [None, None]
    assert c128_errors[2:6] == [None] * 4
    assert c128_errors[6].startswith("state_cache: expected [num_blocks, 8, 1024]")
    assert "(32, 4, 2048)" in c128_errors[6]
    assert p.keys()["compress_c128"] == [CompressC128Key(f, "bfloat16", arch, core)
                                         for f in served for core in ("cluster", "stream")]
    assert not p.supported("compress_c128")
    assert "stacked_kv_proj" not in p.ops()


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["dspark", "dflash"])
@pytest.mark.parametrize("model", list(QWEN3))
def test_qwen3_drafter_preset_plans(model, kind, arch, tp):
    p = plan(f"{model}-{kind}", arch=arch, tp=tp)
    assert p.deployment.drafter.hidden_size == QWEN3[model]
    assert p.supported("stacked_kv_proj") and list(p.ops()) == ["stacked_kv_proj"]
    norm = "float32" if kind == "dspark" else "bfloat16"
    n_kv = 8 // tp  # 8 KV heads split over the ranks
    want = [StackedKvProjKey(StackedLayout(5, n_kv, 128, False, commit, norm, arch), v)
            for commit in (False, True) for v in variants_for(arch, 128, n_kv * 128)]
    assert p.keys()["stacked_kv_proj"] == want
    # wgmma 14 tiles (m64, m128, m128w, the split-head m64h, 9 swapped sw*, the persistent
    # sw128p), the 2 wide swapped sw*w where kv holds 256 columns, and sw32 split in a cluster
    # + mma 4 (m64, m128, swap16 with either hand-over), x2 forms
    wide = 4 if n_kv * 128 >= 256 else 0
    assert len(want) == (38 + wide if arch == "sm_90a" else 8)
    assert [len(c.keys) for c in p.cases] == [len(want) // 2] * 2


def test_more_ranks_than_kv_heads_replicate_them():
    p = plan("qwen3-8b-dspark", arch="sm_90a", tp=16)
    assert {k.layout.n_kv for k in p.keys()["stacked_kv_proj"]} == {1}


# -- one source of truth: a plan's rejection is the op's own LayoutError --------------------------


def _v4(caches, **kv_insert) -> Deployment:
    return Deployment(name="t", kv_insert=KvInsert(tuple(caches), **kv_insert))


def test_rejection_is_the_check_functions_exact_error():
    p = plan(_v4([KvCache("uint8", 64, width=528)]), arch="sm_90a")
    meta = {"device": "meta"}
    args = (torch.empty(8, 512, dtype=torch.bfloat16, **meta),
            torch.empty(4, 64, 528, dtype=torch.uint8, **meta),
            torch.empty(8, dtype=torch.int64, **meta), torch.empty(8, dtype=torch.int64, **meta),
            torch.empty(4096, 64, dtype=torch.float32, **meta), 64)
    with pytest.raises(cute_kernels.LayoutError) as raised:
        cute_kernels.check_kv_rope_insert(*args)
    assert _errors(p, "kv_rope_insert") == [str(raised.value)]
    assert str(raised.value).startswith("k_cache: expected record width 584")


def test_page_padding_is_the_engines():
    # An odd block of V4 records: vLLM pads the page to 576 bytes (16-byte aligned), an
    # unpadded page is 3 * 584 bytes, which the kernel's 16-byte page stride cannot take.
    p = plan(_v4([KvCache("uint8", 3), KvCache("uint8", 3, page_align=1)]), arch="sm_90a")
    padded, unpadded = _errors(p, "kv_rope_insert")
    assert padded is None
    assert unpadded.startswith("k_cache: expected stride(0) a multiple of 16 bytes")
    assert "1752 bytes" in unpadded


def test_kv_insert_rejections_name_the_argument():
    p = plan(_v4([KvCache("float16", 64), KvCache("bfloat16", 64)], head_dim=576, rope_dim=64),
             arch="sm_100a")
    assert _errors(p, "kv_rope_insert") == [
        "kv: expected size 512 in dim 1, got shape (8, 576)"] * 2
    p = plan(_v4([KvCache("float16", 64)]), arch="sm_100a")
    assert _errors(p, "kv_rope_insert")[0].startswith("k_cache: expected dtype torch.uint8 or")


def _compressor(**fields) -> Deployment:
    caches = (KvCache("uint8", 2),)
    return Deployment(name="t", compressors=(Compressor(caches, **fields),))


def test_a_state_block_the_state_cache_cannot_have_is_rejected():
    (error,) = _errors(plan(_compressor(state_block_size=16), arch="sm_90a"), "compress_c128")
    assert error.startswith("state_cache: expected [num_blocks, 8, 1024]")
    assert "(32, 16, 1024)" in error


def test_a_ratio_no_tensor_carries_is_rejected_by_name():
    (error,) = _errors(plan(_compressor(compress_ratio=64), arch="sm_90a"), "compress_c128")
    assert error == "compress_ratio: expected 128 (compress_c128 pools windows of 128 " \
                    "positions), got 64"


def test_compressor_norm_and_eps_come_from_the_description():
    p = plan(_compressor(norm_dtype="float32"), arch="sm_90a")
    assert p.keys()["compress_c128"] == [
        CompressC128Key(CacheFormat.V4_PACKED, "float32", "sm_90a", core)
        for core in ("cluster", "stream")]
    (error,) = _errors(plan(_compressor(rms_norm_eps=-1.0), arch="sm_90a"), "compress_c128")
    assert error.startswith("eps: expected a finite non-negative float")


def _drafter(**fields) -> Deployment:
    base = PRESETS["qwen3-8b-dspark"]
    return dataclasses.replace(base, drafter=dataclasses.replace(base.drafter, **fields))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
def test_a_quantised_drafter_is_rejected_for_its_weight(dtype):
    p = plan(_drafter(weight_dtype=dtype), arch="sm_90a", tp=2)
    assert _errors(p, "stacked_kv_proj") == [
        f"weight: expected dtype torch.bfloat16, got torch.{dtype}"] * 2
    assert p.keys() == {"stacked_kv_proj": []}


@pytest.mark.parametrize(("fields", "reason"), [
    ({"head_dim": 512}, "k_caches[0]: expected head dim (shape[2]) in (64, 128, 256)"),
    ({"kv_cache_dtype": "float8_e4m3fn"}, "k_caches[0]: expected dtype torch.bfloat16"),
    ({"num_hidden_layers": 17}, "k_caches: expected at most 16 layers, got 17"),
    ({"hidden_size": 4000}, "ctx_hidden: expected a hidden size (shape[1]) that is a positive "
                            "multiple of 64"),
    ({"rope_dim": 64}, "cos_sin_cache: expected shape [max_pos >= 1, D = 128]"),
    ({"norm_dtype": "float16"}, "k_norm_weight: expected dtype torch.float32 or torch.bfloat16"),
])
def test_drafter_rejections_name_the_reason(fields, reason):
    errors = _errors(plan(_drafter(**fields), arch="sm_100a"), "stacked_kv_proj")
    assert len(errors) == 2 and all(e.startswith(reason) for e in errors), errors


def test_drafter_bias_and_call_forms_are_in_the_keys():
    p = plan(_drafter(attention_bias=True, commit_lens=(True,)), arch="sm_100a")
    assert {(k.layout.has_bias, k.layout.has_commit) for k in p.keys()["stacked_kv_proj"]} == {
        (True, True)}


def test_an_arch_the_kernels_lack_rejects_every_case():
    p = plan("deepseek-v4-flash", arch="sm_80a")
    assert p.keys() == {"kv_rope_insert": [], "compress_c128": []}
    # the op checks the arch last: the C4 case keeps its own reason
    *others, c4 = p.cases
    assert all(c.error.startswith("arch: expected one of sm_90a, sm_100a, got sm_80a")
               for c in others)
    assert c4.case.startswith("C4") and c4.error.startswith("state_cache:")


def test_the_arch_variable_is_restored(monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_100a")
    assert plan("qwen3-4b-dspark", arch="sm_90a").arch == "sm_90a"
    assert os.environ["CUTE_KERNELS_ARCH"] == "sm_100a"
    assert plan("qwen3-4b-dspark").arch == "sm_100a"  # the default: the variable
    monkeypatch.delenv("CUTE_KERNELS_ARCH")
    plan("qwen3-4b-dspark", arch="sm_90a")
    assert "CUTE_KERNELS_ARCH" not in os.environ


def test_without_an_arch_or_a_gpu_the_error_says_what_to_pass(monkeypatch):
    monkeypatch.delenv("CUTE_KERNELS_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for call in (lambda: plan("qwen3-4b-dspark"), cute_kernels.precompile):
        with pytest.raises(RuntimeError, match="arch='sm_90a'.*CUTE_KERNELS_ARCH"):
            call()


# -- description errors name the field ------------------------------------------------------------


@pytest.mark.parametrize(("data", "field", "problem"), [
    ({"name": "x", "drafter": {"hidden_size": 4096, "num_hidden_layers": 5,
                               "num_kv_heads": 8, "head_dim": 128}},
     "drafter.num_kv_heads", "unknown field; known: hidden_size, num_hidden_layers, "),
    ({"name": "x", "kv_insert": {"caches": [{"dtype": "uint8", "block_size": 64},
                                            {"dtype": "uint8", "blok_size": 64}]}},
     "kv_insert.caches[1].blok_size", "unknown field"),
    ({"name": "x", "drafter": {"hidden_size": 4096, "num_hidden_layers": 5,
                               "num_key_value_heads": 8}},
     "drafter.head_dim", "missing (a required field)"),
    ({"name": "x", "kv_insert": {"caches": [{"dtype": "uint8", "block_size": "64"}]}},
     "kv_insert.caches[0].block_size", "expected a positive integer, got '64'"),
    ({"name": "x", "compressors": [{"caches": [{"dtype": "fp8", "block_size": 2}]}]},
     "compressors[0].caches[0].dtype", "expected a torch dtype name"),
    ({"name": "x", "kv_insert": {"caches": [{"dtype": "uint8", "block_size": 2,
                                             "kv_mxfp8": "yes"}]}},
     "kv_insert.caches[0].kv_mxfp8", 'expected true, false or "auto"'),
    ({"name": "x", "kv_insert": {"caches": []}}, "kv_insert.caches", "expected a non-empty list"),
    ({"name": "x", "tp": 0, "kv_insert": {"caches": [{"dtype": "uint8", "block_size": 2}]}},
     "tp", "expected a positive integer, got 0"),
    ({"name": "x"}, "", "describes no op"),
    ({"name": "x", "tp": 3, "drafter": {"hidden_size": 4096, "num_hidden_layers": 5,
                                        "num_key_value_heads": 8, "head_dim": 128}},
     "tp", "3 ranks cannot share the drafter's 8 KV heads"),
    (["not", "an", "object"], "", "expected a JSON object"),
])
def test_a_bad_description_names_the_field(data, field, problem):
    with pytest.raises(DeploymentError) as raised:
        Deployment.from_json(data)
    assert raised.value.field == field
    assert raised.value.problem.startswith(problem), raised.value.problem
    assert str(raised.value).startswith(f"{field}: " if field else problem)


def test_python_construction_is_checked_too():
    with pytest.raises(DeploymentError, match=r"^hidden_size: expected a positive integer"):
        Drafter(hidden_size=-1, num_hidden_layers=5, num_key_value_heads=8, head_dim=128)
    with pytest.raises(DeploymentError, match=r"^drafter\.head_dim: expected a positive"):
        Deployment(name="x", drafter={"hidden_size": 64, "num_hidden_layers": 1,
                                      "num_key_value_heads": 1, "head_dim": 0})
    with pytest.raises(DeploymentError, match=r"^tp: expected a positive integer"):
        plan("qwen3-8b-dspark", arch="sm_90a", tp=0)


def test_dtype_names_are_normalised():
    assert KvCache("torch.float", 2).dtype == "float32"
    assert KvCache("half", 2).dtype == "float16"


def test_unknown_preset_and_malformed_json(tmp_path):
    with pytest.raises(DeploymentError, match="'qwen9' is neither a preset .*qwen3-8b-dspark"):
        load_deployment("qwen9")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x",')
    with pytest.raises(DeploymentError, match="bad.json is not valid JSON"):
        load_deployment(str(bad))
    bad.write_bytes(b'\xff\xfe{"name": "x"}')  # UTF-16 bytes: not UTF-8
    with pytest.raises(DeploymentError, match="bad.json is not valid JSON: 'utf-8' codec"):
        load_deployment(str(bad))
    bad.write_text('{"a": ' * 100_000)  # deeper than the JSON parser recurses
    with pytest.raises(DeploymentError, match="bad.json is not valid JSON: maximum recursion"):
        load_deployment(str(bad))


@pytest.mark.parametrize("source", [5, None, b"qwen3-8b-dspark", ["qwen3-8b-dspark"]])
def test_a_source_of_another_type_is_a_description_error(source):
    with pytest.raises(DeploymentError, match=r"^expected a Deployment, a parsed JSON object, a "
                                              "preset name or the path of a JSON file, got "):
        plan(source, arch="sm_90a")


def test_an_arch_that_is_not_a_name_is_a_description_error():
    with pytest.raises(DeploymentError, match=r"^arch: expected an arch name such as sm_90a, "
                                              "got 90"):
        plan("qwen3-8b-dspark", arch=90)


def test_an_unreadable_description_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "d.json"
    path.write_text("{}")

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(path), "read_text", refuse)  # root reads every file
    with pytest.raises(DeploymentError, match=r"d\.json cannot be read: .*Permission denied"):
        load_deployment(str(path))


@pytest.mark.parametrize(("data", "section"), [
    ({"drafter": {"hidden_size": 2 ** 63, "num_hidden_layers": 5, "num_key_value_heads": 8,
                  "head_dim": 128}}, "drafter"),
    ({"compressors": [{"caches": [{"dtype": "uint8", "block_size": 2}]},
                      {"caches": [{"dtype": "uint8", "block_size": 2 ** 62}]}]},
     "compressors[1]"),
    ({"kv_insert": {"caches": [{"dtype": "bfloat16", "block_size": 64}], "head_dim": 2 ** 62}},
     "kv_insert"),
])
def test_sizes_no_tensor_can_have_name_the_section(data, section):
    """A size (or the bytes it makes) past 64 bits: no meta tensor can be built, so the plan
    says which section describes it instead of torch's TypeError or RuntimeError."""
    with pytest.raises(DeploymentError) as raised:
        plan({"name": "x", **data}, arch="sm_90a")
    assert raised.value.field == section
    assert raised.value.problem.startswith("sizes no torch."), raised.value.problem


def test_a_layer_count_plan_cannot_build_is_a_description_error():
    """Two meta tensors a layer: a count past MAX_DESCRIBED_LAYERS is refused when parsed (a
    count the op rejects below it is a rejected case, as the op says it)."""
    fields = {"hidden_size": 4096, "num_key_value_heads": 8, "head_dim": 128}
    with pytest.raises(DeploymentError, match=r"^num_hidden_layers: expected at most 4096"):
        Drafter(num_hidden_layers=4097, **fields)
    errors = _errors(plan(_drafter(num_hidden_layers=4096), arch="sm_90a"), "stacked_kv_proj")
    assert errors == ["k_caches: expected at most 16 layers, got 4096"] * 2


# -- the JSON form --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_description_json_round_trip(name, tmp_path):
    preset = PRESETS[name]
    text = json.dumps(preset.to_json())
    assert Deployment.from_json(json.loads(text)) == preset
    path = tmp_path / "d.json"
    path.write_text(text)
    assert load_deployment(path) == preset
    assert plan(str(path), arch="sm_90a") == plan(name, arch="sm_90a")


def test_plan_json_form():
    p = plan("deepseek-v4.1-flash", arch="sm_100a", tp=4)
    data = json.loads(json.dumps(p.to_json()))
    assert data == p.to_json()
    assert Deployment.from_json(data["deployment"]) == p.deployment
    assert (data["arch"], data["tp"], data["variants"]) == ("sm_100a", 4, 7)
    kv = data["ops"]["kv_rope_insert"]
    assert kv["supported"] is True
    assert kv["keys"][0] == "KvRopeInsertKey(cache_format=v41_mxfp8, arch=sm_100a)"
    c128 = data["ops"]["compress_c128"]
    assert c128["supported"] is False and len(c128["keys"]) == 4  # 2 formats x 2 cores
    assert c128["cases"][0] == {
        "case": "C128 k_cache uint8 [*, 2, 528] kv_mxfp8", "supported": False, "keys": [],
        "error": "k_cache: expected record width 584 for a torch.uint8 cache, got shape "
                 "(4, 2, 528)"}


def test_table_lists_cases_and_keys():
    text = plan("deepseek-v4-flash", arch="sm_90a").table()
    lines = text.splitlines()
    assert lines[0] == "deepseek-v4-flash: arch sm_90a, TP 1, 9 compile variants"
    assert any(line.startswith("kv_rope_insert") and "[*, 256, 584]" in line
               and line.endswith("ok, 1 variant") for line in lines)
    assert any(line.startswith("compress_c128") and "C4 k_cache uint8 [*, 64, 584]" in line
               and "REJECTED  state_cache: expected" in line for line in lines)
    keys = lines[lines.index("compile keys:") + 1:]
    assert keys[0] == "  KvRopeInsertKey(cache_format=v4_packed, arch=sm_90a)"
    assert len(keys) == 9  # 3 KV formats, 3 C128 formats x 2 cores


# -- the command line -----------------------------------------------------------------------------


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_cli_table_and_json():
    table = _run("qwen3-8b-dspark", "--arch", "sm_90a", "--tp", "2")
    assert table.returncode == 0, table.stderr
    assert table.stdout == plan("qwen3-8b-dspark", arch="sm_90a", tp=2).table() + "\n"
    assert "n_kv=4" in table.stdout
    machine = _run("qwen3-8b-dflash", "--arch", "sm_100a", "--tp", "8", "--json")
    assert machine.returncode == 0, machine.stderr
    assert json.loads(machine.stdout) == plan("qwen3-8b-dflash", arch="sm_100a", tp=8).to_json()


def test_cli_bad_description_exits_2_naming_the_field(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"name": "x", "drafter": {"hidden": 4096}}))
    result = _run(str(path), "--arch", "sm_90a")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("cute_kernels plan: drafter.hidden: unknown field")


def test_cli_in_process(capsys):
    assert main(["plan", "--list-presets"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(PRESETS)
    assert main(["plan", "qwen9", "--arch", "sm_90a"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["plan", "qwen3-8b-dspark", "--arch", "sm_90a", "--strict"]) == 2
    assert "--strict checks a --precompile" in capsys.readouterr().err
    # rejected cases are information, not a failure
    assert main(["plan", "deepseek-v4-flash", "--arch", "sm_80a"]) == 0
    assert "REJECTED  arch: expected one of sm_90a, sm_100a" in capsys.readouterr().out


# -- precompile(plan) -----------------------------------------------------------------------------


def _record_precompiles(monkeypatch) -> list:
    built = []
    monkeypatch.setattr(KernelCache, "precompile",
                        lambda self, keys: built.extend((self.family, key) for key in keys))
    return built


@pytest.mark.parametrize(("name", "arch"), [("deepseek-v4.1-flash", "sm_100a"),
                                            ("deepseek-v4-flash", "sm_90a"),
                                            ("qwen3-14b-dspark", "sm_90a")])
def test_precompile_builds_exactly_the_plans_keys(monkeypatch, name, arch):
    built = _record_precompiles(monkeypatch)
    p = plan(name, arch=arch, tp=4)
    cute_kernels.precompile(p)
    assert built == [(op, key) for op, keys in p.keys().items() for key in keys]
    assert len(built) == len(set(built)) == p.to_json()["variants"]
    if name == "deepseek-v4.1-flash":  # the rejected C128 uint8 cases build nothing
        assert all(key.cache_format is not CacheFormat.V4_PACKED for _, key in built)


def test_precompile_plan_can_be_limited_to_families(monkeypatch):
    built = _record_precompiles(monkeypatch)
    cute_kernels.precompile(plan("deepseek-v4-flash", arch="sm_90a"), kernels=["compress_c128"])
    assert [family for family, _ in built] == ["compress_c128"] * 6  # 3 formats x 2 cores


def _tiny(tmp_path) -> str:
    """A one-variant deployment: a bf16 KV insert cache (one ~0.2 s compile)."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"name": "tiny", "arch": "sm_90a", "kv_insert": {
        "caches": [{"dtype": "bfloat16", "block_size": 64}]}}))
    return str(path)


def test_precompile_plan_then_strict(monkeypatch, tmp_path, empty_memory):
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path / "cache"))
    empty_memory(KV_KERNELS)  # nothing in memory from other tests
    p = plan(_tiny(tmp_path))
    (key,) = p.keys()["kv_rope_insert"]
    assert key == KvRopeInsertKey(CacheFormat.BF16, "sm_90a")
    before = cute_kernels.cache_stats()
    try:
        cute_kernels.precompile(p, strict=True)
        after = cute_kernels.cache_stats()
        assert after["compiles"] - before["compiles"] == 1
        assert callable(KV_KERNELS.get(key))  # in the plan: served
        with pytest.raises(StrictModeError, match="precompile"):  # outside it: refused
            KV_KERNELS.get(KvRopeInsertKey(CacheFormat.FP8, "sm_90a"))
        assert cute_kernels.cache_stats()["compiles"] == after["compiles"]
    finally:
        compile_cache.set_strict(False)


def test_cli_bakes_an_image_and_strict_checks_it(tmp_path):
    tiny = _tiny(tmp_path)
    cache = {"CUTE_KERNELS_CACHE_DIR": str(tmp_path / "cache")}
    cold = _run(tiny, "--precompile", "--strict", **cache)  # nothing baked yet
    assert cold.returncode == 1 and "strict mode is on" in cold.stderr
    bake = _run(tiny, "--precompile", "--json", **cache)
    assert bake.returncode == 0, bake.stderr
    assert json.loads(bake.stdout)["variants"] == 1  # stdout stays one JSON document
    assert "precompile: variants 1, compiled 1 (" in bake.stderr
    serve = _run(tiny, "--precompile", "--strict", **cache)  # a fresh process: 0 compiles
    assert serve.returncode == 0, serve.stderr
    assert "variants 1, compiled 0 (0.0 s), loaded from the disk cache 1" in serve.stderr
