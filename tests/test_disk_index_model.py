"""DiskIndex (a plain class) against a simple model: files in LRU order by their last touch,
whole-file eviction (exactly the keys the model evicts), stuck and unreadable files in the
bytes, counted pins, replace=True moves at a restart, remove_files and shrink at attach."""
import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvactors.tiers.disk_index import DiskFile, DiskIndex, NoRoomError

KEYS = st.lists(st.integers(0, 9).map(lambda i: bytes([i])), min_size=1, max_size=4)


class Model(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.failing: set[str] = set()
        self.index = DiskIndex(400, self._unlink)
        self.clock = itertools.count()
        self.seq = itertools.count()
        # model
        self.key_file: dict[bytes, str] = {}
        self.file_keys: dict[str, set[bytes]] = {}
        self.file_size: dict[str, int] = {}
        self.file_bb: dict[str, int] = {}
        self.file_last: dict[str, int] = {}
        self.objs: dict[str, DiskFile] = {}
        self.pins: list[bytes] = []
        self.on_disk: dict[str, int] = {}  # files on disk (name -> size), incl. stuck
        self.unreadable_bytes = 0
        self.attached = False

    def _unlink(self, name):
        if name in self.failing:
            return False
        self.on_disk.pop(name, None)
        return True

    # ---- model helpers
    def _m_remove(self, key):
        name = self.key_file.pop(key, None)
        if name is None:
            return
        self.file_keys[name].discard(key)
        if not self.file_keys[name]:
            del self.file_keys[name], self.file_last[name]

    def _m_victims(self, need):
        room, out = 0, []
        for name in sorted(self.file_keys, key=lambda n: self.file_last[n]):
            if any(k in self.pins for k in self.file_keys[name]):
                continue
            out.append(name)
            room += self.file_size[name]
            if room >= need:
                return out
        return None

    def _add(self, keys, replace, bb=10):
        size = 50 + 10 * len(keys)
        name = f"f{next(self.seq)}"
        f = DiskFile(name, size, bb)
        if not replace:
            evicted = []
            stuck_before = self.index.stuck_files
            # model of reserve, when nothing stuck / failing
            need = self.index.used + self.index.reserved + size - self.index.capacity
            exp = None if need <= 0 else self._m_victims(need)
            try:
                self.index.reserve(size, evicted)
            except NoRoomError:
                if not self.failing and not stuck_before:
                    assert need > 0 and exp is None and evicted == []
                for k in evicted:
                    self._m_remove(k)
                return
            if not self.failing and not stuck_before and need > 0:
                exp_keys = {k for n in exp for k in self.file_keys[n]}
                assert set(evicted) == exp_keys, (evicted, exp)
            for k in evicted:
                self._m_remove(k)
            self.on_disk[name] = size
            entries = [(k, j, 0) for j, k in enumerate(dict.fromkeys(keys))]
            added = self.index.add(f, entries, reserved=size)
            fresh = [k for k in dict.fromkeys(keys) if k not in self.key_file]
            assert added == fresh
            if not added:
                self.index.abandon(name, size)
                if name not in self.failing:
                    self.on_disk.pop(name, None)
                return
        else:
            self.on_disk[name] = size
            entries = [(k, j, 0) for j, k in enumerate(dict.fromkeys(keys))]
            added = self.index.add(f, entries, replace=True)
            assert added == list(dict.fromkeys(keys))
            for k in added:
                self._m_remove(k)
        self.objs[name] = f
        self.file_size[name] = size
        self.file_bb[name] = bb
        self.file_keys[name] = set(added)
        self.file_last[name] = next(self.clock)
        for k in added:
            self.key_file[k] = name

    @rule(keys=KEYS)
    def store(self, keys):
        self._add(keys, replace=False)

    @precondition(lambda self: not self.attached)
    @rule(keys=KEYS, bb=st.sampled_from([10, 20]))
    def restart_add(self, keys, bb):
        self._add(keys, replace=True, bb=bb)

    @precondition(lambda self: not self.attached)
    @rule(size=st.integers(0, 120))
    def unreadable(self, size):
        self.index.keep_unreadable(size)
        self.unreadable_bytes += size

    @precondition(lambda self: not self.attached)
    @rule()
    def attach(self):
        self.attached = True
        stale = self.index.remove_files(lambda f: f.block_bytes != 10)
        exp = {k for n, ks in self.file_keys.items() if self.file_bb[n] != 10 for k in ks}
        assert set(stale) == exp
        for k in stale:
            self._m_remove(k)
        ev = self.index.shrink()
        for k in ev:
            self._m_remove(k)
        if not self.failing and not self.pins and self.unreadable_bytes <= self.index.capacity:
            assert self.index.used <= self.index.capacity

    @rule(keys=KEYS)
    def remove(self, keys):
        for k in keys:
            assert self.index.remove(k) == (k in self.key_file)
            self._m_remove(k)

    @rule(keys=KEYS)
    def touch(self, keys):
        for k in keys:
            assert self.index.touch(k) == (k in self.key_file)
            if k in self.key_file:
                self.file_last[self.key_file[k]] = next(self.clock)

    @rule(keys=KEYS)
    def pin(self, keys):
        self.index.pin(keys)
        self.pins.extend(keys)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        i = data.draw(st.integers(0, len(self.pins) - 1))
        k = self.pins.pop(i)
        self.index.unpin([k])

    @rule(data=st.data())
    def toggle_fail(self, data):
        names = sorted(self.on_disk)
        if names:
            n = data.draw(st.sampled_from(names))
            self.failing ^= {n}

    @invariant()
    def agree(self):
        ix = self.index
        assert len(ix) == len(self.key_file)
        for k, n in self.key_file.items():
            assert ix.get(k).file is self.objs[n]
        exp_order = sorted(self.file_keys, key=lambda n: self.file_last[n])
        assert [f.name for f in ix.files()] == exp_order
        for n, ks in self.file_keys.items():
            assert set(self.objs[n].keys) == ks
        # used counts exactly the files on disk (indexed + stuck) + unreadable
        assert ix.reserved == 0
        assert ix.used == sum(self.on_disk.values()) + self.unreadable_bytes, (ix.used, self.on_disk)
        for k in set(self.pins):
            assert ix.pinned(k)
        if self.attached and not self.failing and ix.stuck_files == 0 and not self.pins \
                and self.unreadable_bytes <= ix.capacity:
            assert ix.used <= ix.capacity


Model.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestModel = pytest.mark.timeout(60)(Model.TestCase)
