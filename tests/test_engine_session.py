"""engine/session: a plan whose RAM does not fit this machine is refused before anything is allocated."""

from __future__ import annotations

import pytest
from _cli_fixtures import pack_and_profile


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "polish")


def test_placement_ram_check(files, monkeypatch):
    from colibri_plan.engine import session
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.engine.placement import Placement
    from colibri_plan.errors import BudgetError

    with open_pack(files / "fx") as pack:
        a = pack.arch
        pl = Placement.all_ram(a.moe_layers, a.n_experts)
        block = pack.expert_location(a.moe_layers[0], 0)[1]
        need = session.placement_ram_bytes(pack, pl)
        assert need == (len(a.moe_layers) * a.n_experts + a.top_k) * block
        session.check_ram_fits(pack, pl, available=need)                 # exactly enough: accepted
        with pytest.raises(BudgetError, match=f"{need:,} B.*{need - 1:,} B, MemAvailable"):
            session.check_ram_fits(pack, pl, available=need - 1)
        monkeypatch.setenv(session.NO_RAM_CHECK_ENV, "1")
        session.check_ram_fits(pack, pl, available=1)                    # the override
        monkeypatch.delenv(session.NO_RAM_CHECK_ENV)
        monkeypatch.setattr(session, "mem_available_bytes", lambda: need - 1)
        with pytest.raises(BudgetError):
            session.run_placement(pack, pl, [1, 2], 1, cpu_backend="numpy")
    avail = session.mem_available_bytes()
    assert avail is None or avail > 0
