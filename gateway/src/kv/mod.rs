//! The paged KV cache as the gateway sees it: which physical pages exist on the ranks, who
//! uses them, and which hold a reusable prefix.
//!
//! - Pages have a fixed size (`page_size` tokens, 64 by default) and are numbered
//!   `0..n_pages` (the ranks' Describe `n_pages`). Ranks never allocate: every page a step
//!   writes was handed out here.
//! - The prefix cache covers FULL pages only. A page's key is a hash chain
//!   `key = H(parent_key, tokens of the page)` from [`ROOT`], so a page is found only when every
//!   page before it matches too. Entries also store their parent key and tokens and a lookup
//!   compares them, so a 64-bit hash collision can never hand out a wrong page.
//! - Pages are reference counted. A cached page with no references sits in an LRU list and is
//!   evicted only when an allocation finds the free list empty ("only when memory is needed").
//!   On release, deeper pages of a chain are made older than the pages before them, so eviction
//!   eats chains from their tails and never strands a cached suffix behind an evicted parent.
//! - A page being written by a sequence is private; it becomes shared ([`KvCache::publish`])
//!   once full and accepted by every rank (the handshake). If another sequence already
//!   published an identical page the new one stays private and is freed on release.

use std::collections::{BTreeMap, HashMap};

/// A physical KV page index on the ranks.
pub type PageId = u32;

/// The key of the empty prefix: parent of a sequence's first page.
pub const ROOT: u64 = 0x6d69_6e69_6d61_7821;

/// The chain hash of a full page: FNV-1a over the parent key and the page's token ids,
/// finished with a SplitMix64 mix. Stable across runs and platforms.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parent.to_le_bytes() {
        h = (h ^ b as u64).wrapping_mul(PRIME);
    }
    for t in tokens {
        for b in t.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(PRIME);
        }
    }
    let mut z = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[derive(Clone, Debug, Default)]
struct Page {
    refs: u32,
    /// The cache key when this page is published.
    key: Option<u64>,
    /// LRU position (higher = more recently used); meaningful for cached pages.
    tick: u64,
}

#[derive(Clone, Debug)]
struct Entry {
    page: PageId,
    parent: u64,
    tokens: Box<[u32]>,
}

/// One matched page of a prefix lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    pub key: u64,
    pub page: PageId,
}

/// Counters for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Prompt tokens looked up in the prefix cache (requests that use it).
    pub lookup_tokens: u64,
    /// Of those, tokens served from cached pages.
    pub hit_tokens: u64,
    /// Cached pages evicted to make room.
    pub evictions: u64,
}

/// Page allocator + prefix cache for one rank world.
#[derive(Debug)]
pub struct KvCache {
    page_size: usize,
    pages: Vec<Page>,
    free: Vec<PageId>,
    index: HashMap<u64, Entry>,
    /// Unreferenced cached pages by tick (oldest first).
    lru: BTreeMap<u64, PageId>,
    tick: u64,
    stats: KvStats,
}

impl KvCache {
    /// A cache of `n_pages` empty pages of `page_size` tokens.
    pub fn new(page_size: usize, n_pages: usize) -> Self {
        assert!(page_size > 0, "page size must be positive");
        Self {
            page_size,
            pages: vec![Page::default(); n_pages],
            // Pop from the end: hand out low page numbers first (easier to read in logs).
            free: (0..n_pages as PageId).rev().collect(),
            index: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            stats: KvStats::default(),
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn n_pages(&self) -> usize {
        self.pages.len()
    }

    /// Pages on the free list (never written or already forgotten).
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Cached pages nobody references (evictable).
    pub fn evictable_pages(&self) -> usize {
        self.lru.len()
    }

    /// Pages an allocation could obtain right now.
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Pages referenced by at least one sequence.
    pub fn used_pages(&self) -> usize {
        self.pages.len() - self.available()
    }

    /// Pages holding a published prefix (referenced or not).
    pub fn cached_pages(&self) -> usize {
        self.index.len()
    }

    pub fn stats(&self) -> KvStats {
        self.stats
    }

    /// References held on `page` (for tests and debugging).
    pub fn refs(&self, page: PageId) -> u32 {
        self.pages[page as usize].refs
    }

    /// The longest chain of cached full pages that prefixes `tokens`, at most `max_pages`
    /// pages. No side effects.
    pub fn lookup(&self, tokens: &[u32], max_pages: usize) -> Vec<Hit> {
        let mut hits = Vec::new();
        let mut parent = ROOT;
        for chunk in tokens.chunks_exact(self.page_size).take(max_pages) {
            let key = chain_hash(parent, chunk);
            match self.index.get(&key) {
                Some(e) if e.parent == parent && *e.tokens == *chunk => {
                    hits.push(Hit { key, page: e.page });
                    parent = key;
                }
                _ => break,
            }
        }
        hits
    }

    /// Looks up and references the cached prefix of a prompt. At least one prompt token is
    /// always left uncached (the ranks must compute the last token's logits), so at most
    /// `(len - 1) / page_size` pages are reused. `touch` marks the pages most recently used;
    /// teacher-forced scoring passes `false`. Counts the lookup in the hit statistics.
    pub fn acquire_prefix(&mut self, prompt: &[u32], touch: bool) -> Vec<Hit> {
        let max_pages = prompt.len().saturating_sub(1) / self.page_size;
        let hits = self.lookup(prompt, max_pages);
        self.stats.lookup_tokens += prompt.len() as u64;
        self.stats.hit_tokens += (hits.len() * self.page_size) as u64;
        for h in &hits {
            self.retain(h.page, touch);
        }
        hits
    }

    /// Takes a reference on a page (removing it from the LRU list if it was unreferenced).
    fn retain(&mut self, page: PageId, touch: bool) {
        let tick = if touch { self.next_tick() } else { 0 };
        let p = &mut self.pages[page as usize];
        if p.refs == 0 && p.key.is_some() {
            self.lru.remove(&p.tick);
        }
        p.refs += 1;
        if touch {
            p.tick = tick;
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Allocates `n` pages (referenced once each), all or nothing: from the free list first,
    /// then by evicting the least recently used unreferenced cached pages.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<PageId>> {
        if n > self.available() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let page = match self.free.pop() {
                Some(p) => p,
                None => self.evict_one().expect("available() counted an evictable page"),
            };
            let p = &mut self.pages[page as usize];
            debug_assert_eq!(p.refs, 0);
            p.refs = 1;
            p.key = None;
            out.push(page);
        }
        Some(out)
    }

    fn evict_one(&mut self) -> Option<PageId> {
        let (_, page) = self.lru.pop_first()?;
        let p = &mut self.pages[page as usize];
        if let Some(key) = p.key.take() {
            self.index.remove(&key);
        }
        self.stats.evictions += 1;
        Some(page)
    }

    /// Publishes a full page a sequence has written (and every rank accepted) under the chain
    /// key of `parent` + `tokens`. Returns the page's key, the parent of the next page. If the
    /// same content is already cached in another page, this page stays private.
    pub fn publish(&mut self, page: PageId, parent: u64, tokens: &[u32]) -> u64 {
        debug_assert_eq!(tokens.len(), self.page_size);
        let key = chain_hash(parent, tokens);
        if self.pages[page as usize].key.is_some() {
            return key; // already published (an adopted prefix page)
        }
        if let Some(e) = self.index.get(&key)
            && e.parent == parent
            && *e.tokens == *tokens
        {
            return key;
        }
        if self.index.contains_key(&key) {
            return key; // a true 64-bit collision: keep the older entry, this page stays private
        }
        self.index.insert(key, Entry { page, parent, tokens: tokens.into() });
        self.pages[page as usize].key = Some(key);
        key
    }

    /// Drops one reference on each of a sequence's pages (given in logical order). Pages that
    /// reach zero references go to the LRU list when cached (most recently used when `touch`;
    /// otherwise back to where they were), else to the free list.
    pub fn release(&mut self, pages: &[PageId], touch: bool) {
        // Deeper pages get older ticks, so eviction takes chains from their tails.
        let base = self.tick;
        if touch {
            self.tick += pages.len() as u64;
        }
        for (i, &page) in pages.iter().enumerate() {
            let p = &mut self.pages[page as usize];
            debug_assert!(p.refs > 0, "double release of page {page}");
            p.refs = p.refs.saturating_sub(1);
            if touch {
                p.tick = base + (pages.len() - i) as u64;
            }
            if p.refs == 0 {
                if p.key.is_some() {
                    let mut tick = p.tick;
                    // Ticks are unique LRU keys; an untouched page keeps its old position
                    // unless that slot was taken meanwhile (then just after it).
                    while self.lru.contains_key(&tick) {
                        tick += 1;
                    }
                    p.tick = tick;
                    self.lru.insert(tick, page);
                    if tick > self.tick {
                        self.tick = tick;
                    }
                } else {
                    self.free.push(page);
                }
            }
        }
    }

    /// Forgets everything (the rank world restarted: every page's contents are gone).
    pub fn clear(&mut self) {
        let n = self.pages.len();
        let stats = self.stats;
        *self = Self::new(self.page_size, n);
        self.stats = stats;
    }

    /// Resizes after a restart that reported a different page count; drops all contents.
    pub fn reset(&mut self, page_size: usize, n_pages: usize) {
        let stats = self.stats;
        *self = Self::new(page_size, n_pages);
        self.stats = stats;
    }

    /// Internal consistency (tests): every page is exactly one of free / referenced /
    /// evictable, and the index agrees with the page keys.
    pub fn check_invariants(&self) {
        let mut seen = vec![0u8; self.pages.len()];
        for &p in &self.free {
            seen[p as usize] += 1;
            assert_eq!(self.pages[p as usize].refs, 0);
            assert!(self.pages[p as usize].key.is_none());
        }
        for (&t, &p) in &self.lru {
            seen[p as usize] += 1;
            assert_eq!(self.pages[p as usize].refs, 0);
            assert_eq!(self.pages[p as usize].tick, t);
            assert!(self.pages[p as usize].key.is_some());
        }
        for (i, p) in self.pages.iter().enumerate() {
            if p.refs > 0 {
                seen[i] += 1;
            }
            if let Some(k) = p.key {
                assert_eq!(self.index[&k].page, i as PageId);
            }
        }
        assert!(seen.iter().all(|&s| s == 1), "page accounting broken: {seen:?}");
        assert_eq!(self.index.len(), self.pages.iter().filter(|p| p.key.is_some()).count());
    }
}

#[cfg(test)]
mod tests;
