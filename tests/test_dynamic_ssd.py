"""Dynamic tables (hetero.dynamic) on the SSD tier (hetero.storage): rows and their optimizer
state as records of the tier's file under its row cache, against the same tables in memory."""

import pytest
import torch

from hetero.dynamic import DynamicConfig, Eviction, Keys
from hetero.embedding import HostEmbeddingCollection, TableConfig, move_tables_to_ssd
from hetero.optim import SparseOptimizerKind
from hetero.placement import StorageTier
from hetero.storage import SsdConfig

from test_dynamic import B, D, _user_item_steps, key_stream


@pytest.mark.parametrize("kind", [SparseOptimizerKind.LAZY_ADAM, SparseOptimizerKind.ROWWISE_ADAGRAD])
def test_a_dynamic_table_on_the_ssd_tier_trains_and_resumes_as_in_memory(tmp_path, kind):
    """Admission writes a new key's row and fresh state through the tier's row cache (a cache of 70
    rows of 161: most steps write back and read again); evicted rows are reused. Against the same
    tables in memory, step for step, and resumed from a state dict."""
    def build(directory=None):
        torch.manual_seed(0)
        record = 4 * D + 4 * (2 * D if kind is SparseOptimizerKind.LAZY_ADAM else 1)  # (the row, then its state)
        tier = dict(storage=StorageTier.SSD, ssd=SsdConfig(directory, cache_bytes=70 * record)) if directory else {}
        coll = HostEmbeddingCollection([
            TableConfig("user", 60, D, keys=Keys.DYNAMIC, init_std=0.1, **tier,
                        dynamic=DynamicConfig(admit_after=2, eviction=Eviction.LFU, evict_chunk=4, keep_floor=8,
                                              default_value=0.25, sketch_width=1 << 10)),
            TableConfig("item", 100, D, init_std=0.1, **tier)])
        return coll, kind.optimizer(coll.tables.values())

    stream = key_stream(40, 600, seed=3)
    items = [torch.from_numpy(k[:B] % 100) for k in stream]

    def run(coll, opt, steps):
        return _user_item_steps(coll, opt, stream, items, steps, lambda u, i: (u * i).sum().square())

    memory, memory_opt = build()
    straight = run(memory, memory_opt, range(40))
    assert memory.tables["user"].keymap.stats.evicted > 0
    ssd, ssd_opt = build(tmp_path / "a")
    first = run(ssd, ssd_opt, range(20))
    saved, saved_opt = ssd.state_dict(), ssd_opt.state_dict()  # (the rows read from the tier)
    resumed, resumed_opt = build(tmp_path / "b")
    resumed.load_state_dict(saved)
    resumed_opt.load_state_dict(saved_opt)
    assert first + run(resumed, resumed_opt, range(20, 40)) == straight
    assert resumed.groups[0].ssd.cache.stats.write_backs > 100 and resumed.groups[0].ssd.cache.capacity == 70
    a, b = memory.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = memory_opt.state_dict()["state"], resumed_opt.state_dict()["state"]
    assert all(torch.equal(sa[t][s], sb[t][s]) for t in sa for s in sa[t])
    # new keys admitted by a lookup that no update follows: their rows reach the file too
    fresh = {"user": torch.arange(10**6, 10**6 + 3).repeat(2), "item": torch.arange(6)}
    memory(fresh), resumed(fresh)
    cache = resumed.groups[0].ssd.cache
    cache.flush()
    cache.clear()  # (what a later batch's misses would do: the rows from the file)
    a, b = memory.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_dynamic_table_moved_to_the_ssd_tier_keeps_its_rows_and_default_row(tmp_path):
    torch.manual_seed(0)
    coll = HostEmbeddingCollection([TableConfig("user", 10, D, keys=Keys.DYNAMIC, init_std=0.1,
                                                dynamic=DynamicConfig(default_value=0.25))])
    coll.train()
    coll({"user": torch.tensor([5, 7])})  # admitted: rows 0 and 1 take the keys' initial values
    before = coll.tables["user"].weight.detach().clone()
    move_tables_to_ssd(coll, ["tables.user"], SsdConfig(tmp_path))
    after = coll.state_dict()["tables.user.weight"]
    assert torch.equal(after, before) and torch.equal(after[10], torch.full((D,), 0.25))
    coll.eval()  # (a lookup that admits nothing: key 8 reads the default row, from the tier)
    assert torch.equal(coll({"user": torch.tensor([7, 8])})["user"], torch.stack([before[1], torch.full((D,), 0.25)]))
