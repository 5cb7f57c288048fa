"""``trunk.kv.host`` (formats/plan_trunk.py): earlier versions wrote ``true`` for an MLA model's GPU trunk,
whose latent cache the engine then kept in RAM (no VRAM priced for it). The engine now keeps every cache
on the trunk's device, so such a plan is refused with the reason; ``false`` (or absent) reads as before."""

import pytest

from colibri_plan.errors import FormatError
from colibri_plan.formats.plan_trunk import CPU, TrunkPlacement, parse_trunk


def doc_with(device: str, family: str | None, host) -> dict:
    t = TrunkPlacement(device, "int8", 1000, device, 64, 64, 100, 6400, ()).to_dict()
    t["kv"]["host"] = host
    doc = {"trunk": t, "devices": [{"key": "cuda:0"}]}
    if family is not None:
        doc["model"] = {"family": family}
    return doc


@pytest.mark.parametrize("device", ["cuda:0", CPU])
@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa", "qwen3_moe", None])
def test_host_true_is_refused_with_the_reason(device, family):
    with pytest.raises(FormatError) as exc:
        parse_trunk(doc_with(device, family, True), ["cuda:0"])
    msg = str(exc.value)
    assert "an earlier version kept an MLA model's latent cache in RAM" in msg and f"({device})" in msg
    assert msg.endswith("re-create the plan with `colibri-plan solve`")


def test_host_false_is_fine_anywhere():
    for device in (CPU, "cuda:0"):
        back = parse_trunk(doc_with(device, "qwen3_moe", False), ["cuda:0"])
        assert back.device == device and back.kv_bytes == 6400 and "host" not in back.to_dict()["kv"]


@pytest.mark.parametrize("bad", ["yes", 1, None, "true"])
def test_host_must_be_a_bool(bad):
    with pytest.raises(FormatError, match="trunk.kv.host must be true or false"):
        parse_trunk(doc_with("cuda:0", "deepseek_v3", bad), ["cuda:0"])
