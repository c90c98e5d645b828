"""Files the evaluation writes are strict JSON (fileio.strict_json): a statistic over no data
is null, never a bare NaN that strict readers (jq, JavaScript, pandas' default) reject."""

from __future__ import annotations

import json
import math

from consequence.fileio import strict_json


def test_nan_and_inf_become_null_everywhere():
    obj = {"a": math.nan, "b": [math.inf, 1.5, (-math.inf, 2)], "c": {"d": 0.0, "e": "nan"}, "f": 3}
    text = strict_json(obj, sort_keys=True)
    assert text == '{"a": null, "b": [null, 1.5, [null, 2]], "c": {"d": 0.0, "e": "nan"}, "f": 3}'
    assert json.loads(text)["b"][1] == 1.5
