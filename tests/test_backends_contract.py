"""The backend contract on every backend: discovery never raises, typed out-of-memory errors with no
partial state, freeing twice, closed backends, wrong shapes; and `colibri-plan backends`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from colibri_plan import quant
from colibri_plan.backends import BACKEND_NAMES, get_backend
from colibri_plan.backends.base import Backend, DeviceInfo, ExpertWeights
from colibri_plan.cli import cli
from colibri_plan.errors import DeviceOutOfMemoryError, InputError, UnsupportedError


def _classes():
    params = []
    for name in BACKEND_NAMES:
        try:
            cls = get_backend(name)
            reason = cls.unavailable_reason()
        except ImportError as exc:
            cls, reason = None, f"backend module cannot be imported: {exc}"
        params.append(pytest.param((name, cls, reason), id=name))
    return params


@pytest.fixture(params=_classes())
def backend_cls(request):
    name, cls, reason = request.param
    if reason:
        pytest.skip(f"{name}: {reason}")
    return cls


def _small(cls, capacity: int):
    """A subclass of ``cls`` whose device holds at most ``capacity`` bytes of weights."""
    return type(f"Small{cls.__name__}", (cls,), {"capacity_bytes": lambda self: capacity})


def _qt(out=16, in_=32, fmt="int4", seed=0):
    w = np.random.default_rng(seed).standard_normal((out, in_)).astype(np.float32)
    return quant.quantize(w, fmt)


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_discovery_never_raises(name):
    try:
        cls = get_backend(name)
    except ImportError:
        pytest.skip(f"{name}: backend module not written")
    reason = cls.unavailable_reason()
    assert reason is None or (isinstance(reason, str) and reason)
    assert cls.is_available() == (reason is None)
    devices = cls.list_devices()
    assert all(isinstance(d, DeviceInfo) and d.backend == name for d in devices)
    assert [d.index for d in devices] == list(range(len(devices)))
    for d in devices:
        assert d.kind in ("cpu", "gpu", "igpu") and d.total_memory_bytes >= 0
        assert set(d.formats) <= set(quant.FORMATS)
    if reason is not None:
        assert devices == []


def test_unknown_backend_name():
    with pytest.raises(UnsupportedError, match="unknown backend"):
        get_backend("tpu")


def test_upload_beyond_capacity_is_typed_and_leaves_nothing(backend_cls):
    a, b = _qt(seed=1), _qt(seed=2)
    with _small(backend_cls, a.nbytes + b.nbytes // 2).open(0) as be:
        wa = be.upload(a)
        assert be.memory_used() == a.nbytes
        with pytest.raises(DeviceOutOfMemoryError) as err:
            be.upload(b)
        assert err.value.requested_bytes == b.nbytes
        assert err.value.held_bytes == a.nbytes
        assert be.memory_used() == a.nbytes  # nothing of b stays allocated
        # a failing expert upload frees the matrices it had already placed
        be.free(wa)
        with pytest.raises(DeviceOutOfMemoryError):
            be.upload_expert(a, _qt(seed=3), _qt(32, 16, seed=4))
        assert be.memory_used() == 0
        # the backend still works after the failures
        w = be.upload(b)
        x = np.ones((1, 32), np.float32)
        np.testing.assert_allclose(be.matmul(x, w), quant.matmul_ref(x, b), rtol=1e-4, atol=1e-4)


def test_numpy_backend_capacity_argument():
    cls = get_backend("numpy")
    qt = _qt()
    be = cls(cls.list_devices()[0], capacity_bytes=qt.nbytes - 1)
    with pytest.raises(DeviceOutOfMemoryError) as err:
        be.upload(qt)
    assert (err.value.requested_bytes, err.value.held_bytes, err.value.capacity_bytes) == (
        qt.nbytes, 0, qt.nbytes - 1)
    assert be.memory_used() == 0


def test_free_twice_and_foreign_weights(backend_cls):
    with backend_cls.open(0) as be, backend_cls.open(0) as other:
        w = be.upload(_qt())
        be.free(w)
        assert be.memory_used() == 0
        with pytest.raises(InputError, match="already freed"):
            be.free(w)
        with pytest.raises(InputError, match="already freed"):
            be.matmul(np.ones((1, 32), np.float32), w)
        w2 = other.upload(_qt())
        with pytest.raises(InputError, match="not uploaded by this"):
            be.matmul(np.ones((1, 32), np.float32), w2)
        other.free(w2)


def test_closed_backend_refuses_work(backend_cls):
    be = backend_cls.open(0)
    w = be.upload(_qt())
    be.close()
    be.close()  # harmless
    assert be.memory_used() == 0
    with pytest.raises(InputError, match="closed"):
        be.matmul(np.ones((1, 32), np.float32), w)
    with pytest.raises(InputError, match="closed"):
        be.upload(_qt())
    with pytest.raises(InputError, match="closed"):
        be.expert_ffn([], [])


def test_wrong_shapes_and_inputs(backend_cls):
    with backend_cls.open(0) as be:
        w = be.upload(_qt())
        for x in (np.ones((1, 33), np.float32), np.ones(32, np.float32), np.ones((0, 32), np.float32)):
            with pytest.raises(InputError):
                be.matmul(x, w)
        with pytest.raises(InputError, match="QuantTensor"):
            be.upload(np.ones((4, 4), np.float32))
        gate, up, down = (be.upload(q) for q in (_qt(16, 32), _qt(16, 32, seed=1), _qt(32, 16)))
        e = ExpertWeights(gate, up, down)
        with pytest.raises(InputError, match="inputs for"):
            be.expert_ffn([np.ones((1, 32), np.float32)] * 2, [e])
        with pytest.raises(InputError, match="gate/up"):
            be.expert_ffn([np.ones((1, 32), np.float32)], [ExpertWeights(gate, up, gate)])
        with pytest.raises(InputError):
            be.d_rmsnorm(be.d_put(np.ones((2, 8), np.float32)), be.d_put(np.ones(7, np.float32)), 1e-6)
        # activations of another dtype are converted, not rejected
        y = be.matmul(np.ones((2, 32), np.float64), w)
        assert y.dtype == np.float32 and y.shape == (2, 16)


def test_unsupported_format_is_refused():
    cls = type("F32Only", (get_backend("numpy"),), {"formats": ("f32",)})
    with cls.open(0) as be:
        with pytest.raises(InputError, match="does not support format int4"):
            be.upload(_qt())
        assert be.memory_used() == 0


def test_cpu_backend_reports_missing_numba(monkeypatch):
    import importlib.util

    cls = get_backend("cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "numba" else real(n, *a))
    assert "numba" in cls.unavailable_reason()
    assert cls.list_devices() == []
    assert not cls.is_available()


def test_cli_backends_json_lists_every_backend():
    res = CliRunner().invoke(cli, ["backends", "--json"])
    assert res.exit_code == 0, res.output
    report = {b["name"]: b for b in json.loads(res.output)["backends"]}
    assert list(report) == list(BACKEND_NAMES)
    numpy_dev = report["numpy"]["devices"][0]
    assert report["numpy"]["available"] and numpy_dev["kind"] == "cpu"
    assert numpy_dev["total_memory_bytes"] > 0 and set(numpy_dev["formats"]) == set(quant.FORMATS)
    for b in report.values():
        assert b["available"] == (b["reason"] is None) and (b["available"] or b["devices"] == [])


def test_cli_backends_survives_a_broken_stack(monkeypatch):
    def boom(cls):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(get_backend("numpy"), "unavailable_reason", classmethod(boom))
    import colibri_plan.backends as bk

    real = bk.get_backend
    monkeypatch.setattr(bk, "get_backend", lambda n: (_ for _ in ()).throw(OSError("no libvulkan.so.1"))
                        if n == "vulkan" else real(n))
    res = CliRunner().invoke(cli, ["backends"])
    assert res.exit_code == 0, res.output
    assert "driver exploded" in res.output and "no libvulkan.so.1" in res.output
    assert issubclass(get_backend("cpu"), Backend)


def test_every_backend_is_one_class_over_the_base_and_declares_its_optional_ops():
    """Composition, not a stack of mixins: each backend class derives from Backend alone (its parts are
    objects it holds); every op of the Protocol is supported; supports() answers optional ops from the
    class's declaration, and refuses a name that is no op of the contract."""
    from colibri_plan.backends.contract import OPTIONAL_OPS, REQUIRED_OPS
    from colibri_plan.backends.device_ops import DeviceOps

    assert {"d_add", "d_head_matmul", "d_write_rows", "matmul", "upload", "close"} <= REQUIRED_OPS
    assert set(OPTIONAL_OPS) == {"d_expert_ffn_rows", "d_router_topk", "expert_ffn_sum", "d_capture_step",
                                 "upload_expert_mapped", "d_attention_prologue"}
    declared = {}
    for name in BACKEND_NAMES:
        cls = get_backend(name)
        assert cls.__mro__[1:] == (Backend, DeviceOps, object), cls.__mro__
        assert all(cls.supports(op) for op in REQUIRED_OPS)
        declared[name] = {op for op in OPTIONAL_OPS if cls.supports(op)}
        assert declared[name] == set(cls.optional_ops)
    assert [n for n in BACKEND_NAMES if "d_expert_ffn_rows" in declared[n]] == ["cuda"]
    assert [n for n in BACKEND_NAMES if "d_capture_step" in declared[n]] == ["cuda"]
    assert [n for n in BACKEND_NAMES if "expert_ffn_sum" in declared[n]] == ["cpu"]
    assert [n for n in BACKEND_NAMES if "upload_expert_mapped" in declared[n]] == ["cuda"]
    assert [n for n in BACKEND_NAMES if "d_attention_prologue" in declared[n]] == ["cpu", "cuda"]
    assert all("d_router_topk" in ops for ops in declared.values())  # a kernel or the host arrays' rule
    assert not any(Backend.supports(op) for op in OPTIONAL_OPS)  # the base declares none
    with pytest.raises(InputError, match="'d_ad' is not an op"):
        get_backend("numpy").supports("d_ad")


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_an_open_backend_has_what_it_declares_and_its_hooks_bound(name, tmp_path, monkeypatch):
    """What ``supports`` says is what an open backend has (the engine may stop probing with getattr):
    each optional op it declares is a callable, each it does not is absent; the Protocol's members are
    all there; the device-op hooks are bound on the instance at open (one lookup per call) or are methods
    of the backend class itself, never found through a chain of mixins."""
    from colibri_plan.backends.contract import ComputeBackend

    monkeypatch.setenv("COLIBRI_PLAN_CACHE_DIR", str(tmp_path))
    cls = get_backend(name)
    if cls.unavailable_reason() is not None or not cls.list_devices():
        pytest.skip(f"{name}: {cls.unavailable_reason() or 'no devices found'}")
    with cls.open(0) as be:
        assert isinstance(be, ComputeBackend)
        for op in ("d_expert_ffn_rows", "expert_ffn_sum"):
            assert callable(getattr(be, op, None)) == be.supports(op), op
        hooks = ("_d_add", "_d_matmul", "_d_attention", "_d_head_matmul", "_d_write_block")
        assert all(h in vars(be) or h in vars(cls) for h in hooks)  # bound at open, or the class's own
