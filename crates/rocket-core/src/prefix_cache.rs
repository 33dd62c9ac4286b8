//! Prefix reuse across requests: KV caches of earlier prompts, kept by their
//! token ids, so a new prompt that starts with the same tokens skips their
//! prefill. This module only keeps the entries (lookup of the longest cached
//! block-aligned prefix, insert, least-recently-used eviction by bytes); the
//! batcher copies KV in and out of them (`Backend::copy_prefix`).
//!
//! The rule that makes reuse bitwise invisible on every backend: KV is cached
//! and reused only in whole blocks of `block` tokens counted from the start of
//! the prompt, of prompts whose first pass had at least the backend's
//! `pass_shared_rows().first` rows, and a request reusing a prefix still computes
//! at least `pass_shared_rows().later` tokens (`rest` below), in passes of at least
//! that many rows (`batch::chunk_end`). A row's bits do not depend on the length
//! of such passes, so both runs give every row the same bits, however their
//! passes were cut. The CPU backend's per-row math allows any split (1 and 1);
//! the GPU's products round differently in shorter passes.
//! Only prompt KV written by prefill is cached: generated tokens' KV comes from
//! one-row decode steps, which a later prefill of the same tokens would not
//! reproduce bit for bit on the GPU.

/// What the cache has done since it was made (monotonic counts, and what it
/// holds now).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompts looked up.
    pub lookups: u64,
    /// Lookups that found at least one block to reuse.
    pub hits: u64,
    /// Prompt tokens whose prefill was skipped, summed over hits.
    pub tokens_reused: u64,
    /// Entries added.
    pub inserts: u64,
    /// Entries dropped to stay within the byte budget (or to make room on the device).
    pub evictions: u64,
    /// Entries held now.
    pub entries: usize,
    /// Bytes the entries hold now (at most the budget).
    pub bytes: usize,
}

impl std::ops::Add for PrefixCacheStats {
    type Output = PrefixCacheStats;
    /// Two caches' figures together (a router's engines each keep their own).
    fn add(self, o: PrefixCacheStats) -> PrefixCacheStats {
        PrefixCacheStats {
            lookups: self.lookups + o.lookups,
            hits: self.hits + o.hits,
            tokens_reused: self.tokens_reused + o.tokens_reused,
            inserts: self.inserts + o.inserts,
            evictions: self.evictions + o.evictions,
            entries: self.entries + o.entries,
            bytes: self.bytes + o.bytes,
        }
    }
}

struct Entry<V> {
    tokens: Vec<u32>,
    value: V,
    bytes: usize,
    /// The clock value of the last lookup or insert that used it.
    last_used: u64,
}

/// Cached prompt prefixes of whole blocks, each a value `V` (a KV cache) of
/// `bytes`, at most `max_bytes` in all. Entries are whole prompts' aligned
/// prefixes; one that another entry extends is dropped (the longer covers it),
/// so the entries of a chat's turns collapse into the latest.
pub struct PrefixCache<V> {
    max_bytes: usize,
    block: usize,
    entries: Vec<Entry<V>>,
    clock: u64,
    stats: PrefixCacheStats,
}

/// Where a lookup found reusable KV: the entry's value and how many leading
/// tokens of the prompt it holds (a positive multiple of the block).
pub struct Hit<'c, V> {
    pub value: &'c mut V,
    pub tokens: usize,
}

impl<V> PrefixCache<V> {
    /// A cache of at most `max_bytes` (0: nothing is ever kept) in blocks of
    /// `block` tokens (at least 1).
    pub fn new(max_bytes: usize, block: usize) -> Self {
        PrefixCache { max_bytes, block: block.max(1), entries: Vec::new(), clock: 0, stats: PrefixCacheStats::default() }
    }

    pub fn block(&self) -> usize {
        self.block
    }

    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats { entries: self.entries.len(), bytes: self.bytes(), ..self.stats }
    }

    fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The prefix of `prompt` worth caching: its whole blocks.
    pub fn aligned_len(&self, prompt_len: usize) -> usize {
        prompt_len / self.block * self.block
    }

    /// The longest cached prefix of `prompt` in whole blocks, leaving at least
    /// `rest` prompt tokens to compute (at least one: its logits give the first
    /// token; the batcher leaves the backend's `pass_shared_rows().later`). Counts a lookup, and
    /// a hit when found; the entry becomes the most recently used.
    pub fn lookup(&mut self, prompt: &[u32], rest: usize) -> Option<Hit<'_, V>> {
        self.stats.lookups += 1;
        let (i, tokens) = self.best(prompt, rest)?;
        self.stats.hits += 1;
        self.stats.tokens_reused += tokens as u64;
        let now = self.tick();
        let e = &mut self.entries[i];
        e.last_used = now;
        Some(Hit { value: &mut e.value, tokens })
    }

    /// How many tokens `lookup` would reuse for `prompt` now (0: none), without
    /// counting a lookup or touching the entry.
    pub fn reusable(&self, prompt: &[u32], rest: usize) -> usize {
        self.best(prompt, rest).map_or(0, |(_, tokens)| tokens)
    }

    /// The whole blocks `prompt` may reuse from a prefix of `tokens` (another
    /// prompt's), leaving at least `rest` prompt tokens (and one) to compute.
    pub fn shared_len(&self, prompt: &[u32], tokens: &[u32], rest: usize) -> usize {
        let limit = self.aligned_len(prompt.len().saturating_sub(rest.max(1)));
        self.aligned_len(tokens.iter().zip(prompt).take(limit).take_while(|(a, b)| a == b).count())
    }

    /// The entry with the longest reusable prefix of `prompt`, and its length.
    fn best(&self, prompt: &[u32], rest: usize) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let reusable = self.shared_len(prompt, &e.tokens, rest);
            if reusable > 0 && best.is_none_or(|(_, n)| reusable > n) {
                best = Some((i, reusable));
            }
        }
        best
    }

    /// Whether an entry already holds all of `tokens` (then it becomes the most
    /// recently used, and inserting them would add nothing).
    pub fn covers(&mut self, tokens: &[u32]) -> bool {
        let now = self.clock + 1;
        match self.entries.iter_mut().find(|e| e.tokens.starts_with(tokens)) {
            Some(e) => {
                e.last_used = now;
                self.clock = now;
                true
            }
            None => false,
        }
    }

    /// Whether an entry of `bytes` could be kept at all.
    pub fn admits(&self, bytes: usize) -> bool {
        bytes > 0 && bytes <= self.max_bytes
    }

    /// Keeps `value` (the KV of `tokens`, a positive multiple of the block,
    /// `bytes` of memory) as the most recently used entry, evicting the least
    /// recently used ones until the budget holds. Entries that `tokens` extend
    /// are dropped. Returns false (and drops `value`) when it cannot be kept:
    /// `tokens` not whole blocks, larger than the budget, or already covered.
    pub fn insert(&mut self, tokens: Vec<u32>, value: V, bytes: usize) -> bool {
        if tokens.is_empty() || tokens.len() % self.block != 0 || !self.admits(bytes) || self.covers(&tokens) {
            return false;
        }
        self.entries.retain(|e| !tokens.starts_with(&e.tokens));
        while self.bytes() + bytes > self.max_bytes {
            let Some(lru) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i) else { break };
            self.entries.swap_remove(lru);
            self.stats.evictions += 1;
        }
        let last_used = self.tick();
        self.entries.push(Entry { tokens, value, bytes, last_used });
        self.stats.inserts += 1;
        true
    }

    /// Drops least recently used entries until `bytes` more fit in the budget,
    /// so an entry can be made without the cache ever holding more than its
    /// budget; false (nothing dropped) when `bytes` could never be kept.
    pub fn make_room(&mut self, bytes: usize) -> bool {
        if !self.admits(bytes) {
            return false;
        }
        while self.bytes() + bytes > self.max_bytes && self.evict_one() {}
        true
    }

    /// Drops the least recently used entry; false when there is none. For
    /// making room when the memory the entries hold is needed elsewhere.
    pub fn evict_one(&mut self) -> bool {
        let Some(lru) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i) else { return false };
        self.entries.swap_remove(lru);
        self.stats.evictions += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn lookup_finds_the_longest_whole_block_prefix_and_leaves_a_token_to_compute() {
        let mut c = PrefixCache::new(1000, 4);
        assert!(c.lookup(&ids(0..20), 1).is_none());
        assert!(c.insert(ids(0..12), "a", 10));
        // Diverging inside the third block: only the two whole blocks before it.
        let mut p = ids(0..20);
        p[9] = 99;
        assert_eq!(c.lookup(&p, 1).map(|h| (*h.value, h.tokens)), Some(("a", 8)));
        // Longer prompt with the whole entry as prefix: all of it.
        assert_eq!(c.lookup(&ids(0..20), 1).map(|h| h.tokens), Some(12));
        // The same 12 tokens as the prompt: one token must still be computed,
        // so only the blocks before the last token.
        assert_eq!(c.lookup(&ids(0..12), 1).map(|h| h.tokens), Some(8));
        assert_eq!(c.lookup(&ids(0..13), 1).map(|h| h.tokens), Some(12));
        // Diverging in the first block, or shorter than a block: nothing.
        assert!(c.lookup(&[0, 1, 7, 3, 4, 5, 6], 1).is_none());
        assert!(c.lookup(&ids(0..4), 1).is_none());
        // The longer of two matching entries wins.
        assert!(c.insert(ids(0..4).into_iter().chain([50, 51, 52, 53]).collect(), "b", 10));
        assert_eq!(c.lookup(&[0, 1, 2, 3, 50, 51, 52, 53, 9], 1).map(|h| (*h.value, h.tokens)), Some(("b", 8)));
        assert_eq!(c.lookup(&ids(0..30), 1).map(|h| (*h.value, h.tokens)), Some(("a", 12)));
        let s = c.stats();
        assert_eq!((s.lookups, s.hits, s.tokens_reused), (9, 6, 8 + 12 + 8 + 12 + 8 + 12));
        assert_eq!((s.entries, s.bytes, s.inserts), (2, 20, 2));
        // `reusable` answers as `lookup` would, without counting anything.
        for prompt in [ids(0..13), ids(0..12), ids(0..4), vec![0, 1, 2, 3, 50, 51, 52, 53, 9], ids(0..30)] {
            let want = c.lookup(&prompt, 1).map_or(0, |h| h.tokens);
            let counted = c.stats();
            assert_eq!(c.reusable(&prompt, 1), want, "{prompt:?}");
            assert_eq!(c.stats(), counted);
        }
        // Between two prompts: their common whole blocks, leaving the first one token.
        assert_eq!(c.shared_len(&ids(0..13), &ids(0..100), 1), 12);
        assert_eq!(c.shared_len(&ids(0..12), &ids(0..100), 1), 8);
        assert_eq!(c.shared_len(&ids(0..30), &ids(0..7), 1), 4);
        assert_eq!(c.shared_len(&[9, 1, 2, 3, 4], &ids(0..100), 1), 0);
        // Leaving `rest` tokens: the whole blocks before the prompt's last `rest`.
        assert_eq!(c.shared_len(&ids(0..20), &ids(0..100), 5), 12);
        assert_eq!(c.shared_len(&ids(0..20), &ids(0..100), 8), 12);
        assert_eq!(c.shared_len(&ids(0..20), &ids(0..100), 9), 8);
        assert_eq!(c.shared_len(&ids(0..20), &ids(0..100), 20), 0);
        assert_eq!(c.reusable(&ids(0..20), 9), 8);
        assert_eq!(c.lookup(&ids(0..20), 9).map(|h| h.tokens), Some(8));
        assert!(c.lookup(&ids(0..20), 17).is_none());
    }

    #[test]
    fn insert_keeps_whole_blocks_and_one_entry_per_chain() {
        let mut c = PrefixCache::new(1000, 4);
        assert!(!c.insert(ids(0..6), 1, 10), "not whole blocks");
        assert!(!c.insert(Vec::new(), 1, 10), "empty");
        assert!(c.insert(ids(0..8), 1, 10));
        assert!(!c.insert(ids(0..4), 2, 5), "covered by the entry it starts");
        assert!(c.covers(&ids(0..8)) && !c.covers(&ids(0..12)));
        // A longer prompt of the same chain replaces the shorter entry.
        assert!(c.insert(ids(0..16), 3, 20));
        assert_eq!((c.stats().entries, c.stats().bytes), (1, 20));
        assert_eq!(c.lookup(&ids(0..17), 1).map(|h| (*h.value, h.tokens)), Some((3, 16)));
    }

    #[test]
    fn eviction_drops_the_least_recently_used_until_the_budget_holds() {
        let mut c = PrefixCache::new(30, 2);
        assert!(c.insert(vec![1, 1], 'a', 10));
        assert!(c.insert(vec![2, 2], 'b', 10));
        assert!(c.insert(vec![3, 3], 'c', 10));
        // Using `a` makes `b` the least recently used.
        assert!(c.lookup(&[1, 1, 0], 1).is_some());
        assert!(c.insert(vec![4, 4], 'd', 10));
        assert!(c.lookup(&[2, 2, 0], 1).is_none(), "b was evicted");
        for p in [[1, 1, 0], [3, 3, 0], [4, 4, 0]] {
            assert!(c.lookup(&p, 1).is_some(), "{p:?}");
        }
        // `covers` touches too: `a` after it is newer than `c` and `d`.
        assert!(c.covers(&[1, 1]));
        assert!(c.insert(vec![5, 5], 'e', 20));
        assert!(c.lookup(&[1, 1, 0], 1).is_some() && c.lookup(&[3, 3, 0], 1).is_none() && c.lookup(&[4, 4, 0], 1).is_none());
        let s = c.stats();
        assert_eq!((s.entries, s.bytes, s.evictions), (2, 30, 3));
        assert!(!c.make_room(0), "an empty entry is never kept");
        // Larger than the whole budget: refused, nothing evicted.
        assert!(!c.insert(vec![6, 6], 'f', 31));
        assert_eq!(c.stats().entries, 2);
        // Room for 20 more: `e` goes (`a` was looked up after it was kept).
        assert!(c.make_room(20) && c.stats().entries == 1 && c.lookup(&[1, 1, 0], 1).is_some());
        assert!(!c.make_room(31) && c.stats().entries == 1);
        assert!(c.evict_one() && !c.evict_one());
        assert_eq!(c.stats().bytes, 0);
    }

    #[test]
    fn a_zero_budget_keeps_nothing() {
        let mut c = PrefixCache::new(0, 4);
        assert!(!c.insert(ids(0..4), (), 1));
        assert!(c.lookup(&ids(0..9), 1).is_none());
        assert_eq!(c.stats().entries, 0);
    }
}
