"""The sandbox's confinement layers and the judge's plain-data codec."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consequence.sandbox.hardening import available_layers, layers_report, read_allowlist
from consequence.sandbox.judge import CODEC

NS: dict = {"json": json, "os": None}
exec(CODEC, NS)
enc, dec = NS["_enc"], NS["_dec"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.complex_numbers(allow_nan=False, allow_infinity=False)
)
hashables = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda c: st.tuples(c, c) | st.frozensets(c, max_size=3),
    max_leaves=6,
)
plain = st.recursive(
    scalars,
    lambda c: (
        st.lists(c, max_size=3)
        | st.tuples(c, c)
        | st.dictionaries(hashables, c, max_size=3)
        | st.sets(hashables, max_size=3)
    ),
    max_leaves=12,
)


def _shape(v) -> str:
    """Order-independent type-and-value text: equal iff values AND exact types match."""
    t = type(v).__name__
    if isinstance(v, (list, tuple)):
        return f"{t}[{', '.join(_shape(e) for e in v)}]"
    if isinstance(v, dict):
        return f"dict{{{', '.join(sorted(_shape(k) + ': ' + _shape(e) for k, e in v.items()))}}}"
    if isinstance(v, (set, frozenset)):
        return f"{t}{{{', '.join(sorted(_shape(e) for e in v))}}}"
    return f"{t}:{v!r}"


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(plain)
def test_codec_round_trip_keeps_values_and_exact_types(v):
    back = dec(json.loads(json.dumps(enc(v))))
    assert back == v and _shape(back) == _shape(v)


def test_codec_special_floats_and_rejections():
    back = dec(json.loads(json.dumps(enc([math.inf, -0.0, math.nan]))))
    assert back[0] == math.inf and math.copysign(1, back[1]) == -1 and math.isnan(back[2])

    class IntSubclass(int):
        pass

    for bad in (IntSubclass(1), [object()], {1: range(3)}, (lambda: 0)):
        with pytest.raises(ValueError, match="not plain data"):
            enc(bad)
    for frame in ({"q": []}, {"t": 1}, {"d": [[1]]}, {"s": [[1]]}, {"t": [], "d": []}):
        with pytest.raises((ValueError, TypeError)):
            dec(frame)


def test_layers_probe_and_allowlist():
    layers = available_layers()
    assert set(layers) == {"caps", "landlock", "seccomp"} and all(type(v) is bool for v in layers.values())
    assert isinstance(layers_report(), str) and layers_report()
    paths = read_allowlist()
    assert paths and not any("site-packages" in p or "dist-packages" in p for p in paths)


def test_probe_sees_each_layer_and_its_absence():
    from consequence.sandbox.hardening import _probe

    bare = _probe({})  # negative control: without confinement every attempt works
    assert (bare["read_outside"], bare["fork"], bare["stdlib"]) == (True, True, True)
    on = {k: v for k, v in available_layers().items() if v}
    if not on:
        pytest.skip("no confinement layer works on this host")
    seen = _probe(on)
    assert seen["stdlib"] is True
    if on.get("landlock"):
        assert seen["read_outside"] is False
    if on.get("seccomp"):
        assert seen["fork"] is False and seen["chown"] is False
