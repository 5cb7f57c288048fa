"""planner/quiet: nothing a native solver prints reaches stdout (fd 1), and fd 1 is always restored."""

from __future__ import annotations

import os
import threading

import pytest

from colibri_plan.planner.quiet import no_native_stdout


def test_fd1_is_silenced_inside_and_restored_after(capfd):
    os.write(1, b"before\n")
    with no_native_stdout():
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
    os.write(1, b"after\n")
    assert capfd.readouterr().out == "before\nafter\n"


def test_fd1_is_restored_on_an_exception_and_nesting(capfd):
    with pytest.raises(RuntimeError):
        with no_native_stdout():
            with no_native_stdout():
                os.write(1, b"inner\n")
            os.write(1, b"outer\n")
            raise RuntimeError("boom")
    os.write(1, b"ok\n")
    assert capfd.readouterr().out == "ok\n"


def test_concurrent_solves_share_one_redirection(capfd):
    barrier = threading.Barrier(4)

    def work():
        with no_native_stdout():
            barrier.wait(timeout=10)
            os.write(1, b"noise\n")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.write(1, b"ok\n")
    assert capfd.readouterr().out == "ok\n"


def test_the_milp_call_is_silenced(capfd, monkeypatch):
    from _solver_fixtures import toy_profile, toy_spec

    from colibri_plan.planner import solve as solve_mod
    from colibri_plan.planner.make import make_plan
    from colibri_plan.planner.options import SolveOptions

    real, calls = solve_mod.milp, []

    def noisy(*a, **k):
        calls.append(1)
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        return real(*a, **k)

    monkeypatch.setattr(solve_mod, "milp", noisy)
    make_plan(toy_profile(), toy_spec(n_experts=8), None, SolveOptions(ram="0.6", context_tokens=100,
                                                                       method="milp", trunk="cpu"))
    assert calls and "Highs" not in capfd.readouterr().out
