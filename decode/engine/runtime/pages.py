"""The host side of the paged KV cache: which pages of the pool each sequence holds,
and which full prompt pages can be shared by a later request with the same prefix.

    pool = PagePool(num_pages, page_size)
    hit = pool.match(prompt)           # the longest run of cached full pages that starts the prompt
    pages = pool.allocate(n)           # n more pages (None when the pool cannot give them)
    pool.publish(prompt, hit + pages)  # the prompt's full pages become shareable once written
    pool.release(hit + pages)          # the sequence ended: its references go

A page's content is named by its tokens and everything before them: the key of a full page is
(key of the page before it, its page_size tokens), a chain that starts at a root: ROOT, or the
root a caller names for K/V that is not the base model's (a LoRA adapter's rows: the same tokens
under another adapter are other content). Keys are exact (tuples of ids, no hash that could
collide). A page is in one of three states:

    free      in no sequence, holding nothing anyone can ask for;
    held      referenced by at least one live sequence (`refs` > 0); a published page may be held
              by several sequences at once (a shared prefix);
    cached    published, referenced by no live sequence: kept for a later prefix hit, evicted
              least recently used when `allocate` needs pages and none is free.

Every page is exactly one of them at all times (`check()` verifies it; the tests run it after every
operation of random workloads). Page 0..num_pages-1 are the pool's rows; nothing here touches a
device: the Decoder maps these ids into its page table between device calls.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from decode.config import DecodeConfigError, is_int

ROOT = 0   # the key of the empty prefix


class PoolError(ValueError):
    pass


@dataclasses.dataclass
class Stats:
    lookups: int = 0          # match() calls
    hit_pages: int = 0        # pages matched (their rows need no prefill)
    evictions: int = 0        # cached pages taken back for reuse


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise PoolError(f"a page pool needs num_pages >= 1 and page_size >= 1, got {num_pages}, "
                            f"{page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))      # a stack: low ids first
        self._refs = [0] * num_pages
        self._key_of: dict = {}                              # page -> its content key
        self._page_of: dict = {}                             # content key -> page
        self._node_of: dict = {}                             # page -> its chain id (for children)
        self._next_node = ROOT + 1
        self._cached: collections.OrderedDict = collections.OrderedDict()   # LRU: oldest first
        self.stats = Stats()

    # ------------------------------------------------------------------ what the pool holds
    @property
    def num_free(self) -> int:
        """Pages `allocate` can give now: free ones plus cached ones it may evict."""
        return len(self._free) + len(self._cached)

    @property
    def num_held(self) -> int:
        return sum(1 for r in self._refs if r > 0)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def pages_for(self, rows: int) -> int:
        """Pages that hold `rows` rows."""
        return -(-rows // self.page_size)

    # ------------------------------------------------------------------ prefix reuse
    def _keys(self, tokens, root=ROOT):
        """The content keys of the full pages of `tokens` under `root`, in order."""
        node, out, p = root, [], self.page_size
        for i in range(len(tokens) // p):
            key = (node, tuple(int(t) for t in tokens[i * p:(i + 1) * p]))
            out.append(key)
            page = self._page_of.get(key)
            node = self._node_of[page] if page is not None else None
            if node is None:      # nothing cached past here: later keys cannot match
                break
        return out

    def match(self, tokens, limit: int | None = None, root=ROOT) -> list[int]:
        """Take a reference on the cached full pages that start `tokens` (at most `limit` pages;
        callers keep at least the last prompt token out of the match, so the first forward has a
        token to read). Returns the pages in order; they are the sequence's first pages. `root`:
        the chain the prefix was published under."""
        self.stats.lookups += 1
        pages = self._hits(tokens, limit, root)
        for page in pages:
            self._take(page)
        self.stats.hit_pages += len(pages)
        return pages

    def cached(self, tokens, limit: int | None = None, root=ROOT) -> int:
        """How many pages `match` would give now (no reference taken, nothing counted)."""
        return len(self._hits(tokens, limit, root))

    def _hits(self, tokens, limit: int | None, root=ROOT):
        """The cached full pages that start `tokens` under `root`, in order (at most `limit`)."""
        pages = []
        for key in self._keys(tokens, root):
            page = self._page_of.get(key)
            if page is None or (limit is not None and len(pages) >= limit):
                break
            pages.append(page)
        return pages

    def publish(self, tokens, pages, root=ROOT) -> int:
        """After the rows of `tokens` are written into `pages` (the sequence's pages in order):
        make its full pages shareable under `root`. A full page whose content is already
        published under another page stays private (the first copy is the shared one). Returns
        pages published."""
        n = 0
        node = root
        p = self.page_size
        for i in range(min(len(tokens) // p, len(pages))):
            key = (node, tuple(int(t) for t in tokens[i * p:(i + 1) * p]))
            page = pages[i]
            owner = self._page_of.get(key)
            if owner is None and page not in self._key_of:
                self._page_of[key], self._key_of[page] = page, key
                self._node_of[page] = self._next_node
                self._next_node += 1
                owner = page
                n += 1
            if owner is None:       # this page already names other content: stop the chain
                break
            node = self._node_of[owner]
        return n

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int] | None:
        """n pages for a sequence (each with one reference), or None (nothing taken) when fewer
        than n are free or evictable."""
        if n < 0:
            raise PoolError(f"cannot allocate {n} pages")
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if not self._free:
                self._evict_one()
            page = self._free.pop()
            self._refs[page] = 1
            out.append(page)
        return out

    def release(self, pages) -> None:
        """Drop one reference on each page (a sequence ended or was cancelled)."""
        for page in pages:
            if not 0 <= page < self.num_pages or self._refs[page] <= 0:
                raise PoolError(f"page {page} is not held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._cached[page] = None          # most recently used at the end
                else:
                    self._free.append(page)

    def _take(self, page: int) -> None:
        if self._refs[page] == 0:
            self._cached.pop(page)
        self._refs[page] += 1

    def _evict_one(self) -> None:
        page, _ = self._cached.popitem(last=False)
        key = self._key_of.pop(page)
        del self._page_of[key]
        del self._node_of[page]
        self._free.append(page)
        self.stats.evictions += 1

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Every page is exactly one of free / held / cached; the key maps agree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise PoolError("a page is on the free list twice")
        held = {p for p, r in enumerate(self._refs) if r > 0}
        cached = set(self._cached)
        if free & held or free & cached or held & cached:
            raise PoolError(f"a page is in two states: free&held {free & held}, free&cached "
                            f"{free & cached}, held&cached {held & cached}")
        if free | held | cached != set(range(self.num_pages)):
            raise PoolError(f"pages lost: {set(range(self.num_pages)) - (free | held | cached)}")
        if any(self._refs[p] < 0 for p in range(self.num_pages)):
            raise PoolError("a negative reference count")
        if {self._page_of[k] for k in self._page_of} != set(self._key_of) or \
                any(self._page_of[k] != p for p, k in self._key_of.items()):
            raise PoolError("the key maps disagree")
        if not cached <= set(self._key_of) or free & set(self._key_of):
            raise PoolError("a cached page without a key, or a free page with one")


def static_batch_table(slots: int, shards: int, pages_per_shard: int, per_seq: int) -> np.ndarray:
    """The page table of a static batch (no pool bookkeeping): the i-th slot of shard d holds its
    shard's pages i * per_seq .. (i + 1) * per_seq - 1, as shard-major ids. int32 [slots, per_seq]."""
    slot = np.arange(slots)[:, None]
    per_shard = slots // shards
    return ((slot // per_shard) * pages_per_shard + (slot % per_shard) * per_seq
            + np.arange(per_seq)[None]).astype(np.int32)


class ShardedPool:
    """The pools of a Decoder whose slots are split over `shards` (data x fsdp): shard d owns
    page ids d * per_shard .. + per_shard - 1 (`wedlm_jax.attention.paged`'s shard-major ids)
    and a PagePool of its own over them; a slot's pages and prefix hits come from its shard's.
    One shard is the single pool. Ids in and out are the Decoder's (shard-major) ids."""

    def __init__(self, num_pages: int, page_size: int, shards: int = 1):
        if shards < 1 or num_pages % shards:
            raise PoolError(f"{num_pages} pages cannot be split evenly over {shards} shards")
        self.page_size, self.shards, self.per_shard = page_size, shards, num_pages // shards
        self.pools = [PagePool(self.per_shard, page_size) for _ in range(shards)]

    @property
    def num_pages(self) -> int:
        return self.per_shard * self.shards

    num_free = property(lambda self: sum(p.num_free for p in self.pools))
    num_held = property(lambda self: sum(p.num_held for p in self.pools))
    num_cached = property(lambda self: sum(p.num_cached for p in self.pools))

    @property
    def stats(self) -> Stats:
        return Stats(*(sum(getattr(p.stats, f.name) for p in self.pools)
                       for f in dataclasses.fields(Stats)))

    def free_in(self, shard: int) -> int:
        return self.pools[shard].num_free

    def cached(self, shard: int, tokens, limit: int | None = None, root=ROOT) -> int:
        return self.pools[shard].cached(tokens, limit, root)

    def _ids(self, shard: int, pages):
        return [shard * self.per_shard + p for p in pages]

    def _local(self, pages) -> dict:
        by = collections.defaultdict(list)
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise PoolError(f"page {page} is not in the pool (0 .. {self.num_pages - 1})")
            by[page // self.per_shard].append(page % self.per_shard)
        return by

    def match(self, shard: int, tokens, limit: int | None = None, root=ROOT) -> list[int]:
        return self._ids(shard, self.pools[shard].match(tokens, limit, root))

    def allocate(self, shard: int, n: int) -> list[int] | None:
        got = self.pools[shard].allocate(n)
        return None if got is None else self._ids(shard, got)

    def publish(self, tokens, pages, root=ROOT) -> int:
        by = self._local(pages)
        if len(by) > 1:
            raise PoolError(f"a sequence's pages span shards {sorted(by)}")
        return sum(self.pools[d].publish(tokens, local, root) for d, local in by.items())

    def release(self, pages) -> None:
        for d, local in self._local(pages).items():
            self.pools[d].release(local)

    def check(self) -> None:
        for pool in self.pools:
            pool.check()


def pool_size(page_size, num_pages, rows: int, slots: int, shards: int) -> tuple[int, int]:
    """(page_size, pages per layer) of a paged cache, (0, 0) for the dense one; checked. With
    slots over `shards` (data x fsdp) each shard has num_pages / shards pages of its own."""
    if page_size is None:
        if num_pages is not None:
            raise DecodeConfigError("num_pages needs page_size (a paged cache)")
        return 0, 0
    if not is_int(page_size) or page_size < 1:
        raise DecodeConfigError(f"page_size must be an int >= 1 (0: the dense cache), got "
                                f"{page_size!r}")
    per_seq = -(-rows // page_size)
    num_pages = slots * per_seq if num_pages is None else num_pages
    if not is_int(num_pages) or num_pages < 1:
        raise DecodeConfigError(f"num_pages must be an int >= 1 (a sequence at the capacity "
                                f"holds {per_seq} pages of {page_size} rows), got {num_pages!r}")
    if num_pages % shards:
        raise DecodeConfigError(f"num_pages {num_pages} must be a multiple of the mesh's data x "
                                f"fsdp size {shards}: each slot shard keeps a pool of its own")
    return int(page_size), int(num_pages)
