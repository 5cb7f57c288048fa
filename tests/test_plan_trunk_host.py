"""``trunk.kv.host`` (formats/plan_trunk.py) is refused where the engine would not keep the cache on the host:
a CPU trunk, or a GPU trunk of a model family that is not MLA; an MLA family's GPU trunk keeps it."""

import pytest

from colibri_plan.errors import FormatError
from colibri_plan.formats.plan_trunk import CPU, MLA_FAMILIES, TrunkPlacement, parse_trunk


def doc_with(device: str, family: str | None, host) -> dict:
    t = TrunkPlacement(device, "int8", 1000, device, 64, 64, 100, 6400, (), False).to_dict()
    t["kv"]["host"] = host
    doc = {"trunk": t, "devices": [{"key": "cuda:0"}]}
    if family is not None:
        doc["model"] = {"family": family}
    return doc


def test_host_on_an_mla_gpu_trunk_is_kept():
    for family in ("deepseek_v3", "glm_moe_dsa", None):    # None: a plan without model.family
        back = parse_trunk(doc_with("cuda:0", family, True), ["cuda:0"])
        assert back.device == "cuda:0" and back.kv_on_host is True and back.kv_bytes == 6400


def test_host_false_is_fine_anywhere():
    assert parse_trunk(doc_with(CPU, "qwen3_moe", False), ["cuda:0"]).kv_on_host is False
    assert parse_trunk(doc_with("cuda:0", "qwen3_moe", False), ["cuda:0"]).kv_on_host is False


def test_host_on_a_cpu_trunk_is_refused():
    with pytest.raises(FormatError, match=r"trunk.kv.host is true but the trunk is on the cpu"):
        parse_trunk(doc_with(CPU, "deepseek_v3", True), ["cuda:0"])


def test_host_on_a_non_mla_gpu_trunk_is_refused_naming_the_family():
    assert "glm4_moe" not in MLA_FAMILIES
    with pytest.raises(FormatError) as exc:
        parse_trunk(doc_with("cuda:0", "glm4_moe", True), ["cuda:0"])
    msg = str(exc.value)
    assert "model family 'glm4_moe' is not MLA" in msg and "cuda:0" in msg and "deepseek_v3" in msg
    assert msg.endswith("re-create the plan with `colibri-plan solve`")


@pytest.mark.parametrize("bad", ["yes", 1, None, "true"])
def test_host_must_be_a_bool(bad):
    with pytest.raises(FormatError, match="trunk.kv.host must be true or false"):
        parse_trunk(doc_with("cuda:0", "deepseek_v3", bad), ["cuda:0"])
