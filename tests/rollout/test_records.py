import pytest

from consequence.records import (
    ModelCall,
    TrainingRow,
    Trajectory,
    read_trajectories,
    trajectory_to_rows,
    write_trajectories,
)


def _traj():
    c1 = ModelCall([1, 2, 3], [10, 11, 99], [-0.1, -0.2, -0.3], "stop", observation_ids=[7, 8])
    c2 = ModelCall([1, 2, 3, 10, 11, 99, 7, 8], [12, 99], [-0.4, -0.5], "stop", observation_ids=[5])
    return Trajectory("p#0", "0/p#0", 0, 0, 0, calls=[c1, c2])


def test_append_only_calls_merge_into_one_row_with_exact_mask():
    rows = trajectory_to_rows(_traj())
    assert len(rows) == 1
    r = rows[0]
    assert r.input_ids == [1, 2, 3, 10, 11, 99, 7, 8, 12, 99]  # last observation dropped
    assert r.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert r.old_logprobs == [0, 0, 0, -0.1, -0.2, -0.3, 0, 0, -0.4, -0.5]
    assert len(r.loss_mask) == len(r.input_ids)


def test_rewritten_context_starts_a_new_row():
    t = _traj()
    t.calls[1].context_ids = [1, 2, 42, 7, 8]  # the context builder rewrote history
    rows = trajectory_to_rows(t)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 10, 11, 99], [1, 2, 42, 7, 8, 12, 99]]
    assert rows[1].loss_mask == [0, 0, 0, 0, 0, 1, 1]


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="log-prob"):
        ModelCall([1], [2, 3], [-1.0], "stop")
    with pytest.raises(ValueError, match="lengths differ"):
        TrainingRow([1, 2], [0], [0.0, 0.0])


def test_parquet_round_trip_is_exact(tmp_path):
    t = _traj()
    t.calls[0].tool_calls = [{"name": "replace_line", "arguments": {"line": 2, "code": "    x = 1"}}]
    t.messages = [{"role": "user", "content": "hi"}]
    t.reward, t.reward_components = 1.0, {"hidden_tests": 1.0}
    path = tmp_path / "iter_0000.parquet"
    write_trajectories(path, [t, t])
    back = read_trajectories(path)
    assert back[0] == t and len(back) == 2
    assert not list(tmp_path.glob(".*tmp*"))  # nothing half-written left behind


def test_parquet_round_trip_keeps_env_retries(tmp_path):
    ok, failed = _traj(), _traj()
    ok.env_retries, ok.reward = 2, 1.0  # scored after two re-runs of its sandbox
    failed.outcome, failed.env_retries, failed.error = "env_error", 2, "sandbox: x; gave up after 3 attempts"
    path = tmp_path / "iter_0001.parquet"
    write_trajectories(path, [ok, failed, _traj()])
    back = read_trajectories(path)
    assert [t.env_retries for t in back] == [2, 2, 0] and back == [ok, failed, _traj()]
    # a file written before the field existed reads back with 0 retries
    import pyarrow.parquet as pq

    old = tmp_path / "old.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["env_retries"]), old)
    assert [t.env_retries for t in read_trajectories(old)] == [0, 0, 0]


def test_invalid_calls_round_trip_and_old_files_read_without_them(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = _traj()
    t.calls[0].invalid_calls = ["unknown_tool", "bad_arguments"]
    path = tmp_path / "iter_0000.parquet"
    write_trajectories(path, [t, _traj()])
    back = read_trajectories(path)
    assert back == [t, _traj()] and back[0].calls[0].invalid_calls == ["unknown_tool", "bad_arguments"]
    # a file written before the field existed: its calls lack the column and read back with []
    table = pq.read_table(path)
    calls = table.column("calls").combine_chunks()
    struct = calls.values
    kept = [f.name for f in struct.type if f.name != "invalid_calls"]
    old_struct = pa.StructArray.from_arrays([struct.field(n) for n in kept], names=kept)
    old_calls = pa.ListArray.from_arrays(calls.offsets, old_struct)
    old = tmp_path / "old.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("calls"), "calls", old_calls), old)
    assert "invalid_calls" not in str(pq.read_schema(old))
    assert [c.invalid_calls for x in read_trajectories(old) for c in x.calls] == [[] for x in back for c in x.calls]


def test_unknown_stop_reason_is_rejected():
    with pytest.raises(ValueError, match="stop_reason"):
        ModelCall([1], [2], [-1.0], "stopp")


def test_to_dict_equals_asdict_and_is_a_copy():
    import dataclasses

    t = _traj()
    t.calls[0].keep_ids = [[5, 6], [7]]
    t.calls[0].tool_calls = [{"name": "run_tests", "arguments": {"k": [1, 2]}}]
    t.messages = [{"role": "user", "content": "x", "tool_calls": [{"a": [1]}]}]
    t.tool_histogram, t.env_rewards, t.reward_components = {"run_tests": 1}, {"hidden_tests": 1.0}, {"a": 0.5}
    d = t.to_dict()
    assert d == dataclasses.asdict(t) and list(d) == list(dataclasses.asdict(t))
    d["calls"][0]["context_ids"].append(99)
    d["calls"][0]["keep_ids"][0].append(99)
    d["calls"][0]["tool_calls"][0]["arguments"]["k"].append(99)
    d["messages"][0]["tool_calls"][0]["a"].append(99)
    assert t.to_dict() == dataclasses.asdict(t) != d  # nothing of the record was shared
